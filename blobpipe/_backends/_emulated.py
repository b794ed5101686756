"""An emulated device for tests: real asynchrony without a GPU.

Device memory is separate host memory. Each stream owns a worker thread that
runs its copies in order, each after ``delay`` seconds; the event of a copy
completes only once the bytes have landed. Code that forgets to wait for an
event therefore reads stale bytes, and CPU-only CI catches it.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ._base import Backend, Event, Stream

__all__ = ["EmulatedBackend", "EmulatedEvent", "EmulatedStream"]


class EmulatedEvent(Event):
    """Completes when the work queued before it on its stream has run."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.completed_at = 0.0  # time.perf_counter() when it completed

    def _set(self) -> None:
        self.completed_at = time.perf_counter()
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def __repr__(self) -> str:
        return f"<EmulatedEvent {'done' if self.query() else 'pending'}>"


_STOP = object()


def _worker(q: queue.SimpleQueue[Any], delay_ref: Callable[[], float]) -> None:
    while True:
        item = q.get()
        if item is _STOP:
            return
        fn, event, delayed = item
        if delayed:
            d = delay_ref()
            if d > 0:
                threading.Event().wait(d)
        try:
            if fn is not None:
                fn()
        finally:
            event._set()


class EmulatedStream(Stream):
    """An ordered work queue served by one daemon thread."""

    def __init__(self, backend: EmulatedBackend) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        backend_ref = weakref.ref(backend)

        def delay() -> float:
            b = backend_ref()
            return b.delay if b is not None else 0.0

        self._thread = threading.Thread(
            target=_worker, args=(self._queue, delay), name="blobpipe-emulated-stream", daemon=True
        )
        self._thread.start()
        weakref.finalize(self, self._queue.put, _STOP)

    def enqueue(self, fn: Callable[[], None] | None, *, delayed: bool = True) -> EmulatedEvent:
        event = EmulatedEvent()
        self._queue.put((fn, event, delayed))
        return event

    def synchronize(self) -> None:
        self.enqueue(None, delayed=False).synchronize()


class EmulatedBackend(Backend):
    """A stand-in for a CUDA device whose copies finish later, on worker threads.

    ``delay`` (seconds) is added before every copy; raise it in a test to make a
    missing wait show up as wrong data.
    """

    name = "emulated"
    has_device = True
    pinned = False

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.delay = float(delay)
        self._default: EmulatedStream | None = None
        self._streams: weakref.WeakSet[EmulatedStream] = weakref.WeakSet()
        self._lock = threading.Lock()

    def _alloc_device(self, nbytes: int) -> Any:
        return np.empty(nbytes, dtype=np.uint8)

    def create_stream(self) -> Stream:
        stream = EmulatedStream(self)
        with self._lock:
            self._streams.add(stream)
        return stream

    def default_stream(self) -> Stream:
        with self._lock:
            if self._default is None:
                self._default = EmulatedStream(self)
                self._streams.add(self._default)
            return self._default

    def _enqueue(self, stream: Stream, fn: Callable[[], None]) -> Event:
        if not isinstance(stream, EmulatedStream):
            raise TypeError(f"expected a stream of the emulated backend, got {stream!r}")
        return stream.enqueue(fn)

    def _copy_to_device(self, dst: Any, src: np.ndarray[Any, Any], stream: Stream) -> Event:
        d = dst.reshape(-1).view(np.uint8)
        s = src.reshape(-1).view(np.uint8)
        return self._enqueue(stream, lambda: np.copyto(d, s))

    def _copy_to_host(self, dst: np.ndarray[Any, Any], src: Any, stream: Stream) -> Event:
        d = dst.reshape(-1).view(np.uint8)
        s = src.reshape(-1).view(np.uint8)
        return self._enqueue(stream, lambda: np.copyto(d, s))

    def _launch(self, fn: Callable[[], object], stream: Stream) -> Event:
        def run() -> None:
            fn()

        return self._enqueue(stream, run)

    def elapsed(self, start: Event, end: Event) -> float:
        if not (isinstance(start, EmulatedEvent) and isinstance(end, EmulatedEvent)):
            raise TypeError("elapsed() needs two events of the emulated backend")
        if not (start.query() and end.query()):
            raise ValueError("elapsed() needs two completed events")
        return end.completed_at - start.completed_at

    def record_event(self, stream: Stream | None = None, *, timing: bool = False) -> Event:
        s = stream or self.default_stream()
        if not isinstance(s, EmulatedStream):
            raise TypeError(f"expected a stream of the emulated backend, got {s!r}")
        return s.enqueue(None, delayed=False)

    def synchronize(self) -> None:
        with self._lock:
            streams = list(self._streams)
        for s in streams:
            s.synchronize()
