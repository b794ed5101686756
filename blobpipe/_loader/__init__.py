"""The async prefetching loader: Caffe's DataLayer, staged through the pool onto the device.

Pipeline (Caffe's free/full prefetch queues, FFCV's ring of slots)::

    fillers: min(workers, prefetch) loops,           consumer (async for / for)
    each in its own plain thread                     ──────────────────────────
    ─────────────────────────────
    slot = free.get()              ◄── given back ── when nothing references a
                                                     delivered batch any more
    wait for the slot's last device event
    number + plan the next batch   (under a lock)
    fill it into the slot's host blobs (pinned on CUDA)
    push host→device on the slot's stream
    [device transform kernel on the same stream]
    post (number, slot)            ─────────────────► take batches by number,
                                                     await the slot's event,
                                                     hand out Batch (views of the slot)

One job per module:

* ``_loader``: :class:`Loader`, the facade: its arguments, the parts it builds, what
  it reports (properties, statistics, resume state).
* ``_async``: the async driver, the Loader's ``async with`` / ``async for`` form
  (anyio: awaiting batches and their device events, shielded from cancellation).
* ``_blocking``: the blocking driver, the Loader's ``with`` / ``for`` form (the
  calling thread waits, no event loop).
* ``_pipeline``: the pipeline: the ring, the fillers' threads and loop, the hand-off,
  the consumer's steps, the release, the atexit hook.
* ``_lifecycle``: its one state (UNOPENED, OPEN, FAILING, FAILED, CLOSED) and
  the error for each illegal move.
* ``_options``: the Loader's own argument checks; Batches' options, defined once
  for the Loader's ``**options``.
* ``_ring``: the slots: buffers fitted to each batch, the free queue, the
  caller's lease on a delivered slot.
* ``_device``: the device/host split of the transform; a filled slot's host→device
  push, device transform and events.
* ``_handoff``: the numbered mailbox from the fillers to the consumer.
* ``_batch``: :class:`Batch` (views of a slot).
* ``_stats``: :class:`LoaderStatistics` and the counters behind it.

A handed-out :class:`Batch` holds Blobs that share the slot's memory, and every
array or export taken from them references the slot's lease: the slot is refilled
once none of them lives, so nothing the caller keeps is overwritten.
"""

from ._batch import Batch as Batch
from ._loader import Loader as Loader
from ._stats import LoaderStatistics as LoaderStatistics

__all__ = ["Batch", "Loader", "LoaderStatistics"]
