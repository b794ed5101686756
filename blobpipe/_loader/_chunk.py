"""Small batches filled several at once: a chunk, straight into ring slots.

A batch of small records costs more in per-call Python (planning it, locating
its records, one kernel call, a hand-off to the consumer) than in work on its
rows. So while batches are small, each filler plans consecutive batches
together (:meth:`Batches.next_plans`, up to :data:`CHUNK_BYTES` of output,
:data:`CHUNK_ROWS` rows or :data:`CHUNK_BATCHES` batches), takes a free ring slot
for each in its chunk's turn (one wake-up per chunk), and fills them in one
:meth:`Batches.fill_parts` of their :func:`merged` plan, each batch's rows
straight into its slot: the per-call costs are paid once per chunk, nothing is
copied, and the fillers fill their chunks at once.

Invariants:

* a chunk's batches are numbered consecutively under the plan lock and posted
  in that order; chunks take their slots in number order (a chunk waits for
  its turn: every chunk planned before it has its slots), and the pipeline
  widens (every filler taking a slot before it plans) only once every chunk
  planned has its slots, so no later batch can hold the slot an earlier one
  waits for;
* a chunk is filled only into slots it holds: the rows filled ahead of the
  consumer are the ring's;
* rows are filled exactly as filling each plan alone fills them (the merged
  plan's rows are the plans' rows end to end); when the merged fill raises, the
  plans are filled one by one, so the batches before the failing one are
  delivered and the error reaches the consumer at the failing batch's number,
  naming its record.
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

from .._backends import Event
from .._io._batches import Batches, BatchPlan
from .._io._fill import Part
from .._io._kernels import Deferral, last_level_cache
from .._io._plan import merged
from ._ring import Slot

__all__ = [
    "CHUNK_BATCHES",
    "CHUNK_BYTES",
    "CHUNK_ROWS",
    "HERE_ALONE_BYTES",
    "HERE_CHUNK_BYTES",
    "RowsWritten",
    "Started",
    "chunk_batches",
    "fill_chunk",
    "planned_together",
    "pool_threads",
    "start_chunk",
    "streamed",
]

#: The most output bytes filled in one of the fillers' chunks (the ring holds two chunks'
#: slots); a batch of more than half of it goes alone (each filler fills one).
CHUNK_BYTES = 4 << 20
#: The same for the consumer's chunks (raw rows started on the row pool; the ring holds
#: three chunks' slots while it plans). A chunk's fixed costs on the consumer's thread
#: (the merged plan, locating its records, one kernel call started: about 100 µs) are
#: paid once per chunk: at 4 MiB, CIFAR's 1.2 MB batches went 3 to a chunk, and 16 MiB
#: made W2 1.11× faster (docs/performance.md, "Chunk bytes").
HERE_CHUNK_BYTES = 16 << 20
#: A batch of more output bytes than this the consumer does not chunk (the fillers fill
#: it, each one batch). Measured on both sides: batches of 3.1 MB (3×80×80 cropped to 64)
#: were 1.17× faster in the consumer's chunks than alone (3×64×64, 1.02×), batches of
#: 7 MB (3×96×96) 1.08× faster alone (4.9 MB, 3×96×96 cropped to 80: level).
HERE_ALONE_BYTES = 4 << 20
#: The most rows filled in one chunk.
CHUNK_ROWS = 1024
#: The most batches in one chunk (beyond this the per-batch costs outside the fill
#: dominate).
CHUNK_BATCHES = 16

Arrays = Part  # a slot's data, labels, geometry (as a fill's part: checked without a copy)


class Started(NamedTuple):
    """A chunk the consumer planned and started (:meth:`Pipeline.pump`)."""

    numbered: list[tuple[int, BatchPlan]]  # its batches, by number
    slots: list[Slot]  # theirs, in order
    filled: int  # how many were filled or started (those before ``error``'s batch)
    error: Exception | None  # what the next one raised
    deferral: Deferral | None  # the rows' kernel call on the pool (None: filled)
    stop: tuple[int, Any] | None  # what ended planning after them: (number, end or failure)


class RowsWritten(Event):
    """A slot's event while the pool writes its rows: completes when the deferral's
    calls ran (the close waits for it as for device work)."""

    def __init__(self, deferral: Deferral) -> None:
        self.deferral = deferral

    def query(self) -> bool:
        return self.deferral.query()

    def synchronize(self) -> None:
        self.deferral.wait()

    def wait(self, seconds: float) -> bool:
        """Wait at most ``seconds`` (the GIL released); whether the rows are written."""
        return self.deferral.wait(seconds)


def chunk_batches(plan: BatchPlan, consumer: bool = False, later: bool = False) -> int:
    """How many batches like ``plan`` one chunk holds, a fillers' chunk or the
    consumer's (``consumer``), whose limits are larger once it is past its first epoch
    (``later``: the larger ring's fresh memory is paid only by a loader that reads on;
    grown at once, the first epoch of a small database, open to close, took 1.2-2.5×
    the time: 3×48×48, 3,584 records, 53 against 21 ms). 1: no chunk;
    always for a plan with other sources read in lockstep, which go into their slots
    directly, and for a batch of more than half :data:`CHUNK_BYTES` (the consumer's,
    later: more than :data:`HERE_ALONE_BYTES`)."""
    if plan.extra:
        return 1
    nbytes = math.prod(plan.data_shape) * plan.dtype.itemsize
    grown = consumer and later
    limit = HERE_CHUNK_BYTES if grown else CHUNK_BYTES
    if grown and nbytes > HERE_ALONE_BYTES:
        return 1
    rows = max(len(plan), 1)
    return max(1, min(limit // max(nbytes, 1), CHUNK_ROWS // rows, CHUNK_BATCHES))


def pool_threads(depth: int) -> int:
    """The native threads of the consumer's row pool: one a chunk it starts at once
    (``depth``), but at most one fewer than the CPUs this process may run on. The
    consumer's thread writes rows too (a wait for a chunk's rows writes those no pool
    thread has taken yet, ``Job.synchronize``), so it needs a CPU of its own: with as
    many pool threads as CPUs (2), it waited for one (3×32×32 TEST: 18 µs a batch on
    the run queue, 37% of its time) while CPUs idled between chunks."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not Linux)
        cpus = os.cpu_count() or 1
    return max(1, min(depth, cpus - 1))


def streamed(plan: BatchPlan, slots: int) -> bool:
    """Whether the row pool writes the float32 rows of the consumer's chunks of batches
    like ``plan`` around the caches (``Pool.stream``: non-temporal stores), the ring
    holding ``slots``: where those hold more than the last-level cache. A batch is read
    only after the rows of the chunks started after it were written, so with a ring
    larger than the cache its lines have left the cache by then anyway; written through
    it, each line is read from memory before it is written, and pushes out what the
    threads work on (W2, 40 slots of 1.2 MB: 1.2x faster a batch streamed). A ring that
    fits (W1: 49 slots of 200 KB) keeps its rows cached for a consumer that reads them."""
    limit = last_level_cache()
    return limit > 0 and slots * math.prod(plan.data_shape) * plan.dtype.itemsize > limit


def planned_together(chunk: int) -> int:
    """How many batches one :meth:`Batches.next_plans` call plans while chunks hold
    ``chunk`` batches: whole chunks, at least :data:`CHUNK_BATCHES` batches (a call
    costs 10-20 µs beyond its plans: chunks of 3 batches of 3×32×32, planned a chunk
    at a time, cost 10-15 µs a plan, against 5-6 µs planned 18 at a time); 1 for a
    batch alone in its chunk (a large batch is not planned, nor read, ahead of the
    ring)."""
    return chunk * -(-CHUNK_BATCHES // chunk) if chunk > 1 else 1


def fill_chunk(
    batches: Batches, plans: list[BatchPlan], arrays: list[Arrays]
) -> tuple[int, Exception | None]:
    """Fill the consecutive ``plans`` (each of one source, no other source read in
    lockstep) into their slots' ``arrays``, in one fill of their merged plan.

    Returns how many were filled and None, or how many were filled before the plan
    whose fill raised and its error (the batches before it are filled).
    """
    one = merged(plans)
    if one is not None:
        try:
            batches.fill_parts(one, arrays)
        except Exception:  # raised again by the one-by-one fill, at its own batch
            pass
        else:
            return len(plans), None
    return _one_by_one(batches, plans, arrays)


def start_chunk(
    batches: Batches, plans: list[BatchPlan], arrays: list[Arrays], pool: Any
) -> tuple[int, Exception | None, Deferral | None]:
    """:func:`fill_chunk`, with the merged plan's kernel call started on ``pool``
    (:meth:`Batches.start_parts`): how many were filled or started, the error, and the
    deferral to finish before the data is read (None: filled in this call, one by one
    after the merged fill raised)."""
    one = merged(plans)
    if one is not None:
        try:
            return len(plans), None, batches.start_parts(one, arrays, pool)
        except Exception:  # raised again by the one-by-one fill, at its own batch
            pass
    return (*_one_by_one(batches, plans, arrays), None)


def _one_by_one(
    batches: Batches, plans: list[BatchPlan], arrays: list[Arrays]
) -> tuple[int, Exception | None]:
    for k, (plan, (data, label, geometry)) in enumerate(zip(plans, arrays, strict=True)):
        try:
            batches.fill(plan, data, label, geometry_out=geometry)
        except Exception as exc:
            return k, exc
    return len(plans), None
