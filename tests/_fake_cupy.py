"""A NumPy stand-in for the slice of CuPy that ``blobpipe._backends._cupy`` uses.

It checks the CuPy backend's own logic (which CuPy calls it makes, with which
flags, on which device) on machines without a GPU. It is not a model of CUDA:
copies are immediate, events complete at once. What it follows from CuPy 14's
source: ``Device.__enter__`` switches only to another device but ``__exit__``
always sets the previous one again (``cupy/cuda/device.pyx``);
``ExternalStream(...)`` warns DeprecationWarning and ``Stream.from_external``
takes an object with ``__cuda_stream__`` (``cupy/cuda/stream.pyx``);
``Memory(n)`` raises ``CUDARuntimeError`` with status ``errorMemoryAllocation``
on out of memory, the pools raise ``OutOfMemoryError`` (``cupy/cuda/memory.pyx``).
``version=13`` leaves out ``Stream.from_external``, as CuPy 13. ``driver.streamGetCtx``
gives the device a stream was made on as its context (any other handle: device -1,
which blobpipe takes as not known).
"""

from __future__ import annotations

import threading
import types
import warnings
from typing import Any

import numpy as np


def make(devices: int = 2, version: int = 14) -> types.ModuleType:
    """A fresh ``cupy`` stand-in with ``devices`` devices; ``cp.log`` records calls."""
    cp = types.ModuleType("cupy")
    cp.__version__ = f"{version}.0.0-fake"  # type: ignore[attr-defined]
    log: list[tuple[Any, ...]] = []
    cp.log = log  # type: ignore[attr-defined]
    local = threading.local()
    state = {"fail": None}  # what the next Memory() raises
    cp.state = state  # type: ignore[attr-defined]

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status: int) -> None:
            self.status = status
            super().__init__(f"cudaError {status}")

    class OutOfMemoryError(MemoryError):
        pass

    def get_device() -> int:
        return int(getattr(local, "device", 0))

    def set_device(device: int) -> None:
        log.append(("setDevice", threading.current_thread().name, device))
        local.device = device

    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: devices,
        getDevice=get_device,
        setDevice=set_device,
        CUDARuntimeError=CUDARuntimeError,
        errorMemoryAllocation=2,
    )

    class Device:
        def __init__(self, device: int | None = None) -> None:
            self.id = get_device() if device is None else device
            self._stack: list[int] = []

        def __enter__(self) -> Device:
            previous = get_device()
            self._stack.append(previous)
            if previous != self.id:
                set_device(self.id)
            return self

        def __exit__(self, *exc: object) -> None:
            set_device(self._stack.pop())

        def use(self) -> Device:
            set_device(self.id)
            return self

        def synchronize(self) -> None:
            pass

    class _BaseStream:
        def __init__(self, ptr: int, device_id: int = -1) -> None:
            self.ptr = ptr
            self.device_id = device_id
            self.done = True

        def synchronize(self) -> None:
            log.append(("streamSynchronize", self.ptr))

        def wait_event(self, event: Event) -> None:
            log.append(("streamWaitEvent", self.ptr))

        def __enter__(self) -> _BaseStream:
            stack = local.__dict__.setdefault("streams", [])
            stack.append(self)
            return self

        def __exit__(self, *exc: object) -> None:
            local.streams.pop()

    counter = iter(range(100, 10**9))

    contexts: dict[int, int] = {}  # stream handle -> the device whose context made it

    class Stream(_BaseStream):
        def __init__(self, non_blocking: bool = False, null: bool = False) -> None:
            super().__init__(0 if null else next(counter), get_device())
            contexts[self.ptr] = get_device()

    def stream_get_ctx(ptr: int) -> tuple[str, int]:
        # a handle the stand-in did not make: a context of no device in particular
        return ("context", contexts.get(ptr, -1))

    def ctx_set_current(ctx: Any) -> None:
        local.context = ctx or None

    def ctx_get_device() -> int:
        ctx = getattr(local, "context", None)
        if ctx is None:
            raise RuntimeError("CUDA_ERROR_INVALID_CONTEXT")
        return int(ctx[1])

    driver = types.SimpleNamespace(
        ctxGetCurrent=lambda: getattr(local, "context", None) or 0,
        ctxSetCurrent=ctx_set_current,
        ctxGetDevice=ctx_get_device,
        streamGetCtx=stream_get_ctx,
    )

    if version >= 14:

        def from_external(cls: type, obj: Any) -> Stream:
            version_, ptr = obj.__cuda_stream__()
            assert version_ == 0 and isinstance(ptr, int)
            stream = cls.__new__(cls)
            _BaseStream.__init__(stream, ptr, -1)
            return stream

        Stream.from_external = classmethod(from_external)  # type: ignore[attr-defined]

    class ExternalStream(_BaseStream):
        def __init__(self, ptr: int, device_id: int = -1) -> None:
            if version >= 14:
                warnings.warn(
                    "ExternalStream is deprecated. Use Stream.from_external() instead",
                    DeprecationWarning,
                    stacklevel=2,
                )
            super().__init__(ptr, device_id)

    null = Stream(null=True)

    def get_current_stream() -> _BaseStream:
        stack = local.__dict__.get("streams") or [null]
        return stack[-1]  # type: ignore[no-any-return]

    class Event:
        def __init__(
            self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
        ) -> None:
            log.append(("Event", block, disable_timing))
            self.block = block
            self.done = True

        def record(self, stream: Any = None) -> None:
            log.append(("eventRecord", None if stream is None else stream.ptr))

        def synchronize(self) -> None:
            log.append(("eventSynchronize", self.block))

    class Memory:
        def __init__(self, size: int) -> None:
            fail, state["fail"] = state["fail"], None
            if fail is not None:
                raise fail
            self.size = size
            self.device_id = get_device()
            self._buf = np.zeros(size, np.uint8)
            self.ptr = self._buf.ctypes.data

    class UnownedMemory:
        def __init__(self, ptr: int, size: int, owner: object, device_id: int = -1) -> None:
            self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem: Any, offset: int) -> None:
            self.mem = mem
            self.ptr = mem.ptr + offset
            self.device_id = mem.device_id

    class ndarray:
        def __init__(
            self, shape: Any, dtype: Any = np.uint8, memptr: Any = None, strides: Any = None
        ) -> None:
            self.shape = tuple(shape) if isinstance(shape, tuple) else (shape,)
            self.dtype = np.dtype(dtype)
            self.data = memptr
            self.strides = strides
            self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
            self.device = types.SimpleNamespace(id=memptr.device_id if memptr else get_device())

    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    cp.ndarray = ndarray  # type: ignore[attr-defined]
    cp.uint8 = np.uint8  # type: ignore[attr-defined]
    cp.get_default_memory_pool = lambda: pool  # type: ignore[attr-defined]
    cp.get_default_pinned_memory_pool = lambda: pool  # type: ignore[attr-defined]
    cp.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        runtime=runtime,
        driver=driver,
        Device=Device,
        Stream=Stream,
        ExternalStream=ExternalStream,
        stream=types.SimpleNamespace(_BaseStream=_BaseStream),
        get_current_stream=get_current_stream,
        Event=Event,
        Memory=Memory,
        UnownedMemory=UnownedMemory,
        MemoryPointer=MemoryPointer,
        memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
        get_elapsed_time=lambda a, b: 0.0,
    )
    return cp
