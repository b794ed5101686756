"""Fresh host memory in transparent huge pages (``_backends/_hostmem.py``): which buffers
come from maps, slabs shared by buffers of one size, alignment, unmapping, fallbacks."""

from __future__ import annotations

import gc
import mmap
import os
import sys
import weakref
from typing import Any

import numpy as np
import pytest

from blobpipe._backends import EmulatedBackend, HostBackend, _hostmem
from blobpipe._backends._hostmem import (
    HUGE_PAGE,
    OWN_MAP_FROM,
    SHARED_FROM,
    SLAB_BUFFERS,
    SLAB_BYTES,
    SLAB_SIZES,
    alloc,
)

needs_huge_advice = pytest.mark.skipif(
    getattr(mmap, "MADV_HUGEPAGE", None) is None, reason="no MADV_HUGEPAGE on this platform"
)


def root_map(buffer: np.ndarray[Any, Any]) -> mmap.mmap | None:
    """The map a buffer is a view of (None: the allocator's memory)."""
    base: Any = buffer
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # np.frombuffer's base
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None


def address(buffer: np.ndarray[Any, Any]) -> int:
    return int(buffer.ctypes.data)


def vm_flags(addr: int) -> set[str]:
    """The flags of the mapping holding ``addr`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_small_buffers_come_from_the_allocator() -> None:
    buf = alloc(SHARED_FROM - 1)
    assert len(buf) == SHARED_FROM - 1 and address(buf) % 64 == 0
    assert root_map(buf) is None


@needs_huge_advice
@pytest.mark.parametrize("nbytes", [SHARED_FROM, 786_432 + 7, 1_835_008, OWN_MAP_FROM - 64])
def test_buffers_of_one_size_share_a_slab(nbytes: int) -> None:
    """Consecutive buffers of one size lie side by side in one map of whole huge pages
    (a ring's slots share their huge pages), each 64-byte aligned and its own bytes."""
    first, second = alloc(nbytes), alloc(nbytes)
    slab = root_map(first)
    assert slab is not None and root_map(second) is slab
    stride = -(-nbytes // 64) * 64
    assert address(second) - address(first) == stride
    assert len(first) == len(second) == nbytes
    assert address(first) % 64 == 0 and address(second) % 64 == 0
    # the slab's pages: at least SLAB_BYTES and SLAB_BUFFERS buffers, whole huge pages
    assert len(slab) - HUGE_PAGE >= max(SLAB_BYTES, SLAB_BUFFERS * stride)
    assert (len(slab) - HUGE_PAGE) % HUGE_PAGE == 0
    first[:] = 1
    second[:] = 2
    assert (first == 1).all() and (second == 2).all()


@needs_huge_advice
def test_large_buffers_have_a_map_of_their_own() -> None:
    nbytes = OWN_MAP_FROM + 12_345
    a, b = alloc(nbytes), alloc(nbytes)
    assert root_map(a) is not None and root_map(b) is not None and root_map(a) is not root_map(b)
    assert address(a) % HUGE_PAGE == 0 and len(a) == nbytes
    region = root_map(a)
    assert region is not None
    # whole huge pages, and one more to align the start
    assert len(region) == -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE


@needs_huge_advice
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps")
@pytest.mark.parametrize("nbytes", [SHARED_FROM + 1, OWN_MAP_FROM])
def test_maps_are_advised_huge_pages(nbytes: int) -> None:
    """The kernel is asked to back them with huge pages ("hg"); whether it can is its own
    business (the pages are ordinary ones where it cannot)."""
    assert "hg" in vm_flags(address(alloc(nbytes)))


@needs_huge_advice
def test_a_slab_is_unmapped_once_none_of_its_buffers_lives() -> None:
    nbytes = SHARED_FROM + 4096 * 3 + 64  # a size no other test asks for
    buffers = [alloc(nbytes)]
    slab = root_map(buffers[0])
    assert slab is not None
    gone = weakref.ref(slab)
    count = (len(slab) - HUGE_PAGE) // nbytes  # the buffers the slab holds
    buffers += [alloc(nbytes) for _ in range(count - 1)]
    assert all(root_map(b) is slab for b in buffers)
    following = alloc(nbytes)  # the slab is all handed out: the next comes from another
    assert root_map(following) is not slab
    del slab, buffers
    gc.collect()
    assert gone() is None


@needs_huge_advice
def test_only_the_last_sizes_keep_their_slab_buffers_waiting() -> None:
    """Buffers of a slab not handed out wait for their size's next request, for the last
    SLAB_SIZES sizes asked for only: an older size's slab goes once its buffers do."""
    sizes = [SHARED_FROM + 64 * (1000 + k) for k in range(SLAB_SIZES + 1)]
    first = alloc(sizes[0])
    slab = root_map(first)
    assert slab is not None
    gone = weakref.ref(slab)
    for nbytes in sizes[1:]:
        alloc(nbytes)
    del first, slab
    gc.collect()
    assert gone() is None
    kept = alloc(sizes[-1])
    again = alloc(sizes[-1])
    assert root_map(kept) is root_map(again)


def test_without_huge_page_advice_buffers_come_from_the_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_hostmem, "_MADV_HUGEPAGE", None)
    for nbytes in (SHARED_FROM, OWN_MAP_FROM):
        buf = alloc(nbytes)
        assert root_map(buf) is None and len(buf) == nbytes and address(buf) % 64 == 0


@needs_huge_advice
def test_a_map_that_cannot_be_made_falls_back_to_the_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(nbytes: int) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(_hostmem, "_huge_pages", refuse)
    for nbytes in (SHARED_FROM + 4096 * 5, OWN_MAP_FROM):
        buf = alloc(nbytes)
        assert root_map(buf) is None and len(buf) == nbytes


@needs_huge_advice
@pytest.mark.parametrize("backend", [HostBackend, EmulatedBackend])
def test_host_backends_allocate_here(backend: type[HostBackend]) -> None:
    """The host buffers of the pools (Blobs, a Loader's ring) come from here."""
    buf = backend().alloc_host(SHARED_FROM + 4096 * 7)
    assert root_map(buf) is not None


@needs_huge_advice
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_allocates() -> None:
    nbytes = SHARED_FROM + 4096 * 9
    alloc(nbytes)  # the parent has slab buffers waiting
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            a, b = alloc(nbytes), alloc(nbytes)
            a[:] = 3
            code = 0 if (b == 0).all() and root_map(a) is root_map(b) else 1
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_module_is_linux_only_in_effect() -> None:
    """Elsewhere (no MADV_HUGEPAGE) every buffer is the allocator's."""
    if sys.platform.startswith("linux"):
        assert _hostmem._MADV_HUGEPAGE is not None
    else:  # pragma: no cover - not run on Linux
        assert root_map(alloc(OWN_MAP_FROM)) is None
