"""Reading Caffe's LMDB databases: read-only, shared per process, thread- and fork-safe.

Opening
    :class:`LmdbReader` opens a database the way a reader of a finished dataset
    should: ``readonly=True``, ``lock=False`` (no lock file is created or needed, so
    read-only directories and media work), ``create=False``, and no readahead unless
    asked (a loader reads records in shuffled order). A directory must hold
    ``data.mdb``; a plain file is opened as an LMDB data file (``subdir=False``).

One environment per process
    LMDB, and py-lmdb after it, refuse to open the same environment twice in one
    process. All readers of the same files (identified, as py-lmdb does, by the
    device and inode of the data file, so symlinks and re-created databases are
    handled) share one ``lmdb.Environment`` through a refcounted registry. The last
    reader to close closes it, after which anyone may open the path again. The
    environment's flags (``readahead``) are those of its first reader.

Fork
    A child of ``fork()`` must not use its parent's environments. An
    ``os.register_at_fork`` hook closes them in the child and empties the registry;
    each reader sees the change (a generation counter) and reopens its database on
    first use. Nothing needs to be done by the caller.

Threads and zero-copy reads
    Each thread reading through a reader keeps one read-only transaction (py-lmdb,
    ``buffers=True``) for the reader's life, so a read costs one ``mdb_get``. Values
    are ``memoryview`` objects pointing into the memory map, valid only inside the
    call or the ``with`` block that produced them:

    * ``reader.read(key, fn)`` calls ``fn(view)`` and returns its result;
    * ``with reader.transaction() as txn: txn.get(key)`` gives views until the block
      ends (the loader's path: decode each view straight into the batch, one copy).

    :meth:`LmdbReader.get`, :meth:`~LmdbReader.items` and friends return ``bytes``.

Closing
    :meth:`LmdbReader.close` is idempotent; any use afterwards raises
    :class:`~blobpipe.StateError`. Called while a transaction block, a ``read`` or an
    iterator is still running (in any thread), it takes effect when the last of them
    ends, so a view is never left pointing at unmapped memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Final, TypeVar

import lmdb
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
from ._datum import ParsedDatum, parse_datum
from ._lmdbfile import (
    Damaged,
    Extents,
    NamedDatabases,
    Tree,
    Unsupported,
    current_txnid,
    extents_of,
    picked_meta,
    read_tree,
)

__all__ = ["LmdbReader", "ReadTransaction"]

T = TypeVar("T")

# With lock=False LMDB keeps no reader table, so this bounds nothing at run time; it
# is only what LMDB would allocate if the flag were ever dropped.
_MAX_READERS: Final = 1024
_MAX_PAGE: Final = 1 << 16  # LMDB's largest page size
_LMDB_MAGIC: Final = 0xBEEFC0DE

_FileId = tuple[int, int]


class _SharedEnv:
    """One open environment and the number of readers using it."""

    __slots__ = (
        "data_file",
        "entries",
        "env",
        "file_id",
        "generation",
        "map",
        "mapped",
        "path",
        "refs",
        "tree",
    )

    def __init__(
        self,
        env: Any,
        file_id: _FileId,
        path: str,
        generation: int,
        entries: int,
        data_file: str,
        mapped: tuple[mmap.mmap, Tree | None] | None,
    ) -> None:
        self.env = env
        self.file_id = file_id
        self.path = path
        self.generation = generation
        self.entries = entries
        self.data_file = data_file
        self.map = mapped[0] if mapped is not None else None
        self.mapped = np.frombuffer(self.map, np.uint8) if self.map is not None else None
        self.tree = mapped[1] if mapped is not None else None
        self.refs = 0

    def unmap(self) -> None:
        """Release our map of the file and its descriptor now, unless arrays made from
        it still live (then when the last of them goes)."""
        self.mapped, self.tree, mapped, self.map = None, None, self.map, None
        if mapped is not None:
            with contextlib.suppress(BufferError):
                mapped.close()


def _map_file(path: str, file_id: _FileId) -> mmap.mmap | None:
    """The data file mapped read-only (our own mapping of the pages LMDB maps); None
    when it cannot be, or when ``path`` is no longer the file ``file_id``."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino) != file_id:
                return None
            # Default advice (not MADV_RANDOM, even without readahead): the kernel's
            # fault-around then maps several cached pages per page fault.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError, OverflowError):
        return None


def _check_tree(
    path: str, data_file: str, file_id: _FileId
) -> tuple[mmap.mmap, Tree | None] | None:
    """Map the data file and check its B-tree before LMDB walks it (LMDB trusts its pages:
    a damaged one can abort the process or kill it with SIGBUS). Returns the map and the
    tree; None when the file cannot be mapped (LMDB then reads it unchecked).

    Raises:
        DataError: the tree is damaged, or holds something other than plain records.
    """
    mapped = _map_file(data_file, file_id)
    if mapped is None:
        return None
    message: str | None
    try:
        tree = read_tree(np.frombuffer(mapped, np.uint8))
    except (Damaged, Unsupported, NamedDatabases) as exc:
        message = _refusal(exc)
    except MemoryError:
        message = None
    else:
        return mapped, tree
    with contextlib.suppress(BufferError):  # an array of it still lives: closed when it goes
        mapped.close()
    if message is None:
        return None
    raise DataError(message, path=path)


def _refusal(exc: Exception) -> str:
    """What is wrong with a file :func:`~._lmdbfile.read_tree` refused, and what to do."""
    if isinstance(exc, NamedDatabases):
        names = ", ".join(repr(n) for n in exc.args)
        return (
            f"the database holds named sub-databases ({names}), not records: Caffe's "
            "LMDBs keep their Datums in the main database, which is all blobpipe reads; "
            "write the records there (convert_imageset, blobpipe.write_lmdb)"
        )
    if isinstance(exc, Unsupported):
        return (
            f"not a database blobpipe reads: {exc}; Caffe's LMDBs hold one Datum per key "
            "in a plain main database (convert_imageset, blobpipe.write_lmdb)"
        )
    return (
        f"the database is damaged: {exc}; LMDB would read garbage or crash on it, so it "
        "is not opened; copy it again from a good source or rebuild it"
    )


# Invariant: _registry holds exactly the environments opened in this process (this
# generation) with refs > 0, and _generation changes in a fork child. Both the lock
# and the dict are replaced in the child, so a lock held by a parent thread at fork
# time cannot deadlock the child; read them as module globals, never cache them.
_registry_lock = threading.Lock()
_registry: dict[_FileId, _SharedEnv] = {}
_generation = 0


def _after_fork_in_child() -> None:
    global _registry_lock, _registry, _generation
    _registry_lock = threading.Lock()
    inherited, _registry = _registry, {}
    _generation += 1
    for shared in inherited.values():
        with contextlib.suppress(lmdb.Error):
            shared.env.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _locate(path: str) -> tuple[bool, _FileId, str]:
    """(subdir, identity of the data file, its path) of the database at ``path``."""
    if os.path.isdir(path):
        subdir, data_file = True, os.path.join(path, "data.mdb")
    elif os.path.exists(path):
        subdir, data_file = False, path
    else:
        raise DatabaseNotFoundError(
            "no such file or directory; check the path (Caffe's data_param.source names "
            "the directory that holds data.mdb)",
            path=path,
        )
    try:
        st = os.stat(data_file)
    except FileNotFoundError:
        raise DatabaseNotFoundError(
            "the directory holds no data.mdb, so it is not an LMDB database; give the "
            "directory that convert_imageset created",
            path=path,
        ) from None
    except OSError as exc:
        raise DataError(f"cannot read the database: {exc}", path=path) from exc
    if not stat.S_ISREG(st.st_mode):
        raise DataError(
            f"{data_file!r} is not a regular file; an LMDB's data.mdb is one", path=path
        )
    _check_size(data_file, st.st_size, path)
    return subdir, (st.st_dev, st.st_ino), data_file


def _check_size(data_file: str, size: int, path: str) -> None:
    """Refuse a data file shorter than its meta page says it is (a truncated copy):
    LMDB would map it and die of SIGBUS on the first page past its end. A file
    whose meta pages this cannot read is left to LMDB, which names the problem."""
    try:
        with open(data_file, "rb") as f:
            head = f.read(2 * _MAX_PAGE)
    except OSError as exc:
        raise DataError(f"cannot read the database: {exc}", path=path) from exc
    if len(head) < 160:
        raise DatabaseNotFoundError(
            f"not an LMDB database ({data_file!r} holds {size} bytes, fewer than an LMDB's "
            "meta page: an empty or cut-off copy?); give the directory that "
            "convert_imageset created, or rebuild the database",
            path=path,
        )
    psize = int.from_bytes(head[40:44], "little")  # mm_dbs[FREE_DBI].md_pad
    if psize < 512 or psize > _MAX_PAGE or psize & (psize - 1) or len(head) < psize + 160:
        return
    metas = []
    for m in (0, psize):
        if int.from_bytes(head[m + 16 : m + 20], "little") != _LMDB_MAGIC:
            return
        last_page = int.from_bytes(head[m + 136 : m + 144], "little")  # mm_last_pg
        metas.append((int.from_bytes(head[m + 144 : m + 152], "little"), last_page))
    last_page = metas[picked_meta(metas[0][0], metas[1][0])][1]
    need = (last_page + 1) * psize
    if size < need:
        raise DataError(
            f"{data_file!r} is cut short: its meta page says the database fills {need} "
            f"bytes ({last_page + 1} pages of {psize}) but the file holds {size}; copy it "
            "again or rebuild it",
            path=path,
        )


def _acquire_locked(path: str, readahead: bool) -> _SharedEnv:
    """Return the shared environment for ``path`` with one more reference.

    The caller holds ``_registry_lock``.
    """
    subdir, file_id, data_file = _locate(path)
    shared = _registry.get(file_id)
    if shared is None:
        mapped = _check_tree(path, data_file, file_id)
        try:
            env = lmdb.open(
                path,
                subdir=subdir,
                readonly=True,
                lock=False,
                create=False,
                readahead=readahead,
                max_readers=_MAX_READERS,
                max_dbs=0,
            )
        except (lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.CorruptedError) as exc:
            _unmap(mapped)
            raise DatabaseNotFoundError(
                f"not an LMDB database ({exc}); give the directory that convert_imageset "
                f"created, or rebuild the database",
                path=path,
            ) from exc
        except lmdb.Error as exc:
            _unmap(mapped)
            if "already open" in str(exc):
                raise DataError(
                    "the database is already open in this process outside blobpipe "
                    "(LMDB allows one open per process); close that lmdb.Environment or "
                    "read through LmdbReader only",
                    path=path,
                ) from exc
            raise DataError(f"cannot open the database: {exc}", path=path) from exc
        try:
            entries = int(env.stat()["entries"])
        except lmdb.Error as exc:
            env.close()
            _unmap(mapped)
            raise DataError(f"cannot read the database: {exc}", path=path) from exc
        shared = _SharedEnv(env, file_id, path, _generation, entries, data_file, mapped)
        _registry[file_id] = shared
    shared.refs += 1
    return shared


def _unmap(mapped: tuple[mmap.mmap, Tree | None] | None) -> None:
    if mapped is not None:
        mapped[0].close()


def _acquire(path: str, readahead: bool) -> _SharedEnv:
    with _registry_lock:
        return _acquire_locked(path, readahead)


def _release(shared: _SharedEnv) -> None:
    with _registry_lock:
        if shared.generation != _generation:
            return  # the parent's: the fork hook closed it already
        shared.refs -= 1
        if shared.refs:
            return
        del _registry[shared.file_id]
        # Closed under the lock, so nobody can reopen the files before they are closed.
        shared.env.close()
        # Batches drops its record index before its reader: our map and its
        # descriptor go now, with LMDB's
        shared.unmap()


_OPEN: Final = "open"
_CLOSING: Final = "closing"  # close() called; waits for the last transaction/iterator
_CLOSED: Final = "closed"

_ITEMS: Final = 0
_VALUES: Final = 1
_DATUMS: Final = 2
_BLOBPROTOS: Final = 3


class LmdbReader:
    """A Caffe LMDB database opened read-only (see the module docstring).

    Keys are ``bytes`` and come in byte order, which is the order Caffe's cursor
    visits them (``convert_imageset`` writes ``%08d_<path>`` keys, so list order).

    Args:
        path: the database directory (holding ``data.mdb``) or an LMDB data file.
        readahead: let the OS read ahead in the memory map; good for sequential scans
            of databases larger than RAM, bad for shuffled reads (default False).

    Raises:
        DatabaseNotFoundError: ``path`` does not exist or is not an LMDB database.
        DataError: the database exists but cannot be opened.
    """

    def __init__(self, path: str | os.PathLike[str], *, readahead: bool = False) -> None:
        self._path = os.fsdecode(os.fspath(path))
        self._readahead = bool(readahead)
        self._lock = threading.Lock()
        self._keys_lock = threading.Lock()
        self._state: str = _OPEN
        self._users = 0
        self._keys: tuple[bytes, ...] | None = None
        self._local = threading.local()
        shared = _acquire(self._path, self._readahead)
        self._shared = shared
        self._generation = shared.generation
        self._finalizer = weakref.finalize(self, _release, shared)

    # -- state ---------------------------------------------------------------------------

    @property
    def path(self) -> str:
        """The path the reader was opened with."""
        return self._path

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._state is not _OPEN

    def _closed_error(self) -> StateError:
        return StateError(
            f"this LmdbReader of {self._path!r} is closed; open a new LmdbReader to read "
            f"the database again"
        )

    def _after_fork(self, *, reopen: bool = True) -> None:
        """Adopt the child's registry after a fork: reopen, or just forget the parent's."""
        with _registry_lock:
            if self._generation == _generation:
                return
            self._finalizer.detach()
            self._lock = threading.Lock()
            self._keys_lock = threading.Lock()
            self._local = threading.local()
            self._users = 0
            if self._state is _OPEN and reopen:
                try:
                    shared = _acquire_locked(self._path, self._readahead)
                except DataError:
                    self._state = _CLOSED
                    self._generation = _generation
                    raise
                self._shared = shared
                self._finalizer = weakref.finalize(self, _release, shared)
            else:
                self._state = _CLOSED
            self._generation = _generation

    def _check_open(self) -> None:
        if self._generation != _generation:
            self._after_fork()
        if self._state is not _OPEN:
            raise self._closed_error()

    def _enter(self) -> Any:
        """Count one more user and return this thread's read transaction."""
        if self._generation != _generation:
            self._after_fork()
        with self._lock:
            if self._state is not _OPEN:
                raise self._closed_error()
            self._users += 1
        try:
            return self._local.txn
        except AttributeError:
            pass
        try:
            txn = self._shared.env.begin(buffers=True)
        except lmdb.Error as exc:
            self._exit(self._generation)
            raise DataError(f"cannot start a read transaction: {exc}", path=self._path) from exc
        self._local.txn = txn
        return txn

    def _exit(self, generation: int) -> None:
        """Count one user less; finish a deferred close when it was the last."""
        if generation != _generation:
            return  # entered in the parent before a fork: the child starts from zero
        with self._lock:
            self._users -= 1
            if self._users or self._state is not _CLOSING:
                return
            self._state = _CLOSED
        self._local = threading.local()
        self._finalizer()

    def close(self) -> None:
        """Release the database; the environment closes with its last reader.

        Idempotent. If transactions, ``read`` calls or iterators of this reader are
        still running, the release happens when the last one ends; new uses raise
        :class:`~blobpipe.StateError` at once.
        """
        if self._generation != _generation:
            self._after_fork(reopen=False)
            return
        with self._lock:
            if self._state is not _OPEN:
                return
            if self._users:
                self._state = _CLOSING
                return
            self._state = _CLOSED
        self._local = threading.local()
        self._finalizer()

    def __enter__(self) -> LmdbReader:
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
        if self._state is _OPEN:
            return f"<LmdbReader {self._path!r}: {self._shared.entries} records>"
        return f"<LmdbReader {self._path!r}: closed>"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickling sends the path: the receiving process opens its own reader.
        self._check_open()
        return (_open_reader, (self._path, self._readahead))

    # -- lookups -------------------------------------------------------------------------

    def __len__(self) -> int:
        """The number of records.

        Raises:
            StateError: the reader is closed.
        """
        self._check_open()
        return self._shared.entries

    def keys(self) -> Sequence[bytes]:
        """All keys in byte order (Caffe's cursor order), read once and cached.

        Raises:
            StateError: the reader is closed.
            DataError: the database cannot be read.
        """
        keys = self._keys
        if keys is not None:
            self._check_open()
            return keys
        with self._keys_lock:
            tree = self._shared.tree
            if self._keys is None and tree is not None:
                self._check_open()
                self._keys = tree.keys  # read with the tree at open: the same snapshot
            if self._keys is None:
                self._enter()
                generation = self._generation
                try:
                    with self._shared.env.begin() as txn, txn.cursor() as cursor:
                        self._keys = tuple(cursor.iternext(keys=True, values=False))
                except lmdb.Error as exc:
                    raise DataError(f"cannot list the keys: {exc}", path=self._path) from exc
                finally:
                    self._exit(generation)
            return self._keys

    def _mapped_file(self) -> npt.NDArray[np.uint8] | None:
        """The data file mapped read-only by numpy (mapped and its tree checked when
        the environment was opened), shared by the readers of the environment; None
        when it cannot be mapped (e.g. larger than a 32-bit address space). The
        database must not be written while it is read (as for LMDB's own map with
        ``lock=False``).

        Raises:
            StateError: the reader is closed.
        """
        self._check_open()
        return self._shared.mapped

    def _extents(self, keys: Sequence[bytes]) -> tuple[npt.NDArray[np.uint8], Extents] | None:
        """The mapped file and each value's place in it, in the order of ``keys`` (all
        keys, as :meth:`keys` lists them); None when the file is not mapped or its
        tree, read at open, does not hold exactly ``keys``.

        Raises:
            StateError: the reader is closed.
        """
        self._check_open()
        shared = self._shared
        file, tree = shared.mapped, shared.tree
        if file is None or tree is None:
            return None
        extents = extents_of(tree, keys)
        return None if extents is None else (file, extents)

    def __iter__(self) -> Iterator[bytes]:
        """Iterate over :meth:`keys`."""
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes):
            return False
        txn = self._enter()
        generation = self._generation
        try:
            return bool(key) and txn.get(key) is not None
        except lmdb.BadValsizeError:
            return False
        finally:
            self._exit(generation)

    def _missing(self, key: bytes) -> RecordNotFoundError:
        listed = self._keys
        if listed is not None and key in listed:  # (an error path: a scan is fine)
            return RecordNotFoundError(self._unreadable(), path=self._path, key=key)
        return RecordNotFoundError(
            "no record under this key; list the keys with keys() (they are bytes, e.g. "
            "b'00000000_path/to/image.jpg')",
            path=self._path,
            key=key,
        )

    def _unreadable(self) -> str:
        """Why a record that :meth:`keys` lists cannot be found by its key."""
        shared = self._shared
        file, tree = shared.mapped, shared.tree
        if file is None or tree is None:
            return (
                "the record is listed but cannot be read now: the database was changed "
                "(the record deleted) since it was opened, or its B-tree is damaged; do "
                "not write a database while it is read, or rebuild it"
            )
        now = current_txnid(file)
        if now != tree.txnid:
            return (
                f"the record is listed but cannot be read now: the database was changed "
                f"since it was opened (transaction {tree.txnid}, now {now}), the record "
                "deleted or moved; do not write a database while it is read, or open it "
                "again to read the new data"
            )
        return (
            "the record is listed but LMDB's lookup by key cannot find it, and the "
            "database has not changed since it was opened: its B-tree is damaged; copy it "
            "again from a good source or rebuild it"
        )

    def _get_view(self, txn: Any, key: bytes) -> memoryview:
        try:
            value = txn.get(key)
        except lmdb.BadValsizeError:
            value = None  # empty or longer than LMDB's key limit: cannot be stored
        except lmdb.Error as exc:
            raise DataError(f"cannot read the record: {exc}", path=self._path, key=key) from exc
        if value is None:
            raise self._missing(key)
        return value  # type: ignore[no-any-return]

    def get(self, key: bytes) -> bytes:
        """The value stored under ``key``, copied into ``bytes``.

        Raises:
            RecordNotFoundError: no record has this key (a ``KeyError`` and a
                ``DataError``).
            TypeError: ``key`` is not ``bytes``.
            StateError: the reader is closed.
            DataError: the database cannot be read.
        """
        txn = self._enter()
        generation = self._generation
        try:
            return bytes(self._get_view(txn, key))
        finally:
            self._exit(generation)

    def read(self, key: bytes, fn: Callable[[memoryview], T]) -> T:
        """Call ``fn`` with a zero-copy view of the value under ``key``; return its result.

        The view points into the memory map and is valid only while ``fn`` runs.

        Raises:
            RecordNotFoundError: no record has this key.
            TypeError: ``key`` is not ``bytes``.
            StateError: the reader is closed.
            DataError: the database cannot be read.
            Exception: whatever ``fn`` raises.
        """
        txn = self._enter()
        generation = self._generation
        try:
            return fn(self._get_view(txn, key))
        finally:
            self._exit(generation)

    def transaction(self) -> ReadTransaction:
        """A ``with`` block that reads zero-copy views (see :class:`ReadTransaction`).

        Raises:
            StateError: the reader is closed (when the block is entered).
        """
        return ReadTransaction(self)

    # -- iteration -----------------------------------------------------------------------

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Iterate over ``(key, value)`` in key order, both copied into ``bytes``.

        Raises:
            StateError: the reader is closed (now, or while iterating).
            DataError: the database cannot be read.
        """
        self._check_open()
        return self._iterate(_ITEMS)  # type: ignore[return-value]

    def values(self) -> Iterator[bytes]:
        """Iterate over the values in key order, copied into ``bytes``.

        Raises:
            StateError: the reader is closed (now, or while iterating).
            DataError: the database cannot be read.
        """
        self._check_open()
        return self._iterate(_VALUES)  # type: ignore[return-value]

    def datums(self) -> Iterator[tuple[bytes, ParsedDatum]]:
        """Iterate over ``(key, ParsedDatum)`` in key order.

        Each record is copied out of the map first, so the parsed views stay valid.

        Raises:
            StateError: the reader is closed (now, or while iterating).
            DataError: the database cannot be read, or a record is not a valid
                Datum (the error names its key).
        """
        self._check_open()
        return self._iterate(_DATUMS)  # type: ignore[return-value]

    def blobprotos(self) -> Iterator[tuple[bytes, BlobProto]]:
        """Iterate over ``(key, caffe.BlobProto message)`` in key order.

        Raises:
            StateError: the reader is closed (now, or while iterating).
            DataError: the database cannot be read, or a record is not a valid
                BlobProto (the error names its key).
        """
        self._check_open()
        return self._iterate(_BLOBPROTOS)  # type: ignore[return-value]

    def _iterate(self, what: int) -> Iterator[object]:
        # A private transaction: the iterator may be advanced from any thread.
        self._enter()
        generation = self._generation
        txn = None
        try:
            try:
                txn = self._shared.env.begin(buffers=True)
                cursor = txn.cursor()
            except lmdb.Error as exc:
                raise DataError(f"cannot iterate: {exc}", path=self._path) from exc
            for k, v in cursor:
                if generation != _generation:
                    raise StateError(
                        "this iterator was started before a fork; start a new one in this process"
                    )
                if self._state is not _OPEN:
                    raise self._closed_error()
                key = bytes(k)
                if what == _ITEMS:
                    yield key, bytes(v)
                elif what == _VALUES:
                    yield bytes(v)
                elif what == _DATUMS:
                    yield key, parse_datum(bytes(v), key=key, path=self._path)
                else:
                    try:
                        proto = decode_blobproto(bytes(v))
                    except ProtoError as exc:
                        raise DataError(str(exc), path=self._path, key=key) from exc
                    yield key, proto
        finally:
            if txn is not None and generation == _generation:
                txn.abort()
            self._exit(generation)


def _open_reader(path: str, readahead: bool) -> LmdbReader:
    return LmdbReader(path, readahead=readahead)


class ReadTransaction:
    """Zero-copy reads from an :class:`LmdbReader`, valid until the ``with`` block ends::

        with reader.transaction() as txn:
            for i, key in enumerate(batch_keys):
                label = decode_datum_into(txn.get(key), batch[i], key=key, path=reader.path)

    The views returned point into the database's memory map; do not keep them (or
    arrays made from them) past the block. A transaction belongs to the thread that
    entered it; blocks may nest.
    """

    __slots__ = ("_active", "_generation", "_owner", "_reader", "_txn")

    def __init__(self, reader: LmdbReader) -> None:
        self._reader = reader
        self._txn: Any = None
        self._generation = -1
        self._owner = 0
        self._active = False

    def __enter__(self) -> ReadTransaction:
        if self._active:
            raise StateError("this transaction block is already entered; start another one")
        self._txn = self._reader._enter()
        self._generation = self._reader._generation
        self._owner = threading.get_ident()
        self._active = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._active:
            self._active = False
            self._txn = None
            self._reader._exit(self._generation)

    def _check(self) -> Any:
        if not self._active:
            raise StateError(
                "this transaction block has ended (or was never entered); read inside "
                "`with reader.transaction() as txn:`"
            )
        if self._owner != threading.get_ident():
            raise StateError(
                "a transaction belongs to the thread that entered it; start one per thread"
            )
        if self._generation != _generation:
            raise StateError(
                "this transaction block was entered before a fork; start a new one in this process"
            )
        return self._txn

    def fast_get(self) -> Callable[[bytes], memoryview | None]:
        """The bare lookup of this block for hot loops: ``key -> view or None``.

        No per-call checks: the returned function must only be called by this
        thread inside this block; it returns None for a missing key and may
        raise ``lmdb.Error``. Use :meth:`get` elsewhere.

        Raises:
            StateError: the block has ended, or this is another thread.
        """
        return self._check().get  # type: ignore[no-any-return]

    def get(self, key: bytes) -> memoryview:
        """A view of the value under ``key``, valid until the block ends.

        Raises:
            RecordNotFoundError: no record has this key.
            TypeError: ``key`` is not ``bytes``.
            StateError: the block has ended, or this is another thread.
            DataError: the database cannot be read.
        """
        return self._reader._get_view(self._check(), key)

    def __contains__(self, key: object) -> bool:
        txn = self._check()
        if not isinstance(key, bytes) or not key:
            return False
        try:
            return txn.get(key) is not None
        except lmdb.BadValsizeError:
            return False

    def items(self) -> Iterator[tuple[bytes, memoryview]]:
        """Iterate over ``(key, view)`` in key order; views valid until the block ends.

        Raises:
            StateError: the block has ended, or this is another thread.
        """
        txn = self._check()
        return self._items(txn)

    def _items(self, txn: Any) -> Iterator[tuple[bytes, memoryview]]:
        with txn.cursor() as cursor:
            for k, v in cursor:
                if not self._active:
                    raise StateError("this transaction block has ended")
                yield bytes(k), v
