"""Asking the OS to read pages of a mapped data file ahead (``madvise(MADV_WILLNEED)``).

One page fault reads one stretch of the file and waits for it: a walk of a cold B-tree,
or a shuffled epoch of a cold database, then runs at the disk's latency, one read in
flight. ``MADV_WILLNEED`` starts the reads of the pages named and returns at once, so
the disk holds many reads in flight and the faults that follow find the pages cached.
A hint never changes what is read, only when: where ``madvise`` is missing or fails,
nothing happens. During the walk the map is ``MADV_RANDOM`` (:func:`random_access`): a
fault then reads only its page, not the values around it.

:func:`will_need` gives the B-tree walk its hint (each level's pages, once the level
above has named them); :class:`ReadAhead` keeps the values of the next records of an
epoch's order requested, a bounded number of bytes ahead of the batches planned
(through the reader's ``will_need``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "AHEAD_BYTES",
    "AHEAD_JOIN_GAP",
    "AHEAD_RECORDS",
    "ReadAhead",
    "Requester",
    "advise_ranges",
    "evict_file",
    "will_need",
]

_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)
_PAGE = mmap.PAGESIZE
# How far ahead of the planned batches values are requested: at most this many bytes
# and records (the page cache must hold them until their batch reads them).
AHEAD_BYTES = 64 << 20
AHEAD_RECORDS = 4096
# Values requested ahead that lie this close are requested as one range (one call for
# many small records in nearby leaf pages; the few pages between cost nothing to read).
AHEAD_JOIN_GAP = 64 << 10


def advise_ranges(
    mapped: mmap.mmap,
    starts: npt.NDArray[np.int64],
    stops: npt.NDArray[np.int64],
    gap: int = 0,
) -> None:
    """``MADV_WILLNEED`` over the byte ranges ``[starts[i], stops[i])`` of ``mapped``
    (sorted by start or not; ranges that touch, or lie at most ``gap`` bytes apart,
    are joined into one call)."""
    if _WILLNEED is None or not len(starts):
        return
    order = np.argsort(starts, kind="stable")
    a = (starts[order] // _PAGE) * _PAGE
    b = stops[order]
    # join ranges that touch or overlap: a new run starts where a range begins past
    # the furthest end so far
    reach = np.maximum.accumulate(b)
    new = np.ones(len(a), np.bool_)
    new[1:] = a[1:] > reach[:-1] + gap
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(a)) - 1
    size = len(mapped)
    with contextlib.suppress(OSError, ValueError):
        for lo, hi in zip(a[first].tolist(), reach[last].tolist(), strict=True):
            hi = min(hi, size)
            if hi > lo:
                mapped.madvise(_WILLNEED, lo, hi - lo)


@contextlib.contextmanager
def random_access(mapped: mmap.mmap) -> Iterator[None]:
    """``MADV_RANDOM`` on ``mapped`` for the block, then the default advice again. A
    page fault under the default advice also reads the file around the page; during
    a B-tree walk that means the values between leaf pages, gigabytes of them, while
    the walk's own pages are requested by :func:`will_need`."""
    rand = getattr(mmap, "MADV_RANDOM", None)
    normal = getattr(mmap, "MADV_NORMAL", None)
    if rand is None or normal is None:
        yield
        return
    with contextlib.suppress(OSError, ValueError):
        mapped.madvise(rand)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            mapped.madvise(normal)


def evict_file(path: str) -> None:
    """Ask the OS to drop the cached pages of the file ``path`` that no process maps
    (``posix_fadvise(POSIX_FADV_DONTNEED)``); nothing where that is missing."""
    advice = getattr(os, "POSIX_FADV_DONTNEED", None)
    if advice is None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        finally:
            os.close(fd)


def will_need(mapped: mmap.mmap) -> Callable[[npt.NDArray[np.int64], int], None]:
    """The B-tree walk's hint for ``mapped``: ``advise(pages, page_size)``."""

    def advise(pages: npt.NDArray[np.int64], psize: int) -> None:
        starts = pages * psize
        advise_ranges(mapped, starts, starts + psize)

    return advise


class Requester(Protocol):
    """What :class:`ReadAhead` requests values through (an LmdbReader)."""

    def will_need(self, indices: npt.NDArray[np.int64], max_bytes: int) -> tuple[int, int]: ...


class ReadAhead:
    """Keeps the values of the next records of each epoch's order requested ahead.

    :meth:`planned` is told where each planned batch ends in the epoch's order; it
    requests the records after it, up to :data:`AHEAD_BYTES` (counting what is
    requested and not yet planned) and :data:`AHEAD_RECORDS` ahead, each record once.
    Single consumer (the planner).
    """

    def __init__(self, source: Requester) -> None:
        self._source = source
        self._epoch = -1
        self._done = 0  # positions of ``_epoch`` requested: up to here
        self._chunks: deque[tuple[int, int, int]] = deque()  # (start, stop, bytes) requested

    def planned(self, order: npt.NDArray[np.int64], epoch: int, first: int, stop: int) -> None:
        """A batch was planned over positions ``[first, stop)`` of ``order`` (epoch
        ``epoch``): request its records not requested yet, and what lies ahead."""
        if epoch != self._epoch:
            self._epoch, self._done = epoch, 0
            self._chunks.clear()
        chunks = self._chunks
        while chunks and chunks[0][1] <= stop:
            chunks.popleft()
        start = max(self._done, first)
        # requests go out in large chunks: a new one only once less than half of the
        # record window ahead is requested (the batch itself always is), so a batch
        # of small records costs no call at all most of the time
        if start > first and start - stop >= AHEAD_RECORDS // 2:
            return
        # bytes requested and not yet planned (a chunk planned in part: its share)
        pending = sum(b * (e - max(a, stop)) // (e - a) for a, e, b in chunks)
        budget = AHEAD_BYTES - pending
        if start > first and pending >= AHEAD_BYTES // 2:
            return
        window = order[start : stop + AHEAD_RECORDS]
        if budget <= 0 or not len(window):
            return
        count, nbytes = self._source.will_need(window, budget)
        if count:
            self._done = start + count
            chunks.append((start, self._done, nbytes))
