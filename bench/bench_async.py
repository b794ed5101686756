"""``async for`` against ``for``, later epochs paired in one process, with an A/A control.

Run: ``python bench/bench_async.py [--workloads W1,W2,...] [--point NAME ...] [--rounds N]
[--data-dir DIR] [--quick]``

For each workload (``bench_workloads.py``'s databases and recipes; default all) or sweep
point (``--point``, ``bench_sweep.py``'s name), one process opens a Loader on the database
(2 workers, device "cpu") and consumes its later epochs in turn with ``async for``, on an
anyio event loop of its own thread (``_contenders.AsyncHost``, as the workload benchmark
runs it), with ``for``, and with ``for`` again, the A/A control: the two forms read the
same Loader, so they share its ring's memory and its threads, and every epoch runs in
the loop's thread (which thread consumes moved W1's ``for`` by 5-15%). Loaders differ by
more than the forms do: where their buffers land moves W4 by 5-10% (two Loaders of the
same options, each read with ``for``, read 0.907× each other), so a second Loader, read
with ``for``, is timed beside them as that reference ("another Loader"). Each round runs every
contender in an order shuffled each round (seeded), each one untimed epoch and then one
timed (as the workload benchmark's later passes: the ring refilled as a training loop
finds it), and waits until the process is idle after each
(``bench_workloads.settle``). It prints the medians of µs a batch and of the per-round
speed ratios over ``for``: ``async for``'s, the control's and the other Loader's, with
their 90% bootstrap intervals (``bench_pairs.py``'s). A row reads issue 40's item 3
target (``async for`` ≥ 0.95× ``for``) as PASS or MISS, resolved when the control's
interval lies within ±5% of 1×. First epochs, which need fresh processes:
``bench_pairs.py --workloads``.
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
KEYS = ("for", "async", "again", "other")


def measure(db: str, options: dict[str, Any], rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """µs a batch of each contender's timed later epochs, a round each."""
    import _contenders as cs
    from bench_workloads import settle

    with contextlib.ExitStack() as opened:  # closed in reverse, the event loop last
        host = cs.AsyncHost()
        opened.callback(host.close)
        shared, other = (
            blobpipe.Loader(db, device="cpu", workers=2, mode="epoch", **options) for _ in "ab"
        )
        opened.enter_context(host.portal.wrap_async_context_manager(shared))
        opened.enter_context(other)

        # Every epoch is timed in the loop's thread (the portal's call from this thread
        # is not counted): which thread consumes moved W1's `for` by 5-15%, more than
        # the forms differ.
        async def blocking(loader: blobpipe.Loader) -> float:
            t0, n = time.perf_counter(), 0
            for batch in loader:  # (the loop waits meanwhile)
                batch.data.cpu_data()
                n += 1
            return (time.perf_counter() - t0) / max(n, 1) * 1e6

        async def consume(loader: blobpipe.Loader) -> float:
            t0, n = time.perf_counter(), 0
            async for batch in loader:
                batch.data.cpu_data()
                n += 1
            return (time.perf_counter() - t0) / max(n, 1) * 1e6

        call = host.portal.call
        runs: dict[str, Callable[[], float]] = {
            "for": lambda: call(blocking, shared),
            "async": lambda: call(consume, shared),
            "again": lambda: call(blocking, shared),
            "other": lambda: call(blocking, other),
        }
        for run in (runs["for"], runs["other"]):
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
        f"| async ≥ {ASYNC_TARGET:.2f}× for | another Loader / for (90%) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for w, path, options in prepared(args):
        t = measure(path, options, rounds)
        cells = []
        for key in ("async", "again", "other"):  # speed over for's: above 1, faster
            ratios = [f / x for f, x in zip(t["for"], t[key], strict=True)]
            lo, hi = interval(ratios)
            cells.append((statistics.median(ratios), lo, hi))
        (speed, *_), (_, lo, hi), placed = cells
        resolved = within(lo, hi)
        verdict = "PASS" if speed >= ASYNC_TARGET else "MISS"
        print(
            f"| {w.name} | {statistics.median(t['for']):.1f} "
            f"| {statistics.median(t['async']):.1f} | "
            + " | ".join(f"{m:.3f}× ({a:.3f}–{b:.3f})" for m, a, b in cells[:2])
            + f" | {verdict}{'' if resolved else ' (unresolved)'} "
            + "| {:.3f}× ({:.3f}–{:.3f}) |".format(*placed),
            flush=True,
        )


if __name__ == "__main__":
    main()
