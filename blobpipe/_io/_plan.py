"""What one batch will hold: the plan that :meth:`Batches.next_plan` makes and
:meth:`Batches.fill` (any number of threads, disjoint row ranges) carries out."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["BatchPlan"]


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """What one batch will hold; made by :meth:`Batches.next_plan`.

    Row ``i`` is record ``keys[i]`` (global index ``indices[i]``, from epoch
    ``epochs[i]`` at position ``positions[i]`` of that epoch's order for this
    shard), transformed with random word ``words[i]``. Rows ``>= valid`` are
    padding (``last="pad"``): repeats of the epoch's first records.

    Attributes:
        keys, indices, epochs, positions, words: one entry per row.
        valid: the number of real (non-padding) rows.
        record_shape: the first record's ``(C, H, W)`` before the transform (a
            BlobProto record's own shape).
        data_shape: the batch array's shape, ``(N, C, h, w)`` or ``(N, h, w, C)``
            (``(N, *shape)`` for BlobProto records).
        dtype: the batch array's dtype (float32, or uint8 for raw pixels; float64
            for BlobProto records on request).
        label_dtype: the labels' dtype (float32, as Caffe, or int64).
        state: the resume state after this batch (see :meth:`Batches.state_dict`).
        name: the source's name (``"data"`` for a single database).
        has_label: whether the records carry labels (Datums do, BlobProtos not).
        extra: the other sources read in lockstep, as ``(name, plan)``: the same
            rows (keys, indices, epochs, positions), with their own shapes,
            element types and random words.
    """

    keys: tuple[bytes, ...]
    indices: tuple[int, ...]
    epochs: tuple[int, ...]
    positions: tuple[int, ...]
    words: tuple[int, ...]
    valid: int
    record_shape: tuple[int, ...]
    data_shape: tuple[int, ...]
    dtype: np.dtype[Any]
    state: dict[str, Any]
    label_dtype: np.dtype[Any] = field(default=np.dtype(np.float32))
    name: str = "data"
    has_label: bool = True
    extra: tuple[tuple[str, BatchPlan], ...] = ()
    _first: tuple[np.ndarray, int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.keys)

    def decoded_first(self) -> tuple[np.ndarray, int] | None:
        """Row 0's pixels (values) and label when :meth:`Batches.next_plan` had to
        decode them to learn the batch's shape (the fill then uses them), else None."""
        return self._first

    def take(self, rows: Sequence[int], indices: Sequence[int]) -> BatchPlan:
        """The plan of rows ``rows`` alone, with global indices ``indices`` instead (a
        database's own, for the databases of one source); keeps row 0's decoded
        pixels when it is among them, first."""
        return dataclasses.replace(
            self,
            keys=tuple(self.keys[r] for r in rows),
            indices=tuple(indices),
            epochs=tuple(self.epochs[r] for r in rows),
            positions=tuple(self.positions[r] for r in rows),
            words=tuple(self.words[r] for r in rows),
            valid=len(rows),
            data_shape=(len(rows), *self.data_shape[1:]),
            extra=(),
            _first=self._first if rows[0] == 0 else None,
        )

    @property
    def epoch(self) -> int:
        """The epoch of the first row."""
        return self.epochs[0]
