"""Reading Caffe's LevelDB databases: read-only, lock-free, from many processes at once.

LevelDB's own ``DB::Open`` takes an exclusive ``LOCK`` on the directory and rewrites
it (it replays the write-ahead log into a new table, writes a new MANIFEST and
``CURRENT``, deletes the old files), even to read. blobpipe reads the files
LevelDB documents instead (``_leveldbfile.py``) and never opens one for writing:

1. ``CURRENT`` names the MANIFEST; its VersionEdits, applied in order, give the
   live table files and the log number;
2. every live table's index block, then each of its data blocks (checksum checked,
   snappy blocks decompressed), gives the table's keys and where each value lies;
   every write-ahead log at or after the log number (what ``DB::Open`` would
   replay) gives the puts and deletes written since, record checksums checked;
3. for each user key the entry of the highest sequence number wins (a delete
   removes the key), as in LevelDB's merged view; keys in byte order, which is
   LevelDB's default comparator and Caffe's.

So opening reads the whole database once (keys live beside their values); values
are read again, with ``pread``, when asked for. Nothing is locked, created or
written: a read-only directory or file system works, and any number of processes
read one directory at once (DDP ranks), as they read a directory that does not
change. A database still being written by LevelDB is read as the snapshot its
files held when opened; a table a writer deletes meanwhile stays readable through
the descriptor held open for it.

File descriptors are shared by the threads of a reader (``pread`` has no file
position), at most :data:`_OPEN_FILES` open at once, and stay valid in a child
after ``fork()``. Decoded blocks are cached per thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from .._codec import BlobProto, decode_blobproto
from .._errors import (
    DatabaseNotFoundError,
    DataError,
    ProtoError,
    RecordNotFoundError,
    StateError,
)
from ._keys import PackedKeys
from ._leveldbfile import (
    BYTEWISE,
    TABLE_FOOTER,
    Damaged,
    LogRecord,
    Truncated,
    block_contents,
    block_entries,
    data_block_handles,
    internal_key,
    log_records,
    manifest_of,
    table_index,
    write_batch,
)
from ._wire import ParsedDatum, parse_datum

__all__ = ["LevelDbReader", "is_leveldb"]

T = TypeVar("T")

_OPEN_FILES: Final = 64
_CACHED_BLOCKS: Final = 4  # decoded blocks each thread keeps
_OPEN_TRIES: Final = 3  # a writer may replace files between CURRENT and the tables
_MANIFEST = re.compile(r"MANIFEST-[0-9]+")
_LOG = re.compile(r"([0-9]+)\.log")
_FIX_DAMAGED = (
    "copy the database again from a good source, or rebuild it (convert_imageset); "
    "LevelDB itself would drop or misread these records"
)

_READERS: weakref.WeakSet[LevelDbReader] = weakref.WeakSet()


def is_leveldb(path: str) -> bool:
    """Whether ``path`` is a directory holding LevelDB's ``CURRENT`` file."""
    return os.path.isfile(os.path.join(path, "CURRENT"))


class _Files:
    """Read-only descriptors of a database's files, opened on first use; at most
    :data:`_OPEN_FILES` stay open, and a descriptor is closed only while no read
    uses it (so no thread's ``pread`` ever meets a closed or reused descriptor)."""

    def __init__(self, paths: list[str], held: dict[int, int]) -> None:
        self.paths = paths
        self._open: OrderedDict[int, int] = OrderedDict(held)  # file id -> descriptor
        self._users: dict[int, int] = {}
        self._closed = False
        self.lock = threading.Lock()

    def read(self, file: int, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of file ``file``.

        Raises:
            OSError: the file cannot be opened or read (EBADF once closed).
            Damaged: fewer bytes than asked for (the file shrank).
        """
        with self.lock:
            if self._closed:
                raise OSError(9, "the reader was closed")
            fd = self._open.get(file)
            if fd is None:
                fd = os.open(self.paths[file], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._open[file] = fd
            self._open.move_to_end(file)
            self._users[file] = self._users.get(file, 0) + 1
        try:
            data = os.pread(fd, size, offset)
        finally:
            with self.lock:
                self._users[file] -= 1
                self._trim()
        if len(data) != size:
            raise Damaged(f"{os.path.basename(self.paths[file])} holds fewer bytes than "
                          "when it was opened (cut short since)")  # fmt: skip
        return data

    def _trim(self) -> None:
        keep = 0 if self._closed else _OPEN_FILES
        while len(self._open) > keep:
            idle = next((f for f in self._open if not self._users.get(f)), None)
            if idle is None:
                return
            with contextlib.suppress(OSError):
                os.close(self._open.pop(idle))

    def close(self) -> None:
        """Close every descriptor no read uses now; the others when their reads end."""
        with self.lock:
            self._closed = True
            self._trim()

    def after_fork(self) -> None:
        self.lock = threading.Lock()
        self._users.clear()


class _Index:
    """Every live record of a database: keys in byte order and where each value
    lies. ``block[i] >= 0``: bytes ``offset[i]:offset[i] + length[i]`` of that data
    block's contents; ``block[i] < 0``: the log segments ``segments[-1 - block[i]]``."""

    def __init__(self) -> None:
        self.files: list[str] = []
        self.held: dict[int, int] = {}
        self.blocks: list[tuple[int, int, int]] = []  # (file id, offset, size)
        self.segments: list[tuple[int, tuple[tuple[int, int], ...]]] = []
        self.keys: PackedKeys = PackedKeys.of(())
        self.block = np.zeros(0, np.int64)
        self.offset = np.zeros(0, np.int64)
        self.length = np.zeros(0, np.int64)
        self.table_bytes = 0
        self.log_bytes = 0
        # each entry's place while the files are read, before the merge keeps the live
        self.block_list: list[int] = []
        self.offset_list: list[int] = []
        self.length_list: list[int] = []


class LevelDbReader:
    """A Caffe LevelDB database opened read-only (see the module docstring): the same
    reading API as :class:`~blobpipe.LmdbReader`.

    Keys are ``bytes`` in byte order, the order Caffe's LevelDB cursor visits them.

    Args:
        path: the database directory (holding ``CURRENT``).

    Raises:
        DatabaseNotFoundError: ``path`` is not a LevelDB directory.
        DataError: a file of the database is damaged or cut short (names the file
            and what to do), or uses what Caffe's LevelDB never writes (another
            comparator, zstd blocks).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fsdecode(os.fspath(path))
        self._closed = False
        self._local = threading.local()
        self._index = _open(self._path)
        self._files = _Files(self._index.files, self._index.held)
        self._finalizer = weakref.finalize(self, self._files.close)
        _READERS.add(self)

    # -- state ---------------------------------------------------------------------------

    @property
    def path(self) -> str:
        """The path the reader was opened with."""
        return self._path

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def nbytes(self) -> int:
        """The bytes of the live table files and logs read at open."""
        return self._index.table_bytes + self._index.log_bytes

    def close(self) -> None:
        """Close the database's files. Idempotent; a read already under way finishes,
        later uses raise :class:`~blobpipe.StateError`."""
        self._closed = True
        self._local = threading.local()
        self._finalizer()

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(
                f"this LevelDbReader of {self._path!r} is closed; open a new reader to read "
                "the database again"
            )

    def __enter__(self) -> LevelDbReader:
        self._check_open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"<LevelDbReader {self._path!r}: closed>"
        return f"<LevelDbReader {self._path!r}: {len(self._index.keys)} records>"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickling sends the path: the receiving process opens its own reader.
        self._check_open()
        return (LevelDbReader, (self._path,))

    def _after_fork(self) -> None:
        self._files.after_fork()

    # -- lookups -------------------------------------------------------------------------

    def __len__(self) -> int:
        """The number of records.

        Raises:
            StateError: the reader is closed.
        """
        self._check_open()
        return len(self._index.keys)

    def keys(self) -> Sequence[bytes]:
        """All keys in byte order (Caffe's cursor order), packed.

        Raises:
            StateError: the reader is closed.
        """
        self._check_open()
        return self._index.keys

    def __iter__(self) -> Iterator[bytes]:
        """Iterate over :meth:`keys`."""
        return iter(self.keys())

    def _position(self, key: bytes) -> int | None:
        if not isinstance(key, bytes):
            raise TypeError(f"keys are bytes, got {type(key).__name__}: {key!r}")
        try:
            return self._index.keys.index(key)
        except ValueError:
            return None

    def __contains__(self, key: object) -> bool:
        self._check_open()
        return isinstance(key, bytes) and self._position(key) is not None

    def _view(self, i: int) -> memoryview:
        """Record ``i``'s value: a view of this thread's cached block, or of its bytes
        joined from the log.

        Raises:
            DataError: a block no longer matches its checksum, a file shrank or
                cannot be read.
        """
        index = self._index
        b = int(index.block[i])
        start, length = int(index.offset[i]), int(index.length[i])
        try:
            if b < 0:
                file, places = index.segments[-1 - b]
                return memoryview(b"".join(self._files.read(file, o, n) for o, n in places))
            return memoryview(self._block(b))[start : start + length]
        except Damaged as exc:
            raise DataError(f"{exc}; {_FIX_DAMAGED}", path=self._path,
                            key=index.keys[i]) from None  # fmt: skip
        except OSError as exc:
            raise DataError(f"cannot read the database's files: {exc}", path=self._path,
                            key=index.keys[i]) from exc  # fmt: skip

    def _block(self, b: int) -> bytes | memoryview:
        """Data block ``b``'s contents, checked and decoded, from this thread's cache."""
        cache: OrderedDict[int, bytes | memoryview] | None = getattr(self._local, "blocks", None)
        if cache is None:
            cache = self._local.blocks = OrderedDict()
        found = cache.get(b)
        if found is not None:
            cache.move_to_end(b)
            return found
        file, offset, size = self._index.blocks[b]
        raw = self._files.read(file, offset, size + 5)
        name = os.path.basename(self._index.files[file])
        contents = block_contents(raw, f"the data block at offset {offset} of {name}")
        cache[b] = contents
        if len(cache) > _CACHED_BLOCKS:
            cache.popitem(last=False)
        return contents

    def _missing(self, key: bytes) -> RecordNotFoundError:
        return RecordNotFoundError(
            "no record under this key; list the keys with keys() (they are bytes, e.g. "
            "b'00000000_path/to/image.jpg')",
            path=self._path,
            key=key,
        )

    def get(self, key: bytes) -> bytes:
        """The value stored under ``key``, as ``bytes``.

        Raises:
            RecordNotFoundError: no record has this key (a ``KeyError`` and a
                ``DataError``).
            TypeError: ``key`` is not ``bytes``.
            StateError: the reader is closed.
            DataError: the database cannot be read.
        """
        self._check_open()
        i = self._position(key)
        if i is None:
            raise self._missing(key)
        return bytes(self._view(i))

    def read(self, key: bytes, fn: Callable[[memoryview], T]) -> T:
        """Call ``fn`` with a view of the value under ``key``; return its result.

        Raises:
            RecordNotFoundError: no record has this key.
            TypeError: ``key`` is not ``bytes``.
            StateError: the reader is closed.
            DataError: the database cannot be read.
            Exception: whatever ``fn`` raises.
        """
        self._check_open()
        i = self._position(key)
        if i is None:
            raise self._missing(key)
        return fn(self._view(i))

    def values_at(self, indices: npt.NDArray[np.int64]) -> list[bytes | None]:
        """The values of the records at positions ``indices`` of :meth:`keys` (None
        where one cannot be read: reading it by key names why); for the batch path,
        which knows positions and need not look keys up.

        Raises:
            StateError: the reader is closed.
        """
        self._check_open()
        out: list[bytes | None] = []
        for i in np.asarray(indices, np.int64).tolist():
            try:
                out.append(bytes(self._view(i)))
            except DataError:
                out.append(None)
        return out

    def transaction(self) -> LevelDbTransaction:
        """A ``with`` block that reads views (as :meth:`LmdbReader.transaction`)."""
        return LevelDbTransaction(self)

    # -- iteration -----------------------------------------------------------------------

    def _iterate(self) -> Iterator[tuple[bytes, memoryview]]:
        keys = self._index.keys
        for i in range(len(keys)):
            self._check_open()
            yield keys[i], self._view(i)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Iterate over ``(key, value)`` in key order, both ``bytes``.

        Raises:
            StateError: the reader is closed (now, or while iterating).
            DataError: the database cannot be read.
        """
        self._check_open()
        return ((k, bytes(v)) for k, v in self._iterate())

    def values(self) -> Iterator[bytes]:
        """Iterate over the values in key order, as ``bytes``.

        Raises:
            StateError: the reader is closed (now, or while iterating).
            DataError: the database cannot be read.
        """
        self._check_open()
        return (bytes(v) for _, v in self._iterate())

    def datums(self) -> Iterator[tuple[bytes, ParsedDatum]]:
        """Iterate over ``(key, ParsedDatum)`` in key order.

        Raises:
            StateError: the reader is closed (now, or while iterating).
            DataError: the database cannot be read, or a record is not a valid
                Datum (the error names its key).
        """
        self._check_open()
        return ((k, parse_datum(bytes(v), key=k, path=self._path)) for k, v in self._iterate())

    def blobprotos(self) -> Iterator[tuple[bytes, BlobProto]]:
        """Iterate over ``(key, caffe.BlobProto message)`` in key order.

        Raises:
            StateError: the reader is closed (now, or while iterating).
            DataError: the database cannot be read, or a record is not a valid
                BlobProto (the error names its key).
        """
        self._check_open()
        for key, value in self._iterate():
            try:
                proto = decode_blobproto(bytes(value))
            except ProtoError as exc:
                raise DataError(str(exc), path=self._path, key=key) from exc
            yield key, proto


class LevelDbTransaction:
    """Reads from a :class:`LevelDbReader` inside a ``with`` block: ``get`` returns a
    view of the value (valid while the caller keeps it: views keep their block)."""

    __slots__ = ("_active", "_reader")

    def __init__(self, reader: LevelDbReader) -> None:
        self._reader = reader
        self._active = False

    def __enter__(self) -> LevelDbTransaction:
        self._reader._check_open()
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._active = False

    def _check(self) -> LevelDbReader:
        if not self._active:
            raise StateError(
                "this transaction block has ended (or was never entered); read inside "
                "`with reader.transaction() as txn:`"
            )
        self._reader._check_open()
        return self._reader

    def get(self, key: bytes) -> memoryview:
        """A view of the value under ``key``.

        Raises:
            RecordNotFoundError: no record has this key.
            TypeError: ``key`` is not ``bytes``.
            StateError: the block has ended or the reader is closed.
            DataError: the database cannot be read.
        """
        reader = self._check()
        return reader.read(key, _same)

    def __contains__(self, key: object) -> bool:
        return key in self._check()

    def items(self) -> Iterator[tuple[bytes, memoryview]]:
        """Iterate over ``(key, view)`` in key order.

        Raises:
            StateError: the block has ended or the reader is closed.
        """
        return self._check()._iterate()


def _same(view: memoryview) -> memoryview:
    return view


# -- opening ---------------------------------------------------------------------------------


def _open(path: str) -> _Index:
    """Read the live state of the database at ``path`` (see the module docstring),
    again when a writer replaced a file meanwhile.

    Raises:
        DatabaseNotFoundError, DataError: see :class:`LevelDbReader`.
    """
    if not os.path.isdir(path):
        raise DatabaseNotFoundError(
            "no such directory; check the path (Caffe's data_param.source names the "
            "directory convert_imageset created)",
            path=path,
        )
    for attempt in range(_OPEN_TRIES):
        index = _Index()
        try:
            _read_state(path, index)
            return index
        except FileNotFoundError as exc:
            for fd in index.held.values():
                os.close(fd)
            if attempt + 1 == _OPEN_TRIES:
                raise DataError(
                    f"a file the database lists is missing ({exc.filename}): a LevelDB "
                    "writer is changing the directory, or a copy of it left files out; "
                    "read a complete copy that no program writes",
                    path=path,
                ) from None
        except BaseException:
            for fd in index.held.values():
                os.close(fd)
            raise
    raise AssertionError("unreachable")


def _read_file(path: str, held: dict[int, int] | None = None, file: int = -1) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        chunks = []
        done = 0
        while done < size:
            chunk = os.pread(fd, min(size - done, 1 << 26), done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
        data = b"".join(chunks)
    except BaseException:
        os.close(fd)
        raise
    if held is None or len(held) >= _OPEN_FILES:
        os.close(fd)  # opened again by path when read (a database may have many files)
    else:
        held[file] = fd
    return data


def _damaged(path: str, name: str, what: str, exc: Damaged) -> DataError:
    if isinstance(exc, Truncated):
        return DataError(
            f"the LevelDB {what} {name} is cut short: {exc}; the database was copied while "
            "a program still wrote it, or its writer was killed mid-write (LevelDB would "
            "drop the unfinished write and the records in it): copy it again once the "
            "writer has finished, or rebuild it",
            path=path,
        )
    return DataError(f"the LevelDB {what} {name} is damaged: {exc}; {_FIX_DAMAGED}", path=path)


def _read_state(path: str, index: _Index) -> None:
    try:
        with open(os.path.join(path, "CURRENT"), "rb") as f:
            current = f.read(256)
    except FileNotFoundError:
        raise DatabaseNotFoundError(
            "the directory holds no CURRENT file, so it is not a LevelDB database",
            path=path,
        ) from None
    name = current.decode("ascii", "replace").rstrip("\n")
    if not current.endswith(b"\n") or not _MANIFEST.fullmatch(name):
        raise DataError(
            f"the LevelDB CURRENT file does not name a MANIFEST (it holds {current[:64]!r}); "
            f"{_FIX_DAMAGED}",
            path=path,
        )
    try:
        manifest = manifest_of(_read_file(os.path.join(path, name)))
    except Damaged as exc:
        raise _damaged(path, name, "MANIFEST", exc) from None
    if manifest.comparator not in (None, BYTEWISE):
        raise DataError(
            f"the database orders its keys with comparator {manifest.comparator!r}; "
            f"blobpipe reads {BYTEWISE.decode()} databases (Caffe's)",
            path=path,
        )
    sources: list[tuple[list[bytes], list[int], list[bool], list[int]]] = []
    for number in sorted(manifest.files):
        sources.append(_read_table(path, number, manifest.files[number][1], index))
    logs = []
    for entry in os.listdir(path):
        m = _LOG.fullmatch(entry)
        if m is not None:
            n = int(m[1])
            if n >= manifest.log_number or n == manifest.prev_log_number:
                logs.append((n, entry))
    for _, entry in sorted(logs):
        sources.append(_read_log(path, entry, index))
    _merge(sources, index)


def _read_table(
    path: str, number: int, size: int, index: _Index
) -> tuple[list[bytes], list[int], list[bool], list[int]]:
    """One table's entries: user keys, sequences, puts, and each one's record slot
    (its place appended to ``index``'s location lists)."""
    for suffix in (".ldb", ".sst"):
        name = f"{number:06d}{suffix}"
        if os.path.exists(os.path.join(path, name)):
            break
    else:
        raise FileNotFoundError(2, "missing table", os.path.join(path, f"{number:06d}.ldb"))
    file = len(index.files)
    index.files.append(os.path.join(path, name))
    try:
        data = _read_file(index.files[file], index.held, file)
        if len(data) < size:
            raise Truncated(f"it holds {len(data)} bytes, the MANIFEST says {size}")
        data = data[:size]
        index.table_bytes += size
        io, isize = table_index(data[-TABLE_FOOTER:], size)
        handles = data_block_handles(
            block_contents(data[io : io + isize + 5], "the index block"), io
        )
        keys: list[bytes] = []
        seqs: list[int] = []
        puts: list[bool] = []
        slots: list[int] = []
        last = None
        for offset, bsize in handles:
            b = len(index.blocks)
            index.blocks.append((file, offset, bsize))
            where = f"the data block at offset {offset}"
            contents = block_contents(data[offset : offset + bsize + 5], where)
            for key, start, length in block_entries(contents):
                user, seq, put = internal_key(key)
                if last is not None and (user, -seq) <= last:
                    raise Damaged(f"{where} holds keys out of order ({user!r})")
                last = (user, -seq)
                keys.append(user)
                seqs.append(seq)
                puts.append(put)
                slots.append(len(index.block_list))
                index.block_list.append(b)
                index.offset_list.append(start)
                index.length_list.append(length)
    except Damaged as exc:
        raise _damaged(path, name, "table", exc) from None
    return keys, seqs, puts, slots


def _read_log(
    path: str, name: str, index: _Index
) -> tuple[list[bytes], list[int], list[bool], list[int]]:
    """One write-ahead log's entries, as :func:`_read_table`'s."""
    file = len(index.files)
    index.files.append(os.path.join(path, name))
    keys: list[bytes] = []
    seqs: list[int] = []
    puts: list[bool] = []
    slots: list[int] = []
    try:
        data = _read_file(index.files[file], index.held, file)
        index.log_bytes += len(data)
        record: LogRecord
        for record in log_records(data):
            for entry in write_batch(record.data):
                keys.append(entry.key)
                seqs.append(entry.sequence)
                puts.append(entry.put)
                slots.append(len(index.block_list))
                index.block_list.append(-1 - len(index.segments))
                index.offset_list.append(0)
                index.length_list.append(entry.value_length)
                index.segments.append((file, record.place(entry.value_start, entry.value_length)))
    except Damaged as exc:
        raise _damaged(path, name, "write-ahead log", exc) from None
    return keys, seqs, puts, slots


def _merge(
    sources: list[tuple[list[bytes], list[int], list[bool], list[int]]], index: _Index
) -> None:
    """The live records of every source's entries: per user key the entry of the
    highest sequence, kept when it is a put; in byte order of the keys."""
    keys = [k for s in sources for k in s[0]]
    seqs = [q for s in sources for q in s[1]]
    puts = [p for s in sources for p in s[2]]
    slots = [i for s in sources for i in s[3]]
    n = len(keys)
    ordered = all(keys[i] < keys[i + 1] for i in range(n - 1))
    order = range(n) if ordered else sorted(range(n), key=lambda i: (keys[i], -seqs[i]))
    live: list[int] = []
    previous = None
    for i in order:
        key = keys[i]
        if key == previous:
            continue  # an older entry of a key already decided
        previous = key
        if puts[i]:
            live.append(i)
    index.keys = PackedKeys.of([keys[i] for i in live])
    at = np.fromiter((slots[i] for i in live), np.int64, len(live))
    index.block = np.asarray(index.block_list, np.int64)[at]
    index.offset = np.asarray(index.offset_list, np.int64)[at]
    index.length = np.asarray(index.length_list, np.int64)[at]
    index.block_list, index.offset_list, index.length_list = [], [], []


def _reset_after_fork() -> None:
    for reader in list(_READERS):
        reader._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
