"""A ``caffe.Datum`` record's pixels: views, decoding to ``(C, H, W)`` arrays.

Three ways to get the pixels, from cheapest to most convenient:

* :func:`datum_view` returns a read-only ``(C, H, W)`` view of a raw record's payload
  (uint8 ``data`` or float32 ``float_data``), so a transform can read straight from
  the LMDB memory map and write the batch: exactly one copy. Encoded records are
  decoded by OpenCV into a fresh array.
* :func:`decode_datum_into` copies (and widens, e.g. uint8 to float32) one record
  into a caller-provided array such as ``batch[i]``.
* :func:`decode_datum` returns an owned, writable array.

Which records hold pixels is decided in ``_records.py`` (:func:`~._records.datum_kind`,
which also explains the others); records are read by the wire parser ``_wire.py``.

Encoded records are decoded as Caffe's ``DataTransformer`` does: ``force_color`` →
``cv::imdecode(..., IMREAD_COLOR)``, ``force_gray`` → ``IMREAD_GRAYSCALE``, neither →
``DecodeDatumToCVMatNative``, i.e. ``IMREAD_UNCHANGED`` (a gray PNG stays 1-channel,
an RGBA PNG gives 4 channels). The flags do nothing for raw records (Caffe only
logs). Only ``encoded: true`` selects decoding; the bytes are never sniffed.

No allocation is ever sized by the record's claims: raw dimensions must multiply to
the payload's actual length, and an encoded PNG or JPEG whose header announces more
than ``max_pixels`` pixels is refused before OpenCV allocates.
"""

from __future__ import annotations

import sys

import numpy as np
import numpy.typing as npt

from .._errors import DataError, ShapeError
from ._image import DEFAULT_MAX_PIXELS, Undecodable, decode_image, imread_flag
from ._records import BLOBPROTO, PARSED, RAW, datum_error, datum_kind, kind_mismatch, record_kind
from ._wire import REBUILD, BytesLike, ParsedDatum, parse_datum

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "checked_view",
    "datum_view",
    "decode_datum",
    "decode_datum_into",
    "view_record",
]

_NATIVE_LE = sys.byteorder == "little"
_U1 = np.dtype(np.uint8)


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
        reason = f"{hwc.reason}; {REBUILD}" if hwc.damaged else hwc.reason
        raise DataError(reason, path=path, key=key)
    chw: npt.NDArray[np.uint8] = hwc.transpose(2, 0, 1)
    return chw


def _raw_view(
    p: ParsedDatum, key: bytes | str | None, path: object
) -> npt.NDArray[np.uint8] | npt.NDArray[np.float32]:
    """A raw record's ``(C, H, W)`` pixels as a view of its payload (raises why
    there are none, naming the record)."""
    kind = datum_kind(p)
    c, h, w = p.channels, p.height, p.width
    if kind == RAW:
        view: npt.NDArray[np.uint8] = np.ndarray((c, h, w), _U1, p.data)
        return view
    if kind != PARSED or p.float_data is None:
        raise datum_error(p, key, path)
    arr: npt.NDArray[np.float32] = p.float_data.reshape(c, h, w)
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
    return _raw_view(p, key, path), p.label


def checked_view(
    buf: BytesLike, flag: int, max_pixels: int, key: bytes, path: object
) -> tuple[ParsedDatum, npt.NDArray[np.uint8] | npt.NDArray[np.float32], int]:
    """:func:`view_record` of a Datum database's record ``key``: the parsed record,
    its pixels and label; a BlobProto record's error says that it is one.

    Raises:
        DataError: as :func:`datum_view`, naming key and path.
    """
    try:
        p = parse_datum(buf, key=key, path=path)
        chw, label = view_record(p, flag, max_pixels, key, path)
    except DataError as exc:
        if record_kind(buf) != BLOBPROTO:
            raise
        raise kind_mismatch(key, path) from exc
    return p, chw, label


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
