"""The pipeline behind a Loader: the ring, the fillers, the hand-off, the release.

``min(workers, prefetch)`` fillers, each a loop in its own plain thread: take a free
slot from the ring, wait for the device work still reading it, number and plan the next
batch (under one lock, so numbers follow plan order), fill it, issue its device work,
post it to the hand-off by number. While batches are small (quick to fill, several to a
chunk), each filler fills a chunk of consecutive batches at a time straight into their
slots, and chunks take their slots in number order (``_chunk.py``). A consumer takes the
batches by number in these steps: :meth:`Pipeline.begin_next`, a take from
:attr:`Pipeline.handoff` (waiting as its driver waits: ``_async`` on an event loop,
``_blocking`` in a thread), :meth:`Pipeline.arrived`, the wait for the batch's device
event, and :meth:`Pipeline.deliver`.

Nothing here refers to the :class:`~blobpipe.Loader` that owns the pipeline or
keeps an event-loop object: the Loader can be garbage collected while fillers
run (its finalizer closes the pipeline), and a pipeline may be opened, iterated
and closed from any task or thread. Pipelines still open when the interpreter
exits are closed by an atexit hook.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from .._backends import Backend, Stream, finished
from .._errors import StateError
from .._io._batches import Batches, BatchPlan
from .._io._kernels import row_pool
from .._io._pid import pid
from . import _chunk
from ._batch import Batch
from ._chunk import CHUNK_BATCHES, RowsWritten, Started, chunk_batches, planned_together
from ._device import DeviceWork
from ._handoff import End, Failure, Handoff
from ._lifecycle import CLOSED_ERROR, Lifecycle, State, close_at_exit, closed_before_exit
from ._ring import Ring, Slot
from ._stats import Counters, LoaderStatistics

__all__ = ["HERE_DEPTH", "SMALL_FILL", "Item", "Made", "Pipeline"]

Made = tuple[Slot, BatchPlan]  # a batch filled into its slot
Item = Made | End | Failure  # what the hand-off carries
Stop = tuple[int, End | Failure | None]  # what ended planning: at a number (None: closed)


#: Seconds: a batch that fills in less, and that a chunk holds more than one of, is
#: small: the fillers fill such batches a chunk at a time; other batches one at a time.
SMALL_FILL = 0.001
#: The most chunks the consumer has started at once (and threads in its pool, at most
#: one fewer than the CPUs): the ring then holds this many chunks and the consumer's.
HERE_DEPTH = 2


_FORKED_ERROR = (
    "this Loader was opened in process {parent}, and this is a forked child ({child}): its "
    "filler threads do not exist here. Create and open the Loader in the child (e.g. inside "
    "the worker function), or open it in the parent only after the fork"
)


class Pipeline:
    """The running part of a Loader (see the module docstring).

    ``close`` may be called from any thread, also from a filler's (a garbage
    collection there): the last filler to return releases the ring.
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
        self.counters = Counters()
        self._stream = stream
        self._n_fillers = min(workers, prefetch)
        # The producer plans ahead of the consumer: resume after the last
        # *delivered* batch, never from the producer's cursor.
        self._resume: dict[str, Any] | BatchPlan = batches.state_dict()
        self._lock = threading.Lock()  # the filler count, the release
        self._ring = Ring(backend, prefetch, device.release)
        self.handoff: Handoff[Made] = Handoff()  # the consumer takes batches from it
        self._plan_lock = threading.Lock()  # numbers and plans batches, in order
        self._planned = 0  # the number of the next batch planned
        # under the plan lock: plans made ahead, in order, not numbered yet (None: an
        # epoch's end), and how many one call plans while batches are small
        # (:meth:`_next_planned`)
        self._ahead: deque[BatchPlan | None] = deque()
        self._chunk_ahead = 1
        self._first_epoch, self._grown = -1, False  # first delivered epoch; chunks grow past it
        # set while batches take SMALL_FILL or more to fill: every filler runs;
        # clear (small batches): each filler a chunk at a time (see _filler)
        self._wide = threading.Event()
        self._wide.set()
        self._widen = False  # a filler sets _wide once every chunk has its slots
        # set while the consumer plans (pump): batches small and of raw records, the
        # consumer's thread plans them a chunk at a time and the pool's native threads
        # (which never take the GIL) write their rows, so no filler's Python competes
        # with the consumer's for the GIL; the fillers wait on _unparked meanwhile.
        # _here_ok is cleared for good once a chunk's rows could not be started on the
        # pool (the fillers' chunks then, as before). Written under the plan lock.
        self._here = False
        self._here_ok = True
        self._unparked = threading.Event()
        self._unparked.set()
        self._pool: Any = None  # the native threads (_kernels.row_pool), made once
        self._started: deque[Started] = deque()  # the consumer's alone, in number order
        # held while the consumer starts or posts chunks: the close waits for it before it
        # waits for the slots' events (a chunk being started has no event on its slots
        # yet); re-entrant for a close from the consumer's own thread
        self._pumping = threading.RLock()
        self._here_chunk = CHUNK_BATCHES  # how many batches the consumer's next chunk holds
        # chunks started at once (a chunk's rows are one call; the pool's threads: fewer)
        self._here_depth = min(self._n_fillers, HERE_DEPTH)
        # chunks take their slots in number order: the first numbers of the chunks
        # planned that have not taken their slots yet (at most one per filler), and
        # the condition their fillers wait on for their turn
        self._turns = threading.Condition(threading.Lock())
        self._slotless: list[int] = []
        self._threads: list[threading.Thread] = []
        self._go = threading.Event()  # set once every filler thread was started
        self._fillers_running = 0
        self._fillers_done = threading.Event()  # set when the last filler returned
        self._released = False  # the ring went back to the pool (once)
        self._release_on_return = False  # closed from a filler: the last one releases
        self._pid = pid()  # the process that opened the pipeline

    # -- opening and closing ---------------------------------------------------------
    def open_here(self) -> None:
        """UNOPENED → OPEN from a plain thread: the device transform warmed up in the
        calling thread, then :meth:`start`.

        Raises:
            StateError: the pipeline was opened before (or closed).
        """
        self.device.warm_up()
        self.start()

    def start(self) -> None:
        """UNOPENED → OPEN: allocate the ring, start the fillers (the driver warmed
        up the device before).

        Raises:
            StateError: the pipeline was opened before (or closed).
        """
        self.lifecycle.open()
        self._pid = pid()
        self._ring.open()
        self._fillers_running = self._n_fillers
        self._threads = [
            threading.Thread(
                target=self._thread_filler, args=(k,), name=f"blobpipe-filler-{k}", daemon=True
            )
            for k in range(self._n_fillers)
        ]
        # The fillers start together: a filler that ran at once would hold the GIL while
        # this thread waits to start the next (Thread.start waits for the thread to run),
        # up to the switch interval (5 ms) per filler, the others not yet filling.
        try:
            for thread in self._threads:
                thread.start()
        finally:
            self._go.set()
        close_at_exit(self)

    def close(self) -> None:
        """Stop the fillers and release the ring, waiting in the calling thread: no
        thread left running, every block back in the pool (from a filler thread:
        once the fillers returned). Idempotent; final. The close of the blocking
        form, of the Loader's finalizer and of the atexit hook."""
        if not self.begin_close():
            return
        if threading.current_thread() in self._threads:
            with self._lock:
                self._release_on_return = self._fillers_running > 0
            if self._release_on_return:
                return
        else:
            for thread in self._threads:
                thread.join()
        self._synchronize_slots()
        self.release()

    def begin_close(self) -> bool:
        """Move to CLOSED and stop the fillers. True when the caller is to wait for
        them (:meth:`wait_fillers`, then the slots' device work) and :meth:`release`
        the ring; False when nothing is left to wait for: closed before, never opened
        (the database is released here), or a forked child (the fillers do not exist
        here, and the pool's locks may be held by threads of the parent; the memory
        is this process's copy and goes with it)."""
        closed_before_exit(self)
        left = self.lifecycle.move(State.CLOSED)
        if left is State.UNOPENED:
            self.batches.close()
            return False
        if left is None or pid() != self._pid:
            return False
        # Fillers are loops in threads: each finishes its current batch and
        # returns; no thread is abandoned.
        self._ring.stop()
        self._unparked.set()  # fillers waiting while the consumer planned see the close
        with self._turns:  # fillers waiting for their chunk's turn see the close
            self._turns.notify_all()
        return True

    def wait_fillers(self, timeout: float | None = None) -> bool:
        """Block the calling thread until the last filler returned (True), or for at
        most ``timeout`` seconds (False when it passed)."""
        return self._fillers_done.wait(timeout)

    async def settle(self) -> None:
        """Await the device work (the slots' and the consumer's) still using any
        slot's buffers, the event loop running other tasks meanwhile."""
        with self._pumping:  # a chunk the consumer is starting has its events after this
            pass
        await self._ring.settle()

    def _synchronize_slots(self) -> None:
        """:meth:`settle`, blocking the calling thread."""
        with self._pumping:  # a chunk the consumer is starting has its events after this
            pass
        for slot in self._ring.unheld():
            finished(slot.event)
            finished(slot.released)

    def release(self) -> None:
        """Give the ring back to the pool, close the hand-off and the database (once;
        after the fillers returned and the slots' device work completed)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        if self._pool is not None:
            self._pool.close()  # joins its threads once every job ran
        self._ring.close()
        self.handoff.close()  # a consumer waiting in another task or thread sees the close
        # the state made now: the last plan (its keys, their file map) is not kept, nor
        # the plans made ahead (no filler plans any more)
        self._resume = self.resume_state
        self._ahead.clear()
        self._started.clear()  # (their rows written: the pool was joined)
        self.batches.close()

    @property
    def resume_state(self) -> dict[str, Any]:
        """Where to resume: after the last delivered batch (before any, the start)."""
        resume = self._resume
        return resume.state if isinstance(resume, BatchPlan) else resume

    def statistics(self, backend: Backend) -> LoaderStatistics:
        """The counters so far (see :class:`LoaderStatistics`)."""
        return self.counters.snapshot(backend, self._ring.size, *self._ring.held())

    def load_state(self, state: dict[str, Any]) -> None:
        """Resume at ``state``: only before the pipeline is opened (an open one has
        batches of the old position prefetched already).

        Raises:
            StateError: the pipeline was opened already.
            ArgumentError, DataError: as ``Batches.load_state_dict``.
        """
        lifecycle = self.lifecycle
        if lifecycle.state is not State.UNOPENED:
            raise StateError(
                f"load_state_dict needs a Loader that was not opened yet (this one is "
                f"{lifecycle!r}); create a new Loader with state=..."
            )
        self.batches.load_state_dict(state)
        self._resume = self.batches.state_dict()

    # -- producer --------------------------------------------------------------------
    def _thread_filler(self, k: int) -> None:
        try:
            self._go.wait()  # every filler started (see start)
            self._filler(k)
        finally:
            with self._lock:
                self._fillers_running -= 1
                last = self._fillers_running == 0
                release = last and self._release_on_return
            if last:
                self._fillers_done.set()
            if release:
                self._synchronize_slots()
                self.release()

    def _filler(self, k: int) -> None:
        """Filler ``k``'s loop; returns once the pipeline is not OPEN.

        Whatever it raises is posted as a failure at the next batch number, so
        the consumer gets it in order, as itself, never as an exception group.
        While batches are small (``_wide`` clear), it fills a chunk of batches at
        a time (``_chunk.py``), in turn with the other fillers' chunks.
        """
        self.backend.bind_thread()  # works for this device only: no switch, no other context
        while self.lifecycle.state is State.OPEN:
            if self._here:  # the consumer plans (see pump)
                self._unparked.wait()
                continue
            if not self._wide.is_set():
                if not self._chunk_step():
                    return
                continue
            slot = self._ring.take()
            if slot is None or not self._fill_slot(slot):
                return

    def _fill_slot(self, slot: Slot) -> bool:
        """Plan the next batch, fill it into ``slot`` and post it (or the end of the
        epoch, or the failure, in its place); False when the pipeline stopped or
        this batch failed."""
        number: int | None = None
        try:
            slot.event.synchronize()  # device work still reading the slot's buffers
            with self._plan_lock:
                if self._here:  # the consumer plans now: the slot is not needed
                    self._ring.put(slot)
                    return True
                number, planned = self._plan_next()
            if planned is None or self.lifecycle.state is State.CLOSED:
                # (closed while it planned: nobody takes the batch, and the close waits
                # for this thread, so it is not filled)
                item: Item | None = None
            elif isinstance(planned, BatchPlan):
                item = self._fill_and_issue(slot, number, planned)
            else:
                item = planned
        except Exception as exc:
            number, item = self._failed(self._number_for(number), exc)
        return self._post(slot, number, item)

    def _number_for(self, number: int | None) -> int:
        """The number a failure takes: ``number`` (the batch it happened to), else a
        new one."""
        if number is not None:
            return number
        with self._plan_lock:
            self._planned += 1
            return self._planned - 1

    def _post(self, slot: Slot, number: int, item: Item | None) -> bool:
        """Post ``item`` at ``number`` (the slot goes back to the ring unless it holds
        the batch); False when nothing more is to be filled."""
        if not isinstance(item, tuple):  # end of epoch, failure, or stopped
            self._ring.put(slot)
        if item is None:
            return False
        self.handoff.post(number, item)
        return not isinstance(item, Failure)

    def _plan_next(self, ahead: int = 1) -> tuple[int, BatchPlan | End | Failure | None]:
        """Under the plan lock: number and plan the next batch; its plan, the end of
        an epoch, the failure, or None once the pipeline is not OPEN. ``ahead``: as
        :meth:`_next_planned`."""
        if self.lifecycle.state is not State.OPEN:
            return self._planned, None
        number = self._planned
        self._planned += 1
        try:
            plan = self._next_planned(ahead)
        except Exception as exc:  # delivered to the consumer, in order
            return self._failed(number, exc)
        return number, End() if plan is None else plan

    def _next_planned(self, ahead: int) -> BatchPlan | None:
        """Under the plan lock: the next plan (None at the end of an epoch), the first of
        those made ahead, else made now together with ``ahead - 1`` after it in one
        :meth:`Batches.next_plans` call (one call's costs for many small batches).
        Plans come out as consecutive ``next_plan`` calls make them; a failure
        planning a batch is raised at that batch (``next_plans`` holds it back)."""
        if not self._ahead:
            self._ahead.extend(self.batches.next_plans(ahead))
        return self._ahead.popleft()

    def _chunk_of(self, plan: BatchPlan, consumer: bool) -> int:
        """:func:`chunk_batches`; the consumer's larger ones once it is past its first epoch."""
        return chunk_batches(plan, consumer, self._grown)

    def _fill_and_issue(self, slot: Slot, number: int, plan: BatchPlan) -> Item:
        """Fill ``plan`` into ``slot`` and start its device work: the filled batch,
        or the failure in its place."""
        t0 = time.perf_counter()
        try:
            data, label, geometry, extra = slot.prepare(plan, self.device.out_shape(plan))
            self.batches.fill(plan, data, label, geometry_out=geometry, extra_out=extra)
        except Exception as exc:  # delivered to the consumer, in order
            return self._failed(number, self._ring.explain(exc))[1]
        finally:
            self._filled(time.perf_counter() - t0, 1, self._chunk_of(plan, self._here_ok))
        return self._issue(slot, number, plan)

    def _issue(self, slot: Slot, number: int, plan: BatchPlan) -> Item:
        try:
            self.device.issue(slot, plan, self.batches.path)
        except Exception as exc:
            return self._failed(number, exc)[1]
        return (slot, plan)

    def _filled(self, seconds: float, batches: int, chunk: int) -> None:
        """``batches`` batches took ``seconds`` to fill: the statistics, and whether
        batches are small: quick to fill, and chunkable (a ``chunk`` holds more than
        one of them; a batch alone in its chunk gains nothing from it). Any filler
        narrows the pipeline at once (to the consumer's planning where it can); widening
        waits until every chunk planned has its slots (:meth:`_widen_once_slotted`)."""
        each = seconds / batches
        self.counters.filled(seconds)
        small = each < SMALL_FILL and chunk > 1
        if small and self._here_ok and self._wide.is_set():
            self._plan_here(chunk)
        elif small and self._wide.is_set():
            self._wide.clear()
        elif not small and not self._wide.is_set():
            self._widen = True

    def _chunk_step(self) -> bool:
        """A filler while batches are small: plan a chunk, take a free slot for each
        of its batches in its turn (the consumer wakes the filler once for them
        all), fill them straight into the slots and post them together; then what
        ended planning early (the end of an epoch, a failure). False when the
        pipeline stopped or a batch failed."""
        if self._widen:  # the last chunk's batches were large: every filler runs
            return self._widen_once_slotted()
        numbered, stop = self._plan_chunk()
        if len(numbered) == 1:  # one batch: straight into a slot
            return self._fill_one(*numbered[0], stop)
        if numbered:
            # room for this chunk while the consumer is on the last one
            self._ring.grow(2 * len(numbered) + 1)
            slots = self._take_in_turn(numbered[0][0], len(numbered))
            if slots is None or not self._fill_chunk(numbered, slots):
                return False
        if stop is not None and stop[1] is not None:
            self.handoff.post(stop[0], stop[1])  # by number: after the chunk's batches
        return stop is None or isinstance(stop[1], End)

    def _take_in_turn(self, first: int, n: int) -> list[Slot] | None:
        """``n`` free slots for the chunk planned from batch ``first`` (or that batch,
        planned alone), taken in its turn; None once closed."""
        try:
            slots = self._ring.take_many(n) if self._await_turn(first) else None
        finally:
            self._end_turn(first)
        if slots is not None and self.lifecycle.state is State.CLOSED:
            self._ring.put_many(slots)  # a slot may be the consumer's last
            return None
        return slots

    def _fill_chunk(self, numbered: list[tuple[int, BatchPlan]], slots: list[Slot]) -> bool:
        """Fill the chunk's batches straight into ``slots`` and post them together (one
        wake-up of the consumer), a failure in place of the batch that failed (the
        slots of it and those after it back to the ring); False when one failed."""
        t0 = time.perf_counter()
        arrays, error = self._prepare_chunk(numbered, slots)
        filled = 0
        if arrays:
            plans = [plan for _, plan in numbered[: len(arrays)]]
            filled, failed = _chunk.fill_chunk(self.batches, plans, arrays)
            error = failed or error
        chunk = self._chunk_of(numbered[0][1], self._here_ok)
        self._filled(time.perf_counter() - t0, len(numbered), chunk)
        return self._post_chunk(numbered, slots, filled, error)

    def _prepare_chunk(
        self, numbered: list[tuple[int, BatchPlan]], slots: list[Slot]
    ) -> tuple[list[_chunk.Arrays], Exception | None]:
        """The host arrays of a chunk's batches in their slots (each slot's device work
        done first), and the error that stopped it before the end (or None)."""
        arrays: list[_chunk.Arrays] = []
        try:
            for slot, (_, plan) in zip(slots, numbered, strict=True):
                slot.event.synchronize()  # device work still reading the slot's buffers
                data, label, geometry, _ = slot.prepare(plan, self.device.out_shape(plan))
                arrays.append(_chunk.Arrays(data, label, geometry))
        except Exception as exc:  # delivered to the consumer, in order
            return arrays, self._ring.explain(exc)
        return arrays, None

    def _post_chunk(
        self,
        numbered: list[tuple[int, BatchPlan]],
        slots: list[Slot],
        filled: int,
        error: Exception | None,
    ) -> bool:
        """Issue the device work of a chunk's first ``filled`` batches and post them
        together (one wake-up of the consumer), ``error`` in place of the next one
        (the slots of it and those after it back to the ring); False when one
        failed."""
        made: list[tuple[int, Item]] = []
        for slot, (number, plan) in zip(slots[:filled], numbered, strict=False):
            item = self._issue(slot, number, plan)
            made.append((number, item))
            if not isinstance(item, tuple):
                break
        else:
            if error is not None:
                number = numbered[filled][0]
                made.append((number, self._failed(number, error)[1]))
        held = sum(isinstance(item, tuple) for _, item in made)
        self._ring.put_many(slots[held:])  # nothing after a failed batch is delivered
        self.handoff.post_many(made)
        return held == len(numbered)

    def _await_turn(self, first: int) -> bool:
        """Wait until the chunk planned from batch ``first`` (or that batch, planned
        alone) is the earliest planned without its slots: chunks take their slots in
        number order (a later chunk holding the slots an earlier one waits for would
        wait for it forever). False once closed."""
        with self._turns:
            while min(self._slotless) != first:
                if self.lifecycle.state is State.CLOSED:
                    return False
                self._turns.wait()
        return self.lifecycle.state is not State.CLOSED

    def _end_turn(self, first: int) -> None:
        """The chunk planned from batch ``first`` has its slots, or never will: the
        next one's turn."""
        with self._turns:
            self._slotless.remove(first)
            self._turns.notify_all()

    def _widen_once_slotted(self) -> bool:
        """Every filler runs, once every chunk planned has its slots (a filler taking
        a slot before it plans would hold slots an earlier chunk waits for). False
        once closed."""
        with self._turns:
            while self._slotless:
                if self.lifecycle.state is State.CLOSED:
                    return False
                self._turns.wait()
            if self._widen:
                self._widen = False
                self._wide.set()
        return True

    def _fill_one(self, number: int, plan: BatchPlan, stop: Stop | None) -> bool:
        """Batch ``number`` filled straight into a free slot, posted, then ``stop``."""
        slots = self._take_in_turn(number, 1)
        if slots is None:
            return False
        slot = slots[0]
        try:
            slot.event.synchronize()
            item: Item | None = self._fill_and_issue(slot, number, plan)
        except Exception as exc:
            item = self._failed(number, exc)[1]
        if stop is not None and stop[1] is not None and isinstance(item, tuple):
            self.handoff.post(stop[0], stop[1])  # the end or failure after it
        return self._post(slot, number, item)

    def _plan_chunk(self) -> tuple[list[tuple[int, BatchPlan]], Stop | None]:
        """Number and plan consecutive batches, as many as :func:`chunk_batches` of the
        first allows. Returns them and what ended them early: the end of the epoch,
        a failure, or None once the pipeline is not OPEN (else None). Small batches
        are planned ahead, as many in one call as :func:`planned_together` says for
        the last chunk's size."""
        with self._plan_lock:
            if self._here:  # the consumer plans now
                return [], None
            number, planned = self._plan_next(self._chunk_ahead)
            if not isinstance(planned, BatchPlan):
                return [], (number, planned)
            numbered = [(number, planned)]
            with self._turns:
                self._slotless.append(number)
            want = chunk_batches(planned)
            self._chunk_ahead = planned_together(want)
            return numbered, self._plan_more(numbered, want)

    def _plan_more(self, numbered: list[tuple[int, BatchPlan]], want: int) -> Stop | None:
        """Under the plan lock: number and plan the batches after ``numbered``'s (added
        to it) until it holds ``want``; what ended them early (the end of the epoch, a
        failure), else None."""
        while len(numbered) < want:
            number = self._planned
            self._planned += 1
            try:
                plan = self._next_planned(self._chunk_ahead)
            except Exception as exc:  # delivered to the consumer, in order
                return self._failed(number, exc)
            if plan is None:
                return number, End()
            numbered.append((number, plan))
        return None

    def _failed(self, number: int, exc: Exception) -> tuple[int, Failure]:
        """Batch ``number`` failed: OPEN → FAILING, nothing after it is planned."""
        self.lifecycle.move(State.FAILING)
        return number, Failure(exc)

    # -- planning on the consumer (small batches of raw records) ----------------------
    def _plan_here(self, chunk: int) -> None:
        """A filler found batches small (``chunk`` to a chunk): from now on the consumer
        plans them (:meth:`pump`) and the pool's native threads write their rows, where
        the row kernel is built; else the fillers fill them a chunk at a time."""
        with self._plan_lock:
            if self._here or not self._here_ok or self.lifecycle.state is not State.OPEN:
                return
            if self._pool is None:
                self._pool = row_pool(_chunk.pool_threads(self._here_depth))
            if self._pool is None:  # not built
                self._here_ok = False
                self._wide.clear()
                return
            self._here_chunk = chunk
            self._ring.grow((self._here_depth + 1) * chunk + 1)
            self._unparked.clear()  # (before _here: a filler that sees it waits)
            self._here = True

    def _leave_here(self, deferrable: bool) -> None:
        """The consumer stops planning: batches are large, or (not ``deferrable``) their
        rows could not be started on the pool (the fillers' chunks from now on)."""
        with self._plan_lock:
            self._here = False
            if not deferrable:
                self._here_ok = False
            self._unparked.set()

    def pump(self) -> None:
        """On the consumer's thread, while it plans or has chunks started: post the
        started chunks whose rows were written, in number order, then plan and start
        chunks while fewer than one a filler are started and the ring has slots free.
        Never waits."""
        started = self._started
        with self._pumping:
            while started and started[0].deferral.query():  # type: ignore[union-attr]
                self._collect(started.popleft())
            while (
                self._here
                and len(started) < self._here_depth
                # room is likely only when a chunk's slots are free (asked without a
                # lock); without it, a chunk is tried only when nothing else brings the
                # next batch
                and (
                    self._ring.free_now() >= self._here_chunk
                    or not (started or self.handoff.ready())
                )
                and self._start_chunk()
            ):
                pass

    def wait_started(self) -> bool:
        """The next batch is not in the hand-off: wait for the rows of the first chunk the
        consumer started (the GIL released) and post it. False when none is started."""
        with self._pumping:
            if not self._started:
                return False
            self._collect(self._started.popleft())
        return True

    def started_event(self) -> RowsWritten | None:
        """What completes when the first chunk the consumer started has its rows (the
        async form awaits it); None when none is started."""
        if not self._started:
            return None
        deferral = self._started[0].deferral
        assert deferral is not None  # (a chunk without jobs is posted at once)
        return RowsWritten(deferral)

    def _start_chunk(self) -> bool:
        """Plan a chunk of batches into free slots (taken first: the consumer never waits
        for memory only its own consumption frees) and start its rows on the pool;
        False when nothing more is to be started now."""
        t0 = time.perf_counter()
        with self._plan_lock:
            if not self._here or self.lifecycle.state is not State.OPEN:
                return False
            slots = self._ring.take_free(self._here_chunk)
            if slots is None:
                return False
            number, planned = self._plan_next(self._chunk_ahead)
            if not isinstance(planned, BatchPlan):
                self._ring.put_many(slots)
                if planned is not None:
                    self.handoff.post(number, planned)
                return isinstance(planned, End)
            numbered = [(number, planned)]
            want = self._chunk_of(planned, True)
            self._here_chunk = want
            self._chunk_ahead = planned_together(want)
            stop = self._plan_more(numbered, min(want, len(slots)))
        self._ring.put_many(slots[len(numbered) :])
        slots = slots[: len(numbered)]
        if want > 1:  # room for the chunks started while the consumer is on another
            self._ring.grow(room := (self._here_depth + 1) * want + 1)
            self._pool.stream = _chunk.streamed(planned, room)
        arrays, error = self._prepare_chunk(numbered, slots)
        filled, deferral = 0, None
        if arrays:
            plans = [plan for _, plan in numbered[: len(arrays)]]
            filled, failed, deferral = _chunk.start_chunk(self.batches, plans, arrays, self._pool)
            error = failed or error
        if deferral is not None and deferral.jobs:
            written = RowsWritten(deferral)
            for slot in slots[:filled]:
                slot.event = written  # the close waits for the pool's writes
        elif filled and error is None:  # filled here: not rows the pool can write
            self._leave_here(deferrable=False)
        if want == 1:  # large batches: the fillers fill them
            self._leave_here(deferrable=True)
        self.counters.filled(time.perf_counter() - t0)
        started = Started(numbered, slots, filled, error, deferral, stop)
        if deferral is not None and deferral.jobs:
            self._started.append(started)
        else:  # nothing left to wait for
            self._collect(started)
        return error is None and (stop is None or isinstance(stop[1], End))

    def _collect(self, started: Started) -> None:
        """Post a started chunk's batches once their rows are written (waiting for them,
        the GIL released), a failure in place of the first that failed, then what
        ended planning after them."""
        numbered, slots, filled, error, deferral, stop = started
        if deferral is not None:
            try:
                deferral.finish()
            except Exception as exc:  # the database changed under the read: all of it
                filled, error = 0, exc
        self._post_chunk(numbered, slots, filled, error)
        if stop is not None and stop[1] is not None:
            self.handoff.post(stop[0], stop[1])  # by number: after the chunk's batches

    # -- consumer --------------------------------------------------------------------
    def _check_process(self) -> None:
        here = pid()
        if here != self._pid and self.lifecycle.state is not State.UNOPENED:
            raise StateError(_FORKED_ERROR.format(parent=self._pid, child=here))

    def begin_next(self) -> float:
        """The consumer asks for the next batch; returns when it started waiting (for
        the statistics).

        Raises:
            StateError: the pipeline is closed, failed earlier, or was opened in
                the parent of this forked process.
        """
        if self.lifecycle.state is not State.OPEN or pid() != self._pid:  # (once a batch)
            self._check_process()
            self.lifecycle.check_next()
        if self._here or self._started:
            self.pump()
        return time.perf_counter()

    def taken(self) -> Item:
        """After the consumer was woken: the batch that arrived (or StateError when closed)."""
        self.lifecycle.check_iterable()
        item = self.handoff.take()
        if item is None:  # pragma: no cover - woken without a batch means closed
            raise StateError(CLOSED_ERROR)
        return item

    def arrived(self, item: Item, t0: float) -> Made | None:
        """A batch that arrived; None at the end of an epoch; raises failures."""
        if isinstance(item, End):
            self.counters.waited(time.perf_counter() - t0)
            return None
        if isinstance(item, Failure):
            self.lifecycle.fail(item.exc)
            raise item.exc
        return item

    def device_failed(self, exc: BaseException) -> None:
        """The device work of a batch that arrived failed (the consumer gets ``exc``): the
        loader stops, as after a filler's error."""
        lifecycle = self.lifecycle
        if lifecycle.state is State.OPEN:
            lifecycle.move(State.FAILING)
        if lifecycle.state is State.FAILING:
            lifecycle.fail(exc)

    def deliver(self, slot: Slot, plan: BatchPlan, t0: float) -> Batch:
        """Account for the batch whose device work completed and hand it out."""
        self.counters.delivered(plan.valid, time.perf_counter() - t0, self.device.elapsed(slot))
        self._resume = plan  # its state is made when asked for
        if not self._grown:
            first = self._first_epoch = plan.epoch if self._first_epoch < 0 else self._first_epoch
            self._grown = plan.epoch > first
        src = slot.out if self.device.on_device else slot.host
        # the consumer's stream: the named one, else the one current here
        stream = self._stream
        if stream is None and self.backend.has_device:
            stream = self.backend.current_stream()
        lease = self._ring.lease(slot, stream)
        if src is None or slot.label is None:  # closed by another thread meanwhile
            raise StateError(CLOSED_ERROR)
        if plan.extra:
            extra = {name: slot.extra[name] for name, _ in plan.extra}
            return Batch(src, slot.label, plan, lease, extra=extra)
        return Batch(src, slot.label, plan, lease)
