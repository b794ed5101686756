"""The async driver: a Loader's form for an event loop (``async with``, ``async for``,
``anext``), through anyio, so the same code runs under asyncio and trio.

Every await after a batch left the hand-off is shielded, so a cancellation never
loses a batch or its slot. No task group is entered and no event-loop object is
kept beyond the cached thread-safe caller of the last loop that waited, so a
loader may be opened, iterated and closed from any task (an async generator
finalized in another task, a loop left with ``break``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._backends import COMPLETED, wait_event
from ._batch import Batch
from ._handoff import threadsafe_caller
from ._lifecycle import State
from ._pipeline import Item, Pipeline

__all__ = ["YIELD_EVERY", "AsyncForm"]

#: Seconds: the longest ``async for`` keeps its event loop from other tasks (and a
#: cancellation from its consumer), while batches are ready and while it waits for
#: one in the loop's thread. A turn of the loop costs more than a small batch
#: and lets a busy filler take the GIL, and a wake-up through the loop takes several
#: turns, so neither is taken per batch (docs/performance.md).
YIELD_EVERY = 0.005

_F = TypeVar("_F", bound="AsyncForm")


def _event_loop_running() -> bool:
    """Whether the calling thread runs an event loop anyio knows (asyncio, trio)."""
    try:
        anyio.lowlevel.current_token()
    except RuntimeError:  # anyio's NoEventLoopError
        return False
    return True


class _Opened:
    """What ``loader.open()`` returns where it opened the loader at once (no event
    loop): awaiting it does nothing."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        return
        yield  # a generator that ends at once


_OPENED = _Opened()


class AsyncForm:
    """The Loader's async methods, driving its pipeline ``_pipe`` from an event loop."""

    _pipe: Pipeline  # the Loader's, made before this __init__ runs

    def __init__(self) -> None:
        # when this loader last let the event loop run other tasks (__anext__, open)
        self._yielded = 0.0
        # (event loop token, its thread-safe caller) of the last event loop that waited
        self._caller: tuple[object, Callable[[Callable[[], object]], object]] | None = None

    async def __aenter__(self: _F) -> _F:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def open(self) -> Awaitable[None]:
        """Start the pipeline.

        In async code, ``await loader.open()``; prefer ``async with``, which also
        calls :meth:`aclose`. The device transform's warm-up (when there is one)
        runs in a worker thread; the fillers are plain threads, so :meth:`aclose`
        (or ``close``) may run in any task or thread. A checkpoint either way.

        In plain code (no event loop running in the calling thread),
        ``loader.open()`` opens the loader at once, as ``with loader:`` does, and
        returns an awaitable that does nothing; close it with ``close()``.

        Raises:
            StateError: the loader was opened before (in plain code at once; in
                async code when awaited).
        """
        if _event_loop_running():
            return self._open_async()
        self._pipe.open_here()
        return _OPENED

    async def _open_async(self) -> None:
        pipe = self._pipe
        if pipe.device.on_device:
            await anyio.to_thread.run_sync(pipe.device.warm_up)
        else:  # nothing to warm up: no worker thread (a first epoch pays for one)
            await anyio.lowlevel.checkpoint()
        pipe.start()
        # the loop ran other tasks just now: the first batch is waited for in this thread
        # while YIELD_EVERY lasts, as any other (a wake-up through the loop costs more)
        self._yielded = time.perf_counter()

    async def aclose(self) -> None:
        """Stop the pipeline: no thread left running, every block back in the pool.
        The fillers are awaited shielded from cancellation: in the loop's thread for up
        to YIELD_EVERY (each finishes the batch it fills, mostly sooner: a worker
        thread's start would cost more), then in a worker thread. Idempotent; callable
        from any task, also inside ``async with``."""
        pipe = self._pipe
        if not pipe.begin_close():
            return
        with anyio.CancelScope(shield=True):
            if not pipe.wait_fillers(YIELD_EVERY):
                await anyio.to_thread.run_sync(pipe.wait_fillers)
            await pipe.settle()
            pipe.release()

    def __aiter__(self) -> AsyncIterator[Batch]:
        self._pipe.lifecycle.check_closed()
        return self

    async def __anext__(self) -> Batch:
        """The next batch; the first call opens a Loader that was not entered.

        Raises:
            StopAsyncIteration: at the end of an epoch (``mode="epoch"``).
            BlobpipeError: the error a worker raised filling this batch (e.g. a
                DataError naming the record key and the database).
            StateError: the loader is closed or failed earlier, or was opened in
                the parent of this forked process.
        """
        pipe = self._pipe
        if pipe.lifecycle.state is State.UNOPENED:
            await self.open()
        # A batch already there costs no checkpoint while the event loop ran other
        # tasks less than YIELD_EVERY ago; else it gets one. So a consumer whose body
        # never awaits is still cancelled (and times out) within YIELD_EVERY of its
        # own time, and other tasks run at least that often; a wait for a batch that
        # is not there is a cancellation point at once (``_wait``).
        t0 = pipe.begin_next()
        handoff = pipe.handoff
        if t0 - self._yielded >= YIELD_EVERY and handoff.ready():
            await anyio.lowlevel.checkpoint()
            t0 = self._yielded = time.perf_counter()
            pipe.lifecycle.check_iterable()
        item = handoff.take()
        if item is None:
            item = await self._wait(pipe)
        made = pipe.arrived(item, t0)
        if made is None:
            raise StopAsyncIteration
        done = made[0].event
        if done is COMPLETED:  # (no device: nothing to wait for)
            return pipe.deliver(*made, t0)
        try:
            if done.query():
                done.synchronize()  # completed: returns at once, or raises what failed
            else:
                # Shielded: the batch has left the hand-off, so a cancellation here
                # would lose it and its slot. The wait is bounded by the copy.
                with anyio.CancelScope(shield=True):
                    await wait_event(done)
        except Exception as exc:  # its device work failed
            pipe.device_failed(exc)
            raise
        return pipe.deliver(*made, t0)

    async def _wait(self, pipe: Pipeline) -> Item:
        """The next batch (or end, or failure), which was not there: waited for in
        the event loop's thread while the loop's YIELD_EVERY lasts (one wake-up of
        this thread; when it is spent, after a turn of the loop, for a YIELD_EVERY
        more), then through the event loop (a checkpoint)."""
        handoff = pipe.handoff
        started = pipe.started_event()
        if started is not None:  # the consumer's own chunk: its rows, then it is posted
            # Its rows are waited for in this thread, the GIL released, for up to
            # YIELD_EVERY since the loop last ran other tasks (after a turn of the loop,
            # when that time is spent: cheaper than a worker thread's wake-up), then in
            # a worker thread. A cancellation at either checkpoint loses nothing: the
            # chunk stays started, and the next call waits for it.
            here = YIELD_EVERY - (time.perf_counter() - self._yielded)
            if started.query() or here > 0:
                await anyio.lowlevel.checkpoint_if_cancelled()
            else:
                await anyio.lowlevel.checkpoint()
                self._yielded = time.perf_counter()
                here = YIELD_EVERY
                pipe.lifecycle.check_iterable()  # (closed meanwhile by another task)
            if not started.query() and not started.wait(here):
                await wait_event(started, raising=False)
                self._yielded = time.perf_counter()
            pipe.pump()
            item = handoff.take()
            if item is not None:
                return item
        # Waited for in this thread, the GIL released, for what is left of YIELD_EVERY
        # since the loop last ran other tasks; when that is spent, after a turn of the
        # loop (other tasks run, a cancellation is seen, nothing is taken yet), for a
        # YIELD_EVERY more: a wake-up through the loop costs more than the turn (a
        # first epoch's batches, 2-5 ms apart, each came through the loop). Past that,
        # through the event loop.
        here = YIELD_EVERY - (time.perf_counter() - self._yielded)
        if here > 0:
            await anyio.lowlevel.checkpoint_if_cancelled()
            if handoff.wait(here):
                return pipe.taken()
        await anyio.lowlevel.checkpoint()
        self._yielded = time.perf_counter()
        pipe.lifecycle.check_iterable()  # (closed meanwhile by another task)
        if YIELD_EVERY > 0 and handoff.wait(YIELD_EVERY):
            return pipe.taken()
        event = anyio.Event()
        call_soon = self._threadsafe_caller()
        item = handoff.take(lambda: call_soon(event.set))
        if item is None:
            try:
                await event.wait()
            finally:
                handoff.forget_waiter()
            self._yielded = time.perf_counter()
            return pipe.taken()
        # it arrived meanwhile and is taken: a cancellation now would lose it, so
        # this call's checkpoint is a shielded one
        await anyio.lowlevel.cancel_shielded_checkpoint()
        return item

    def _threadsafe_caller(self) -> Callable[[Callable[[], object]], object]:
        """The running event loop's thread-safe caller (cached per loop)."""
        token = anyio.lowlevel.current_token()
        caller = self._caller
        if caller is None or caller[0] is not token:
            caller = self._caller = (token, threadsafe_caller())
        return caller[1]
