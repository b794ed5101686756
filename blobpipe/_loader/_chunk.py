"""Small batches filled several at once: a chunk, handed to ring slots together.

A batch of small records costs more in per-call Python (planning it, locating
its records, one kernel call) than in work on its rows. So while batches are
small, each filler plans consecutive batches together (:meth:`Batches.next_plans`,
up to :data:`CHUNK_BYTES` of output, :data:`CHUNK_ROWS` rows or
:data:`CHUNK_BATCHES` batches, each batch at most :data:`CHUNK_BATCH_BYTES`),
fills them in one :meth:`Batches.fill` of their :func:`merged` plan into a
scratch array, waits for its chunk's turn and until the ring has a free slot
for each (one wake-up per chunk), and copies each batch's rows into its slot:
the per-call costs are paid once per chunk, the copy is a memcpy of the batch,
and the fillers fill their chunks at once.

Invariants:

* a chunk's batches are numbered consecutively under the plan lock and posted
  in that order; chunks take their slots in number order (a chunk waits for
  its :attr:`Chunk.turn`: every chunk planned before it handed out), and the
  pipeline widens (every filler taking a slot before it plans) only once every
  chunk planned is handed out, so no later batch can hold the slot an earlier
  one waits for;
* the rows filled ahead of the ring are at most one chunk per filler;
* rows are filled exactly as filling each plan alone fills them (the merged
  plan's rows are the plans' rows end to end); when the merged fill raises, the
  plans are filled one by one, so the batches before the failing one are
  delivered and the error reaches the consumer at the failing batch's number,
  naming its record.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from .._io._batches import Batches, BatchPlan
from .._io._kernels import Geometry
from .._io._plan import merged

__all__ = [
    "CHUNK_BATCHES",
    "CHUNK_BATCH_BYTES",
    "CHUNK_BYTES",
    "CHUNK_ROWS",
    "Chunk",
    "chunk_batches",
]

#: The most output bytes filled in one chunk (beyond the ring's slots).
CHUNK_BYTES = 2 << 20
#: The most rows filled in one chunk.
CHUNK_ROWS = 1024
#: The most batches in one chunk (beyond this the per-batch costs outside the fill
#: dominate).
CHUNK_BATCHES = 16
#: The largest batch (output bytes) a chunk takes. A chunk saves each batch its
#: per-call costs (tens of µs, whatever its size) and costs it a copy into its slot
#: (about 0.16 µs a KiB on the benchmark machine); above this the copy costs more
#: than it saves, and each filler fills one batch at a time straight into its slot
#: (measured both sides: docs/performance.md).
CHUNK_BATCH_BYTES = 512 << 10


def chunk_batches(plan: BatchPlan) -> int:
    """How many batches like ``plan`` one chunk holds (1: no chunk; always for a plan
    with other sources read in lockstep, which go into their slots directly, and for
    a batch of more than :data:`CHUNK_BATCH_BYTES`)."""
    if plan.extra:
        return 1
    nbytes = math.prod(plan.data_shape) * plan.dtype.itemsize
    if nbytes > CHUNK_BATCH_BYTES:
        return 1
    rows = max(len(plan), 1)
    return max(1, min(CHUNK_BYTES // max(nbytes, 1), CHUNK_ROWS // rows, CHUNK_BATCHES))


class Chunk:
    """Batches filled ahead: each one's number, plan and rows of the scratch arrays."""

    def __init__(self) -> None:
        # (number, plan, data rows, label rows, geometry rows)
        self._left: deque[tuple[int, BatchPlan, np.ndarray, np.ndarray, Geometry]] = deque()
        # the number the chunk was planned from: its place in the order chunks take
        # slots in (the pipeline's), until its last batch is handed out
        self.turn = 0

    def __len__(self) -> int:
        """Batches filled and not handed to a slot yet."""
        return len(self._left)

    def clear(self) -> None:
        self._left.clear()

    def fill(self, batches: Batches, numbered: list[tuple[int, BatchPlan]]) -> Exception | None:
        """Fill the consecutive plans ``numbered`` (``(number, plan)``, each of one
        source, no other source read in lockstep) into new scratch arrays, keeping
        each batch's rows for :meth:`next`.

        Returns None, or the error filling one of them raised: the batches before
        it are kept, it and those after it are not (the caller posts the error
        at the number of the batch after the kept ones).
        """
        plans = [plan for _, plan in numbered]
        one = merged(plans)
        if one is not None:
            arrays = _scratch(one)
            if _filled(batches, one, arrays):
                start = 0
                for number, plan in numbered:
                    self._keep(number, plan, arrays, start)
                    start += len(plan)
                return None
        for number, plan in numbered:  # one by one: where a batch fails, stop
            arrays = _scratch(plan)
            try:
                batches.fill(plan, *arrays[:2], geometry_out=arrays[2])
            except Exception as exc:
                return exc
            self._keep(number, plan, arrays, 0)
        return None

    def _keep(
        self,
        number: int,
        plan: BatchPlan,
        arrays: tuple[np.ndarray, np.ndarray, Geometry],
        start: int,
    ) -> None:
        rows = slice(start, start + len(plan))
        data, label, geometry = arrays
        self._left.append((number, plan, data[rows], label[rows], geometry.take(rows)))

    def next(self) -> tuple[int, BatchPlan]:
        """The next batch's number and plan (the chunk is not empty); its rows then
        go into a slot's arrays with :meth:`copy_into`."""
        number, plan = self._left[0][:2]
        return number, plan

    def copy_into(self, data: np.ndarray, label: np.ndarray, geometry: Geometry | None) -> None:
        """Copy the batch :meth:`next` named into a slot's arrays, and drop it."""
        _, _, rows, labels, geom = self._left.popleft()
        np.copyto(data, rows)
        np.copyto(label, labels)
        if geometry is not None:
            for mine, theirs in zip(geometry.arrays(), geom.arrays(), strict=True):
                np.copyto(mine, theirs)


def _filled(batches: Batches, plan: BatchPlan, arrays: tuple[Any, Any, Geometry]) -> bool:
    """Whether ``plan`` filled into ``arrays`` without an error (a merged plan's
    error is raised again by the one-by-one fill that places it)."""
    try:
        batches.fill(plan, *arrays[:2], geometry_out=arrays[2])
    except Exception:
        return False
    return True


def _scratch(plan: BatchPlan) -> tuple[Any, Any, Geometry]:
    """New arrays for a fill of ``plan``: data, labels, each row's crop and flip."""
    n = len(plan)
    return (
        np.empty(plan.data_shape, plan.dtype),
        np.empty(n, plan.label_dtype),
        Geometry.zeros(n),
    )
