"""Fresh host memory that costs little to touch first: transparent huge pages.

A buffer's memory costs nothing until it is first written; then every 4 KiB page is
a page fault, a trap into the kernel that zeroes the page. A first epoch writes its
ring's buffers for the first time, so it pays that for all of them: on a 2-core VM
about 2–3 µs a page, 3 MiB of a batch buffer in 1.5 ms, as long as the fill of a
small batch itself (the plain loop writes one batch buffer, a Loader's ring five to
thirty-four). A transparent huge page is one fault and one zeroed 2 MiB block, about
a tenth of that. So host buffers come from private anonymous maps the kernel is asked
(``madvise(MADV_HUGEPAGE)``) to back with huge pages:

* a buffer of :data:`OWN_MAP_FROM` bytes or more has a map of its own, 2 MiB aligned,
  of whole 2 MiB pages (it holds up to 2 MiB more memory than asked, under half);
* a buffer of :data:`SHARED_FROM` bytes up to that is cut from a *slab*, a map of
  whole 2 MiB pages holding several buffers of one size (at least :data:`SLAB_BUFFERS`,
  and at least :data:`SLAB_BYTES`): the buffers of a ring come in runs of one size and
  share their huge pages. The buffers of a slab not handed out yet wait for the next
  request of their size (those of the last :data:`SLAB_SIZES` sizes asked for); a slab
  is unmapped once none of its buffers is referenced. Memory: a huge page is backed
  once any buffer in it is written, so a slab holds at most one partly used huge page
  beyond its buffers' bytes (untouched pages of a map cost nothing);
* smaller buffers come from the allocator (``np.empty``), as do all buffers where the
  platform has no ``MADV_HUGEPAGE`` (Linux only) or a map cannot be made.

Where the kernel gives no huge page (``transparent_hugepage`` set to ``never``, no
2 MiB page free), the maps are backed by ordinary pages, as ``malloc``'s own map of a
large buffer is: nothing is lost but the rounding.

Every buffer starts at a multiple of ``HOST_ALIGN`` bytes (64). Thread-safe; a forked
child starts with no slab buffers waiting (its parent's lock may have been held).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = [
    "HOST_ALIGN",
    "HUGE_PAGE",
    "OWN_MAP_FROM",
    "SHARED_FROM",
    "SLAB_BUFFERS",
    "SLAB_BYTES",
    "SLAB_SIZES",
    "aligned",
    "alloc",
]

Buffer = np.ndarray[Any, np.dtype[np.uint8]]

HOST_ALIGN = 64  # bytes: host buffers start at a multiple of this
#: a transparent huge page (x86-64; arm64 with 4 KiB base pages)
HUGE_PAGE = 2 << 20
#: buffers of at least this many bytes are cut from slabs (smaller: the allocator)
SHARED_FROM = 128 << 10
#: buffers of at least this many bytes get a map of their own
OWN_MAP_FROM = 4 << 20
#: a slab holds at least this many buffers ...
SLAB_BUFFERS = 4
#: ... and at least this many bytes
SLAB_BYTES = 8 << 20
#: the sizes whose slab's buffers not handed out yet are kept for the next request
SLAB_SIZES = 4

_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)
_lock = threading.Lock()
# per buffer size (its stride): the buffers of its last slab not handed out yet, the
# most recently asked size last
_waiting: OrderedDict[int, list[Buffer]] = OrderedDict()


def alloc(nbytes: int) -> Buffer:
    """A new 1-D uint8 host buffer of ``nbytes``, 64-byte aligned (see the module
    docstring for where it comes from).

    Raises MemoryError when the system cannot provide it.
    """
    if _MADV_HUGEPAGE is not None and nbytes >= SHARED_FROM:
        try:
            return _own_map(nbytes) if nbytes >= OWN_MAP_FROM else _from_slab(nbytes)
        except OSError:
            pass  # no map (a limit on maps or on committed memory): the allocator's
    return aligned(np.empty(nbytes + HOST_ALIGN - 1, dtype=np.uint8), nbytes)


def aligned(raw: Buffer, nbytes: int) -> Buffer:
    """The ``nbytes`` of ``raw`` (``HOST_ALIGN - 1`` longer) from its first
    ``HOST_ALIGN``-aligned byte. JAX (XLA) imports 64-byte aligned DLPack buffers
    without a copy and copies the others: aligned, a batch never depends on where
    the allocator put it (and SIMD loops like it too)."""
    skip = -raw.ctypes.data % HOST_ALIGN
    return raw[skip : skip + nbytes]


def _huge_pages(nbytes: int) -> Buffer:
    """A private anonymous map of ``nbytes`` rounded up to whole huge pages, 2 MiB
    aligned, advised to be backed by huge pages (the array holds the map: it is
    unmapped with the last array made from it)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # one page more, to start at a 2 MiB boundary (the part before it is never touched)
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert _MADV_HUGEPAGE is not None
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages
        region.madvise(_MADV_HUGEPAGE)
    raw = np.frombuffer(region, np.uint8)
    skip = -raw.ctypes.data % HUGE_PAGE
    return raw[skip : skip + size]


def _own_map(nbytes: int) -> Buffer:
    return _huge_pages(nbytes)[:nbytes]


def _from_slab(nbytes: int) -> Buffer:
    stride = -(-nbytes // HOST_ALIGN) * HOST_ALIGN
    with _lock:
        left = _waiting.pop(stride, None)
        if not left:
            slab = _huge_pages(max(SLAB_BYTES, SLAB_BUFFERS * stride))
            left = [slab[i : i + stride] for i in range(0, len(slab) - stride + 1, stride)]
            left.reverse()  # handed out from the start of the slab
        buffer = left.pop()
        if left:
            _waiting[stride] = left
            while len(_waiting) > SLAB_SIZES:
                _waiting.popitem(last=False)
    return buffer[:nbytes]


def _forget_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _waiting.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
