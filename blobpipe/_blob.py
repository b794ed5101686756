"""Blob: Caffe's N-D array with data and diff, each a SyncedMemory.

A Blob owns two :class:`~blobpipe._syncedmem.SyncedMemory` objects (``data``
and ``diff``) of ``capacity`` elements and views their first ``count``
elements as arrays of the blob's shape and dtype: NumPy arrays on the host,
device arrays (CuPy on CUDA) on the device. The head of each SyncedMemory
moves exactly as in Caffe: read-only accessors copy without moving it,
``mutable_*`` accessors move it.

Invariants:

* ``count() <= capacity``; both memories hold at least ``capacity`` elements.
  :meth:`Blob.reshape` allocates new memories only when the new count exceeds
  the capacity (the old blocks go back to the pool), so shrinking and
  re-growing within the capacity keeps the memory and its bytes.
* A SyncedMemory shared by several blobs (:meth:`Blob.share_data`,
  :meth:`Blob.share_diff`) is closed when the last of them lets go of it
  (Caffe's ``shared_ptr``): closing one blob never frees memory another uses.
* Math (``update``, ``asum_*``, ``sumsq_*``, ``scale_*``) and ``copy_from``
  run on the side of the head, as Caffe does in GPU mode: ``HEAD_AT_CPU`` on
  the host, ``HEAD_AT_GPU`` and ``SYNCED`` on the device.

Where it differs from Caffe (raising where Caffe aborts or misbehaves): docs/design.md,
"Blob".
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final

import numpy as np

from ._backends import Backend, Event, Stream, get_backend
from ._blobmath import BlobMath
from ._blobproto import BlobProtoIO
from ._errors import (
    BlobIndexError,
    ShapeError,
    StateError,
    UnsupportedOperationError,
)
from ._hostviews import TypedViews, held_key
from ._shape import (
    MAX_BLOB_AXES,
    SUPPORTED_DTYPES,
    canonical_axis,
    check_dtype,
    count_range,
    flat_offset,
    format_shape,
    legacy_dim,
    validate_shape,
)
from ._syncedmem import BorrowedPair, MemoryPair, SharedMemory, SyncedMemory

__all__ = ["MAX_BLOB_AXES", "SUPPORTED_DTYPES", "Blob"]

_DLPACK_CPU: Final = 1  # DLDeviceType.kDLCPU


class Blob(BlobMath, BlobProtoIO):
    """Caffe's Blob: an N-D array of ``dtype`` with data and diff memories.

    ``shape`` is a sequence of at most 32 non-negative ints, or None for
    Caffe's default blob (no axes, count 0; array accessors raise StateError
    until :meth:`reshape`). ``dtype`` is float32 (default), float64, int32 or
    uint32 (or uint8 for raw pixel batches, int64 for labels). ``backend`` is a
    Backend or a device name (see
    :func:`blobpipe.get_backend`); None means the default backend.

    Memory is allocated lazily, from the backend's pools, on first access, and
    zero-filled. Give it back with :meth:`close` (or use the blob as a context
    manager); a finalizer does it only as a safety net. A Blob is not
    thread-safe.

    Raises ShapeError for a bad shape or dtype, TypeError for a shape that is
    not a sequence of ints.
    """

    def __init__(
        self,
        shape: Sequence[int] | None = None,
        dtype: Any = np.float32,
        *,
        backend: Backend | str | None = None,
    ) -> None:
        self._dtype = check_dtype(dtype)
        self._itemsize = self._dtype.itemsize
        if shape is None:
            self._shape: tuple[int, ...] = ()
            self._count = 0
            self._shaped = False
        else:
            self._shape, self._count = validate_shape(shape, self._itemsize)
            self._shaped = True
        self._backend = get_backend(backend)
        nbytes = self._count * self._itemsize
        self._holder = MemoryPair(self._new_memory(nbytes), self._new_memory(nbytes))
        self._closed = False
        self._closed_message: str | None = None
        self._typed: dict[str, TypedViews] = {}
        self._held: dict[str, tuple[TypedViews, np.ndarray[Any, Any]]] = {}
        self._readonly_export = False
        # What the memory's lifetime depends on beyond this blob (a loader batch's
        # lease): every array and export made from this blob references it.
        self._owner: object | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = weakref.finalize(
            self, self._holder.release
        )

    def view(
        self,
        *,
        readonly_export: bool = False,
        owner: object = None,
        borrow: bool = False,
    ) -> Blob:
        """A new Blob of the same shape and dtype sharing this blob's data *and* diff
        memories (as ``ndarray.view()`` shares an array's memory).

        Allocates nothing: each memory's reference count goes up, so the memories
        stay alive while either blob uses them, and closing one releases only its
        own references. A reshape beyond the capacity gives the reshaped blob new
        memories and ends the sharing for it alone.

        ``readonly_export`` sets the view's :attr:`readonly_export`.

        ``owner``: an object the view, and every array and DLPack export made from
        it, keep referenced (a loader batch's lease: its slot is refilled only once
        nothing made from the batch lives); a view of a view keeps its owner too.
        ``borrow``: the view takes no references of its own (nothing to release, no
        finalizer): ``owner`` must keep the memories alive while anything made from
        the view lives (a lease holds its slot, whose Blobs own them; the loader's
        per-batch path, where the references' locks and the finalizer cost more
        than the rest of a small batch's view).

        Raises StateError when this blob is closed.
        """
        self.check_open()
        data, diff = self._holder.data, self._holder.diff
        assert data is not None and diff is not None
        view = Blob.__new__(Blob)
        view._dtype = self._dtype
        view._itemsize = self._itemsize
        view._shape = self._shape
        view._count = self._count
        view._shaped = self._shaped
        view._backend = self._backend
        view._holder = (
            BorrowedPair(data, diff) if borrow else MemoryPair(data.acquire(), diff.acquire())
        )
        view._closed = False
        view._closed_message = None
        view._typed = dict(self._typed)  # the same buffers: their typed views are shared
        view._held = {}
        view._readonly_export = readonly_export
        view._owner = owner if self._owner is None else _owners(self._owner, owner)
        view._finalizer = None if borrow else weakref.finalize(view, view._holder.release)
        return view

    def _own_memories(self) -> None:
        """A view that borrows its memories (a loader batch's Blob) takes references of
        its own, and the finalizer that releases them, before it lets go of one or
        replaces one: from then on it is an ordinary Blob."""
        holder = self._holder
        if isinstance(holder, BorrowedPair):
            self._holder = holder.acquired()
            self._finalizer = weakref.finalize(self, self._holder.release)

    def _new_memory(self, nbytes: int) -> SharedMemory:
        return SharedMemory(SyncedMemory(nbytes, self._backend))

    # -- lifetime -----------------------------------------------------------------
    def close(self, reason: str | None = None) -> None:
        """Let go of data and diff; memories no other blob shares return to the pool.

        Idempotent. Afterwards every array accessor raises StateError, whose
        message is ``reason`` when one was given (the latest one, if several
        calls gave one), else says the blob was closed.
        """
        if reason is not None:
            self._closed_message = reason
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        self._typed.clear()
        self._held.clear()
        self._owner = None
        self._holder.release()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    def release_after(self, *, stream: Stream | None = None, event: Event | None = None) -> None:
        """Order the return of the memories to the pool (when this blob or the last
        one sharing them lets go) after the work queued on ``stream`` up to that
        moment, and after ``event``: device work still reading them (a consumer's
        kernels on its own stream) runs before any reuse."""
        self.check_open()
        for ref in (self._holder.data, self._holder.diff):
            if ref is not None:
                if stream is not None:
                    ref.mem.release_after_stream(stream)
                if event is not None:
                    ref.mem.release_after_event(event)

    def take_release_streams(self) -> list[Stream]:
        """The streams named for the data memory's release (:meth:`release_after`, a
        DLPack consumer's stream) since the last take: a loader's ring slot orders
        its reuse after them, then forgets them. Empty once the blob let go of its
        memory."""
        ref = self._holder.data
        return [] if self._closed or ref is None else ref.mem.take_release_streams()

    def __enter__(self) -> Blob:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        shape = self._shape if self._shaped else "unshaped"
        return f"<Blob {self._dtype} {shape} on {self._backend.name}{state}>"

    def check_open(self) -> None:
        """Raise StateError when the blob is closed (with the ``reason`` given to
        :meth:`close`, if any); nothing otherwise. Changes nothing."""
        if self._closed:
            raise StateError(
                self._closed_message
                or f"this Blob (shape {self.shape_string()}) was closed; create a new one"
            )

    def _mem(self, which: str) -> SyncedMemory:
        self.check_open()
        ref = self._holder.data if which == "data" else self._holder.diff
        assert ref is not None  # only None after close
        return ref.mem

    # -- shape ----------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype[Any]:
        """The element type."""
        return self._dtype

    @property
    def backend(self) -> Backend:
        """The device backend the memories live on."""
        return self._backend

    @property
    def shape(self) -> tuple[int, ...]:
        """The dimensions, as a tuple."""
        return self._shape

    @property
    def num_axes(self) -> int:
        """The number of axes."""
        return len(self._shape)

    @property
    def capacity(self) -> int:
        """Elements the current memories hold; :meth:`reshape` within it does not allocate."""
        h = self._holder
        if h.data is None or h.diff is None:
            return 0
        return min(h.data.mem.size, h.diff.mem.size) // self._itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the ``count()`` elements (of data, or of diff)."""
        return self._count * self._itemsize

    def reshape(self, *shape: Any) -> None:
        """Change the shape: ``reshape((n, c, h, w, ...))``, Caffe's legacy
        ``reshape(n, c, h, w)``, or ``reshape(blob_shape_proto)``.

        Reallocates only when the new count exceeds :attr:`capacity`: then data
        and diff get new (lazily zero-filled) memories and the old blocks go
        back to the pool. Within the capacity the memories, and their bytes,
        are kept. A failing reshape leaves the blob unchanged.

        Raises ShapeError (more than 32 axes, a negative dimension, an
        unaddressable size), TypeError (not ints), StateError (closed).
        """
        self.check_open()
        if len(shape) == 4:
            dims: Any = shape
        elif len(shape) == 1:
            dims = shape[0]
            if hasattr(dims, "dim"):
                dims = list(dims.dim)  # a caffe BlobShape
        else:
            raise TypeError(
                "reshape takes one shape sequence, e.g. reshape((2, 3, 4, 5)), or the four "
                f"legacy ints reshape(n, c, h, w); got {len(shape)} arguments"
            )
        new_shape, count = validate_shape(dims, self._itemsize)
        if count > self.capacity:
            nbytes = count * self._itemsize
            data, diff = self._new_memory(nbytes), self._new_memory(nbytes)
            self._typed.clear()
            self._own_memories()
            self._holder.release()
            self._holder.data, self._holder.diff = data, diff
        self._shape, self._count, self._shaped = new_shape, count, True

    def reshape_like(self, other: Blob) -> None:
        """Reshape to ``other``'s shape (see :meth:`reshape`)."""
        self.reshape(other.shape)

    def shape_string(self) -> str:
        """Caffe's shape string, e.g. ``"2 3 4 5 (120)"``."""
        return format_shape(self._shape, self._count)

    def canonical_axis_index(self, axis_index: int) -> int:
        """``axis_index`` in ``[0, num_axes)``; negative values count from the end.

        Raises BlobIndexError outside ``[-num_axes, num_axes)``.
        """
        return canonical_axis(self._shape, axis_index, self.shape_string())

    def shape_at(self, axis: int) -> int:
        """The dimension of ``axis`` (negative counts from the end); Caffe's ``shape(i)``.

        Raises BlobIndexError for an axis out of range.
        """
        return self._shape[self.canonical_axis_index(axis)]

    def count(self, start_axis: int | None = None, end_axis: int | None = None) -> int:
        """The number of elements; with axes, the product of dims in ``[start, end)``.

        ``count()`` is the element count (0 for an unshaped blob, as in Caffe);
        ``count(start)`` runs to the last axis. As in Caffe the axes are not
        canonicalised: ``0 <= start <= end <= num_axes`` is required, else
        BlobIndexError.
        """
        if start_axis is None and end_axis is None:
            return self._count
        return count_range(self._shape, start_axis, end_axis, self.shape_string())

    def legacy_shape(self, index: int) -> int:
        """Caffe's ``LegacyShape``: the dim of ``index`` in ``[-4, 4)``, 1 for the
        axes a blob of fewer than 4 axes lacks (the one-padding of legacy blobs).

        Raises ShapeError for a blob of more than 4 axes, BlobIndexError for an
        index outside ``[-4, 4)``.
        """
        return legacy_dim(self._shape, index, self.shape_string())

    @property
    def num(self) -> int:
        """Legacy ``shape_at(0)`` (1 when missing); raises ShapeError beyond 4 axes."""
        return self.legacy_shape(0)

    @property
    def channels(self) -> int:
        """Legacy ``shape_at(1)`` (1 when missing); raises ShapeError beyond 4 axes."""
        return self.legacy_shape(1)

    @property
    def height(self) -> int:
        """Legacy ``shape_at(2)`` (1 when missing); raises ShapeError beyond 4 axes."""
        return self.legacy_shape(2)

    @property
    def width(self) -> int:
        """Legacy ``shape_at(3)`` (1 when missing); raises ShapeError beyond 4 axes."""
        return self.legacy_shape(3)

    def offset(self, n: int | Sequence[int], c: int = 0, h: int = 0, w: int = 0) -> int:
        """The flat (row-major) index of an element.

        ``offset(n, c=0, h=0, w=0)`` uses the legacy 4-D view:
        ``((n * channels + c) * height + h) * width + w``. ``offset(indices)``
        takes a sequence of at most ``num_axes`` indices; missing trailing
        indices are 0.

        Every index must lie in ``[0, dim)`` (Caffe lets ``n == num`` through;
        this does not). Raises BlobIndexError for an index out of range or too
        many indices, ShapeError for the legacy form on more than 4 axes.
        """
        return flat_offset(self._shape, n, c, h, w, self.shape_string())

    # -- typed views ----------------------------------------------------------------
    def _check_shaped(self, what: str) -> None:
        if not self._shaped:
            raise StateError(
                f"{what}: this Blob has no shape yet (Caffe's default Blob); call reshape() first"
            )

    def _host(self, which: str, mutable: bool, overwrite: bool = False) -> np.ndarray[Any, Any]:
        # (once a batch in a training loop: the checks of _mem and _check_shaped inline)
        if self._closed or not self._shaped:
            self._mem(which)
            self._check_shaped(f"cpu_{which}")
        ref = self._holder.data if which == "data" else self._holder.diff
        mem = ref.mem  # type: ignore[union-attr]
        if overwrite:
            raw = mem.overwrite_cpu_data()
        else:
            raw = mem.mutable_cpu_data() if mutable else mem.host_bytes()
        # callers get fresh views of the buffer's TypedViews (made once per buffer and
        # shape, shared with the blob's views: _hostviews.py)
        cached = self._typed.get(which)
        if cached is None or cached.raw is not raw or cached.shape != self._shape:
            typed = raw[: self.nbytes].view(self._dtype).reshape(self._shape)
            cached = self._typed[which] = TypedViews(raw, self._shape, typed)
        if self._owner is None:
            base = cached.typed if mutable else cached.read_only()
        else:  # it and every view of it keep the owner
            key = held_key(which, mutable)
            held = self._held.get(key)
            if held is None or held[0] is not cached:
                held = self._held[key] = (cached, cached.held(self._owner, mutable))
            base = held[1]
        out: np.ndarray[Any, Any] = base.view()
        return out

    def _device(self, which: str, mutable: bool) -> Any:
        mem = self._mem(which)
        self._backend.require_device(f"gpu_{which}")
        self._check_shaped(f"gpu_{which}")
        raw = mem.mutable_gpu_data() if mutable else mem.gpu_data()
        view = self._backend.device_view(raw, self._dtype, self._shape, readonly=not mutable)
        if self._owner is not None:  # it and every view of it keep the owner
            view = self._backend.hold_device(view, self._owner)
        return view

    @property
    def data(self) -> SyncedMemory:
        """The SyncedMemory of the data (Caffe's ``data()``); owned by the blob, do
        not close it. Raises StateError after close."""
        return self._mem("data")

    @property
    def diff(self) -> SyncedMemory:
        """The SyncedMemory of the diff (Caffe's ``diff()``); owned by the blob, do
        not close it. Raises StateError after close."""
        return self._mem("diff")

    def cpu_data(self) -> np.ndarray[Any, Any]:
        """The data on the host, read-only, of the blob's shape and dtype.

        Copies from the device when the head is there (the head becomes SYNCED).
        Raises StateError when closed or unshaped.
        """
        return self._host("data", False)

    def mutable_cpu_data(self) -> np.ndarray[Any, Any]:
        """The data on the host, writable; the head moves to the CPU."""
        return self._host("data", True)

    def overwrite_cpu_data(self) -> np.ndarray[Any, Any]:
        """:meth:`mutable_cpu_data` for a caller that writes every element before
        anyone reads one (a loader filling a batch slot): the data on the host,
        writable, the head moved to the CPU without the zero fill of a first use
        and without the copy back from the device. Until written, the elements
        hold whatever the buffer held.

        Raises StateError when closed or unshaped.
        """
        return self._host("data", True, overwrite=True)

    def cpu_diff(self) -> np.ndarray[Any, Any]:
        """The diff on the host, read-only (see :meth:`cpu_data`)."""
        return self._host("diff", False)

    def mutable_cpu_diff(self) -> np.ndarray[Any, Any]:
        """The diff on the host, writable; the diff's head moves to the CPU."""
        return self._host("diff", True)

    def gpu_data(self) -> Any:
        """The data on the device (a CuPy array on CUDA), of the blob's shape and dtype.

        Read-only where the array type supports it (CuPy arrays have no such
        flag: do not write to them). Copies from the host when the head is
        there. Raises BackendUnavailableError on the host backend.
        """
        return self._device("data", False)

    def mutable_gpu_data(self) -> Any:
        """The data on the device, writable; the head moves to the GPU.

        Raises BackendUnavailableError on the host backend.
        """
        return self._device("data", True)

    def gpu_diff(self) -> Any:
        """The diff on the device (see :meth:`gpu_data`)."""
        return self._device("diff", False)

    def mutable_gpu_diff(self) -> Any:
        """The diff on the device, writable; the diff's head moves to the GPU."""
        return self._device("diff", True)

    def set_cpu_data(self, array: np.ndarray[Any, Any]) -> None:
        """Make the data use ``array`` (borrowed, never returned to a pool).

        ``array`` must be a C-contiguous NumPy array of the blob's dtype with
        ``count()`` elements (its shape does not matter). If the data memory
        is not exactly ``count()`` elements, data and diff are first replaced
        by new memories of that size (as Caffe does), so :attr:`capacity`
        becomes ``count()`` and sharing with other blobs ends. The head moves
        to the CPU.

        Raises ShapeError for a wrong dtype, size or layout.
        """
        self.check_open()
        self._check_shaped("set_cpu_data")
        self._check_borrowed(array, "set_cpu_data", np.ndarray)
        self._fit_memories()
        self._mem("data").set_cpu_data(array)

    def set_gpu_data(self, array: Any) -> None:
        """Make the data use the device ``array`` (borrowed); see :meth:`set_cpu_data`.

        Raises BackendUnavailableError on the host backend, ShapeError for a
        wrong dtype, size or layout.
        """
        self.check_open()
        self._backend.require_device("set_gpu_data")
        self._check_shaped("set_gpu_data")
        self._check_borrowed(array, "set_gpu_data", None)
        self._fit_memories()
        self._mem("data").set_gpu_data(array)

    def _check_borrowed(self, array: Any, what: str, kind: type | None) -> None:
        if kind is not None and not isinstance(array, kind):
            raise TypeError(f"{what} expects a numpy array, got {type(array).__name__}")
        dtype = getattr(array, "dtype", None)
        if dtype != self._dtype:
            raise ShapeError(f"{what}: the array's dtype is {dtype}, this blob's is {self._dtype}")
        size = int(getattr(array, "size", -1))
        if size != self._count:
            raise ShapeError(
                f"{what}: the array has {size} elements, the blob {self.shape_string()} "
                f"needs {self._count}"
            )
        if not array.flags.c_contiguous:
            raise ShapeError(f"{what} needs a C-contiguous array")

    def _fit_memories(self) -> None:
        data = self._mem("data")
        if data.size != self.nbytes:
            fresh_data = self._new_memory(self.nbytes)
            fresh_diff = self._new_memory(self.nbytes)
            self._own_memories()
            self._holder.release()
            self._holder.data, self._holder.diff = fresh_data, fresh_diff

    # -- NumPy ------------------------------------------------------------------------
    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        """``np.asarray(blob)``: the host data as :meth:`cpu_data` gives it (a
        read-only view, no copy); ``copy=True`` copies, ``copy=False`` raises
        ValueError where a ``dtype`` would need a copy (NumPy 2's rules).

        Raises:
            UnsupportedOperationError: on a device backend (use ``cpu_data()``,
                which copies from the device, or ``gpu_data()``).
        """
        if self._backend.has_device:
            raise UnsupportedOperationError(
                f"a Blob on {self._backend.name} does not convert implicitly: "
                "use blob.cpu_data() for a host copy (or blob.gpu_data() on the device)"
            )
        array = self.cpu_data()
        if dtype is not None and np.dtype(dtype) != array.dtype:
            if copy is False:
                raise ValueError(
                    f"np.asarray(blob, dtype={np.dtype(dtype)}, copy=False): the blob holds "
                    f"{array.dtype}, so a copy is needed"
                )
            return array.astype(dtype)
        return array.copy() if copy else array

    # -- DLPack -----------------------------------------------------------------------
    @property
    def readonly_export(self) -> bool:
        """Whether host-side DLPack exports are read-only to consumers that can be
        told (see :meth:`__dlpack__`): True for a Loader batch's Blobs, whose
        buffers are the loader's, until the batch is detached; False otherwise.
        Setting it changes what later exports give, nothing already exported."""
        return self._readonly_export

    @readonly_export.setter
    def readonly_export(self, value: bool) -> None:
        self._readonly_export = bool(value)

    def __dlpack__(self, **kwargs: Any) -> Any:
        """Export the data through DLPack, on the side of the head, without a copy.

        The side is the device when the data's head is HEAD_AT_GPU or SYNCED
        (on a device backend), else the host. The export is a writable alias,
        so the head moves there as with ``mutable_gpu_data()`` /
        ``mutable_cpu_data()``. The export holds a reference to the memory, on
        either side: the pool does not reuse it while the exported array lives,
        even once the blob is closed. ``np.from_dlpack(blob)`` and
        ``torch.from_dlpack(blob)`` take it. Keyword arguments (``stream``,
        ``max_version``, ``dl_device``, ``copy``) go to the array's own
        ``__dlpack__``.

        A device export's ``stream`` (the consumer's stream, DLPack's
        hand-shake: None is the legacy default stream, -1 none) waits for the
        caller's current stream on the blob's device, whichever device is
        current, and also orders the memory's reuse: a loader refills the batch's
        buffers, and the pool hands them out again, only after the work the
        consumer queued on it by then.

        A Loader's batches are the loader's buffers (:attr:`readonly_export`):
        their host-side exports are
        read-only (DLPack 1.0's flag, the head left where it is) to consumers
        that ask for DLPack 1.0 or later (NumPy's ``from_dlpack`` gives a
        read-only array; torch takes the memory, as it has no read-only
        tensors); consumers of the older protocol, which cannot be told, and
        device-side exports get the writable alias.
        """
        if self._head_on_device("data"):
            view = self.mutable_gpu_data()
            backend = self._backend
            consumer = backend.dlpack_stream(kwargs.get("stream"))
            if consumer is not None:
                # the hand-shake under the blob's device: the array's own (CuPy's)
                # orders the consumer after the current stream of the caller's
                # current device, and warns on stream 0; it is told -1 (none)
                backend.after_current(consumer)
                self._mem("data").release_after_stream(consumer)
            kwargs["stream"] = -1
            assert self._holder.data is not None
            held = self._holder.data.keep_alive(view, device=True, owner=self._owner)
            return held.__dlpack__(**kwargs)
        if self._readonly_export and self._wants_versioned(kwargs):
            array = self.cpu_data()
        else:
            array = self.mutable_cpu_data()
        assert self._holder.data is not None
        # the export holds the memory: the pool does not reuse it while the array lives
        return self._holder.data.keep_alive(array).__dlpack__(**kwargs)

    @staticmethod
    def _wants_versioned(kwargs: dict[str, Any]) -> bool:
        version = kwargs.get("max_version")
        return version is not None and tuple(version) >= (1, 0)

    def __dlpack_device__(self) -> tuple[Any, int]:
        """The DLPack device of what :meth:`__dlpack__` would export."""
        self._check_shaped("__dlpack_device__")
        if self._head_on_device("data"):
            return self.gpu_data().__dlpack_device__()  # type: ignore[no-any-return]
        return (_DLPACK_CPU, 0)

    # -- element access ---------------------------------------------------------------
    def data_at(self, n: int | Sequence[int], c: int = 0, h: int = 0, w: int = 0) -> Any:
        """The data element at ``offset(n, c, h, w)`` or ``offset(indices)``, as a
        Python number (read on the host, like Caffe's ``data_at``)."""
        return self._at("data", n, c, h, w)

    def diff_at(self, n: int | Sequence[int], c: int = 0, h: int = 0, w: int = 0) -> Any:
        """The diff element at ``offset(n, c, h, w)`` or ``offset(indices)``."""
        return self._at("diff", n, c, h, w)

    def _at(self, which: str, n: int | Sequence[int], c: int, h: int, w: int) -> Any:
        self.check_open()
        off = self.offset(n, c, h, w)
        if off >= self._count:  # only when an omitted trailing axis has size 0
            raise BlobIndexError(
                f"no element at offset {off} in Blob with shape {self.shape_string()}"
            )
        return self._host(which, False).reshape(-1)[off].item()

    # -- sharing and copying -------------------------------------------------------------
    def _check_compatible(self, other: Blob, what: str) -> None:
        if not isinstance(other, Blob):
            raise TypeError(f"{what} expects a Blob, got {type(other).__name__}")
        self.check_open()
        other.check_open()
        if other._dtype != self._dtype:
            raise ShapeError(
                f"{what}: dtype mismatch, this blob is {self._dtype}, the other {other._dtype}"
            )

    def _share(self, other: Blob, which: str) -> None:
        what = f"share_{which}"
        self._check_compatible(other, what)
        if other._backend is not self._backend:
            raise UnsupportedOperationError(
                f"{what}: the blobs live on different backends ({self._backend!r} and "
                f"{other._backend!r}); memory cannot be shared across them"
            )
        if other._count != self._count:
            raise ShapeError(
                f"{what}: counts differ, this blob {self.shape_string()}, the other "
                f"{other.shape_string()}"
            )
        src = other._holder.data if which == "data" else other._holder.diff
        assert src is not None
        new = src.acquire()
        self._own_memories()
        if which == "data":
            old, self._holder.data = self._holder.data, new
        else:
            old, self._holder.diff = self._holder.diff, new
        self._owner = _owners(self._owner, other._owner)  # the shared memory's lifetime
        self._typed.clear()
        self._held.clear()
        if old is not None:
            old.release()

    def share_data(self, other: Blob) -> None:
        """Use ``other``'s data memory (Caffe's ``ShareData``); the blob's own data
        memory is released unless another blob still uses it.

        The count must be equal (the shapes may differ). :attr:`capacity`
        becomes the smaller of the two memories; a later reshape beyond it
        allocates new memories and ends the sharing. Raises ShapeError for a
        count or dtype mismatch, UnsupportedOperationError across backends.
        """
        self._share(other, "data")

    def share_diff(self, other: Blob) -> None:
        """Use ``other``'s diff memory (Caffe's ``ShareDiff``); see :meth:`share_data`."""
        self._share(other, "diff")

    def copy_from(self, source: Blob, copy_diff: bool = False, reshape: bool = False) -> None:
        """Copy ``source``'s data (or diff, with ``copy_diff``) into this blob's.

        With ``reshape`` this blob first takes ``source``'s shape; without it
        the shapes must be equal. The copy runs on the device when the
        source's head is on it (HEAD_AT_GPU or SYNCED) and both blobs share
        the backend, else on the host.

        Raises ShapeError for a shape or dtype mismatch.
        """
        self._check_compatible(source, "copy_from")
        if source._shape != self._shape or source._count != self._count:
            if not reshape:
                raise ShapeError(
                    f"copy_from: trying to copy blobs of different shapes, source "
                    f"{source.shape_string()}, destination {self.shape_string()}; pass "
                    "reshape=True to reshape the destination"
                )
            self.reshape_like(source)
        if self._count == 0:
            return
        self._copy_values(source, "diff" if copy_diff else "data")


def _owners(mine: object, other: object) -> object:
    """What a blob keeps referenced to keep both ``mine`` and ``other`` (None: nothing)."""
    if mine is None or mine is other:
        return other
    if other is None:
        return mine
    return (mine, other)
