"""Memory layouts: Caffe's NCHW and the channels-last NHWC.

Caffe stores a batch as N×C×H×W, row-major: the element (n, c, h, w) lives at
flat offset ``((n*C + c)*H + h)*W + w``, so each channel is a contiguous H×W
plane. Channels-last (NHWC, what OpenCV, PIL and most JPEG decoders produce)
puts it at ``((n*H + h)*W + w)*C + c``, so the channels of a pixel are
adjacent.

The converters work on NumPy and CuPy arrays alike (they only use
``transpose`` and ``copy``) and on single images: CHW ↔ HWC for 3-D arrays.
"""

from __future__ import annotations

from typing import Any

from ._errors import BlobIndexError, ShapeError

__all__ = ["nchw_offset", "nchw_to_nhwc", "nhwc_offset", "nhwc_to_nchw"]

_TO_NHWC = {4: (0, 2, 3, 1), 3: (1, 2, 0)}
_TO_NCHW = {4: (0, 3, 1, 2), 3: (2, 0, 1)}


def _convert(array: Any, axes: dict[int, tuple[int, ...]], what: str, copy: bool) -> Any:
    ndim = getattr(array, "ndim", None)
    if ndim not in axes:
        shape = getattr(array, "shape", None)
        raise ShapeError(
            f"{what} expects a 4-D batch or a 3-D image, got an array of shape {shape}"
        )
    out = array.transpose(axes[ndim])
    # ndarray.copy() (NumPy and CuPy) defaults to C order: a contiguous result.
    return out.copy() if copy else out


def nchw_to_nhwc(array: Any, *, copy: bool = True) -> Any:
    """An N×C×H×W array as N×H×W×C (a C×H×W image as H×W×C).

    With ``copy`` (the default) the result is a new C-contiguous array;
    without, a strided view of ``array``. Raises ShapeError unless ``array``
    is 3-D or 4-D.
    """
    return _convert(array, _TO_NHWC, "nchw_to_nhwc", copy)


def nhwc_to_nchw(array: Any, *, copy: bool = True) -> Any:
    """An N×H×W×C array as N×C×H×W (an H×W×C image as C×H×W); see :func:`nchw_to_nhwc`."""
    return _convert(array, _TO_NCHW, "nhwc_to_nchw", copy)


def _check(shape: tuple[int, int, int, int], index: tuple[int, int, int, int]) -> None:
    if len(shape) != 4 or any(d < 0 for d in shape):
        raise ShapeError(f"expected a 4-D shape of non-negative dims, got {shape}")
    for name, dim, i in zip("NCHW", shape, index, strict=True):
        if not 0 <= i < dim:
            raise BlobIndexError(
                f"index {name.lower()}={i} out of range [0, {dim}) for shape {shape}"
            )


def nchw_offset(shape: tuple[int, int, int, int], n: int, c: int, h: int, w: int) -> int:
    """The flat offset of (n, c, h, w) in an NCHW array of ``shape`` = (N, C, H, W):
    ``((n*C + c)*H + h)*W + w``, Caffe's ``Blob.offset``.

    Raises BlobIndexError for an index outside its dim, ShapeError for a bad shape.
    """
    _check(shape, (n, c, h, w))
    _, C, H, W = shape
    return ((n * C + c) * H + h) * W + w


def nhwc_offset(shape: tuple[int, int, int, int], n: int, c: int, h: int, w: int) -> int:
    """The flat offset of (n, c, h, w) in an NHWC array of logical ``shape`` =
    (N, C, H, W): ``((n*H + h)*W + w)*C + c``.

    Raises BlobIndexError for an index outside its dim, ShapeError for a bad shape.
    """
    _check(shape, (n, c, h, w))
    _, C, H, W = shape
    return ((n * H + h) * W + w) * C + c
