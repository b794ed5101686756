"""Caffe's math on a Blob's data or diff (the part of ``math_functions.cpp`` that
``blob.cpp`` calls): ``update``, ``asum_*``, ``sumsq_*``, ``scale_*`` and the copy
behind ``copy_from``.

:class:`BlobMath` is :class:`~blobpipe.Blob`'s base and works through the Blob's
public accessors only (``data``/``diff``, ``cpu_*``/``gpu_*``, ``backend``).

Invariant: an operation runs on the side of its memory's head, as Caffe does in
GPU mode: ``HEAD_AT_CPU`` on the host with NumPy, ``HEAD_AT_GPU`` and ``SYNCED``
on the device with the backend's array module, ordered after the caller's current
stream and the copies that brought the operands, and waited for (docs/design.md,
"Streams and events"). An uninitialised memory is never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ._errors import StateError, UnsupportedOperationError
from ._shape import FLOAT_DTYPES
from ._syncedmem import Head

if TYPE_CHECKING:
    from ._backends import Backend
    from ._syncedmem import SyncedMemory

__all__ = ["BlobMath"]

Which = Literal["data", "diff"]


class BlobMath:
    """The math methods of :class:`~blobpipe.Blob` (see the module docstring)."""

    if TYPE_CHECKING:  # what the Blob provides

        @property
        def backend(self) -> Backend: ...
        @property
        def dtype(self) -> np.dtype[Any]: ...
        @property
        def data(self) -> SyncedMemory: ...
        @property
        def diff(self) -> SyncedMemory: ...
        def count(self, start_axis: int | None = None, end_axis: int | None = None) -> int: ...
        def shape_string(self) -> str: ...
        def check_open(self) -> None: ...
        def cpu_data(self) -> np.ndarray[Any, Any]: ...
        def cpu_diff(self) -> np.ndarray[Any, Any]: ...
        def mutable_cpu_data(self) -> np.ndarray[Any, Any]: ...
        def mutable_cpu_diff(self) -> np.ndarray[Any, Any]: ...
        def gpu_data(self) -> Any: ...
        def gpu_diff(self) -> Any: ...
        def mutable_gpu_data(self) -> Any: ...
        def mutable_gpu_diff(self) -> Any: ...

    def _check_float(self, why: str) -> None:
        if self.dtype not in FLOAT_DTYPES:
            raise UnsupportedOperationError(f"{why}; use a float32 or float64 blob")

    def _check_math(self, what: str) -> None:
        self._check_float(f"{what}() is not implemented for {self.dtype} blobs (NOT_IMPLEMENTED)")
        self.check_open()

    def _head_on_device(self, which: Which) -> bool:
        """Whether ``which``'s current bytes are on the device (HEAD_AT_GPU, SYNCED)."""
        head = (self.data if which == "data" else self.diff).head
        return self.backend.has_device and head in (Head.HEAD_AT_GPU, Head.SYNCED)

    def _on_device(self, which: Which) -> bool | None:
        """True: compute on the device; False: on the host; None: uninitialised."""
        head = (self.data if which == "data" else self.diff).head
        return None if head is Head.UNINITIALIZED else self._head_on_device(which)

    def _array(self, which: Which, on_device: bool, mutable: bool) -> Any:
        """The data or diff on the side the math runs on."""
        if which == "data":
            if on_device:
                return self.mutable_gpu_data() if mutable else self.gpu_data()
            return self.mutable_cpu_data() if mutable else self.cpu_data()
        if on_device:
            return self.mutable_gpu_diff() if mutable else self.gpu_diff()
        return self.mutable_cpu_diff() if mutable else self.cpu_diff()

    def _compute(self, on_device: bool, fn: Callable[[Any], Any]) -> Any:
        """``fn(xp)``, ``xp`` the device's array module or NumPy; on the device,
        launched (ordered after the caller's stream and the backend's copies) and
        waited for, so the caller's later work, copies and host reads come after it."""
        if not on_device:
            return fn(np)
        xp = self.backend.xp
        result: list[Any] = []
        self.backend.launch(lambda: result.append(fn(xp))).synchronize()
        return result[0]

    def _copy_values(self, source: BlobMath, which: Which) -> None:
        """``which`` of ``source`` (of this blob's shape) into this blob's: on the
        device when the source's head is there and both share a backend."""
        on_device = source.backend is self.backend and source._head_on_device(which)
        src = source._array(which, on_device, False)
        dst = self._array(which, on_device, True)
        self._compute(on_device, lambda xp: xp.copyto(dst, src))

    def update(self) -> None:
        """``data -= diff`` (Caffe's ``Update``), on the side of the data's head.

        Raises UnsupportedOperationError for integer blobs, StateError when the
        data was never initialised (Caffe: "Syncedmem not initialized.") or the
        blob is closed.
        """
        self._check_math("update")
        side = self._on_device("data")
        if side is None:
            raise StateError(
                f"update(): the data of Blob {self.shape_string()} was never initialised "
                "(Caffe: 'Syncedmem not initialized'); write it with mutable_cpu_data() "
                "or mutable_gpu_data() first"
            )
        diff = self._array("diff", side, False)
        data = self._array("data", side, True)
        self._compute(side, lambda xp: xp.subtract(data, diff, out=data))

    def _reduce(self, which: Which, what: str, squares: bool) -> float:
        self._check_math(what)
        if self.count() == 0:
            return 0.0
        side = self._on_device(which)
        if side is None:
            return 0.0
        flat = self._array(which, side, False).reshape(-1)
        return float(
            self._compute(side, lambda xp: (flat * flat).sum() if squares else xp.abs(flat).sum())
        )

    def asum_data(self) -> float:
        """The sum of absolute values of the data, on the side of its head (0 when
        uninitialised). Raises UnsupportedOperationError for integer blobs."""
        return self._reduce("data", "asum_data", squares=False)

    def asum_diff(self) -> float:
        """The sum of absolute values of the diff (see :meth:`asum_data`)."""
        return self._reduce("diff", "asum_diff", squares=False)

    def sumsq_data(self) -> float:
        """The sum of squares of the data, on the side of its head (0 when
        uninitialised). Raises UnsupportedOperationError for integer blobs."""
        return self._reduce("data", "sumsq_data", squares=True)

    def sumsq_diff(self) -> float:
        """The sum of squares of the diff (see :meth:`sumsq_data`)."""
        return self._reduce("diff", "sumsq_diff", squares=True)

    def _scale(self, which: Which, what: str, factor: float) -> None:
        self._check_math(what)
        if self.count() == 0:
            return
        side = self._on_device(which)
        if side is None:
            return
        value = self.dtype.type(factor)
        array = self._array(which, side, True)
        self._compute(side, lambda xp: xp.multiply(array, value, out=array))

    def scale_data(self, factor: float) -> None:
        """Multiply the data by ``factor`` in place, on the side of its head (nothing
        when uninitialised). Raises UnsupportedOperationError for integer blobs."""
        self._scale("data", "scale_data", factor)

    def scale_diff(self, factor: float) -> None:
        """Multiply the diff by ``factor`` in place (see :meth:`scale_data`)."""
        self._scale("diff", "scale_diff", factor)
