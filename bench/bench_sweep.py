"""The Loader against the plain loop over a grid of record shapes, kinds and recipes.

Run: ``python bench/bench_sweep.py [--quick] [--rounds N] [--points SUBSTR,...]
[--point NAME ...] [--json OUT] [--plot OUT.png] [--data-dir DIR] [--markdown] [--check]
[--prefault MIB]``

The workload benchmark (``bench_workloads.py``) measures five workloads; this one
measures the space around them, with the same harness (its contenders, its
interleaved rounds, its first epochs in a fresh process, its idle wait between
passes): raw Datums from 1×28×28 to 3×512×512 (square and not), JPEG and PNG
records, TEST and TRAIN recipes (scale only; crop; crop + mirror + mean file; mean
values), NCHW and NHWC, uint8 pass-through. Each point is one database and one
recipe; the databases (``bench/_data/sweep_*``, git-ignored) hold about 24 MB of
pixels each (at least 6 batches), so an epoch takes tens of milliseconds and the
whole sweep about ten minutes on a 2-core machine. ``--point NAME`` (repeatable) measures
a point the grid does not hold, named as the table names points (``x`` for ``×``):
``--point 'raw 3x48x48 TEST, scale'`` checks a change on held-out shapes as well.

Contenders per point: the plain one-thread loop (the baseline), the Loader with 2
workers in its ``async for`` and blocking forms, the blocking form with 1 worker,
``Batches`` driven by hand in one thread (``next_plan`` and ``fill``: the batch work
without a pipeline), and the blocking form with 2 workers a second time (an A/A
control: its ratio to the first shows how far two runs of the same code differ at
that point in that run, the noise a ratio such as ``async for`` / blocking is read against); each as
a first epoch (a fresh process) and as later epochs (a pipeline kept open). A
point's contenders are opened, measured over all its rounds (every round runs every
pass once, in an order rotated each round) and closed before the next point, so
memory stays bounded; ratios are medians over rounds of the ratio to the plain loop
of the same round. A later pass times several epochs back to
back (as many as the plain loop needs 0.3 s for). This machine's share of the host
varies for minutes at a time, and two threads suffer more from it than one: each
round starts once two threads hash at least 1.7× as fast as one (waiting up to
20 s), and the table gives the lowest such headroom a point's rounds started at.

Targets at every point: the Loader's later epochs ≥ 1.5× the plain loop, first
epochs ≥ 1.2× (and never below 1.0×); ``async for`` ≥ 0.95× the blocking form
(first and later); where the batch work dominates (one worker takes ≥ 1 ms a
batch in later epochs), 2 workers ≥ 1.6× one, elsewhere (small batches, where the
pipeline's own Python decides) 2 workers ≥ 1.5× ``Batches`` in one thread. ``--check``
exits 1 on a miss.

Each point also shows the blocking Loader's GIL budget in later epochs
(``bench_workloads.py`` explains it): the share s of its CPU time that holds the GIL,
and the speed-up ``1 / (s + (1 - s) / 32)`` that 32 workers could reach at most.

The table lists each point's record bytes (the stored value), the plain loop's
later img/s, and the ratios; ``--plot`` (default ``bench/_data/sweep.png`` when
matplotlib is installed: ``pip install -e '.[bench]'``) draws the later- and
first-epoch ratios of the blocking form against record bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _contenders as cs
import _fresh as fresh_memory
import bench_workloads as bw
from _make import make
from _workloads_data import DATA_DIR, DbSpec, prepare, warm_page_cache

LATER_TARGET = 1.5
FIRST_TARGET = 1.2
FIRST_FLOOR = 1.0
ASYNC_TARGET = 0.95
SCALING_TARGET = 1.6
# one worker's later-epoch time per batch from which the batch work dominates
WORK_DOMINATES_S = 1e-3
# a later pass times as many epochs back to back as the plain loop needs this long for
# (its untimed first epoch, measured when it opens), at most MAX_LATER_EPOCHS: an epoch
# of a sweep database is tens of milliseconds, too short to measure alone
LATER_PASS_S = 0.3
MAX_LATER_EPOCHS = 16
PIXEL_BUDGET = 24 << 20  # pixel bytes per sweep database
KEYS = ("plain", "async", "blocking", "blocking1", "again", "batches")
# where the batch work does not dominate: 2 workers against Batches driven in one thread
PIPELINE_TARGET = 1.5
# the A/A control counts as agreeing with the blocking form within this (either way)
AA_BAND = 0.05


@dataclass(frozen=True)
class Point:
    name: str
    kind: str  # raw, jpeg, png
    shape: tuple[int, int, int]
    recipe: cs.Recipe


def _batch(shape: tuple[int, int, int]) -> int:
    pixels = shape[0] * shape[1] * shape[2]
    return 64 if pixels <= 3 * 128 * 128 else (32 if pixels <= 3 * 256 * 256 else 16)


def grid(quick: bool) -> list[Point]:
    """The sweep's points (a handful of small ones with ``quick``)."""
    mv = (104.0, 117.0, 123.0)
    s = 0.00390625
    table: list[tuple[str, tuple[int, int, int], dict[str, Any]]] = [
        ("raw", (1, 28, 28), {"phase": "test", "scale": s}),
        ("raw", (1, 28, 28), {"phase": "train", "crop": 24, "mirror": True, "mean_value": (33.0,)}),
        ("raw", (3, 32, 32), {"phase": "test", "scale": s}),
        ("raw", (3, 32, 32), {"phase": "train", "mirror": True, "mean_file": True}),
        ("raw", (3, 32, 32), {"phase": "train", "mirror": True, "mean_value": mv}),
        ("raw", (3, 40, 40), {"phase": "test", "crop": 32, "scale": s}),
        ("raw", (3, 48, 48), {"phase": "test", "scale": s}),
        ("raw", (3, 64, 64), {"phase": "test", "scale": s}),
        ("raw", (3, 64, 64), {"phase": "test", "scale": s, "layout": "NHWC"}),
        ("raw", (3, 64, 64), {"phase": "train", "crop": 56, "mirror": True, "mean_file": True}),
        ("raw", (3, 64, 64), {"phase": "test", "dtype": "uint8"}),
        ("raw", (3, 80, 80), {"phase": "train", "crop": 64, "mirror": True, "mean_file": True}),
        ("raw", (3, 96, 96), {"phase": "test", "scale": s}),
        ("raw", (3, 96, 96), {"phase": "train", "crop": 80, "mirror": True, "mean_file": True}),
        ("raw", (3, 96, 96), {"phase": "test", "mean_value": mv, "scale": s}),
        ("raw", (3, 128, 128), {"phase": "test", "scale": s}),
        ("raw", (3, 128, 128), {"phase": "train", "crop": 112, "mirror": True, "mean_file": True}),
        ("raw", (3, 128, 128), {"phase": "train", "crop": 112, "mean_value": mv, "layout": "NHWC"}),
        ("raw", (3, 224, 224), {"phase": "test", "scale": s}),
        ("raw", (3, 224, 224), {"phase": "test", "mean_value": mv, "layout": "NHWC"}),
        ("raw", (3, 256, 256), {"phase": "test", "scale": s}),
        ("raw", (3, 256, 256), {"phase": "train", "crop": 227, "mirror": True, "mean_file": True}),
        ("raw", (3, 256, 256), {"phase": "test", "crop": 227, "mean_file": True}),
        ("raw", (3, 256, 256), {"phase": "test", "dtype": "uint8"}),
        ("raw", (3, 375, 500), {"phase": "test", "scale": s}),
        ("raw", (3, 375, 500), {"phase": "train", "crop": 227, "mirror": True, "mean_value": mv}),
        ("raw", (3, 512, 512), {"phase": "test", "scale": s}),
        ("raw", (3, 512, 512), {"phase": "train", "crop": 448, "mirror": True, "mean_value": mv}),
        ("raw", (3, 512, 512), {"phase": "test", "dtype": "uint8"}),
        ("jpeg", (3, 64, 64), {"phase": "test", "scale": s}),
        ("jpeg", (3, 96, 96), {"phase": "train", "crop": 80, "mirror": True, "mean_value": mv}),
        ("jpeg", (3, 256, 256), {"phase": "test", "crop": 224, "scale": s}),
        ("jpeg", (3, 256, 256), {"phase": "train", "crop": 227, "mirror": True, "mean_value": mv}),
        ("jpeg", (3, 375, 500), {"phase": "train", "crop": 227, "mirror": True, "mean_value": mv}),
        ("jpeg", (3, 375, 500), {"phase": "test", "crop": 227, "mean_value": mv, "layout": "NHWC"}),
        ("jpeg", (3, 512, 512), {"phase": "train", "crop": 448, "mirror": True, "mean_value": mv}),
        ("png", (3, 64, 64), {"phase": "test", "scale": s}),
        ("png", (3, 256, 256), {"phase": "train", "crop": 227, "mirror": True, "mean_value": mv}),
    ]
    if quick:
        table = [table[i] for i in (9, 29)]
    points = []
    for kind, shape, kw in table:
        if quick:  # small records, few of them
            c, h, w = shape
            shape = (c, min(h, 64), min(w, 64))
            if kw.get("crop"):
                kw = {**kw, "crop": min(kw["crop"], shape[1] - 8)}
        points.append(_point(kind, shape, kw))
    return points


_MEAN_FILE_WANTED = Path("<mean file>")


def _mark(recipe: cs.Recipe) -> cs.Recipe:
    """A recipe that wants its database's mean file (filled in once it is prepared)."""
    return dataclasses.replace(recipe, mean_file=_MEAN_FILE_WANTED)


def _name(kind: str, shape: tuple[int, int, int], r: cs.Recipe, mean_file: bool) -> str:
    steps = [r.phase.upper()]
    if r.crop:
        steps.append(f"crop {r.crop}")
    if r.mirror:
        steps.append("mirror")
    if mean_file:
        steps.append("mean file")
    if r.mean_value:
        steps.append("mean values")
    if r.scale != 1.0:
        steps.append("scale")
    if r.dtype == "uint8":
        steps.append("uint8")
    if r.layout == "NHWC":
        steps.append("NHWC")
    return f"{kind} {'×'.join(map(str, shape))} " + ", ".join(steps)


_STEP = re.compile(r"crop (\d+)|mirror|mean file|mean values|scale|uint8|NHWC")


def point_from_name(name: str) -> Point:
    """The point a name spells, as :func:`grid` names its points (``x`` for ``×``):
    ``"raw 3x48x48 TEST, scale"``, ``"raw 3x80x80 TRAIN, crop 64, mirror, mean file"``:
    a point of the same kinds of records and recipes, of a shape the grid does not
    hold (the held-out shapes a change is checked on besides the grid's)."""
    head, _, rest = name.replace("×", "x").partition(",")
    try:
        kind, dims, phase = head.split()
        c, h, w = (int(v) for v in dims.split("x"))
    except ValueError:
        raise ValueError(
            f"{name!r}: expected 'KIND CxHxW PHASE[, step, ...]', e.g. 'raw 3x48x48 TEST, scale'"
        ) from None
    if kind not in ("raw", "jpeg", "png") or phase not in ("TEST", "TRAIN"):
        raise ValueError(f"{name!r}: KIND is raw, jpeg or png; PHASE is TEST or TRAIN")
    kw: dict[str, Any] = {"phase": phase.lower()}
    for step in (s.strip() for s in rest.split(",") if s.strip()):
        m = _STEP.fullmatch(step)
        if m is None:
            raise ValueError(f"{name!r}: unknown step {step!r}")
        if m.group(1):
            kw["crop"] = int(m.group(1))
        elif step == "mean file":
            kw["mean_file"] = True
        elif step == "mean values":
            kw["mean_value"] = (104.0, 117.0, 123.0)[:c] if c == 3 else (33.0,) * c
        elif step == "scale":
            kw["scale"] = 0.00390625
        elif step == "uint8":
            kw["dtype"] = "uint8"
        else:
            kw[step.lower() if step != "NHWC" else "layout"] = True if step == "mirror" else step
    return _point(kind, (c, h, w), kw)


def _point(kind: str, shape: tuple[int, int, int], kw: dict[str, Any]) -> Point:
    kw = {"mean_file": None, **kw}
    wants_mean = bool(kw["mean_file"])
    recipe = cs.Recipe(batch=_batch(shape), encoded=kind != "raw", **{**kw, "mean_file": None})
    name = _name(kind, shape, recipe, wants_mean)
    return Point(name, kind, shape, recipe if not wants_mean else _mark(recipe))


def db_spec(point: Point, quick: bool) -> DbSpec:
    c, h, w = point.shape
    per = c * h * w
    batch = point.recipe.batch
    count = max(6 * batch, min(20_000, PIXEL_BUDGET // per))
    if point.kind != "raw":
        count = max(6 * batch, min(count, 2048))  # decoding is the cost: fewer records
    if quick:
        count = 4 * batch
    count -= count % batch  # whole batches: first and later epochs alike
    return DbSpec(
        name=f"sweep_{point.kind}",
        kind=point.kind,  # type: ignore[arg-type]
        count=count,
        pool=16 if quick else 64,
        keys="index",
        shape=point.shape,
        quality=90,
        mean_file=point.kind == "raw",
        fixed=point.kind == "jpeg",
    )


# -- measuring ---------------------------------------------------------------------------------


def recipe_for(point: Point, prepared: Any) -> cs.Recipe:
    """``point``'s recipe over its prepared database (the mean file made with it)."""
    recipe = point.recipe
    if recipe.mean_file is not None:
        recipe = dataclasses.replace(recipe, mean_file=prepared.mean_file)
    return recipe


def build(point: Point, prepared: Any, host: cs.AsyncHost) -> bw.Run:
    recipe = recipe_for(point, prepared)
    files = cs.Files(loader=prepared.path, first=prepared.first, plain=prepared.copy)
    out = recipe.out_shape(*point.shape)
    rows = [bw.Row(make(key, files, recipe, out, host)) for key in KEYS]
    for row in rows[1:3]:
        row.checks = [
            bw.Check("first", "plain", FIRST_TARGET),
            bw.Check("later", "plain", LATER_TARGET),
        ]
    rows[1].checks += [
        bw.Check("first", "blocking", ASYNC_TARGET),
        bw.Check("later", "blocking", ASYNC_TARGET),
    ]
    workload = bw.Workload(point.name, point.name, prepared.spec, recipe)
    plain = rows[0].contender
    assert isinstance(plain, cs.PlainLoop)
    error = cs.check_against_transform(recipe, files.plain, lambda v, d: list(plain.rows_of(v, d)))
    return bw.Run(workload, prepared, recipe, rows, transform_errors={"plain": error})


# per point name and contender: the CPU seconds per image of each later-epoch pass
CPU: dict[str, dict[str, list[float]]] = {}
# per point name: the parallel headroom each round started at (bw.quiet_headroom)
HEADROOM: dict[str, list[float]] = {}


def measure_point(run: bw.Run, rounds: int) -> None:
    """Open the point's kept-open contenders, run its rounds, close them. Each
    later-epoch pass also records the process's CPU time per image (all threads;
    the Loader's passes run two epochs, the plain loop's one; the idle wait after a
    pass, when a Loader refills its ring, is counted too): a figure that the load
    of other processes on the machine changes much less than wall-clock rates."""
    cpu = CPU.setdefault(run.workload.name, {row.contender.key: [] for row in run.rows})
    try:
        for row in run.rows:
            t0 = time.perf_counter()
            row.contender.start()
            if row.contender.key == "plain":
                run.later_epochs = later_epochs(time.perf_counter() - t0)
            bw.settle()
        items = [(row, kind) for row in run.rows for kind in ("first", "later")]
        headroom = HEADROOM.setdefault(run.workload.name, [])
        for rnd in range(rounds):
            headroom.append(bw.quiet_headroom())
            shift = (rnd * 3) % len(items)
            for row, kind in items[shift:] + items[:shift]:
                c0 = time.process_time()
                bw.run_pass(run, row, kind, keep=rnd == 0)
                if kind == "later":  # the Loaders run one more epoch, untimed
                    epochs = run.later_epochs + (row.contender.key != "plain")
                    spent = time.process_time() - c0
                    cpu[row.contender.key].append(spent / (epochs * run.prepared.count))
    finally:
        for row in run.rows:
            row.contender.close()
        cs.close_shared_envs()


def later_epochs(plain_epoch_s: float) -> int:
    """Epochs a later pass times together, given the plain loop's epoch time."""
    return max(1, min(MAX_LATER_EPOCHS, math.ceil(LATER_PASS_S / max(plain_epoch_s, 1e-6))))


def evaluate(run: bw.Run) -> None:
    """The harness's checks, plus: first epochs never below the plain loop, and 2 workers
    against 1 where the batch work dominates."""
    one = run.row("blocking1").median("later")
    dominated = one is not None and run.recipe.batch / one >= WORK_DOMINATES_S
    blocking = run.row("blocking")
    if dominated:
        blocking.checks.append(bw.Check("later", "blocking1", SCALING_TARGET))
    else:
        blocking.checks.append(bw.Check("later", "batches", PIPELINE_TARGET))
    bw.compare_first_batches(run)
    bw.evaluate(run)
    for key in ("async", "blocking"):
        row = run.row(key)
        worst = min(
            (
                a / b
                for a, b in zip(row.rates["first"], run.row("plain").rates["first"], strict=True)
            ),
            default=None,
        )
        if worst is not None and worst < FIRST_FLOOR:
            row.problems.append(f"a first epoch at {worst:.3f}× < {FIRST_FLOOR:.2f}×")


def _r(run: bw.Run, key: str, kind: str, against: str = "plain") -> float | None:
    return run.ratio(run.row(key), kind, against)


HEADER = (
    "point",
    "record B",
    "epochs",
    "headroom",
    "plain later img/s",
    "async first",
    "async later",
    "blocking first",
    "blocking later",
    "1 worker later",
    "2 / 1 workers",
    "2 workers / Batches",
    "async / blocking later",
    "A/A first",
    "A/A later",
    "CPU/img: plain / Loader",
    "GIL share · bound 32",
    "result",
)


def cpu_ratio(run: bw.Run, key: str = "blocking") -> float | None:
    """The plain loop's CPU time per image over the Loader's (2 workers, all its
    threads), later epochs, medians."""
    cpu = CPU.get(run.workload.name, {})
    if not cpu.get("plain") or not cpu.get(key):
        return None
    return statistics.median(cpu["plain"]) / statistics.median(cpu[key])


def table(runs: list[bw.Run]) -> list[tuple[str, ...]]:
    f = bw._fmt_ratio
    lines: list[tuple[str, ...]] = []
    for run in runs:
        problems = [f"{k}: {p}" for k in ("async", "blocking") for p in run.row(k).problems]
        problems += [f"plain: {p}" for p in run.row("plain").problems]
        one = run.row("blocking1").median("later")
        dominated = one is not None and run.recipe.batch / one >= WORK_DOMINATES_S
        scaling = f(_r(run, "blocking", "later", "blocking1"))
        pipeline = f(_r(run, "blocking", "later", "batches"))
        lines.append(
            (
                run.workload.name,
                f"{run.prepared.value_bytes:,.0f}",
                str(run.later_epochs),
                f"{min(HEADROOM.get(run.workload.name) or [0.0]):.2f}×",
                bw._fmt_rate(run.row("plain").median("later")),
                f(_r(run, "async", "first")),
                f(_r(run, "async", "later")),
                f(_r(run, "blocking", "first")),
                f(_r(run, "blocking", "later")),
                f(_r(run, "blocking1", "later")),
                scaling if dominated else f"({scaling})",
                f"({pipeline})" if dominated else pipeline,
                f(_r(run, "async", "later", "blocking")),
                f(_r(run, "again", "first", "blocking")),
                f(_r(run, "again", "later", "blocking")),
                f(cpu_ratio(run)),
                bw._gil_cell(run.row("blocking")),
                "MISS: " + "; ".join(problems) if problems else "PASS",
            )
        )
    return lines


def control_summary(runs: list[bw.Run]) -> str:
    """How far the A/A control (the blocking form measured twice) strayed from 1×:
    the spread that two measurements of the same code show in this run."""
    parts = []
    for kind in ("first", "later"):
        got = [r for r in (_r(run, "again", kind, "blocking") for run in runs) if r is not None]
        if not got:
            continue
        within = sum(abs(r - 1.0) <= AA_BAND for r in got)
        parts.append(
            f"{kind} epochs within ±{AA_BAND:.0%} of 1× at {within} of {len(got)} points "
            f"({min(got):.2f}×–{max(got):.2f}×)"
        )
    if not parts:
        return "A/A control: not measured"
    return "A/A control (the blocking form against itself, same rounds): " + "; ".join(parts)


def plot(runs: list[bw.Run], path: Path) -> str:
    """The ratio of the blocking Loader to the plain loop against record bytes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install -e '.[bench]')"
    fig, ax = plt.subplots(figsize=(9, 5.5))
    markers = {"raw": "o", "jpeg": "s", "png": "^"}
    for kind, marker in markers.items():
        sel = [r for r in runs if r.prepared.spec.kind == kind]
        if not sel:
            continue
        x = [r.prepared.value_bytes for r in sel]
        later = [_r(r, "blocking", "later") or 0.0 for r in sel]
        first = [_r(r, "blocking", "first") or 0.0 for r in sel]
        ax.scatter(x, later, marker=marker, color="tab:blue", label=f"{kind}, later epochs")
        ax.scatter(
            x, first, marker=marker, facecolors="none", edgecolors="tab:orange",
            label=f"{kind}, first epoch",
        )  # fmt: skip
    ax.axhline(LATER_TARGET, color="tab:blue", ls="--", lw=0.8)
    ax.axhline(FIRST_TARGET, color="tab:orange", ls="--", lw=0.8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")  # ratios: 0.5× and 2× lie as far from 1×
    ticks = [0.25, 0.5, 0.75, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 10.0]
    ax.set_yticks(ticks, [f"{t:g}×" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("record bytes (stored value)")
    ax.set_ylabel("Loader (blocking, 2 workers) / plain loop")
    ax.set_title("blobpipe sweep: the Loader against the plain loop")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return f"plot: {path}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two small points, one round")
    ap.add_argument("--rounds", type=int, help="interleaved rounds per point (default 2, quick 1)")
    ap.add_argument("--points", metavar="SUBSTR,...", help="only points whose name contains one")
    ap.add_argument(
        "--point",
        action="append",
        default=[],
        metavar="NAME",
        help="also measure this point, named as the table names points (repeatable; "
        "'raw 3x48x48 TEST, scale'); with only --point, only these",
    )
    ap.add_argument("--json", type=Path, metavar="OUT", help="write every sample to OUT")
    ap.add_argument("--plot", type=Path, metavar="OUT", help="the PNG plot (default under data)")
    ap.add_argument("--data-dir", type=Path, help="LMDB cache (default bench/_data)")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    fresh_memory.add_option(ap)
    args = ap.parse_args(argv)
    if args.prefault < 0:
        ap.error("--prefault must be >= 0")
    cs.PREFAULT_MIB = args.prefault
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    points = grid(args.quick)
    if args.points:
        wanted = [t.strip() for t in args.points.split(",")]
        points = [p for p in points if any(t in p.name for t in wanted)]
    elif args.point:
        points = []
    try:
        points += [point_from_name(name) for name in args.point]
    except ValueError as exc:
        ap.error(str(exc))
    root = DATA_DIR if args.data_dir is None else args.data_dir

    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    headroom = bw.parallel_headroom()
    prepared = {}
    for p in points:
        spec = db_spec(p, args.quick)
        if spec not in prepared:
            prepared[spec] = prepare(spec, root)
    t_data = time.perf_counter() - t0
    host = cs.AsyncHost()
    runs = []
    try:
        for p in points:
            pre = prepared[db_spec(p, args.quick)]
            warm_page_cache(pre)
            run = build(p, pre, host)
            measure_point(run, args.rounds)
            evaluate(run)
            runs.append(run)
            print(
                f"[{time.perf_counter() - t0:6.1f} s] {len(runs)}/{len(points)} {p.name}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        host.close()
    elapsed = time.perf_counter() - t0
    print(
        f"blobpipe sweep{' (--quick)' if args.quick else ''}: {len(runs)} points, "
        f'{args.rounds} interleaved round(s) each, medians; Loader device="cpu", '
        'mode="epoch"'
    )
    if note := fresh_memory.note(args.prefault):
        print(f"fresh memory: {note}")
    print(
        f"machine: {os.cpu_count()} CPU cores, load average {load0:.2f} at start, parallel "
        f"headroom {headroom:.2f}× (2.00× = two idle cores); time: data {t_data:.1f} s, "
        f"total {elapsed:.1f} s"
    )
    print(
        "ratios to the plain loop of the same round; '2 / 1 workers' in parentheses where "
        f"one worker takes < {WORK_DOMINATES_S * 1e3:g} ms a batch (not checked); 'CPU/img': "
        "the plain loop's CPU time per image over the blocking Loader's (all threads, later "
        "epochs), which other processes' load changes far less than the wall-clock ratios; "
        f"a later pass times the epochs the plain loop needs {LATER_PASS_S:g} s for (at most "
        f"{MAX_LATER_EPOCHS}; 'epochs' column); each round waits (up to 20 s) until 2 threads "
        "hash at least 1.70× as fast as 1 ('headroom': the lowest a round started at)\n"
    )
    lines = table(runs)
    print(bw.render(HEADER, lines, args.markdown, set(range(1, len(HEADER) - 1))))
    missed = [line[0] for line in lines if line[-1] != "PASS"]
    print(f"\n{len(lines) - len(missed)} of {len(lines)} points PASS, {len(missed)} MISS")
    print(control_summary(runs))
    plot_path = args.plot or (root / ("sweep_quick.png" if args.quick else "sweep.png"))
    print(plot(runs, plot_path))
    if args.json is not None:
        doc = {
            "benchmark": "bench_sweep",
            "quick": args.quick,
            "prefault": args.prefault,
            "rounds": args.rounds,
            "loadavg_start": load0,
            "parallel_headroom": headroom,
            "seconds": elapsed,
            "points": [
                {
                    "name": run.workload.name,
                    "kind": run.prepared.spec.kind,
                    "shape": list(run.prepared.spec.shape),
                    "records": run.prepared.count,
                    "later_epochs_per_pass": run.later_epochs,
                    "parallel_headroom_per_round": HEADROOM.get(run.workload.name),
                    "record_bytes": run.prepared.value_bytes,
                    "recipe": run.recipe.to_doc(),
                    "plain_vs_transform_max_abs_diff": run.plain_error,
                    "contenders": {
                        row.contender.key: {
                            kind: {
                                "img_s": row.rates[kind],
                                "ratio": run.ratio(row, kind),
                            }
                            for kind in ("first", "later")
                        }
                        for row in run.rows
                    },
                    "cpu_s_per_image_later": CPU.get(run.workload.name),
                    "problems": {row.contender.key: row.problems for row in run.rows},
                    "result": "PASS" if line[-1] == "PASS" else "MISS",
                }
                for run, line in zip(runs, lines, strict=True)
            ],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
