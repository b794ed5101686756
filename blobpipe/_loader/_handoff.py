"""The numbered hand-off from the fillers to the consumer (Caffe's full queue).

The planner numbers batches 0, 1, 2… in plan order; fillers finish them in any
order and :meth:`Handoff.post` each under its number; the consumer
:meth:`Handoff.take` s them strictly by number. So the consumer sees batches,
epoch ends and errors in plan order whatever finished first, and an error
raised while making a batch reaches it when that batch is due, as the original
exception (a :class:`Failure` holds it), never as an exception group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio.from_thread
import anyio.lowlevel

__all__ = ["End", "Failure", "Handoff", "threadsafe_caller"]

T = TypeVar("T")


class End:
    """The end of an epoch."""


class Failure:
    """The error raised while making a batch, delivered in that batch's place."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Handoff(Generic[T]):
    """Posted items by number; at most one consumer waits, for the next number.

    Thread-safe: fillers post from worker threads, the consumer takes from
    its event loop (or thread).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, T | End | Failure] = {}
        self._next = 0  # the number the consumer takes next
        self._closed = False  # under _lock; a closed hand-off wakes a waiter at once
        # the consumer waiting for the next number: (number, wake), under _lock
        self._waiter: tuple[int, Callable[[], object]] | None = None

    def __len__(self) -> int:
        """Items posted and not taken yet."""
        return len(self._items)

    def ready(self) -> bool:
        """True when the next item is there (a hint: no lock taken)."""
        return self._next in self._items

    def post(self, number: int, item: T | End | Failure) -> None:
        """Post item ``number``; wake the consumer if it waits for this one."""
        self.post_many([(number, item)])

    def post_many(self, items: list[tuple[int, T | End | Failure]]) -> None:
        """Post each ``(number, item)``, waking the consumer at most once, if it waits
        for one of them (it then finds them all): a chunk's batches cost it one
        wake-up. For the async form the wake-up is scheduled on the event loop,
        without blocking the posting filler until it ran."""
        with self._lock:
            self._items.update(items)
            waiter = self._waiter
            if waiter is None or waiter[0] not in self._items:
                return
            self._waiter = None
        try:
            waiter[1]()
        except RuntimeError:  # the event loop is gone (closing)
            pass

    def take(self, wake: Callable[[], object] | None = None) -> T | End | Failure | None:
        """The next item if it was posted; else None, and ``wake`` (if given) is
        called once when it is posted or the hand-off is closed (at once if it was)."""
        with self._lock:
            item = self._items.pop(self._next, None)
            closed = self._closed
            if item is None and wake is not None and not closed:
                self._waiter = (self._next, wake)
        if item is not None:
            self._next += 1
        elif wake is not None and closed:
            wake()
        return item

    def wait(self, timeout: float | None = None) -> bool:
        """Block the calling thread until the next item is posted or the hand-off is
        closed (True), or for at most ``timeout`` seconds (False when it passed).

        One lock acquired twice is the whole mechanism: no event loop, a single
        release of the GIL while waiting.
        """
        woken = threading.Lock()
        woken.acquire()
        with self._lock:
            if self._next in self._items or self._closed:
                return True
            self._waiter = (self._next, woken.release)
        try:
            return woken.acquire(timeout=-1 if timeout is None else timeout)
        finally:
            self.forget_waiter()

    def forget_waiter(self) -> None:
        """The consumer stopped waiting (woken, or cancelled)."""
        with self._lock:
            self._waiter = None

    def close(self) -> None:
        """Drop the posted items and wake a waiting consumer (it finds nothing)."""
        with self._lock:
            self._items.clear()
            self._closed = True
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter[1]()


def threadsafe_caller() -> Callable[[Callable[[], object]], object]:
    """A function that schedules a callback on the running event loop from any thread
    and returns at once (asyncio's ``call_soon_threadsafe``, trio's ``run_sync_soon``).

    anyio's ``from_thread.run_sync`` would block the calling thread until the
    loop ran the callback; it is the fallback for other backends.
    """
    token = anyio.lowlevel.current_token()
    native = token.native_token
    for name in ("call_soon_threadsafe", "run_sync_soon"):
        call = getattr(native, name, None)
        if callable(call):
            return call  # type: ignore[no-any-return]

    def blocking(fn: Callable[[], object]) -> object:
        return anyio.from_thread.run_sync(fn, token=token)

    return blocking
