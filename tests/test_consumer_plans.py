"""Small batches of raw records planned on the consumer's thread, their rows written by
native threads that never take the GIL (``Pipeline.pump``, ``_rowkernel.Pool``).

The content tests of ``test_loader.py`` run through this path wherever their batches
are small and raw; here: the pool against the kernel called in place, that the path is
taken and the fillers stand aside, what leaves it, keeping batches, failures that
surface only after the rows were written, and the close while rows are being written.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blobpipe
from blobpipe import Batches, DataError, Loader
from blobpipe._io import _fill, _kernels
from blobpipe._loader import _async, _chunk, _pipeline
from blobpipe._loader._chunk import RowsWritten
from tests._helpers import encoded_db, raw_db
from tests.conftest import make_backend
from tests.test_loader import Got, PoolWatch, assert_matches, collect, expected, fillers_plan

pytestmark = pytest.mark.skipif(
    _kernels.row_kernel() is None, reason="the compiled row kernel was not built"
)


# -- the pool ------------------------------------------------------------------------


def _rows_args(rng: np.random.Generator, n: int, shape: tuple[int, int, int], crop: int) -> Any:
    c, h, w = shape
    src = rng.integers(0, 256, size=n * c * h * w + 7, dtype=np.uint8)
    offsets = (np.arange(n, dtype=np.int64) * c * h * w + 7)[rng.permutation(n)]
    ch = crop or h
    cw = crop or w
    h_off = rng.integers(0, h - ch + 1, size=n).astype(np.intp)
    w_off = rng.integers(0, w - cw + 1, size=n).astype(np.intp)
    mirror = rng.integers(0, 2, size=n).astype(np.bool_)
    mean = rng.random(c * h * w, dtype=np.float32) * 100
    return src, offsets, h_off, w_off, mirror, mean, (c, ch, cw)


def _placed(shape: tuple[int, ...], shift: int) -> np.ndarray:
    """A float32 array of ``shape`` full of NaN, its data ``shift`` bytes past a 64-byte
    boundary (0: on one: the pool's streamed stores take its whole, aligned lines)."""
    n = int(np.prod(shape))
    raw = np.empty(4 * n + 128, np.uint8)
    at = (-raw.ctypes.data) % 64 + shift
    out = raw[at : at + 4 * n].view(np.float32).reshape(shape)
    out[...] = np.nan
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shift", [0, 4])
@pytest.mark.parametrize(
    ("shape", "crop", "outs", "nhwc"),
    [
        ((1, 28, 28), 0, 1, 0),  # whole planes of 784 pixels
        ((3, 32, 32), 0, 2, 0),  # whole planes, and mirrored lines of 32
        ((3, 32, 32), 16, 2, 0),  # cropped lines of 16: whole cache lines
        ((3, 32, 32), 28, 3, 0),  # lines of 28: never streamed
        ((3, 40, 40), 33, 2, 1),  # NHWC: never streamed
    ],
)
def test_a_pool_writes_what_the_kernel_writes_in_place(
    shape: tuple[int, int, int], crop: int, outs: int, nhwc: int, shift: int, stream: bool
) -> None:
    """The same bytes from a pool's threads as from the kernel called in place, stored
    as usual or (``Pool.stream``) around the caches, into outputs on a cache line's
    boundary or 4 bytes past it (which the streamed stores leave to the usual ones)."""
    kernel = _kernels.row_kernel()
    rng = np.random.default_rng(sum(shape) + crop)
    n = 6 * outs
    src, offsets, h_off, w_off, mirror, mean, (c, ch, cw) = _rows_args(rng, n, shape, crop)
    row = (ch, cw, c) if nhwc else (c, ch, cw)

    def out() -> Any:
        parts = [_placed((6, *row), shift) for _ in range(outs)]
        return parts, parts[0] if outs == 1 else tuple(parts)

    want, want_arg = out()
    args = (h_off, w_off, mirror, mean, 0.5)
    kernel.transform_rows(src, offsets, shape, *args, want_arg, crop, nhwc)
    pool = kernel.Pool(2)
    assert pool.stream is False
    pool.stream = stream
    assert pool.stream is stream
    jobs = []
    gots = []
    for _ in range(5):  # several queued at once
        got, got_arg = out()
        jobs.append(pool.start(src, offsets, shape, *args, got_arg, crop, nhwc))
        gots.append(got)
    for job, got in zip(jobs, gots, strict=True):
        job.synchronize()
        assert job.query()
        for a, b in zip(got, want, strict=True):
            assert a.tobytes() == b.tobytes()
    pool.close()


@settings(max_examples=60, deadline=None)
@given(
    channels=st.sampled_from([1, 3]),
    height=st.integers(1, 40),
    width=st.integers(1, 70),
    crop=st.integers(0, 40),
    nhwc=st.booleans(),
    shift=st.sampled_from([0, 4, 32]),
    seed=st.integers(0, 2**16),
)
def test_streamed_rows_are_the_kernels_rows_at_any_shape(
    channels: int, height: int, width: int, crop: int, nhwc: bool, shift: int, seed: int
) -> None:
    """Fuzzed shapes, crops (lines of any width, whole cache lines or not), mirrors, a
    mean file, outputs on or off a cache line's boundary: a streaming pool writes the
    kernel's bytes."""
    crop = crop if 0 < crop <= min(height, width) else 0
    if nhwc and channels != 3:
        nhwc = False
    shape = (channels, height, width)
    kernel = _kernels.row_kernel()
    rng = np.random.default_rng(seed)
    src, offsets, h_off, w_off, mirror, mean, (c, ch, cw) = _rows_args(rng, 5, shape, crop)
    row = (ch, cw, c) if nhwc else (c, ch, cw)
    want, got = _placed((5, *row), shift), _placed((5, *row), shift)
    args = (h_off, w_off, mirror, mean, 0.5)
    kernel.transform_rows(src, offsets, shape, *args, want, crop, nhwc)
    pool = kernel.Pool(1)
    pool.stream = True
    pool.start(src, offsets, shape, *args, got, crop, nhwc).synchronize()
    pool.close()
    assert got.tobytes() == want.tobytes()


def test_a_pool_checks_the_call_when_it_starts_and_refuses_after_close() -> None:
    kernel = _kernels.row_kernel()
    rng = np.random.default_rng(1)
    src, offsets, h_off, w_off, mirror, mean, _ = _rows_args(rng, 4, (3, 8, 8), 0)
    pool = kernel.Pool(1)
    out = np.empty((4, 3, 8, 8), np.float32)
    bad = offsets.copy()
    bad[2] = len(src)  # outside the buffer: refused before anything is queued
    with pytest.raises(ValueError, match="row 2 lies outside the buffer"):
        pool.start(src, bad, (3, 8, 8), h_off, w_off, mirror, mean, 1.0, out, 0, 0)
    with pytest.raises(ValueError, match=r"whole number of rows|n rows"):
        pool.start(src, offsets, (3, 8, 8), h_off, w_off, mirror, mean, 1.0, out[:3], 0, 0)
    # a job let go of before it ran: freeing it waits for it, the buffer stays held
    # (exported) until then, and the output is written
    pool.start(src, offsets, (3, 8, 8), h_off, w_off, mirror, None, 2.0, out, 0, 0)
    want = np.empty_like(out)
    kernel.transform_rows(src, offsets, (3, 8, 8), h_off, w_off, mirror, None, 2.0, want, 0, 0)
    assert out.tobytes() == want.tobytes()
    job = pool.start(src, offsets, (3, 8, 8), h_off, w_off, mirror, None, 2.0, out, 0, 0)
    pool.close()  # the queued job runs first
    assert job.query()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.start(src, offsets, (3, 8, 8), h_off, w_off, mirror, None, 2.0, out, 0, 0)
    with pytest.raises(ValueError, match="threads"):
        kernel.Pool(0)


_NEVER_RUN: list[Any] = []  # a job no thread would run: freeing it would wait for good


def test_a_close_that_lands_inside_a_start_refuses_its_job_and_lets_go_of_its_buffers() -> None:
    """``Pool.start`` queues its job without the GIL, so a close in another thread can
    run meanwhile; the start then raises "closed" rather than queue a job whose
    threads have ended (no thread would run it: its wait would never end), and holds
    none of its buffers after."""
    kernel = _kernels.row_kernel()
    rng = np.random.default_rng(3)
    src, offsets, h_off, w_off, mirror, mean, _ = _rows_args(rng, 2, (3, 4, 4), 0)
    out = np.empty((2, 3, 4, 4), np.float32)
    args = (src, offsets, (3, 4, 4), h_off, w_off, mirror, mean, 1.0, out, 0, 0)
    pool = kernel.Pool(1)
    pool.start(*args).synchronize()  # its thread started
    base = sys.getrefcount(src), sys.getrefcount(out)
    result: dict[str, Any] = {}

    def starter() -> None:
        try:
            result["job"] = pool.start(*args)
        except RuntimeError as exc:
            result["error"] = str(exc)

    kernel._pause_starts(0.3)
    try:
        thread = threading.Thread(target=starter)
        thread.start()
        time.sleep(0.1)  # the start is in its pause, the GIL released
        pool.close()
        thread.join(30)
    finally:
        kernel._pause_starts(0)
    assert not thread.is_alive()
    if "job" in result:
        job = result.pop("job")
        ran = job.wait(5.0)
        if not ran:
            _NEVER_RUN.append(job)
        pytest.fail(f"the start queued a job on a closing pool (ran: {ran})")
    assert "closed" in result["error"]
    assert (sys.getrefcount(src), sys.getrefcount(out)) == base  # every buffer let go
    with pytest.raises(ValueError, match="seconds"):
        kernel._pause_starts(-1.0)


def _claimed_by_the_pool(job: Any) -> None:
    """Until a pool thread claimed every row of ``job`` (it is being written)."""
    deadline = time.monotonic() + 30
    while job.rows()[0] < job.rows()[2]:
        assert time.monotonic() < deadline, "no pool thread took the job"
        time.sleep(0.0005)


def test_a_waiter_writes_the_rows_no_thread_took_and_waits_at_most_the_time_given() -> None:
    """A job queued behind another is written by its waiter (``synchronize``, and
    ``wait(seconds)`` for seconds > 0), a block at a time, while the pool's one thread
    is still on the other; rows all claimed by a pool thread it waits for, at most about
    the time given (False until they are written, True once they are);
    ``Deferral.wait(seconds)`` over its jobs."""
    kernel = _kernels.row_kernel()
    rng = np.random.default_rng(2)
    pool = kernel.Pool(1)
    # one row of 3×3072×3072 (108 MiB of float32 to write: tens of ms), a block alone
    big = _rows_args(rng, 1, (3, 3072, 3072), 0)
    src, offsets, h_off, w_off, mirror, mean, _ = big
    big_out = np.empty((1, 3, 3072, 3072), np.float32)
    small = _rows_args(rng, 4, (3, 8, 8), 0)
    small_out = np.full((4, 3, 8, 8), np.nan, np.float32)
    s_src, s_off, s_h, s_w, s_mirror, s_mean, _ = small
    want = np.empty_like(small_out)
    kernel.transform_rows(s_src, s_off, (3, 8, 8), s_h, s_w, s_mirror, s_mean, 0.5, want, 0, 0)

    def small_job() -> Any:
        small_out.fill(np.nan)
        return pool.start(s_src, s_off, (3, 8, 8), s_h, s_w, s_mirror, s_mean, 0.5, small_out,
                          0, 0)  # fmt: skip

    first = pool.start(src, offsets, (3, 3072, 3072), h_off, w_off, mirror, mean, 1.0,
                       big_out, 0, 0)  # fmt: skip
    _claimed_by_the_pool(first)
    job = small_job()
    assert job.wait(0) is False  # no time given: nothing written here
    job.synchronize()  # written here: the pool's thread is still on the big row
    assert job.rows() == (4, 4, 4) and first.rows()[1] == 0
    assert small_out.tobytes() == want.tobytes()
    job = small_job()
    assert job.wait(60) is True and first.rows()[1] == 0  # the same, timed
    assert small_out.tobytes() == want.tobytes()
    t0 = time.monotonic()
    ran = first.wait(0.001)  # every row claimed: it waits, and writes nothing
    waited = time.monotonic() - t0
    if ran:  # (a fast machine: written within the millisecond, by the pool's thread)
        assert first.rows() == (1, 1, 1)
    else:
        assert waited >= 0.0009
    assert first.wait(60) is True
    big_want = np.empty_like(big_out)
    kernel.transform_rows(src, offsets, (3, 3072, 3072), h_off, w_off, mirror, mean, 1.0,
                          big_want, 0, 0)  # fmt: skip
    assert big_out.tobytes() == big_want.tobytes()
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="seconds"):
            job.wait(bad)
    with pytest.raises(TypeError):
        job.wait("1")
    # a deferral waits for all its jobs within the time given
    deferral = _kernels.Deferral(pool)
    deferral.jobs.append(pool.start(src, offsets, (3, 3072, 3072), h_off, w_off, mirror, mean,
                                    1.0, big_out, 0, 0))  # fmt: skip
    _claimed_by_the_pool(deferral.jobs[0])
    deferral.jobs.append(small_job())
    assert deferral.wait(0) is False
    assert deferral.wait(60) is True and deferral.query()
    pool.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_pool_and_a_waiter_share_a_jobs_rows(threads: int) -> None:
    """A job's rows are claimed a block at a time by the pool's threads and by its
    waiter, so whoever writes which rows, the output is the kernel's in place: over
    row sizes on both sides of the block's byte limit, crops, mirrors, NHWC, several
    outputs taking the rows in turn, and streamed stores."""
    kernel = _kernels.row_kernel()
    rng = np.random.default_rng(4 + threads)
    for n, shape, crop, nhwc, stream in (
        (1024, (1, 28, 28), 0, 0, False),
        (640, (3, 32, 32), 0, 0, True),
        (333, (3, 40, 40), 32, 0, False),
        (257, (3, 64, 64), 56, 1, True),
        (96, (3, 80, 80), 64, 0, False),
        (9, (3, 200, 200), 0, 0, True),  # rows over the block's bytes: a row a block
    ):
        pool = kernel.Pool(threads)
        pool.stream = stream
        src, offsets, h_off, w_off, mirror, mean, _ = _rows_args(rng, n, shape, crop)
        side = crop or shape[1]
        row = (side, side, shape[0]) if nhwc else (shape[0], side, side)
        parts = [_placed((m, *row), 0) for m in (n // 3, n - n // 3)]
        want = np.full((n, *row), np.nan, np.float32)
        kernel.transform_rows(src, offsets, shape, h_off, w_off, mirror, mean, 0.5, want,
                              crop, nhwc)  # fmt: skip
        for _ in range(3):
            for part in parts:
                part.fill(np.nan)
            job = pool.start(src, offsets, shape, h_off, w_off, mirror, mean, 0.5, tuple(parts),
                             crop, nhwc)  # fmt: skip
            job.synchronize()  # at once: blocks no pool thread took yet are written here
            assert job.rows() == (n, n, n)
            assert np.concatenate(parts).tobytes() == want.tobytes()
        pool.close()


def _start_in_child(pool: Any, queue: Any) -> None:
    src = np.zeros(48, np.uint8)
    z = np.zeros(1, np.intp)
    try:
        pool.start(src, np.zeros(1, np.int64), (3, 4, 4), z, z, np.zeros(1, np.bool_), None,
                   1.0, np.empty((1, 3, 4, 4), np.float32), 0, 0)  # fmt: skip
    except RuntimeError as exc:
        queue.put(str(exc))
    else:
        queue.put("started")


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="no fork on this platform"
)
def test_a_pool_made_in_the_parent_refuses_work_in_a_forked_child() -> None:
    pool = _kernels.row_pool(1)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_start_in_child, args=(pool, queue))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert "another process" in queue.get(timeout=10)
    pool.close()


# -- the Loader ----------------------------------------------------------------------


def _filler_fills(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that call Batches.fill or fill_parts, one a call."""
    names: list[str] = []
    for name in ("fill", "fill_parts"):
        original = getattr(Batches, name)

        def wrapped(self: Batches, *args: Any, _original: Any = original, **kw: Any) -> Any:
            names.append(threading.current_thread().name)
            return _original(self, *args, **kw)

        monkeypatch.setattr(Batches, name, wrapped)
    return names


@pytest.mark.parametrize("device", ["host", "emulated"])
@pytest.mark.parametrize("form", ["blocking", "async"])
def test_small_raw_batches_are_planned_by_the_consumer(
    tmp_path: Path, device: str, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a filler found batches small, the consumer plans them: no filler fills
    another, every batch is what Batches makes (three epochs, TRAIN crops and mirrors,
    shuffled), and the ring's memory stays as it was once every slot was filled."""
    db = raw_db(tmp_path / "db", 300)
    names = _filler_fills(monkeypatch)
    options: dict[str, Any] = {
        "transform": blobpipe.Transform(crop_size=8, mirror=True, scale=0.5),
        "phase": "train",
        "order": "shuffle",
        "seed": 5,
        "mode": "wrap",
    }
    n = 3 * 300 // 4
    backend = make_backend(device)
    watch = PoolWatch(backend)
    loader = Loader(db, 4, device=backend, workers=2, **options)
    if form == "blocking":
        with loader:
            got = [Got.of(b) for _, b in zip(range(n), loader, strict=False)]
            here = loader._pipe._here
    else:

        async def run() -> tuple[list[Got], bool]:
            async with loader:
                got = await collect(loader, n)
                return got, loader._pipe._here

        got, here = anyio.run(run)
    assert here
    assert_matches(got, expected(db, n, batch_size=4, **options))
    # the fillers filled the first batches, then stood aside
    assert 1 <= sum(name.startswith("blobpipe-filler") for name in names) <= 4
    watch.assert_returned()


@pytest.mark.parametrize(("cpus", "workers", "threads"), [
    (1, 2, 1), (2, 1, 1), (2, 2, 1), (2, 8, 1), (3, 2, 2), (3, 1, 1), (64, 2, 2), (64, 64, 2),
])  # fmt: skip
def test_the_consumers_pool_leaves_it_a_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int, workers: int, threads: int
) -> None:
    """The consumer writes rows too (its waits write those no pool thread took), so its
    pool has a thread for each chunk it starts at once (2, or ``workers``), at most one
    fewer than the CPUs the process may run on, and at least one; the batches are the
    same either way."""
    made: list[int] = []
    row_pool = _kernels.row_pool

    def counted(n: int) -> Any:
        made.append(n)
        return row_pool(n)

    monkeypatch.setattr(_pipeline, "row_pool", counted)
    monkeypatch.setattr(_chunk.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    db = raw_db(tmp_path / "db", 120)
    options: dict[str, Any] = {"transform": blobpipe.Transform(scale=0.5), "mode": "wrap"}
    with Loader(db, 4, device="cpu", workers=workers, **options) as loader:
        got = [Got.of(b) for _, b in zip(range(90), loader, strict=False)]
        assert loader._pipe._here
    assert made == [threads]
    assert_matches(got, expected(db, 90, batch_size=4, **options))


def slow_pool(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A slow pool: a chunk's rows read as written only once someone waited for them
    (``Deferral.query`` says False until then), so the consumer always waits for its
    chunks. Returns the list that the timed waits' limits are appended to."""
    query, wait = _kernels.Deferral.query, _kernels.Deferral.wait
    waited: set[_kernels.Deferral] = set()  # (by identity)
    timed: list[float] = []

    def slow_query(self: _kernels.Deferral) -> bool:
        return self in waited and query(self)

    def recorded_wait(self: _kernels.Deferral, seconds: float | None = None) -> bool:
        if seconds is not None:
            timed.append(seconds)
        done = wait(self, seconds)
        if done:
            waited.add(self)
        return done

    monkeypatch.setattr(_kernels.Deferral, "query", slow_query)
    monkeypatch.setattr(_kernels.Deferral, "wait", recorded_wait)
    return timed


@pytest.mark.parametrize("spent", [False, True])
def test_async_for_waits_for_its_chunks_rows_in_the_loops_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spent: bool
) -> None:
    """``async for`` waits for the rows of a chunk it started in the event loop's
    thread (the GIL released, up to YIELD_EVERY), not through a worker thread. Rows
    here are never written before someone waits for them (a slow pool), so every
    chunk is waited for; the batches are Batches'. ``spent``: YIELD_EVERY is always
    spent when a wait begins, so each wait follows a turn of the loop."""
    if spent:
        monkeypatch.setattr(_async, "YIELD_EVERY", 1e-9)
    timed = slow_pool(monkeypatch)
    through_worker: list[object] = []
    wait_event = _async.wait_event

    async def counted(event: Any, raising: bool = True) -> None:
        if isinstance(event, RowsWritten):
            through_worker.append(event)
        await wait_event(event, raising=raising)

    monkeypatch.setattr(_async, "wait_event", counted)
    db = raw_db(tmp_path / "db", 300)
    n = 2 * 300 // 4

    async def run() -> list[Got]:
        async with Loader(db, 4, device="cpu", workers=2, mode="wrap", phase="test") as loader:
            got = await collect(loader, n)
            assert loader._pipe._here
            return got

    got = anyio.run(run)
    assert_matches(got, expected(db, n, batch_size=4, phase="test"))
    if spent:  # (a wait of a nanosecond may time out: then in a worker thread)
        return
    assert len(timed) >= 5, timed  # a chunk's rows waited for in the loop's thread ...
    assert all(0 < seconds <= _async.YIELD_EVERY for seconds in timed)
    assert len(through_worker) < len(timed) / 2  # ... not in a worker thread


@pytest.mark.parametrize("device", ["host", "emulated"])
def test_batches_turning_large_while_the_consumer_plans_go_to_the_fillers_and_back(
    tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of odd epochs are too large to chunk (a chunk holds one), of even epochs
    small: the consumer plans the small ones, hands the large ones to the fillers when
    it plans the first of them, and takes over again once a filler found batches small.
    Every batch is Batches', in order, and every block returns to its pool."""
    original = _pipeline.chunk_batches

    def by_epoch(plan: Any, consumer: bool = False, later: bool = False) -> int:
        return 1 if int(plan.epochs[0]) % 2 else original(plan, consumer, later)

    monkeypatch.setattr(_pipeline, "chunk_batches", by_epoch)
    switches: list[str] = []
    plan_here, leave_here = _pipeline.Pipeline._plan_here, _pipeline.Pipeline._leave_here

    def planning(self: Any, chunk: int) -> None:
        was = self._here
        plan_here(self, chunk)
        if self._here and not was:
            switches.append("consumer")

    def leaving(self: Any, deferrable: bool) -> None:
        switches.append("fillers" if deferrable else "fillers for good")
        leave_here(self, deferrable)

    monkeypatch.setattr(_pipeline.Pipeline, "_plan_here", planning)
    monkeypatch.setattr(_pipeline.Pipeline, "_leave_here", leaving)
    db = raw_db(tmp_path / "db", 120)
    n = 6 * 120 // 4  # six epochs, wrapping
    backend = make_backend(device)
    watch = PoolWatch(backend)
    with Loader(db, 4, device=backend, workers=2, mode="wrap", phase="test") as loader:
        got = [Got.of(b) for _, b in zip(range(n), loader, strict=False)]
    assert_matches(got, expected(db, n, batch_size=4, phase="test"))
    # the consumer took over in each even epoch, the fillers in each odd one
    assert switches.count("consumer") >= 3, switches
    assert switches.count("fillers") >= 2 and "fillers for good" not in switches, switches
    watch.assert_returned()


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize(("cache", "streams"), [(1, True), (1 << 40, False)])
@pytest.mark.parametrize(
    ("shape", "transform"),
    [
        ((1, 28, 28), blobpipe.Transform(scale=0.5)),  # whole planes
        ((3, 32, 32), blobpipe.Transform(mirror=True, mean_value=[1.0, 2.0, 3.0])),
        ((3, 40, 40), blobpipe.Transform(crop_size=16, mirror=True, scale=0.5)),
    ],
)
def test_the_consumers_rows_go_around_the_caches_where_its_ring_exceeds_them(
    tmp_path: Path,
    device: str,
    cache: int,
    streams: bool,
    shape: tuple[int, int, int],
    transform: blobpipe.Transform,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the ring holds more than the last-level cache (here made 1 byte), the
    pool writes the consumer's rows around the caches (``Pool.stream``); where it fits,
    as usual. The batches are Batches' either way (TRAIN crops and mirrors, shuffled,
    past the first epoch, whose chunks and ring are smaller), on the host and pushed to
    the emulated device, whose copies read the host rows on a thread of their own."""
    monkeypatch.setattr(blobpipe._loader._chunk, "last_level_cache", lambda: cache)
    db = raw_db(tmp_path / "db", 160, shape)
    options: dict[str, Any] = {
        "transform": transform,
        "phase": "train",
        "order": "shuffle",
        "seed": 3,
        "mode": "wrap",
    }
    n = 3 * 160 // 8
    backend = "cpu" if device == "cpu" else make_backend(device)
    # (no device transform: the host fills float32 rows, the rows the pool streams)
    with Loader(db, 8, device=backend, workers=2, device_transform=False, **options) as loader:
        got = [Got.of(b) for _, b in zip(range(n), loader, strict=False)]
        pool = loader._pipe._pool
        assert loader._pipe._here and pool is not None
        assert pool.stream is streams
    assert_matches(got, expected(db, n, batch_size=8, **options))


@pytest.mark.parametrize("device", ["host", "emulated"])
def test_the_consumers_chunks_grow_after_the_first_epoch(
    tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the first epoch the consumer's chunks are the fillers' size (the ring stays
    small: a short first epoch does not pay for memory it cannot use); from the second
    on they take HERE_CHUNK_BYTES (the ring grows to 3 chunks and one). The batches are
    Batches' throughout, and every block returns to its pool."""
    db = raw_db(tmp_path / "db", 240)
    with Batches(db, 4) as batches:
        plan = batches.next_plan()
    assert plan is not None
    nbytes = int(np.prod(plan.data_shape)) * plan.dtype.itemsize  # float32 rows
    chunk = blobpipe._loader._chunk
    monkeypatch.setattr(chunk, "CHUNK_BYTES", 2 * nbytes)  # chunks of 2 in the first epoch
    monkeypatch.setattr(chunk, "HERE_CHUNK_BYTES", 8 * nbytes)  # of 8 later
    assert chunk.chunk_batches(plan, True) == 2 and chunk.chunk_batches(plan, True, True) == 8
    backend = make_backend(device)
    watch = PoolWatch(backend)
    per_epoch = 240 // 4
    got: list[Got] = []
    # (no device transform: the host fills float32 rows, as Batches' plan says)
    with Loader(
        db, 4, device=backend, workers=2, mode="wrap", phase="test", device_transform=False
    ) as loader:
        got += [Got.of(b) for _, b in zip(range(20), loader, strict=False)]
        assert loader._pipe._here
        first = loader.statistics().slots  # (planned ahead, but within the first epoch)
        got += [Got.of(b) for _, b in zip(range(2 * per_epoch), loader, strict=False)]
        later = loader.statistics().slots
    assert first <= 3 * 2 + 2 < 3 * 8 + 1 <= later, (first, later)
    assert_matches(got, expected(db, len(got), batch_size=4, phase="test"))
    watch.assert_returned()


def test_cancelling_async_for_while_it_waits_for_its_chunk_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``anext`` called cancelled, before each real call, while the consumer's chunks
    are started and their rows not written (a slow pool; YIELD_EVERY always spent, so a
    wait for a chunk begins with a turn of the loop, where the cancellation lands):
    every batch still comes, in order, none twice, and every block returns to its pool."""
    monkeypatch.setattr(_async, "YIELD_EVERY", 1e-9)
    slow_pool(monkeypatch)
    db = raw_db(tmp_path / "db", 200)
    n = 2 * 200 // 4
    backend = make_backend("host")
    watch = PoolWatch(backend)
    cancelled_waits = 0

    async def run() -> list[Got]:
        nonlocal cancelled_waits
        got: list[Got] = []
        async with Loader(db, 4, device=backend, workers=2, mode="wrap", phase="test") as loader:
            pipe = loader._pipe
            while len(got) < n:
                waiting = pipe._here and bool(pipe._started) and not pipe.handoff.ready()
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    got.append(Got.of(await anext(loader)))  # (never: cancelled first)
                assert scope.cancelled_caught
                cancelled_waits += waiting
                got.append(Got.of(await anext(loader)))
            assert pipe._here
        return got

    got = anyio.run(run)
    assert cancelled_waits >= 5, cancelled_waits  # cancelled in a wait for a started chunk
    assert_matches(got, expected(db, len(got), batch_size=4, phase="test"))
    watch.assert_returned()


def test_encoded_batches_go_back_to_the_fillers(tmp_path: Path) -> None:
    """A chunk whose rows the pool cannot write (JPEGs) is filled on the consumer's
    thread once; the fillers fill chunks from then on, and the batches are Batches'."""
    db = encoded_db(tmp_path / "jpg", 96, ".jpg")
    with Loader(db, 4, device="cpu", workers=2, mode="wrap", phase="test") as loader:
        got = [Got.of(b) for _, b in zip(range(72), loader, strict=False)]
        assert not loader._pipe._here and not loader._pipe._here_ok
    assert_matches(got, expected(db, 72, batch_size=4, phase="test"))


def test_a_consumer_that_keeps_its_batches_is_never_stuck(tmp_path: Path) -> None:
    """The consumer takes only slots that are free now: keeping every batch makes new
    slots, never a wait for memory only its own consumption would free."""
    db = raw_db(tmp_path / "db", 200)
    backend = make_backend("host")
    watch = PoolWatch(backend)
    with Loader(db, 4, device=backend, workers=2, mode="epoch", phase="test") as loader:
        kept = list(loader)
        assert loader._pipe._here
        assert len(kept) == 50
        got = [Got.of(b) for b in kept]
    assert_matches(got, expected(db, None, batch_size=4, phase="test", mode="epoch"))
    del kept
    watch.assert_returned()


@pytest.mark.parametrize("failing", [1, 3])
def test_a_check_after_the_rows_fails_its_whole_chunk(
    tmp_path: Path, failing: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot check runs once the pool wrote a chunk's rows (they were read then):
    when it fails, the chunk's first batch gets the error; every batch before the chunk
    arrives intact."""
    db = raw_db(tmp_path / "db", 400)
    calls = 0
    original = _fill.Filler._check_snapshot
    chunks: list[int] = []

    def check(self: Any, index: Any) -> None:
        nonlocal calls
        if threading.current_thread() is threading.main_thread():  # the consumer's chunks
            calls += 1
            if calls == failing:
                raise DataError("the database changed while it was being read (test)")
        original(self, index)

    monkeypatch.setattr(_fill.Filler, "_check_snapshot", check)
    start = blobpipe._loader._pipeline.Pipeline._start_chunk

    def started(self: Any) -> bool:
        first = self._planned
        result = start(self)
        if self._planned != first:
            chunks.append(first)
        return result

    monkeypatch.setattr(blobpipe._loader._pipeline.Pipeline, "_start_chunk", started)
    got: list[Got] = []
    with (
        Loader(db, 4, device="cpu", workers=2, mode="epoch", phase="test") as loader,
        pytest.raises(DataError, match="changed while"),
    ):
        got.extend(Got.of(b) for b in loader)
    assert len(got) == chunks[failing - 1]
    assert_matches(got, expected(db, len(got), batch_size=4, phase="test"))


@pytest.mark.parametrize("planner", ["consumer", "fillers"])
def test_closed_while_rows_are_written(tmp_path: Path, planner: str, monkeypatch: Any) -> None:
    """A close right after the consumer started chunks waits for the pool's writes
    before the ring's memory goes back: every block returns, the pool is joined."""
    if planner == "fillers":
        fillers_plan(monkeypatch)
    db = raw_db(tmp_path / "db", 400)
    backend = make_backend("emulated")
    watch = PoolWatch(backend)
    for _ in range(5):
        loader = Loader(db, 4, device=backend, workers=2, mode="wrap", phase="test")
        with loader:
            for _, _batch in zip(range(6), loader, strict=False):
                pass
            del _batch
        assert (loader._pipe._pool is not None) == (planner == "consumer")
    watch.assert_returned()
