"""Reading a cold data file ahead (``_io/_readahead.py``): the calls (cut to what one call
of the OS reads, in the order the batches need them, only for pages not cached), the
Advisor's thread (its own descriptor, never waited for, gone when idle or closed), the
window (a small file's epoch requested at its first batch, a large file's not), and what
must not change: the batches, and the clean errors of a file cut short or replaced.

Eviction needs a file system with a page cache (``posix_fadvise(DONTNEED)``); where it
cannot be evicted (tmpfs) the tests that need a cold file are skipped.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import blobpipe
from blobpipe import Batches, LmdbReader
from blobpipe._io import _readahead
from blobpipe._io._lmdbenv import open_same
from blobpipe._io._readahead import (
    AHEAD_BYTES,
    AHEAD_BYTES_MAX,
    AHEAD_RECORDS_SMALL,
    SAMPLE,
    Advisor,
    ReadAhead,
    advice_cap,
    ahead_window,
    available_memory,
    evict_file,
    missing,
    pieces,
    whole_limit,
)
from tests._helpers import in_forked_child, raw_db, run_script

PAGE = mmap.PAGESIZE


def wait_until(done: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def readahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "blobpipe-readahead"]


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[np.ndarray]:
    """``path`` mapped (never read through: only for ``mincore``)."""
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield np.frombuffer(m, np.uint8)
    finally:
        with contextlib.suppress(BufferError):
            m.close()


def cached(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (``mincore`` through ``ctypes``,
    apart from the code under test)."""
    import ctypes

    call = ctypes.PyDLL(None).mincore
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-path.stat().st_size // PAGE)
    vec = np.zeros(pages, np.uint8)
    with mapped(path) as array:
        assert call(array.ctypes.data, len(array), vec.ctypes.data) == 0
    return float((vec & 1).mean())


@pytest.fixture
def cold_file(tmp_path: Path) -> Path:
    """A 4 MiB file out of the page cache (skips where it cannot be evicted)."""
    path = tmp_path / "cold.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4 << 20, np.uint8).tobytes())
    evict_file(path)
    if cached(path) > 0.5:
        pytest.skip("this file system's page cache cannot be evicted (tmpfs?)")
    return path


# -- the calls ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1 << 22), st.integers(1, 1 << 18)), min_size=1, max_size=60),
    st.integers(1, 8),
    st.sampled_from([0, 4096, 65536]),
    st.sampled_from([0, 4096, 131072, 1 << 20]),
)
def test_pieces_cover_every_range_within_the_cap_group_by_group(
    ranges: list[tuple[int, int]], per_group: int, gap: int, cap: int
) -> None:
    starts = np.array([a for a, _ in ranges], np.int64)
    stops = starts + np.array([n for _, n in ranges], np.int64)
    group = np.arange(len(ranges), dtype=np.int64) // per_group
    at, length = pieces(starts, stops, group=group, gap=gap, cap=cap)
    assert (at % PAGE == 0).all() and (length > 0).all()
    if cap:
        assert (length <= cap).all()
    ends = at + length
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):  # every byte asked for
        covered = a
        for lo, hi in sorted(zip(at.tolist(), ends.tolist(), strict=True)):
            if lo <= covered < hi:
                covered = hi
        assert covered >= b
    # group by group, in order: the same as each group alone, one after another
    alone = [
        pieces(starts[group == g], stops[group == g], gap=gap, cap=cap)
        for g in np.unique(group).tolist()
    ]
    assert at.tolist() == [x for a, _ in alone for x in a.tolist()]
    assert length.tolist() == [x for _, n in alone for x in n.tolist()]


def test_pieces_join_near_ranges_and_cut_long_ones() -> None:
    starts = np.array([0, 10_000, 200_000], np.int64)
    stops = np.array([8_000, 20_000, 210_000], np.int64)
    at, length = pieces(starts, stops, gap=4096)
    assert at.tolist() == [0, 196_608] and length.tolist() == [20_000, 210_000 - 196_608]
    at, length = pieces(np.array([0], np.int64), np.array([3 << 20], np.int64), cap=1 << 20)
    assert at.tolist() == [0, 1 << 20, 2 << 20] and length.tolist() == [1 << 20] * 3
    # in the order given, group by group (sorted within a group)
    at, _ = pieces(
        np.array([50_000, 10_000, 90_000, 30_000], np.int64),
        np.array([51_000, 11_000, 91_000, 31_000], np.int64),
        group=np.array([0, 0, 1, 1], np.int64),
    )
    assert at.tolist() == [8192, 49152, 28672, 86016]


def test_advice_cap_reads_the_device_or_falls_back(tmp_path: Path) -> None:
    cap = advice_cap(os.stat(tmp_path).st_dev)
    assert cap >= 128 << 10 and cap % 1024 == 0
    assert advice_cap(os.makedev(4095, 1048575)) == 128 << 10  # no such device


def test_the_window_follows_the_memory_available() -> None:
    assert ahead_window(None) >= AHEAD_BYTES
    assert ahead_window(1 << 20) == AHEAD_BYTES  # short of memory: the least window
    assert ahead_window(2 << 30) == (2 << 30) // 8
    assert ahead_window(1 << 40) == AHEAD_BYTES_MAX
    # a file requested whole: up to 1/8 of the memory available, however large
    assert whole_limit(1 << 40) == 1 << 37 and whole_limit(1 << 20) == AHEAD_BYTES
    available = available_memory()
    assert available is None or available > 0


@pytest.fixture(params=["compiled", "ctypes"])
def lookup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Pages looked up through the compiled row kernel's ``resident``, or (as where it
    is not built) a ``ctypes`` call of ``mincore`` a page."""
    from blobpipe._io import _readahead

    if request.param == "compiled":
        kernel = _readahead.row_kernel()
        if kernel is None or not hasattr(kernel, "resident"):
            pytest.skip("the compiled row kernel (Linux) is not built here")
    else:
        monkeypatch.setattr(_readahead, "row_kernel", lambda: None)
    return str(request.param)


def test_resident_pages_the_compiled_lookup_and_ctypes_agree(
    cold_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Page by page, cached or not, inside the map or outside it (either side, and the
    partial last page), as ``mincore`` tells it."""
    from blobpipe._io import _readahead

    kernel = _readahead.row_kernel()
    if kernel is None or not hasattr(kernel, "resident"):
        pytest.skip("the compiled row kernel (Linux) is not built here")
    size = cold_file.stat().st_size
    with open(cold_file, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead
        os.pread(f.fileno(), 3 * PAGE, 5 * PAGE)  # pages 5, 6, 7 cached
        os.pread(f.fileno(), PAGE, 100 * PAGE)  # and page 100
    last = (size - 1) // PAGE
    spans = [
        (-1, 0),
        (0, 0),
        (4, 4),
        (5, 5),
        (5, 7),
        (4, 7),
        (5, 8),
        (7, 5),
        (last, last),
        (last, last + 1),
        (last + 1, last + 1),
        (1 << 40, 1 << 40),
    ]
    want = [False, False, False, True, True, False, False, False, False, False, False, False]
    first = np.array([f for f, _ in spans], np.intp)
    final = np.array([g for _, g in spans], np.intp)
    with mapped(cold_file) as array:
        compiled = _readahead.resident(array, first, final)
        assert compiled is not None and compiled.tolist() == want
        # a span of more than 32 pages: its first and last pages looked at
        long = _readahead.resident(array, np.array([5, 8], np.intp), np.array([100, 100], np.intp))
        assert long is not None and long.tolist() == [True, False]
        monkeypatch.setattr(_readahead, "row_kernel", lambda: None)
        by_ctypes = _readahead.resident(array, first, final)
        assert by_ctypes is not None and by_ctypes.tolist() == [
            False,
            False,
            False,
            True,
            True,
            False,
            False,
            False,
            False,
            False,
            False,
            False,
        ]
        with pytest.raises(ValueError, match="page boundary"):
            kernel.resident(array[1:], first, final)
        with pytest.raises(ValueError, match="first must be intp"):
            kernel.resident(array, first.astype(np.int32), final)
        with pytest.raises(ValueError, match="one length"):
            kernel.resident(array, first, final[:-1])
        assert kernel.resident(array, first[:0], final[:0]) == b""


def test_missing_tells_cached_pages(cold_file: Path, lookup: str) -> None:
    size = cold_file.stat().st_size
    with open(cold_file, "rb") as f:
        os.pread(f.fileno(), 64 << 10, 1 << 20)  # cache [1 MiB, 1 MiB + 64 KiB)
    with mapped(cold_file) as array:
        at = np.array([1 << 20, (1 << 20) + 4096, 3 << 20, size - 10, size + PAGE], np.int64)
        length = np.array([4096, 8192, 4096, 10, 100], np.int64)
        assert missing(array, at, length).tolist() == [False, False, True, True, True]
        # a range counts as cached when its first and last pages are
        assert missing(array, np.array([1 << 20], np.int64), np.array([2 << 20], np.int64))[0]
        # many ranges: all cached (told from a sample), else all taken as missing
        cached_ones = (1 << 20) + PAGE * np.arange(16, dtype=np.int64)
        cold_ones = (3 << 20) + PAGE * np.arange(40, dtype=np.int64)
        one = np.full(100, PAGE, np.int64)
        assert not missing(array, np.repeat(cached_ones, 4)[:60], one[:60]).any()
        assert missing(array, cold_ones, one[:40]).all()
        mixed = np.concatenate([cold_ones, cached_ones])
        assert missing(array, mixed, one[:56]).all()


# -- the Advisor -------------------------------------------------------------------------------


def opener_of(path: Path) -> Callable[[], int | None]:
    return lambda: os.open(path, os.O_RDONLY)


def test_the_advisor_reads_ahead_in_its_thread_and_ends_when_done(cold_file: Path) -> None:
    size = cold_file.stat().st_size
    advisor = Advisor(opener_of(cold_file), size)
    at = np.arange(0, size, 1 << 20, dtype=np.int64)
    advisor.request(at, np.full(len(at), 1 << 20, np.int64))
    assert wait_until(lambda: cached(cold_file) == 1.0)
    assert wait_until(lambda: not advisor.busy())  # idle: no thread, no descriptor
    assert wait_until(lambda: not readahead_threads())
    advisor.request(at[:1], np.array([PAGE], np.int64))  # a new request, a new thread
    assert wait_until(lambda: not advisor.busy())


def test_closing_the_advisor_never_waits_and_its_thread_closes_its_descriptor(
    tmp_path: Path,
) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100_000)
    gate = threading.Event()
    opened: list[int] = []

    def slow_opener() -> int:  # a thread that is slow to start its calls
        gate.wait(10)
        fd = os.open(path, os.O_RDONLY)
        opened.append(fd)
        return fd

    advisor = Advisor(slow_opener, 100_000)
    advisor.request(np.array([0], np.int64), np.array([100_000], np.int64))
    t0 = time.monotonic()
    advisor.close()
    assert time.monotonic() - t0 < 0.5 and advisor.closed
    advisor.request(np.array([0], np.int64), np.array([4096], np.int64))  # closed: ignored
    gate.set()
    assert wait_until(lambda: not advisor.busy() and not readahead_threads())
    assert len(opened) == 1
    try:
        st = os.fstat(opened[0])
    except OSError:
        pass  # closed
    else:  # the number was taken again since: by another file
        assert st.st_ino != os.stat(path).st_ino


def test_an_advisor_without_its_file_drops_its_requests() -> None:
    advisor = Advisor(lambda: None, 10)
    advisor.request(np.array([0], np.int64), np.array([10], np.int64))
    assert wait_until(lambda: not advisor.busy())
    assert not readahead_threads() or wait_until(lambda: not readahead_threads())


def test_an_advisor_in_a_fork_child_starts_its_own_thread(cold_file: Path) -> None:
    size = cold_file.stat().st_size
    advisor = Advisor(opener_of(cold_file), size)
    gate = threading.Event()
    parent = os.getpid()
    # in the parent its thread holds on (a thread the child does not have)
    blocked = Advisor(lambda: None if os.getpid() != parent else gate.wait(10) and None, 1)
    blocked.request(np.array([0], np.int64), np.array([1], np.int64))

    def child() -> bool:
        # the parent's thread is not here; the child's requests start a thread of its own
        blocked.request(np.array([0], np.int64), np.array([1], np.int64))
        advisor.request(np.array([0], np.int64), np.array([size], np.int64))
        return wait_until(lambda: not advisor.busy() and not blocked.busy(), 20)

    assert in_forked_child(child) == 0
    gate.set()
    assert wait_until(lambda: not blocked.busy())


def test_opening_the_file_again_refuses_another_file_and_never_blocks(tmp_path: Path) -> None:
    path = tmp_path / "data.mdb"
    path.write_bytes(b"x" * 10)
    st = os.stat(path)
    fd = open_same(str(path), (st.st_dev, st.st_ino))
    assert fd is not None
    os.close(fd)
    held = os.open(path, os.O_RDONLY)  # as a reader's map holds it: its inode stays taken
    try:
        path.unlink()
        path.write_bytes(b"y" * 10)  # replaced: another inode
        assert open_same(str(path), (st.st_dev, st.st_ino)) is None
        path.unlink()
        os.mkfifo(path)  # a FIFO in its place: opened without waiting for a writer, refused
        t0 = time.monotonic()
        assert open_same(str(path), (st.st_dev, st.st_ino)) is None
        assert time.monotonic() - t0 < 1
        assert open_same(str(tmp_path / "gone"), (st.st_dev, st.st_ino)) is None
    finally:
        os.close(held)


# -- the window ------------------------------------------------------------------------------


class Source:
    """Records each will_need call; every record is 10 bytes; the file ``size`` bytes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls: list[tuple[list[int], int]] = []

    def will_need(
        self, indices: np.ndarray, max_bytes: int, *, now: int = 0, advisor: object = None
    ) -> tuple[int, int]:
        count = max(1, min(len(indices), max_bytes // 10))
        self.calls.append((indices[:count].tolist(), now))
        return count, 10 * count

    def advisor(self) -> Advisor:
        return Advisor(lambda: None, self.size)


@pytest.mark.parametrize("size", [2000, 5000])
def test_a_file_within_the_window_is_requested_whole_at_its_first_batch(
    monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    monkeypatch.setattr(_readahead, "AHEAD_RECORDS", 50)
    order = np.arange(200, dtype=np.int64)[::-1].copy()  # 200 records, 2000 bytes
    src = Source(size)
    ahead = ReadAhead(src, window=4096)
    for stop in range(8, 201, 8):  # batches of 8
        ahead.planned(order, 0, stop - 8, stop)
    first, now = src.calls[0]
    assert now == 8  # the batch's own records before planned() returns
    if size <= 4096:  # the file fits the window: its epoch at once, in the batches' order
        assert first == order.tolist() and len(src.calls) == 1
    else:  # larger than the window: a window of records ahead at a time
        assert first == order[: 8 + 50].tolist()
        assert sorted(i for call, _ in src.calls for i in call) == list(range(200))
        assert all(len(call) <= 58 for call, _ in src.calls)
    ahead.planned(order, 1, 0, 8)  # the next epoch starts over
    assert src.calls[-1][0][0] == order[0]
    ahead.close()


def test_a_small_file_is_requested_at_most_so_many_records_at_a_time() -> None:
    order = np.arange(AHEAD_RECORDS_SMALL + 500, dtype=np.int64)
    src = Source(1000)
    ahead = ReadAhead(src, window=1 << 40)
    ahead.planned(order, 0, 0, 100)
    assert len(src.calls[0][0]) == AHEAD_RECORDS_SMALL + 100


# -- a database read cold --------------------------------------------------------------------


def epoch(db: Path | LmdbReader) -> list[tuple[np.ndarray, np.ndarray]]:
    with Batches(db, 7, order="shuffle", mode="epoch", seed=3) as b:
        return [(x.data.copy(), x.label.copy()) for x in b]


@pytest.fixture
def cold_db(tmp_path: Path) -> Path:
    db = raw_db(tmp_path / "db", 120, shape=(3, 40, 40))  # one overflow value each
    evict_file(db / "data.mdb")
    if cached(db / "data.mdb") > 0.5:
        pytest.skip("this file system's page cache cannot be evicted (tmpfs?)")
    return db


def test_a_cold_epoch_reads_ahead_and_gives_the_same_batches(
    cold_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = cold_db / "data.mdb"
    calls: list[int] = []
    real = Advisor.request

    def request(self: Advisor, at: np.ndarray, length: np.ndarray) -> None:
        calls.append(len(at))
        real(self, at, length)

    monkeypatch.setattr(Advisor, "request", request)
    cold = epoch(cold_db)
    assert calls and calls[0] > 0  # the epoch's records after the first batch: requested
    assert cached(data) > 0.9
    calls.clear()
    warm = epoch(cold_db)
    assert sum(calls) == 0  # all cached: no call goes out, no thread starts
    evict_file(data)
    monkeypatch.setattr(ReadAhead, "planned", lambda *a: None)  # no read-ahead at all
    plain = epoch(cold_db)
    for a, b, c in zip(cold, warm, plain, strict=True):
        for x, y, z in zip(a, b, c, strict=True):
            assert np.array_equal(x, y) and np.array_equal(x, z)
    assert wait_until(lambda: not readahead_threads())


def test_the_records_read_at_open_are_requested_together_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records an open reads to tell the database's kind (its first and eight spread
    over it): all requested in one ``will_need`` before the first is read, so a cold
    file reads them at once, not a B-tree descent and a value after another."""
    events: list[tuple[str, object]] = []
    will_need, get = LmdbReader.will_need, LmdbReader.get

    def requesting(self: LmdbReader, indices: np.ndarray, *args: object, **kw: object) -> object:
        events.append(("request", [int(i) for i in indices]))
        return will_need(self, indices, *args, **kw)  # type: ignore[arg-type]

    def reading(self: LmdbReader, key: bytes) -> bytes:
        events.append(("read", key))
        return get(self, key)

    monkeypatch.setattr(LmdbReader, "will_need", requesting)
    monkeypatch.setattr(LmdbReader, "get", reading)
    with Batches(raw_db(tmp_path / "db", 120, shape=(3, 40, 40)), 4) as b:
        keys = list(b._sources[0].keys)
    kind, first = events[0]
    assert kind == "request", events
    assert isinstance(first, list) and len(set(first)) == 9 and {0, 119} <= set(first)
    read = [keys.index(k) for what, k in events if what == "read"]
    assert len(read) == 9 and set(read) == set(first), events


def test_will_need_with_an_advisor_requests_the_rest_in_the_background(cold_db: Path) -> None:
    with LmdbReader(cold_db) as r:
        size = len(r.get(r.keys()[0]))
        evict_file(cold_db / "data.mdb")
        advisor = r.advisor()
        assert advisor is not None and advisor.size == (cold_db / "data.mdb").stat().st_size
        order = np.random.default_rng(0).permutation(len(r)).astype(np.int64)
        assert r.will_need(order, 1 << 30, now=5, advisor=advisor) == (len(r), len(r) * size)
        assert wait_until(lambda: cached(cold_db / "data.mdb") > 0.9)
    assert advisor.closed  # closed with its reader
    assert wait_until(lambda: not advisor.busy())


def test_will_need_of_a_warm_file_sorts_and_joins_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch's request over a file in the page cache (its sample of records cached)
    returns what it would have requested, without making ranges (a millisecond per
    20,000 records, once an epoch, holding the GIL); a cold one still makes them."""
    from blobpipe._io import _lmdb

    made: list[int] = []
    real = _lmdb.pieces
    monkeypatch.setattr(_lmdb, "pieces", lambda *a, **k: made.append(1) or real(*a, **k))
    db = raw_db(tmp_path / "warm", 300, shape=(3, 32, 32))
    with LmdbReader(db) as r:
        order = np.random.default_rng(2).permutation(len(r)).astype(np.int64)
        keys = r.keys()
        sizes = [len(r.get(k)) for k in keys]  # every value read: cached
        whole = (300, sum(sizes))
        advisor = Recorder(lambda: None)
        assert r.will_need(order, 1 << 30, now=5, advisor=advisor) == whole
        part = sum(sizes[i] for i in order[:100].tolist())
        assert r.will_need(order, part, now=5, advisor=advisor) == (100, part)
        assert made == [] and advisor.requests == []
        assert r.will_need(order[:SAMPLE], 1 << 30, now=5, advisor=advisor)[0] == SAMPLE
        assert r.will_need(order[:3], 1 << 30)[0] == 3
        assert made == []  # few records: each looked at, all cached
        # a page of the sample out of the cache (told as mincore would; an open map's
        # pages cannot be evicted here): the ranges are made and requested
        monkeypatch.setattr(_lmdb, "missing", lambda m, at, n: np.ones(len(at), np.bool_))
        monkeypatch.setattr(_lmdb, "uncached", lambda m, at, n: (at, n))
        assert r.will_need(order, 1 << 30, now=5, advisor=advisor) == whole
        assert made and advisor.requests


class Recorder(Advisor):
    """An advisor that records its requests and makes none."""

    def __init__(self, opener: Callable[[], int | None]) -> None:
        super().__init__(opener)
        self.requests: list[np.ndarray] = []

    def request(self, at: np.ndarray, length: np.ndarray) -> None:
        self.requests.append(at.copy())


def test_values_go_out_in_the_batches_order_and_small_ones_in_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large values are requested in the order given (here each its own stretch); small
    ones, which join into long runs anyway, sorted by place: one sweep."""
    from blobpipe._io import _lmdb

    monkeypatch.setattr(_lmdb, "AHEAD_GROUP_BYTES", 1)
    big = raw_db(tmp_path / "big", 160, shape=(3, 150, 150))  # 67.5 KB values, 11 MB
    small = raw_db(tmp_path / "small", 3000, shape=(3, 32, 32))  # 3 KB values, 12 MB
    for db, dense in ((big, False), (small, True)):
        evict_file(db / "data.mdb")
        if cached(db / "data.mdb") > 0.5:
            pytest.skip("this file system's page cache cannot be evicted (tmpfs?)")
        got: list[np.ndarray] = []

        class Recorder(Advisor):
            def request(self, at: np.ndarray, length: np.ndarray, out: list = got) -> None:
                out.append(at.copy())

        with LmdbReader(db) as r:
            order = np.random.default_rng(1).permutation(len(r)).astype(np.int64)
            r.will_need(order, 1 << 30, now=0, advisor=Recorder(lambda: None))
            offsets = r._shared.tree.offsets  # type: ignore[union-attr]
            if dense:
                assert len(got[0]) >= 1 and (np.diff(got[0]) > 0).all()
            else:  # (the records that opening the reader read are cached: not asked for)
                want = (offsets[order] // PAGE * PAGE).tolist()
                assert len(got[0]) >= 80
                assert got[0].tolist() == [x for x in want if x in set(got[0].tolist())]
                assert got[0].tolist() != sorted(got[0].tolist())


def test_closing_a_loader_stops_its_read_ahead(cold_db: Path) -> None:
    loader = blobpipe.Loader(cold_db, 4, device="cpu", shuffle=True, mode="epoch", prefetch=2)
    with loader:
        next(iter(loader))
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5
    assert wait_until(lambda: not readahead_threads())


_CUT_WHILE_AHEAD = """
    import os, sys, threading
    import blobpipe

    db = sys.argv[1]
    data = os.path.join(db, "data.mdb")
    fd = os.open(data, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    smaller = open(os.path.join(sys.argv[2], "data.mdb"), "rb").read()
    try:
        with blobpipe.Batches(db, 4, mode="epoch", order="shuffle") as b:
            it = iter(b)
            next(it)  # the epoch's records requested ahead
            with open(data, "r+b") as f:  # cp over it, while the requests go out
                f.truncate(0)
                f.write(smaller)
            for _ in it:
                pass
        print("no error")
    except blobpipe.DataError as exc:
        print("clean:", exc)
    alive = [t for t in threading.enumerate() if t.name == "blobpipe-readahead"]
    for t in alive:
        t.join(10)
    print("threads:", sum(t.is_alive() for t in alive))
"""


def test_a_file_cut_while_it_is_read_ahead_is_the_clean_error(tmp_path: Path) -> None:
    db = raw_db(tmp_path / "big", 300, shape=(3, 40, 40))
    small = raw_db(tmp_path / "small", 5, shape=(3, 40, 40))
    done = run_script(_CUT_WHILE_AHEAD, str(db), str(small), timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "clean: the database changed while it was being read" in done.stdout, done.stdout
    assert "threads: 0" in done.stdout


def test_a_file_replaced_while_it_is_read_gives_the_same_batches(tmp_path: Path) -> None:
    db = raw_db(tmp_path / "db", 60, shape=(3, 40, 40))
    want = epoch(db)
    other = raw_db(tmp_path / "other", 60, shape=(3, 20, 20))
    evict_file(db / "data.mdb")
    with Batches(db, 7, order="shuffle", mode="epoch", seed=3) as b:
        it = iter(b)
        got = [next(it)]
        # a new file renamed over the path: the open maps keep the old one; the read-ahead
        # finds the path naming another file and requests nothing from it
        os.replace(other / "data.mdb", db / "data.mdb")
        got += list(it)
    for (x, y), z in zip(want, got, strict=True):
        assert np.array_equal(x, z.data) and np.array_equal(y, z.label)
    assert wait_until(lambda: not readahead_threads())
