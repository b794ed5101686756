"""The persistent index of an LMDB data file: its checked tree, kept on disk so the
next open of the same snapshot reads it instead of walking every branch and leaf page.

What it holds
    Per record, in key order: the value's file offset (int64) and length (uint32);
    the keys joined, with where each ends. The arrays are used straight from a
    read-only map of the index file, so an open through the index takes no anonymous
    memory per record. Record kinds are not in it: the record index (``_index.py``)
    learns them as batches read the records.

When it is trusted
    Only for the exact snapshot it was built from: the data file's device, inode,
    size and modification time, and the picked meta page's page size, transaction,
    root page and entry count, all compared at open. Any commit changes the
    transaction (and the file's time), so the index is rebuilt after it. The file
    ends with a footer holding a CRC-32 of everything before it; an index whose
    length, magic, footer or checksum is wrong is not used (and is rebuilt), and
    its extents must lie inside the data file. It is built only by the checked walk
    (``_lmdbfile.read_tree``): a damaged database is refused as without an index.

Where it lives
    ``index="cache"`` (the default): ``$BLOBPIPE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/blobpipe``, else ``~/.cache/blobpipe``, one file per data file
    (named by a hash of its real path). ``index="beside"``: ``<data file>.blobpipe-index``,
    next to the database. ``index=None``: none (every open walks the tree).

Writing, and many processes
    Written to a temporary file in the same directory, flushed with ``fsync`` and
    renamed into place, so a reader sees a whole index or none (a process killed
    mid-write leaves a temporary file, never a trusted partial index). Processes
    opening one database at once (the ranks of a job) take an exclusive POSIX lock
    (``lockf``) on ``<index>.lock`` before building: one walks and writes, the others wait and
    then read what it wrote. Where the cache cannot be written the open still
    works, walking the tree each time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from ._keys import PackedKeys
from ._lmdbfile import Advise, Meta, Tree, meta_of, read_tree

__all__ = ["IndexPlace", "Snapshot", "cache_dir", "index_path", "load", "store", "tree_of"]

IndexPlace = Literal["cache", "beside"] | None

_MAGIC = b"BPINDEX1"
_END = b"BPINDEND"
_VERSION = 1
_HEADER = struct.Struct("<8sII12Q")  # magic, version, header size, 12 fields
_FOOTER = struct.Struct("<II8s")  # crc32, 0, end magic


class Snapshot(NamedTuple):
    """What an index must match to be trusted: the data file's identity and its
    picked meta page."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    psize: int
    txnid: int
    root: int
    entries: int


def snapshot_of(st: os.stat_result, meta: Meta) -> Snapshot:
    """The snapshot of a data file of status ``st`` whose picked meta page is ``meta``."""
    mtime = st.st_mtime_ns % (1 << 64)
    return Snapshot(
        st.st_dev, st.st_ino, st.st_size, mtime, meta.psize, meta.txnid, meta.root, meta.entries
    )


def cache_dir() -> str:
    """The user cache directory of blobpipe's indexes: ``$BLOBPIPE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/blobpipe``, else ``~/.cache/blobpipe``."""
    own = os.environ.get("BLOBPIPE_CACHE_DIR")
    if own:
        return own
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "blobpipe")


def index_path(data_file: str, place: IndexPlace) -> str | None:
    """Where the index of ``data_file`` lives for ``place`` (None: no index)."""
    if place is None:
        return None
    if place == "beside":
        return data_file + ".blobpipe-index"
    real = os.path.realpath(data_file)
    name = hashlib.sha256(os.fsencode(real)).hexdigest()[:32]
    return os.path.join(cache_dir(), f"{name}.index")


def _layout(n: int, ends_size: int, keys_len: int) -> tuple[int, int, int, int, int]:
    """Offsets of the arrays (offsets, lengths, ends, keys) and of the footer."""

    def up(x: int) -> int:
        return (x + 7) & ~7

    at_off = up(_HEADER.size)
    at_len = at_off + 8 * n
    at_ends = up(at_len + 4 * n)
    at_keys = up(at_ends + ends_size * n)
    footer = up(at_keys + keys_len)
    return at_off, at_len, at_ends, at_keys, footer


def load(path: str, snap: Snapshot) -> Tree | None:
    """The tree stored at ``path`` when it is whole and of snapshot ``snap``, its arrays
    views of a read-only map of the file; else None."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER.size + _FOOTER.size:
                return None
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    try:
        tree = _read(mapped, size, snap)
    except (ValueError, struct.error):
        tree = None
    if tree is None:
        with contextlib.suppress(BufferError):
            mapped.close()
    return tree


def _read(mapped: mmap.mmap, size: int, snap: Snapshot) -> Tree | None:
    magic, version, header, *fields = _HEADER.unpack_from(mapped, 0)
    if magic != _MAGIC or version != _VERSION or header != _HEADER.size:
        return None
    n, ends_size, keys_len, *stored = fields[:3] + fields[3:11]
    if tuple(stored) != tuple(snap) or n != snap.entries or ends_size not in (4, 8):
        return None
    at_off, at_len, at_ends, at_keys, footer = _layout(n, ends_size, keys_len)
    if footer + _FOOTER.size != size:
        return None
    crc, _zero, end = _FOOTER.unpack_from(mapped, footer)
    if end != _END or crc != zlib.crc32(memoryview(mapped)[:footer]):
        return None
    buf = np.frombuffer(mapped, np.uint8)
    offsets = buf[at_off:at_len].view("<i8")
    lengths = buf[at_len : at_len + 4 * n].view("<u4")
    ends = buf[at_ends : at_ends + ends_size * n].view("<u4" if ends_size == 4 else "<i8")
    keys = buf[at_keys : at_keys + keys_len]
    if n:
        if int(offsets.min()) < 0 or int((offsets + lengths).max()) > snap.size:
            return None  # extents outside the data file: not this file's index
        if int(ends[-1]) != keys_len or bool((np.diff(ends.astype(np.int64)) <= 0).any()):
            return None
    return Tree(offsets, lengths, snap.txnid, PackedKeys(keys, ends), snap.root)


def store(path: str, tree: Tree, snap: Snapshot) -> bool:
    """Write ``tree`` of snapshot ``snap`` to ``path`` atomically (a temporary file,
    fsync, rename); False when it cannot be written (nothing is left at ``path``
    then but what was there)."""
    keys = tree.keys
    ends = np.ascontiguousarray(keys.ends)
    ends_size = 4 if ends.dtype == np.uint32 else 8
    ends = ends.astype("<u4" if ends_size == 4 else "<i8", copy=False)
    key_bytes = keys.joined
    n = len(ends)
    at_off, at_len, at_ends, at_keys, footer = _layout(n, ends_size, len(key_bytes))
    header = _HEADER.pack(_MAGIC, _VERSION, _HEADER.size, n, ends_size, len(key_bytes), *snap, 0)
    parts: list[tuple[int, memoryview | bytes]] = [
        (0, header),
        (at_off, np.ascontiguousarray(tree.offsets, "<i8").data.cast("B")),
        (at_len, np.ascontiguousarray(tree.lengths, "<u4").data.cast("B")),
        (at_ends, ends.data.cast("B")),
        (at_keys, key_bytes),
    ]
    folder = os.path.dirname(path) or "."
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            crc = 0
            written = 0
            for at, data in parts:
                if at > written:
                    pad = b"\0" * (at - written)
                    f.write(pad)
                    crc = zlib.crc32(pad, crc)
                f.write(data)
                crc = zlib.crc32(data, crc)
                written = at + len(data)
            pad = b"\0" * (footer - written)
            f.write(pad)
            crc = zlib.crc32(pad, crc)
            f.write(_FOOTER.pack(crc, 0, _END))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(folder)
        return True
    except OSError:
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _fsync_dir(folder: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[bool]:
    """Hold an exclusive POSIX lock (``lockf``) on ``<path>.lock`` (waiting for another process that
    holds it); yields False where the lock file cannot be made (nothing is then
    stored: without the lock another process may be writing)."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        yield False
        return
    try:
        # A POSIX record lock, not flock: it belongs to the process, so a fork child
        # does not inherit it (with flock, a child forked while a parent thread held
        # the lock would share it through the inherited descriptor, which no thread
        # of the child ever closes, and wait for itself forever). Threads of one
        # process never contend here: they build under the registry's lock.
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # releases the lock


def tree_of(
    file: npt.NDArray[np.uint8], st: os.stat_result, data_file: str, place: IndexPlace,
    advise: Advise | None = None,
) -> Tree | None:  # fmt: skip
    """The checked tree of ``file`` (the data file ``data_file`` of status ``st``,
    mapped): from its index when that is of this snapshot, else walked (with
    ``advise``, see :func:`~._lmdbfile.read_tree`) and stored for the next open.

    Raises:
        Damaged, Unsupported, NamedDatabases: as :func:`~._lmdbfile.read_tree`.
    """
    meta = meta_of(file)
    path = index_path(data_file, place)
    if meta is None or path is None or st.st_size != file.size:
        return read_tree(file, advise)
    snap = snapshot_of(st, meta)
    tree = load(path, snap)
    if tree is not None:
        return tree
    with _locked(path) as locked:
        if locked:
            tree = load(path, snap)  # another process built it while this one waited
            if tree is not None:
                return tree
        tree = read_tree(file, advise)
        if tree is None or not locked or not store(path, tree, snap):
            return tree
    stored = load(path, snap)  # the same tree, now from the file's map
    return tree if stored is None else stored
