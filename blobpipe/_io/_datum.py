"""``caffe.Datum``: a fast wire-format reader, decoding to ``(C, H, W)`` arrays, writers.

A Datum (``proto/caffe.proto``) is::

    1 channels  int32      2 height  int32      3 width  int32
    4 data      bytes      5 label   int32      6 float_data  repeated float
    7 encoded   bool [default = false]

:func:`parse_datum` reads those seven fields straight from the wire bytes, with no
protobuf message and no copy: ``data`` comes back as a ``memoryview`` slice of the
input and ``float_data`` as a numpy view when it was written packed. It follows
protobuf's own parser (upb) exactly, and ``tests/test_datum.py`` holds it to
protobuf's own ``caffe.Datum`` parser on real, generated and fuzzed records:

* the last value of a non-repeated field wins; ``float_data`` accepts packed and
  unpacked runs, mixed, in any order;
* a known field sent with another wire type is an unknown field;
* unknown fields of wire types 0, 1, 2 and 5 are skipped, and so are groups (3 ... 4,
  nested up to 100 deep); a stray end-group, wire types 6 and 7, field number 0, a
  tag longer than 5 bytes or above 2**32, a varint longer than 10 bytes, a length
  longer than 5 bytes or past the end, and a packed float run whose length is not a
  multiple of 4 are malformed and raise :class:`~blobpipe.DataError`.

Three ways to get the pixels, from cheapest to most convenient:

* :func:`datum_view` returns a read-only ``(C, H, W)`` view of a raw record's payload
  (uint8 ``data`` or float32 ``float_data``), so a transform can read straight from
  the LMDB memory map and write the batch: exactly one copy. Encoded records are
  decoded by OpenCV into a fresh array.
* :func:`decode_datum_into` copies (and widens, e.g. uint8 to float32) one record
  into a caller-provided array such as ``batch[i]``.
* :func:`decode_datum` returns an owned, writable array.

Encoded records are decoded as Caffe's ``DataTransformer`` does: ``force_color`` →
``cv::imdecode(..., IMREAD_COLOR)``, ``force_gray`` → ``IMREAD_GRAYSCALE``, neither →
``DecodeDatumToCVMatNative``, i.e. ``IMREAD_UNCHANGED`` (a gray PNG stays 1-channel,
an RGBA PNG gives 4 channels). The flags do nothing for raw records (Caffe only
logs). Only ``encoded: true`` selects decoding; the bytes are never sniffed.

No allocation is ever sized by the record's claims: raw dimensions must multiply to
the payload's actual length, and an encoded PNG or JPEG whose header announces more
than ``max_pixels`` pixels is refused before OpenCV allocates.

The writers produce the bytes Caffe's tools write: :func:`encode_raw_datum` and
:func:`encode_encoded_datum` match ``convert_imageset`` byte for byte,
:func:`encode_float_datum` matches pycaffe's ``array_to_datum`` for float arrays.
"""

from __future__ import annotations

import operator
import sys
from typing import NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from .._errors import DataError, ProtoError, ShapeError
from ._image import DEFAULT_MAX_PIXELS, Undecodable, decode_image, imread_flag

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "BytesLike",
    "ParsedDatum",
    "datum_view",
    "decode_datum",
    "decode_datum_into",
    "encode_encoded_datum",
    "encode_float_datum",
    "encode_raw_datum",
    "match_raw_layout",
    "parse_datum",
    "raw_header",
]

BytesLike: TypeAlias = bytes | bytearray | memoryview


_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
_UINT64_MASK = (1 << 64) - 1
# upb's default recursion limit: 100 nested groups parse, 101 do not.
_MAX_GROUP_DEPTH = 100
# An unpacked float_data run is sliced with numpy from this many elements on.
_VECTOR_RUN = 8
_FLOAT_TAG = 0x35  # field 6, wire type 5
_NATIVE_LE = sys.byteorder == "little"
_F4 = np.dtype("<f4")
_U1 = np.dtype(np.uint8)

_REBUILD = (
    "the database is damaged or was not written by Caffe; rebuild it with Caffe's "
    "convert_imageset or blobpipe's writers"
)


class ParsedDatum(NamedTuple):
    """The fields of one ``caffe.Datum``, read without a protobuf message.

    Absent integer fields are 0 and an absent ``encoded`` is False, as protobuf
    reports them. ``data`` is None when the field is absent, else a ``memoryview``
    into the parsed buffer; ``float_data`` is None when the record holds no float,
    else a 1-D little-endian float32 array (a view of the buffer when written
    packed in one run, a copy otherwise). Both are valid only as long as the parsed
    buffer is: for a view handed out by an LMDB transaction, inside it.
    """

    channels: int
    height: int
    width: int
    label: int
    encoded: bool
    data: memoryview | None
    float_data: npt.NDArray[np.float32] | None


def _new_parsed(fields: tuple[object, ...]) -> ParsedDatum:
    return tuple.__new__(ParsedDatum, fields)


class _Malformed(Exception):
    """Internal: the wire bytes are not a valid Datum (becomes a DataError)."""


def _varint(b: memoryview, pos: int, end: int, limit: int, what: str) -> tuple[int, int]:
    start = pos
    stop = min(end, pos + limit)
    result = 0
    shift = 0
    while pos < stop:
        byte = b[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    if pos - start >= limit:
        raise _Malformed(f"{what} at byte {start} is longer than {limit} bytes")
    raise _Malformed(f"{what} at byte {start} is cut off by the end of the record")


def _int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def _skip_value(b: memoryview, pos: int, end: int, wt: int, field: int) -> int:
    """Skip the value of an unknown field of wire type 0, 1, 2 or 5."""
    if wt == 0:
        return _varint(b, pos, end, 10, f"the varint of field {field}")[1]
    if wt == 2:
        ln, pos = _varint(b, pos, end, 5, f"the length of field {field}")
        if ln > end - pos:
            raise _Malformed(
                f"field {field} claims {ln} bytes at byte {pos} but only {end - pos} remain"
            )
        return pos + ln
    size = 8 if wt == 1 else 4
    if end - pos < size:
        raise _Malformed(f"the {size}-byte value of field {field} at byte {pos} is cut off")
    return pos + size


def _skip_group(b: memoryview, pos: int, end: int, field: int) -> int:
    """Skip an unknown group whose start tag (field ``field``) ends just before ``pos``."""
    open_groups = [field]
    while True:
        if pos >= end:
            raise _Malformed(f"the group of field {open_groups[-1]} is never closed")
        tag, pos = _varint(b, pos, end, 5, "a tag")
        if tag > 0xFFFFFFFF:
            raise _Malformed(f"a tag ending at byte {pos} exceeds 32 bits")
        f, wt = tag >> 3, tag & 7
        if f == 0:
            raise _Malformed(f"field number 0 in a tag ending at byte {pos}")
        if wt == 4:
            if f != open_groups[-1]:
                raise _Malformed(
                    f"end-group for field {f} at byte {pos} closes the group of field "
                    f"{open_groups[-1]}"
                )
            open_groups.pop()
            if not open_groups:
                return pos
        elif wt == 3:
            open_groups.append(f)
            if len(open_groups) > _MAX_GROUP_DEPTH:
                raise _Malformed(f"groups nest deeper than {_MAX_GROUP_DEPTH}")
        elif wt > 5:
            raise _Malformed(f"invalid wire type {wt} at byte {pos}")
        else:
            pos = _skip_value(b, pos, end, wt, f)


def _parse(b: memoryview) -> ParsedDatum:
    return _parse_from(b, 0, 0, 0, 0, None)


def _parse_from(
    b: memoryview, pos: int, channels: int, height: int, width: int, data: memoryview | None
) -> ParsedDatum:
    end = len(b)
    label = 0
    encoded = False
    floats: list[memoryview | npt.NDArray[np.uint8]] = []
    while pos < end:
        tag = b[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(b, pos, end, 5, "a tag")
            if tag > 0xFFFFFFFF:
                raise _Malformed(f"a tag ending at byte {pos} exceeds 32 bits")
        field = tag >> 3
        wt = tag & 7
        if field == 0:
            raise _Malformed(f"field number 0 in a tag ending at byte {pos}")
        if wt == 0:
            if pos < end and b[pos] < 0x80:
                v = b[pos]
                pos += 1
            else:
                v, pos = _varint(b, pos, end, 10, f"the varint of field {field}")
            if field == 1:
                channels = _int32(v)
            elif field == 2:
                height = _int32(v)
            elif field == 3:
                width = _int32(v)
            elif field == 5:
                label = _int32(v)
            elif field == 7:
                encoded = (v & _UINT64_MASK) != 0
        elif wt == 2:
            if pos < end and b[pos] < 0x80:
                ln = b[pos]
                pos += 1
            else:
                ln, pos = _varint(b, pos, end, 5, f"the length of field {field}")
            if ln > end - pos:
                raise _Malformed(
                    f"field {field} claims {ln} bytes at byte {pos} but only {end - pos} remain"
                )
            if field == 4:
                data = b[pos : pos + ln]
            elif field == 6:
                if ln % 4:
                    raise _Malformed(
                        f"packed float_data at byte {pos} holds {ln} bytes, not a multiple of 4"
                    )
                floats.append(b[pos : pos + ln])
            pos += ln
        elif wt == 5:
            if end - pos < 4:
                raise _Malformed(f"the 4-byte value of field {field} at byte {pos} is cut off")
            if field == 6:
                start = pos - 1
                if tag == _FLOAT_TAG and b[start] == _FLOAT_TAG:
                    # An unpacked run: tag, 4 bytes, tag, 4 bytes, ... (what C++ writes).
                    m = (end - start) // 5
                    if m >= _VECTOR_RUN:
                        rows = np.frombuffer(b, np.uint8, count=m * 5, offset=start)
                        rows = rows.reshape(m, 5)
                        stops = np.flatnonzero(rows[:, 0] != _FLOAT_TAG)
                        k = int(stops[0]) if stops.size else m
                        floats.append(rows[:k, 1:])
                        pos = start + 5 * k
                        continue
                floats.append(b[pos : pos + 4])
            pos += 4
        elif wt == 1:
            if end - pos < 8:
                raise _Malformed(f"the 8-byte value of field {field} at byte {pos} is cut off")
            pos += 8
        elif wt == 3:
            pos = _skip_group(b, pos, end, field)
        elif wt == 4:
            raise _Malformed(f"end-group for field {field} at byte {pos} without a start")
        else:
            raise _Malformed(f"invalid wire type {wt} at byte {pos}")
    return ParsedDatum(channels, height, width, label, encoded, data, _join_floats(floats))


def _join_floats(
    floats: list[memoryview | npt.NDArray[np.uint8]],
) -> npt.NDArray[np.float32] | None:
    if not floats:
        return None
    if len(floats) == 1 and isinstance(floats[0], memoryview):
        if not len(floats[0]):
            return None
        return np.frombuffer(floats[0], _F4)
    parts = [
        np.frombuffer(p, np.uint8) if isinstance(p, memoryview) else p.reshape(-1) for p in floats
    ]
    joined = np.concatenate(parts)
    if not joined.size:
        return None
    return joined.view(_F4)


def _as_bytes_view(buf: BytesLike) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")
    return mv


def parse_datum(
    buf: BytesLike, *, key: bytes | str | None = None, path: object = None
) -> ParsedDatum:
    """Read a serialized ``caffe.Datum`` without building a protobuf message.

    ``key`` and ``path`` only name the record and its database in error messages.
    The result refers to ``buf`` (no payload is copied): keep ``buf`` alive and
    unchanged while using it.

    Raises:
        TypeError: ``buf`` is not a bytes-like object.
        DataError: the bytes are not a valid protobuf message (see the module
            docstring for the exact rules); the message says where.
    """
    b = memoryview(buf)
    if b.format != "B" or b.ndim != 1:
        b = b.cast("B")
    try:
        return _parse(b)
    except _Malformed as exc:
        raise DataError(f"not a valid caffe.Datum: {exc}; {_REBUILD}", path=path, key=key) from None


# -- pixels --------------------------------------------------------------------------------


def _decode_image(
    data: memoryview | None,
    flag: int,
    max_pixels: int,
    key: bytes | str | None,
    path: object,
) -> npt.NDArray[np.uint8]:
    """Decode an encoded Datum's image to a (C, H, W) view of an HWC array."""
    hwc = decode_image(b"" if data is None else data, flag, max_pixels)
    if isinstance(hwc, Undecodable):
        reason = f"{hwc.reason}; {_REBUILD}" if hwc.damaged else hwc.reason
        raise DataError(reason, path=path, key=key)
    chw: npt.NDArray[np.uint8] = hwc.transpose(2, 0, 1)
    return chw


def _raw_view(
    p: ParsedDatum, key: bytes | str | None, path: object
) -> npt.NDArray[np.uint8] | npt.NDArray[np.float32]:
    c, h, w = p.channels, p.height, p.width
    data = p.data if p.data is not None and len(p.data) else None
    floats = p.float_data
    if data is None and floats is None:
        raise DataError(
            "the record holds no pixels: data and float_data are both empty and "
            "encoded is false; " + _REBUILD,
            path=path,
            key=key,
        )
    if c <= 0 or h <= 0 or w <= 0:
        raise DataError(
            f"a raw (encoded: false) record needs positive channels, height and width, "
            f"got {c}×{h}×{w}; if data holds an image file, the record should say "
            f"encoded: true; " + _REBUILD,
            path=path,
            key=key,
        )
    count = c * h * w  # a Python int: never overflows, never allocated
    if data is not None:
        # Caffe reads data when it is non-empty and ignores float_data.
        if len(data) != count:
            raise DataError(
                f"data holds {len(data)} bytes but channels×height×width is "
                f"{c}×{h}×{w} = {count} (one uint8 per element); if data holds an image "
                f"file, the record should say encoded: true; " + _REBUILD,
                path=path,
                key=key,
            )
        if floats is not None and len(floats) != count:
            raise DataError(
                f"the record holds both data ({len(data)} bytes) and float_data "
                f"({len(floats)} values) and they disagree; a record holds one or the "
                f"other; " + _REBUILD,
                path=path,
                key=key,
            )
        return np.frombuffer(data, np.uint8).reshape(c, h, w)
    assert floats is not None
    if len(floats) != count:
        raise DataError(
            f"float_data holds {len(floats)} values but channels×height×width is "
            f"{c}×{h}×{w} = {count}; " + _REBUILD,
            path=path,
            key=key,
        )
    arr: npt.NDArray[np.float32] = floats.reshape(c, h, w)
    return arr if _NATIVE_LE else arr.astype(np.float32)


def datum_view(
    datum: BytesLike | ParsedDatum,
    *,
    force_color: bool = False,
    force_gray: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    key: bytes | str | None = None,
    path: object = None,
) -> tuple[npt.NDArray[np.uint8] | npt.NDArray[np.float32], int]:
    """A record's ``(C, H, W)`` pixels and its label, copying nothing that is not needed.

    For a raw record the array is a view of the payload inside ``datum`` (uint8 for
    ``data``, float32 for ``float_data``; possibly unaligned; read-only unless
    ``datum`` is a writable buffer): valid only
    as long as the buffer, e.g. inside the LMDB transaction that produced it. For an
    encoded record it is a freshly decoded uint8 array (BGR channel order, possibly
    not C-contiguous). Feed it to a transform that writes the batch: one copy.

    ``force_color``/``force_gray`` select OpenCV's decode mode for encoded records
    (see the module docstring) and are ignored for raw ones, as in Caffe.
    ``key`` and ``path`` name the record in error messages.

    Raises:
        DataError: the record is malformed, holds no pixels, its dimensions are not
            positive or do not match its payload, or its image cannot be decoded,
            is not 8-bit, or announces more than ``max_pixels`` pixels.
        ProtoError: both ``force_color`` and ``force_gray`` are set.
    """
    flag = imread_flag(force_color, force_gray)  # raises for both
    return view_record(datum, flag, max_pixels, key, path)


def view_record(
    datum: BytesLike | ParsedDatum,
    flag: int,
    max_pixels: int,
    key: bytes | str | None,
    path: object,
) -> tuple[npt.NDArray[np.uint8] | npt.NDArray[np.float32], int]:
    """:func:`datum_view` with the imdecode flag."""
    p = datum if isinstance(datum, ParsedDatum) else parse_datum(datum, key=key, path=path)
    if p.encoded:
        return _decode_image(p.data, flag, max_pixels, key, path), p.label
    c, h, w, label, _, data, floats = p
    if data is not None and floats is None and c > 0 and h > 0 and w > 0 and len(data) == c * h * w:
        return np.ndarray((c, h, w), _U1, data), label  # the common case: a view
    return _raw_view(p, key, path), label


def decode_datum(
    buf: BytesLike | ParsedDatum,
    *,
    force_color: bool = False,
    force_gray: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    key: bytes | str | None = None,
    path: object = None,
) -> tuple[npt.NDArray[np.uint8] | npt.NDArray[np.float32], int]:
    """Decode one record into a new C-contiguous, writable ``(C, H, W)`` array and its label.

    uint8 for ``data`` and for encoded images (BGR, as OpenCV decodes them), float32
    for ``float_data``. Decoding follows Caffe's ``DataTransformer`` (see the module
    docstring). The result does not refer to ``buf``.

    Raises:
        DataError: as :func:`datum_view`.
        ProtoError: both ``force_color`` and ``force_gray`` are set.
    """
    chw, label = datum_view(
        buf,
        force_color=force_color,
        force_gray=force_gray,
        max_pixels=max_pixels,
        key=key,
        path=path,
    )
    return np.array(chw, dtype=chw.dtype.newbyteorder("="), order="C", copy=True), label


def decode_datum_into(
    buf: BytesLike | ParsedDatum,
    out: npt.NDArray[np.generic],
    *,
    force_color: bool = False,
    force_gray: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    key: bytes | str | None = None,
    path: object = None,
) -> int:
    """Copy one record's ``(C, H, W)`` pixels into ``out`` and return its label.

    ``out`` is any writable array of the record's shape (e.g. ``batch[i]``); its
    dtype may be wider than the record's (uint8 into float32 converts during the
    copy), never narrower. A raw record is copied once, straight from ``buf``.

    Raises:
        DataError: as :func:`datum_view`; or the record's shape differs from
            ``out.shape`` (every record of a batch must have the same shape);
            or the record holds float32 values and ``out`` cannot hold them.
        ShapeError: ``out`` is read-only.
        ProtoError: both ``force_color`` and ``force_gray`` are set.
    """
    if not out.flags.writeable:
        raise ShapeError(f"out (shape {out.shape}, dtype {out.dtype}) is read-only")
    chw, label = datum_view(
        buf,
        force_color=force_color,
        force_gray=force_gray,
        max_pixels=max_pixels,
        key=key,
        path=path,
    )
    if chw.shape != out.shape:
        raise DataError(
            f"the record is {_shape(chw.shape)} but out is {_shape(out.shape)}; every "
            f"record of a batch must have the same shape (resize when building the "
            f"database, e.g. convert_imageset --resize_height/--resize_width, or crop)",
            path=path,
            key=key,
        )
    if chw.dtype != out.dtype and not np.can_cast(chw.dtype, out.dtype, "safe"):
        raise DataError(
            f"the record holds {chw.dtype} values that {out.dtype} cannot hold without "
            f"loss; use a float32 output for float_data records",
            path=path,
            key=key,
        )
    np.copyto(out, chw, casting="safe")
    return label


def _shape(shape: tuple[int, ...]) -> str:
    return "×".join(str(s) for s in shape)


# -- many raw records at once -----------------------------------------------------------------


def _varint_column(
    tail: npt.NDArray[np.uint8], start: int, length: int
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
    """Rows whose bytes ``[start, start+length)`` form one varint, and its int32 value."""
    cols = tail[:, start : start + length].astype(np.uint64)
    ok = np.ones(len(tail), dtype=bool)
    value = np.zeros(len(tail), dtype=np.uint64)
    for j in range(length):
        byte = cols[:, j]
        last = j == length - 1
        ok &= (byte < 0x80) if last else (byte >= 0x80)
        value |= (byte & np.uint64(0x7F)) << np.uint64(7 * j)
    low = (value & np.uint64(0xFFFFFFFF)).astype(np.int64)
    low[low >= 1 << 31] -= 1 << 32  # int32 semantics, as protobuf's parser
    return ok, low


def raw_header(shape: tuple[int, int, int]) -> npt.NDArray[np.uint8]:
    c, h, w = shape
    return np.frombuffer(_header(c, h, w) + b"\x22" + _enc_varint(c * h * w), np.uint8)


def match_raw_layout(
    block: npt.NDArray[np.uint8], header: npt.NDArray[np.uint8], size: int
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
    """Rows of ``block`` (records of one length) in convert_imageset's raw layout, and labels.

    The layout: ``header`` (channels, height, width, the data tag and length),
    ``size`` pixel bytes, then ``0x28 varint(label)`` and optionally ``0x38
    0x00`` (``encoded: false``) — nothing else.
    """
    n, length = block.shape
    hl = len(header)
    good = (block[:, :hl] == header).all(axis=1)
    tail = block[:, hl + size :]
    k = length - hl - size
    good &= tail[:, 0] == 0x28
    with_enc = np.zeros(n, dtype=bool)
    labels = np.zeros(n, dtype=np.int64)
    if 1 <= k - 3 <= 10:
        ok, lab = _varint_column(tail, 1, k - 3)
        with_enc = ok & (tail[:, k - 2] == 0x38) & (tail[:, k - 1] == 0x00)
        labels = np.where(with_enc, lab, labels)
    bare = np.zeros(n, dtype=bool)
    if 1 <= k - 1 <= 10:
        ok, lab = _varint_column(tail, 1, k - 1)
        bare = ok & ~with_enc
        labels = np.where(bare, lab, labels)
    return good & (with_enc | bare), labels


# -- writers -------------------------------------------------------------------------------


def _enc_varint(v: int) -> bytes:
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _enc_int32(v: int) -> bytes:
    # protobuf writes a negative int32 as its 64-bit two's complement (10 bytes)
    return _enc_varint(v + (1 << 64) if v < 0 else v)


def _check_label(label: int) -> int:
    label = operator.index(label)
    if not _INT32_MIN <= label <= _INT32_MAX:
        raise ProtoError(f"label {label} does not fit caffe.Datum.label (int32)")
    return label


def _check_chw(arr: npt.NDArray[np.generic], dtype: type[np.generic], what: str) -> None:
    if arr.ndim != 3 or arr.dtype != dtype:
        raise ShapeError(
            f"{what} needs a (C, H, W) {np.dtype(dtype)} array, got shape "
            f"{arr.shape} dtype {arr.dtype}"
        )
    if any(d > _INT32_MAX for d in arr.shape):
        raise ShapeError(f"{what}: dimensions {arr.shape} do not fit Datum's int32 fields")


def _header(c: int, h: int, w: int) -> bytes:
    return b"\x08" + _enc_varint(c) + b"\x10" + _enc_varint(h) + b"\x18" + _enc_varint(w)


def encode_raw_datum(chw_uint8: npt.ArrayLike, label: int) -> bytes:
    """Serialize a raw uint8 Datum exactly as Caffe's ``convert_imageset`` does.

    Fields in order: channels, height, width, data (C, H, W planes, row-major),
    label, and an explicit ``encoded: false``.

    Raises:
        ShapeError: ``chw_uint8`` is not a 3-D uint8 array.
        ProtoError: ``label`` does not fit an int32.
        TypeError: ``label`` is not an integer.
    """
    arr = np.asarray(chw_uint8)
    _check_chw(arr, np.uint8, "encode_raw_datum")
    label = _check_label(label)
    payload = arr.tobytes(order="C")
    return b"".join(
        (
            _header(*arr.shape),
            b"\x22",
            _enc_varint(len(payload)),
            payload,
            b"\x28",
            _enc_int32(label),
            b"\x38\x00",
        )
    )


def encode_encoded_datum(image_bytes: BytesLike, label: int) -> bytes:
    """Serialize an encoded Datum exactly as ``convert_imageset --encoded`` does.

    Fields in order: data (the whole image file), label, ``encoded: true``.

    Raises:
        DataError: ``image_bytes`` is empty.
        ProtoError: ``label`` does not fit an int32.
        TypeError: ``image_bytes`` is not bytes-like or ``label`` not an integer.
    """
    data = _as_bytes_view(image_bytes)
    if not len(data):
        raise DataError("cannot encode an empty image; pass the bytes of an image file")
    label = _check_label(label)
    return b"".join(
        (b"\x22", _enc_varint(len(data)), data, b"\x28", _enc_int32(label), b"\x38\x01")
    )


def encode_float_datum(chw_float32: npt.ArrayLike, label: int) -> bytes:
    """Serialize a float Datum as pycaffe's ``array_to_datum`` does for float arrays.

    Fields in order: channels, height, width, label, then ``float_data`` unpacked
    (proto2 ``repeated float``: one tag per value), no ``encoded`` field. The float32
    bit patterns are kept exactly.

    Raises:
        ShapeError: ``chw_float32`` is not a 3-D float32 array.
        ProtoError: ``label`` does not fit an int32.
        TypeError: ``label`` is not an integer.
    """
    arr = np.asarray(chw_float32)
    _check_chw(arr, np.float32, "encode_float_datum")
    label = _check_label(label)
    flat = np.ascontiguousarray(arr, dtype=_F4).reshape(-1)
    rows = np.empty((flat.size, 5), np.uint8)
    rows[:, 0] = _FLOAT_TAG
    rows[:, 1:] = flat.view(np.uint8).reshape(-1, 4)
    return b"".join((_header(*arr.shape), b"\x28", _enc_int32(label), rows.tobytes()))
