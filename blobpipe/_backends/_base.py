"""The narrow interface every device backend implements.

A backend allocates host buffers (pinned when it is CUDA) and device buffers,
runs copies between them on streams, and hands back events that say when a
copy has finished. Everything above it (the pool, SyncedMemory, Blob, the
loader) speaks only this interface:

    Backend.alloc_host(nbytes)      -> 1-D uint8 numpy array (pinned on CUDA)
    Backend.alloc_device(nbytes)    -> 1-D uint8 device array (xp array)
    Backend.create_stream()         -> Stream
    Backend.copy_to_device(dst, src, stream) -> Event   (asynchronous)
    Backend.copy_to_host(dst, src, stream)   -> Event   (asynchronous)
    Backend.launch(fn, stream)               -> Event   (asynchronous)
    Backend.fill_device_zero(dst) / release_buffers(buffers)
    Backend.current_stream() / using(stream) / as_stream(obj)
    Backend.record_event(stream) / stream_wait(stream, event) / after_current(stream)
    Backend.bind_thread() / hold_device(view, owner) / check_device_array(a, what)
    Backend.dlpack_stream(stream)
    Event.query() / Event.synchronize() / await wait_event(event) / all_of(events)

Invariants (the stream discipline, docs/design.md):

* a buffer that a copy reads or writes must not be reused or handed out again
  before that copy's event has completed;
* every copy and launch is ordered after the work the caller queued so far on
  its current stream (:meth:`Backend.current_stream`), so device bytes the
  caller's kernels write are there before blobpipe reads them;
* a thread that works for one device (a loader's filler) makes it its current
  device once (:meth:`Backend.bind_thread`) and is never switched to another:
  on CUDA 12 and later, switching a thread to a device creates that device's
  primary context.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType, SimpleNamespace
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

from .._errors import BackendUnavailableError
from . import _hostmem

__all__ = [
    "COMPLETED",
    "Backend",
    "BackendStatistics",
    "CompletedEvent",
    "Event",
    "EventGroup",
    "Stream",
    "all_of",
    "cuda_initialised",
    "finished",
    "hold_array",
    "note_cuda_initialised",
    "wait_event",
]


# set once a CUDA backend was made in this process; a child forked after it
# cannot use CUDA (see _backends.__init__)
_cuda_initialised = threading.Event()


def note_cuda_initialised() -> None:
    """A CUDA backend exists in this process (CUDA is initialised)."""
    _cuda_initialised.set()


def cuda_initialised() -> bool:
    """Whether a CUDA backend was made in this process."""
    return _cuda_initialised.is_set()


def hold_array(
    array: np.ndarray[Any, Any], owner: object, interface: dict[str, Any] | None = None
) -> np.ndarray[Any, Any]:
    """A NumPy array over ``array``'s memory whose base references ``owner``: the
    owner lives as long as the array or anything exported from it (a DLPack
    capsule and the consumer's array keep their producer referenced).
    ``interface``: ``array.__array_interface__``, when the caller kept it (it is
    the same for every call on the same array)."""
    # the base: the memory's interface, the array whose memory it is, and the owner
    base = SimpleNamespace(
        __array_interface__=array.__array_interface__ if interface is None else interface,
        array=array,
        owner=owner,
    )
    held: np.ndarray[Any, Any] = np.asarray(base)
    return held


class Event(abc.ABC):
    """Marks a point in a stream; completes when the work before it has."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True when the work recorded before this event has completed."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the event has completed."""


class CompletedEvent(Event):
    """An event that has always completed (synchronous work, host backend)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return "CompletedEvent()"


COMPLETED = CompletedEvent()


class EventGroup(Event):
    """Completes when every one of ``events`` has (see :func:`all_of`)."""

    def __init__(self, events: tuple[Event, ...]) -> None:
        self.events = events

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()

    def __repr__(self) -> str:
        return f"EventGroup({list(self.events)!r})"


def all_of(events: list[Event] | tuple[Event, ...]) -> Event:
    """One event that completes when all of ``events`` have: groups are flattened,
    completed events dropped; :data:`COMPLETED` when none is left."""
    flat: list[Event] = []
    for e in events:
        for one in e.events if isinstance(e, EventGroup) else (e,):
            if one is not COMPLETED and not isinstance(one, CompletedEvent):
                flat.append(one)
    if not flat:
        return COMPLETED
    if len(flat) == 1:
        return flat[0]
    return EventGroup(tuple(flat))


class Stream(abc.ABC):
    """An ordered queue of device work (copies, kernels).

    A per-thread default stream (CUDA's handle 2, ``cupy.cuda.Stream.ptds``) names a
    different stream in every thread: its Stream keeps the thread it was named in
    (:attr:`thread`), and from any other thread (a batch let go in a DLPack deleter
    or a collection) the backend records and waits on the legacy default stream
    instead, which CUDA orders after every per-thread default stream.
    """

    #: the thread whose per-thread default stream this is; None: the same stream
    #: from every thread
    thread: threading.Thread | None = None

    def elsewhere(self) -> bool:
        """True in a thread other than the one whose per-thread default stream this
        names (work and events then go to the legacy default stream)."""
        return self.thread is not None and self.thread is not threading.current_thread()

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until all work queued on this stream has completed."""

    def same(self, other: Stream) -> bool:
        """True when ``other`` queues work on the same device stream as this one."""
        return other is self

    def idle(self) -> bool:
        """True when all work queued on this stream so far has completed (an event
        recorded now would be complete already)."""
        return False


async def wait_event(event: Event, *, raising: bool = True) -> None:
    """Wait for ``event`` without blocking the event loop.

    Already-completed events return at once (raising the error of the work they
    cover, if it failed, as a wait would); otherwise the blocking wait runs
    in a worker thread (CUDA's synchronize releases the GIL), so other tasks
    keep running. Cancellation takes effect once the copy has finished: the
    buffers involved must not be released while the copy may still touch them.
    ``raising=False``: return once the work is over, failed or not (a release).
    """
    if event.query():
        if raising:
            event.synchronize()  # completed: returns at once, or raises what the work raised
        return
    await anyio.to_thread.run_sync(event.synchronize if raising else partial(finished, event))


def finished(event: Event) -> None:
    """Block until ``event`` completed, whether or not the work it covers failed: the
    wait before buffers that work touched are released (the failure itself is
    reported where the work's result is waited for)."""
    try:
        event.synchronize()
    except Exception:  # over all the same; the consumer is told where it waits for it
        pass


@dataclass(frozen=True)
class BackendStatistics:
    """Copy counters of a backend (see :meth:`Backend.statistics`)."""

    h2d_copies: int
    d2h_copies: int
    h2d_bytes: int
    d2h_bytes: int
    host_allocations: int
    device_allocations: int


class Backend:
    """A device backend: host/device allocation, streams, copies, events."""

    #: short name: "cupy", "host", "emulated"
    name: str = "abstract"
    #: True when device buffers exist (cupy, emulated); False for "host"
    has_device: bool = False
    #: True when host buffers are page-locked (CUDA)
    pinned: bool = False

    def __init__(self) -> None:
        self._stats_lock = threading.Lock()
        self._h2d_copies = 0
        self._d2h_copies = 0
        self._h2d_bytes = 0
        self._d2h_bytes = 0
        self._host_allocs = 0
        self._device_allocs = 0
        self._fill_stream: Stream | None = None  # fill_device_zero's

    # -- identity ---------------------------------------------------------
    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    @property
    def device_id(self) -> int | None:
        """The CUDA device ordinal, or None for backends without one."""
        return None

    # -- array module ------------------------------------------------------
    @property
    def xp(self) -> ModuleType:
        """The array module of device arrays (``cupy``, or ``numpy`` for emulation)."""
        self.require_device("xp")
        return np

    def require_device(self, what: str) -> None:
        """Check that this backend has device memory (:attr:`has_device`) before an
        operation that needs it; ``what`` names the operation in the message.

        Returns nothing and changes nothing: on a device backend (cupy, emulated)
        it always passes, on the host backend it always raises.

        Raises:
            BackendUnavailableError: the backend has no device memory (``"host"``).
        """
        if not self.has_device:
            raise BackendUnavailableError(
                f"{what} needs a GPU, but this blob lives on the {self.name!r} backend, which "
                "has no device memory. Use device='cuda' on a machine with CUDA (install "
                "blobpipe[cuda12] or blobpipe[cuda13]), or use the host accessors "
                "(cpu_data(), mutable_cpu_data())."
            )

    # -- allocation ----------------------------------------------------------
    def alloc_host(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A new 1-D uint8 host buffer of ``nbytes`` (pinned where supported), its
        first byte 64-byte aligned.

        Raises MemoryError when the system cannot provide it.
        """
        buf = self._alloc_host(nbytes)
        with self._stats_lock:
            self._host_allocs += 1
        return buf

    def alloc_device(self, nbytes: int) -> Any:
        """A new 1-D uint8 device buffer of ``nbytes``.

        Raises BackendUnavailableError without a device, MemoryError when full.
        """
        self.require_device("device memory")
        buf = self._alloc_device(nbytes)
        with self._stats_lock:
            self._device_allocs += 1
        return buf

    def release_cached(self, kind: str) -> None:
        """Give the blocks the array library caches for ``kind`` ("host" or
        "device") memory back to the system (CuPy's default memory pools, which
        hold the temporaries of device code such as the device transform). A
        blobpipe pool out of memory calls it before its last try."""
        return None

    def release_buffers(self, buffers: list[Any]) -> None:
        """Give ``buffers`` (host or device buffers of this backend, referenced nowhere
        else) back to the system, emptying the list, under this backend's device.

        CUDA's frees synchronise the device (``Memory.__dealloc__``'s ``cudaFree``,
        ``PinnedMemory``'s ``cudaFreeHost``): the caller holds no lock that other
        threads wait for.
        """
        buffers.clear()

    def _alloc_host(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        # fresh memory in transparent huge pages where it is large enough (_hostmem)
        return _hostmem.alloc(nbytes)

    def _alloc_device(self, nbytes: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def fill_device_zero(self, dst: Any) -> None:
        """Zero a device buffer that no queued work uses yet (a fresh pool block).

        The fill runs on a stream of its own, not ordered after the caller's
        current stream, and the call returns once it has run: the calling thread
        waits for the fill alone, never for the work it queued before.
        """
        self.require_device("fill_device_zero")
        self._launch(lambda: dst.fill(0), self._zero_stream()).synchronize()

    def _zero_stream(self) -> Stream:
        """The stream of :meth:`fill_device_zero` (made on first use)."""
        with self._stats_lock:
            stream = self._fill_stream
        if stream is None:
            made = self.create_stream()
            with self._stats_lock:
                if self._fill_stream is None:
                    self._fill_stream = made
                stream = self._fill_stream
        return stream

    # -- streams and copies ------------------------------------------------------
    def create_stream(self) -> Stream:
        """A new non-blocking stream."""
        self.require_device("create_stream")
        raise NotImplementedError  # pragma: no cover

    def default_stream(self) -> Stream:
        """The stream used when a caller passes none."""
        self.require_device("default_stream")
        raise NotImplementedError  # pragma: no cover

    def copy_to_device(
        self, dst: Any, src: np.ndarray[Any, Any], stream: Stream | None = None
    ) -> Event:
        """Start copying host ``src`` into device ``dst`` (same byte size); return its event."""
        self.require_device("copy_to_device")
        if src.nbytes != dst.nbytes:
            raise ValueError(
                f"copy size mismatch: {src.nbytes} host bytes, {dst.nbytes} device bytes"
            )
        stream = stream or self.default_stream()
        self.after_current(stream)
        event = self._copy_to_device(dst, src, stream)
        with self._stats_lock:
            self._h2d_copies += 1
            self._h2d_bytes += src.nbytes
        return event

    def copy_to_host(
        self, dst: np.ndarray[Any, Any], src: Any, stream: Stream | None = None
    ) -> Event:
        """Start copying device ``src`` into host ``dst`` (same byte size); return its event."""
        self.require_device("copy_to_host")
        if src.nbytes != dst.nbytes:
            raise ValueError(
                f"copy size mismatch: {src.nbytes} device bytes, {dst.nbytes} host bytes"
            )
        stream = stream or self.default_stream()
        self.after_current(stream)
        event = self._copy_to_host(dst, src, stream)
        with self._stats_lock:
            self._d2h_copies += 1
            self._d2h_bytes += src.nbytes
        return event

    def _copy_to_device(self, dst: Any, src: np.ndarray[Any, Any], stream: Stream) -> Event:
        raise NotImplementedError  # pragma: no cover

    def _copy_to_host(self, dst: np.ndarray[Any, Any], src: Any, stream: Stream) -> Event:
        raise NotImplementedError  # pragma: no cover

    def launch(self, fn: Callable[[], object], stream: Stream | None = None) -> Event:
        """Run device work ``fn`` (kernels on ``xp`` arrays) in ``stream``'s order.

        ``fn`` runs after the work already queued on the stream (e.g. the copy
        that brings its input) and after the work the caller queued so far on
        its current stream; the returned event completes after it.
        """
        self.require_device("launch")
        stream = stream or self.default_stream()
        self.after_current(stream)
        return self._launch(fn, stream)

    def _launch(self, fn: Callable[[], object], stream: Stream) -> Event:
        raise NotImplementedError  # pragma: no cover

    def record_event(self, stream: Stream | None = None, *, timing: bool = False) -> Event:
        """An event that completes when the work queued so far on ``stream`` has.

        With ``timing``, two such events can be passed to :meth:`elapsed`.
        """
        self.require_device("record_event")
        raise NotImplementedError  # pragma: no cover

    def elapsed(self, start: Event, end: Event) -> float:
        """Seconds between two completed timing events (``record_event(timing=True)``)."""
        self.require_device("elapsed")
        raise NotImplementedError  # pragma: no cover

    def synchronize(self) -> None:
        """Wait for all outstanding device work of this backend."""
        return None

    # -- the caller's stream ------------------------------------------------------
    def current_stream(self) -> Stream:
        """The calling thread's current stream on this device: where the caller's
        own device work goes (CuPy's current stream; on the emulated device the
        stream :meth:`using` made current, else its null stream)."""
        self.require_device("current_stream")
        raise NotImplementedError  # pragma: no cover

    def using(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        """Inside the ``with`` block, ``stream`` is the calling thread's current
        stream and this backend's device the current device (CuPy's ``with
        device, stream``); both are restored after it."""
        self.require_device("using")
        raise NotImplementedError  # pragma: no cover

    def as_stream(self, stream: object) -> Stream:
        """A Stream of this backend for a caller's stream: a Stream of this
        backend as is; on CUDA also a CuPy stream, a torch stream (its
        ``cuda_stream`` handle) or a raw ``cudaStream_t`` handle (an int).

        The caller keeps a raw handle's stream alive while blobpipe uses it (a
        stream object is kept referenced).

        Raises:
            TypeError: ``stream`` is none of those.
            ArgumentError: a stream of another device (a ValueError).
        """
        self.require_device("as_stream")
        raise NotImplementedError  # pragma: no cover

    def stream_wait(self, stream: Stream, event: Event) -> None:
        """Work queued on ``stream`` after this call runs only once ``event`` has
        completed (``cudaStreamWaitEvent``); the calling thread does not wait.
        An :class:`EventGroup` is waited for event by event."""
        self.require_device("stream_wait")
        for one in event.events if isinstance(event, EventGroup) else (event,):
            if not one.query():
                self._stream_wait(stream, one)

    def _stream_wait(self, stream: Stream, event: Event) -> None:
        raise NotImplementedError  # pragma: no cover

    # -- threads, exports, foreign arrays ----------------------------------------------
    def bind_thread(self) -> None:
        """Make this backend's device the calling thread's current device for good.

        For threads that work for this device only (a loader's fillers): later
        device scopes in the thread find it current and switch nothing, so the
        thread never touches (on CUDA: never creates a context on) another
        device. Cheap when already bound. Nothing without a device.
        """
        return None

    def hold_device(self, view: Any, owner: object) -> Any:
        """A device array over the memory of device array ``view`` that keeps
        ``owner`` referenced for as long as it, or anything made from it (a
        DLPack capsule, the consumer's tensor), lives."""
        self.require_device("hold_device")
        raise NotImplementedError  # pragma: no cover

    def check_device_array(self, array: Any, what: str) -> None:
        """Raise UnsupportedOperationError unless ``array`` is memory of this
        backend's device (``what`` names the operation)."""
        self.require_device(what)

    def dlpack_stream(self, stream: object) -> Stream | None:
        """The stream a DLPack consumer named in ``__dlpack__(stream=...)``, as a
        Stream of this backend; None when it asks for no ordering (-1)."""
        self.require_device("dlpack_stream")
        raise NotImplementedError  # pragma: no cover

    def after_current(self, stream: Stream) -> None:
        """Order ``stream`` after the work queued so far on the caller's current stream
        of this backend's device, whichever device is current (no host wait).

        Kernels a user runs on ``mutable_gpu_data()`` arrays go to the current
        stream, which blobpipe's non-blocking streams do not wait for by
        themselves: without this, a copy or a Blob operation could read device
        bytes before the kernel that writes them has run.
        """
        current = self.current_stream()
        if not current.same(stream):
            self.stream_wait(stream, self.record_event(current))

    # -- views -----------------------------------------------------------------
    def device_view(self, buf: Any, dtype: Any, shape: tuple[int, ...], readonly: bool) -> Any:
        """A typed, shaped view of the first bytes of device buffer ``buf``.

        ``readonly`` is honoured where the array module supports it (numpy);
        CuPy arrays have no read-only flag.
        """
        self.require_device("device_view")
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        view = buf[: n * dt.itemsize].view(dt).reshape(shape)
        if readonly and isinstance(view, np.ndarray):
            view.flags.writeable = False
        return view

    # -- statistics ------------------------------------------------------------
    def statistics(self) -> BackendStatistics:
        """Counts of copies and raw allocations made through this backend."""
        with self._stats_lock:
            return BackendStatistics(
                h2d_copies=self._h2d_copies,
                d2h_copies=self._d2h_copies,
                h2d_bytes=self._h2d_bytes,
                d2h_bytes=self._d2h_bytes,
                host_allocations=self._host_allocs,
                device_allocations=self._device_allocs,
            )
