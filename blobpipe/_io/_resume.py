"""Resume states: what :meth:`Batches.state_dict` writes, and the checks a state
passes before :meth:`Batches.load_state_dict` seeks to it.

A state is plain JSON types (the record key a str: bytes that are not UTF-8 as
``surrogateescape`` surrogates); states holding the key as bytes are accepted too.
Its fields are the cursor (:data:`CURSOR`: epoch, position, and the key of the record
there) and what makes the order (seed, order, buffer size, shard, shard mode,
padding, ranks per node, record count); :func:`check_state` compares every field
:func:`make_state` writes outside the cursor, so a field added there is compared
too. One exception, for states of older versions: ``pad_shards`` changes nothing
unsharded and is not compared there, and a state without it was saved with False.
Fields it does not write are ignored.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import ArgumentError, ArgumentTypeError, DataError

__all__ = ["CURSOR", "STATE_VERSION", "check_state", "make_state", "state_sources"]

STATE_VERSION = 1
MAX_EPOCH = 2**62  # an epoch, and the ones after it, fit the int64 the draws take
# The fields that say where a state stands; all others say how the order is made.
CURSOR = ("epoch", "position", "key")


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


def state_sources(
    keys: Sequence[bytes],
    settings: Mapping[str, Any],
    shard: tuple[int, int],
    order_of: Callable[[int], npt.NDArray[np.int64]],
    places: list[tuple[int, int]],
) -> list[Callable[[], dict[str, Any]]]:
    """What makes the state at each ``(epoch, pos)`` of ``places`` later (a plan's
    ``state_source``), also once the Batches is closed (a kept batch's ``state``): the
    records' indices are looked up now in ``order_of(epoch)`` (one gather for each run
    of places in one epoch), their keys when asked. Each a ``functools.partial``: made
    without a Python call, once a batch."""
    if len(places) == 1:  # next_plan: once a batch, as Batches alone plans
        epoch, pos = places[0]
        return [
            functools.partial(
                _state_at, keys, settings, shard, epoch, pos, int(order_of(epoch)[pos])
            )
        ]
    out: list[Callable[[], dict[str, Any]]] = []
    i = 0
    while i < len(places):
        epoch, j = places[i][0], i + 1
        while j < len(places) and places[j][0] == epoch:
            j += 1
        positions = [pos for _, pos in places[i:j]]
        order = order_of(epoch)
        indices = [int(order[positions[0]])] if j == i + 1 else order[positions].tolist()
        out += [
            functools.partial(_state_at, keys, settings, shard, epoch, p, x)
            for p, x in zip(positions, indices, strict=True)
        ]
        i = j
    return out


def _state_at(
    keys: Sequence[bytes],
    settings: Mapping[str, Any],
    shard: tuple[int, int],
    epoch: int,
    pos: int,
    index: int,
) -> dict[str, Any]:
    """The state at ``pos`` of ``epoch``, whose record is ``index`` (key looked up now)."""
    return make_state(epoch, pos, keys[index], settings, shard)


def _plain(value: Any) -> Any:
    """``value`` in a form where two values compare equal only when one could stand for
    the other in a state: a bool is not an int, an int not a float, a list of the
    shard the same as a tuple, NumPy's integers Python's."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, bytes, float)):
        return (type(value).__name__, value)
    if isinstance(value, (list, tuple)):
        return ("sequence", tuple(_plain(v) for v in value))
    try:
        return ("int", operator.index(value))
    except TypeError:
        return ("other", repr(value))


def _cursor_integer(state: Mapping[str, Any], name: str) -> int:
    value = state[name]
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return operator.index(value)


def check_state(
    state: Mapping[str, Any],
    *,
    settings: Mapping[str, Any],
    shard: tuple[int, int],
    shard_len: int,
    path: object,
) -> tuple[int, int, bytes]:
    """``(epoch, position, key)`` of ``state``, once it is known to fit: every field
    :func:`make_state` writes from ``settings`` (how the order is made and the record
    count, as :meth:`Batches.state_dict` passes them) and ``shard`` equal, and a
    position inside the shard.

    Raises:
        ArgumentTypeError: ``state`` is not a mapping.
        ArgumentError: the state is malformed, of another version, or was saved for
            another shard or with other settings; its epoch or position is out of range.
        DataError: the database has another record count than when it was saved.
    """
    if not isinstance(state, Mapping):
        raise ArgumentTypeError(
            f"a resume state is a dict from state_dict(), got {type(state).__name__}"
        )
    try:
        version = state["version"]
        epoch, pos = _cursor_integer(state, "epoch"), _cursor_integer(state, "position")
        key = state["key"]
        if isinstance(key, str):
            key = key.encode("utf-8", "surrogateescape")
        elif not isinstance(key, bytes):
            raise TypeError(f"key must be a str or bytes, got {type(key).__name__}")
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ArgumentError(
            f"malformed resume state {state!r}: {exc!r}; pass a state from state_dict()"
        ) from exc
    if _plain(version) != _plain(STATE_VERSION):
        raise ArgumentError(
            f"unsupported resume state version {version!r} (this blobpipe writes and "
            f"reads version {STATE_VERSION})"
        )
    expected = make_state(epoch, pos, key, settings, shard)
    # the shard first (the likeliest mix-up), the record count last (a DataError)
    names = sorted(expected, key=lambda name: (name != "shard", name == "num_records"))
    for name in names:
        want = expected[name]
        if name in CURSOR or name == "version":
            continue
        if name == "pad_shards" and shard[1] == 1:
            continue  # unsharded, padding changes nothing
        if name in state:
            got = state[name]
        elif name == "pad_shards":
            got = False
        else:
            raise ArgumentError(
                f"malformed resume state: it has no {name!r}, which state_dict() writes "
                f"(it writes {', '.join(sorted(expected))}); pass a state from state_dict()"
            )
        if _plain(got) == _plain(want):
            continue
        if name == "shard":
            shown = tuple(got) if isinstance(got, (list, tuple)) else got
            raise ArgumentError(
                f"the state was saved for shard {shown!r} but this one is shard "
                f"{tuple(want)}; resume each rank from its own state"
            )
        if name == "num_records":
            raise DataError(
                f"the dataset changed: the state was saved with {got!r} records, the "
                f"database now has {want} (the state's num_records); resume from a state "
                "of this database, or start afresh",
                path=path,
            )
        raise ArgumentError(
            f"the state was saved with {name}={got!r}, but {name}={want!r} was given; "
            "resume with the options the state was saved with"
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
