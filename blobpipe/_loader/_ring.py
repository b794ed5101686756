"""The ring of batch slots (Caffe's free queue, FFCV's batch slots).

Invariants:

* ``prefetch`` slots are allocated once, when the loader opens, each with its
  own stream (for small batches handed over a chunk at a time the ring grows to
  ``2 * chunk + 1``, at most 33); their buffers come from the backend's pools and
  are fitted to each batch by reshaping within capacity, so a steady state
  allocates nothing. At most that much batch memory is alive: a slow consumer
  slows reading.
* A slot is refilled only after the consumer has moved past its batch (it is
  then :meth:`Ring.put` back) *and* the device work reading its host buffers
  (the staged pixels, the rows' ``geometry`` the device transform reads as is)
  has completed (its ``event``, which the filler waits for). Its device
  buffers are written again only after ``released`` (an event recorded on the
  consumer's stream when it let the batch go), which the slot's stream waits
  for: the consumer's queued work on the batch runs first.
* A slot's buffers are released only after both events completed; a buffer a
  slot lets go of while the loader runs (a batch of another shape or dtype) goes
  back to the pool ordered after ``released`` too, so no other slot or blob
  reuses it while the consumer's work may still read it.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np

from .._backends import COMPLETED, Backend, Event, Stream, wait_event
from .._blob import Blob
from .._io._batches import BatchPlan
from .._io._kernels import Geometry

__all__ = ["Ring", "Slot"]


def _fit(
    blob: Blob | None,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    backend: Backend,
    released: Event,
) -> Blob:
    """``blob`` reshaped to ``shape`` (within capacity: no allocation), or a new Blob;
    memory let go of returns to the pool only after ``released``."""
    if blob is not None and blob.dtype == dtype:
        if blob.shape != shape:
            count = int(np.prod(shape, dtype=np.int64))
            if count > blob.capacity:  # the reshape lets the old memories go
                blob.release_after(event=released)
            blob.reshape(shape)
        return blob
    if blob is not None:
        blob.release_after(event=released)
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
        # each row's crop and flip, as the host drew them, for the device transform:
        # the batch's rows (views of _rows, which holds the capacity); None without
        # a device transform
        self.geometry: Geometry | None = None
        self._rows: Geometry = Geometry.zeros(0)

    def prepare(
        self, plan: BatchPlan, out_shape: tuple[int, ...] | None
    ) -> tuple[np.ndarray, np.ndarray, Geometry | None, dict[str, np.ndarray]]:
        """Fit the slot's buffers to ``plan``; the host arrays to fill.

        ``out_shape`` is the device transform's output shape (None: no device
        transform). Returns the data and label arrays, the geometry to record each
        row's crop and flip in for the device transform (:attr:`geometry`, views of
        the slot's arrays; None without one), and the other sources' arrays by name.
        """
        backend = self.backend
        released = self.released
        self.host = _fit(self.host, plan.data_shape, plan.dtype, backend, released)
        self.label = _fit(self.label, (len(plan),), plan.label_dtype, backend, released)
        self.geometry = None
        if out_shape is not None:
            self.staged = _fit(self.staged, plan.data_shape, plan.dtype, backend, released)
            self.out = _fit(self.out, out_shape, np.dtype(np.float32), backend, released)
            if len(self._rows) < len(plan):
                self._rows = Geometry.zeros(len(plan))
            self.geometry = self._rows.take(slice(len(plan)))
        extra = {}
        for name, part in plan.extra:
            blob = self.extra[name] = _fit(
                self.extra.get(name), part.data_shape, part.dtype, backend, released
            )
            extra[name] = blob.overwrite_cpu_data()
        # every row and label is written by the fill: no zero fill, no copy back
        return self.host.overwrite_cpu_data(), self.label.overwrite_cpu_data(), self.geometry, extra

    def forget(self, stream: Stream | None = None) -> None:
        """Drop the blobs (a detached batch now owns their memory). ``stream``: the
        consumer's named stream; the detached batch's memory returns to the pool
        only after the work queued on it by then (and on the closer's current
        stream)."""
        if stream is not None:
            for blob in self.blobs():
                blob.release_after(stream=stream)
        self.host = self.label = self.staged = self.out = None
        self.extra = {}

    def blobs(self) -> list[Blob]:
        """The slot's blobs (None left out)."""
        return [
            b
            for b in (self.host, self.label, self.staged, self.out, *self.extra.values())
            if b is not None
        ]

    def device_blobs(self) -> list[Blob]:
        """The blobs whose device memory the consumer sees (data and labels)."""
        return [b for b in (self.out, self.host, self.label, *self.extra.values()) if b is not None]

    def close(self) -> None:
        self.event.synchronize()
        self.released.synchronize()
        for blob in self.blobs():
            blob.close()
        self.forget()


class Ring:
    """Slots and the queue of free ones, shared by the fillers.

    Fillers :meth:`take` a free slot (blocking) or several at once
    (:meth:`take_many`: a filler handing out a chunk of small batches); the
    consumer :meth:`put` s back the slot of a batch it moved past, waking a filler
    only once as many slots as it waits for are free; :meth:`stop` wakes every
    waiting filler with None. The ring starts with ``size`` slots and may
    :meth:`grow` (for small batches, handed over a chunk at a time).
    """

    def __init__(self, backend: Backend, size: int) -> None:
        self._backend = backend
        self._size = size
        self.slots: list[Slot] = []
        self._free: deque[Slot] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._needs: list[int] = []  # how many free slots each waiting filler needs
        self._stopped = False

    @property
    def size(self) -> int:
        """The slots the ring has now (those it was made with before it opens)."""
        with self._cond:
            return max(len(self.slots), self._size)

    def open(self) -> None:
        """Create the slots (and their streams), all free."""
        self.grow(self._size)

    def grow(self, size: int) -> None:
        """At least ``size`` slots (new ones free; their buffers come with their
        first batch)."""
        backend = self._backend
        with self._cond:
            while len(self.slots) < size:
                slot = Slot(backend, backend.create_stream() if backend.has_device else None)
                self.slots.append(slot)
                self._free.append(slot)
            self._cond.notify_all()

    def take(self) -> Slot | None:
        """A free slot, waiting for one; None once :meth:`stop` was called."""
        got = self.take_many(1)
        return got[0] if got else None

    def take_many(self, n: int) -> list[Slot] | None:
        """``n`` free slots (at most the ring's size), waiting until that many are
        free; None once :meth:`stop` was called."""
        with self._cond:
            n = max(1, min(n, len(self.slots)))
            if len(self._free) < n and not self._stopped:
                self._needs.append(n)
                try:
                    while len(self._free) < n and not self._stopped:
                        self._cond.wait()
                finally:
                    self._needs.remove(n)
            if self._stopped:
                return None
            return [self._free.popleft() for _ in range(n)]

    def put(self, slot: Slot) -> None:
        """Give a slot back to the fillers."""
        with self._cond:
            self._free.append(slot)
            if self._needs and len(self._free) >= min(self._needs):
                self._cond.notify_all()

    def put_many(self, slots: list[Slot]) -> None:
        """Give slots back to the fillers (those a filler took and did not fill)."""
        for slot in slots:
            self.put(slot)

    def stop(self) -> None:
        """Wake every filler waiting in :meth:`take` (they get None), and every later
        call of it."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

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
