"""``caffe.Datum`` on the wire: a reader that builds no protobuf message.

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

:func:`wire_fields` lists a message's top-level fields and wire types under the same
rules, for any message: what a record *is* (``_records.py``) is told from them.
"""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from .._errors import DataError

__all__ = ["FLOAT_TAG", "REBUILD", "BytesLike", "ParsedDatum", "parse_datum", "wire_fields"]

BytesLike: TypeAlias = bytes | bytearray | memoryview


_UINT64_MASK = (1 << 64) - 1
# upb's default recursion limit: 100 nested groups parse, 101 do not.
_MAX_GROUP_DEPTH = 100
# An unpacked float_data run is sliced with numpy from this many elements on.
_VECTOR_RUN = 8
FLOAT_TAG = 0x35  # field 6, wire type 5: one unpacked float_data value
_F4 = np.dtype("<f4")

REBUILD = (
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
                if tag == FLOAT_TAG and b[start] == FLOAT_TAG:
                    # An unpacked run: tag, 4 bytes, tag, 4 bytes, ... (what C++ writes).
                    m = (end - start) // 5
                    if m >= _VECTOR_RUN:
                        rows = np.frombuffer(b, np.uint8, count=m * 5, offset=start)
                        rows = rows.reshape(m, 5)
                        stops = np.flatnonzero(rows[:, 0] != FLOAT_TAG)
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
        raise DataError(f"not a valid caffe.Datum: {exc}; {REBUILD}", path=path, key=key) from None


def wire_fields(buf: BytesLike) -> frozenset[tuple[int, int]] | None:
    """The ``(field number, wire type)`` pairs of a message's top-level fields (a
    group counts as wire type 3), or None when the bytes are not a valid message."""
    b = memoryview(buf)
    if b.format != "B" or b.ndim != 1:
        b = b.cast("B")
    seen: set[tuple[int, int]] = set()
    pos, end = 0, len(b)
    try:
        while pos < end:
            tag, pos = _varint(b, pos, end, 5, "a tag")
            field, wt = tag >> 3, tag & 7
            if tag > 0xFFFFFFFF or field == 0 or wt in (4, 6, 7):
                return None
            seen.add((field, wt))
            if wt == 3:
                pos = _skip_group(b, pos, end, field)
            else:
                pos = _skip_value(b, pos, end, wt, field)
    except _Malformed:
        return None
    return frozenset(seen)
