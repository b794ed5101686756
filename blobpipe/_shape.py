"""A blob's element types and shapes: the checks every Blob constructor and reshape runs.

Caffe's rules (``kMaxBlobAxes``, dims >= 0, ``shape_string``'s format) plus the
two this library adds: a closed list of element types, and a byte size the
platform can address, so a shape from an untrusted proto cannot ask for an
impossible allocation.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from ._errors import ShapeError

__all__ = [
    "FLOAT_DTYPES",
    "MAX_BLOB_AXES",
    "SUPPORTED_DTYPES",
    "as_dim",
    "check_dtype",
    "format_shape",
    "validate_shape",
]

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
