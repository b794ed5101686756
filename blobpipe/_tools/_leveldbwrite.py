"""A LevelDB written as Caffe's ``convert_imageset --backend=leveldb`` leaves one.

Caffe's tool opens a new LevelDB, puts its records in write batches and exits; the
directory then holds ``CURRENT`` (naming ``MANIFEST-000002``), that MANIFEST (the
comparator, then log number 3, next file 4, last sequence 0), the write-ahead log
``000003.log`` holding every batch, and an empty ``LOCK`` (and LevelDB's text
``LOG``, not written here). :class:`LevelDbWriter` writes exactly those bytes
(``doc/log_format.md``: 32 KiB blocks of checksummed fragments; a WriteBatch is
``sequence u64 | count u32 | (1, key, value)*``), so LevelDB, Caffe and blobpipe's
reader open the result as they open Caffe's.

A batch is appended whole or, when the process dies while writing it, cut back to
the last whole batch when the writer opens the directory again (a rerun resumes).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from .._errors import DataError
from .._io._leveldbfile import LOG_BLOCK, Damaged, log_records, masked_crc, write_batch

__all__ = ["LEVELDB_FILES", "LevelDbWriter"]

_HEADER: Final = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_MANIFEST: Final = "MANIFEST-000002"
_LOG: Final = "000003.log"
#: the VersionEdits LevelDB writes into a new database's MANIFEST-000002: the
#: comparator; then log number 3, previous log 0, next file 4, last sequence 0
_EDITS: Final = (b"\x01\x1aleveldb.BytewiseComparator", b"\x02\x03\x09\x00\x03\x04\x04\x00")
LEVELDB_FILES: Final = frozenset({"CURRENT", _MANIFEST, _LOG, "LOCK", "CURRENT.tmp"})


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _records(data: bytes, offset: int) -> tuple[bytes, int]:
    """``data`` as one logical log record written from file offset ``offset``
    (LevelDB's ``log::Writer::AddRecord``): its bytes and the offset after them."""
    out = bytearray()
    pos, left, begin = 0, len(data), True
    while True:
        room = LOG_BLOCK - offset % LOG_BLOCK
        if room < _HEADER:
            out += bytes(room)  # the block's trailer
            offset += room
            room = LOG_BLOCK
        n = min(left, room - _HEADER)
        end = n == left
        kind = _FULL if begin and end else _FIRST if begin else _LAST if end else _MIDDLE
        chunk = data[pos : pos + n]
        out += struct.pack("<IHB", masked_crc(bytes([kind]) + chunk), n, kind) + chunk
        offset += _HEADER + n
        pos += n
        left -= n
        begin = False
        if not left:
            return bytes(out), offset


class LevelDbWriter:
    """A new LevelDB at ``path`` (a directory), or the one a previous writer left there
    (resumed after its last whole batch); the interface of the tools' LMDB writer.

    Raises:
        DataError: the directory holds a LevelDB this writer did not make, or its
            files cannot be written.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._keys: set[bytes] = set()
        self._sequence = 0
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            log = self.path / _LOG
            if (self.path / "CURRENT").exists():
                self._resume(log)
            else:
                manifest = b"".join(_records(e, 0)[0] for e in _EDITS[:1])
                manifest += _records(_EDITS[1], len(manifest))[0]
                (self.path / _MANIFEST).write_bytes(manifest)
                log.write_bytes(b"")
                (self.path / "LOCK").write_bytes(b"")
                (self.path / "CURRENT.tmp").write_bytes(_MANIFEST.encode() + b"\n")
                os.replace(self.path / "CURRENT.tmp", self.path / "CURRENT")
            self._file = open(log, "ab")  # noqa: SIM115 - held until close()
        except OSError as exc:
            raise DataError(f"cannot write the LevelDB: {exc}", path=self.path) from exc
        self._offset = self._file.tell()

    def _resume(self, log: Path) -> None:
        if (self.path / "CURRENT").read_bytes() != _MANIFEST.encode() + b"\n" or not log.exists():
            raise DataError(
                "the directory holds a LevelDB that blobpipe did not write; write to a new "
                "directory",
                path=self.path,
            )
        data = log.read_bytes()
        whole = 0
        try:
            for record in log_records(data):
                batch = list(write_batch(record.data))
                self._keys.update(e.key for e in batch)
                self._sequence = batch[-1].sequence if batch else self._sequence
                whole = record.fragments[-1][1] + record.fragments[-1][2]
        except Damaged:
            pass  # a batch cut short by a writer that died: kept up to the last whole one
        if whole < len(data):
            with open(log, "r+b") as f:
                f.truncate(whole)

    def __enter__(self) -> LevelDbWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def entries(self) -> int:
        """Number of distinct keys written so far."""
        return len(self._keys)

    def put_many(self, items: Sequence[tuple[bytes, bytes]], *, unique: bool = False) -> None:
        """Append every ``(key, value)`` as one write batch (a key written before is
        replaced; with ``unique``, a DataError instead, nothing written).

        Raises:
            DataError: a repeated key with ``unique``; the log cannot be written.
        """
        if not items:
            return
        if unique:
            seen = set(self._keys)
            for key, _ in items:
                if key in seen:
                    raise DataError(
                        f"two records have the key {key!r}; keys must be unique", path=self.path
                    )
                seen.add(key)
        body = bytearray(struct.pack("<QI", self._sequence + 1, len(items)))
        for key, value in items:
            body += b"\x01" + _varint(len(key)) + key + _varint(len(value)) + value
        data, end = _records(bytes(body), self._offset)
        try:
            self._file.write(data)
            self._file.flush()
        except OSError as exc:
            raise DataError(f"cannot write the LevelDB's log: {exc}", path=self.path) from exc
        self._offset = end
        self._sequence += len(items)
        self._keys.update(k for k, _ in items)

    def sync(self) -> None:
        """Flush the log to disk."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the log; idempotent."""
        self._file.close()
