"""Encoded images of every format OpenCV reads, and copies whose header announces
another size (for the size guard's tests and fuzzing).

:func:`encoded` is OpenCV's own encoding of a small image; :func:`announcing`
patches the fields its decoder takes the size from, leaving the rest of the bytes
as they were (a decoder that believed them would allocate ``width × height``).
"""

from __future__ import annotations

import re
import struct
from functools import cache

import cv2
import numpy as np

#: One name per format OpenCV decodes in this build, with the extension it encodes by.
FORMATS = {
    "png": ".png",
    "jpeg": ".jpg",
    "gif": ".gif",
    "bmp": ".bmp",
    "tiff": ".tiff",
    "webp": ".webp",
    "webp-lossless": ".webp",
    "webp-extended": ".webp",
    "ppm": ".ppm",
    "pgm": ".pgm",
    "pbm": ".pbm",
    "pam": ".pam",
    "pfm": ".pfm",
    "sunras": ".ras",
    "hdr": ".hdr",
    "jp2": ".jp2",
    "avif": ".avif",
}

SHAPE = (70, 110)  # (H, W) of the encoded images


@cache
def encoded(fmt: str) -> bytes:
    """A 110×70 image of format ``fmt`` as OpenCV encodes it."""
    rng = np.random.default_rng(3)
    img: np.ndarray = rng.integers(0, 256, (*SHAPE, 3), dtype=np.uint8)
    params: list[int] = []
    if fmt in ("pgm", "pbm"):
        img = img[..., 0]
    if fmt in ("pfm", "hdr"):
        img = img.astype(np.float32) / 255
    if fmt in ("webp", "webp-extended"):
        params = [cv2.IMWRITE_WEBP_QUALITY, 90]  # lossy: a VP8 frame
    if fmt == "webp-lossless":
        params = [cv2.IMWRITE_WEBP_QUALITY, 101]
    ok, buf = cv2.imencode(FORMATS[fmt], img, params)
    assert ok, fmt
    data = buf.tobytes()
    if fmt == "webp-extended":  # a VP8X header before the VP8 chunk (canvas size)
        vp8x = b"VP8X" + struct.pack("<I", 10) + b"\x00" * 4
        vp8x += (SHAPE[1] - 1).to_bytes(3, "little") + (SHAPE[0] - 1).to_bytes(3, "little")
        body = b"WEBP" + vp8x + data[12:]
        data = b"RIFF" + struct.pack("<I", len(body)) + body
    return data


def _tiff_size(data: bytearray, width: int, height: int) -> None:
    order = "<" if data[:2] == b"II" else ">"
    ifd = struct.unpack_from(order + "I", data, 4)[0]
    count = struct.unpack_from(order + "H", data, ifd)[0]
    for k in range(count):
        at = ifd + 2 + 12 * k
        tag, kind = struct.unpack_from(order + "HH", data, at)
        if tag in (256, 257):
            value = width if tag == 256 else height
            if kind == 3:
                struct.pack_into(order + "H", data, at + 8, value & 0xFFFF)
            else:
                struct.pack_into(order + "I", data, at + 8, value)


def announcing(fmt: str, width: int, height: int, data: bytes | None = None) -> bytes:
    """``encoded(fmt)`` (or ``data`` of that format) with a header announcing
    ``width × height`` (clipped to what the format's fields hold)."""
    b = bytearray(encoded(fmt) if data is None else data)
    if fmt == "png":
        struct.pack_into(">II", b, 16, width, height)
    elif fmt == "jpeg":
        at = b.index(b"\xff\xc0")
        struct.pack_into(">HH", b, at + 5, height & 0xFFFF, width & 0xFFFF)
    elif fmt == "gif":
        struct.pack_into("<HH", b, 6, width & 0xFFFF, height & 0xFFFF)
        at = b.index(b"\x2c\x00\x00\x00\x00")  # the image descriptor at (0, 0)
        struct.pack_into("<HH", b, at + 5, width & 0xFFFF, height & 0xFFFF)
    elif fmt == "bmp":
        struct.pack_into("<ii", b, 18, width & 0x7FFFFFFF, height & 0x7FFFFFFF)
    elif fmt == "tiff":
        _tiff_size(b, width, height)
    elif fmt == "webp":
        struct.pack_into("<HH", b, 26, width & 0x3FFF, height & 0x3FFF)
    elif fmt == "webp-lossless":
        bits = int.from_bytes(b[21:25], "little") & ~((1 << 28) - 1)
        bits |= ((width - 1) & 0x3FFF) | (((height - 1) & 0x3FFF) << 14)
        b[21:25] = bits.to_bytes(4, "little")
    elif fmt == "webp-extended":
        b[24:30] = ((width - 1) & 0xFFFFFF).to_bytes(3, "little") + (
            (height - 1) & 0xFFFFFF
        ).to_bytes(3, "little")
    elif fmt in ("ppm", "pgm", "pbm", "pfm"):
        b = bytearray(re.sub(rb"^(P.\s+)\d+\s+\d+", rb"\g<1>%d %d" % (width, height), bytes(b)))
    elif fmt == "pam":
        text = re.sub(rb"WIDTH \d+", b"WIDTH %d" % width, bytes(b), count=1)
        b = bytearray(re.sub(rb"HEIGHT \d+", b"HEIGHT %d" % height, text, count=1))
    elif fmt == "sunras":
        struct.pack_into(">II", b, 4, width, height)
    elif fmt == "hdr":
        b = bytearray(re.sub(rb"-Y \d+ \+X \d+", b"-Y %d +X %d" % (height, width), bytes(b)))
    elif fmt == "jp2":
        at = b.index(b"ihdr")
        struct.pack_into(">II", b, at + 4, height, width)
        at = b.index(b"\xff\x4f\xff\x51")
        xo, yo = struct.unpack_from(">II", b, at + 16)
        struct.pack_into(">II", b, at + 8, xo + width, yo + height)
    elif fmt == "avif":
        at = b.find(b"ispe")
        while at >= 0:
            struct.pack_into(">II", b, at + 8, width, height)
            at = b.find(b"ispe", at + 4)
    else:
        raise ValueError(fmt)
    return bytes(b)
