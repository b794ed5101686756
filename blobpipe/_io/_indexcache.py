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
    size, modification time and change time (which no one can set back: a file
    rewritten in place with its modification time restored still shows), and the
    picked meta page's page size, transaction, root page and entry count, all
    compared at open. Any commit changes the transaction (and the file's times), so
    the index is rebuilt after it. The file ends with a footer holding a CRC-32 of
    everything before it; an index whose length, magic, footer or checksum is wrong
    is not used (and is rebuilt), and its extents must lie inside the data file. It
    is built only by the checked walk (``_lmdbfile.read_tree``): a damaged database
    is refused as without an index.

Where it lives
    ``index="cache"`` (the default): ``$BLOBPIPE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/blobpipe``, else ``~/.cache/blobpipe``, one file per data file
    (named by a hash of its real path). ``index="beside"``: ``<data file>.blobpipe-index``,
    next to the database. ``index=None``: none (every open walks the tree).

What it opens
    The names in the cache directory are predictable, so whoever can write to it
    could put there a FIFO (an open for reading would wait for a writer forever), a
    link (the lock's ``O_CREAT`` would create the file it points to), or a forged
    index. So the cache directory is used only when no one but this user and root
    can change it (:func:`private_folder`: owned by this user, not writable by group
    or others, and every directory above it owned by this user or root and not
    writable by group or others unless sticky, as ``/tmp``), made with mode 0700 where it is
    missing; otherwise a warning says what is unsafe and how to fix it, and every
    open walks. In either place, an index and its lock are opened only as regular
    files (``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``; in the cache directory also
    owned by this user and not writable by others), never a link, FIFO, socket,
    device or directory. An index refused so is rebuilt and replaced (the rename
    replaces whatever held its name); a lock refused so leaves the index unwritten,
    with a warning naming it. Beside the database, the index is trusted as far as
    the database itself: whoever can write the one can write the other.

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
import stat
import struct
import tempfile
import warnings
import zlib
from collections.abc import Iterator
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from ._keys import PackedKeys
from ._lmdbfile import Advise, Meta, Tree, meta_of, read_tree

__all__ = [
    "IndexPlace",
    "Snapshot",
    "cache_dir",
    "index_path",
    "load",
    "private_folder",
    "store",
    "tree_of",
]

IndexPlace = Literal["cache", "beside"] | None

_MAGIC = b"BPINDEX1"
_END = b"BPINDEND"
_VERSION = 2
_HEADER = struct.Struct("<8sII13Q")  # magic, version, header size, 13 fields
# An index or lock file is opened with these: never through a link, never waiting
# (a FIFO's open for reading waits for a writer without O_NONBLOCK).
_NO_FOLLOW_NO_WAIT = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# Mode bits that let group or others write.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_FOOTER = struct.Struct("<II8s")  # crc32, 0, end magic


class Snapshot(NamedTuple):
    """What an index must match to be trusted: the data file's identity and its
    picked meta page."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    psize: int
    txnid: int
    root: int
    entries: int


def snapshot_of(st: os.stat_result, meta: Meta) -> Snapshot:
    """The snapshot of a data file of status ``st`` whose picked meta page is ``meta``."""
    mtime = st.st_mtime_ns % (1 << 64)
    ctime = st.st_ctime_ns % (1 << 64)
    return Snapshot(
        st.st_dev, st.st_ino, st.st_size, mtime, ctime, meta.psize, meta.txnid, meta.root,
        meta.entries,
    )  # fmt: skip


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


def load(path: str, snap: Snapshot, *, private: bool = False) -> Tree | None:
    """The tree stored at ``path`` when it is whole and of snapshot ``snap``, its arrays
    views of a read-only map of the file; else None (also where ``path`` is not a
    regular file, or with ``private`` not this user's own, see :func:`_open_regular`)."""
    try:
        fd = _open_regular(path, os.O_RDONLY, private)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER.size + _FOOTER.size:
            return None
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)  # the map keeps its own reference to the file
    try:
        tree = _read(mapped, size, snap)
    except (ValueError, struct.error):
        tree = None
    if tree is None:
        with contextlib.suppress(BufferError):
            mapped.close()
    return tree


class _NotRegular(OSError):
    """A name in the index's folder that is not a regular file of the kind expected
    (the message says what it is instead)."""


def _open_regular(path: str, flags: int, private: bool) -> int:
    """A descriptor of the regular file ``path`` opened with ``flags`` (``O_CREAT``
    among them: made, mode 0600, where missing), never following a link nor waiting on
    a FIFO, and checked with ``fstat`` once open: a regular file and, with
    ``private``, owned by this user and not writable by group or others.

    Raises:
        _NotRegular: ``path`` is something else (a link, FIFO, socket, device,
            directory), or another user's or others may write it.
        OSError: it cannot be opened (missing, no permission).
    """
    with contextlib.suppress(FileNotFoundError):
        # refused before the open where possible: opening a device may act on it
        _check_regular(path, os.lstat(path), private)
    fd = os.open(path, flags | _NO_FOLLOW_NO_WAIT, 0o600)
    try:
        _check_regular(path, os.fstat(fd), private)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular(path: str, st: os.stat_result, private: bool) -> None:
    """Raises _NotRegular where ``st`` is not of a file :func:`_open_regular` opens."""
    if not stat.S_ISREG(st.st_mode):
        raise _NotRegular(f"{path!r} is not a regular file ({_kind(st.st_mode)})")
    if private and st.st_uid != os.geteuid():
        raise _NotRegular(f"{path!r} is owned by uid {st.st_uid}, not by this user")
    if private and st.st_mode & _OTHERS_WRITE:
        raise _NotRegular(
            f"{path!r} is writable by {_writers(st.st_mode)} (mode {stat.filemode(st.st_mode)})"
        )


def _writers(mode: int) -> str:
    """Who besides the owner may write a file of ``mode``: "group", "others" or both."""
    return " and ".join(
        who for bit, who in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if mode & bit
    )


def _kind(mode: int) -> str:
    """What a file of ``mode`` is, in words."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return f"mode {stat.filemode(mode)}"


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """Warn (RuntimeWarning) of ``message`` the first time this process meets it."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def private_folder(folder: str) -> str | None:
    """The real path of ``folder`` (made, mode 0700, where missing) when no one but this
    user and root can change what it holds: a directory owned by this user, not
    writable by group or others, under directories each owned by this user or root
    and not writable by group or others unless sticky (as ``/tmp``: there no one can
    rename or remove what is not theirs). None where it cannot be made or is not a
    directory (the open then walks, as where the cache is unwritable); None with a
    warning (once a process) that says what is unsafe and what to do otherwise."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        real = os.path.realpath(folder)
        st = os.lstat(real)
    except (OSError, ValueError):
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    uid = os.geteuid()
    problem = ""
    if st.st_uid != uid:
        problem = (
            f"{real!r} is owned by uid {st.st_uid}, not by this user (uid {uid}); use a "
            "directory of your own"
        )
    elif st.st_mode & _OTHERS_WRITE:
        problem = (
            f"{real!r} is writable by {_writers(st.st_mode)} (mode "
            f"{stat.filemode(st.st_mode)}); make it private: chmod go-w {real!r}"
        )
    else:
        above = os.path.dirname(real)
        while not problem:
            try:
                up = os.lstat(above)
            except OSError:
                return None
            if up.st_uid not in (0, uid):
                problem = (
                    f"the directory above it, {above!r}, is owned by uid {up.st_uid}, not "
                    f"by this user (uid {uid}) or root, who alone may own the directories "
                    "above a cache directory"
                )
            elif up.st_mode & _OTHERS_WRITE and not up.st_mode & stat.S_ISVTX:
                problem = (
                    f"the directory above it, {above!r}, is writable by "
                    f"{_writers(up.st_mode)} and not sticky (mode {stat.filemode(up.st_mode)}): "
                    f"they could rename the cache directory away and put theirs there; "
                    f"chmod go-w {above!r}"
                )
            parent = os.path.dirname(above)
            if parent == above:
                break
            above = parent
    if problem:
        _warn_once(
            f"blobpipe does not use the LMDB index cache directory {real!r}: {problem}, or "
            "set BLOBPIPE_CACHE_DIR to a directory only you can write. Until then every "
            "open walks the database's B-tree instead of reading its saved index."
        )
        return None
    return real


def _read(mapped: mmap.mmap, size: int, snap: Snapshot) -> Tree | None:
    magic, version, header, *fields = _HEADER.unpack_from(mapped, 0)
    if magic != _MAGIC or version != _VERSION or header != _HEADER.size:
        return None
    n, ends_size, keys_len, *stored = fields[:3] + fields[3:12]
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
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW_NO_WAIT)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _locked(path: str, private: bool = False) -> Iterator[bool]:
    """Hold an exclusive POSIX lock (``lockf``) on ``<path>.lock`` (waiting for another
    process that holds it); yields False where the lock file cannot be opened as a
    regular file (see :func:`_open_regular`), with a warning where something else has
    its name: nothing is then stored (without the lock another process may be writing).
    ``path``'s folder exists."""
    lock = path + ".lock"
    try:
        fd = _open_regular(lock, os.O_RDWR | os.O_CREAT, private)
    except _NotRegular as exc:
        _warn_once(
            f"blobpipe does not write the LMDB index {path!r}: its lock {exc}; remove it "
            "(until then every open of that database walks its B-tree)"
        )
        yield False
        return
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
    private = place == "cache"
    if private:
        folder = private_folder(os.path.dirname(path))
        if folder is None:
            return read_tree(file, advise)
        path = os.path.join(folder, os.path.basename(path))
    snap = snapshot_of(st, meta)
    tree = load(path, snap, private=private)
    if tree is not None:
        return tree
    with _locked(path, private) as locked:
        if locked:
            # another process built it while this one waited
            tree = load(path, snap, private=private)
            if tree is not None:
                return tree
        tree = read_tree(file, advise)
        if tree is None or not locked or not store(path, tree, snap):
            return tree
    stored = load(path, snap, private=private)  # the same tree, now from the file's map
    return tree if stored is None else stored
