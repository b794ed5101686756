"""SyncedMemory: Caffe's host/device memory with a "head" state machine.

The head says where the freshest bytes are::

    UNINITIALIZED --cpu_data/mutable_cpu_data--> HEAD_AT_CPU   (zero-filled)
    UNINITIALIZED --gpu_data/mutable_gpu_data--> HEAD_AT_GPU   (zero-filled)
    HEAD_AT_CPU   --gpu_data-->  SYNCED   (copies CPU→GPU)
    HEAD_AT_GPU   --cpu_data-->  SYNCED   (copies GPU→CPU)
    any           --mutable_cpu_data--> HEAD_AT_CPU  (copies GPU→CPU if head was at GPU)
    any           --mutable_gpu_data--> HEAD_AT_GPU  (copies CPU→GPU if head was at CPU)

Memory is allocated lazily, on first touch, from the backend's pools.

Unlike Caffe, an asynchronous push (``async_gpu_push``) does not mark the head
SYNCED when the copy is *issued*: until the copy's event has completed the copy
is *pending*, and every accessor first waits for it. So no accessor can observe
device bytes that have not landed, nor modify host bytes a copy still reads.

Its blocks go back to the pool (on :meth:`SyncedMemory.close`, or when the last
blob sharing it lets go) after the last copy touching them *and* after the work
queued so far on the releasing caller's current stream and on every stream named
with :meth:`SyncedMemory.release_after_stream` (a loader's consumer stream, a
DLPack consumer's): the pool reuses none of it before that work has run.

A SyncedMemory is not thread-safe (neither is Caffe's); give each thread its own
or guard it.
"""

from __future__ import annotations

import enum
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np

from ._backends import Backend, Event, Stream, all_of, get_backend, wait_event
from ._backends._base import hold_array
from ._errors import ShapeError, StateError
from ._pool import Block, MemoryPool, get_pool

__all__ = ["Head", "MemoryPair", "SharedMemory", "SyncedMemory"]


class Head(enum.Enum):
    """Where the current bytes of a SyncedMemory live."""

    UNINITIALIZED = 0
    HEAD_AT_CPU = 1
    HEAD_AT_GPU = 2
    SYNCED = 3


class _Copy(NamedTuple):
    """An async copy between a SyncedMemory's buffers, issued and not yet observed complete."""

    event: Event  # completes once the copy's bytes have landed
    head: Head  # the head the memory takes once the event has completed


class _Owned:
    """The pool blocks a SyncedMemory owns and the async copy in flight on its buffers;
    shared with its finalizer."""

    __slots__ = ("after", "backend", "copy", "cpu", "gpu", "streams")

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.cpu: Block | None = None
        self.gpu: Block | None = None
        # The pending async copy, its only record: while it is set, every accessor waits
        # for its event first, and a release returns the blocks only after that event.
        self.copy: _Copy | None = None
        # Streams whose work queued up to the release runs before any reuse, and
        # events that must have completed too (release_after_*).
        self.streams: list[Stream] = []
        self.after: list[Event] = []

    def add_stream(self, stream: Stream) -> None:
        if not any(s.same(stream) for s in self.streams):
            self.streams.append(stream)

    def take_streams(self) -> list[Stream]:
        streams, self.streams = self.streams, []
        return streams

    def release(self) -> None:
        events = [self.copy.event] if self.copy is not None else []
        events += self.after
        self.copy, self.after = None, []
        blocks = [b for b in (self.cpu, self.gpu) if b is not None]
        self.cpu = self.gpu = None
        streams = self.take_streams()
        for stream in streams if blocks else ():
            try:
                events.append(self.backend.record_event(stream))
            except RuntimeError:  # at interpreter exit: nothing will reuse the blocks
                break
        event = all_of(events) if events else None
        for block in blocks:
            # the pool adds the releasing caller's current stream
            block.pool.free(block, event)


def _as_bytes(buf: Any, size: int, where: str) -> Any:
    """A flat uint8 view of the first ``size`` bytes of a borrowed buffer."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ShapeError(f"set_{where}_data needs a C-contiguous array")
        flat = buf.reshape(-1).view(np.uint8)
    elif hasattr(buf, "__cuda_array_interface__") and where == "gpu":
        if not buf.flags.c_contiguous:
            raise ShapeError("set_gpu_data needs a C-contiguous array")
        flat = buf.reshape(-1).view(np.uint8)
    else:
        try:
            flat = np.frombuffer(buf, dtype=np.uint8)
        except TypeError:
            raise TypeError(
                f"set_{where}_data expects an array or a buffer, got {type(buf).__name__}"
            ) from None
    if flat.nbytes < size:
        raise ShapeError(
            f"set_{where}_data: the buffer holds {flat.nbytes} bytes, this SyncedMemory "
            f"needs {size}"
        )
    return flat[:size]


class SyncedMemory:
    """``size`` bytes that live on the host, the device, or both (see module doc).

    ``backend`` defaults to the default backend (``"auto"``). Blocks come from
    the backend's shared pools unless ``host_pool``/``device_pool`` are given,
    and go back on :meth:`close` (also a context manager; a finalizer is only a
    safety net).
    """

    def __init__(
        self,
        size: int,
        backend: Backend | str | None = None,
        *,
        host_pool: MemoryPool | None = None,
        device_pool: MemoryPool | None = None,
    ) -> None:
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool):
            raise TypeError(f"size must be an int, got {type(size).__name__}")
        if size < 0:
            raise ShapeError(f"SyncedMemory size must be >= 0, got {size}")
        self._size = int(size)
        self._backend = get_backend(backend)
        self._host_pool = host_pool
        self._device_pool = device_pool
        self._head = Head.UNINITIALIZED
        self._cpu: Any = None  # flat uint8 view of exactly size bytes
        self._gpu: Any = None
        self._owned = _Owned(self._backend)
        self._closed = False
        self._finalizer = weakref.finalize(self, self._owned.release)

    # -- properties ------------------------------------------------------------
    @property
    def size(self) -> int:
        """The number of bytes."""
        return self._size

    @property
    def backend(self) -> Backend:
        """The device backend this memory lives on."""
        return self._backend

    @property
    def head(self) -> Head:
        """Where the current bytes are (waits for a pending async copy first)."""
        self._settle()
        return self._head

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    @property
    def copy_pending(self) -> bool:
        """True while an async copy is in flight and has not been observed."""
        copy = self._owned.copy
        return copy is not None and not copy.event.query()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self._head.name
        return f"<SyncedMemory {self._size} B {state} on {self._backend.name}>"

    # -- lifetime -------------------------------------------------------------
    def close(self) -> None:
        """Return the owned blocks to their pools (after any in-flight copy). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._owned.release()  # after the pending copy's event, if any; forgets the copy
        self._finalizer.detach()
        self._cpu = self._gpu = None

    def __enter__(self) -> SyncedMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"this SyncedMemory ({self._size} B) was closed")

    # -- allocation -------------------------------------------------------------
    def _pool(self, kind: str) -> MemoryPool:
        if kind == "host":
            if self._host_pool is None:
                self._host_pool = get_pool(self._backend, "host")
            return self._host_pool
        if self._device_pool is None:
            self._device_pool = get_pool(self._backend, "device")
        return self._device_pool

    def _alloc_cpu(self) -> None:
        block = self._pool("host").malloc(self._size)
        self._owned.cpu = block
        self._cpu = block.view()

    def _alloc_gpu(self) -> None:
        self._backend.require_device("gpu_data")
        block = self._pool("device").malloc(self._size)
        self._owned.gpu = block
        self._gpu = block.view()

    # -- transitions (Caffe's to_cpu / to_gpu) ----------------------------------
    def _settle(self) -> None:
        """Wait for a pending async copy and apply its head transition."""
        copy = self._owned.copy
        if copy is not None:
            copy.event.synchronize()
            self._owned.copy = None
            self._head = copy.head

    def _to_cpu(self) -> None:
        self._check_open()
        self._settle()
        if self._head is Head.UNINITIALIZED:
            if self._cpu is None:
                self._alloc_cpu()
            self._cpu.fill(0)
            self._head = Head.HEAD_AT_CPU
        elif self._head is Head.HEAD_AT_GPU:
            if self._cpu is None:
                self._alloc_cpu()
            if self._size:
                self._backend.copy_to_host(self._cpu, self._gpu).synchronize()
            self._head = Head.SYNCED

    def _to_gpu(self) -> None:
        self._check_open()
        self._backend.require_device("gpu_data")
        self._settle()
        if self._head is Head.UNINITIALIZED:
            if self._gpu is None:
                self._alloc_gpu()
            if self._size:
                self._backend.fill_device_zero(self._gpu)
            self._head = Head.HEAD_AT_GPU
        elif self._head is Head.HEAD_AT_CPU:
            if self._gpu is None:
                self._alloc_gpu()
            if self._size:
                self._backend.copy_to_device(self._gpu, self._cpu).synchronize()
            self._head = Head.SYNCED

    # -- accessors ---------------------------------------------------------------
    def cpu_data(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The bytes on the host, read-only (copies GPU→CPU when the head is at the GPU)."""
        self._to_cpu()
        view: np.ndarray[Any, np.dtype[np.uint8]] = self._cpu[:]
        view.flags.writeable = False
        return view

    def host_bytes(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """:meth:`cpu_data` without the read-only view: the host buffer itself, for a
        caller that only reads it or hands out read-only views of it (Blob's
        ``cpu_data``, which caches its typed view per buffer).

        The head moves as with :meth:`cpu_data`: an uninitialised memory is
        zero-filled (HEAD_AT_CPU), a head at the GPU is copied back (SYNCED),
        HEAD_AT_CPU and SYNCED stay. The same array object
        comes back on every call until the host buffer changes
        (:meth:`set_cpu_data`, :meth:`close`). The caller must not write to it:
        the device copy would not see the change.

        Raises:
            StateError: the memory is closed.
        """
        head = self._head
        # (once a batch in a training loop: the host is current, nothing pending)
        if (head is Head.HEAD_AT_CPU or head is Head.SYNCED) and self._owned.copy is None:
            self._check_open()
            return self._cpu  # type: ignore[no-any-return]
        self._to_cpu()
        return self._cpu  # type: ignore[no-any-return]

    def mutable_cpu_data(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The bytes on the host, writable; the head moves to the CPU."""
        self._to_cpu()
        self._head = Head.HEAD_AT_CPU
        return self._cpu  # type: ignore[no-any-return]

    def overwrite_cpu_data(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """:meth:`mutable_cpu_data` for a caller that writes every byte before anyone
        reads one (a loader refilling a batch slot): the host buffer itself.

        After any pending async copy has finished, the head moves to HEAD_AT_CPU
        without the zero fill of a first use and without the copy back from the
        device: until the caller has written them, the bytes are whatever the
        buffer held (a reused pool block's old bytes, stale host bytes).

        Raises:
            StateError: the memory is closed.
        """
        self._check_open()
        self._settle()
        if self._cpu is None:
            self._alloc_cpu()
        self._head = Head.HEAD_AT_CPU
        return self._cpu  # type: ignore[no-any-return]

    def gpu_data(self) -> Any:
        """The bytes on the device (read-only where the array type allows it).

        Raises BackendUnavailableError on the host backend.
        """
        self._to_gpu()
        view = self._gpu[:]
        if isinstance(view, np.ndarray):
            view.flags.writeable = False
        return view

    def mutable_gpu_data(self) -> Any:
        """The bytes on the device, writable; the head moves to the GPU."""
        self._to_gpu()
        self._head = Head.HEAD_AT_GPU
        return self._gpu

    def set_cpu_data(self, buf: Any) -> None:
        """Use a borrowed host buffer (never returned to a pool); head → HEAD_AT_CPU."""
        self._check_open()
        self._settle()
        flat = _as_bytes(buf, self._size, "cpu")
        if self._owned.cpu is not None:
            block, self._owned.cpu = self._owned.cpu, None
            block.pool.free(block)
        self._cpu = flat
        self._head = Head.HEAD_AT_CPU

    def set_gpu_data(self, buf: Any) -> None:
        """Use a borrowed device buffer (never returned to a pool); head → HEAD_AT_GPU.

        Raises UnsupportedOperationError when ``buf`` is not memory of this
        backend's device (host memory, another GPU).
        """
        self._check_open()
        self._backend.require_device("set_gpu_data")
        self._backend.check_device_array(buf, "set_gpu_data")
        self._settle()
        flat = _as_bytes(buf, self._size, "gpu")
        if self._owned.gpu is not None:
            block, self._owned.gpu = self._owned.gpu, None
            block.pool.free(block)
        self._gpu = flat
        self._head = Head.HEAD_AT_GPU

    # -- ordering the release --------------------------------------------------------
    def release_after_stream(self, stream: Stream) -> None:
        """Hand the blocks back, when released, only after the work queued on
        ``stream`` up to that moment (a consumer's stream: the pool does not reuse
        memory its kernels may still read)."""
        self._owned.add_stream(stream)

    def release_after_event(self, event: Event) -> None:
        """Hand the blocks back, when released, only after ``event`` completed."""
        self._owned.after.append(event)

    def take_release_streams(self) -> list[Stream]:
        """The streams named with :meth:`release_after_stream` since the last take
        (a ring slot records its release on them, then forgets them)."""
        return self._owned.take_streams()

    # -- asynchronous copies --------------------------------------------------------
    def start_gpu_push(self, stream: Stream | None = None) -> Event:
        """Issue the CPU→GPU copy on ``stream`` and return its event, without waiting.

        The head must be HEAD_AT_CPU. The copy stays *pending* until its event
        is observed complete: every accessor (and :attr:`head`) waits for it
        first. Await :meth:`async_gpu_push` instead to wait without blocking.
        """
        self._check_open()
        self._backend.require_device("async_gpu_push")
        self._settle()
        if self._head is not Head.HEAD_AT_CPU:
            raise StateError(
                f"async_gpu_push needs the head at the CPU, but it is {self._head.name} "
                "(write the data with mutable_cpu_data() first)"
            )
        if self._gpu is None:
            self._alloc_gpu()
        event = self._backend.copy_to_device(self._gpu, self._cpu, stream)
        self._owned.copy = _Copy(event, Head.SYNCED)
        return event

    def start_cpu_pull(self, stream: Stream | None = None) -> Event:
        """Issue the GPU→CPU copy on ``stream`` and return its event (head must be HEAD_AT_GPU)."""
        self._check_open()
        self._backend.require_device("async_cpu_pull")
        self._settle()
        if self._head is not Head.HEAD_AT_GPU:
            raise StateError(
                f"async_cpu_pull needs the head at the GPU, but it is {self._head.name}"
            )
        if self._cpu is None:
            self._alloc_cpu()
        event = self._backend.copy_to_host(self._cpu, self._gpu, stream)
        self._owned.copy = _Copy(event, Head.SYNCED)
        return event

    async def wait(self) -> None:
        """Wait, without blocking the event loop, for a pending async copy."""
        copy = self._owned.copy
        if copy is not None:
            await wait_event(copy.event)
            if self._owned.copy is copy:  # not settled or closed meanwhile
                self._settle()

    async def async_gpu_push(self, stream: Stream | None = None) -> None:
        """Copy CPU→GPU on ``stream`` and await its completion; head → SYNCED after it."""
        self.start_gpu_push(stream)
        await self.wait()

    async def async_cpu_pull(self, stream: Stream | None = None) -> None:
        """Copy GPU→CPU on ``stream`` and await its completion; head → SYNCED after it."""
        self.start_cpu_pull(stream)
        await self.wait()


class SharedMemory:
    """A SyncedMemory with a reference count: each blob using it holds one.

    The last :meth:`release` closes the SyncedMemory, returning its blocks.
    """

    __slots__ = ("_lock", "mem", "refs")

    def __init__(self, mem: SyncedMemory) -> None:
        self.mem = mem
        self.refs = 1
        self._lock = threading.Lock()

    def acquire(self) -> SharedMemory:
        with self._lock:
            if self.refs == 0:
                raise StateError(f"{self.mem!r} was already released")
            self.refs += 1
        return self

    def release(self) -> None:
        with self._lock:
            self.refs -= 1
            last = self.refs == 0
        if last:
            self.mem.close()

    def keep_alive(self, array: Any, *, device: bool = False, owner: object = None) -> Any:
        """``array`` (a host view of this memory, or with ``device`` a device view)
        as an array holding a reference to it, released when the last array over
        it goes: the pool does not reuse the bytes while an export made from it
        lives, even after the blobs let go. ``owner``: kept referenced as long too
        (a loader batch's lease)."""
        reference = _Reference(self.acquire())
        held: object = reference if owner is None else (reference, owner)
        if device:
            return self.mem.backend.hold_device(array, held)
        return hold_array(array, held)


class _Reference:
    """One reference to a SharedMemory, released when this object goes."""

    __slots__ = ("_mem",)

    def __init__(self, mem: SharedMemory) -> None:
        self._mem: SharedMemory | None = mem

    def __del__(self) -> None:
        mem, self._mem = self._mem, None
        if mem is not None:
            mem.release()


class MemoryPair:
    """A blob's data and diff memories, one reference to each; shared with the blob's
    finalizer, which releases them."""

    __slots__ = ("data", "diff")

    def __init__(self, data: SharedMemory, diff: SharedMemory) -> None:
        self.data: SharedMemory | None = data
        self.diff: SharedMemory | None = diff

    def release(self) -> None:
        data, diff, self.data, self.diff = self.data, self.diff, None, None
        if data is not None:
            data.release()
        if diff is not None:
            diff.release()


class BorrowedPair(MemoryPair):
    """A blob's data and diff memories without references of its own: whoever makes it
    keeps them alive for as long as the blob can use them (a loader batch's lease, which
    the blob keeps referenced, holds the slot whose Blobs own them). Releasing it only
    lets go of them."""

    __slots__ = ()

    def release(self) -> None:
        self.data = self.diff = None

    def acquired(self) -> MemoryPair:
        """The same memories with a reference of its own to each."""
        assert self.data is not None and self.diff is not None
        return MemoryPair(self.data.acquire(), self.diff.acquire())
