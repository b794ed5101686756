"""The batches that ``export`` writes and ``bench`` times.

Both read the io layer's :class:`~blobpipe.Batches` as Caffe's DataLayer does
in the TEST phase: key order, one epoch at a time, the last batch kept short,
and an optional strided shard (record ``i`` goes to rank ``i % world``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from .._io._batches import Batches
from .._io._transform import Transform
from ._output import open_database

__all__ = ["open_batches"]


@contextmanager
def open_batches(
    db: str | os.PathLike[str],
    *,
    batch_size: int,
    transform: Transform | None = None,
    shard: tuple[int, int] | None = None,
) -> Iterator[Batches]:
    """TEST-phase ``Batches`` over ``db`` in key order; each iteration is one epoch.

    Raises :class:`DatabaseNotFoundError` (naming an unfinished ``.partial``
    conversion when there is one), :class:`DataError` for an empty database or
    shard, and :class:`ValueError` for bad options; iterating raises
    :class:`DataError` (naming the key) for a record that cannot be decoded or
    does not fit the batch.
    """
    with (
        open_database(db) as reader,
        Batches(
            reader,
            batch_size,
            transform=transform,
            phase="test",
            order="key",
            mode="epoch",
            last="keep",
            shard=shard,
            pad_shards=False,  # a shard of the dataset: each of its records once
        ) as batches,
    ):
        yield batches
