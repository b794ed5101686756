"""Decoding encoded images, as Caffe does: OpenCV's ``imdecode``, with a size guard.

Caffe decodes an encoded Datum with ``cv::imdecode``: ``force_color`` →
``IMREAD_COLOR``, ``force_gray`` → ``IMREAD_GRAYSCALE``, neither →
``IMREAD_UNCHANGED`` (:func:`imread_flag`). blobpipe's reference is the installed
OpenCV's ``cv2.imdecode``, and every image it returns is that function's.

:func:`decode_image` is the one entry point (the Datum readers and the batch path
both use it): an image whose PNG or JPEG header announces more than
``max_pixels`` pixels is refused before anything is allocated (other formats are
bounded by OpenCV's own ``OPENCV_IO_MAX_IMAGE_PIXELS``, set to the same limit);
what OpenCV cannot decode comes back as :class:`Undecodable`, a sentence the
caller puts in its error. :func:`decode_many` decodes a batch's images one after
another, each as the caller asks for it. OpenCV releases the GIL while it
decodes, so worker threads decode in parallel.

(A libjpeg-turbo shortcut through simplejpeg, exact where it applies, was
measured on the ImageNet-sized JPEG workload and dropped: with two workers it
made no difference to the Loader; see ``docs/performance.md``.)
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from .._errors import ProtoError

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "JpegFrame",
    "Undecodable",
    "decode_image",
    "decode_many",
    "image_header",
    "imread_flag",
    "jpeg_frame",
]

#: Largest decoded image (width × height) :func:`datum_view` and friends accept by default.
DEFAULT_MAX_PIXELS = 1 << 26

_cv2: Any = None  # OpenCV, once the first encoded record needed it


def _opencv() -> Any:
    """OpenCV, imported on first use (never at import of blobpipe)."""
    global _cv2
    if _cv2 is None:
        # Formats whose header we cannot read are bounded by OpenCV's own limit,
        # which it reads on its first decode: at most DEFAULT_MAX_PIXELS unless
        # the environment sets another.
        os.environ.setdefault("OPENCV_IO_MAX_IMAGE_PIXELS", str(DEFAULT_MAX_PIXELS))
        import cv2  # OpenCV loads on the first encoded record, not at import

        _cv2 = cv2
    return _cv2


class JpegFrame(NamedTuple):
    """A JPEG's first frame header (SOFn)."""

    marker: int  # 0xC0 baseline, 0xC1 extended, 0xC2 progressive, ...
    precision: int  # bits per sample
    width: int
    height: int
    components: int


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_BE16 = struct.Struct(">H")
_BE32X2 = struct.Struct(">II")


def jpeg_frame(b: bytes) -> JpegFrame | None:
    """The first frame header of JPEG bytes ``b`` (after the SOI), None if there is none."""
    n = len(b)
    i = 2
    while i + 4 <= n:
        if b[i] != 0xFF:  # extraneous bytes before a marker: libjpeg skips them
            i += 1
            continue
        marker = b[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            i += 2
            continue
        if marker in _SOF_MARKERS:
            if i + 10 > n:
                return None
            height, width = _BE16.unpack_from(b, i + 5)[0], _BE16.unpack_from(b, i + 7)[0]
            return JpegFrame(marker, b[i + 4], width, height, b[i + 9])
        i += 2 + _BE16.unpack_from(b, i + 2)[0]
    return None


class Undecodable(NamedTuple):
    """Why an image cannot be had: a sentence, and whether the bytes are damaged
    (rather than genuine but refused, e.g. too large or not 8-bit)."""

    reason: str
    damaged: bool


def image_header(b: bytes | memoryview) -> tuple[int, int, JpegFrame | None] | None:
    """(width, height, the JPEG frame header or None for a PNG) from a PNG or JPEG
    header, None for other or unreadable data."""
    n = len(b)
    head = bytes(b[:4096])  # headers sit at the start: scan a bytes copy, not the view
    if n >= 24 and head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
        width, height = _BE32X2.unpack_from(head, 16)
        return width, height, None
    if n >= 4 and head[0] == 0xFF and head[1] == 0xD8:
        frame = jpeg_frame(head)
        if frame is None and n > len(head):
            frame = jpeg_frame(bytes(b))  # a long header (EXIF, ICC profile, ...)
        return None if frame is None else (frame.width, frame.height, frame)
    return None


def decode_image(
    data: bytes | memoryview, flag: int, max_pixels: int = DEFAULT_MAX_PIXELS
) -> npt.NDArray[np.uint8] | Undecodable:
    """One image as ``cv2.imdecode(data, flag)`` gives it, as an ``(H, W, C)`` uint8
    array (C = 1 for gray); or, where it cannot be had, why (see the module
    docstring)."""
    if not len(data):
        return Undecodable("the record says encoded: true but holds no image bytes in data", True)
    header = image_header(data)
    if header is not None and header[0] * header[1] > max_pixels:
        return Undecodable(
            f"the encoded image announces {header[0]}×{header[1]} pixels, more than "
            f"max_pixels={max_pixels}; pass a larger max_pixels if the image is genuine",
            False,
        )
    cv2 = _opencv()
    try:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
    except cv2.error as exc:
        return Undecodable(f"OpenCV refused the encoded image ({str(exc).strip()})", True)
    if img is None:
        return Undecodable(
            f"OpenCV cannot decode the encoded image ({len(data)} bytes, starting "
            f"{bytes(data[:8])!r})",
            True,
        )
    if img.dtype != np.uint8:
        return Undecodable(
            f"the encoded image decodes to {img.dtype} pixels; Caffe needs 8-bit images "
            "(its Transform checks CV_8U): re-encode it as 8-bit, or set force_color or "
            "force_gray, which convert to 8-bit",
            False,
        )
    hwc = cast("npt.NDArray[np.uint8]", img)
    return hwc[..., np.newaxis] if hwc.ndim == 2 else hwc


def decode_many(
    images: Iterable[bytes | memoryview], flag: int, max_pixels: int = DEFAULT_MAX_PIXELS
) -> Iterator[npt.NDArray[np.uint8] | Undecodable]:
    """:func:`decode_image` for each of ``images``, one after another, as the caller
    asks for the next: a batch's rows are decoded and used one at a time, each
    image still in cache when it is transformed."""
    for data in images:
        yield decode_image(data, flag, max_pixels)


def imread_flag(force_color: bool, force_gray: bool) -> int:
    """The ``cv2.imdecode`` flag Caffe's DataTransformer decodes with.

    Raises:
        ProtoError: both are set.
    """
    if force_color and force_gray:
        raise ProtoError(
            "cannot set both force_color and force_gray (as Caffe's TransformationParameter "
            "refuses); set at most one"
        )
    if force_color:
        return 1  # cv2.IMREAD_COLOR
    if force_gray:
        return 0  # cv2.IMREAD_GRAYSCALE
    return -1  # cv2.IMREAD_UNCHANGED; Caffe's DecodeDatumToCVMatNative: cv::imdecode(.., -1)
