"""LevelDB's on-disk formats, read and checked: logs, the MANIFEST, tables, blocks.

The formats are google/leveldb's ``doc/log_format.md``, ``doc/table_format.md`` and
``db/version_edit.cc``, ``db/write_batch.cc``, ``table/block.cc``:

* a *log* (``NNNNNN.log`` write-ahead log, ``MANIFEST-NNNNNN``) is a sequence of
  32 KiB blocks of physical records ``crc32c (masked) | length u16 | type u8 | data``;
  FULL, or FIRST MIDDLE* LAST, records make one logical record;
* a write-ahead log's logical record is a WriteBatch: ``sequence u64 | count u32``,
  then ``count`` entries ``1 key value`` (a put) or ``0 key`` (a delete), each
  string a varint32 length and its bytes; entry ``i`` has sequence ``sequence + i``;
* a MANIFEST's logical records are VersionEdits (tagged fields: the comparator, the
  log numbers, the table files added and deleted per level);
* a table (``NNNNNN.ldb``, formerly ``.sst``) ends with a 48-byte footer naming its
  index block; each block is ``contents | type u8 | crc32c (masked) of both``,
  type 0 stored and 1 snappy-compressed; a block holds prefix-compressed entries and
  a restart array; a data block's keys are internal keys
  (``user key | sequence << 8 | type`` as a little-endian u64).

Every function here trusts nothing it reads: each length and offset is checked
against the bytes actually present before it is used, no allocation is sized by a
stored number beyond the bytes it is read from (a snappy block's announced size is
bounded by what its compressed bytes can expand to), and whatever does not hold
raises :class:`Damaged` with a sentence saying what (the reader adds the file and
the fix).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "BLOCK_STORED",
    "LOG_BLOCK",
    "TABLE_FOOTER",
    "Damaged",
    "Entry",
    "LogRecord",
    "Manifest",
    "Truncated",
    "block_contents",
    "block_entries",
    "data_block_handles",
    "log_records",
    "manifest_of",
    "masked_crc",
    "table_index",
    "write_batch",
]

LOG_BLOCK: Final = 32768
_HEADER: Final = 7  # crc u32, length u16, type u8
_ZERO, _FULL, _FIRST, _MIDDLE, _LAST = 0, 1, 2, 3, 4
TABLE_FOOTER: Final = 48
_TABLE_MAGIC: Final = 0xDB4775248B80FB57
_TRAILER: Final = 5  # a block's type u8 and crc u32
BLOCK_STORED: Final = 0
_BLOCK_SNAPPY: Final = 1
_BLOCK_ZSTD: Final = 2
# snappy's densest element, a 3-byte copy, yields 64 bytes: no valid block expands more
_SNAPPY_MOST: Final = 22
_MASK_DELTA: Final = 0xA282EAD8
_TYPE_DELETION: Final = 0
_TYPE_VALUE: Final = 1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
BYTEWISE: Final = b"leveldb.BytewiseComparator"


class Damaged(Exception):
    """Bytes that do not hold what the format says they must; the message says what."""


class Truncated(Damaged):
    """A file that ends inside a record: cut short (copied while written, or a writer
    that died mid-write)."""


_crc32c: Any = None
_cramjam: Any = None


def _libraries() -> tuple[Any, Any]:
    """google-crc32c and cramjam (snappy), imported on the first LevelDB read."""
    global _crc32c, _cramjam
    if _cramjam is None:
        import cramjam
        import google_crc32c

        _crc32c, _cramjam = google_crc32c, cramjam
    return _crc32c, _cramjam


def masked_crc(data: bytes | memoryview) -> int:
    """LevelDB's stored form of ``crc32c(data)`` (``util/crc32c.h``'s ``Mask``)."""
    crc32c, _ = _libraries()
    crc = int(crc32c.value(bytes(data) if isinstance(data, memoryview) else data))
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def _varint(buf: bytes | memoryview, pos: int, end: int, most: int = 10) -> tuple[int, int]:
    """The varint at ``buf[pos:]`` (at most ``most`` bytes, ending before ``end``) and
    the position after it."""
    value = shift = 0
    stop = min(end, pos + most)
    while pos < stop:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    if stop == end:
        raise Damaged("a varint runs past the end of its block or record")
    raise Damaged(f"a varint longer than {most} bytes")


def _string(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int, int]:
    """A varint32-length-prefixed string at ``pos``: ``(start, stop, next position)``."""
    n, pos = _varint(buf, pos, end, 5)
    if n > end - pos:
        raise Damaged(f"a string of {n} bytes runs past the end of its record ({end - pos} left)")
    return pos, pos + n, pos + n


# -- logs ----------------------------------------------------------------------------------


@dataclass
class LogRecord:
    """One logical record of a log: its bytes (joined where it was split) and its
    fragments, ``(offset of the record's bytes, offset in the file, length)``."""

    data: bytes | memoryview
    fragments: list[tuple[int, int, int]] = field(default_factory=list)

    def place(self, start: int, length: int) -> tuple[tuple[int, int], ...]:
        """Where bytes ``start:start + length`` of the record lie in the file: one
        ``(file offset, length)`` per fragment they touch."""
        out = []
        end = start + length
        for at, file_at, n in self.fragments:
            lo, hi = max(start, at), min(end, at + n)
            if lo < hi:
                out.append((file_at + lo - at, hi - lo))
        if not out:
            out.append((self.fragments[-1][1] if self.fragments else 0, 0))
        return tuple(out)


def log_records(buf: bytes | memoryview) -> Iterator[LogRecord]:
    """The logical records of a log file's bytes, every physical record's checksum
    checked.

    Raises:
        Truncated: the file ends inside a physical record or inside a record split
            in fragments.
        Damaged: a checksum that does not match, a bad length or type, fragments out
            of order, a block trailer that is not zeros.
    """
    size = len(buf)
    pos = 0
    parts: list[tuple[int, int]] = []  # (file offset, length) of the pending fragments
    while pos < size:
        left = LOG_BLOCK - pos % LOG_BLOCK
        if left < _HEADER:
            if any(buf[pos : min(size, pos + left)]):
                raise Damaged(f"the trailer of the log block at offset {pos - pos % LOG_BLOCK} "
                              "is not zeros")  # fmt: skip
            pos += left
            continue
        if size - pos < _HEADER:
            if not any(buf[pos:size]) and not parts:
                return  # zeros to the end: space a writer preallocated
            raise Truncated(f"the log ends inside a record header at offset {pos}")
        crc, length = _U32.unpack_from(buf, pos)[0], buf[pos + 4] | buf[pos + 5] << 8
        kind = buf[pos + 6]
        if kind == _ZERO and length == 0:
            if parts:
                raise Damaged(f"an empty record at offset {pos} inside a split record")
            pos += left  # LevelDB skips the rest of a block of preallocated zeros
            continue
        data_at = pos + _HEADER
        if data_at + length > size and size - pos < left:
            raise Truncated(f"the log ends inside the record at offset {pos} ({length} "
                            f"bytes announced, {size - data_at} present)")  # fmt: skip
        if _HEADER + length > left:
            raise Damaged(f"the record at offset {pos} announces {length} bytes, more "
                          "than its log block holds")  # fmt: skip
        if masked_crc(buf[pos + 6 : data_at + length]) != crc:
            raise Damaged(f"the checksum of the log record at offset {pos} does not match")
        if kind == _FULL:
            if parts:
                raise Damaged(f"a whole record at offset {pos} inside a split record")
            yield LogRecord(buf[data_at : data_at + length], [(0, data_at, length)])
        elif kind == _FIRST:
            if parts:
                raise Damaged(f"a first fragment at offset {pos} inside a split record")
            parts = [(data_at, length)]
        elif kind in (_MIDDLE, _LAST):
            if not parts:
                raise Damaged(f"a {'middle' if kind == _MIDDLE else 'last'} fragment at "
                              f"offset {pos} without its first")  # fmt: skip
            parts.append((data_at, length))
            if kind == _LAST:
                fragments, at = [], 0
                for file_at, n in parts:
                    fragments.append((at, file_at, n))
                    at += n
                joined = b"".join(buf[a : a + n] for a, n in parts)
                parts = []
                yield LogRecord(joined, fragments)
        else:
            raise Damaged(f"the log record at offset {pos} has unknown type {kind}")
        pos = data_at + length
    if parts:
        raise Truncated("the log ends inside a record split in fragments (its last "
                        "fragment is missing)")  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One put or delete of a write batch: its user key, sequence, whether it is a
    put, and where its value lies in the batch's record (0, 0 for a delete)."""

    key: bytes
    sequence: int
    put: bool
    value_start: int
    value_length: int


def write_batch(data: bytes | memoryview) -> Iterator[Entry]:
    """The entries of a write-ahead log record (a WriteBatch).

    Raises:
        Damaged: a header cut short, an unknown tag, a string past the record's end,
            a count that does not match the entries.
    """
    end = len(data)
    if end < 12:
        raise Damaged(f"a write batch of {end} bytes, fewer than its 12-byte header")
    sequence = _U64.unpack_from(data, 0)[0]
    count = _U32.unpack_from(data, 8)[0]
    pos = 12
    found = 0
    while pos < end:
        tag = data[pos]
        pos += 1
        a, b, pos = _string(data, pos, end)
        if tag == _TYPE_VALUE:
            v0, v1, pos = _string(data, pos, end)
            yield Entry(bytes(data[a:b]), sequence + found, True, v0, v1 - v0)
        elif tag == _TYPE_DELETION:
            yield Entry(bytes(data[a:b]), sequence + found, False, 0, 0)
        else:
            raise Damaged(f"a write batch entry with unknown tag {tag}")
        found += 1
    if found != count:
        raise Damaged(f"a write batch announces {count} entries and holds {found}")


# -- the MANIFEST ----------------------------------------------------------------------------


@dataclass
class Manifest:
    """The live state a MANIFEST describes: the comparator, the log numbers, and the
    table files of each level (``number -> size``)."""

    comparator: bytes | None = None
    log_number: int = 0
    prev_log_number: int = 0
    files: dict[int, tuple[int, int]] = field(default_factory=dict)  # number -> (level, size)


_LEVELS: Final = 7
_COMPARATOR, _LOG_NUMBER, _NEXT_FILE, _LAST_SEQUENCE = 1, 2, 3, 4
_COMPACT_POINTER, _DELETED_FILE, _NEW_FILE, _PREV_LOG_NUMBER = 5, 6, 7, 9


def manifest_of(buf: bytes | memoryview) -> Manifest:
    """The state after every VersionEdit of a MANIFEST's bytes, applied in order.

    Raises:
        Truncated, Damaged: as :func:`log_records`; an unknown tag, a level out of
            range, a field cut short, a deleted file that was never added.
    """
    state = Manifest()
    for record in log_records(buf):
        data = record.data
        end = len(data)
        pos = 0
        while pos < end:
            tag, pos = _varint(data, pos, end, 5)
            if tag == _COMPARATOR:
                a, b, pos = _string(data, pos, end)
                state.comparator = bytes(data[a:b])
            elif tag == _LOG_NUMBER:
                state.log_number, pos = _varint(data, pos, end)
            elif tag == _PREV_LOG_NUMBER:
                state.prev_log_number, pos = _varint(data, pos, end)
            elif tag in (_NEXT_FILE, _LAST_SEQUENCE):
                _, pos = _varint(data, pos, end)
            elif tag == _COMPACT_POINTER:
                _level(data, pos, end)
                _, pos = _varint(data, pos, end, 5)
                _, _, pos = _string(data, pos, end)
            elif tag == _DELETED_FILE:
                _level(data, pos, end)
                level, pos = _varint(data, pos, end, 5)
                number, pos = _varint(data, pos, end)
                if state.files.get(number, (None,))[0] == level:
                    del state.files[number]
            elif tag == _NEW_FILE:
                _level(data, pos, end)
                level, pos = _varint(data, pos, end, 5)
                number, pos = _varint(data, pos, end)
                size, pos = _varint(data, pos, end)
                _, _, pos = _string(data, pos, end)  # smallest internal key
                _, _, pos = _string(data, pos, end)  # largest
                state.files[number] = (level, size)
            else:
                raise Damaged(f"a VersionEdit field with unknown tag {tag}")
    return state


def _level(data: bytes | memoryview, pos: int, end: int) -> None:
    level, _ = _varint(data, pos, end, 5)
    if level >= _LEVELS:
        raise Damaged(f"a VersionEdit names level {level}; LevelDB has {_LEVELS}")


# -- tables ----------------------------------------------------------------------------------


def _handle(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int, int]:
    """A BlockHandle at ``pos``: ``(offset, size, next position)``."""
    offset, pos = _varint(buf, pos, end)
    size, pos = _varint(buf, pos, end)
    return offset, size, pos


def table_index(footer: bytes, file_size: int) -> tuple[int, int]:
    """The index block's ``(offset, size)`` from a table's last 48 bytes.

    Raises:
        Damaged: no table magic; a handle outside the file.
    """
    if len(footer) != TABLE_FOOTER:
        raise Damaged(f"the file holds {file_size} bytes, fewer than a table's footer")
    if _U64.unpack_from(footer, 40)[0] != _TABLE_MAGIC:
        raise Damaged("the footer does not end with a LevelDB table's magic number")
    _, _, pos = _handle(footer, 0, 40)  # the metaindex: filters only, not needed
    offset, size, _ = _handle(footer, pos, 40)
    if offset + size + _TRAILER > file_size - TABLE_FOOTER:
        raise Damaged(f"the index block ({size} bytes at {offset}) lies outside the file")
    return offset, size


def block_contents(raw: bytes | memoryview, where: str) -> bytes | memoryview:
    """A block's contents from its bytes and trailer (``size + 5`` bytes as stored),
    its checksum checked and, when compressed, decompressed.

    Raises:
        Damaged: a checksum that does not match, an unknown compression, a snappy
            block that does not decompress or announces more than it can hold.
    """
    size = len(raw) - _TRAILER
    if size < 0:
        raise Damaged(f"{where} is cut short")
    crc = _U32.unpack_from(raw, size + 1)[0]
    if masked_crc(raw[: size + 1]) != crc:
        raise Damaged(f"the checksum of {where} does not match its bytes")
    kind = raw[size]
    body = raw[:size]
    if kind == BLOCK_STORED:
        return body
    if kind == _BLOCK_SNAPPY:
        _, cramjam = _libraries()
        try:
            length = int(cramjam.snappy.decompress_raw_len(body))
        except cramjam.DecompressionError as exc:
            raise Damaged(f"{where} is not valid snappy data ({exc})") from None
        if length > _SNAPPY_MOST * size + 64:
            raise Damaged(f"{where} announces {length} bytes from {size} compressed "
                          "bytes, more than snappy can expand to")  # fmt: skip
        try:
            return bytes(cramjam.snappy.decompress_raw(bytes(body), output_len=length))
        except cramjam.DecompressionError as exc:
            raise Damaged(f"{where} does not decompress ({exc})") from None
    if kind == _BLOCK_ZSTD:
        raise Damaged(f"{where} is zstd-compressed (LevelDB 1.24 and later can write "
                      "this); blobpipe reads stored and snappy blocks, which is what "
                      "Caffe's LevelDB writes")  # fmt: skip
    raise Damaged(f"{where} has unknown compression type {kind}")


def block_entries(block: bytes | memoryview) -> Iterator[tuple[bytes, int, int]]:
    """A block's entries in order: ``(key, value start, value length)`` (offsets
    into ``block``).

    Raises:
        Damaged: a restart array that does not fit, an entry past the entries'
            end, a key sharing more bytes than the key before it has.
    """
    n = len(block)
    if n < 4:
        raise Damaged(f"a block of {n} bytes, fewer than its restart count")
    restarts = _U32.unpack_from(block, n - 4)[0]
    if restarts > (n - 4) // 4:
        raise Damaged(f"a block of {n} bytes announces {restarts} restart points")
    end = n - 4 - 4 * restarts
    pos = 0
    key = b""
    while pos < end:
        shared, pos = _varint(block, pos, end, 5)
        fresh, pos = _varint(block, pos, end, 5)
        length, pos = _varint(block, pos, end, 5)
        if shared > len(key):
            raise Damaged(f"a block entry shares {shared} bytes with a key of {len(key)}")
        if fresh + length > end - pos:
            raise Damaged("a block entry runs past the end of its block's entries")
        key = key[:shared] + bytes(block[pos : pos + fresh])
        pos += fresh
        yield key, pos, length
        pos += length


def data_block_handles(index: bytes | memoryview, data_end: int) -> list[tuple[int, int]]:
    """The data blocks ``(offset, size)`` an index block lists, checked to lie one
    after another before ``data_end`` (the index block's offset).

    Raises:
        Damaged: as :func:`block_entries`; a handle out of order or out of range.
    """
    out = []
    floor = 0
    for _, start, length in block_entries(index):
        offset, size, pos = _handle(index, start, start + length)
        if pos != start + length:
            raise Damaged("an index entry holds more than a block handle")
        if offset < floor or offset + size + _TRAILER > data_end:
            raise Damaged(f"the index names a data block ({size} bytes at {offset}) out "
                          "of order or outside the table's data")  # fmt: skip
        floor = offset + size + _TRAILER
        out.append((offset, size))
    return out


def internal_key(key: bytes) -> tuple[bytes, int, bool]:
    """A table key's ``(user key, sequence, is a put)``.

    Raises:
        Damaged: shorter than its 8-byte tag, or a type that is neither put nor delete.
    """
    if len(key) < 8:
        raise Damaged(f"a table key of {len(key)} bytes, fewer than its 8-byte tag")
    tag = _U64.unpack_from(key, len(key) - 8)[0]
    kind = tag & 0xFF
    if kind not in (_TYPE_VALUE, _TYPE_DELETION):
        raise Damaged(f"a table key of unknown type {kind}")
    return key[:-8], tag >> 8, kind == _TYPE_VALUE


ReadAt = Callable[[int, int], bytes]
