"""What a large batch's memory traffic costs the Python around it: the GIL time of
planning a batch, with the caches warm and after the work a batch does between plans.

Run: ``python bench/bench_cold_python.py [--rounds N] [--data-dir DIR] [--quick]``

On W3's database (``bench_workloads.py``'s: raw 3×256×256 Datums, TRAIN, shuffle, crop
227, mirror, the mean file; batch 64), one ``Batches`` in one thread plans every batch of
an epoch (``next_plan``: pure Python and NumPy, the GIL held throughout) and, between two
plans, does one of:

* **nothing**: the caches hold what the last plan touched;
* **read the records**: sums a buffer as large as a batch's records (12.6 MB at W3);
* **copy the output**: copies a buffer as large as a batch's output (39.6 MB), read
  and written;
* **fill the batch**: ``Batches.fill``, the row kernel's crop, flip and mean of the
  batch's records into one cached output array, as the benchmarks' plain ``Batches``.

Each round runs one epoch of each, in an order turned every round; the table gives the
medians over rounds of the thread CPU time ``next_plan`` takes a batch, and its ratio to
"nothing". The fill's own Python (``Batches.fill`` besides the kernel) meets the same
cold caches. A ratio well over 1 says the per-batch Python of large batches runs from
memory, not from cache: its GIL time (``bench_workloads.py``'s budget) is set by what the
rows evict (the 32 MiB last-level cache of a 2-core VM holds less than one batch's
traffic), not only by how much Python there is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _workloads_data import imagenet_raw, prepare, warm_page_cache

import blobpipe

BATCH = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 7, quick 1)")
    parser.add_argument("--data-dir", type=Path, default=None, help="LMDB cache (bench/_data)")
    parser.add_argument("--quick", action="store_true", help="a tiny database, one round")
    args = parser.parse_args()
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 7)

    spec, crop = imagenet_raw(args.quick)
    prepared = prepare(spec, args.data_dir)
    warm_page_cache(prepared)
    transform = blobpipe.Transform(crop_size=crop, mirror=True, mean_file=prepared.mean_file)
    batches = blobpipe.Batches(
        prepared.path, BATCH, transform=transform, phase="train", order="shuffle", mode="epoch"
    )
    c, h, w = spec.shape
    records = np.ones(BATCH * c * h * w // 8, np.float64)  # a batch's records' bytes
    out_bytes = BATCH * c * crop * crop * 4
    source, target = np.ones(out_bytes // 8), np.empty(out_bytes // 8)
    data = np.empty((BATCH, c, crop, crop), np.float32)
    label = np.empty(BATCH, np.float32)

    def fill(plan: blobpipe.BatchPlan) -> None:
        batches.fill(plan, data[: len(plan)], label[: len(plan)])

    between: dict[str, Callable[[blobpipe.BatchPlan], object]] = {
        "nothing": lambda plan: None,
        "read the records": lambda plan: records.sum(),
        "copy the output": lambda plan: np.copyto(target, source),
        "fill the batch": fill,
    }
    names = list(between)

    def epoch(work: Callable[[blobpipe.BatchPlan], object]) -> float:
        """Thread CPU µs ``next_plan`` takes a batch over one epoch, ``work`` between."""
        spent, count, clock = 0.0, 0, time.thread_time
        while True:
            t0 = clock()
            plan = batches.next_plan()
            spent += clock() - t0
            if plan is None:
                return 1e6 * spent / max(count, 1)
            work(plan)
            count += 1

    with batches:
        for name in names:  # untimed: every path's first use
            epoch(between[name])
        samples: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            turn = names[r % len(names) :] + names[: r % len(names)]
            for name in turn:
                samples[name].append(epoch(between[name]))

    print(
        f"W3's database ({prepared.count:,} raw {c}×{h}×{w} Datums, batch {BATCH}, crop "
        f"{crop}): records {records.nbytes / 1e6:.1f} MB, output {out_bytes / 1e6:.1f} MB "
        f"a batch; {rounds} round(s), medians\n"
    )
    warm = statistics.median(samples["nothing"])
    print("| between two plans | next_plan µs a batch (GIL held) | × nothing |")
    print("| --- | --- | --- |")
    for name in names:
        us = statistics.median(samples[name])
        print(f"| {name} | {us:.1f} | {us / warm:.2f}× |")


if __name__ == "__main__":
    main()
