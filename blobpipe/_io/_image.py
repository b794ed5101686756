"""Decoding encoded images: OpenCV, and libjpeg-turbo straight where it gives OpenCV's pixels.

Caffe decodes encoded Datums with ``cv::imdecode``; blobpipe's reference is the
installed OpenCV's ``cv2.imdecode``, and every array blobpipe returns equals it.

For JPEGs, ``cv2.imdecode`` spends a third of its time around libjpeg-turbo
rather than in it (OpenCV 5: ~38 µs for a 64×64 image on the benchmark machine).
`simplejpeg <https://gitlab.com/jfolz/simplejpeg>`_ calls libjpeg-turbo's
TurboJPEG API directly (~25 µs, GIL released) with the same method OpenCV asks
libjpeg for (accurate integer IDCT, fancy upsampling, libjpeg's colour
conversion), so the pixels are the same bits. :func:`decode_jpeg` uses it

* only where the result is OpenCV's by construction: JPEG bytes (SOI marker)
  decoded to 3-channel BGR or to gray from a 1- or 3-component image. Never for
  4-component (CMYK, YCCK) images, which OpenCV converts itself, never for other
  formats, and never where EXIF orientation may apply (``IMREAD_COLOR`` and
  ``IMREAD_GRAYSCALE`` rotate by it): bytes that contain ``b"Exif"`` go to OpenCV;
* only after checking, once per process, that the two agree bit for bit on a
  built-in set of JPEGs (every chroma subsampling OpenCV writes, progressive,
  restart markers, gray, odd sizes), and on the first :data:`SAMPLE` images the
  process decodes with it. On any difference blobpipe warns once
  (``RuntimeWarning``) and uses OpenCV alone from then on: an OpenCV built on
  IJG libjpeg 9, whose upsampling differs, lands there;
* with OpenCV deciding everything simplejpeg refuses or warns about (corrupt,
  truncated, 12-bit, unsupported images): their errors and partial images are
  OpenCV's.

``BLOBPIPE_JPEG_DECODER=opencv`` turns it off; without simplejpeg installed,
OpenCV decodes everything.

:func:`decode_image` is the one entry point: the size guard on the header, the
choice of decoder, OpenCV's errors as sentences; :func:`decode_many` decodes a
batch's images one after another with it. Caffe's flag comes from
:func:`imread_flag`.
"""

from __future__ import annotations

import os
import struct
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from .._errors import BlobpipeError, ProtoError

__all__ = [
    "COLORSPACE",
    "DEFAULT_MAX_PIXELS",
    "SAMPLE",
    "JpegFrame",
    "Undecodable",
    "decode_image",
    "decode_jpeg",
    "decode_many",
    "image_header",
    "imread_flag",
    "jpeg_channels",
    "jpeg_frame",
]

#: Largest decoded image (width × height) :func:`datum_view` and friends accept by default.
DEFAULT_MAX_PIXELS = 1 << 26

#: Images checked against OpenCV at the start of each process.
SAMPLE = 64

_ENV = "BLOBPIPE_JPEG_DECODER"
_SOI = b"\xff\xd8"
#: simplejpeg colorspace for each output channel count
COLORSPACE = {3: "BGR", 1: "GRAY"}

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


# Huffman-coded 8-bit frames: baseline, extended sequential, progressive. The
# self-test covers baseline and progressive; extended differs from baseline only
# in allowing more tables. Arithmetic, lossless and hierarchical frames go to OpenCV.
_FAST_MARKERS = frozenset((0xC0, 0xC1, 0xC2))


def jpeg_channels(flag: int, frame: JpegFrame) -> int:
    """Channels ``cv2.imdecode(jpeg, flag)`` returns for a JPEG with this frame, where
    :func:`decode_jpeg` decodes it; 0 where it leaves it to OpenCV (4-component CMYK
    or YCCK images, which OpenCV converts itself, and frames other than 8-bit
    Huffman-coded baseline, extended or progressive)."""
    if frame.components not in (1, 3) or frame.precision != 8:
        return 0
    if frame.marker not in _FAST_MARKERS:
        return 0
    if flag == 1:  # IMREAD_COLOR
        return 3
    if flag == 0:  # IMREAD_GRAYSCALE
        return 1
    return frame.components if flag == -1 else 0  # IMREAD_UNCHANGED keeps them


class _Fast:
    """The process's simplejpeg state: started on first use, checked, maybe turned off."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = False
        self.decode: Callable[..., np.ndarray] | None = None
        self.sampled = 0

    def get(self) -> Callable[..., np.ndarray] | None:
        if not self.started:
            with self.lock:
                if not self.started:
                    self.decode = _start()
                    self.started = True
        return self.decode

    def turn_off(self, why: str) -> None:
        with self.lock:
            if self.decode is None:
                return
            self.decode = None
        warnings.warn(
            f"simplejpeg's JPEG decoding differs from this OpenCV's ({why}); blobpipe "
            f"decodes JPEGs with OpenCV alone from now on (slower, same pixels as "
            f"Caffe's cv::imdecode). Set {_ENV}=opencv to skip the check.",
            RuntimeWarning,
            stacklevel=3,
        )


_fast = _Fast()


def _reset() -> None:
    """Start over on next use (tests: after changing the environment or the modules)."""
    global _fast
    _fast = _Fast()


def _start() -> Callable[..., np.ndarray] | None:
    choice = os.environ.get(_ENV, "auto").strip().lower()
    if choice not in ("auto", "opencv", ""):
        raise BlobpipeError(
            f"{_ENV}={os.environ[_ENV]!r} is not a JPEG decoder choice: set 'auto' "
            "(simplejpeg where it gives OpenCV's pixels, the default) or 'opencv'"
        )
    if choice == "opencv":
        return None
    try:
        import simplejpeg
    except ImportError:
        return None
    decode: Callable[..., np.ndarray] = simplejpeg.decode_jpeg
    why = _self_test(decode)
    if why is not None:
        warnings.warn(
            f"simplejpeg's JPEG decoding differs from this OpenCV's ({why}); blobpipe "
            "decodes JPEGs with OpenCV alone (slower, same pixels as Caffe's cv::imdecode)",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    return decode


def _test_images() -> list[tuple[str, bytes]]:
    """JPEGs covering what decoders may do differently, written by this OpenCV."""
    cv2 = _opencv()
    y, x = np.mgrid[0:29, 0:37]  # odd sizes: partial MCUs at the right and bottom edges
    bgr = np.stack([(x * 7 + y * 3) % 256, (x * x + y * 5) % 256, (y * y + x) % 256], -1)
    noise = np.random.default_rng(7).integers(0, 48, bgr.shape)
    bgr = np.clip(bgr + noise, 0, 255).astype(np.uint8)
    gray = cv2.cvtColor(bgr, cv2.COLOR_BGR2GRAY)
    images = []
    for sampling in ("411", "420", "422", "440", "444"):
        factor = getattr(cv2, "IMWRITE_JPEG_SAMPLING_FACTOR_" + sampling)
        for progressive, restart, quality in ((0, 0, 95), (1, 0, 75), (0, 3, 50)):
            params = [
                cv2.IMWRITE_JPEG_QUALITY, quality,
                cv2.IMWRITE_JPEG_SAMPLING_FACTOR, factor,
                cv2.IMWRITE_JPEG_PROGRESSIVE, progressive,
                cv2.IMWRITE_JPEG_RST_INTERVAL, restart,
            ]  # fmt: skip
            _, enc = cv2.imencode(".jpg", bgr, params)
            images.append((f"{sampling} progressive={progressive} q{quality}", enc.tobytes()))
    for progressive in (0, 1):
        _, enc = cv2.imencode(".jpg", gray, [cv2.IMWRITE_JPEG_PROGRESSIVE, progressive])
        images.append((f"gray progressive={progressive}", enc.tobytes()))
    return images


def _self_test(decode: Callable[..., np.ndarray]) -> str | None:
    """None when simplejpeg and OpenCV agree on :func:`_test_images`, else what differs."""
    cv2 = _opencv()
    for name, data in _test_images():
        frame = jpeg_frame(data)
        for flag in (1, 0, -1):
            channels = 0 if frame is None else jpeg_channels(flag, frame)
            if not channels:
                return f"a test JPEG ({name}) has a frame it does not take: {frame}"
            want = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
            try:
                got = decode(data, colorspace=COLORSPACE[channels])
            except Exception as exc:  # any failure to decode a plain JPEG disqualifies it
                return f"it failed on a test JPEG ({name}): {exc}"
            if channels == 1:
                got = got.reshape(got.shape[:2])
            if want is None or want.shape != got.shape or not np.array_equal(want, got):
                return f"a test JPEG ({name}, imdecode flag {flag}) decodes differently"
    return None


def decode_jpeg(
    data: bytes | memoryview, flag: int, frame: JpegFrame | None = None
) -> np.ndarray | None:
    """``cv2.imdecode(data, flag)`` through libjpeg-turbo's TurboJPEG API, or None.

    Returns a new ``(H, W, 3)`` BGR array, or ``(H, W)`` gray, as OpenCV would.
    ``frame``: the bytes' frame header (:func:`jpeg_frame`), when the caller has
    read it already (and checked its size: simplejpeg allocates what it says). None
    means: not a JPEG, or one this decoder leaves to OpenCV
    (:func:`fast_channels`), or simplejpeg is off or failed; decode with OpenCV.
    """
    decode = _fast.get()
    if decode is None:
        return None
    if frame is None:
        if bytes(data[:2]) != _SOI:
            return None
        frame = jpeg_frame(bytes(data))
        if frame is None:
            return None
    channels = jpeg_channels(flag, frame)
    if not channels or not _exif_free(data, flag):
        return None
    try:
        img = decode(data, colorspace=COLORSPACE[channels])
    except Exception:  # corrupt, truncated, unsupported, too large: OpenCV decides
        return None
    if channels == 1:
        img = img.reshape(img.shape[:2])
    return img if _sampled(data, flag, img) else None


def _sampled(data: bytes | memoryview, flag: int, img: np.ndarray) -> bool:
    """Whether simplejpeg's ``img`` of ``data`` may be used: yes, unless it is one of
    the process's first :data:`SAMPLE` images and OpenCV decodes it differently
    (then simplejpeg is turned off for the process)."""
    fast = _fast
    if fast.sampled >= SAMPLE:
        return True
    with fast.lock:
        check = fast.sampled < SAMPLE
        fast.sampled += check
    if not check:
        return True
    want = _opencv().imdecode(np.frombuffer(data, np.uint8), flag)
    if want is None or want.shape != img.shape or not np.array_equal(want, img):
        fast.turn_off(f"an image of {len(data)} bytes decodes differently")
        return False
    return True


def _exif_free(data: bytes | memoryview, flag: int) -> bool:
    """Whether OpenCV would not rotate this image by EXIF orientation: flag -1
    (IMREAD_UNCHANGED) never does; flags 0 and 1 do when the bytes hold EXIF."""
    return flag == -1 or bytes(data).find(b"Exif") < 0


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
    array (C = 1 for gray); or, where it cannot be had, why.

    An image whose PNG or JPEG header announces more than ``max_pixels`` pixels
    is refused before anything is allocated; JPEGs go through libjpeg-turbo
    straight where that is exact (:func:`decode_jpeg`), everything else, and
    anything it refuses, through OpenCV.
    """
    if not len(data):
        return Undecodable("the record says encoded: true but holds no image bytes in data", True)
    data = bytes(data)  # one copy, out of the database's memory, for every step below
    header = image_header(data)
    if header is not None and header[0] * header[1] > max_pixels:
        return Undecodable(
            f"the encoded image announces {header[0]}×{header[1]} pixels, more than "
            f"max_pixels={max_pixels}; pass a larger max_pixels if the image is genuine",
            False,
        )
    img: np.ndarray | None = None
    if header is not None and header[2] is not None:
        img = decode_jpeg(data, flag, frame=header[2])
    if img is None:
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
