"""Reading Caffe's LMDB databases: read-only, shared per process, thread- and fork-safe.

Opening, one environment per process, fork
    The environments themselves (opened read-only without a lock, one per data file
    per process, reopened after ``fork()``, the file checked before LMDB maps it)
    are ``_lmdbenv.py``'s; a reader holds a reference to one.

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
import functools
import mmap
import os
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
    ArgumentError,
    DataError,
    ProtoError,
    RecordNotFoundError,
    StateError,
)
from . import _lmdbenv as envs
from ._indexcache import IndexPlace
from ._lmdbfile import Extents, current_txnid, extents_of
from ._readahead import (
    AHEAD_GROUP_BYTES,
    AHEAD_JOIN_GAP,
    Advisor,
    advice_cap,
    advise_pieces,
    evict_file,
    missing,
    pieces,
    uncached,
)
from ._wire import ParsedDatum, parse_datum

__all__ = ["LmdbReader", "ReadTransaction"]

T = TypeVar("T")


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
        index: where the persistent index of the database lives: "cache" (default:
            ``$BLOBPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/blobpipe``, else
            ``~/.cache/blobpipe``), "beside" (``data.mdb.blobpipe-index`` next to the
            data file) or None (no index: every open walks the B-tree). The index is
            written at the first open and used by later opens of the same snapshot
            of the file (rebuilt after any write), so they need not read every
            branch and leaf page; where it cannot be written, the open walks.

    Raises:
        DatabaseNotFoundError: ``path`` does not exist or is not an LMDB database.
        DataError: the database exists but cannot be opened.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readahead: bool = False,
        index: IndexPlace = "cache",
    ) -> None:
        self._path = os.fsdecode(os.fspath(path))
        self._readahead = bool(readahead)
        if index not in ("cache", "beside", None):
            raise ArgumentError(f"index must be 'cache', 'beside' or None, got {index!r}")
        self._index: IndexPlace = index
        self._lock = threading.Lock()
        self._keys_lock = threading.Lock()
        self._state: str = _OPEN
        self._users = 0
        self._keys: Sequence[bytes] | None = None
        self._local = threading.local()
        self._cap: int | None = None  # the bytes one WILLNEED call reads (_advice_cap)
        self._advisors: weakref.WeakSet[Advisor] = weakref.WeakSet()
        shared = envs.acquire(self._path, self._readahead, index)
        self._shared = shared
        self._generation = shared.generation
        self._finalizer = weakref.finalize(self, envs.release, shared)

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
        with envs.REGISTRY.lock:
            if self._generation == envs.REGISTRY.generation:
                return
            self._finalizer.detach()
            self._lock = threading.Lock()
            self._keys_lock = threading.Lock()
            self._local = threading.local()
            self._users = 0
            if self._state is _OPEN and reopen:
                try:
                    shared = envs.acquire_locked(self._path, self._readahead, self._index)
                except DataError:
                    self._state = _CLOSED
                    self._generation = envs.REGISTRY.generation
                    raise
                self._shared = shared
                self._finalizer = weakref.finalize(self, envs.release, shared)
            else:
                self._state = _CLOSED
            self._generation = envs.REGISTRY.generation

    def _check_open(self) -> None:
        if self._generation != envs.REGISTRY.generation:
            self._after_fork()
        if self._state is not _OPEN:
            raise self._closed_error()

    def check_file(self) -> None:
        """Refuse to read on when the data file is now shorter than when it was
        opened (truncated, or copied over in place by ``cp``): its pages past the new
        end would kill the process with SIGBUS when touched. Every read checks it
        first; one ``fstat``.

        Raises:
            StateError: the reader is closed.
            DataError: the file shrank; names the database.
        """
        self._check_open()
        shrunk = self._shared.shrunk()
        if shrunk is not None:
            then, now = shrunk
            raise DataError(
                f"the database changed while it was being read: its data file holds "
                f"{now} bytes, {then} when it was opened (truncated, or copied over in "
                "place); do not write or copy over a database while a Loader or reader "
                "reads it (copy to a new directory and open that instead)",
                path=self._path,
            )

    def _enter(self) -> Any:
        """Count one more user and return this thread's read transaction.

        Raises:
            StateError: the reader is closed.
            DataError: the data file shrank since it was opened (:meth:`check_file`).
        """
        self.check_file()
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
        if generation != envs.REGISTRY.generation:
            return  # entered in the parent before a fork: the child starts from zero
        with self._lock:
            self._users -= 1
            if self._users or self._state is not _CLOSING:
                return
            self._state = _CLOSED
        self._release()

    def _release(self) -> None:
        """Let go of the environment (its last reader closes it) with nothing of ours
        left over its maps: the keys are views of the index file's map, so the map
        and its descriptor close now, not when this reader is collected."""
        self._local = threading.local()
        self._keys = None
        for made in list(self._advisors):
            made.close()
        self._finalizer()

    def close(self) -> None:
        """Release the database; the environment closes with its last reader.

        Idempotent. If transactions, ``read`` calls or iterators of this reader are
        still running, the release happens when the last one ends; new uses raise
        :class:`~blobpipe.StateError` at once.
        """
        if self._generation != envs.REGISTRY.generation:
            self._after_fork(reopen=False)
            return
        with self._lock:
            if self._state is not _OPEN:
                return
            if self._users:
                self._state = _CLOSING
                return
            self._state = _CLOSED
        self._release()

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
        return (_open_reader, (self._path, self._readahead, self._index))

    # -- lookups -------------------------------------------------------------------------

    def __len__(self) -> int:
        """The number of records.

        Raises:
            StateError: the reader is closed.
        """
        self._check_open()
        return self._shared.entries

    def keys(self) -> Sequence[bytes]:
        """All keys in byte order (Caffe's cursor order), read once and cached: a
        sequence of ``bytes`` kept packed (one buffer; lookups by binary search).

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

    def mapped_extents(self, keys: Sequence[bytes]) -> tuple[npt.NDArray[np.uint8], Extents] | None:
        """For the record index (``_index.py``): the mapped file and each value's
        place in it, in the order of ``keys`` (all keys, as :meth:`keys` lists them);
        None when the file is not mapped or its tree, read at open, does not hold
        exactly ``keys``.

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

    def will_need(
        self,
        indices: npt.NDArray[np.int64],
        max_bytes: int,
        *,
        now: int = 0,
        advisor: Advisor | None = None,
    ) -> tuple[int, int]:
        """Ask the OS to start reading the values of records ``indices`` (positions in
        :meth:`keys`), in that order, while their sizes add up to at most ``max_bytes``
        (at least one); returns how many records and bytes were requested. The reads
        run in the background (``WILLNEED``), so later reads of these records find them
        in memory. With an ``advisor`` (:meth:`advisor`), only the first ``now`` records
        are requested before this returns and the rest by the advisor's thread, in
        about the order given (sorted by place within 16 MiB stretches, nearby values
        joined into one request; values smaller than 64 KiB on average all sorted
        together: they join into long runs anyway); without one, all before it
        returns. Requests are cut to what one call of the OS reads on this device, and
        only those with a page not cached go out (``mincore``): a warm epoch costs a
        few lookups per call, and no thread.
        Nothing is requested where the file is not mapped.

        Raises:
            StateError: the reader is closed.
        """
        self._check_open()
        shared = self._shared
        tree, mapped = shared.tree, shared.map
        if tree is None or mapped is None or not len(indices):
            return 0, 0
        idx = np.asarray(indices, np.int64)
        starts = tree.offsets[idx]
        sizes = tree.lengths[idx].astype(np.int64)
        total = np.cumsum(sizes)
        count = max(1, int(np.searchsorted(total, max_bytes, side="right")))
        own = shared.mapped
        if own is not None and not missing(own, starts[:count], sizes[:count]).any():
            # a warm epoch (the sample of the records, or each of a few, is cached):
            # nothing to request, and no ranges to sort and join (a file's epoch: a
            # millisecond per 20,000 records) nor the device's limit read
            return count, int(total[count - 1])
        stops = starts + sizes
        cap = self._advice_cap()
        first = count if advisor is None else min(max(0, now), count)
        if first:
            at, length = pieces(starts[:first], stops[:first], gap=AHEAD_JOIN_GAP, cap=cap)
            advise_pieces(mapped, *uncached(own, at, length))
        if first < count and advisor is not None:
            # in about the order given: sorted by place within stretches of 16 MiB; small
            # values (less than the join gap on average) lie so close that their ranges
            # join: sorted all together instead, one sweep rather than one per stretch
            before = int(total[first - 1]) if first else 0
            group = (total[first:count] - sizes[first:count] - before) // AHEAD_GROUP_BYTES
            if int(total[count - 1]) - before < (count - first) * AHEAD_JOIN_GAP:
                group[:] = 0
            at, length = pieces(
                starts[first:count], stops[first:count], group=group, gap=AHEAD_JOIN_GAP, cap=cap
            )
            advisor.request(*uncached(own, at, length))
        return count, int(total[count - 1])

    def _advice_cap(self) -> int:
        cap = self._cap
        if cap is None:
            cap = self._cap = advice_cap(self._shared.file_id[0])
        return cap

    def advisor(self) -> Advisor | None:
        """A new :class:`~._readahead.Advisor` of this database's data file, for
        :meth:`will_need`: its thread requests values in the background (with a
        descriptor of its own, opened only while the path still names the file this
        reader opened) and ends when it has nothing left to request. Closed with the
        reader. None where the file is not mapped.

        Raises:
            StateError: the reader is closed.
        """
        self._check_open()
        shared = self._shared
        if shared.map is None:
            return None
        opener = functools.partial(envs.open_same, shared.data_file, shared.file_id)
        made = Advisor(opener, len(shared.map))
        self._advisors.add(made)
        return made

    def evict(self) -> None:
        """Drop the database's pages from memory: from this process's map of the data
        file (``madvise(MADV_DONTNEED)``), then from the OS page cache
        (``posix_fadvise(POSIX_FADV_DONTNEED)``, which keeps pages other processes
        map). Later reads come from the disk: for measuring cold reads, and for
        handing memory back after a pass over a database larger than RAM. What is
        read stays correct (the pages are read again).

        Raises:
            StateError: the reader is closed.
        """
        self._check_open()
        shared = self._shared
        drop = getattr(mmap, "MADV_DONTNEED", None)
        if shared.map is not None and drop is not None:
            with contextlib.suppress(OSError, ValueError):
                shared.map.madvise(drop)
        evict_file(shared.data_file)

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
                if generation != envs.REGISTRY.generation:
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
            if txn is not None and generation == envs.REGISTRY.generation:
                txn.abort()
            self._exit(generation)


def _open_reader(path: str, readahead: bool, index: IndexPlace = "cache") -> LmdbReader:
    return LmdbReader(path, readahead=readahead, index=index)


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
        if self._generation != envs.REGISTRY.generation:
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
