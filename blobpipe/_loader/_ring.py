"""The ring of batch slots (Caffe's free queue, FFCV's batch slots), and the caller's
:class:`Lease` on a delivered one.

Invariants:

* A delivered slot is the caller's while anything handed out for its batch lives:
  the :class:`~blobpipe.Batch`, its Blobs, their host and device arrays and DLPack
  exports all reference the slot's :class:`Lease`, and nothing of the loader does.
  The lease's end (CPython frees it with its last reference; a reference cycle
  when the collector runs) gives the slot back: a slot is refilled only when
  nothing the caller can reach shows its buffers.
* The ring has ``size + 1`` slots: ``size`` (``prefetch``; for small batches
  handed over a chunk at a time it grows to ``2 * chunk + 1``, at most 33; to
  ``3 * chunk + 1``, at most 49 and 48 MiB and a batch, while the consumer plans
  them) for the
  batches filled ahead and the one the caller is on, and one for the previous
  batch, which a loop variable still holds while the next one is asked for. A
  loop that keeps nothing therefore never waits for its own memory and allocates
  nothing once every slot was filled. Each further batch the caller holds gets a
  new slot when a filler needs one, so the fillers never wait for memory the
  caller keeps; when the caller lets such batches go, the ring shrinks back to
  ``size + 1`` (the other slots' buffers go back to the pool).
* Buffers come from the backend's pools and are fitted to each batch by reshaping
  within capacity.
* A slot is refilled only after the device work reading its host buffers (the
  staged pixels, the rows' ``geometry`` the device transform reads as is) has
  completed (its ``event``, which the filler waits for). Its device buffers are
  written again only after ``released``: events recorded, when its lease ended,
  on the consumer's stream and on every stream a DLPack consumer named, which the
  slot's stream waits for: the consumer's queued work on the batch runs first,
  whichever thread let the last reference go.
* A slot's buffers are released only after both events completed; a buffer a
  slot lets go of while the loader runs (a batch of another shape or dtype) goes
  back to the pool ordered after ``released`` too, so no other slot or blob
  reuses it while the consumer's work may still read it. A slot the caller still
  holds when the loader closes is released when its lease ends.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .._backends import COMPLETED, Backend, Event, Stream, all_of, finished, wait_event
from .._blob import Blob
from .._errors import PoolMemoryError
from .._io._batches import BatchPlan
from .._io._kernels import Geometry
from .._io._pid import pid

__all__ = ["Lease", "Ring", "Slot"]


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
        # the last batch's arrays while they fit the next (no device transform, no other
        # source): (data shape, dtype, label dtype, host and label memories, their
        # buffers, the typed arrays over them); None after any other batch
        self._fast: tuple[Any, ...] | None = None

    def prepare(
        self, plan: BatchPlan, out_shape: tuple[int, ...] | None
    ) -> tuple[np.ndarray, np.ndarray, Geometry | None, dict[str, np.ndarray]]:
        """Fit the slot's buffers to ``plan``; the host arrays to fill.

        ``out_shape`` is the device transform's output shape (None: no device
        transform). Returns the data and label arrays, the geometry to record each
        row's crop and flip in for the device transform (:attr:`geometry`, views of
        the slot's arrays; None without one), and the other sources' arrays by name.
        """
        fast = self._fast
        if (  # the slot's last batch's arrays fit (small batches: once a batch)
            fast is not None
            and out_shape is None
            and not plan.extra
            and plan.data_shape == fast[0]
            and plan.dtype == fast[1]
            and plan.label_dtype == fast[2]
            # each memory's head moved to the CPU as Blob.overwrite_cpu_data moves it;
            # the typed arrays hold while the buffers are the same (else: refitted)
            and fast[3].overwrite_cpu_data() is fast[5]
            and fast[4].overwrite_cpu_data() is fast[6]
        ):
            self.geometry = None
            return fast[7], fast[8], None, {}
        self._fast = None
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
        data, labels = self.host.overwrite_cpu_data(), self.label.overwrite_cpu_data()
        if out_shape is None and not plan.extra:
            host_mem, label_mem = self.host.data, self.label.data
            self._fast = (
                plan.data_shape, plan.dtype, plan.label_dtype, host_mem, label_mem,
                host_mem.host_bytes(), label_mem.host_bytes(), data, labels,
            )  # fmt: skip
        return data, labels, self.geometry, extra

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

    def nbytes(self) -> int:
        """Bytes of host and device memory the slot's blobs hold."""
        return sum(b.capacity * b.dtype.itemsize for b in self.blobs())

    def close(self) -> None:
        """Release the buffers once the slot's and the consumer's device work completed
        (waiting for both here)."""
        finished(self.event)
        finished(self.released)
        self._drop()

    def close_after(self) -> None:
        """Release the buffers without waiting: the pool reuses none of them before
        the slot's and the consumer's device work completed."""
        for blob in self.blobs():
            blob.release_after(event=all_of([self.event, self.released]))
        self._drop()

    def _drop(self) -> None:
        self._fast = None
        for blob in self.blobs():
            blob.close()
        self.host = self.label = self.staged = self.out = None
        self.extra = {}


class Lease:
    """The caller's hold on a delivered slot (see the module docstring).

    The batch, its Blobs and every array or export made from them reference the
    lease; the ring does not. The batch's Blob views borrow the slot Blobs' memories
    (no references of their own), which the held slot keeps. When the lease goes,
    :meth:`Ring.give_back` returns the slot, ordered after the work queued by
    then on the consumer's stream (``stream``, the one current where the batch was
    delivered, or the Loader's named one) and on the streams DLPack consumers named.
    It may go in any thread (a DLPack deleter, a collection in a filler).
    """

    __slots__ = ("_ring", "slot", "stream")

    def __init__(self, ring: Ring, slot: Slot, stream: Stream | None) -> None:
        self._ring: Ring | None = ring
        self.slot = slot
        self.stream = stream

    def __del__(self) -> None:
        ring, self._ring = self._ring, None
        # At the interpreter's end nothing reuses the slot; in a forked child the
        # ring's locks may be held by threads of the parent (the memory is this
        # process's copy and goes with it).
        if ring is not None and not sys.is_finalizing() and pid() == ring.pid:
            ring.give_back(self)


class Ring:
    """Slots, the queue of free ones, and the slots the caller holds; shared by the
    fillers, the consumer and the leases (see the module docstring).

    Fillers :meth:`take` a free slot (blocking) or several at once
    (:meth:`take_many`: a filler handing out a chunk of small batches); the
    consumer :meth:`lease` s a filled slot to the caller, and the lease's end
    gives it back (:meth:`give_back`), waking a filler only once as many slots as
    it waits for are free; a filler :meth:`put` s back a slot it did not fill;
    :meth:`stop` wakes every waiting filler with None.

    The lock is re-entrant: a lease may end (a collection) in a thread that is
    inside one of these methods already.
    """

    def __init__(
        self, backend: Backend, size: int, release: Callable[[Stream | None, Slot], Event]
    ) -> None:
        self._backend = backend
        self._has_device = backend.has_device
        self._release = release  # the event after the consumer's work on a slot
        self._size = size
        self.slots: list[Slot] = []
        self._free: deque[Slot] = deque()
        self._held: set[Slot] = set()  # slots whose lease lives
        self._lost: list[Slot] = []  # slots whose release could not be ordered
        # the lock the condition waits on, taken directly where it is taken per batch
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._needs: list[int] = []  # how many free slots each waiting filler needs
        self._stopped = False
        self._closed = False
        self.pid = pid()  # the process whose leases give slots back

    @property
    def size(self) -> int:
        """The slots the ring has now (those it is made with before it opens)."""
        with self._lock:
            return max(len(self.slots), self._size + 1)

    def _limit(self) -> int:
        """The most slots the ring has now: its size, one for the previous batch
        while the next is asked for, and one for each further batch the caller
        holds."""
        return self._size + 1 + max(0, len(self._held) - 2)

    def held(self) -> tuple[int, int]:
        """Batches the caller holds, and the bytes of their slots' buffers."""
        with self._lock:
            held = list(self._held)
        return len(held), sum(slot.nbytes() for slot in held)

    def open(self) -> None:
        """Create the slots (and their streams), all free."""
        self.pid = pid()
        self.grow(self._size)

    def grow(self, size: int) -> None:
        """At least ``size`` slots for the fillers and the caller's batch, and one for
        the previous batch (new ones free; their buffers come with their first
        batch)."""
        with self._lock:
            self._size = max(self._size, size)
            while len(self.slots) < self._size + 1:
                self._new_slot()
            self._cond.notify_all()

    def _new_slot(self) -> None:
        backend = self._backend
        slot = Slot(backend, backend.create_stream() if backend.has_device else None)
        self.slots.append(slot)
        self._free.append(slot)

    def take(self) -> Slot | None:
        """A free slot, waiting for one; None once :meth:`stop` was called."""
        got = self.take_many(1)
        return got[0] if got else None

    def take_many(self, n: int) -> list[Slot] | None:
        """``n`` free slots (at most the ring's size), waiting until that many are
        free (making new ones while the caller holds more than the ring keeps room
        for); None once :meth:`stop` was called."""
        with self._lock:
            n = max(1, min(n, self._size))
            waiting = False
            try:
                while not self._stopped:
                    self._make_room(n)
                    if len(self._free) >= n:
                        break
                    if not waiting:
                        self._needs.append(n)
                        waiting = True
                    self._cond.wait()
            finally:
                if waiting:
                    self._needs.remove(n)
            if self._stopped:
                return None
            return [self._free.popleft() for _ in range(n)]

    def free_now(self) -> int:
        """How many slots are free (a hint: no lock taken)."""
        return len(self._free)

    def take_free(self, n: int) -> list[Slot] | None:
        """Up to ``n`` free slots (at most the ring's size), as many as are free now
        (making new ones while the caller holds more than the ring keeps room for);
        None when none is, or once :meth:`stop` was called. Never waits: for the
        consumer's thread, which must not wait for slots only its own consumption
        frees."""
        with self._lock:
            n = max(1, min(n, self._size))
            self._make_room(n)
            if self._stopped or not self._free:
                return None
            return [self._free.popleft() for _ in range(min(n, len(self._free)))]

    def _make_room(self, n: int) -> None:
        """Under the lock: new free slots until ``n`` are free or the ring has as many as
        it keeps room for (:meth:`_limit`)."""
        while len(self._free) < n and len(self.slots) < self._limit():
            self._new_slot()

    def put(self, slot: Slot) -> None:
        """Give back a slot a filler took and did not fill."""
        with self._lock:
            self._free.append(slot)
            self._wake()

    def put_many(self, slots: list[Slot]) -> None:
        """Give back slots a filler took and did not fill."""
        for slot in slots:
            self.put(slot)

    def _wake(self) -> None:
        if self._needs and len(self._free) >= min(self._needs):
            self._cond.notify_all()

    def lease(self, slot: Slot, stream: Stream | None) -> Lease:
        """Hand ``slot`` (filled, its device work complete) to the caller: the lease
        every object made for its batch references. ``stream``: the consumer's
        stream (see :class:`Lease`)."""
        lease = Lease(self, slot, stream)
        with self._lock:
            self._held.add(slot)
            if len(self._held) > 2:
                self._wake_for_room()
        return lease

    def give_back(self, lease: Lease) -> None:
        """The lease of ``lease.slot`` ended: order the slot's reuse after the
        consumer's streams, and free it (or, while
        the ring has more slots than it keeps room for, or once it is closed,
        release its buffers)."""
        slot = lease.slot
        released: Event = COMPLETED
        try:
            if self._has_device:
                released = self._release(lease.stream, slot)
        except BaseException:
            # unordered after the consumer: never reused; the ring makes another slot,
            # and this one's buffers go back only when the device is idle (close)
            with self._lock:
                self._held.discard(slot)
                if slot in self.slots:
                    self.slots.remove(slot)
                self._lost.append(slot)
                self._wake_for_room()
            raise
        with self._lock:
            held = self._held
            held.discard(slot)
            slot.released = released
            # (:meth:`_limit` and :meth:`_wake`, written out: this runs once a batch)
            keep = not self._closed and len(self.slots) <= self._size + 1 + max(0, len(held) - 2)
            if keep:
                self._free.append(slot)
                if self._needs and len(self._free) >= min(self._needs):
                    self._cond.notify_all()
            elif slot in self.slots:
                self.slots.remove(slot)
                self._wake_for_room()
        if not keep:
            slot.close_after()

    def _wake_for_room(self) -> None:
        if self._needs:
            self._cond.notify_all()  # a waiting filler may make a slot now

    def explain(self, exc: Exception) -> Exception:
        """``exc``, or for a pool out of memory while the caller holds batches, the
        same error saying so."""
        if not isinstance(exc, PoolMemoryError):
            return exc
        count, nbytes = self.held()
        if count < 2:
            return exc
        return PoolMemoryError(
            f"{count} batches kept by the caller hold {_gib(nbytes)}; drop them or copy what "
            f"you need ({exc})"
        )

    def stop(self) -> None:
        """Wake every filler waiting in :meth:`take` (they get None), and every later
        call of it."""
        with self._lock:
            self._stopped = True
            self._cond.notify_all()

    def unheld(self) -> list[Slot]:
        """The slots the caller does not hold."""
        with self._lock:
            return [slot for slot in self.slots if slot not in self._held]

    async def settle(self) -> None:
        """Wait until no device work (the slot's or the consumer's) uses the buffers of
        any slot the caller does not hold."""
        for slot in self.unheld():
            await wait_event(slot.event, raising=False)
            await wait_event(slot.released, raising=False)

    def close(self) -> None:
        """Release the buffers of every slot the caller does not hold (after its device
        work completed); the others are released when their leases end."""
        with self._lock:
            self._closed = True
            slots = [slot for slot in self.slots if slot not in self._held]
            self.slots = [slot for slot in self.slots if slot in self._held]
            self._free.clear()
            lost, self._lost = self._lost, []
        for slot in slots:
            slot.close()
        if lost:
            self._backend.synchronize()  # the consumer's work on them, whatever it was
            for slot in lost:
                slot.close()


def _gib(nbytes: int) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"
