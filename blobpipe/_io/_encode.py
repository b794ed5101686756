"""Writing ``caffe.Datum`` records: the bytes Caffe's tools write.

:func:`encode_raw_datum` and :func:`encode_encoded_datum` match ``convert_imageset``
byte for byte, :func:`encode_float_datum` matches pycaffe's ``array_to_datum`` for
float arrays; :func:`raw_header` is the first bytes ``convert_imageset`` writes for a
raw record of one shape (what ``_records.py`` matches records against).
"""

from __future__ import annotations

import operator

import numpy as np
import numpy.typing as npt

from .._errors import DataError, ProtoError, ShapeError
from ._wire import FLOAT_TAG, BytesLike

__all__ = [
    "encode_encoded_datum",
    "encode_float_datum",
    "encode_raw_datum",
    "encode_varint",
    "raw_header",
]

_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
_F4 = np.dtype("<f4")


def _as_bytes_view(buf: BytesLike) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")
    return mv


def raw_header(shape: tuple[int, int, int]) -> npt.NDArray[np.uint8]:
    """The bytes before the pixels of a raw record of ``shape`` as ``convert_imageset``
    writes it: channels, height, width, the data tag and the data length."""
    c, h, w = shape
    return np.frombuffer(_header(c, h, w) + b"\x22" + encode_varint(c * h * w), np.uint8)


def encode_varint(v: int) -> bytes:
    """``v`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _enc_int32(v: int) -> bytes:
    # protobuf writes a negative int32 as its 64-bit two's complement (10 bytes)
    return encode_varint(v + (1 << 64) if v < 0 else v)


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
    return b"\x08" + encode_varint(c) + b"\x10" + encode_varint(h) + b"\x18" + encode_varint(w)


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
            encode_varint(len(payload)),
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
        (b"\x22", encode_varint(len(data)), data, b"\x28", _enc_int32(label), b"\x38\x01")
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
    rows[:, 0] = FLOAT_TAG
    rows[:, 1:] = flat.view(np.uint8).reshape(-1, 4)
    return b"".join((_header(*arr.shape), b"\x28", _enc_int32(label), rows.tobytes()))
