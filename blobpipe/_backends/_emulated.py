"""An emulated device for tests: real asynchrony without a GPU.

Device memory is separate host memory. Each stream owns a worker thread that
runs its copies in order, each after ``delay`` seconds; the event of a copy
completes only once the bytes have landed. Code that forgets to wait for an
event therefore reads stale bytes, and CPU-only CI catches it.

The caller has a current stream, as on CUDA: the backend's null stream (CUDA's
legacy default stream), or the stream a ``with backend.using(stream)`` block
makes current in the calling thread. Consumer-side device work (a training
step's kernels) is queued there with :meth:`EmulatedBackend.run_later` and runs
late on that stream's thread, so blobpipe code that reads or reuses a buffer
without ordering itself after the consumer's work sees wrong data.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
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
        fn, event, delay = item
        d = delay_ref() if delay is None else delay
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

    def enqueue(
        self, fn: Callable[[], None] | None, *, delay: float | None = None
    ) -> EmulatedEvent:
        """Queue ``fn`` to run after the work queued before it, ``delay`` seconds
        late (None: the backend's ``delay``); the event completes after it ran."""
        event = EmulatedEvent()
        self._queue.put((fn, event, delay))
        return event

    def synchronize(self) -> None:
        self.enqueue(None, delay=0.0).synchronize()


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
        self._null: EmulatedStream | None = None
        self._streams: weakref.WeakSet[EmulatedStream] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._local = threading.local()  # .stream: the stream using() made current

    def _alloc_device(self, nbytes: int) -> Any:
        return np.empty(nbytes, dtype=np.uint8)

    def fill_device_zero(self, dst: Any) -> None:
        self._require_device("fill_device_zero")
        self.current_stream().enqueue(lambda: dst.fill(0), delay=0.0).synchronize()

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

    def null_stream(self) -> EmulatedStream:
        """The stream current in every thread outside :meth:`using` (CUDA's legacy
        default stream)."""
        with self._lock:
            if self._null is None:
                self._null = EmulatedStream(self)
                self._streams.add(self._null)
            return self._null

    def current_stream(self) -> EmulatedStream:
        stream: EmulatedStream | None = getattr(self._local, "stream", None)
        return stream if stream is not None else self.null_stream()

    @contextlib.contextmanager
    def _using(self, stream: EmulatedStream) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def using(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        return self._using(self._stream(stream))

    def as_stream(self, stream: object) -> Stream:
        if isinstance(stream, EmulatedStream):
            return stream
        raise TypeError(
            f"the emulated device takes its own streams (create_stream()), got "
            f"{type(stream).__name__}"
        )

    def stream_wait(self, stream: Stream, event: Event) -> None:
        self._stream(stream).enqueue(event.synchronize, delay=0.0)

    def run_later(
        self, fn: Callable[[], object], seconds: float | None = None, stream: Stream | None = None
    ) -> EmulatedEvent:
        """Queue consumer-side device work ``fn`` (a training step's kernel) on the
        caller's current stream, or ``stream``, to run ``seconds`` late (default:
        ``delay``); returns its event. Nothing waits for it unless ordered after it."""

        def run() -> None:
            fn()

        return self._stream(stream or self.current_stream()).enqueue(run, delay=seconds)

    @staticmethod
    def _stream(stream: Stream) -> EmulatedStream:
        if not isinstance(stream, EmulatedStream):
            raise TypeError(f"expected a stream of the emulated backend, got {stream!r}")
        return stream

    def _enqueue(self, stream: Stream, fn: Callable[[], None]) -> Event:
        return self._stream(stream).enqueue(fn)

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
        return self._stream(stream or self.default_stream()).enqueue(None, delay=0.0)

    def synchronize(self) -> None:
        with self._lock:
            streams = list(self._streams)
        for s in streams:
            s.synchronize()
