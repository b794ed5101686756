"""The CUDA backend, on CuPy: pinned host memory, non-blocking streams, events.

CuPy is imported when this backend is first constructed, never at
``import blobpipe``. Works with CuPy 13 and 14: foreign streams are wrapped with
``Stream.from_external`` where it exists (14; ``ExternalStream`` warns there),
else with ``ExternalStream``.

Events are blocking-sync (``cudaEventBlockingSync``): a host thread waiting for one
sleeps instead of spinning a core.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np

from .._errors import ArgumentError, BackendUnavailableError, UnsupportedOperationError
from ._base import Backend, Event, Stream, note_cuda_initialised

__all__ = ["CupyBackend", "import_cupy"]

_INSTALL_HINT = (
    "Install it with: pip install 'blobpipe[cuda12]' (CUDA 12) or 'blobpipe[cuda13]' (CUDA 13), "
    "or use device='cpu'."
)


def import_cupy() -> ModuleType:
    """Import CuPy, or raise BackendUnavailableError saying which extra to install."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(f"CuPy is not installed. {_INSTALL_HINT}") from exc
    return cupy  # type: ignore[no-any-return]


class _CupyEvent(Event):
    def __init__(self, event: Any) -> None:
        self._event = event

    def query(self) -> bool:
        return bool(self._event.done)

    def synchronize(self) -> None:
        self._event.synchronize()


class _Handle:
    """A raw ``cudaStream_t`` (an int) under the CUDA stream protocol
    (``Stream.from_external`` takes objects with ``__cuda_stream__``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


_LEGACY = 1  # cudaStreamLegacy: the legacy default stream of the current device
_PER_THREAD = 2  # cudaStreamPerThread: the calling thread's per-thread default stream


class _CupyStream(Stream):
    """A CuPy stream of the backend's device (``device``: its ``cupy.cuda.Device``).

    Over the per-thread default stream (handle 2) it keeps the thread that named it;
    from another thread its work goes to ``legacy`` (the legacy default stream,
    which CUDA orders after every per-thread default stream).
    """

    def __init__(self, stream: Any, cp: Any, device: Any, legacy: Any = None) -> None:
        self.raw = stream
        self._cp = cp
        self._device = device
        self._legacy = legacy
        self.owner: object = None  # the caller's stream object, kept alive with this
        if int(stream.ptr) == _PER_THREAD:
            self.thread = threading.current_thread()

    def here(self) -> Any:
        """The CuPy stream this names in the calling thread."""
        return self._legacy if self.elsewhere() else self.raw

    def synchronize(self) -> None:
        # on a blocking-sync event, made on the stream's device: the waiting thread
        # sleeps (cudaStreamSynchronize spins or yields, as the device's flags say)
        with self._device:
            event = self._cp.cuda.Event(block=True, disable_timing=True)
            event.record(self.here())
        event.synchronize()

    def idle(self) -> bool:
        return not self.elsewhere() and bool(self.raw.done)  # cudaStreamQuery

    def same(self, other: Stream) -> bool:
        return (
            isinstance(other, _CupyStream)
            and int(other.raw.ptr) == int(self.raw.ptr)
            and other.thread is self.thread
        )


class CupyBackend(Backend):
    """Real CUDA through CuPy on device ``device_id``."""

    name = "cupy"
    has_device = True
    pinned = True

    def __init__(self, device_id: int = 0) -> None:
        super().__init__()
        cp = import_cupy()
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDA driver missing or broken
            raise BackendUnavailableError(
                f"CuPy is installed but CUDA is not usable here ({exc}). Use device='cpu'."
            ) from exc
        if count == 0:
            raise BackendUnavailableError("CuPy found no CUDA device. Use device='cpu'.")
        if not 0 <= device_id < count:
            raise BackendUnavailableError(
                f"CUDA device {device_id} requested, but this machine has {count} "
                f"(valid: cuda:0 .. cuda:{count - 1})."
            )
        self._cp = cp
        self._device_id = device_id
        self._device = cp.cuda.Device(device_id)
        self._default: _CupyStream | None = None
        self._legacy: Any = None  # a CuPy stream over cudaStreamLegacy (made on first use)
        self._lock = threading.Lock()
        self._bound = threading.local()  # .yes: bind_thread() ran in this thread
        note_cuda_initialised()

    @property
    def device_id(self) -> int | None:
        return self._device_id

    def __repr__(self) -> str:
        return f"<CupyBackend cuda:{self._device_id}>"

    @property
    def xp(self) -> ModuleType:
        return self._cp

    def _out_of_memory(self, exc: BaseException) -> bool:
        """Whether a CuPy error is an out-of-memory (the pool may free and retry);
        any other CUDA error is passed on as it is."""
        cp = self._cp
        if isinstance(exc, cp.cuda.memory.OutOfMemoryError):
            return True
        return isinstance(exc, cp.cuda.runtime.CUDARuntimeError) and getattr(
            exc, "status", None
        ) == getattr(cp.cuda.runtime, "errorMemoryAllocation", 2)

    def _alloc_host(self, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        cp = self._cp
        try:
            # Straight from CUDA (cudaHostAlloc, page-aligned: HOST_ALIGN holds),
            # not through CuPy's pinned pool, which rounds to powers of two:
            # blobpipe's own pool does the caching. Under this device: CUDA
            # would otherwise create a context on device 0 for it.
            with self._device:
                mem = cp.cuda.PinnedMemoryPointer(cp.cuda.PinnedMemory(max(nbytes, 1)), 0)
        except Exception as exc:
            if self._out_of_memory(exc):
                raise MemoryError(
                    f"cannot allocate {nbytes} bytes of pinned host memory: {exc}"
                ) from exc
            raise
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def _alloc_device(self, nbytes: int) -> Any:
        cp = self._cp
        with self._device:
            try:
                mem = cp.cuda.Memory(max(nbytes, 1))
            except Exception as exc:
                if self._out_of_memory(exc):
                    raise MemoryError(
                        f"cannot allocate {nbytes} bytes on cuda:{self._device_id}: {exc}"
                    ) from exc
                raise
            ptr = cp.cuda.MemoryPointer(mem, 0)
            return cp.ndarray((nbytes,), dtype=cp.uint8, memptr=ptr)

    def release_buffers(self, buffers: list[Any]) -> None:
        with self._device:
            buffers.clear()

    def release_cached(self, kind: str) -> None:
        cp = self._cp
        with self._device:
            if kind == "host":
                cp.get_default_pinned_memory_pool().free_all_blocks()
            else:
                cp.get_default_memory_pool().free_all_blocks()

    def create_stream(self) -> Stream:
        with self._device:
            return _CupyStream(self._cp.cuda.Stream(non_blocking=True), self._cp, self._device)

    def default_stream(self) -> Stream:
        with self._lock:
            if self._default is None:
                with self._device:
                    self._default = _CupyStream(
                        self._cp.cuda.Stream(non_blocking=True), self._cp, self._device
                    )
            return self._default

    def _record(self, stream: Stream, timing: bool = False) -> Event:
        assert isinstance(stream, _CupyStream)
        # blocking-sync: a host thread that waits for it sleeps instead of spinning
        ev = self._cp.cuda.Event(block=True, disable_timing=not timing, interprocess=False)
        ev.record(stream.here())
        return _CupyEvent(ev)

    def current_stream(self) -> Stream:
        with self._device:
            return self._wrap(self._cp.cuda.get_current_stream())

    def _wrap(self, raw: Any) -> _CupyStream:
        """A Stream of this backend over CuPy stream ``raw``."""
        legacy = None
        if int(raw.ptr) == _PER_THREAD:
            legacy = self._legacy
            if legacy is None:
                legacy = self._legacy = self._external(_LEGACY)
        return _CupyStream(raw, self._cp, self._device, legacy)

    def bind_thread(self) -> None:
        if getattr(self._bound, "yes", False):
            return
        runtime = self._cp.cuda.runtime
        if runtime.getDevice() != self._device_id:
            runtime.setDevice(self._device_id)
        self._bound.yes = True

    def hold_device(self, view: Any, owner: object) -> Any:
        cp = self._cp
        nbytes = int(view.nbytes)
        mem = cp.cuda.UnownedMemory(int(view.data.ptr), nbytes, owner, self._device_id)
        return cp.ndarray(
            view.shape,
            dtype=view.dtype,
            memptr=cp.cuda.MemoryPointer(mem, 0),
            strides=view.strides,
        )

    def check_device_array(self, array: Any, what: str) -> None:
        if not isinstance(array, self._cp.ndarray):
            raise UnsupportedOperationError(
                f"{what}: expected a CuPy array on cuda:{self._device_id}, got "
                f"{type(array).__name__} (host memory: use set_cpu_data)"
            )
        device = int(array.device.id)
        if device != self._device_id:
            raise UnsupportedOperationError(
                f"{what}: the array is on cuda:{device}, this blob lives on "
                f"cuda:{self._device_id}; copy it there first (array.copy() under "
                f"cupy.cuda.Device({self._device_id}))"
            )

    def dlpack_stream(self, stream: object) -> Stream | None:
        if isinstance(stream, int) and not isinstance(stream, bool):
            if stream == -1:
                return None
            if stream == 0:  # not valid DLPack; torch has sent it for its default stream
                stream = 1
        elif stream is None:  # DLPack: None means the legacy default stream
            stream = 1
        # a consumer's handle is of the array's device (DLPack's contract): not looked up
        return self._as_stream(stream, check_handle=False)

    def _external(self, ptr: int) -> Any:
        """A CuPy stream over a foreign ``cudaStream_t``."""
        cuda = self._cp.cuda
        from_external = getattr(cuda.Stream, "from_external", None)
        if from_external is not None:  # CuPy 14
            return from_external(_Handle(ptr))
        with warnings.catch_warnings():  # CuPy 13: the only way
            warnings.simplefilter("ignore", DeprecationWarning)
            return cuda.ExternalStream(ptr, self._device_id)

    @contextlib.contextmanager
    def _using(self, stream: _CupyStream) -> Iterator[None]:
        with self._device, stream.here():
            yield

    def using(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        return self._using(self._own(stream))

    def as_stream(self, stream: object) -> Stream:
        return self._as_stream(stream, check_handle=True)

    def _as_stream(self, stream: object, check_handle: bool) -> _CupyStream:
        """:meth:`as_stream`; ``check_handle``: a raw handle's device is checked too
        (through its context: a few driver calls)."""
        cp = self._cp
        if isinstance(stream, _CupyStream):
            self._check_device(int(stream._device.id), stream)
            return stream
        base = getattr(cp.cuda.stream, "_BaseStream", cp.cuda.Stream)
        if isinstance(stream, (cp.cuda.Stream, base)):
            device = int(stream.device_id)  # -1: not known (external, null, per-thread)
            self._check_device(device, stream)
            if device < 0 and check_handle:
                self._check_handle(int(stream.ptr))
            wrapped = self._wrap(stream)
        else:
            handle = getattr(stream, "cuda_stream", stream)  # torch.cuda.Stream
            if not isinstance(handle, int) or isinstance(handle, bool):
                raise TypeError(
                    f"stream must be a CuPy stream, a torch.cuda.Stream or a cudaStream_t "
                    f"handle (an int), got {type(stream).__name__}"
                )
            if handle is stream:
                if check_handle:
                    self._check_handle(handle)
            else:
                self._check_device(getattr(getattr(stream, "device", None), "index", None), stream)
            wrapped = self._wrap(self._external(handle))
        wrapped.owner = stream  # kept alive while blobpipe uses it
        return wrapped

    def _check_device(self, device: int | None, stream: object) -> None:
        """Refuse a stream of another device (``device`` None or -1: not known)."""
        if device is None or device < 0 or device == self._device_id:
            return
        n = self._device_id
        raise ArgumentError(
            f"stream: {stream} is a stream of cuda:{device}, this backend is cuda:{n}; "
            f"pass a stream of cuda:{n} (made under cupy.cuda.Device({n}), or "
            f"torch.cuda.Stream(device={n}))"
        )

    def _check_handle(self, ptr: int) -> None:
        """Refuse a ``cudaStream_t`` of another device's context, or none at all
        (the special handles 0, 1 and 2 name a stream of whichever device is current)."""
        driver = getattr(self._cp.cuda, "driver", None)
        if ptr in (0, _LEGACY, _PER_THREAD) or driver is None:
            return
        try:
            # the device of the stream's context: bound for the query alone, the
            # calling thread's context (none, in a fresh thread) bound again after it
            ctx = driver.streamGetCtx(ptr)
            saved = driver.ctxGetCurrent()
            driver.ctxSetCurrent(ctx)
            try:
                device = int(driver.ctxGetDevice())
            finally:
                driver.ctxSetCurrent(saved)
        except Exception as exc:  # CUDADriverError: not a stream (destroyed, or never one)
            raise ArgumentError(f"stream: {ptr:#x} is not a live CUDA stream ({exc})") from exc
        self._check_device(device, f"{ptr:#x}")

    def _stream_wait(self, stream: Stream, event: Event) -> None:
        raw = self._own(stream).here()
        if isinstance(event, _CupyEvent):
            with self._device:
                raw.wait_event(event._event)
        else:  # not a CUDA event: the host waits for it
            event.synchronize()

    @staticmethod
    def _own(stream: Stream) -> _CupyStream:
        if not isinstance(stream, _CupyStream):
            raise TypeError(f"expected a stream of the CuPy backend, got {stream!r}")
        return stream

    def _copy_to_device(self, dst: Any, src: np.ndarray[Any, Any], stream: Stream) -> Event:
        assert isinstance(stream, _CupyStream)
        if not src.flags.c_contiguous:
            raise ValueError("host source of a device copy must be C-contiguous")
        with self._device:
            if src.nbytes:
                dst.data.copy_from_host_async(src.ctypes.data, src.nbytes, stream.here())
            return self._record(stream)

    def _copy_to_host(self, dst: np.ndarray[Any, Any], src: Any, stream: Stream) -> Event:
        assert isinstance(stream, _CupyStream)
        if not dst.flags.c_contiguous:
            raise ValueError("host destination of a device copy must be C-contiguous")
        with self._device:
            if src.nbytes:
                src.data.copy_to_host_async(dst.ctypes.data, src.nbytes, stream.here())
            return self._record(stream)

    def _launch(self, fn: Callable[[], object], stream: Stream) -> Event:
        assert isinstance(stream, _CupyStream)
        with self._device, stream.here():
            fn()
            return self._record(stream)

    def record_event(self, stream: Stream | None = None, *, timing: bool = False) -> Event:
        with self._device:
            return self._record(stream or self.default_stream(), timing)

    def elapsed(self, start: Event, end: Event) -> float:
        assert isinstance(start, _CupyEvent) and isinstance(end, _CupyEvent)
        return float(self._cp.cuda.get_elapsed_time(start._event, end._event)) / 1000.0

    def synchronize(self) -> None:
        with self._device:
            self._device.synchronize()
