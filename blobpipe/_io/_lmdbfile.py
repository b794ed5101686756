"""Where each value of an LMDB database lies in its data file, read from the B-tree pages.

LMDB (0.9, data format version 1, which Caffe's databases use) stores a B+tree
in fixed-size pages: two meta pages, branch pages whose nodes point to child
pages, leaf pages whose nodes hold a key and either the value itself or, for a
value too large for the page (``F_BIGDATA``: every image record), the number of
the first of its consecutive overflow pages, where the value starts right after
the 16-byte page header. :func:`value_extents` walks those pages, vectorised
with numpy over a read-only mapping of the file, and returns each value's file
offset and length, in key order. Only the tree's branch and leaf pages are read
(as listing the keys does); values are not touched.

Everything read is checked: magic and version, page numbers and node offsets
inside the file and the page, page kinds level by level, the entry count, and
the keys themselves, byte for byte, against the keys LMDB listed. A database
this code does not understand (another format version, a DUPSORT or named
sub-database, any inconsistency) gives None, and the caller reads through LMDB
as before. Pages are read through our own mapping of the file, never LMDB's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["Extents", "NamedDatabases", "picked_meta", "value_extents"]

_PAGEHDRSZ = 16
_NODESIZE = 8
_P_BRANCH = 0x01
_P_LEAF = 0x02
_P_LEAF2 = 0x20
_F_BIGDATA = 0x01
_F_SUBDATA = 0x02  # the node's value is a named sub-database
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_MAX_DEPTH = 64
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


class NamedDatabases(Exception):
    """The main database holds named sub-databases, not records (their names are
    the exception's ``args``)."""


class _Bad(Exception):
    """The file is not a database this walker reads."""


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


def _nodes(
    file: npt.NDArray[np.uint8], pages: I64, psize: int, kind: int, limit: int
) -> tuple[I64, I64]:
    """The node offsets of ``pages`` (all of page kind ``kind``), in order, and each
    node's page start; at most ``limit`` nodes (checked before allocating)."""
    size = file.size
    # compared before multiplying: a page number from the file may be near 2**48
    if pages.size == 0 or (pages < 2).any() or (pages >= size // psize).any():
        raise _Bad("a page number outside the file")
    starts = pages * psize
    flags = _u16(file, starts + 10)
    if ((flags & (_P_BRANCH | _P_LEAF | _P_LEAF2)) != kind).any():
        raise _Bad("a page of an unexpected kind")
    lower = _u16(file, starts + 12)
    upper = _u16(file, starts + 14)
    if ((lower < _PAGEHDRSZ) | (lower > upper) | (upper > psize) | (lower & 1 == 1)).any():
        raise _Bad("a page header out of range")
    counts = (lower - _PAGEHDRSZ) >> 1
    if int(counts.sum()) > limit:
        raise _Bad("more nodes than the file can hold")
    ptr_at, owner = _ragged(starts + _PAGEHDRSZ, counts, 2)
    ptrs = _u16(file, ptr_at)
    if ((ptrs < upper[owner]) | (ptrs + _NODESIZE > psize)).any():
        raise _Bad("a node outside its page")
    return starts[owner] + ptrs, starts[owner]


def value_extents(file: npt.NDArray[np.uint8], keys: Sequence[bytes]) -> Extents | None:
    """Each value's ``(offset, length)`` in ``file`` (an LMDB data file), in the order of
    ``keys`` (all keys, as LMDB lists them); None when the file cannot be read this way
    or does not hold exactly ``keys``.

    Raises:
        NamedDatabases: the main database holds named sub-databases, not records.
    """
    try:
        return _walk(file, keys)
    except (_Bad, IndexError, ValueError, OverflowError, MemoryError):
        return None


def _walk(file: npt.NDArray[np.uint8], keys: Sequence[bytes]) -> Extents:
    size = file.size
    if size < 1024:
        raise _Bad("too small")
    if _u32(file, 16) != _MAGIC or _u32(file, 20) != _DATA_VERSION:
        raise _Bad("not an LMDB 0.9 data file")
    psize = _u32(file, 40)  # mm_dbs[FREE_DBI].md_pad: the page size
    if psize < 512 or psize > 1 << 16 or psize & (psize - 1) or 2 * psize > size:
        raise _Bad("bad page size")
    metas = []
    for m in (0, psize):
        if _u32(file, m + 16) != _MAGIC or _u32(file, m + 20) != _DATA_VERSION:
            raise _Bad("bad meta page")
        metas.append((_u64(file, m + 144), m))  # (mm_txnid, page)
    meta = metas[picked_meta(metas[0][0], metas[1][0])][1]
    main = meta + 88  # mm_dbs[MAIN_DBI]
    if _u32(file, main + 4) & 0xFFFF:  # md_flags
        raise _Bad("a main database with flags (DUPSORT, INTEGERKEY, ...)")
    depth = _u32(file, main + 4) >> 16  # md_depth
    entries = _u64(file, main + 32)
    root = _u64(file, main + 40)
    n = len(keys)
    if entries != n or n == 0 or not 1 <= depth <= _MAX_DEPTH:
        raise _Bad("entry count or depth differs")
    level = np.array([root], np.int64)
    pages = size // psize
    for _ in range(depth - 1):  # branch levels: children in key order
        nodes, _owner = _nodes(file, level, psize, _P_BRANCH, pages)
        lo = _u16(file, nodes)
        hi = _u16(file, nodes + 2)
        top = _u16(file, nodes + 4)
        level = lo | (hi << 16) | (top << 32)
    offsets = np.empty(n, np.int64)
    lengths = np.empty(n, np.uint32)  # LMDB stores a value's size in 32 bits
    done = 0
    key_lens = np.fromiter(map(len, keys), np.int64, n)
    c = 0
    step = 64  # leaf pages; then as many as hold about _STEP_NODES nodes
    while c < len(level):
        nodes, page = _nodes(file, level[c : c + step], psize, _P_LEAF, n - done)
        m = len(nodes)
        pages = min(step, len(level) - c)
        c += pages
        step = max(16, min(4096, _STEP_NODES * pages // max(m, 1)))
        flags = _u16(file, nodes + 4)
        ksize = _u16(file, nodes + 6)
        dsize = _u16(file, nodes) | (_u16(file, nodes + 2) << 16)
        if (flags & _F_SUBDATA).any():
            names = [bytes(keys[done + int(j)]) for j in np.flatnonzero(flags & _F_SUBDATA)]
            raise NamedDatabases(*names)
        if (flags & ~_F_BIGDATA).any():
            raise _Bad("duplicate values")
        if (ksize != key_lens[done : done + m]).any():
            raise _Bad("keys differ")
        data_at = nodes + _NODESIZE + ksize
        big = (flags & _F_BIGDATA) != 0
        inline_end = data_at + np.where(big, 8, dsize)
        if (inline_end > page + psize).any():
            raise _Bad("a node's data outside its page")
        key_at, _ = _ragged(nodes + _NODESIZE, ksize, 1)
        if file[key_at].tobytes() != b"".join(keys[done : done + m]):
            raise _Bad("keys differ")
        off = data_at.copy()
        if big.any():
            at = data_at[big]
            pg = np.zeros(len(at), np.uint64)
            for b in range(8):
                pg |= file[at + b].astype(np.uint64) << np.uint64(8 * b)
            if (pg >= np.uint64(size // psize)).any():
                raise _Bad("an overflow page outside the file")
            off[big] = pg.astype(np.int64) * psize + _PAGEHDRSZ
        if (off + dsize > size).any():
            raise _Bad("a value past the end of the file")
        offsets[done : done + m] = off
        lengths[done : done + m] = dsize
        done += m
    if done != n:
        raise _Bad("fewer nodes than entries")
    return Extents(offsets, lengths, _u64(file, meta + 144))
