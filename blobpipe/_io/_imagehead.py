"""The size an encoded image announces, read from its header for every format OpenCV
decodes, before anything is decoded.

:func:`image_size` recognises the image by the signature OpenCV's decoders check
(``checkSignature``) and reads the width and height the decoder will allocate for:
PNG (``IHDR``), JPEG (the first frame header, markers read as libjpeg reads them),
GIF (the logical screen and the first image descriptor), BMP, TIFF and BigTIFF (the
first directory), WebP (``VP8 ``, ``VP8L``, ``VP8X``), PBM/PGM/PPM and PAM, PFM, Sun
raster, Radiance HDR, JPEG 2000 (the codestream's ``SIZ``, in a JP2 file or bare) and
AVIF (every ``ispe`` property). Where the signature is known but the size cannot be
read, or no signature is known, the answer is a sentence saying so: the caller then
refuses the image rather than let a decoder allocate what the bytes ask for. The
bound therefore never depends on OpenCV's ``OPENCV_IO_MAX_IMAGE_PIXELS``, which
OpenCV reads once, when it is first imported, by whoever imports it first.
"""

from __future__ import annotations

import re
import struct
from typing import NamedTuple

__all__ = ["NO_SIGNATURE", "ImageSize", "JpegFrame", "image_size", "jpeg_frame"]

#: :func:`image_size`'s answer for bytes no OpenCV decoder takes.
NO_SIGNATURE = "it starts with no signature of an image format OpenCV reads"


class JpegFrame(NamedTuple):
    """A JPEG's first frame header (SOFn)."""

    marker: int  # 0xC0 baseline, 0xC1 extended, 0xC2 progressive, ...
    precision: int  # bits per sample
    width: int
    height: int
    components: int


class ImageSize(NamedTuple):
    """What an image's header announces."""

    format: str  # "png", "jpeg", "gif", "bmp", "tiff", "webp", "pnm", ...
    width: int
    height: int
    frame: JpegFrame | None = None  # JPEG only


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_BE16 = struct.Struct(">H")
_HEAD = 4096  # PNG and JPEG headers are looked for in these leading bytes first


def jpeg_frame(b: bytes) -> JpegFrame | None:
    """The first frame header of JPEG bytes ``b`` (after the SOI), as libjpeg's
    ``next_marker``/``read_markers`` find it: bytes other than 0xFF before a marker
    are skipped, fill bytes (0xFF 0xFF ...) swallowed, a stuffed 0xFF 0x00 discarded,
    TEM and RSTn have no length, every other marker's segment is skipped by its
    length. None when there is none before the scan, the end of the image or the end
    of ``b`` (libjpeg then decodes nothing), or a segment length is below 2."""
    n = len(b)
    i = 2
    while i < n:
        if b[i] != 0xFF:
            i += 1
            continue
        while i + 1 < n and b[i + 1] == 0xFF:  # fill bytes
            i += 1
        if i + 1 >= n:
            return None
        marker = b[i + 1]
        if marker == 0x00:  # stuffed zero: not a marker
            i += 2
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # TEM, RSTn: no segment
            i += 2
            continue
        if marker in (0xD8, 0xD9, 0xDA):  # SOI again, EOI, SOS: no frame header first
            return None
        if i + 4 > n:
            return None
        length = _BE16.unpack_from(b, i + 2)[0]
        if length < 2:
            return None
        if marker in _SOF_MARKERS:
            if i + 10 > n:
                return None
            height, width = _BE16.unpack_from(b, i + 5)[0], _BE16.unpack_from(b, i + 7)[0]
            return JpegFrame(marker, b[i + 4], width, height, b[i + 9])
        i += 2 + length
    return None


def _u16(b: bytes, at: int, order: str) -> int:
    return int(struct.unpack_from(order + "H", b, at)[0])


def _u32(b: bytes, at: int, order: str) -> int:
    return int(struct.unpack_from(order + "I", b, at)[0])


def _png(b: bytes) -> ImageSize | str:
    if len(b) < 24 or b[12:16] != b"IHDR":
        return "its PNG header has no IHDR chunk"
    return ImageSize("png", _u32(b, 16, ">"), _u32(b, 20, ">"))


def _jpeg(b: bytes, whole: bytes | memoryview) -> ImageSize | str:
    frame = jpeg_frame(b)
    if frame is None and len(whole) > len(b):
        frame = jpeg_frame(bytes(whole))  # a long header (EXIF, ICC profile, ...)
    if frame is None:
        return (
            "its JPEG markers hold no frame header before the scan (cut short?), so its "
            "size cannot be checked before decoding"
        )
    return ImageSize("jpeg", frame.width, frame.height, frame)


def _gif(b: bytes) -> ImageSize | str:
    if len(b) < 13:
        return "its GIF header is cut short"
    width, height, flags = _u16(b, 6, "<"), _u16(b, 8, "<"), b[10]
    i = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # the global colour table
    while i < len(b):  # to the first image descriptor: it may reach past the screen
        block = b[i]
        if block == 0x2C:
            if i + 10 > len(b):
                break
            left, top = _u16(b, i + 1, "<"), _u16(b, i + 3, "<")
            w, h = _u16(b, i + 5, "<"), _u16(b, i + 7, "<")
            width, height = max(width, left + w), max(height, top + h)
            break
        if block != 0x21 or i + 2 > len(b):  # only extensions come before it
            break
        i += 2
        while i < len(b) and b[i]:  # sub-blocks
            i += 1 + b[i]
        i += 1
    return ImageSize("gif", width, height)


def _bmp(b: bytes) -> ImageSize | str:
    if len(b) < 26:
        return "its BMP header is cut short"
    size = _u32(b, 14, "<")
    if size == 12:  # OS/2 BITMAPCOREHEADER
        return ImageSize("bmp", _u16(b, 18, "<"), _u16(b, 20, "<"))
    width, height = struct.unpack_from("<ii", b, 18)
    return ImageSize("bmp", abs(int(width)), abs(int(height)))


def _tiff(b: bytes, whole: bytes | memoryview) -> ImageSize | str:
    order = "<" if b[:2] == b"II" else ">"
    big = _u16(b, 2, order) == 43
    data = bytes(whole)
    try:
        if big:
            offset = int(struct.unpack_from(order + "Q", data, 8)[0])
            count = int(struct.unpack_from(order + "Q", data, offset)[0])
            entry, first = 20, offset + 8
        else:
            offset = _u32(data, 4, order)
            count = _u16(data, offset, order)
            entry, first = 12, offset + 2
        found: dict[int, int] = {}
        for k in range(min(count, 4096)):
            at = first + k * entry
            tag, kind = _u16(data, at, order), _u16(data, at + 2, order)
            if tag not in (256, 257):
                continue
            value_at = at + (12 if big else 8)
            if kind == 3:
                found[tag] = _u16(data, value_at, order)
            elif kind == 4:
                found[tag] = _u32(data, value_at, order)
            elif kind == 16:
                found[tag] = int(struct.unpack_from(order + "Q", data, value_at)[0])
    except struct.error:
        return "its TIFF directory lies outside the bytes"
    if 256 not in found or 257 not in found:
        return "its first TIFF directory names no ImageWidth and ImageLength"
    return ImageSize("tiff", found[256], found[257])


def _webp(b: bytes) -> ImageSize | str:
    chunk = b[12:16]
    if chunk == b"VP8X" and len(b) >= 30:
        width = 1 + int.from_bytes(b[24:27], "little")
        height = 1 + int.from_bytes(b[27:30], "little")
        return ImageSize("webp", width, height)
    if chunk == b"VP8L" and len(b) >= 25 and b[20] == 0x2F:
        bits = int.from_bytes(b[21:25], "little")
        return ImageSize("webp", 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF))
    if chunk == b"VP8 " and len(b) >= 30 and b[23:26] == b"\x9d\x01\x2a":
        return ImageSize("webp", _u16(b, 26, "<") & 0x3FFF, _u16(b, 28, "<") & 0x3FFF)
    return "its WebP header holds no VP8, VP8L or VP8X frame size"


_PNM_TOKEN = re.compile(rb"(?:\s|#[^\n\r]*)*(\d+)")


def _pnm(b: bytes) -> ImageSize | str:
    at, sizes = 2, []
    for _ in range(2):
        m = _PNM_TOKEN.match(b, at)
        if m is None:
            return "its PNM header has no width and height"
        sizes.append(int(m.group(1)))
        at = m.end()
    return ImageSize("pnm", sizes[0], sizes[1])


def _pam(b: bytes) -> ImageSize | str:
    width = re.search(rb"(?m)^\s*WIDTH\s+(\d+)", b)
    height = re.search(rb"(?m)^\s*HEIGHT\s+(\d+)", b)
    if width is None or height is None:
        return "its PAM header has no WIDTH and HEIGHT"
    return ImageSize("pam", int(width.group(1)), int(height.group(1)))


def _hdr(b: bytes) -> ImageSize | str:
    m = re.search(rb"\n\s*[-+]([XY])\s+(\d+)\s+[-+]([XY])\s+(\d+)", b)
    if m is None:
        return "its Radiance header has no resolution line"
    return ImageSize("hdr", int(m.group(4)), int(m.group(2)))


def _siz(b: bytes, at: int) -> ImageSize | str:
    """A JPEG 2000 codestream's image size (SIZ, after the SOC at ``at``)."""
    if len(b) < at + 24 or b[at : at + 4] != b"\xff\x4f\xff\x51":
        return "its JPEG 2000 codestream has no SIZ segment"
    xsiz, ysiz, xo, yo = struct.unpack_from(">IIII", b, at + 8)
    return ImageSize("jpeg2000", max(0, xsiz - xo), max(0, ysiz - yo))


def _jp2(b: bytes, whole: bytes | memoryview) -> ImageSize | str:
    data, i = bytes(whole), 0
    sizes: list[ImageSize] = []
    while i + 8 <= len(data):
        size, kind = _u32(data, i, ">"), data[i + 4 : i + 8]
        head = 8
        if size == 1 and i + 16 <= len(data):
            size, head = int(struct.unpack_from(">Q", data, i + 8)[0]), 16
        elif size == 0:
            size = len(data) - i
        if kind == b"jp2h":  # a superbox: its boxes follow its header
            j = i + head
            while j + 8 <= min(len(data), i + size):
                if data[j + 4 : j + 8] == b"ihdr" and j + 16 <= len(data):
                    height, width = struct.unpack_from(">II", data, j + 8)
                    sizes.append(ImageSize("jpeg2000", int(width), int(height)))
                step = _u32(data, j, ">")
                if step < 8:
                    break
                j += step
        if kind == b"jp2c":
            found = _siz(data, i + head)
            if isinstance(found, str):
                return found
            sizes.append(found)
            break
        if size < head:
            break
        i += size
    if not sizes:
        return "its JP2 boxes hold no image header or codestream"
    return max(sizes, key=lambda s: s.width * s.height)


def _avif(b: bytes, whole: bytes | memoryview) -> ImageSize | str:
    data = bytes(whole)
    sizes = []
    at = data.find(b"ispe")
    while at >= 4 and at + 16 <= len(data):
        width, height = struct.unpack_from(">II", data, at + 8)
        sizes.append((int(width), int(height)))
        at = data.find(b"ispe", at + 4)
    if not sizes:
        return "its AVIF header has no image size (ispe) property"
    width, height = max(sizes, key=lambda s: s[0] * s[1])
    return ImageSize("avif", width, height)


def _is_avif(b: bytes) -> bool:
    if b[4:8] != b"ftyp" or len(b) < 16:
        return False
    size = min(_u32(b, 0, ">"), len(b))
    brands = [b[8:12]] + [b[k : k + 4] for k in range(16, size - 3, 4)]
    return b"avif" in brands or b"avis" in brands


def image_size(data: bytes | memoryview) -> ImageSize | str:
    """The width and height the header of encoded image ``data`` announces, or,
    where it cannot be read (an unknown signature, a header cut short or
    malformed), a phrase saying why (see the module docstring)."""
    b = bytes(data[:_HEAD])  # a bytes copy of the start, not the view
    if b.startswith(b"\x89PNG\r\n\x1a\n"):
        return _png(b)
    if b.startswith(b"\xff\xd8"):  # (OpenCV's signature is FF D8 FF: a superset)
        return _jpeg(b, data)
    if len(data) > len(b):
        b = bytes(data)  # the rarer formats: their headers may run long
    if b[:6] in (b"GIF87a", b"GIF89a"):
        return _gif(b)
    if b.startswith(b"BM"):
        return _bmp(b)
    if b[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return _tiff(b, data)
    if b.startswith(b"RIFF") and b[8:12] == b"WEBP":
        return _webp(b)
    if len(b) >= 3 and b[0:1] == b"P" and b[2:3].isspace():
        if b[1:2] in b"123456":
            return _pnm(b)
        if b[1:2] == b"7":
            return _pam(b)
        if b[1:2] in (b"F", b"f"):
            return _pnm(b)  # PFM: "PF" or "Pf", then width and height as in PNM
    if b.startswith(b"\x59\xa6\x6a\x95"):
        if len(b) < 12:
            return "its Sun raster header is cut short"
        return ImageSize("sunras", _u32(b, 4, ">"), _u32(b, 8, ">"))
    if b.startswith((b"#?RADIANCE", b"#?RGBE")):
        return _hdr(b)
    if b.startswith(b"\x00\x00\x00\x0cjP  \r\n\x87\n"):
        return _jp2(b, data)
    if b.startswith(b"\xff\x4f\xff\x51"):
        return _siz(b, 0)
    if _is_avif(b):
        return _avif(b, data)
    return NO_SIGNATURE
