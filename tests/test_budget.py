"""The GIL budget (``blobpipe._io._budget``): the compiled modules' GIL-free CPU time."""

from __future__ import annotations

import multiprocessing
import threading
import time

import numpy as np
import pytest

from blobpipe._io import _budget
from blobpipe._io._kernels import row_kernel

kernel = row_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the compiled row kernel is not built")


def _transform(rows: int = 256, side: int = 128) -> int:
    """One large transform; returns the calling thread's CPU time in the kernel call (ns)."""
    src = np.full(rows * 3 * side * side, 7, np.uint8)
    offsets = np.arange(rows, dtype=np.int64) * 3 * side * side
    zeros = np.zeros(rows, np.intp)
    out = np.zeros((rows, 3, side, side), np.float32)  # faulted in here, not in the kernel
    t0 = time.thread_time_ns()
    kernel.transform_rows(
        src, offsets, (3, side, side), zeros, zeros, np.zeros(rows, np.bool_), None, 0.5, out,
        0, False,
    )  # fmt: skip
    spent = time.thread_time_ns() - t0
    assert out[0, 0, 0, 0] == 3.5
    return spent


@needs_kernel
def test_kernel_time_counts_as_gil_free() -> None:
    with _budget.measure() as b:
        _transform()
    assert b.free > 0
    assert b.cpu >= b.free * 0.9  # the process clock and the thread clocks: same time
    assert b.serial < 0.5  # a large transform: most of it without the GIL


@needs_kernel
def test_counts_kernel_calls_of_other_threads() -> None:
    spent: list[int] = []
    with _budget.measure() as b:
        threads = [threading.Thread(target=lambda: spent.append(_transform())) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # Each thread's own clock around its kernel call is the reference: the same work, not a
    # second run whose page faults or cache state may differ. The measuring thread made no call.
    assert len(spent) == 2 and min(spent) > 0
    assert 0.9 * sum(spent) <= b.free * 1e9 <= sum(spent) * 1.01 + 1e6


@needs_kernel
def test_a_pools_threads_and_its_waiter_count_as_gil_free() -> None:
    """A pool job's rows, claimed a block at a time by its threads and by the waiter,
    count as GIL-free whole: the claims between blocks too (a pool thread never holds
    the GIL), and not a pair of clock reads and a lock a block, which counted as holding
    the GIL while a benchmark counts."""
    rows, side = 8192, 32
    src = np.full(rows * 3 * side * side, 7, np.uint8)
    offsets = np.arange(rows, dtype=np.int64) * 3 * side * side
    zeros = np.zeros(rows, np.intp)
    out = np.zeros((rows, 3, side, side), np.float32)  # faulted in here, not in the pool
    pool = kernel.Pool(2)
    args = (src, offsets, (3, side, side), zeros, zeros, np.zeros(rows, np.bool_), None, 0.5,
            out, 0, False)  # fmt: skip
    pool.start(*args).synchronize()  # the threads started, the caches as they will be
    with _budget.measure() as b:
        for _ in range(3):
            pool.start(*args).synchronize()
    pool.close()
    assert out[-1, 0, 0, 0] == 3.5
    assert b.free > 0
    assert b.serial < 0.05, b  # ~400 blocks a job


def _call_in_flight(rows: int) -> tuple[_budget.Budget, bool, int, int]:
    """A block that ends while another thread is inside a kernel call of ``rows`` rows:
    the budget, whether the call was still running at the block's end, the counter read
    at the block's end and read again once the call ended."""
    side = 128
    src = np.full(rows * 3 * side * side, 7, np.uint8)
    offsets = np.arange(rows, dtype=np.int64) * 3 * side * side
    zeros = np.zeros(rows, np.intp)
    out = np.zeros((rows, 3, side, side), np.float32)  # faulted in here, not in the kernel
    inside, done = threading.Event(), threading.Event()

    def call() -> None:
        inside.set()
        kernel.transform_rows(
            src, offsets, (3, side, side), zeros, zeros, np.zeros(rows, np.bool_), None, 0.5,
            out, 0, False,
        )  # fmt: skip
        done.set()

    worker = threading.Thread(target=call)
    with _budget.measure() as b:
        worker.start()
        inside.wait()
        time.sleep(0.005)  # the worker in the kernel (the GIL released), this thread asleep
        running = not done.is_set()
    at_end = kernel.free_cpu(False)
    worker.join()
    return b, running, at_end, kernel.free_cpu(False)


@needs_kernel
def test_a_call_running_when_the_block_ends_counts_up_to_its_end() -> None:
    """The process clock has a running call's CPU time so far: so has the GIL-free count
    (counted only when the call ended, it would count as holding the GIL)."""
    for rows in (256, 1024, 4096):
        b, running, at_end, after = _call_in_flight(rows)
        if running:
            break
    else:
        pytest.skip("the kernel call ended within 5 ms every time")
    assert b.free > 0.002  # the 5 ms the block slept through, less the thread's start
    assert b.free <= b.cpu * 1.01 + 1e-4
    assert b.serial < 0.5
    assert after == at_end  # and nothing of it after the block


def _child() -> None:
    _transform()  # a section noted while the parent counts: the child's own start
    assert kernel.free_cpu(False) >= 0


@needs_kernel
def test_a_child_forked_while_counting_counts_without_the_parents_notes() -> None:
    ctx = multiprocessing.get_context("fork")
    with _budget.measure():
        child = ctx.Process(target=_child)
        child.start()
        child.join(60)
    assert child.exitcode == 0


def test_python_work_holds_the_gil() -> None:
    with _budget.measure() as b:
        sum(i * i for i in range(200_000))
    assert b.free == 0
    assert b.serial == pytest.approx(1.0)
    assert b.bound(32) == pytest.approx(1.0)


@needs_kernel
def test_counting_stops_after_the_block() -> None:
    with _budget.measure():
        pass
    before = kernel.free_cpu(False)
    _transform()
    assert kernel.free_cpu(False) == before  # not counted outside a measured block


@needs_kernel
def test_nested_blocks_keep_counting_until_the_outer_ends() -> None:
    with _budget.measure() as outer:
        with _budget.measure():
            pass
        _transform()  # after the inner block ended: still counted for the outer one
    assert outer.free > 0


def test_amdahl_bound() -> None:
    b = _budget.Budget(wall=1.0, cpu=1.0, free=0.75)
    assert b.serial == pytest.approx(0.25)
    assert b.busy == pytest.approx(0.25)
    assert b.bound(1) == pytest.approx(1.0)
    assert b.bound(2) == pytest.approx(1 / (0.25 + 0.75 / 2))
    assert b.bound() == pytest.approx(4.0)
