"""Several databases as one: record ``i`` of the whole is record ``i - start[k]`` of
database ``k``, in the order the databases were given.

:class:`ConcatFiller` is a ``_fill.RowFiller``, as ``_fill.Filler`` is, and hands each
database its own rows: a run of rows from one database is filled straight into
the batch, rows of several databases interleaved (a shuffled order) are filled
per database into a scratch block and scattered. Each database keeps its own
record index, so every row still comes from a mapped file where it can.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ._fill import Filler, Part, store_geometry
from ._kernels import Deferral, Geometry
from ._plan import BatchPlan
from ._records import RecordKind
from ._transform import Transform

__all__ = ["ConcatFiller"]


class ConcatFiller:
    """Fills rows of a plan over several databases, each with its own :class:`Filler`."""

    def __init__(self, parts: Sequence[Filler], lengths: Sequence[int]) -> None:
        self._parts = list(parts)
        self._starts = np.cumsum([0, *lengths], dtype=np.int64)
        self.kind: RecordKind = self._parts[0].kind
        self.blob_dtype: np.dtype[Any] = self._parts[0].blob_dtype

    @property
    def transform(self) -> Transform:
        return self._parts[0].transform

    def close(self) -> None:
        for part in self._parts:
            part.close()

    def _where(self, index: int) -> tuple[int, int]:
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        return k, index - int(self._starts[k])

    def output(self, record_shape: tuple[int, ...], key: bytes) -> tuple[tuple[int, ...], Any]:
        return self._parts[0].output(record_shape, key)

    def uniform_shape(self) -> tuple[int, ...] | None:
        """Every part's, when they are one."""
        shapes = {part.uniform_shape() for part in self._parts}
        return shapes.pop() if len(shapes) == 1 else None

    def learn(self, indices: npt.NDArray[np.int64], ahead: npt.NDArray[np.int64]) -> None:
        """Each part learns its rows of ``indices`` (and of ``ahead``)."""
        which = np.searchsorted(self._starts, indices, side="right") - 1
        after = np.searchsorted(self._starts, ahead, side="right") - 1
        for k in np.unique(which).tolist():
            start = self._starts[k]
            self._parts[k].learn(indices[which == k] - start, ahead[after == k] - start)

    def first(self, index: int) -> tuple[tuple[int, ...], tuple[np.ndarray, int] | None]:
        k, local = self._where(index)
        return self._parts[k].first(local)

    def fill(
        self, plan: BatchPlan, start: int, parts: Sequence[Part], defer: Deferral | None = None
    ) -> None:
        """Rows of ``plan`` from ``start`` on into ``parts``, each row from its own
        database, in this call (``defer`` is not used)."""
        for part in parts:
            self._fill_part(plan, start, part)
            start += len(part.label)

    def _fill_part(self, plan: BatchPlan, start: int, part: Part) -> None:
        indices = plan.indices[start : start + len(part.label)]
        which = np.searchsorted(self._starts, indices, side="right") - 1
        for k in np.unique(which).tolist():
            rows = np.flatnonzero(which == k)  # relative to start: the part's rows
            sub = plan.take(start + rows, indices[rows] - self._starts[k])
            n = len(rows)
            first, last = int(rows[0]), int(rows[-1])
            if last - first + 1 == n:  # one run: straight into the part
                a, b = first, first + n
                run = part.geometry.take(slice(a, b)) if part.geometry is not None else None
                self._parts[k].fill(sub, 0, [Part(part.data[a:b], part.label[a:b], run)])
                continue
            data = np.empty((n, *part.data.shape[1:]), part.data.dtype)
            label = np.empty(n, part.label.dtype)
            geometry = Geometry.zeros(n) if part.geometry is not None else None
            self._parts[k].fill(sub, 0, [Part(data, label, geometry)])
            part.data[rows] = data
            part.label[rows] = label
            if part.geometry is not None and geometry is not None:
                store_geometry(part.geometry, rows, geometry)
