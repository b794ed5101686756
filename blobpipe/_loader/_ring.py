"""The ring of batch slots (Caffe's free queue, FFCV's batch slots).

Invariants:

* ``prefetch`` slots are allocated once, when the loader opens, each with its
  own stream; their buffers come from the backend's pools and are fitted to
  each batch by reshaping within capacity, so a steady state allocates nothing.
  At most that much batch memory is alive: a slow consumer slows reading.
* A slot is refilled only after the consumer has moved past its batch (it is
  then :meth:`Ring.put` back) *and* the device work reading its host buffers
  has completed (its ``event``, which the filler waits for). Its device
  buffers are written again only after ``released`` (an event recorded on the
  consumer's stream when it let the batch go), which the slot's stream waits
  for: the consumer's queued work on the batch runs first.
* A slot's buffers are released only after both events completed.
"""

from __future__ import annotations

import queue
from typing import Any

import numpy as np
import numpy.typing as npt

from .._backends import COMPLETED, Backend, Event, Stream, wait_event
from .._blob import Blob
from .._io._batches import BatchPlan

__all__ = ["Ring", "Slot"]


def _fit(blob: Blob | None, shape: tuple[int, ...], dtype: np.dtype[Any], backend: Backend) -> Blob:
    """``blob`` reshaped to ``shape`` (within capacity: no allocation), or a new Blob."""
    if blob is not None and blob.dtype == dtype:
        if blob.shape != shape:
            blob.reshape(shape)
        return blob
    if blob is not None:
        blob.close()
    return Blob(shape, dtype, backend=backend)


class Slot:
    """One ring slot: host staging blobs, device blobs, a stream, the last event."""

    def __init__(self, backend: Backend, stream: Stream | None) -> None:
        self.backend = backend
        self.stream = stream
        self.event: Event = COMPLETED  # completes after the slot's last device work
        # completes after the consumer's device work queued before it let the batch go
        self.released: Event = COMPLETED
        self.started: Event | None = None  # timing event before that work
        self.host: Blob | None = None  # data as filled on the host (pinned)
        self.label: Blob | None = None  # labels (pushed to the device too)
        self.staged: Blob | None = None  # device copy of ``host`` (device transform)
        self.out: Blob | None = None  # device transform output (float32)
        self.extra: dict[str, Blob] = {}  # other sources read in lockstep, by name
        self.params: npt.NDArray[np.int32] = np.zeros((0, 3), np.int32)

    def prepare(
        self, plan: BatchPlan, out_shape: tuple[int, ...] | None
    ) -> tuple[np.ndarray, np.ndarray, npt.NDArray[np.int32] | None, dict[str, np.ndarray]]:
        """Fit the slot's buffers to ``plan``; the host arrays to fill.

        ``out_shape`` is the device transform's output shape (None: no device
        transform). Returns the data and label arrays, the per-row crop
        parameters to record for the device transform (None without one), and
        the other sources' arrays by name.
        """
        backend = self.backend
        self.host = _fit(self.host, plan.data_shape, plan.dtype, backend)
        self.label = _fit(self.label, (len(plan),), plan.label_dtype, backend)
        params = None
        if out_shape is not None:
            self.staged = _fit(self.staged, plan.data_shape, plan.dtype, backend)
            self.out = _fit(self.out, out_shape, np.dtype(np.float32), backend)
            if self.params.shape[0] < len(plan):
                self.params = np.zeros((len(plan), 3), np.int32)
            params = self.params[: len(plan)]
        extra = {}
        for name, part in plan.extra:
            blob = self.extra[name] = _fit(
                self.extra.get(name), part.data_shape, part.dtype, backend
            )
            extra[name] = blob._overwrite_cpu_data()
        # every row and label is written by the fill: no zero fill, no copy back
        return self.host._overwrite_cpu_data(), self.label._overwrite_cpu_data(), params, extra

    def forget(self) -> None:
        """Drop the blobs (a detached batch now owns their memory)."""
        self.host = self.label = self.staged = self.out = None
        self.extra = {}

    def close(self) -> None:
        self.event.synchronize()
        self.released.synchronize()
        for blob in (self.host, self.label, self.staged, self.out, *self.extra.values()):
            if blob is not None:
                blob.close()
        self.forget()


class Ring:
    """``size`` slots and the queue of free ones, shared by the fillers.

    Fillers :meth:`take` a free slot (blocking), the consumer :meth:`put` s
    back the slot of a batch it moved past; :meth:`stop` wakes every waiting
    filler with ``None``.
    """

    def __init__(self, backend: Backend, size: int) -> None:
        self._backend = backend
        self._size = size
        self.slots: list[Slot] = []
        self._free: queue.SimpleQueue[Slot | None] = queue.SimpleQueue()

    def open(self) -> None:
        """Create the slots (and their streams), all free."""
        backend = self._backend
        for _ in range(self._size):
            slot = Slot(backend, backend.create_stream() if backend.has_device else None)
            self.slots.append(slot)
            self._free.put(slot)

    def take(self) -> Slot | None:
        """A free slot, waiting for one; None once :meth:`stop` was called."""
        return self._free.get()

    def take_nowait(self) -> Slot | None:
        """A free slot if one is waiting, else None (never a filler's stop signal)."""
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            return None
        if slot is None:  # a stop signal: it is a filler's
            self._free.put(None)
        return slot

    def put(self, slot: Slot) -> None:
        """Give a slot back to the fillers."""
        self._free.put(slot)

    def stop(self, fillers: int) -> None:
        """Wake ``fillers`` fillers waiting in :meth:`take` (they get None)."""
        for _ in range(fillers):
            self._free.put(None)

    async def settle(self) -> None:
        """Wait until no device work (the slot's or the consumer's) uses any slot's buffers."""
        for slot in self.slots:
            await wait_event(slot.event)
            await wait_event(slot.released)

    def close(self) -> None:
        """Release every slot's buffers (after its device work completed)."""
        for slot in self.slots:
            slot.close()
        self.slots.clear()
