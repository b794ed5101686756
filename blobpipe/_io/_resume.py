"""Resume states: what :meth:`Batches.state_dict` writes, and the checks a state
passes before :meth:`Batches.load_state_dict` seeks to it.

A state is plain JSON types (the record key a str: bytes that are not UTF-8 as
``surrogateescape`` surrogates); states holding the key as bytes are accepted too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._errors import ArgumentError, DataError

__all__ = ["STATE_VERSION", "check_state", "make_state"]

STATE_VERSION = 1
MAX_EPOCH = 2**62  # an epoch, and the ones after it, fit the int64 the draws take


def make_state(
    epoch: int, pos: int, key: bytes, settings: Mapping[str, Any], shard: tuple[int, int]
) -> dict[str, Any]:
    """The state that resumes at position ``pos`` of epoch ``epoch`` (record ``key``)."""
    return {
        "version": STATE_VERSION,
        "epoch": epoch,
        "position": pos,
        "key": bytes(key).decode("utf-8", "surrogateescape"),
        **settings,
        "shard": [shard[0], shard[1]],
    }


def check_state(
    state: Mapping[str, Any],
    *,
    shard: tuple[int, int],
    settings: Mapping[str, Any],
    num_records: int,
    shard_len: int,
    path: object,
) -> tuple[int, int, bytes]:
    """``(epoch, position, key)`` of ``state``, once it is known to fit: this shard,
    these order settings, this record count, a position inside the shard.

    Raises:
        ArgumentError: the state is malformed, of another version, or was saved for
            another shard or with other settings; its epoch or position is out of range.
        DataError: the database has another record count than when it was saved.
    """
    try:
        version = state["version"]
        epoch, pos, key = int(state["epoch"]), int(state["position"]), state["key"]
        if isinstance(key, str):
            key = key.encode("utf-8", "surrogateescape")
        saved = {k: state[k] for k in ("seed", "order", "buffer_size", "shard_mode")}
        saved_shard = tuple(state["shard"])
        pad = state.get("pad_shards", False)
        saved["pad_shards"] = pad if saved_shard[1] > 1 else False
        n = int(state["num_records"])
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
        raise ArgumentError(f"malformed resume state {state!r}: {exc!r}") from exc
    if version != STATE_VERSION:
        raise ArgumentError(f"unsupported resume state version {version!r}")
    if saved_shard != shard:
        raise ArgumentError(
            f"the state was saved for shard {saved_shard} but this one is shard {shard}"
        )
    for name, value in saved.items():
        if settings[name] != value:
            raise ArgumentError(
                f"the state was saved with {name}={value!r}, but {name}={settings[name]!r} "
                "was given; resume with the options the state was saved with"
            )
    if n != num_records:
        raise DataError(
            f"the dataset changed: the state was saved with {n} records, the database "
            f"now has {num_records}",
            path=path,
        )
    if not 0 <= epoch <= MAX_EPOCH:
        raise ArgumentError(
            f"the state's epoch {epoch} is out of range: epochs count from 0 to "
            f"2**62 (the random draws take the epoch as a 64-bit integer); pass a "
            "state saved by state_dict()"
        )
    if not 0 <= pos < shard_len:
        raise ArgumentError(
            f"the state's epoch {epoch} / position {pos} is out of range "
            f"(this shard has {shard_len} records per epoch)"
        )
    return epoch, pos, bytes(key)
