"""A blob's element types and shapes: the checks every Blob constructor and reshape runs,
and the index arithmetic of Caffe's shape API (axes, counts, legacy dims, offsets).

Caffe's rules (``kMaxBlobAxes``, dims >= 0, ``shape_string``'s format) plus the
two this library adds: a closed list of element types, and a byte size the
platform can address, so a shape from an untrusted proto cannot ask for an
impossible allocation. The index functions take the shape and its text (the
blob's ``shape_string()``, for messages) and raise where Caffe would abort.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from ._errors import BlobIndexError, ShapeError

__all__ = [
    "FLOAT_DTYPES",
    "MAX_BLOB_AXES",
    "SUPPORTED_DTYPES",
    "as_dim",
    "canonical_axis",
    "check_dtype",
    "count_range",
    "flat_offset",
    "format_shape",
    "legacy_dim",
    "validate_shape",
]

_LEGACY_NAMES: Final = ("num", "channels", "height", "width")

#: Caffe's ``kMaxBlobAxes``.
MAX_BLOB_AXES: Final = 32

#: The element types a Blob can hold (Caffe instantiates Blob for the first four).
SUPPORTED_DTYPES: Final = (
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.int32),
    np.dtype(np.uint32),
    # Not Caffe's: raw pixel batches (Transform(dtype="uint8")) and class-index
    # labels (label_dtype="int64", as torch's losses take them) use these.
    np.dtype(np.uint8),
    np.dtype(np.int64),
)

FLOAT_DTYPES: Final = (np.dtype(np.float32), np.dtype(np.float64))


def check_dtype(dtype: Any) -> np.dtype[Any]:
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise ShapeError(
            f"unsupported blob dtype {dtype!r}: expected float32, float64, int32, uint32, "
            "uint8 or int64"
        ) from exc
    if dt.newbyteorder("=") not in SUPPORTED_DTYPES or not dt.isnative:
        raise ShapeError(
            f"unsupported blob dtype {dt}: expected float32, float64, int32, uint32, uint8 or int64"
        )
    result: np.dtype[Any] = dt
    return result


def as_dim(value: object, what: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def format_shape(shape: Sequence[int], count: int) -> str:
    # Caffe's shape_string(): every dim followed by a space, then "(count)".
    return "".join(f"{d} " for d in shape) + f"({count})"


def validate_shape(dims: object, itemsize: int) -> tuple[tuple[int, ...], int]:
    """The shape as a tuple of ints and its count; raises ShapeError/TypeError."""
    if isinstance(dims, (str, bytes)) or not hasattr(dims, "__len__"):
        raise TypeError(
            f"a blob shape must be a sequence of ints such as (2, 3, 4, 5), got {dims!r}"
        )
    values = list(dims)  # type: ignore[call-overload]
    if len(values) > MAX_BLOB_AXES:
        raise ShapeError(
            f"a blob has at most {MAX_BLOB_AXES} axes, got {len(values)} "
            f"(shape {format_shape(values, 0)})"
        )
    shape = tuple(as_dim(v, f"dimension {i}") for i, v in enumerate(values))
    count = 1
    for d in shape:
        count *= d
    for i, d in enumerate(shape):
        if d < 0:
            raise ShapeError(
                f"dimension {i} of a blob shape must be >= 0, got {d} "
                f"(shape {format_shape(shape, count)})"
            )
    if count * itemsize > sys.maxsize:
        raise ShapeError(
            f"a blob of shape {format_shape(shape, count)} needs {count * itemsize} bytes, "
            f"more than this platform can address ({sys.maxsize})"
        )
    return shape, count


# -- index arithmetic (Caffe's Blob shape API) --------------------------------------------


def canonical_axis(shape: tuple[int, ...], axis_index: object, text: str) -> int:
    """``axis_index`` in ``[0, len(shape))``; negative values count from the end.

    Raises:
        BlobIndexError: outside ``[-num_axes, num_axes)``.
    """
    axis = as_dim(axis_index, "axis")
    n = len(shape)
    if not -n <= axis < n:
        raise BlobIndexError(f"axis {axis} out of range for {n}-D Blob with shape {text}")
    return axis + n if axis < 0 else axis


def count_range(shape: tuple[int, ...], start_axis: object, end_axis: object, text: str) -> int:
    """The product of the dims in ``[start, end)`` (None: the first / past the last axis).

    Raises:
        BlobIndexError: unless ``0 <= start <= end <= num_axes`` (not canonicalised,
            as in Caffe).
    """
    n = len(shape)
    start = 0 if start_axis is None else as_dim(start_axis, "start_axis")
    end = n if end_axis is None else as_dim(end_axis, "end_axis")
    if not 0 <= start <= end <= n:
        raise BlobIndexError(
            f"count({start}, {end}) needs 0 <= start_axis <= end_axis <= num_axes ({n}) for "
            f"Blob with shape {text}"
        )
    result = 1
    for d in shape[start:end]:
        result *= d
    return result


def legacy_dim(shape: tuple[int, ...], index: object, text: str) -> int:
    """Caffe's ``LegacyShape``: the dim of ``index`` in ``[-4, 4)``, 1 for the axes a
    shape of fewer than 4 axes lacks.

    Raises:
        ShapeError: more than 4 axes.
        BlobIndexError: an index outside ``[-4, 4)``.
    """
    idx = as_dim(index, "index")
    if len(shape) > 4:
        raise ShapeError(
            "cannot use legacy accessors (num/channels/height/width, legacy_shape, "
            f"offset(n, c, h, w)) on a Blob with more than 4 axes: shape {text}; use "
            "shape_at() and offset(indices)"
        )
    if not -4 <= idx < 4:
        raise BlobIndexError(f"legacy axis {idx} out of range [-4, 4) for Blob with shape {text}")
    if idx >= len(shape) or idx < -len(shape):
        return 1
    return shape[idx]


def flat_offset(
    shape: tuple[int, ...], n: object, c: object, h: object, w: object, text: str
) -> int:
    """The row-major index of ``(n, c, h, w)`` in the legacy 4-D view, or of ``n`` as a
    sequence of at most ``num_axes`` indices (missing trailing ones 0).

    Raises:
        BlobIndexError: an index outside ``[0, dim)`` (Caffe lets ``n == num`` through;
            this does not), or too many indices.
        ShapeError: the legacy form on more than 4 axes.
        TypeError: indices that are not ints.
    """
    if isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)):
        dims = [legacy_dim(shape, i, text) for i in range(4)]
        result = 0
        for name, dim, value in zip(_LEGACY_NAMES, dims, (n, c, h, w), strict=True):
            i = as_dim(value, name)
            if not 0 <= i < dim:
                raise BlobIndexError(
                    f"index {name}={i} out of range [0, {dim}) for Blob with shape {text}"
                )
            result = result * dim + i
        return result
    if (c, h, w) != (0, 0, 0):
        raise TypeError("offset(indices) takes the indices as one sequence only")
    if isinstance(n, (str, bytes)) or not hasattr(n, "__len__"):
        raise TypeError(f"offset expects ints or a sequence of ints, got {n!r}")
    indices: Sequence[object] = n  # type: ignore[assignment]
    idx = [as_dim(v, f"index {i}") for i, v in enumerate(indices)]
    if len(idx) > len(shape):
        raise BlobIndexError(
            f"{len(idx)} indices given for a {len(shape)}-D Blob with shape {text}"
        )
    result = 0
    for axis, dim in enumerate(shape):
        result *= dim
        if axis < len(idx):  # missing trailing indices are 0
            if not 0 <= idx[axis] < dim:
                raise BlobIndexError(
                    f"index {idx[axis]} out of range [0, {dim}) for axis {axis} of Blob with "
                    f"shape {text}"
                )
            result += idx[axis]
    return result
