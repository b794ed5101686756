"""Micro-benchmark: what reshape-within-capacity and the pool save.

For a small blob (one 3×32×40 image) and a large one (a 32×3×224×224 batch),
each step gets a writable host array of the blob's shape and fills it (as a
layer fills its top blob), four ways:

* reshape within capacity: one blob, reshaped between two shapes that fit
  (Caffe's pattern for a top blob whose batch size varies);
* new blob, pool hit: a fresh Blob per step, closed after it, so its block
  comes back from the pool's cache;
* new blob, pool miss: the same, but the pool's cache is emptied after each
  step, so every block is a fresh allocation from the system;
* np.zeros: a plain NumPy allocation per step, for reference.

The pool counters (hits, misses, allocations) come from
``MemoryPool.statistics()``. A new blob's memory is zero-filled on first
touch (Caffe's SyncedMemory does the same); a reshaped one is not, since it
is already initialised. On the host backend an allocation is cheap (the OS
maps zeroed pages); on CUDA a pinned one costs far more, which is what the
pool saves there. Runs on the host backend in well under 20 s.

Usage: python bench/bench_blob.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blobpipe._backends import HostBackend
from blobpipe._blob import Blob
from blobpipe._pool import get_pool

CASES = [
    # name, shape, a smaller shape within capacity, steps
    ("image 3x32x40", (1, 3, 32, 40), (1, 3, 24, 24), 5000),
    ("batch 32x3x224x224", (32, 3, 224, 224), (24, 3, 224, 224), 200),
]


def timed(steps: int, step: Callable[[int], None]) -> float:
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    return (time.perf_counter() - start) / steps


Row = tuple[str, float, int, int, int]


def run_case(shape: tuple[int, ...], small: tuple[int, ...], steps: int) -> list[Row]:
    rows: list[Row] = []

    def measure(name: str, backend: HostBackend, step: Callable[[int], None]) -> None:
        pool = get_pool(backend, "host")
        step(0)  # warm-up, neither timed nor counted
        before = pool.statistics()
        per_step = timed(steps, step)
        after = pool.statistics()
        rows.append(
            (
                name,
                per_step,
                after.hits - before.hits,
                after.misses - before.misses,
                after.allocations - before.allocations,
            )
        )

    backend = HostBackend()
    blob = Blob(shape, backend=backend)
    blob.mutable_cpu_data()

    def reshape_step(i: int) -> None:
        blob.reshape(small if i % 2 else shape)
        blob.mutable_cpu_data()[...] = i

    measure("reshape within capacity", backend, reshape_step)
    blob.close()

    hit_backend = HostBackend()

    def hit_step(i: int) -> None:
        with Blob(shape, backend=hit_backend) as b:
            b.mutable_cpu_data()[...] = i

    measure("new blob, pool hit", hit_backend, hit_step)

    miss_backend = HostBackend()
    miss_pool = get_pool(miss_backend, "host")

    def miss_step(i: int) -> None:
        with Blob(shape, backend=miss_backend) as b:
            b.mutable_cpu_data()[...] = i
        miss_pool.free_all_blocks()

    measure("new blob, pool miss", miss_backend, miss_step)

    def numpy_step(i: int) -> None:
        a = np.zeros(shape, np.float32)
        a[...] = i

    measure("np.zeros (reference)", HostBackend(), numpy_step)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the steps")
    args = parser.parse_args(argv)
    print(f"{'case':<20} {'method':<26} {'us/step':>10} {'hits':>6} {'misses':>7} {'allocs':>7}")
    for case, shape, small, steps in CASES:
        steps = max(steps // 10, 2) if args.quick else steps
        nbytes = int(np.prod(shape)) * 4
        for name, per_step, hits, misses, allocs in run_case(shape, small, steps):
            print(
                f"{case:<20} {name:<26} {per_step * 1e6:>10.1f} {hits:>6} {misses:>7} {allocs:>7}"
            )
        print(f"{'':<20} ({steps} steps, {nbytes / 2**20:.2f} MiB per array)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
