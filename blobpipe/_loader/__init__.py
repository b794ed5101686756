"""The async prefetching loader: Caffe's DataLayer, staged through the pool onto the device.

Pipeline (Caffe's free/full prefetch queues, FFCV's ring of slots)::

    fillers: min(workers, prefetch) loops,           consumer (async for / for)
    each in an anyio worker thread                   ──────────────────────────
    ─────────────────────────────
    slot = free.get()              ◄──── recycled ── previous batch's slot
    wait for the slot's last device event
    number + plan the next batch   (under a lock)
    fill it into the slot's host blobs (pinned on CUDA)
    push host→device on the slot's stream
    [device transform kernel on the same stream]
    post (number, slot)            ─────────────────► take batches by number,
                                                     await the slot's event,
                                                     hand out Batch (views of the slot)

One job per module:

* ``_loader``: :class:`Loader` (construction, lifecycle, the fillers' loop,
  ``__aiter__``/``__anext__``).
* ``_lifecycle``: its one state (UNOPENED, OPEN, FAILING, FAILED, CLOSED) and
  the error for each illegal move.
* ``_options``: Batches' options, defined once for the Loader's ``**options``.
* ``_ring``: the slots: buffers fitted to each batch, the free queue.
* ``_device``: a filled slot's host→device push, device transform and events.
* ``_handoff``: the numbered mailbox from the fillers to the consumer.
* the blocking form (``with``/``for``): plain filler threads, no event loop (``_loader.py``).
* ``_batch``: :class:`Batch` (views of a slot) and :class:`LoaderStatistics`.

A handed-out :class:`Batch` holds Blobs that share the slot's memory; when the
consumer asks for the next batch they are retired, so a recycled batch raises
instead of silently showing other data. :meth:`Batch.detach` keeps one.
"""

from ._batch import Batch as Batch
from ._batch import LoaderStatistics as LoaderStatistics
from ._loader import Loader as Loader

__all__ = ["Batch", "Loader", "LoaderStatistics"]
