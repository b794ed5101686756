"""Asking the OS to read pages of a data file ahead (``WILLNEED``).

One page fault reads one stretch of the file and waits for it: a walk of a cold B-tree,
or a shuffled epoch of a cold database, then runs at the disk's latency, one read in
flight. ``WILLNEED`` starts the reads of the pages named and returns, so the disk holds
many reads in flight and the faults that follow find the pages cached. A hint never
changes what is read, only when: where the call is missing or fails, nothing happens.
During the walk the map is ``MADV_RANDOM`` (:func:`random_access`): a fault then reads
only its page, not the values around it.

Two limits of the call shape everything here. Linux reads at most
``max(read_ahead_kb, max_sectors_kb)`` of the device per call (``force_page_cache_ra``):
a longer range is read only at its head, so ranges go out in pieces of that size
(:func:`advice_cap`, :func:`pieces`). And the call blocks while the device's queue is
full, holding the GIL when made through ``mmap.madvise``: a long request made by the
planner stalls every filler. So what lies ahead goes to an :class:`Advisor`, a thread that
makes the calls with ``os.posix_fadvise`` (which releases the GIL) on a descriptor of
its own, and ends when it has nothing left to request.

:func:`will_need` gives the B-tree walk its hint (each level's pages, once the level
above has named them); :class:`ReadAhead` keeps the values of the next records of an
epoch's order requested, a window ahead of the batches planned whose size follows the
memory available (:func:`ahead_window`), through the reader's ``will_need``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ._kernels import row_kernel
from ._pid import pid

__all__ = [
    "AHEAD_BYTES",
    "AHEAD_BYTES_MAX",
    "AHEAD_GROUP_BYTES",
    "AHEAD_JOIN_GAP",
    "AHEAD_MEMORY_SHARE",
    "AHEAD_RECORDS",
    "AHEAD_RECORDS_SMALL",
    "SAMPLE",
    "Advisor",
    "ReadAhead",
    "Requester",
    "advice_cap",
    "advise_pieces",
    "advise_ranges",
    "ahead_window",
    "available_memory",
    "evict_file",
    "missing",
    "pieces",
    "resident",
    "uncached",
    "whole_limit",
    "will_need",
]

_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)
_FADV_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)
_PAGE = mmap.PAGESIZE
# How far ahead of the planned batches values are requested: a window of at least
# AHEAD_BYTES and at most AHEAD_BYTES_MAX, 1/AHEAD_MEMORY_SHARE of the memory available
# (what is requested must stay cached until its batch reads it), and at most
# AHEAD_RECORDS records. A data file no larger than 1/AHEAD_MEMORY_SHARE of the memory
# available (whole_limit) has its epoch requested at its first batch instead,
# AHEAD_RECORDS_SMALL records at a time.
AHEAD_BYTES = 64 << 20
AHEAD_BYTES_MAX = 1 << 30
AHEAD_MEMORY_SHARE = 8
AHEAD_RECORDS = 4096
AHEAD_RECORDS_SMALL = 1 << 16
# Values requested ahead that lie this close are requested as one range (one call for
# many small records in nearby leaf pages; the few pages between cost nothing to read).
AHEAD_JOIN_GAP = 64 << 10
# Values requested ahead are sorted by place (and joined) within runs of this many bytes
# of the epoch's order: the reads go out in about the order the batches need them.
AHEAD_GROUP_BYTES = 16 << 20
# What one WILLNEED call reads at most where the device's limits cannot be read: Linux's
# default read_ahead_kb.
_CAP_DEFAULT = 128 << 10


def advice_cap(dev: int) -> int:
    """The most bytes one ``WILLNEED`` call reads of a file on device ``dev`` (its
    ``st_dev``): ``max(read_ahead_kb, max_sectors_kb)`` of its block device, as Linux's
    ``force_page_cache_ra`` caps it; 128 KiB where sysfs does not say (a network or
    union file system, another OS)."""
    try:
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    except (OverflowError, ValueError):
        return _CAP_DEFAULT
    # a partition's queue is its disk's (the directory above it)
    for queue in (f"{base}/queue", f"{base}/../queue"):
        try:
            with open(f"{queue}/read_ahead_kb", "rb") as f:
                ahead = int(f.read(32))
            with open(f"{queue}/max_sectors_kb", "rb") as f:
                largest = int(f.read(32))
        except (OSError, ValueError):
            continue
        return max(ahead, largest, _CAP_DEFAULT >> 10) << 10
    return _CAP_DEFAULT


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit() -> int | None:
    """This process's cgroup memory limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), None where there is none or it cannot be read. Page
    cache counts against it: read-ahead beyond it is dropped before it is used."""
    try:
        with open("/proc/self/cgroup", "rb") as f:
            lines = f.read(1 << 16).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ident, controllers, path = parts
        if ident == "0" and not controllers:
            name = f"/sys/fs/cgroup{path}/memory.max"
        elif "memory" in controllers.split(","):
            name = f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"
        else:
            continue
        name = os.path.normpath(name)
        if not name.startswith("/sys/fs/cgroup/"):
            continue
        try:
            with open(name, "rb") as f:
                text = f.read(64).strip()
        except OSError:
            continue
        if text.isdigit():
            found.append(int(text))
    return min(found) if found else None


def available_memory() -> int | None:
    """Bytes of memory the page cache may hold without pushing out what this process
    and others need: ``MemAvailable`` of ``/proc/meminfo``, at most this process's
    cgroup limit; None where neither can be read."""
    values = [v for v in (_meminfo_available(), _cgroup_limit()) if v is not None]
    return min(values) if values else None


def ahead_window(available: int | None = None) -> int:
    """How many bytes of values :class:`ReadAhead` keeps requested ahead of the batches
    planned: 1/:data:`AHEAD_MEMORY_SHARE` of the memory available
    (:func:`available_memory` unless given), at least :data:`AHEAD_BYTES` and at most
    :data:`AHEAD_BYTES_MAX`."""
    if available is None:
        available = available_memory()
    if available is None:
        return AHEAD_BYTES
    return max(AHEAD_BYTES, min(AHEAD_BYTES_MAX, available // AHEAD_MEMORY_SHARE))


def whole_limit(available: int | None = None) -> int:
    """The largest data file :class:`ReadAhead` requests whole at an epoch's first batch:
    1/:data:`AHEAD_MEMORY_SHARE` of the memory available (:func:`available_memory`
    unless given; :data:`AHEAD_BYTES` where that is unknown). What is requested stays
    cached until its batch reads it: an epoch reads it all anyway, and the page cache
    keeps it with room to spare; a file that could be pushed out before it is read is
    requested a window at a time."""
    if available is None:
        available = available_memory()
    if available is None:
        return AHEAD_BYTES
    return max(AHEAD_BYTES, available // AHEAD_MEMORY_SHARE)


def pieces(
    starts: npt.NDArray[np.int64],
    stops: npt.NDArray[np.int64],
    *,
    group: npt.NDArray[np.int64] | None = None,
    gap: int = 0,
    cap: int = 0,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The byte ranges ``[starts[i], stops[i])`` as calls: ``(offsets, lengths)``.

    Starts are rounded down to a page. Within each group (``group[i]``, non-decreasing;
    one group when None) ranges are sorted by start, and those that touch or lie at most
    ``gap`` bytes apart are joined; groups keep their order. Each joined range is cut
    into pieces of at most ``cap`` bytes (``cap`` 0: not cut).
    """
    n = len(starts)
    if not n:
        empty = np.zeros(0, np.int64)
        return empty, empty
    a = (np.asarray(starts, np.int64) // _PAGE) * _PAGE
    b = np.asarray(stops, np.int64)
    order = np.argsort(a, kind="stable") if group is None else np.lexsort((a, group))
    a, b = a[order], b[order]
    new = np.zeros(n, np.bool_)
    new[0] = True
    if group is not None:
        g = np.asarray(group, np.int64)[order]
        new[1:] = g[1:] != g[:-1]
    # the furthest end so far, within each group: a run of joined ranges starts where a
    # range begins past it (or a group begins)
    first = np.flatnonzero(new)
    reach = b.copy()
    for lo, hi in zip(first.tolist(), np.append(first[1:], n).tolist(), strict=True):
        np.maximum.accumulate(reach[lo:hi], out=reach[lo:hi])
    new[1:] |= a[1:] > reach[:-1] + gap
    first = np.flatnonzero(new)
    last = np.append(first[1:], n) - 1
    lo_, hi_ = a[first], reach[last]
    if cap <= 0:
        return lo_, hi_ - lo_
    count = (hi_ - lo_ + cap - 1) // cap
    which = np.repeat(np.arange(len(lo_)), count)
    within = np.arange(len(which)) - np.repeat(np.cumsum(count) - count, count)
    at = lo_[which] + within * cap
    return at, np.minimum(cap, hi_[which] - at)


def advise_pieces(
    mapped: mmap.mmap, offsets: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
) -> None:
    """``MADV_WILLNEED`` over each ``[offsets[i], offsets[i] + lengths[i])`` of ``mapped``
    (page-aligned offsets, as :func:`pieces` gives), one call each, in order. Blocks
    while the device's queue is full, holding the GIL: for a few ranges at a time."""
    if _WILLNEED is None:
        return
    size = len(mapped)
    with contextlib.suppress(OSError, ValueError):
        for lo, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
            n = min(n, size - lo)
            if n > 0:
                mapped.madvise(_WILLNEED, lo, n)


def advise_ranges(
    mapped: mmap.mmap,
    starts: npt.NDArray[np.int64],
    stops: npt.NDArray[np.int64],
    gap: int = 0,
    cap: int = 0,
) -> None:
    """``MADV_WILLNEED`` over the byte ranges ``[starts[i], stops[i])`` of ``mapped``
    (sorted by start or not; ranges that touch, or lie at most ``gap`` bytes apart,
    are joined into one call; calls of at most ``cap`` bytes when ``cap``)."""
    if _WILLNEED is None or not len(starts):
        return
    advise_pieces(mapped, *pieces(starts, stops, gap=gap, cap=cap))


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


def evict_file(path: str | os.PathLike[str]) -> None:
    """Ask the OS to drop the cached pages of the file ``path`` that no process maps
    (``posix_fadvise(POSIX_FADV_DONTNEED)``, after ``fsync``: pages not yet written
    back are not dropped); nothing where that is missing."""
    advice = getattr(os, "POSIX_FADV_DONTNEED", None)
    if advice is None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, advice)
        finally:
            os.close(fd)


def will_need(mapped: mmap.mmap) -> Callable[[npt.NDArray[np.int64], int], None]:
    """The B-tree walk's hint for ``mapped``: ``advise(pages, page_size)``."""

    def advise(pages: npt.NDArray[np.int64], psize: int) -> None:
        starts = pages * psize
        advise_ranges(mapped, starts, starts + psize)

    return advise


# How many ranges :func:`missing` looks at, spread over them: when all of these are
# cached (a warm epoch), so are taken to be the others.
SAMPLE = 32
_mincore: Callable[[int, int, int], int] | None = None
_mincore_tried = False


def _mincore_call() -> Callable[[int, int, int], int] | None:
    """libc's ``mincore``, called with the GIL held (``PyDLL``: it only looks pages up,
    never waits for a read), or None where there is none."""
    global _mincore, _mincore_tried
    if not _mincore_tried:
        _mincore_tried = True
        try:
            import ctypes

            call = ctypes.PyDLL(None).mincore
            call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            call.restype = ctypes.c_int
            _mincore = call
        except (ImportError, OSError, AttributeError):
            _mincore = None
    return _mincore


def resident(
    mapped: npt.NDArray[np.uint8], first: npt.NDArray[np.intp], last: npt.NDArray[np.intp]
) -> np.ndarray | None:
    """Per span of pages ``[first[i], last[i]]`` of ``mapped`` (a map of a file,
    starting at a page boundary), whether it lies inside the map and its pages are in
    the page cache (``mincore``; of a span of more than 32 pages, its first and last).
    One call of the compiled row kernel (``_rowkernel.resident``: a ``mincore`` call a
    span, ~1 µs each on a VM) where it is built; else ``ctypes``, a call a page (2-10
    µs each), first and last page. None where the system has no ``mincore``."""
    first = np.ascontiguousarray(first, np.intp)
    last = np.ascontiguousarray(last, np.intp)
    kernel = row_kernel()
    compiled = getattr(kernel, "resident", None) if kernel is not None else None
    if compiled is not None:
        return np.frombuffer(compiled(mapped, first, last), np.bool_)
    call = _mincore_call()
    if call is None:
        return None
    base = int(mapped.ctypes.data)
    end = (len(mapped) - 1) // _PAGE
    vec = np.zeros(1, np.uint8)
    address = int(vec.ctypes.data)

    def cached(page: int) -> bool:
        if not 0 <= page <= end or call(base + page * _PAGE, _PAGE, address):
            return False
        return bool(vec[0] & 1)

    spans = zip(first.tolist(), last.tolist(), strict=True)
    return np.array([f <= g and cached(f) and cached(g) for f, g in spans], np.bool_)


def missing(
    mapped: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
) -> npt.NDArray[np.bool_]:
    """Per range ``[offsets[i], offsets[i] + lengths[i])`` of the file ``mapped`` (a
    map of it), whether a page of it is not in the page cache (:func:`resident`: its
    pages, or of a range of more than 32 pages its first and last; ``mincore`` looks
    pages up and faults nothing in, so a file cut short meanwhile is no hazard). A
    range past the file's end, or where ``mincore`` is missing, counts as missing. Of
    more than :data:`SAMPLE` ranges only that many are looked at, spread over them: all
    cached (a warm epoch), all are taken to be; else none is (a hint too many costs a
    lookup in the thread, a hint too few a wait)."""
    n = len(offsets)
    out = np.ones(n, np.bool_)
    size = len(mapped)
    if not n or not size or int(mapped.ctypes.data) % _PAGE:
        return out
    # the ranges looked at: all, or SAMPLE spread over them (only their pages computed)
    picks = np.arange(n) if n <= SAMPLE else np.arange(SAMPLE) * (n - 1) // (SAMPLE - 1)
    at = np.asarray(offsets, np.int64)[picks]
    head = at // _PAGE
    tail = (np.minimum(at + np.asarray(lengths, np.int64)[picks], size) - 1) // _PAGE
    found = resident(mapped, head, tail)
    if found is None:
        return out
    if n <= SAMPLE:
        out[:] = ~found
    elif found.all():
        out[:] = False
    return out


def uncached(
    mapped: npt.NDArray[np.uint8] | None,
    offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The ranges of which a page is not cached (:func:`missing`); all without a map."""
    if mapped is None or not len(offsets):
        return offsets, lengths
    keep = missing(mapped, offsets, lengths)
    return offsets[keep], lengths[keep]


class Advisor:
    """Requests byte ranges of one file ahead from a thread of its own.

    :meth:`request` queues calls (offsets and lengths, each at most the device's cap,
    see :func:`pieces`) and returns at once; a thread named ``blobpipe-readahead``
    makes them in order with ``os.posix_fadvise(WILLNEED)``, which releases the GIL
    and may block while the device's queue is full. The thread opens its own
    descriptor of the file (``opener``: None when the path no longer names the file
    that was opened), closes it when it ends, and ends as soon as the queue is empty:
    an idle Advisor holds no thread and no descriptor. Each call takes the GIL again,
    which the fillers want: request only what is not cached (:func:`uncached`).
    :meth:`close` empties the queue and returns without waiting; the thread stops
    after the call it is in. A hint never
    changes what is read, and a call past the file's end reads nothing, so a file cut
    short or replaced meanwhile costs nothing but the hint. In a child of ``fork()``
    (where the parent's thread does not exist) the queue starts empty.
    """

    def __init__(self, opener: Callable[[], int | None], size: int = 0) -> None:
        self._opener = opener
        self.size = size  # the file's length when the Advisor was made
        self._lock = threading.Lock()
        self._queue: deque[tuple[list[int], list[int]]] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pid = pid()

    @property
    def closed(self) -> bool:
        return self._closed

    def busy(self) -> bool:
        """Whether a thread is requesting (for tests)."""
        return self._thread is not None

    def request(self, offsets: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> None:
        """Queue ``WILLNEED`` calls over ``[offsets[i], offsets[i] + lengths[i])``."""
        if _FADV_WILLNEED is None or not len(offsets) or self._closed:
            return
        if self._pid != pid():  # a fork child: the parent's thread and lock are not ours
            self._lock = threading.Lock()
            self._queue = deque()
            self._thread = None
            self._pid = pid()
        with self._lock:
            if self._closed:
                return
            self._queue.append((offsets.tolist(), lengths.tolist()))
            if self._thread is not None:
                return
            thread = threading.Thread(target=self._run, name="blobpipe-readahead", daemon=True)
            self._thread = thread
            try:
                thread.start()
            except RuntimeError:  # no new threads (the interpreter is finalizing)
                self._thread = None
                self._queue.clear()

    def close(self) -> None:
        """Drop what is queued and stop the thread after its current call; never waits."""
        self._closed = True
        if self._pid != pid():
            return
        with self._lock:
            self._queue.clear()

    def _run(self) -> None:
        fd: int | None = None
        ended = False
        advice = _FADV_WILLNEED or 0  # (request() queues nothing without it)
        try:
            fd = self._opener()
            while fd is not None:
                with self._lock:
                    if self._closed or not self._queue:
                        self._thread = None
                        ended = True
                        return
                    offsets, lengths = self._queue.popleft()
                for at, n in zip(offsets, lengths, strict=True):
                    if self._closed:
                        break
                    try:
                        os.posix_fadvise(fd, at, n, advice)
                    except OSError:
                        break
        finally:
            if not ended:  # no file to read, or an error: forget the queue
                with self._lock:
                    self._thread = None
                    self._queue.clear()
            if fd is not None:
                os.close(fd)


class Requester(Protocol):
    """What :class:`ReadAhead` requests values through (an LmdbReader)."""

    def will_need(
        self,
        indices: npt.NDArray[np.int64],
        max_bytes: int,
        *,
        now: int = 0,
        advisor: Advisor | None = None,
    ) -> tuple[int, int]: ...

    def advisor(self) -> Advisor | None: ...


class ReadAhead:
    """Keeps the values of the next records of each epoch's order requested ahead.

    :meth:`planned` is told where each planned batch ends in the epoch's order; it
    requests the records after it, up to ``window`` bytes (:func:`ahead_window` unless
    given; counting what is requested and not yet planned) and :data:`AHEAD_RECORDS`
    records ahead, each record once: the planned batch's own records before it returns
    (its fillers read them next), the rest through an :class:`Advisor` of its own, in
    the background, in the order the batches read them. A data file that the page
    cache holds with room to spare (:func:`whole_limit`; with a ``window`` given: no
    larger than it) has its epoch requested at the epoch's first batch instead (up to
    :data:`AHEAD_RECORDS_SMALL` records at a time): a cold epoch's reads then keep the
    disk busy from its first batch on. Dropping or closing the ReadAhead stops its
    requests. Single consumer (the planner).
    """

    def __init__(self, source: Requester, window: int | None = None) -> None:
        self._source = source
        # read at the first batch (the memory available then)
        self._window = window
        self._whole = window  # the largest file requested whole
        self._advisor: Advisor | None = None
        self._records = 0  # records requested ahead at most (set at the first batch)
        self._epoch = -1
        self._done = 0  # positions of ``_epoch`` requested: up to here
        self._chunks: deque[tuple[int, int, int]] = deque()  # (start, stop, bytes) requested

    @property
    def window(self) -> int:
        """The bytes kept requested ahead (:func:`ahead_window`; a file requested whole:
        its size, if larger)."""
        if self._window is None:
            available = available_memory()
            self._window = ahead_window(available)
            self._whole = whole_limit(available)
        return self._window

    def close(self) -> None:
        """Stop the requests in flight (the reads the OS started go on)."""
        if self._advisor is not None:
            self._advisor.close()

    def _start(self) -> int:
        """The advisor, and how many records to request ahead at most."""
        window = self.window
        self._advisor = advisor = self._source.advisor()
        if advisor is None:
            return AHEAD_RECORDS
        weakref.finalize(self, advisor.close)
        if not 0 < advisor.size <= (self._whole or 0):
            return AHEAD_RECORDS
        self._window = max(window, advisor.size)  # the whole file fits the budget
        return AHEAD_RECORDS_SMALL

    def planned(self, order: npt.NDArray[np.int64], epoch: int, first: int, stop: int) -> None:
        """A batch was planned over positions ``[first, stop)`` of ``order`` (epoch
        ``epoch``): request its records not requested yet, and what lies ahead."""
        records = self._records or self._start()
        self._records = records
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
        if start > first and start - stop >= records // 2:
            return
        # bytes requested and not yet planned (a chunk planned in part: its share)
        pending = sum(b * (e - max(a, stop)) // (e - a) for a, e, b in chunks)
        budget = self.window - pending
        if start > first and pending >= self.window // 2:
            return
        window = order[start : stop + records]
        if budget <= 0 or not len(window):
            return
        count, nbytes = self._source.will_need(
            window, budget, now=max(0, stop - start), advisor=self._advisor
        )
        if count:
            self._done = start + count
            chunks.append((start, self._done, nbytes))
