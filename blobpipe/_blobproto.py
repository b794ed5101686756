"""A Blob from and to Caffe's ``BlobProto`` message (``Blob::FromProto``, ``ToProto``,
``ShapeEquals``): :class:`BlobProtoIO`, a base of :class:`~blobpipe.Blob` that works
through the Blob's public accessors only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._codec import BlobProto, fill_blobproto, proto_arrays, proto_shape_equals
from ._errors import UnsupportedOperationError
from ._shape import FLOAT_DTYPES

__all__ = ["BlobProtoIO"]


def _check_float(dtype: np.dtype[Any], what: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise UnsupportedOperationError(
            f"{what}: BlobProto has no integer fields (float or double values only), and this "
            f"blob is {dtype}; use a float32 or float64 blob"
        )


class BlobProtoIO:
    """The protobuf methods of :class:`~blobpipe.Blob` (see the module docstring)."""

    if TYPE_CHECKING:  # what the Blob provides

        @property
        def dtype(self) -> np.dtype[Any]: ...
        @property
        def shape(self) -> tuple[int, ...]: ...
        def count(self, start_axis: int | None = None, end_axis: int | None = None) -> int: ...
        def shape_string(self) -> str: ...
        def check_open(self) -> None: ...
        def reshape(self, *shape: Any) -> None: ...
        def cpu_data(self) -> np.ndarray[Any, Any]: ...
        def cpu_diff(self) -> np.ndarray[Any, Any]: ...
        def mutable_cpu_data(self) -> np.ndarray[Any, Any]: ...
        def mutable_cpu_diff(self) -> np.ndarray[Any, Any]: ...

    def shape_equals(self, proto: BlobProto) -> bool:
        """Whether ``proto``'s shape equals this blob's (Caffe's ``ShapeEquals``).

        When any legacy field (num, channels, height, width) is set, the blob
        must have at most 4 axes and match them padded with leading 1s, as
        legacy parameter blobs were indexed from the end.
        """
        return proto_shape_equals(proto, self.shape)

    def from_proto(self, proto: BlobProto, reshape: bool = True) -> None:
        """Load shape (with ``reshape``), data and diff from a ``caffe.BlobProto``.

        The shape comes from the legacy num/channels/height/width fields when
        any is set (unset ones read 0, as in Caffe), else from ``shape``.
        Without ``reshape`` the proto's shape must equal the blob's
        (:meth:`shape_equals`). Data comes from ``double_data`` when it is not
        empty, else ``data``; the diff likewise, and stays untouched when the
        proto has none. Values are cast to the blob's dtype. Everything is
        validated before the blob changes.

        Raises ProtoError for a bad shape or a value count that differs from
        the shape's, ShapeError for a shape mismatch without ``reshape``,
        UnsupportedOperationError for integer blobs.
        """
        self.check_open()
        _check_float(self.dtype, "from_proto")
        shape, data, diff = proto_arrays(
            proto,
            self.dtype.itemsize,
            None if reshape else (self.shape, self.count()),
            self.shape_string(),
        )
        if reshape:
            self.reshape(shape)
        if data.size:
            self.mutable_cpu_data().reshape(-1)[:] = data
            if diff is not None:
                self.mutable_cpu_diff().reshape(-1)[:] = diff

    def to_proto(self, write_diff: bool = False, proto: BlobProto | None = None) -> BlobProto:
        """This blob as a ``caffe.BlobProto`` (Caffe's ``ToProto``).

        Writes the ``shape`` field (never the legacy ones) and the data; float64
        blobs write ``double_data``/``double_diff``, float32 blobs
        ``data``/``diff``. With ``write_diff`` the diff is written too. A
        ``proto`` passed in is cleared, filled and returned.

        Raises UnsupportedOperationError for integer blobs (BlobProto has no
        integer fields), StateError when closed.
        """
        self.check_open()
        _check_float(self.dtype, "to_proto")
        count = self.count()
        data = self.cpu_data() if count else None
        diff = self.cpu_diff() if count and write_diff else None
        return fill_blobproto(proto, self.shape, data, diff)
