"""The LMDB environments readers share: opened read-only, one per data file per process,
checked before LMDB maps them, reopened after ``fork()``.

Opening
    A database is opened the way a reader of a finished dataset should:
    ``readonly=True``, ``lock=False`` (no lock file is created or needed, so read-only
    directories and media work), ``create=False``, and no readahead unless asked (a
    loader reads records in shuffled order). A directory must hold ``data.mdb``; a plain
    file is opened as an LMDB data file (``subdir=False``). Before LMDB maps it, the file
    must be a regular file at least as long as its meta page says, and its B-tree is
    walked and checked (``_lmdbfile.read_tree``): a damaged file is a clean error, never
    a crash inside LMDB. The walk's offsets and key list are kept with the environment.

One environment per process
    LMDB, and py-lmdb after it, refuse to open the same environment twice in one
    process. All readers of the same files (identified, as py-lmdb does, by the
    device and inode of the data file, so symlinks and re-created databases are
    handled) share one ``lmdb.Environment`` through a refcounted registry. The last
    reader to close closes it, after which anyone may open the path again. The
    environment's flags (``readahead``) are those of its first reader.

Fork
    A child of ``fork()`` keeps its parent's environments, read-only and lock-free,
    but none of its parent's transactions. It must never close them: a parent thread
    may have been inside LMDB at the fork, and py-lmdb's close waits for that thread,
    which does not exist in the child; nor can the child open the same file again
    (py-lmdb allows one open per process, and the inherited one stays open). So an
    ``os.register_at_fork`` hook replaces the registry's lock and gives each
    inherited environment a new entry (``inherited``: no references, never closed);
    each reader sees the change (the registry's generation), drops its parent's
    transactions and takes a reference to the child's entry on first use.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
from typing import Any, Final

import lmdb
import numpy as np

from .._errors import DatabaseNotFoundError, DataError
from ._indexcache import IndexPlace, tree_of
from ._lmdbfile import Damaged, NamedDatabases, Tree, Unsupported, picked_meta
from ._readahead import random_access, will_need

__all__ = ["REGISTRY", "SharedEnv", "acquire", "acquire_locked", "open_same", "release"]

# With lock=False LMDB keeps no reader table, so this bounds nothing at run time; it
# is only what LMDB would allocate if the flag were ever dropped.
_MAX_READERS: Final = 1024
_MAX_PAGE: Final = 1 << 16  # LMDB's largest page size
_LMDB_MAGIC: Final = 0xBEEFC0DE

_FileId = tuple[int, int]


class SharedEnv:
    """One open environment and the number of readers using it."""

    __slots__ = (
        "data_file",
        "entries",
        "env",
        "fd",
        "file_id",
        "generation",
        "inherited",
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
        self.inherited = False
        # the data file, open while it is mapped: shrunk()'s fstat without the GIL
        # released (None: mmap.size(), which releases it)
        self.fd = (
            open_same(data_file, file_id)
            if self.map is not None and _file_size is not None
            else None
        )

    def adopted(self, generation: int) -> SharedEnv:
        """The entry a fork child keeps for this environment: the same files and map,
        no references, never closed (see the module docstring)."""
        child = SharedEnv(
            self.env, self.file_id, self.path, generation, self.entries, self.data_file, None
        )
        child.map, child.mapped, child.tree = self.map, self.mapped, self.tree
        child.fd = self.fd  # inherited across the fork, as the map
        child.inherited = True
        return child

    def shrunk(self) -> tuple[int, int] | None:
        """``(mapped, now)`` when the data file is now shorter than the map made at
        open (truncated or copied over in place): a page past its new end would
        raise SIGBUS when touched. None while the file is whole (one ``fstat``), or
        when it is not mapped by us."""
        mapped, fd = self.map, self.fd
        if mapped is None:
            return None
        try:
            # fstat of the mapped file: its current length (once a batch: without
            # releasing the GIL where the compiled module is built)
            now = mapped.size() if fd is None or _file_size is None else _file_size(fd)
            length = len(mapped)
        except (OSError, ValueError):
            return None
        return (length, now) if now < length else None

    def unmap(self) -> None:
        """Release our map of the file and its descriptor now, unless arrays made from
        it still live (then when the last of them goes)."""
        self.mapped, self.tree, mapped, self.map = None, None, self.map, None
        fd, self.fd = self.fd, None
        if fd is not None and not self.inherited:
            with contextlib.suppress(OSError):
                os.close(fd)
        if mapped is not None:
            with contextlib.suppress(BufferError):
                mapped.close()


def open_same(path: str, file_id: _FileId) -> int | None:
    """A descriptor of ``path`` when it is still the file ``file_id`` (device, inode),
    else None: never blocks (a FIFO put in its place is opened non-blocking, then
    refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        st = None
    if st is None or (st.st_dev, st.st_ino) != file_id:
        os.close(fd)
        return None
    return fd


def _compiled_file_size() -> Any:
    try:
        from . import _rowkernel as module  # type: ignore[attr-defined]
    except ImportError:  # not built: mmap.size()
        return None
    return module.file_size


_file_size = _compiled_file_size()


def _map_file(path: str, file_id: _FileId) -> tuple[mmap.mmap, os.stat_result] | None:
    """The data file mapped read-only (our own mapping of the pages LMDB maps), and its
    status when mapped; None when it cannot be, or when ``path`` is no longer the file
    ``file_id``."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino) != file_id:
                return None
            # Default advice (not MADV_RANDOM, even without readahead): the kernel's
            # fault-around then maps several cached pages per page fault.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), st
    except (OSError, ValueError, OverflowError):
        return None


def _check_tree(
    path: str, data_file: str, file_id: _FileId, index: IndexPlace = "cache"
) -> tuple[mmap.mmap, Tree | None] | None:
    """Map the data file and check its B-tree before LMDB walks it (LMDB trusts its pages:
    a damaged one can abort the process or kill it with SIGBUS). Returns the map and the
    tree; None when the file cannot be mapped (LMDB then reads it unchecked).

    Raises:
        DataError: the tree is damaged, or holds something other than plain records.
    """
    found = _map_file(data_file, file_id)
    if found is None:
        return None
    mapped, st = found
    message: str | None
    try:
        # from the persistent index of this snapshot, else walked with readahead hints
        with random_access(mapped):
            tree = tree_of(np.frombuffer(mapped, np.uint8), st, data_file, index, will_need(mapped))
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


class _Registry:
    """The environments open in this process, by data file.

    Invariant: ``envs`` holds exactly the environments opened in this process (this
    ``generation``) with refs > 0, plus those inherited from a fork parent (any refs),
    and ``generation`` changes in a fork child. Both the
    lock and the dict are replaced in the child, so a lock held by a parent thread at
    fork time cannot deadlock the child: read them through ``REGISTRY`` each time,
    never keep them.
    """

    def __init__(self) -> None:
        # Reentrant: the garbage collector may finalize a reader (whose finalizer
        # releases its environment) in a thread that holds the lock, at any
        # allocation inside an open. A release there never touches the entry being
        # opened: that one is either not yet in ``envs`` or already referenced.
        self.lock = threading.RLock()
        self.envs: dict[_FileId, SharedEnv] = {}
        self.generation = 0


REGISTRY = _Registry()


def _after_fork_in_child() -> None:
    """In a fork child: a new lock (a parent thread may have held the old one) and a
    new generation whose entries adopt the parent's environments. Takes no lock and
    calls nothing in LMDB: the parent's other threads may hold either."""
    REGISTRY.lock = threading.RLock()
    REGISTRY.generation += 1
    REGISTRY.envs = {
        file_id: shared.adopted(REGISTRY.generation) for file_id, shared in REGISTRY.envs.items()
    }


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


def acquire_locked(path: str, readahead: bool, index: IndexPlace = "cache") -> SharedEnv:
    """Return the shared environment for ``path`` with one more reference.

    The caller holds ``REGISTRY.lock``.
    """
    subdir, file_id, data_file = _locate(path)
    shared = REGISTRY.envs.get(file_id)
    if shared is None:
        mapped = _check_tree(path, data_file, file_id, index)
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
        shared = SharedEnv(env, file_id, path, REGISTRY.generation, entries, data_file, mapped)
        REGISTRY.envs[file_id] = shared
    shared.refs += 1
    return shared


def _unmap(mapped: tuple[mmap.mmap, Tree | None] | None) -> None:
    if mapped is not None:
        mapped[0].close()


def acquire(path: str, readahead: bool, index: IndexPlace = "cache") -> SharedEnv:
    """The shared environment for ``path``, with one more reference (opened if needed).

    Raises:
        DatabaseNotFoundError: no database at ``path``.
        DataError: the file is cut short, damaged, not a plain database of records, or
            already opened in this process outside blobpipe.
    """
    with REGISTRY.lock:
        return acquire_locked(path, readahead, index)


def release(shared: SharedEnv) -> None:
    """Drop one reference; the last closes the environment and unmaps the file."""
    with REGISTRY.lock:
        if shared.generation != REGISTRY.generation:
            return  # the parent's: the fork hook closed it already
        shared.refs -= 1
        if shared.refs or shared.inherited:
            return  # an inherited environment stays open for the child's life
        del REGISTRY.envs[shared.file_id]
        # Closed under the lock, so nobody can reopen the files before they are closed.
        shared.env.close()
        # Batches drops its record index before its reader: our map and its
        # descriptor go now, with LMDB's
        shared.unmap()
