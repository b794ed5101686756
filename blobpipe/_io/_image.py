"""Images, as Caffe reads and writes them: OpenCV's ``imdecode`` with a size guard,
``imencode`` and ``resize`` (the one module that imports OpenCV; also the captions
``blobpipe show`` draws).

Caffe decodes an encoded Datum with ``cv::imdecode``: ``force_color`` →
``IMREAD_COLOR``, ``force_gray`` → ``IMREAD_GRAYSCALE``, neither →
``IMREAD_UNCHANGED`` (:func:`imread_flag`). blobpipe's reference is the installed
OpenCV's ``cv2.imdecode``, and every image it returns is that function's.

:func:`decode_image` is the one entry point (the Datum readers and the batch path
both use it): an image whose header announces more than ``max_pixels`` pixels,
or whose size cannot be read from its header (every format OpenCV reads:
``_imagehead``), is refused before anything is allocated, whoever imported OpenCV
first; what OpenCV cannot decode comes back as :class:`Undecodable`, a sentence the
caller puts in its error. OpenCV releases the GIL while it
decodes, so worker threads decode in parallel.

A batch's images go through the compiled ``_jpegwindow`` module (libjpeg-turbo, built
when its headers are present at install) wherever the pixels are exactly those of
OpenCV's whole-image decode (an ordinary colour JPEG: see ``_jpegwindow.c``): a batch's
JPEGs in one call (:func:`decode_rows`; of one size, or each of its own size as its
header says, :func:`image_sizes`, under a crop); where a batch keeps only a crop
of an image, :func:`decode_window` decodes only the crop's window (partial
decompression); where it keeps the whole image, :func:`decode_whole` decodes it
straight into a block of the thread's, without OpenCV's fixed cost per call (about a
third of a 64×64 image's decode). A batch's 8-bit RGB PNGs go through the compiled
``_pngrows`` module (libpng, built when its headers are present) in one call the same
way (:func:`decode_rows`; see ``_pngrows.c``). Every other image, or every image when
the modules are absent, is decoded by :func:`decode_image`.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from .._errors import DataError, ProtoError
from ._imagehead import NO_SIGNATURE, JpegFrame, image_size, jpeg_frame
from ._kernels import Geometry

__all__ = [
    "CAPTION_SCALE",
    "DEFAULT_MAX_PIXELS",
    "IMAGE_JPEG",
    "IMAGE_PNG",
    "JpegFrame",
    "Undecodable",
    "decode_image",
    "decode_rows",
    "decode_whole",
    "decode_window",
    "encode_image",
    "image_header",
    "image_sizes",
    "imread_flag",
    "jpeg_frame",
    "jpeg_window_decoding",
    "put_text",
    "resize_image",
    "rows_decodable",
    "text_width",
]

#: Largest decoded image (width × height) :func:`datum_view` and friends accept by default.
DEFAULT_MAX_PIXELS = 1 << 26

_cv2: Any = None  # OpenCV, once the first encoded record needed it


def _opencv() -> Any:
    """OpenCV, imported on first use (never at import of blobpipe)."""
    global _cv2
    if _cv2 is None:
        # Every image's size is checked from its header before it is decoded; OpenCV's
        # own limit (read once, when OpenCV is first imported, so only when it is
        # imported here) is a second bound.
        os.environ.setdefault("OPENCV_IO_MAX_IMAGE_PIXELS", str(DEFAULT_MAX_PIXELS))
        import cv2  # OpenCV loads on the first encoded record, not at import

        _cv2 = cv2
    return _cv2


class Undecodable(NamedTuple):
    """Why an image cannot be had: a sentence, and whether the bytes are damaged
    (rather than genuine but refused, e.g. too large or not 8-bit)."""

    reason: str
    damaged: bool


def image_header(b: bytes | memoryview) -> tuple[int, int, JpegFrame | None] | None:
    """(width, height, the JPEG frame header or None) from an encoded image's header
    (any format OpenCV reads, see ``_imagehead``); None where it cannot be read."""
    size = image_size(b)
    return None if isinstance(size, str) else (size.width, size.height, size.frame)


def decode_image(
    data: bytes | memoryview,
    flag: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    *,
    decoded_before: bool = False,
    too_large: str = "pass a larger max_pixels if the image is genuine",
) -> npt.NDArray[np.uint8] | Undecodable:
    """One image as ``cv2.imdecode(data, flag)`` gives it, as an ``(H, W, C)`` uint8
    array (C = 1 for gray); or, where it cannot be had, why (see the module
    docstring). ``decoded_before``: these very bytes decoded before within
    ``max_pixels`` (a record the index noted the shape of, in a snapshot that has not
    changed), so their header is not read again for the size check. ``too_large``:
    the fix the reason gives for an image over ``max_pixels`` (the caller's)."""
    if not len(data):
        return Undecodable("the record says encoded: true but holds no image bytes in data", True)
    if decoded_before:
        return _imdecode(data, flag)
    size = image_size(data)
    if isinstance(size, str):  # no decoder may be left to allocate what the bytes say
        who = "OpenCV cannot" if size == NO_SIGNATURE else "cannot"
        return Undecodable(
            f"{who} decode the encoded image ({len(data)} bytes, starting "
            f"{bytes(data[:8])!r}): {size}",
            True,
        )
    if size.width * size.height > max_pixels:
        return Undecodable(
            f"the encoded image announces {size.width}×{size.height} pixels, more than "
            f"max_pixels={max_pixels}; {too_large}",
            False,
        )
    return _imdecode(data, flag)


def _imdecode(data: bytes | memoryview, flag: int) -> npt.NDArray[np.uint8] | Undecodable:
    """``cv2.imdecode`` of bytes whose size was checked (see :func:`decode_image`)."""
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


_UNLOADED: Any = object()
# the compiled decoders (None: not built here), loaded on first use like OpenCV
_jpegwindow: Any = _UNLOADED
_pngrows: Any = _UNLOADED
# one growing block per thread for the images decode_window and decode_whole return (of a
# window, only the window and its margin are written), kept up to this size; a larger
# image gets a block of its own, freed with its result
_scratch = threading.local()
_SCRATCH_KEEP = 32 << 20


def _compiled(name: str) -> Any:
    """The compiled module ``name`` of this package (``_jpegwindow``, ``_pngrows``), or
    None where it was not built here (its library's headers were missing at install);
    imported on first use, like OpenCV, and kept in the module global of that name."""
    module = globals()[name]
    if module is _UNLOADED:
        try:
            module = importlib.import_module(f".{name}", __package__)
        except ImportError:  # decoded by OpenCV, one image at a time
            module = None
        globals()[name] = module
    return module


def compiled_modules() -> tuple[Any, Any]:
    """The compiled decoders ``_jpegwindow`` and ``_pngrows`` (None where not built)."""
    return _compiled("_jpegwindow"), _compiled("_pngrows")


def jpeg_window_decoding() -> bool:
    """Whether this installation decodes JPEG records with libjpeg-turbo (built at
    install where its headers are present): only the crop's window when a transform
    crops (partial decompression), and a batch's JPEGs of one size in one call;
    where False, images are decoded whole with OpenCV, one at a time, which gives
    the same pixels."""
    return _compiled("_jpegwindow") is not None


def _thread_block(need: int) -> npt.NDArray[np.uint8]:
    """``need`` bytes of this thread's block (grown to fit; kept up to _SCRATCH_KEEP)."""
    block = getattr(_scratch, "block", None)
    if block is None or len(block) < need:
        block = np.empty(need, np.uint8)
        if need <= _SCRATCH_KEEP:
            _scratch.block = block
    return cast("npt.NDArray[np.uint8]", block[:need])


def decode_whole(
    data: bytes | memoryview,
    flag: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    *,
    decoded_before: bool = False,
) -> npt.NDArray[np.uint8] | Undecodable:
    """:func:`decode_image`'s pixels of an image read once, right away: where libjpeg-turbo
    gives exactly OpenCV's pixels (see the module docstring), an ``(H, W, 3)`` view of a
    block of this thread's, valid until this thread's next call here or to
    :func:`decode_window`; otherwise :func:`decode_image`'s result."""
    decoder = _compiled("_jpegwindow")
    if decoder is not None and flag in (1, -1) and data[:2] == b"\xff\xd8":
        block = getattr(_scratch, "block", None)
        if block is None:
            block = _thread_block(1 << 16)
        status, h, w = decoder.decode_whole(data, block, max_pixels)
        if status == 2:  # a larger image than the block holds: its size is within max_pixels
            block = _thread_block(h * w * 3)
            status, h, w = decoder.decode_whole(data, block, max_pixels)
        if status == 1:
            return cast("npt.NDArray[np.uint8]", block[: h * w * 3].reshape(h, w, 3))
    return decode_image(data, flag, max_pixels, decoded_before=decoded_before)


def decode_window(
    data: bytes | memoryview,
    flag: int,
    window: Callable[[int, int], tuple[int, int, int, int] | None],
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> npt.NDArray[np.uint8] | Undecodable:
    """:func:`decode_image`, for an image of which only a window will be read:
    ``window(height, width)`` says which (``(top, left, height, width)``, or None for
    the whole image). Where the window alone can be decoded exactly (see the module
    docstring), the result is an ``(H, W, 3)`` view of a block of this thread's whose
    window holds the pixels :func:`decode_image` would give, the rest unspecified,
    valid until this thread's next call here or to :func:`decode_whole`; otherwise
    :func:`decode_image`'s result (a window of the whole image goes to
    :func:`decode_whole`)."""
    decoder = _compiled("_jpegwindow")
    if decoder is not None and flag in (1, -1):
        size = image_size(data)
        frame = None if isinstance(size, str) else size.frame
        if frame is not None and frame.components == 3 and frame.precision == 8:
            h, w = frame.height, frame.width
            win = window(h, w) if 0 < h * w <= max_pixels else None
            if win is not None and win[2] * win[3] < h * w:
                out = _thread_block(h * w * 3)
                if decoder.decode_window(data, out, *win):
                    return out.reshape(h, w, 3)
            elif win is not None:  # the window is the whole image
                return decode_whole(data, flag, max_pixels)
    return decode_image(data, flag, max_pixels)


#: :func:`image_sizes`' formats (the compiled modules' ``header_size``, ``_kernel.h``).
IMAGE_JPEG = 1
IMAGE_PNG = 2


def image_sizes(
    images: Any, extents: npt.NDArray[np.int64] | None = None
) -> npt.NDArray[np.intp] | None:
    """Per image, ``(format, height, width)`` from its header, read by the compiled
    decoders' ``image_sizes`` (``_kernel.h``'s ``header_size``) in one call without the
    GIL: :data:`IMAGE_JPEG` with its first frame header's size, :data:`IMAGE_PNG` with
    its IHDR's, 0 for anything else (or a row left alone); ``0 × 0`` where the size
    cannot be read. ``images``: row ``i``'s bytes or None; or, with ``extents`` (a
    C-contiguous ``(n, 2)`` int64 array), one buffer, row ``i``'s bytes at
    ``extents[i] = (offset, length)`` (offset -1: left alone). A hint for drawing each
    row's crop before :func:`decode_rows` (which checks every image's size as it
    decodes it). None where no compiled decoder is built here."""
    decoder = _compiled("_jpegwindow") or _compiled("_pngrows")
    if decoder is None:
        return None
    args = (images,) if extents is None else (images, extents)
    heads = np.frombuffer(decoder.image_sizes(*args), np.intp)
    return cast("npt.NDArray[np.intp]", heads.reshape(-1, 3))


def rows_decodable(shape: tuple[int, ...], flag: int) -> bool:
    """Whether :func:`decode_rows` can write any row of images of ``shape`` decoded with
    ``flag`` here (a compiled decoder, colour or unchanged, 3 channels): the caller
    prepares its arguments only then."""
    return (
        flag in (1, -1)
        and len(shape) == 3
        and shape[0] == 3
        and (_compiled("_jpegwindow") is not None or _compiled("_pngrows") is not None)
    )


def decode_rows(
    images: Any,
    shape: tuple[int, ...],
    flag: int,
    kernel_args: tuple[Any, ...],
    sizes: npt.NDArray[np.intp] | None = None,
    formats: npt.NDArray[np.intp] | None = None,
    extents: npt.NDArray[np.int64] | None = None,
) -> bytes | None:
    """A batch's JPEGs and PNGs of ``shape`` (``(3, H, W)``, within the pixel limit: the
    batch's, already checked) decoded and transformed into their output rows, one
    call per format without the GIL (``_jpegwindow.decode_rows``: only a crop's
    window, where there is a crop; ``_pngrows.decode_rows``: 8-bit RGB PNGs),
    wherever the pixels are exactly OpenCV's (see the module docstring).
    ``images``, ``extents``: as :func:`image_sizes` takes them (every image goes to
    the decoder of its format, which leaves it where it cannot promise OpenCV's
    pixels); ``kernel_args``: ``_kernels.kernel_args`` of the rows' outputs, geometry
    and spec. ``sizes``: each row's own ``(height, width)`` (a C-contiguous ``(n, 2)``
    intp array, each within the pixel limit, the crop drawn for it; the kernel's spec
    the same for every size: ``Transform.crops_any_size``), else every row is of
    ``shape``. ``formats``: :func:`image_sizes`' formats of the images, where the
    caller has them. Returns which rows were written, one byte a row (1: written;
    ``np.frombuffer(status, np.bool_)``: as an array); the caller fills the others
    (another format or size, refused, or left alone). None where nothing can be done
    here (no compiled decoder, a flag other than colour or unchanged, not 3
    channels)."""
    if not rows_decodable(shape, flag):
        return None
    if formats is None:
        heads = image_sizes(images, extents)
        formats = np.zeros(0, np.intp) if heads is None else heads[:, 0]
    present = set(formats.tolist())
    extra = (sizes,) if extents is None else (sizes, extents)
    done: bytes | None = None
    for decoder, kind in (
        (_compiled("_jpegwindow"), IMAGE_JPEG),
        (_compiled("_pngrows"), IMAGE_PNG),
    ):
        if decoder is not None and kind in present:
            status = bytes(decoder.decode_rows(images, shape, *kernel_args, *extra))
            if done is not None:  # (a batch of JPEGs and PNGs) each row by one decoder
                status = (np.frombuffer(done, np.uint8) | np.frombuffer(status, np.uint8)).tobytes()
            done = status
    return done


class Decoded(NamedTuple):
    """The rows of a fill range decoded and transformed in one call: which were written
    (``status``: one byte a row, 1 where written), every row's crop and flip
    (``geometry``: those of the rows written are theirs) and ``(H, W)`` size
    (``sizes``: the rows written were decoded at theirs)."""

    status: bytes
    geometry: Geometry
    sizes: npt.NDArray[np.intp]

    @property
    def every(self) -> bool:
        """Whether every row was written (a bytes count: a NumPy reduction took 80 µs
        right after a W4 batch's decode, its code evicted from the caches)."""
        return self.status.count(0) == 0

    @property
    def done(self) -> npt.NDArray[np.bool_]:
        """Which rows were written."""
        return np.frombuffer(self.status, np.bool_)


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


def resize_image(hwc: npt.NDArray[np.uint8], height: int, width: int) -> npt.NDArray[np.uint8]:
    """``hwc`` (``(H, W, C)``) resized to ``height`` × ``width`` as Caffe's
    ``ReadImageToCVMat`` does: ``cv::resize`` with its default bilinear filter."""
    cv2 = _opencv()
    out = np.asarray(cv2.resize(hwc, (width, height)))
    return out.reshape(height, width, hwc.shape[2])


def encode_image(hwc: npt.NDArray[np.uint8], ext: str) -> bytes:
    """``hwc`` (``(H, W, C)``, BGR or gray) encoded as ``cv2.imencode("." + ext, hwc)``
    encodes it (OpenCV's defaults: JPEG quality 95), as Caffe's ``convert_imageset``
    re-encodes an image.

    Raises:
        DataError: OpenCV cannot encode it in that format (its message included).
    """
    cv2 = _opencv()
    try:
        ok, buf = cv2.imencode("." + ext, hwc)
    except cv2.error as exc:
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise DataError(f"OpenCV cannot encode a {hwc.shape} image as {ext!r} ({detail})") from exc
    if not ok:
        raise DataError(f"OpenCV cannot encode a {hwc.shape} image as {ext!r}")
    return bytes(buf)


#: The caption font (OpenCV's Hershey simplex, ASCII) and its scale.
CAPTION_SCALE = 0.35


def text_width(text: str, scale: float = CAPTION_SCALE) -> int:
    """The width in pixels :func:`put_text` draws ``text`` at (printable ASCII)."""
    cv2 = _opencv()
    (width, _), _ = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
    return int(width)


def put_text(
    image: npt.NDArray[np.uint8],
    text: str,
    at: tuple[int, int],
    scale: float = CAPTION_SCALE,
    color: tuple[int, int, int] = (230, 230, 230),
) -> None:
    """Draw ``text`` (printable ASCII) into the BGR ``image`` with its baseline's left
    end at ``at`` (x, y), anti-aliased."""
    cv2 = _opencv()
    cv2.putText(image, text, at, cv2.FONT_HERSHEY_SIMPLEX, scale, color, 1, cv2.LINE_AA)
