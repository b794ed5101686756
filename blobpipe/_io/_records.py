"""What a stored record is: the one place that decides it.

A database holds ``caffe.Datum`` or ``caffe.BlobProto`` records. Their wire formats
overlap (fields 1 to 3 are varints in both, field 6 is a float run in both), and a
protobuf message of the wrong type parses as unknown fields, so "it parses as a
BlobProto" says nothing. A record's kind is told from its fields:

* a **Datum** holds pixels (``data`` of ``C·H·W`` bytes, ``float_data`` of ``C·H·W``
  values, or ``encoded`` image bytes). A record with a field that only a Datum has
  (``data`` as bytes, field 4 length-delimited; ``label`` or ``encoded`` as varints,
  fields 5 and 7) *is Datum-looking* and is judged as a Datum even when it is
  damaged: its error says what is wrong with it as a Datum, never "a BlobProto";
* a **BlobProto** has no Datum-only field, every field BlobProto defines (1 to 9)
  with BlobProto's own wire type, its shape (all four legacy ``num/channels/height/
  width`` fields, or ``shape``) or its values present, and value counts that match
  its shape (``_codec.blobproto_array``).

:func:`classify` judges many Datum records of one buffer at once (the record index,
``_index.py``): raw records in ``convert_imageset``'s layout and of the ``hint``
shape are recognised by comparing their header and tail bytes (which also decodes
their labels), in one call of the compiled row kernel or with a few NumPy calls per
record length where it is not built; any other record goes through the wire parser
(``_wire.parse_datum``). Per record the answer is a kind (:data:`RAW`,
:data:`ENCODED`, :data:`PARSED`, :data:`BLOB`, :data:`BAD`), where its payload
lies, its shape and its label. :func:`datum_kind` is the rule for one parsed Datum
and :func:`datum_error` the error that names why one is :data:`BAD`;
:func:`record_kind` tells a database's kind from one record, and
:func:`blob_record` reads a BlobProto record's values, checked.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from .._codec import blobproto_array
from .._errors import DataError, ProtoError
from ._encode import raw_header
from ._kernels import row_kernel
from ._wire import REBUILD, BytesLike, ParsedDatum, parse_datum, wire_fields

__all__ = [
    "BAD",
    "BLOB",
    "BLOBPROTO",
    "DATUM",
    "ENCODED",
    "PARSED",
    "RAW",
    "UNKNOWN",
    "Classified",
    "RecordKind",
    "blob_record",
    "classify",
    "datum_error",
    "datum_kind",
    "kind_mismatch",
    "record_kind",
]

UNKNOWN, RAW, ENCODED, PARSED, BAD, BLOB = 0, 1, 2, 3, 4, 5

RecordKind = Literal["datum", "blobproto"]
DATUM: RecordKind = "datum"
BLOBPROTO: RecordKind = "blobproto"

# (field, wire type) pairs that only a Datum has: data as bytes, label and encoded as varints.
_DATUM_ONLY = frozenset({(4, 2), (5, 0), (7, 0)})
# BlobProto's fields and the wire types protobuf writes them with (repeated floats
# and doubles packed or not).
_BLOB_WIRE = {1: {0}, 2: {0}, 3: {0}, 4: {0}, 5: {2, 5}, 6: {2, 5}, 7: {2}, 8: {2, 1}, 9: {2, 1}}

_KIND_HINT = "a database must hold one kind of record"


class Classified(NamedTuple):
    """Per record: kind, payload offset (in the buffer) and length, ``(C, H, W)``
    (zeros where not known) and label. For :data:`ENCODED` the payload is the image
    file; for :data:`PARSED`, :data:`BLOB` and :data:`BAD` it is the whole value."""

    kind: npt.NDArray[np.int8]
    offset: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]
    shape: npt.NDArray[np.int32]
    label: npt.NDArray[np.int32]


def datum_kind(p: ParsedDatum) -> int:
    """What a parsed Datum yields: :data:`ENCODED` (image bytes to decode),
    :data:`RAW` (``data`` of ``C·H·W`` bytes, any ``float_data`` agreeing),
    :data:`PARSED` (only ``float_data``, ``C·H·W`` values) or :data:`BAD`."""
    if p.encoded:
        return ENCODED if p.data is not None and len(p.data) else BAD
    c, h, w = p.channels, p.height, p.width
    count = c * h * w if c > 0 and h > 0 and w > 0 else 0
    floats = p.float_data
    if p.data is not None and len(p.data):
        ok = count and len(p.data) == count and (floats is None or len(floats) == count)
        return RAW if ok else BAD
    return PARSED if floats is not None and count and len(floats) == count else BAD


def datum_error(p: ParsedDatum, key: bytes | str | None, path: object) -> DataError:
    """Why the raw (``encoded: false``) Datum ``p`` yields no pixels (:func:`datum_kind`
    is :data:`BAD`), naming ``key`` and ``path``."""
    c, h, w = p.channels, p.height, p.width
    data = p.data if p.data is not None and len(p.data) else None
    floats = p.float_data
    if data is None and floats is None:
        why = "the record holds no pixels: data and float_data are both empty and encoded is false"
    elif c <= 0 or h <= 0 or w <= 0:
        why = (
            f"a raw (encoded: false) record needs positive channels, height and width, "
            f"got {c}×{h}×{w}; if data holds an image file, the record should say "
            f"encoded: true"
        )
    elif data is not None and len(data) != c * h * w:
        why = (
            f"data holds {len(data)} bytes but channels×height×width is "
            f"{c}×{h}×{w} = {c * h * w} (one uint8 per element); if data holds an image "
            f"file, the record should say encoded: true"
        )
    elif data is not None and floats is not None:
        why = (
            f"the record holds both data ({len(data)} bytes) and float_data "
            f"({len(floats)} values) and they disagree; a record holds one or the other"
        )
    else:
        n = 0 if floats is None else len(floats)
        why = f"float_data holds {n} values but channels×height×width is {c}×{h}×{w} = {c * h * w}"
    return DataError(f"{why}; {REBUILD}", path=path, key=key)


def _datum_looking(fields: frozenset[tuple[int, int]]) -> bool:
    return not fields.isdisjoint(_DATUM_ONLY)


def _blob_fields(fields: frozenset[tuple[int, int]]) -> bool:
    """Whether ``fields`` are a BlobProto's own: each known field with its wire type,
    and a shape (all four legacy fields, or ``shape``) or values present."""
    for field, wt in fields:
        allowed = _BLOB_WIRE.get(field)
        if allowed is not None and wt not in allowed:
            return False
    legacy = {f for f, _ in fields if f <= 4}
    if legacy and len(legacy) != 4:
        return False
    return bool(legacy) or (7, 2) in fields or any(f in (5, 8) for f, _ in fields)


def _is_datum(value: BytesLike, fields: frozenset[tuple[int, int]]) -> bool:
    """Whether ``value`` is judged as a Datum: Datum-looking, or a Datum with pixels."""
    if _datum_looking(fields):
        return True
    try:
        return datum_kind(parse_datum(value)) != BAD
    except DataError:
        return False


def _is_blob(value: BytesLike, fields: frozenset[tuple[int, int]]) -> bool:
    if not _blob_fields(fields):
        return False
    try:
        blobproto_array(value)
    except ProtoError:
        return False
    return True


def record_kind(value: BytesLike) -> RecordKind | None:
    """Which kind of record ``value`` is: a Datum (holding pixels, or Datum-looking:
    see the module docstring), else a BlobProto whose own fields are present and
    consistent, else None (neither)."""
    fields = wire_fields(value)
    if fields is None:
        return None
    if _is_datum(value, fields):
        return DATUM
    return BLOBPROTO if _is_blob(value, fields) else None


def blob_record(value: BytesLike, key: bytes, path: object) -> np.ndarray:
    """A BlobProto record's values, shaped (``_codec.blobproto_array``), checked to be
    a BlobProto's (see the module docstring).

    Raises:
        DataError: the record is a Datum, or not a valid BlobProto; names key and path.
    """
    fields = wire_fields(value)
    if fields is not None and _is_datum(value, fields):
        raise DataError(
            f"record {key!r} is a caffe.Datum, and this database is read as BlobProtos "
            f"(its first record is one, or record='blobproto' was given): {_KIND_HINT}",
            path=path,
            key=key,
        )
    try:
        values = blobproto_array(value, f"record {key!r}")
    except ProtoError as exc:
        raise DataError(str(exc), path=path, key=key) from None
    if fields is None or not _blob_fields(fields):
        raise DataError(
            f"record {key!r} is not a valid caffe.BlobProto: a field has another type "
            f"than BlobProto's, or it holds neither a shape nor values; {REBUILD}",
            path=path,
            key=key,
        )
    return values


def kind_mismatch(key: bytes, path: object) -> DataError:
    """The error for a BlobProto record in a database read as Datums."""
    return DataError(
        f"record {key!r} is a caffe.BlobProto, not a Datum, and this database is read as "
        f"Datums (its first record is one, or record='datum' was given): {_KIND_HINT}",
        path=path,
        key=key,
    )


# -- many records at once ---------------------------------------------------------------------


def classify(
    buffer: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    hint: tuple[int, int, int] | None = None,
) -> Classified:
    """What each record ``buffer[offsets[i]:offsets[i] + lengths[i]]`` is (as a Datum
    of a Datum database; :data:`BLOB` for a BlobProto among them).

    ``hint``: the shape raw records probably have (a batch's first record's); raw
    records of that shape in convert_imageset's layout are recognised in one pass,
    the others are parsed one by one.
    """
    offsets = np.asarray(offsets, np.int64)
    lengths = np.asarray(lengths, np.int64)
    n = len(offsets)
    out = Classified(
        np.full(n, BAD, np.int8),
        offsets.copy(),
        lengths.copy(),
        np.zeros((n, 3), np.int32),
        np.zeros(n, np.int32),
    )
    rest = np.arange(n, dtype=np.intp)
    if hint is not None and n:
        rest = _match_raw(buffer, offsets, lengths, hint, out)
    for r in rest.tolist():
        _judge(buffer, int(offsets[r]), int(lengths[r]), out, r)
    return out


def _judge(buffer: npt.NDArray[np.uint8], start: int, length: int, out: Classified, r: int) -> None:
    """Record ``r`` of ``out`` (the value ``buffer[start:start+length]``), parsed."""
    view = buffer[start : start + length].data
    try:
        p = parse_datum(view)
    except DataError:
        return  # BAD
    kind = datum_kind(p)
    if kind == BAD:
        fields = wire_fields(view)
        if fields is not None and not _datum_looking(fields) and _is_blob(view, fields):
            out.kind[r] = BLOB
        return
    out.label[r] = p.label
    if kind == ENCODED:
        assert p.data is not None
        out.offset[r] = start + _position(p.data, view)
        out.length[r] = len(p.data)
    else:
        out.shape[r] = (p.channels, p.height, p.width)
        if kind == RAW:
            assert p.data is not None
            out.offset[r] = start + _position(p.data, view)
            out.length[r] = len(p.data)
    out.kind[r] = kind


def _match_raw(
    buffer: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    shape: tuple[int, int, int],
    out: Classified,
) -> npt.NDArray[np.intp]:
    """Mark the records of ``shape`` in convert_imageset's raw layout :data:`RAW` in
    ``out``; return the positions of the others. One pass of the compiled row kernel
    (``match_raw``: no NumPy step per length, the GIL released), or NumPy's
    (:func:`_match_layout` per record length) where it is not built."""
    header = raw_header(shape)
    size = shape[0] * shape[1] * shape[2]
    hl = len(header)
    kernel = row_kernel()
    if kernel is not None:
        return _match_compiled(kernel, buffer, offsets, lengths, header, shape, out)
    rows = np.arange(len(offsets), dtype=np.intp)
    rest = []
    ordered = np.sort(lengths)
    distinct = (
        ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if len(ordered) else ordered
    )
    for length in distinct.tolist():
        sel = lengths == length
        group = rows[sel]
        if length < hl + size + 2 or length > hl + size + 14:
            rest.append(group)
            continue
        starts = offsets[sel]
        # each record's header and the bytes after its pixels: two gathers of
        # contiguous windows (a row of bytes each), not one index per byte
        block = np.concatenate(
            [
                byte_windows(buffer, hl)[starts],
                byte_windows(buffer, length - hl - size)[starts + hl + size],
            ],
            axis=1,
        )
        good, labels = _match_layout(block, header)
        rest.append(group[~good])
        group = group[good]
        out.offset[group] = offsets[sel][good] + hl
        out.length[group] = size
        out.shape[group] = shape
        out.label[group] = labels[good]
        out.kind[group] = RAW
    return np.concatenate(rest) if rest else rows[:0]


def _match_compiled(
    kernel: Any,
    buffer: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    header: npt.NDArray[np.uint8],
    shape: tuple[int, int, int],
    out: Classified,
) -> npt.NDArray[np.intp]:
    """:func:`_match_raw` by the row kernel's ``match_raw``: one pass over the records."""
    size = shape[0] * shape[1] * shape[2]
    good = np.empty(len(offsets), np.bool_)
    labels = np.empty(len(offsets), np.int32)
    offsets = np.ascontiguousarray(offsets, np.int64)
    lengths = np.ascontiguousarray(lengths, np.int64)
    kernel.match_raw(buffer, offsets, lengths, header.tobytes(), size, good, labels)
    group = np.flatnonzero(good)
    out.offset[group] = offsets[group] + len(header)
    out.length[group] = size
    out.shape[group] = shape
    out.label[group] = labels[group]
    out.kind[group] = RAW
    return np.flatnonzero(~good)


def byte_windows(buffer: npt.NDArray[np.uint8], width: int) -> npt.NDArray[np.uint8]:
    """Every ``width``-byte window of ``buffer`` as a row (a view: row ``i`` starts at
    byte ``i``): indexing it with byte offsets gathers whole windows at once."""
    windows: npt.NDArray[np.uint8] = np.ndarray(
        (len(buffer) - width + 1, width), np.uint8, buffer, 0, (1, 1)
    )
    return windows


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


def _match_layout(
    block: npt.NDArray[np.uint8], header: npt.NDArray[np.uint8]
) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int64]]:
    """Rows of ``block`` (a record's header bytes then its bytes after the pixels, for
    records of one length) in convert_imageset's raw layout, and their labels.

    The layout: ``header`` (channels, height, width, the data tag and length), the
    pixels, then ``0x28 varint(label)`` and optionally ``0x38 0x00``
    (``encoded: false``) — nothing else.
    """
    n, length = block.shape
    hl = len(header)
    good = (block[:, :hl] == header).all(axis=1)
    tail = block[:, hl:]
    k = length - hl
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


def _position(part: memoryview, whole: memoryview) -> int:
    """Where the slice ``part`` of ``whole`` starts in it."""
    a = np.frombuffer(part, np.uint8)
    b = np.frombuffer(whole, np.uint8)
    return int(a.__array_interface__["data"][0]) - int(b.__array_interface__["data"][0])
