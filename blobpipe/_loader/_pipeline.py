"""The pipeline behind a Loader: the ring, the fillers, the hand-off and the consumer's end.

``min(workers, prefetch)`` fillers, each a loop in its own plain thread: take a
free slot from the ring, wait for the device work still reading it, number and
plan the next batch (under one lock, so numbers follow plan order), fill it,
issue its device work, post it to the hand-off by number. The consumer takes
batches by number, from an event loop (:meth:`Pipeline.next_async`) or a thread
(:meth:`Pipeline.next_blocking`).

No task group is entered and no event-loop object is kept across calls, so a
pipeline may be opened, iterated and closed from any task (an async generator
finalized in another task, a loop left with ``break``). Nothing here refers to
the :class:`~blobpipe.Loader` that owns the pipeline: the Loader can be garbage
collected while fillers run, and its finalizer closes the pipeline.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._backends import Backend, Stream, wait_event
from .._errors import StateError
from .._io._batches import Batches, BatchPlan
from .._pool import get_pool
from ._batch import Batch, LoaderStatistics
from ._device import DeviceWork
from ._handoff import End, Failure, Handoff, threadsafe_caller
from ._lifecycle import CLOSED_ERROR, Lifecycle, State
from ._ring import Ring, Slot

__all__ = ["Pipeline"]

_Made = tuple[Slot, BatchPlan]  # a batch filled into its slot
_YIELD_EVERY = 0.001  # seconds: the longest the consumer keeps the event loop from others
_Item = _Made | End | Failure  # what the hand-off carries

_FORKED_ERROR = (
    "this Loader was opened in process {parent}, and this is a forked child ({child}): its "
    "filler threads do not exist here. Create and open the Loader in the child (e.g. inside "
    "the worker function), or open it in the parent only after the fork"
)


class Pipeline:
    """The running part of a Loader (see the module docstring).

    ``close``/``aclose`` may be called from any thread, also from a filler's
    (a garbage collection there): the last filler to return releases the ring.
    """

    def __init__(
        self,
        batches: Batches,
        backend: Backend,
        device: DeviceWork,
        stream: Stream | None,
        prefetch: int,
        workers: int,
    ) -> None:
        self.batches = batches
        self.backend = backend
        self.device = device
        self.lifecycle = Lifecycle()
        self._stream = stream
        self._n_fillers = min(workers, prefetch)
        # The producer plans ahead of the consumer: resume after the last
        # *delivered* batch, never from the producer's cursor.
        self.resume_state: dict[str, Any] = batches.state_dict()
        self._lock = threading.Lock()  # the statistics, the filler count, the release
        self._n_batches = 0
        self._n_records = 0
        self._wait_time = 0.0
        self._decode_time = 0.0
        self._copy_time = 0.0
        self._ring = Ring(backend, prefetch)
        self._handoff: Handoff[_Made] = Handoff()
        self._plan_lock = threading.Lock()  # numbers and plans batches, in order
        self._planned = 0  # the number of the next batch planned
        self._current: tuple[Slot, Batch] | None = None  # the batch handed out last
        self._yielded = 0.0  # when next_async last let the event loop run other tasks
        self._last_fill = float("inf")  # seconds the last batch took to fill
        # set while batches take _YIELD_EVERY or more to fill: every filler runs;
        # clear (small batches): filler 0 and the consumer alone (see _filler)
        self._wide = threading.Event()
        self._wide.set()
        self._threads: list[threading.Thread] = []
        self._fillers_running = 0
        self._fillers_done = threading.Event()  # set when the last filler returned
        self._released = False  # the ring went back to the pool (once)
        self._release_on_return = False  # closed from a filler: the last one releases
        self._pid = os.getpid()  # the process that opened the pipeline
        # (event loop token, its thread-safe caller) of the last async consumer
        self._caller: tuple[object, Callable[[Callable[[], object]], object]] | None = None

    # -- opening and closing ---------------------------------------------------------
    def open(self) -> None:
        """UNOPENED → OPEN: warm up the device, allocate the ring, start the fillers.

        Raises:
            StateError: the pipeline was opened before (or closed).
        """
        self.device.warm_up()
        self._start()

    async def aopen(self) -> None:
        """:meth:`open`, with the device warm-up in a worker thread."""
        await anyio.to_thread.run_sync(self.device.warm_up)
        self._start()

    def _start(self) -> None:
        self.lifecycle.open()
        self._pid = os.getpid()
        self._ring.open()
        self._fillers_running = self._n_fillers
        self._threads = [
            threading.Thread(
                target=self._thread_filler, args=(k,), name=f"blobpipe-filler-{k}", daemon=True
            )
            for k in range(self._n_fillers)
        ]
        for thread in self._threads:
            thread.start()
        _close_at_exit(self)

    def close(self) -> None:
        """Stop the fillers and release the ring: no thread left running, every
        block back in the pool (from a filler thread: once the fillers returned).
        Idempotent; final."""
        _open_pipelines.discard(self)
        left = self.lifecycle.move(State.CLOSED)
        if left is State.UNOPENED:
            self.batches.close()
            return
        if left is None:
            return
        if os.getpid() != self._pid:
            # a forked child: the fillers do not exist here, and the pool's locks
            # may be held by threads of the parent; the memory is this process's
            # copy and goes with it
            return
        self._stop_fillers()
        me = threading.current_thread()
        if me in self._threads:
            with self._lock:
                self._release_on_return = self._fillers_running > 0
            if self._release_on_return:
                return
        else:
            for thread in self._threads:
                thread.join()
        for slot in self._ring.slots:  # device work still reading a slot
            slot.event.synchronize()
            slot.released.synchronize()
        self._release()

    async def aclose(self) -> None:
        """:meth:`close` for the event loop: the fillers are awaited in a worker
        thread, shielded from cancellation. Idempotent; final."""
        _open_pipelines.discard(self)
        left = self.lifecycle.move(State.CLOSED)
        if left is State.UNOPENED:
            self.batches.close()
            return
        if left is None or os.getpid() != self._pid:
            return
        with anyio.CancelScope(shield=True):
            self._stop_fillers()
            await anyio.to_thread.run_sync(self._fillers_done.wait)
            await self._ring.settle()
            self._release()

    def _stop_fillers(self) -> None:
        self.recycle_current()  # the consumer lets its batch go
        # Fillers are loops in threads: each finishes its current batch and
        # returns; no thread is abandoned.
        self._wide.set()  # parked fillers see the pipeline is closed
        self._ring.stop(self._n_fillers)

    def _release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self.recycle_current()
        self._ring.close()
        self._handoff.close()  # a consumer waiting in another task or thread sees the close
        self.batches.close()

    # -- statistics ------------------------------------------------------------------
    def statistics(self) -> LoaderStatistics:
        """Counters of the batches delivered so far."""
        backend = self.backend
        with self._lock:
            return LoaderStatistics(
                batches=self._n_batches,
                records=self._n_records,
                wait_time=self._wait_time,
                decode_time=self._decode_time,
                copy_time=self._copy_time,
                pool=get_pool(backend, "host").statistics(),
                device_pool=(
                    get_pool(backend, "device").statistics() if backend.has_device else None
                ),
            )

    # -- producer --------------------------------------------------------------------
    def _thread_filler(self, k: int) -> None:
        try:
            self._filler(k)
        finally:
            with self._lock:
                self._fillers_running -= 1
                last = self._fillers_running == 0
                release = last and self._release_on_return
            if last:
                self._fillers_done.set()
            if release:
                for slot in self._ring.slots:
                    slot.event.synchronize()
                    slot.released.synchronize()
                self._release()

    def _filler(self, k: int) -> None:
        """Filler ``k``'s loop; returns once the pipeline is not OPEN.

        Whatever it raises is posted as a failure at the next batch number, so
        the consumer gets it in order, as itself, never as an exception group.
        While batches are small (``_wide`` clear), only filler 0 fills, with the
        consumer's help: more threads would spend the time on the GIL.
        """
        self.backend.bind_thread()  # works for this device only: no switch, no other context
        while self.lifecycle.state is State.OPEN:
            if k and not self._wide.is_set():
                self._wide.wait()  # set again by a large batch, or by close
                continue
            slot = self._ring.take()
            if slot is None or not self._fill_slot(slot):
                return

    def _fill_slot(self, slot: Slot) -> bool:
        """Plan the next batch, fill it into ``slot`` and post it (or the end of the
        epoch, or the failure, in its place); False when the pipeline stopped or
        this batch failed."""
        try:
            slot.event.synchronize()  # device work still reading the slot's buffers
            number, item = self._plan_and_fill(slot)
        except Exception as exc:
            with self._plan_lock:
                number, item = self._failed(self._planned, exc)
                self._planned += 1
        if not isinstance(item, tuple):  # end of epoch, failure, or stopped
            self._ring.put(slot)
        if number is None or item is None:
            return False
        self._handoff.post(number, item)
        return not isinstance(item, Failure)

    def _plan_and_fill(self, slot: Slot) -> tuple[int | None, _Item | None]:
        """Number and plan the next batch, fill it, and start its device work.

        Returns its number and what to post: the filled batch, the end of an
        epoch, or the failure; (None, None) once the pipeline is not OPEN.
        """
        with self._plan_lock:
            if self.lifecycle.state is not State.OPEN:
                return None, None
            number = self._planned
            self._planned += 1
            try:
                plan = self.batches.next_plan()
            except Exception as exc:  # delivered to the consumer, in order
                return self._failed(number, exc)
        if plan is None:
            return number, End()
        t0 = time.perf_counter()
        try:
            data, label, params, extra = slot.prepare(plan, self.device.out_shape(plan))
            self.batches.fill(plan, data, label, params_out=params, extra_out=extra)
        except Exception as exc:  # delivered to the consumer, in order
            return self._failed(number, exc)
        finally:
            dt = time.perf_counter() - t0
            self._last_fill = dt
            if (dt >= _YIELD_EVERY) != self._wide.is_set():
                (self._wide.set if dt >= _YIELD_EVERY else self._wide.clear)()
            with self._lock:
                self._decode_time += dt
        try:
            self.device.issue(slot, plan, self.batches.path)
        except Exception as exc:
            return self._failed(number, exc)
        return number, (slot, plan)

    def _failed(self, number: int, exc: Exception) -> tuple[int, Failure]:
        """Batch ``number`` failed: OPEN → FAILING, nothing after it is planned."""
        self.lifecycle.move(State.FAILING)
        return number, Failure(exc)

    # -- consumer --------------------------------------------------------------------
    def recycle_current(self) -> None:
        """The consumer lets the batch it holds go: its slot is refilled after the
        device work queued on the consumer's stream so far."""
        current, self._current = self._current, None
        if current is None:
            return
        slot, batch = current
        batch._recycle()
        slot.released = self.device.release(self._stream, slot)
        self._ring.put(slot)

    def _detach_current(self, batch: Batch) -> None:
        if self._current is not None and self._current[1] is batch:
            slot, _ = self._current
            slot.forget(self._stream)

    def _check_process(self) -> None:
        pid = os.getpid()
        if pid != self._pid and self.lifecycle.state is not State.UNOPENED:
            raise StateError(_FORKED_ERROR.format(parent=self._pid, child=pid))

    def _threadsafe_caller(self) -> Callable[[Callable[[], object]], object]:
        token = anyio.lowlevel.current_token()
        caller = self._caller
        if caller is None or caller[0] is not token:
            caller = self._caller = (token, threadsafe_caller())
        return caller[1]

    async def next_async(self) -> Batch:
        """The next batch (recycling the previous one's buffers), for ``__anext__``.

        Raises:
            StopAsyncIteration: at the end of an epoch (``mode="epoch"``).
            BlobpipeError: the error a filler raised making this batch.
            StateError: the pipeline is closed, failed earlier, or was opened in
                the parent of this forked process.
        """
        # Every call is a cancellation point, so a consumer whose body never
        # awaits can still be cancelled (and time out): waiting for a batch is a
        # checkpoint; a batch already there gets one when the loop last ran
        # other tasks at least _YIELD_EVERY ago, else a cancellation check only
        # (a turn of the event loop per batch costs more than a small batch).
        t0 = self._begin_next()
        handoff = self._handoff
        # nothing ready, and batches fill in less time than the event loop may be
        # kept from other tasks: fill them here meanwhile (see _help)
        self._help(t0)
        if handoff.ready():
            if t0 - self._yielded >= _YIELD_EVERY:
                await anyio.lowlevel.checkpoint()
                t0 = self._yielded = time.perf_counter()
                self.lifecycle.check_iterable()
            else:  # batches arriving faster than this: cancellation is still seen
                await anyio.lowlevel.checkpoint_if_cancelled()
        item = handoff.take()
        if item is None:
            event = anyio.Event()
            call_soon = self._threadsafe_caller()
            item = handoff.take(lambda: call_soon(event.set))
            if item is None:
                try:
                    await event.wait()
                finally:
                    handoff.forget_waiter()
                item = self._taken()
            else:
                # it arrived meanwhile and is taken: a cancellation now would lose
                # it, so this call's checkpoint is a shielded one
                await anyio.lowlevel.cancel_shielded_checkpoint()
        made = self._arrived(item, t0)
        if made is None:
            raise StopAsyncIteration
        done = made[0].event
        if not done.query():
            # Shielded: the batch has left the hand-off, so a cancellation here
            # would lose it and its slot. The wait is bounded by the copy.
            with anyio.CancelScope(shield=True):
                await wait_event(done)
        return self._deliver(*made, t0)

    def next_blocking(self) -> Batch:
        """:meth:`next_async` for the blocking form: waits in the calling thread."""
        t0 = self._begin_next()
        handoff = self._handoff
        self._help(t0)
        item = handoff.take()
        if item is None:
            event = threading.Event()
            item = handoff.take(event.set)
            if item is None:
                try:
                    event.wait()
                finally:
                    handoff.forget_waiter()
                item = self._taken()
        made = self._arrived(item, t0)
        if made is None:
            raise StopIteration
        made[0].event.synchronize()
        return self._deliver(*made, t0)

    def _help(self, t0: float) -> None:
        """While the next batch is not ready and batches are small, fill batches
        into free slots in the consumer's thread (for at most about _YIELD_EVERY)
        rather than sleep until a filler posts one: for small records a thread
        hand-off per batch costs more than the batch. (Large batches keep the
        fillers busy on every core already.)"""
        handoff = self._handoff
        while (
            not handoff.ready()
            and self._last_fill < _YIELD_EVERY
            and time.perf_counter() - t0 < _YIELD_EVERY
        ):
            slot = self._ring.take_nowait()
            if slot is None or not self._fill_slot(slot):
                return

    def _begin_next(self) -> float:
        self._check_process()
        self.lifecycle.check_next()
        self.recycle_current()
        return time.perf_counter()

    def _taken(self) -> _Item:
        """After a wake-up: the batch that arrived (or StateError when closed)."""
        self.lifecycle.check_iterable()
        item = self._handoff.take()
        if item is None:  # pragma: no cover - woken without a batch means closed
            raise StateError(CLOSED_ERROR)
        return item

    def _arrived(self, item: _Item, t0: float) -> _Made | None:
        """A batch that arrived; None at the end of an epoch; raises failures."""
        if isinstance(item, End):
            with self._lock:
                self._wait_time += time.perf_counter() - t0
            return None
        if isinstance(item, Failure):
            self.lifecycle.fail(item.exc)
            raise item.exc
        return item

    def _deliver(self, slot: Slot, plan: BatchPlan, t0: float) -> Batch:
        """Account for the batch whose device work completed and hand it out."""
        copy = self.device.elapsed(slot)
        with self._lock:
            self._copy_time += copy
            self._wait_time += time.perf_counter() - t0
            self._n_batches += 1
            self._n_records += plan.valid
        self.resume_state = plan.state
        batch = self._make_batch(slot, plan)
        self._current = (slot, batch)
        return batch

    def _make_batch(self, slot: Slot, plan: BatchPlan) -> Batch:
        src = slot.out if self.device.on_device else slot.host
        if src is None or slot.label is None:  # closed by another thread meanwhile
            raise StateError(CLOSED_ERROR)
        # closed by _recycle (or kept by detach, which adds the finalizer)
        data = src._alias(finalize=False, readonly_export=True)
        label = slot.label._alias(finalize=False, readonly_export=True)
        extra = {
            name: slot.extra[name]._alias(finalize=False, readonly_export=True)
            for name, _ in plan.extra
        }
        return Batch(data, label, plan, on_detach=self._detach_current, extra=extra)


# Pipelines still open: closed by an atexit hook, so that no filler thread is inside
# native code (OpenCV, NumPy) while the interpreter finalizes.
_open_pipelines: weakref.WeakSet[Pipeline] = weakref.WeakSet()
_exit_hook = threading.Lock()
_exit_hooked = False


def _close_at_exit(pipeline: Pipeline) -> None:
    global _exit_hooked
    _open_pipelines.add(pipeline)
    with _exit_hook:
        if not _exit_hooked:
            atexit.register(_close_open_pipelines)
            _exit_hooked = True


def _close_open_pipelines() -> None:
    for pipeline in list(_open_pipelines):
        with contextlib.suppress(Exception):  # exiting: close what can be closed
            pipeline.close()
