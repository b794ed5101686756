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

Device indices, as on CUDA: ``EmulatedBackend(device_id=1)`` is a second device.
Each thread has a current emulated device (0 unless ``using()`` says otherwise;
a stream's thread has its backend's). Device arrays (:class:`EmulatedArray`)
belong to a device: the backend's for its allocations, the current one for
arrays its ``xp`` makes. As CuPy does, device work on an array of another
device than the current one raises ValueError, and a copy refuses memory of
another device, so work issued outside its device's scope shows as an error.

Switching devices is modelled as CUDA 12 does it: a fresh thread's current device
is 0 without having touched it; every switch (``using()`` entering or leaving,
:func:`use_device`, :meth:`EmulatedBackend.bind_thread`) *touches* the device it
switches to, as ``cudaSetDevice`` creates that device's primary context.
:func:`touched_devices` tells which devices a thread has touched, so a worker
thread that creates a context on a device it does not use shows in a test.
(Not modelled: the context's memory, and CUDA calls that touch device 0 without
a switch, e.g. a runtime API call before any ``cudaSetDevice``.)

Per-thread default streams, as CUDA's handle 2 (``cudaStreamPerThread``,
``cupy.cuda.Stream.ptds``): :attr:`EmulatedBackend.per_thread` names, in each
thread that uses it, that thread's own stream. The legacy default stream (the
null stream) waits for them: work queued on it, an event recorded on it included,
runs after the work queued so far on every per-thread default stream of its
backend, as CUDA orders the legacy stream after every blocking stream. (Not
modelled: the other direction, per-thread default streams waiting for the legacy
one.)

Streams belong to a device: an event recorded, a copy or a kernel queued by one
device's backend on a stream of another fails, as CUDA's invalid resource handle.

Frees, as ``cudaFree`` does them: a device buffer of :meth:`EmulatedBackend.alloc_device`
going back to the system (its last reference dropped) first waits for all work
queued on every stream of its backend, so a free made while a lock is held keeps
that lock for as long as the device is busy. A free from a thread whose current
device is another one is counted (:attr:`EmulatedBackend.frees_off_device`): on
CUDA it runs in that device's context (in a fresh thread, creating one on device 0).

DLPack: ``backend.xp.from_dlpack(obj)`` calls
``obj.__dlpack__(stream=<the caller's current stream>)``, as CuPy and torch pass
theirs, so a producer that ignores the consumer's stream shows. A device array's
own ``__dlpack__(stream=...)`` does what CuPy's does (``cupy/_core/core.pyx``): the
consumer's stream (None or 1: the legacy default stream of the *current* device;
0 the same, with CuPy's warning; -1: no ordering) waits for the current stream of
the calling thread's *current device*, which need not be the array's.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np

from .._errors import ArgumentError, UnsupportedOperationError
from ._base import Backend, Event, Stream, hold_array

__all__ = [
    "EmulatedArray",
    "EmulatedBackend",
    "EmulatedEvent",
    "EmulatedStream",
    "PerThreadStream",
    "current_device",
    "touched_devices",
    "use_device",
]


class EmulatedEvent(Event):
    """Completes when the work queued before it on its stream has run."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.completed_at = 0.0  # time.perf_counter() when it completed
        self.error: BaseException | None = None  # raised by the work before it

    def _set(self) -> None:
        self.completed_at = time.perf_counter()
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        """Wait for it; raises the error of the work it covers, if that failed."""
        self._done.wait()
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        return f"<EmulatedEvent {'done' if self.query() else 'pending'}>"


_STOP = object()
_device = threading.local()  # .id: the calling thread's current emulated device
# device id -> the emulated backend made last for it (whose streams are that device's)
_backends: dict[int, weakref.ref[EmulatedBackend]] = {}
_touched_lock = threading.Lock()
# thread -> the devices it switched to (its contexts)
_touched: weakref.WeakKeyDictionary[threading.Thread, set[int]] = weakref.WeakKeyDictionary()


def current_device() -> int:
    """The calling thread's current emulated device (0 unless set)."""
    return int(getattr(_device, "id", 0))


def _switch(device_id: int) -> None:
    """``cudaSetDevice``: the device becomes current and is touched (its context made)."""
    _device.id = device_id
    with _touched_lock:
        _touched.setdefault(threading.current_thread(), set()).add(device_id)


def use_device(device_id: int) -> None:
    """Make ``device_id`` the calling thread's current emulated device, for good
    (``cupy.cuda.Device(n).use()``, ``torch.cuda.set_device(n)``)."""
    _switch(int(device_id))


def touched_devices(thread: threading.Thread | None = None) -> set[int]:
    """The emulated devices ``thread`` (default: the calling one) was ever switched
    to: on CUDA 12, the devices it created a primary context on."""
    with _touched_lock:
        return set(_touched.get(thread or threading.current_thread(), ()))


@contextlib.contextmanager
def _device_scope(device_id: int) -> Iterator[None]:
    """CuPy's ``with Device(n)``: switch when another device is current; on exit
    set the previous device again (always, as CuPy's ``Device.__exit__`` does)."""
    previous = current_device()
    if previous != device_id:
        _switch(device_id)
    try:
        yield
    finally:
        _switch(previous)


class EmulatedArray(np.ndarray):
    """A NumPy array standing in for memory of emulated device ``device_id``.

    Elementwise work (ufuncs) on it from a thread whose current emulated device
    is another raises ValueError, as CuPy's kernels do; ``get()`` copies it to a
    plain NumPy array after the work queued so far on the caller's current
    stream, as CuPy's does.
    """

    device_id: int
    backend: Callable[[], EmulatedBackend | None] | None

    def __array_finalize__(self, obj: Any) -> None:
        self.device_id = getattr(obj, "device_id", current_device())
        self.backend = getattr(obj, "backend", None)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        here = current_device()
        out = kwargs.get("out") or ()
        for a in (*inputs, *out):
            if isinstance(a, EmulatedArray) and a.device_id != here:
                raise ValueError(
                    f"array device must be same as the current device: array device = "
                    f"{a.device_id} while current = {here} (emulated; enter the array's "
                    "device first, e.g. backend.using(stream))"
                )
        plain = tuple(a.view(np.ndarray) if isinstance(a, EmulatedArray) else a for a in inputs)
        if out:
            kwargs["out"] = tuple(
                o.view(np.ndarray) if isinstance(o, EmulatedArray) else o for o in out
            )
        result = getattr(ufunc, method)(*plain, **kwargs)
        if out:
            return out[0] if len(out) == 1 else out
        if isinstance(result, np.ndarray):
            return result.view(EmulatedArray)
        return result

    def __dlpack__(self, *, stream: Any = None, **kwargs: Any) -> Any:
        """CuPy's hand-shake, then NumPy's export (see the module docstring)."""
        here = current_device()
        own = self.backend() if self.backend is not None else None
        if own is None or own.emulated_device != here:
            ref = _backends.get(here)
            own = ref() if ref is not None else None
        if own is not None:
            if isinstance(stream, int) and not isinstance(stream, bool) and stream == 0:
                warnings.warn(
                    "Stream 0 is passed from a library that you are converting to; CuPy "
                    "assumes 0 as a legacy default stream. Please report this problem to "
                    "the library as this violates the DLPack protocol.",
                    stacklevel=2,
                )
                stream = 1
            consumer = own.dlpack_stream(stream)
            current = own.current_stream()
            if consumer is not None and not consumer.same(current):
                own.stream_wait(consumer, own.record_event(current))
        return np.ndarray.__dlpack__(self, **kwargs)

    def get(self) -> np.ndarray[Any, Any]:
        """A host copy (a plain NumPy array), after the current stream's work."""
        backend = self.backend() if self.backend is not None else None
        if backend is not None:
            backend.current_stream().synchronize()
        return np.array(self.view(np.ndarray))


_MAKERS = frozenset(
    {"array", "asarray", "ascontiguousarray", "empty", "zeros", "ones", "full", "arange"}
    | {"empty_like", "zeros_like", "ones_like", "full_like"}
)


class _Capsule:
    """Hands a DLPack capsule already made to ``numpy.from_dlpack``."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class _DeviceNumpy(ModuleType):
    """NumPy whose array constructors make :class:`EmulatedArray` s of the current
    emulated device (CuPy's make arrays on the current CUDA device), and whose
    ``from_dlpack`` passes the caller's current stream, as CuPy's does."""

    def __init__(self, backend: EmulatedBackend) -> None:
        super().__init__("blobpipe.testing.xp", "NumPy over the emulated device")
        self._backend = weakref.ref(backend)

    def from_dlpack(self, obj: Any) -> EmulatedArray:
        """``obj.__dlpack__(stream=<current stream>)`` as an array of the current device."""
        backend = self._backend()
        stream = backend.current_stream() if backend is not None else None
        capsule = obj.__dlpack__(stream=stream)
        made = np.from_dlpack(_Capsule(capsule)).view(EmulatedArray)
        made.device_id = current_device()
        made.backend = self._backend
        return made

    def __getattr__(self, name: str) -> Any:
        attr = getattr(np, name)
        if name not in _MAKERS:
            return attr

        def make(*args: Any, **kwargs: Any) -> EmulatedArray:
            made = np.asarray(attr(*args, **kwargs)).view(EmulatedArray)
            made.device_id = current_device()
            made.backend = self._backend
            return made

        return make


def _free_device(backend_ref: weakref.ref[EmulatedBackend], device_id: int) -> None:
    """``cudaFree`` of a buffer of device ``device_id``: counted when the calling
    thread's current device is another; waits for every stream of the device's
    backend (except from a stream's own thread, where CUDA would never free)."""
    backend = backend_ref()
    if backend is None:
        return
    if current_device() != device_id:
        with backend._lock:
            backend.frees_off_device += 1
    if not getattr(_device, "worker", False):
        backend.synchronize()


def _worker(q: queue.SimpleQueue[Any], delay_ref: Callable[[], float], device_id: int) -> None:
    _switch(device_id)
    _device.worker = True
    failed: BaseException | None = None  # the stream's first error: sticky, as CUDA's
    while True:
        item = q.get()
        if item is _STOP:
            return
        fn, event, delay = item
        d = delay_ref() if delay is None else delay
        if d > 0:
            threading.Event().wait(d)
        try:
            if fn is not None and failed is None:
                fn()
        except BaseException as exc:  # kept for synchronize(), as CUDA reports it
            failed = exc
        finally:
            # every event after a failed piece of work reports it: work queued later
            # on the stream may depend on it (a batch's copy, then its kernel)
            event.error = failed
            event._set()


class EmulatedStream(Stream):
    """An ordered work queue served by one daemon thread."""

    def __init__(self, backend: EmulatedBackend) -> None:
        self._backend = weakref.ref(backend)
        self.device_id = backend.emulated_device
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._last: EmulatedEvent | None = None  # the event of the last work queued
        backend_ref = weakref.ref(backend)

        def delay() -> float:
            b = backend_ref()
            return b.delay if b is not None else 0.0

        self._thread = threading.Thread(
            target=_worker,
            args=(self._queue, delay, backend.emulated_device),
            name="blobpipe-emulated-stream",
            daemon=True,
        )
        self._thread.start()
        weakref.finalize(self, self._queue.put, _STOP)

    def enqueue(
        self, fn: Callable[[], None] | None, *, delay: float | None = None
    ) -> EmulatedEvent:
        """Queue ``fn`` to run after the work queued before it, ``delay`` seconds
        late (None: the backend's ``delay``); the event completes after it ran."""
        event = EmulatedEvent()
        self._last = event
        self._queue.put((fn, event, delay))
        return event

    def idle(self) -> bool:
        last = self._last
        return last is None or last.query()

    def synchronize(self) -> None:
        self.enqueue(None, delay=0.0).synchronize()


class _LegacyStream(EmulatedStream):
    """The null stream: its work runs after the work queued so far on every
    per-thread default stream of its backend (CUDA's legacy default stream)."""

    def enqueue(
        self, fn: Callable[[], None] | None, *, delay: float | None = None
    ) -> EmulatedEvent:
        backend = self._backend()
        if backend is not None:
            before = [e for e in backend._per_thread_events() if not e.query()]
            if before:

                def wait() -> None:
                    for event in before:
                        event.synchronize()

                super().enqueue(wait, delay=0.0)
        return super().enqueue(fn, delay=delay)


class PerThreadStream(Stream):
    """CUDA's per-thread default stream handle (2, ``cupy.cuda.Stream.ptds``): work
    queued on it goes to the per-thread default stream of the thread that queues it.

    The backend's Streams for it (``as_stream``, ``current_stream``,
    ``dlpack_stream(2)``) keep the thread they were made in (``thread``): from
    another thread their work goes to the null stream, which waits for it."""

    def __init__(self, backend: EmulatedBackend, thread: threading.Thread | None = None) -> None:
        self._backend = weakref.ref(backend)
        self.thread = thread

    def _resolve(self) -> EmulatedStream:
        backend = self._backend()
        if backend is None:
            raise RuntimeError("the emulated backend of this stream is gone")
        return backend._stream(self)

    def synchronize(self) -> None:
        self._resolve().synchronize()

    def idle(self) -> bool:
        return not self.elsewhere() and self._resolve().idle()

    def same(self, other: Stream) -> bool:
        return (
            isinstance(other, PerThreadStream)
            and other._backend() is self._backend()
            and other.thread is self.thread
        )

    def __repr__(self) -> str:
        return "<PerThreadStream>"


class EmulatedBackend(Backend):
    """A stand-in for a CUDA device whose copies finish later, on worker threads.

    ``delay`` (seconds) is added before every copy; raise it in a test to make a
    missing wait show up as wrong data.
    """

    name = "emulated"
    has_device = True
    pinned = False

    def __init__(self, delay: float = 0.0, device_id: int = 0) -> None:
        super().__init__()
        self.delay = float(delay)
        self.emulated_device = int(device_id)
        self._default: EmulatedStream | None = None
        self._null: EmulatedStream | None = None
        self._streams: weakref.WeakSet[EmulatedStream] = weakref.WeakSet()
        # (thread, its per-thread default stream): kept until the thread ended and
        # the stream ran its work, which the legacy stream waits for meanwhile
        self._per_thread: list[tuple[threading.Thread, EmulatedStream]] = []
        #: the per-thread default stream's handle (CUDA's 2, ``cupy.cuda.Stream.ptds``)
        self.per_thread = PerThreadStream(self)
        # re-entrant: a device buffer's free (a finalizer) may run while it is held
        self._lock = threading.RLock()
        # .stream: the stream using() made current; .per_thread: this thread's default
        self._local = threading.local()
        self._xp = _DeviceNumpy(self)
        _backends[self.emulated_device] = weakref.ref(self)
        #: device buffers freed from a thread whose current device was another
        self.frees_off_device = 0

    def __repr__(self) -> str:
        return f"<EmulatedBackend emulated:{self.emulated_device}>"

    @property
    def xp(self) -> ModuleType:
        return self._xp

    def _alloc_device(self, nbytes: int) -> Any:
        buf = np.empty(nbytes, dtype=np.uint8).view(EmulatedArray)
        buf.device_id = self.emulated_device
        buf.backend = weakref.ref(self)
        # its free synchronises the device, as cudaFree does (not at the interpreter's exit)
        weakref.finalize(buf, _free_device, buf.backend, self.emulated_device).atexit = False
        return buf

    def release_buffers(self, buffers: list[Any]) -> None:
        with _device_scope(self.emulated_device):
            buffers.clear()

    def _own(self, array: Any, what: str) -> Any:
        """``array`` as flat bytes, refused when it is memory of another device."""
        device = getattr(array, "device_id", self.emulated_device)
        if device != self.emulated_device:
            raise ValueError(
                f"{what}: memory of emulated device {device} given to emulated device "
                f"{self.emulated_device}"
            )
        return array.reshape(-1).view(np.uint8)

    def fill_device_zero(self, dst: Any) -> None:
        # as the base does, without the emulated copy delay: a memset of a fresh block
        self.require_device("fill_device_zero")
        stream = self._stream(self._zero_stream())
        stream.enqueue(lambda: dst.fill(0), delay=0.0).synchronize()

    def bind_thread(self) -> None:
        if getattr(_device, "id", None) != self.emulated_device:
            _switch(self.emulated_device)

    def hold_device(self, view: Any, owner: object) -> Any:
        held: EmulatedArray = hold_array(view, owner).view(EmulatedArray)
        held.device_id = getattr(view, "device_id", self.emulated_device)
        held.backend = weakref.ref(self)
        return held

    def check_device_array(self, array: Any, what: str) -> None:
        device = getattr(array, "device_id", None)
        if not isinstance(array, EmulatedArray) or device is None:
            raise UnsupportedOperationError(
                f"{what}: expected memory of emulated device {self.emulated_device} (an "
                f"array made by backend.xp or alloc_device), got host memory "
                f"({type(array).__name__})"
            )
        if device != self.emulated_device:
            raise UnsupportedOperationError(
                f"{what}: the array is memory of emulated device {device}, this blob "
                f"lives on emulated device {self.emulated_device}; copy it there first"
            )

    def dlpack_stream(self, stream: object) -> Stream | None:
        if isinstance(stream, int) and not isinstance(stream, bool):
            # -1: no ordering; 2: the per-thread default stream; CUDA's other
            # handles (1 legacy, a cudaStream_t): the null stream stands in
            if stream == -1:
                return None
            return self.as_stream(self.per_thread) if stream == 2 else self.null_stream()
        if stream is None:
            return self.null_stream()  # DLPack: None means the legacy default stream
        return self.as_stream(stream)

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
        default stream: it waits for the per-thread default streams)."""
        with self._lock:
            if self._null is None:
                self._null = _LegacyStream(self)
                self._streams.add(self._null)
            return self._null

    def _per_thread_stream(self) -> EmulatedStream:
        """The calling thread's per-thread default stream (made on first use)."""
        stream: EmulatedStream | None = getattr(self._local, "per_thread", None)
        if stream is None:
            stream = self._local.per_thread = EmulatedStream(self)
            with self._lock:
                self._streams.add(stream)
                self._per_thread.append((threading.current_thread(), stream))
        return stream

    def _per_thread_events(self) -> list[EmulatedEvent]:
        """The last event of every per-thread default stream (what the legacy waits for)."""
        with self._lock:
            self._per_thread = [(t, s) for t, s in self._per_thread if t.is_alive() or not s.idle()]
            streams = [s for _, s in self._per_thread]
        return [e for e in (s._last for s in streams) if e is not None]

    def current_stream(self) -> Stream:
        stream: Stream | None = getattr(self._local, "stream", None)
        return self.as_stream(stream) if stream is not None else self.null_stream()

    @contextlib.contextmanager
    def _using(self, stream: Stream) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            with _device_scope(self.emulated_device):
                yield
        finally:
            self._local.stream = previous

    def using(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        self._stream(stream)  # a stream of this backend
        return self._using(stream)

    def as_stream(self, stream: object) -> Stream:
        if isinstance(stream, PerThreadStream):
            if stream.thread is None or stream._backend() is not self:
                # handle 2 names the per-thread default stream of the thread naming it
                return PerThreadStream(self, stream.thread or threading.current_thread())
            return stream
        if isinstance(stream, EmulatedStream):
            if stream.device_id != self.emulated_device:
                raise ArgumentError(
                    f"stream: a stream of emulated device {stream.device_id}, this backend "
                    f"is emulated device {self.emulated_device}; pass one of its own "
                    "(create_stream())"
                )
            return stream
        raise TypeError(
            f"the emulated device takes its own streams (create_stream()), got "
            f"{type(stream).__name__}"
        )

    def _stream_wait(self, stream: Stream, event: Event) -> None:
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

    def _stream(self, stream: Stream) -> EmulatedStream:
        """The emulated stream ``stream`` queues work on in the calling thread."""
        if isinstance(stream, PerThreadStream):
            # another thread's: the legacy stream, which waits for every per-thread one
            return self.null_stream() if stream.elsewhere() else self._per_thread_stream()
        if not isinstance(stream, EmulatedStream):
            raise TypeError(f"expected a stream of the emulated backend, got {stream!r}")
        return stream

    def _on_device(self, stream: Stream) -> EmulatedStream:
        """``stream`` in the calling thread; refused, as CUDA refuses it (invalid
        resource handle), when it is a stream of another device."""
        emulated = self._stream(stream)
        if emulated.device_id != self.emulated_device:
            raise RuntimeError(
                f"cudaErrorInvalidResourceHandle (emulated): work of emulated device "
                f"{self.emulated_device} queued on a stream of emulated device "
                f"{emulated.device_id}"
            )
        return emulated

    def _enqueue(self, stream: Stream, fn: Callable[[], None]) -> Event:
        return self._on_device(stream).enqueue(fn)

    def _copy_to_device(self, dst: Any, src: np.ndarray[Any, Any], stream: Stream) -> Event:
        d = self._own(dst, "copy_to_device")
        s = src.reshape(-1).view(np.uint8)
        return self._enqueue(stream, lambda: np.copyto(d, s))

    def _copy_to_host(self, dst: np.ndarray[Any, Any], src: Any, stream: Stream) -> Event:
        d = dst.reshape(-1).view(np.uint8)
        s = self._own(src, "copy_to_host")
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
        return self._on_device(stream or self.default_stream()).enqueue(None, delay=0.0)

    def synchronize(self) -> None:
        with self._lock:
            streams = list(self._streams)
        for s in streams:
            s.synchronize()
