"""What one batch will hold: the plan that :meth:`Batches.next_plan` makes and
:meth:`Batches.fill` (any number of threads, disjoint row ranges) carries out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["BatchPlan", "joined", "read_only"]

_A = TypeVar("_A", bound="np.ndarray[Any, Any]")
_T = TypeVar("_T", bound=np.generic)


def read_only(array: _A) -> _A:
    """``array``, made read-only (``flags.writeable = False``) in place."""
    array.setflags(write=False)
    return array


def joined(parts: list[npt.NDArray[_T]]) -> npt.NDArray[_T]:
    """``parts`` end to end as one read-only array (the one part itself when alone)."""
    return read_only(parts[0] if len(parts) == 1 else np.concatenate(parts))


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """What one batch will hold; made by :meth:`Batches.next_plan`.

    Row ``i`` is record ``keys[i]`` (global index ``indices[i]``, from epoch
    ``epochs[i]`` at position ``positions[i]`` of that epoch's order for this
    shard), transformed with random word ``words[i]``. Rows ``>= valid`` are
    padding (``last="pad"``): repeats of the epoch's first records.

    Attributes:
        keys: one key (bytes) per row, a tuple.
        indices, epochs, positions: one entry per row, read-only int64 arrays.
        words: one random word per row, a read-only uint64 array (all 0 when
            nothing is random).
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
        first_decoded: row 0's pixels (``(C, H, W)``; a BlobProto's values) and
            label when :meth:`Batches.next_plan` had to decode them to learn the
            batch's shape (filling row 0 then uses them), else None.
    """

    keys: tuple[bytes, ...]
    indices: npt.NDArray[np.int64]
    epochs: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    words: npt.NDArray[np.uint64]
    valid: int
    record_shape: tuple[int, ...]
    data_shape: tuple[int, ...]
    dtype: np.dtype[Any]
    state: dict[str, Any]
    label_dtype: np.dtype[Any] = field(default=np.dtype(np.float32))
    name: str = "data"
    has_label: bool = True
    extra: tuple[tuple[str, BatchPlan], ...] = ()
    first_decoded: tuple[np.ndarray, int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, rows: npt.ArrayLike, indices: npt.ArrayLike) -> BatchPlan:
        """The plan of rows ``rows`` alone, with global indices ``indices`` instead (a
        database's own, for the databases of one source); keeps row 0's decoded
        pixels when it is among them, first."""
        at = np.asarray(rows, np.intp)
        return dataclasses.replace(
            self,
            keys=tuple(self.keys[r] for r in at.tolist()),
            indices=read_only(np.array(indices, np.int64)),
            epochs=read_only(self.epochs[at]),
            positions=read_only(self.positions[at]),
            words=read_only(self.words[at]),
            valid=len(at),
            data_shape=(len(at), *self.data_shape[1:]),
            extra=(),
            first_decoded=self.first_decoded if at[0] == 0 else None,
        )

    @property
    def epoch(self) -> int:
        """The epoch of the first row."""
        return int(self.epochs[0])
