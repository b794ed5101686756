"""Where each value of an LMDB database lies in its data file, read from the B-tree pages.

LMDB (0.9, data format version 1, which Caffe's databases use) stores a B+tree
in fixed-size pages: two meta pages, branch pages whose nodes point to child
pages, leaf pages whose nodes hold a key and either the value itself or, for a
value too large for the page (``F_BIGDATA``: every image record), the number of
the first of its consecutive overflow pages, where the value starts right after
the 16-byte page header. :func:`read_tree` walks those pages, vectorised with
numpy over a read-only mapping of the file, and returns each value's file
offset and length, in key order. Only the tree's branch and leaf pages are read
(as listing the keys does); values are not touched.

Everything read is checked, so that the reader can check a file before LMDB
walks it (LMDB trusts its pages: a damaged one can make it abort or die of
SIGBUS): the meta page LMDB picks, page numbers inside the database, each page's
own number and kind level by level, node offsets and key and value sizes inside
the page, values inside the database, keys in strictly increasing order, each
branch key between the keys left and right of it (LMDB's lookup relies on it),
the entry count and the depth. :func:`read_tree`
raises :class:`Damaged` (what, and on which page) for any inconsistency and
:class:`Unsupported` or :class:`NamedDatabases` for a valid layout that is not
a plain database of records. :func:`value_extents` then matches the tree's keys
with the keys LMDB listed. Pages are read through our own mapping of the file,
never LMDB's; overflow pages (the values) are not read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from ._keys import PackedKeys, narrow_ends

__all__ = [
    "Damaged",
    "Extents",
    "Meta",
    "NamedDatabases",
    "Tree",
    "Unsupported",
    "current_txnid",
    "extents_of",
    "meta_of",
    "picked_meta",
    "read_tree",
    "value_extents",
]

_PAGEHDRSZ = 16
_NODESIZE = 8
_P_BRANCH = 0x01
_P_LEAF = 0x02
_P_META = 0x08
_P_LEAF2 = 0x20
_P_INVALID = 2**64 - 1  # the root of an empty database
_F_BIGDATA = 0x01
_F_SUBDATA = 0x02  # the node's value is a named sub-database
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_MAX_DEPTH = 32  # LMDB's cursor stack (CURSOR_STACK)
_MAX_KEY = 511  # LMDB's largest key (MDB_MAXKEYSIZE)
_DUP_FLAGS = 0x04 | 0x10 | 0x20 | 0x40  # MDB_DUPSORT, DUPFIXED, INTEGERDUP, REVERSEDUP
_STEP_NODES = 8192  # leaf nodes per step, about (bounds the per-node arrays' memory)

I64 = npt.NDArray[np.int64]


class Extents(NamedTuple):
    """Per value, in key order: its file offset and its length in bytes; and the
    transaction whose tree they were read from (the meta page's ``mm_txnid``)."""

    offsets: I64
    lengths: npt.NDArray[np.uint32]
    txnid: int


def picked_meta(txnid0: int, txnid1: int) -> int:
    """Which meta page (0 or 1) LMDB reads, given their transaction ids: meta 1 only
    when its transaction is newer, meta 0 on a tie (``mdb_env_pick_meta``)."""
    return 1 if txnid0 < txnid1 else 0


def current_txnid(file: npt.NDArray[np.uint8]) -> int:
    """The transaction a reader starting now would read (the picked meta page's)."""
    psize = _u32(file, 40)
    ids = (_u64(file, 144), _u64(file, psize + 144))
    return ids[picked_meta(*ids)]


class Meta(NamedTuple):
    """What the meta page LMDB picks says of the main database: the page size, the
    transaction, the root page, the entry count and the last page."""

    psize: int
    txnid: int
    root: int
    entries: int
    last_page: int


def meta_of(file: npt.NDArray[np.uint8]) -> Meta | None:
    """The picked meta page of ``file`` (unchecked beyond the magic, version and page
    size: :func:`read_tree` checks the rest); None when it is no LMDB 0.9 data file."""
    if file.size < 1024:
        return None
    psize = _u32(file, 40)
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1) or 2 * psize > file.size:
        return None
    for m in (0, psize):
        if _u32(file, m + 16) != _MAGIC or _u32(file, m + 20) != _DATA_VERSION:
            return None
    ids = (_u64(file, 144), _u64(file, psize + 144))
    m = psize * picked_meta(*ids)
    return Meta(
        psize, ids[m // psize], _u64(file, m + 128), _u64(file, m + 120), _u64(file, m + 136)
    )


class NamedDatabases(Exception):
    """The main database holds named sub-databases, not records (their names are
    the exception's ``args``)."""


class Tree(NamedTuple):
    """The main database's tree as read and checked: per value, in key order, its file
    offset and length; the transaction read (``mm_txnid``); the keys, in order (what
    LMDB's cursor lists: the reader's ``keys()``), packed; the root page read."""

    offsets: I64
    lengths: npt.NDArray[np.uint32]
    txnid: int
    keys: PackedKeys
    root: int


class Damaged(Exception):
    """The file's B-tree is inconsistent; the message says what, and on which page."""


class Unsupported(Exception):
    """A valid LMDB layout that is not a plain database of records (sorted duplicates,
    keys not in byte order); the message says which."""


def _fail(bad: npt.NDArray[np.bool_], pages: I64, what: str) -> None:
    """Raise :class:`Damaged` naming the first page where ``bad`` holds."""
    if bad.any():
        raise Damaged(f"{what} (page {int(pages[int(np.argmax(bad))])})")


def _u16(file: npt.NDArray[np.uint8], at: I64) -> I64:
    return file[at].astype(np.int64) | (file[at + 1].astype(np.int64) << 8)


def _u32(file: npt.NDArray[np.uint8], at: int) -> int:
    return int.from_bytes(file[at : at + 4].tobytes(), "little")


def _u64(file: npt.NDArray[np.uint8], at: int) -> int:
    return int.from_bytes(file[at : at + 8].tobytes(), "little")


def _ragged(starts: I64, counts: I64, step: int) -> tuple[I64, I64]:
    """``starts[i] + step*j`` for ``j < counts[i]``, flattened; and each item's owner ``i``."""
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(starts), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    j = np.arange(total, dtype=np.int64) - first[owner]
    return starts[owner] + step * j, owner


def _key_bytes(file: npt.NDArray[np.uint8], at: I64, size: I64) -> bytes:
    """The keys at ``at`` of sizes ``size`` (at least one byte each), joined: gathered
    as fixed-width rows of the file, then the bytes past each key's size dropped."""
    width = int(size.max())
    last = len(file) - width
    if int(at.max()) <= last:
        windows = np.lib.stride_tricks.as_strided(file, (last + 1, width), (1, 1), writeable=False)
        rows = windows[at]
    else:  # a key within ``width`` bytes of the file's end
        rows = file[np.minimum(at[:, np.newaxis] + np.arange(width), len(file) - 1)]
    return rows[np.arange(width) < size[:, np.newaxis]].tobytes()


def _nodes(
    file: npt.NDArray[np.uint8], pages: I64, psize: int, npages: int, kind: int, limit: int
) -> tuple[I64, I64, I64, I64]:
    """The node offsets of ``pages`` (all of page kind ``kind``, each holding at least one
    node), in order; each node's page start; its page number; and the node count of
    each page. At most ``limit`` nodes
    (checked before allocating); ``npages``: the database's pages (``mm_last_pg + 1``)."""
    # compared before multiplying: a page number from the file may be near 2**64
    _fail((pages < 2) | (pages >= npages), np.clip(pages, 0, None), "a page number past the end")
    starts = pages * psize
    own = _u16(file, starts) | (_u16(file, starts + 2) << 16) | (_u16(file, starts + 4) << 32)
    _fail(
        (own != pages) | (_u16(file, starts + 6) != 0),
        pages,
        "a page whose header has another number",
    )
    flags = _u16(file, starts + 10)
    _fail((flags & (_P_BRANCH | _P_LEAF | _P_LEAF2)) != kind, pages, "a page of an unexpected kind")
    lower = _u16(file, starts + 12)
    upper = _u16(file, starts + 14)
    _fail(
        (lower <= _PAGEHDRSZ) | (lower > upper) | (upper > psize) | (lower & 1 == 1),
        pages,
        "a page header out of range",
    )
    counts = (lower - _PAGEHDRSZ) >> 1
    if int(counts.sum()) > limit:
        raise Damaged("more nodes than the database holds entries or pages")
    ptr_at, owner = _ragged(starts + _PAGEHDRSZ, counts, 2)
    ptrs = _u16(file, ptr_at)
    at = starts[owner] + ptrs
    _fail(
        (ptrs < upper[owner]) | (ptrs + _NODESIZE > psize), pages[owner], "a node outside its page"
    )
    ksize = _u16(file, at + 6)
    _fail(
        (ptrs + _NODESIZE + ksize > psize) | (ksize > _MAX_KEY),
        pages[owner],
        "a key outside its page",
    )
    return at, starts[owner], pages[owner], counts


def _compare(
    file: npt.NDArray[np.uint8], a_at: I64, a_size: I64, b_at: I64, b_size: I64
) -> npt.NDArray[np.int64]:
    """Per pair, the sign of key ``a`` minus key ``b`` in byte order (-1, 0 or 1)."""
    n = len(a_at)
    if n == 0:
        return np.zeros(0, np.int64)
    width = int(max(a_size.max(), b_size.max()))
    cols = np.arange(width, dtype=np.int64)
    # every width-byte window of the file, as rows: a key's bytes are one row (a
    # gather of whole rows, not of single bytes)
    last = len(file) - width
    windows = np.lib.stride_tricks.as_strided(file, (last + 1, width), (1, 1), writeable=False)

    def padded(at: I64, size: I64) -> npt.NDArray[np.bytes_]:
        """The keys as fixed-width byte strings, zero padded."""
        if int(at.max()) <= last:
            rows = windows[at]
        else:  # a key within ``width`` bytes of the file's end
            rows = file[np.minimum(at[:, np.newaxis] + cols, len(file) - 1)]
        rows[cols >= size[:, np.newaxis]] = 0
        return np.ascontiguousarray(rows).view(f"S{width}").reshape(n)

    a, b = padded(a_at, a_size), padded(b_at, b_size)
    # byte order on the zero-padded keys; equal ones differ at most in trailing zero
    # bytes, where the shorter key is less
    by_bytes = (a > b).astype(np.int64) - (a < b)
    sign: npt.NDArray[np.int64] = np.where(by_bytes != 0, by_bytes, np.sign(a_size - b_size))
    return sign


def _increasing(file: npt.NDArray[np.uint8], key_at: I64, ksize: I64) -> npt.NDArray[np.bool_]:
    """Per pair of consecutive keys, whether the second is greater (byte order)."""
    return _compare(file, key_at[:-1], ksize[:-1], key_at[1:], ksize[1:]) < 0


def _check_separators(
    file: npt.NDArray[np.uint8],
    branches: list[tuple[I64, I64, I64, npt.NDArray[np.bool_]]],
    leaf_counts: I64,
    key_at: I64,
    ksize: I64,
) -> None:
    """Each branch key (but a page's first, which LMDB ignores) must lie between the
    last key left of its child and the child's first key, as LMDB's key lookup
    assumes. ``branches``: per branch level, top down, its nodes' offsets, key sizes,
    pages, and which are the first of their page; the child of a level's node ``k``
    is page ``k`` of the level below."""
    first_record = np.cumsum(leaf_counts) - leaf_counts  # per page of the level below
    for nodes, sizes, page, head in reversed(branches):
        node_first = first_record  # node k's child is page k below
        sep = ~head
        r = node_first[sep]
        _fail(r < 1, page[sep], "a branch key that does not separate its children")
        at, size = nodes[sep] + _NODESIZE, sizes[sep]
        left = _compare(file, key_at[r - 1], ksize[r - 1], at, size) < 0
        right = _compare(file, at, size, key_at[r], ksize[r]) <= 0
        _fail(~(left & right), page[sep], "a branch key that does not separate its children")
        first_record = node_first[head]


Advise = Callable[[I64, int], None]


def read_tree(file: npt.NDArray[np.uint8], advise: Advise | None = None) -> Tree | None:
    """The main database's tree of ``file`` (an LMDB data file), checked; None when the
    file is no LMDB 0.9 data file (no magic, another version: LMDB says so itself).

    ``advise(pages, page_size)``, when given, is called with each level's page numbers
    (sorted) before the level is read: the caller asks the OS to read them ahead
    (many reads in flight on a cold file, instead of one page fault at a time).

    Raises:
        Damaged: the tree is inconsistent (names what, and the page).
        Unsupported: the main database holds sorted duplicates or orders its keys
            otherwise than by bytes.
        NamedDatabases: the main database holds named sub-databases, not records.
    """
    try:
        return _walk(file, advise)
    except (IndexError, ValueError, OverflowError) as exc:  # a check missed: still refused
        raise Damaged(f"an inconsistent B-tree ({exc})") from None


def value_extents(file: npt.NDArray[np.uint8], keys: Sequence[bytes]) -> Extents | None:
    """Each value's ``(offset, length)`` in ``file`` (an LMDB data file), in the order of
    ``keys`` (all keys, as LMDB lists them); None when the file cannot be read this way
    or does not hold exactly ``keys``.

    Raises:
        NamedDatabases: the main database holds named sub-databases, not records.
    """
    try:
        tree = read_tree(file)
    except (Damaged, Unsupported, MemoryError):
        return None
    return None if tree is None else extents_of(tree, keys)


def extents_of(tree: Tree, keys: Sequence[bytes]) -> Extents | None:
    """``tree``'s extents when its keys are exactly ``keys`` (in this order), else None."""
    n = len(keys)
    if n == 0 or len(tree.offsets) != n:
        return None
    if keys is not tree.keys and PackedKeys.of(keys) != tree.keys:
        return None
    return Extents(tree.offsets, tree.lengths, tree.txnid)


def _hint(advise: Advise | None, level: I64, psize: int, npages: int) -> None:
    """Pass the in-range pages of ``level`` to ``advise`` (out-of-range ones are refused
    when the level is read)."""
    if advise is not None:
        pages = np.sort(level[(level >= 2) & (level < npages)])
        if len(pages):
            advise(pages, psize)


def _walk(file: npt.NDArray[np.uint8], advise: Advise | None) -> Tree | None:
    size = file.size
    if size < 1024:
        return None
    if _u32(file, 16) != _MAGIC or _u32(file, 20) != _DATA_VERSION:
        return None
    psize = _u32(file, 40)  # mm_dbs[FREE_DBI].md_pad: the page size
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1) or 2 * psize > size:
        return None
    metas = []
    for m in (0, psize):
        if _u32(file, m + 16) != _MAGIC or _u32(file, m + 20) != _DATA_VERSION:
            return None
        if not int(file[m + 10]) & _P_META:
            return None
        metas.append((_u64(file, m + 144), m))  # (mm_txnid, page)
    meta = metas[picked_meta(metas[0][0], metas[1][0])][1]
    where = f"meta page {meta // psize}"
    txnid = _u64(file, meta + 144)
    npages = _u64(file, meta + 136) + 1  # mm_last_pg + 1
    if npages * psize > size:
        raise Damaged(f"the database is longer than the file ({where})")
    main = meta + 88  # mm_dbs[MAIN_DBI]
    db_flags = _u32(file, main + 4) & 0xFFFF  # md_flags
    if db_flags & _DUP_FLAGS:
        raise Unsupported(
            f"its main database holds sorted duplicates (flags 0x{db_flags:x}: MDB_DUPSORT)"
        )
    if db_flags:
        raise Unsupported(
            f"its main database orders keys otherwise than by bytes (flags 0x{db_flags:x})"
        )
    depth = _u32(file, main + 4) >> 16  # md_depth
    n = _u64(file, main + 32)  # md_entries
    root = _u64(file, main + 40)
    if root == _P_INVALID and depth == 0 and n == 0:
        return Tree(np.zeros(0, np.int64), np.zeros(0, np.uint32), txnid, PackedKeys.of(()), root)
    if not 1 <= depth <= _MAX_DEPTH:
        raise Damaged(f"a tree depth of {depth} ({where})")
    if n == 0 or n > npages * psize // _NODESIZE:
        raise Damaged(f"an entry count of {n} ({where})")
    if not 2 <= root < npages:
        raise Damaged(f"a root page number past the end ({where})")
    level = np.array([root], np.int64)
    branches: list[tuple[I64, I64, I64, npt.NDArray[np.bool_]]] = []
    for _ in range(depth - 1):  # branch levels: children in key order
        _hint(advise, level, psize, npages)
        nodes, _start, page, counts = _nodes(file, level, psize, npages, _P_BRANCH, npages)
        ksize = _u16(file, nodes + 6)
        first = np.zeros(len(nodes), np.bool_)  # node 0 of its page: no key
        first[np.cumsum(counts) - counts] = True
        branches.append((nodes, ksize, page, first))
        pair = ~first[1:] & ~first[:-1]  # both keys of one page, neither a node 0
        ok = _increasing(file, nodes + _NODESIZE, ksize)
        _fail(pair & ~ok, page[1:], "branch keys out of order")
        level = _u16(file, nodes) | (_u16(file, nodes + 2) << 16) | (_u16(file, nodes + 4) << 32)
    _hint(advise, level, psize, npages)
    offsets = np.empty(n, np.int64)
    lengths = np.empty(n, np.uint32)  # LMDB stores a value's size in 32 bits
    keys_at = np.empty(n, np.int64)
    keys_size = np.empty(n, np.int64)
    leaf_counts = []
    key_bytes: list[bytes] = []  # the keys' bytes, joined per step
    done = 0
    last_key: tuple[I64, I64] | None = None  # the previous step's last key: (at, size)
    c = 0
    step = 64  # leaf pages; then as many as hold about _STEP_NODES nodes
    while c < len(level):
        nodes, start, page, counts = _nodes(
            file, level[c : c + step], psize, npages, _P_LEAF, n - done
        )
        m = len(nodes)
        pages = min(step, len(level) - c)
        c += pages
        step = max(16, min(4096, _STEP_NODES * pages // max(m, 1)))
        flags = _u16(file, nodes + 4)
        ksize = _u16(file, nodes + 6)
        dsize = _u16(file, nodes) | (_u16(file, nodes + 2) << 16)
        if (flags & _F_SUBDATA).any():
            names = []
            for j in np.flatnonzero(flags & _F_SUBDATA)[:5].tolist():
                at, k = int(nodes[j]) + _NODESIZE, int(ksize[j])
                names.append(file[at : at + k].tobytes())
            raise NamedDatabases(*names)
        _fail((flags & ~_F_BIGDATA) != 0, page, "a node of sorted duplicates in a plain database")
        _fail(ksize == 0, page, "an empty key")
        key_at = nodes + _NODESIZE
        data_at = key_at + ksize
        big = (flags & _F_BIGDATA) != 0
        _fail(data_at + np.where(big, 8, dsize) > start + psize, page, "a value outside its page")
        if last_key is None:
            ok = _increasing(file, key_at, ksize)
            _fail(~ok, page[1:], "keys out of order")
        else:
            ok = _increasing(
                file, np.concatenate([last_key[0], key_at]), np.concatenate([last_key[1], ksize])
            )
            _fail(~ok, page, "keys out of order")
        last_key = (key_at[-1:], ksize[-1:])
        off = data_at.copy()
        if big.any():
            at = data_at[big]
            pg = np.zeros(len(at), np.uint64)
            for b in range(8):
                pg |= file[at + b].astype(np.uint64) << np.uint64(8 * b)
            _fail(
                (pg < 2) | (pg >= np.uint64(npages)),
                page[big],
                "an overflow page number past the end",
            )
            off[big] = pg.astype(np.int64) * psize + _PAGEHDRSZ
        _fail(off + dsize > npages * psize, page, "a value past the end of the database")
        offsets[done : done + m] = off
        lengths[done : done + m] = dsize
        keys_at[done : done + m] = key_at
        keys_size[done : done + m] = ksize
        leaf_counts.append(counts)
        key_bytes.append(_key_bytes(file, key_at, ksize))
        done += m
    if done != n:
        raise Damaged(f"{done} records in the tree, {n} in the meta page ({where})")
    _check_separators(file, branches, np.concatenate(leaf_counts), keys_at, keys_size)
    keys = PackedKeys(b"".join(key_bytes), narrow_ends(np.cumsum(keys_size)))
    return Tree(offsets, lengths, txnid, keys, root)
