"""Paired measurements at the small-record points, resolved against an A/A control.

Run: ``python bench/bench_pairs.py [--quick] [--rounds N] [--points SUBSTR,...]
[--workloads W1,W3,...] [--json OUT] [--data-dir DIR] [--markdown] [--check] [--prefault
MIB]`` (``--quick``: a smoke test, two points on tiny databases, 3 rounds; ``--workloads``:
``bench_workloads.py``'s workloads, with the same contenders, instead of the points;
``--prefault``: ``_fresh.py``)

Small records are where the pipeline's own Python decides (``docs/design.md``, "The GIL
budget"), so these are the points where a few microseconds a batch move a ratio by a few
percent, and two rounds cannot tell a 5% target from noise. This benchmark runs the
sweep's small raw points (``bench_sweep.py``'s grid, records of at most 3×80×80) with
the sweep's harness and contenders (the plain loop, ``Batches`` driven in one thread, the
Loader with 2 workers in its ``async for`` and blocking forms, the blocking form a second
time as the A/A control; first epochs in a fresh process, later epochs of a pipeline kept
open; rounds interleaved, each pass's order rotated), over more rounds (default 9), and
reads each target against the control's resolution:

* 2 workers (blocking) ≥ 1.5× ``Batches`` in one thread, later epochs;
* ``async for`` ≥ 0.95× ``for`` (blocking), first and later epochs;
* the Loader's first epoch (blocking) ≥ 1.2× the plain loop's.

Ratios are medians over rounds of the per-round ratio. The A/A control (the blocking form
against itself, same rounds) gives the resolution: its median's 90% bootstrap interval
(2,000 resamples of the rounds). A point is **resolved** when that interval lies within
±5% of 1× for both first and later epochs; a target read at an unresolved point is shown
but marked ``(unresolved)``: rerun with more rounds, or on a quieter machine. Each row
also shows the blocking Loader's GIL share s in later epochs (``bench_workloads.py``).
``--check`` exits 1 when a resolved point misses a target or no point is resolved.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _contenders as cs
import _fresh as fresh_memory
import bench_sweep as sweep
import bench_workloads as bw
from _workloads_data import DATA_DIR, prepare, warm_page_cache

ROUNDS = 9
PIPELINE_TARGET = 1.5
ASYNC_TARGET = 0.95
FIRST_TARGET = 1.2
RESOLUTION = 0.05  # the A/A interval must lie within 1 ± this
MAX_PIXELS = 3 * 80 * 80  # the small-record points: records of at most this many pixels
RESAMPLES = 2000
#: the contenders a workload's run keeps (``--workloads``): those the checks read
PAIRED = ("plain", "memcpy", "batches", "async", "blocking", "again")


def per_round(run: bw.Run, key: str, kind: str, against: str) -> list[float]:
    a, b = run.row(key).rates[kind], run.row(against).rates[kind]
    return [x / y for x, y in zip(a, b, strict=True)]


def interval(ratios: list[float], seed: int = 0) -> tuple[float, float]:
    """The 90% bootstrap interval of the median of ``ratios``."""
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(RESAMPLES)
    )
    return medians[int(0.05 * RESAMPLES)], medians[int(0.95 * RESAMPLES) - 1]


def within(lo: float, hi: float) -> bool:
    """Whether an A/A control's interval ``[lo, hi]`` lies within ±RESOLUTION of 1×: the
    ratios read beside it are resolved."""
    return lo >= 1 - RESOLUTION and hi <= 1 + RESOLUTION


def resolved(run: bw.Run) -> bool:
    return all(
        within(*interval(per_round(run, "again", k, "blocking"))) for k in ("first", "later")
    )


CHECKS = (
    ("2 workers / Batches, later", "blocking", "later", "batches", PIPELINE_TARGET),
    ("async / for, first", "async", "first", "blocking", ASYNC_TARGET),
    ("async / for, later", "async", "later", "blocking", ASYNC_TARGET),
    ("first epoch / plain", "blocking", "first", "plain", FIRST_TARGET),
)

HEADER = (
    "point",
    "rounds",
    *(f"{name} (≥ {target:.2f}×)" for name, _, _, _, target in CHECKS),
    "A/A first (90%)",
    "A/A later (90%)",
    "GIL share",
    "result",
)


def row(run: bw.Run) -> tuple[tuple[str, ...], list[str], bool]:
    """The table row, the targets missed, and whether the point is resolved (a check
    whose contenders the run has not, W5's plain loop: "—")."""
    ok = resolved(run)
    cells, missed = [], []
    keys = {r.contender.key for r in run.rows}
    for name, key, kind, against, target in CHECKS:
        if not {key, against} <= keys:
            cells.append("—")
            continue
        got = statistics.median(per_round(run, key, kind, against))
        cells.append(f"{got:.2f}×")
        if got < target:
            missed.append(f"{name} {got:.3f}× < {target:.2f}×")
    aa = []
    for kind in ("first", "later"):
        ratios = per_round(run, "again", kind, "blocking")
        lo, hi = interval(ratios)
        aa.append(f"{statistics.median(ratios):.2f}× ({lo:.2f}–{hi:.2f})")
    serial = run.row("blocking").gil(lambda b, n: b.serial)
    result = ("MISS: " + "; ".join(missed) if missed else "PASS") + ("" if ok else " (unresolved)")
    return (
        (
            run.workload.name,
            str(len(run.row("blocking").rates["later"])),
            *cells,
            *aa,
            "—" if serial is None else f"{serial:.0%}",
            result,
        ),
        missed,
        ok,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two points, tiny databases, 3 rounds")
    ap.add_argument("--rounds", type=int, help=f"rounds (default {ROUNDS}, quick 3)")
    ap.add_argument("--points", metavar="SUBSTR,...", help="only points whose name contains one")
    ap.add_argument(
        "--workloads",
        metavar="W1,W3,...",
        help="bench_workloads.py's workloads instead of the small-record points",
    )
    ap.add_argument("--json", type=Path, metavar="OUT", help="write every sample to OUT")
    ap.add_argument("--data-dir", type=Path, help="LMDB cache (default bench/_data)")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--check", action="store_true", help="exit 1 on a resolved miss")
    fresh_memory.add_option(ap)
    args = ap.parse_args(argv)
    if args.prefault < 0:
        ap.error("--prefault must be >= 0")
    cs.PREFAULT_MIB = args.prefault
    if args.rounds is None:
        args.rounds = 3 if args.quick else ROUNDS
    if args.rounds < 3:
        ap.error("--rounds must be >= 3 (an interval needs rounds)")
    points = [
        p
        for p in sweep.grid(False)
        if p.kind == "raw" and p.shape[0] * p.shape[1] * p.shape[2] <= MAX_PIXELS
    ]
    if args.points:
        wanted = [t.strip() for t in args.points.split(",")]
        points = [p for p in points if any(t in p.name for t in wanted)]
    if args.quick:
        points = points[:2]
    chosen = bw.select(bw.workloads(args.quick), args.workloads) if args.workloads else []
    root = DATA_DIR if args.data_dir is None else args.data_dir
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    host = cs.AsyncHost()
    runs = []

    def measured(run: bw.Run) -> None:
        sweep.measure_point(run, args.rounds)
        runs.append(run)
        name = run.workload.name
        print(f"[{time.perf_counter() - t0:6.1f} s] {name}", file=sys.stderr, flush=True)

    try:
        for w in chosen:  # the same contenders as at a point (no torch, no DALI)
            pre = prepare(w.db, root)
            warm_page_cache(pre)
            run = bw.build(w, pre, host, False, False)
            run.rows = [r for r in run.rows if r.contender.key in PAIRED]
            measured(run)
        for p in [] if chosen else points:
            pre = prepare(sweep.db_spec(p, args.quick), root)
            warm_page_cache(pre)
            measured(sweep.build(p, pre, host))
    finally:
        host.close()
    print(
        f"blobpipe pairs: {len(runs)} {'workloads' if chosen else 'small-record points'}, "
        f"{args.rounds} interleaved rounds "
        f"each, medians of per-round ratios; {os.cpu_count()} CPU cores, load "
        f"average {load0:.2f} at start; {time.perf_counter() - t0:.0f} s"
    )
    if note := fresh_memory.note(args.prefault):
        print(f"fresh memory: {note}")
    print()
    lines, resolved_count, misses = [], 0, 0
    for run in runs:
        line, missed, ok = row(run)
        lines.append(line)
        resolved_count += ok
        misses += bool(missed) and ok
    print(bw.render(HEADER, lines, args.markdown, set(range(1, len(HEADER) - 1))))
    print(
        f"\n{resolved_count} of {len(runs)} points resolved (the A/A control's 90% interval "
        f"within ±{RESOLUTION:.0%}); {misses} resolved point(s) miss a target"
    )
    if args.json is not None:
        doc = {
            "benchmark": "bench_pairs",
            "quick": args.quick,
            "prefault": args.prefault,
            "rounds": args.rounds,
            "loadavg_start": load0,
            "points": [
                {
                    "name": run.workload.name,
                    "rates": {r.contender.key: r.rates for r in run.rows},
                    "gil_serial": run.row("blocking").gil(lambda b, n: b.serial),
                    "resolved": resolved(run),
                }
                for run in runs
            ],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if args.check and (misses or not resolved_count) else 0


if __name__ == "__main__":
    sys.exit(main())
