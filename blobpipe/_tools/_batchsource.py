"""The batches that ``export`` writes and ``bench`` times.

This is the one place the tools meet the loader. ``Batches`` cannot be
imported until the reader's ``LmdbReader`` lands, so for now this walks the
records itself with the same ``Transform`` and Datum codec, as ``Batches``
does with ``order="key", mode="epoch", last="keep", phase="test"`` and a
strided shard. Swap the body of :func:`iter_batches` for ``Batches`` (and
later the async ``Loader``) and ``export``/``bench`` follow unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import DataError
from .._io._datum import decode_datum
from .._io._transform import Transform
from ._source import Records, open_records

__all__ = ["SourceBatch", "count_selected", "iter_batches", "parse_shard"]


@dataclass(frozen=True)
class SourceBatch:
    """``data`` (N, C, H, W) or NHWC, ``label`` (N,) float32, ``keys`` of the records."""

    data: npt.NDArray[Any]
    label: npt.NDArray[np.float32]
    keys: tuple[bytes, ...]


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` → ``(I, N)`` with ``0 <= I < N``; raises :class:`ValueError`."""
    try:
        index_s, count_s = text.split("/")
        index, count = int(index_s), int(count_s)
    except ValueError:
        raise ValueError(f"shard must look like I/N (e.g. 0/4), got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard I/N needs 0 <= I < N, got {text!r}")
    return index, count


def _selected(n: int, shard: tuple[int, int] | None, limit: int | None) -> int:
    index, count = shard or (0, 1)
    selected = len(range(index, n, count))
    return selected if limit is None else min(selected, limit)


def count_selected(records: Records, shard: tuple[int, int] | None, limit: int | None) -> int:
    """How many records a shard (round-robin by key order) and a limit select."""
    return _selected(len(records), shard, limit)


def iter_batches(
    db: str | os.PathLike[str],
    *,
    batch_size: int,
    transform: Transform | None = None,
    limit: int | None = None,
    shard: tuple[int, int] | None = None,
) -> Iterator[SourceBatch]:
    """One pass over the selected records in key order, TEST phase; the last batch may be short.

    Raises :class:`DataError` (naming the key) for a record that cannot be decoded
    or whose shape differs from the first one's.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tf = transform if transform is not None else Transform()
    index, count = shard or (0, 1)
    with open_records(db) as records:
        todo = count_selected(records, shard, limit)
        done = 0
        rows: list[npt.NDArray[Any]] = []
        labels: list[float] = []
        keys: list[bytes] = []
        first_shape: tuple[int, ...] | None = None
        for i, (key, value) in enumerate(records.items()):
            if done >= todo:
                break
            if i % count != index:
                continue
            chw, label = decode_datum(
                value,
                force_color=tf.force_color,
                force_gray=tf.force_gray,
                key=key,
                path=records.path,
            )
            if first_shape is None:
                first_shape = chw.shape
            elif chw.shape != first_shape:
                raise DataError(
                    f"record has shape {chw.shape}, the first record had {first_shape}; "
                    "batches need records of one size (crop with --crop-size, or convert "
                    "with --resize-height/--resize-width)",
                    key=key,
                    path=records.path,
                )
            rows.append(np.asarray(tf(chw, phase="test", index=i)))
            labels.append(float(label))
            keys.append(key)
            done += 1
            if len(rows) == batch_size or done == todo:
                yield SourceBatch(np.stack(rows), np.asarray(labels, dtype=np.float32), tuple(keys))
                rows, labels, keys = [], [], []
