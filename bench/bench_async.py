"""``async for`` against ``for``, later epochs paired in one process, with an A/A control.

Run: ``python bench/bench_async.py [--workloads W1,W2,...] [--point NAME ...] [--rounds N]
[--data-dir DIR] [--quick]``

For each workload (``bench_workloads.py``'s databases and recipes; default all) or sweep
point (``--point``, ``bench_sweep.py``'s name), one process opens three Loaders on the same
database (2 workers, device "cpu"): one consumed with ``async for`` on an anyio event loop
of its own thread (``_contenders.AsyncHost``, as the workload benchmark runs it), one with
``for``, and one with ``for`` again, the A/A control. Each round runs every Loader in an
order shuffled each round (seeded), each one untimed epoch and then one timed (as the
workload benchmark's later passes: the ring refilled as a training loop finds it), and
waits until the process is idle after each (``bench_workloads.settle``). It prints the
medians of µs a batch and of the per-round speed ratios, ``async for`` over ``for`` and the
control over ``for``, with their 90% bootstrap intervals (``bench_pairs.py``'s). A row
reads issue 40's item 3 target (``async for`` ≥ 0.95× ``for``) as PASS or MISS, resolved
when the control's interval lies within ±5% of 1×. First epochs, which need fresh
processes: ``bench_pairs.py --workloads``.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import blobpipe

ROUNDS = 41
KEYS = ("for", "async", "again")


def measure(db: str, options: dict[str, Any], rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """µs a batch of each contender's timed later epochs, a round each."""
    import _contenders as cs
    from bench_workloads import settle

    with contextlib.ExitStack() as opened:  # closed in reverse, the event loop last
        host = cs.AsyncHost()
        opened.callback(host.close)
        loaders = {
            k: blobpipe.Loader(db, device="cpu", workers=2, mode="epoch", **options) for k in KEYS
        }
        opened.enter_context(host.portal.wrap_async_context_manager(loaders["async"]))
        for key in ("for", "again"):
            opened.enter_context(loaders[key])

        def blocking(loader: blobpipe.Loader) -> float:
            t0, n = time.perf_counter(), 0
            for batch in loader:
                batch.data.cpu_data()
                n += 1
            return (time.perf_counter() - t0) / max(n, 1) * 1e6

        async def consume(loader: blobpipe.Loader) -> float:
            # timed in the loop's thread: the portal's call from this thread is not counted
            t0, n = time.perf_counter(), 0
            async for batch in loader:
                batch.data.cpu_data()
                n += 1
            return (time.perf_counter() - t0) / max(n, 1) * 1e6

        runs: dict[str, Callable[[], float]] = {
            "for": lambda: blocking(loaders["for"]),
            "async": lambda: host.portal.call(consume, loaders["async"]),
            "again": lambda: blocking(loaders["again"]),
        }
        for run in runs.values():
            run()  # the first epoch: opened, indexed, every slot filled
        times: dict[str, list[float]] = {k: [] for k in KEYS}
        rng = random.Random(seed)
        for _ in range(rounds):
            order = list(KEYS)
            rng.shuffle(order)
            for key in order:
                runs[key]()  # untimed: the ring refilled, as a later pass finds it
                times[key].append(runs[key]())
                settle()
        return times


def main(argv: list[str] | None = None) -> None:
    from bench_planners import case_arguments

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    case_arguments(parser, "W1,W2,W3,W4,W5", ROUNDS)
    args = parser.parse_args(argv)
    from bench_pairs import ASYNC_TARGET, interval, within
    from bench_planners import prepared, rounds_of

    rounds = rounds_of(parser, args)
    print(f"async for against for, paired in one process, {rounds} rounds, later epochs")
    print(
        "| case | for µs a batch | async for µs a batch | async / for (90%) | A/A (90%) "
        f"| async ≥ {ASYNC_TARGET:.2f}× for |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for w, path, options in prepared(args):
        t = measure(path, options, rounds)
        cells = []
        for key in ("async", "again"):  # speed over for's: above 1, faster
            ratios = [f / x for f, x in zip(t["for"], t[key], strict=True)]
            lo, hi = interval(ratios)
            cells.append((statistics.median(ratios), lo, hi))
        (speed, *_), (_, lo, hi) = cells
        resolved = within(lo, hi)
        verdict = "PASS" if speed >= ASYNC_TARGET else "MISS"
        print(
            f"| {w.name} | {statistics.median(t['for']):.1f} "
            f"| {statistics.median(t['async']):.1f} | "
            + " | ".join(f"{m:.3f}× ({a:.3f}–{b:.3f})" for m, a, b in cells)
            + f" | {verdict}{'' if resolved else ' (unresolved)'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
