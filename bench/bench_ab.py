"""Paired A/B of blobpipe's batch work between two checkouts, on the workload databases.

Run: ``python bench/bench_ab.py OTHER_CHECKOUT [--pairs N] [--epochs N] [--workloads W1,W2]
[--point NAME ...] [--loader [blocking|async]] [--control] [--data-dir DIR] [--quick]``, or
``python bench/bench_ab.py OTHER_CHECKOUT --in-process [--rounds N] [--workloads ...]
[--point NAME ...]``

For each workload (W1–W5 and W3-test of ``bench_workloads.py``, the same databases and
recipes; default W1–W4; ``--point`` adds a point of ``bench_sweep.py`` by name, its
database and recipe) it starts one fresh process per side, alternating (this checkout,
the other, this, ...), each reading ``--epochs`` epochs: with ``Batches`` driven by hand in
one thread (the workload benchmark's "Batches, one thread" row), the thread's CPU seconds
of its best later epoch; with ``--loader``, a ``Loader`` (2 workers, device "cpu") in its
blocking form (``for batch in loader``) or, with ``--loader async``, its ``async for``
form under asyncio, the whole process's CPU seconds and the wall-clock seconds of its best
later epoch, and the wall-clock seconds of its first epoch (open to close); either way also
the µs a batch that some thread held the GIL (``_io/_budget.py``; the median of the later
epochs). The loop
reads each batch's data on the host and keeps nothing but its loop variable, as a
training loop does. It prints, per workload and figure, both sides' minimum and median
and the median over pairs of this side / the other side: below 1.00 means this checkout
spends less. Pairing keeps the ratio meaningful when the machine's speed drifts; on a
shared VM single runs differ by ±20%, so use 8 pairs or more. ``--control`` adds an A/A
control: each pair also runs this checkout a second time (the three in an order rotated
each pair), and the last column gives the median and the range over pairs of this side
/ its second run: how far two measurements of the same code differ in this run, the
spread a this / other ratio is read against.

Each pair's processes first allocate and keep the same random number of bytes (a multiple
of 16 below 128 KiB; ``--no-heap-pad``: none), so that every later heap address shifts by
an amount drawn anew each pair. Where a workload's speed depends on where its buffers
land (W4: an 8 KiB shift of the heap moved its CPU time by 5% with ASLR off, the same in
every run), a change that only allocates a little more or less would otherwise read as a
speed change, and the A/A control, which repeats one layout, would not show it.

The other checkout is put first on ``PYTHONPATH``, so its ``blobpipe`` is the one imported
(e.g. ``git worktree add ../before HEAD~3``). Databases are made on first use and cached
under ``bench/_data`` (as the workload benchmark's).

``--in-process`` pairs Loaders in one process instead, for changes of a few percent to
the per-batch Python, which fresh processes do not resolve: the other checkout's package
is imported as ``blobpipe_other`` (a link to its ``blobpipe/`` folder; its imports are
relative and its compiled modules load under any name; built with ``python setup.py
build_ext --inplace`` there), and three Loaders (2 workers, device "cpu", the blocking
form) are opened side by side: this checkout's, the other's (on the database's
byte-identical copy: LMDB opens a file once a process) and this checkout's again, the A/A
control. Each round times a later epoch of each, in an order reversed every other round,
each after an untimed epoch of the same Loader (``bench_planners.py``'s method); it prints
the medians of µs a batch and the median of the per-round ratios this / other (below 1.00:
this checkout is faster) and this / again, each with its 90% bootstrap interval (
``bench_pairs.py``'s): a ratio is resolved where the control's interval lies within ±5%.
The control shares this checkout's code, not the other's place: Loaders differ by where
their buffers land, so run this checkout against itself (``bench_ab.py . --in-process``)
to see what the other's place alone reads (W1 0.99-1.00×, W2 1.00-1.03× on the
development VM).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# One measurement, run in a fresh process of either side: prints a JSON line.
_CHILD = r"""
import json, statistics, sys, time
spec = json.loads(sys.argv[1])
pad = bytearray(spec["pad"])  # kept: every later heap address shifts by it
import numpy as np
import blobpipe
try:
    from blobpipe._io._budget import measure
except ImportError:  # (a checkout from before the GIL budget: no figure)
    import contextlib, types

    @contextlib.contextmanager
    def measure():
        yield types.SimpleNamespace(held=float("nan"))
t = blobpipe.Transform(**spec["transform"])
kw = dict(transform=t, phase=spec["phase"], order=spec["order"], mode="epoch")
walls, cpus, gils = [], [], []  # gils: µs holding the GIL a batch
first = 0.0
if spec["loader"] == "blocking":
    t0 = time.perf_counter()
    with blobpipe.Loader(spec["db"], spec["batch"], device="cpu", workers=2, **kw) as loader:
        for _ in range(spec["epochs"]):
            t0, c0 = (t0 if not walls else time.perf_counter()), time.process_time()
            n = 0
            with measure() as bud:
                for batch in loader:
                    batch.data.cpu_data()
                    n += 1
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            gils.append(1e6 * bud.held / max(n, 1))
elif spec["loader"] == "async":
    import anyio

    async def run():
        t0 = time.perf_counter()
        async with blobpipe.Loader(
            spec["db"], spec["batch"], device="cpu", workers=2, **kw
        ) as loader:
            for _ in range(spec["epochs"]):
                t0, c0 = (t0 if not walls else time.perf_counter()), time.process_time()
                n = 0
                with measure() as bud:
                    async for batch in loader:
                        batch.data.cpu_data()
                        n += 1
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
                gils.append(1e6 * bud.held / max(n, 1))

    anyio.run(run)
else:
    b = blobpipe.Batches(spec["db"], spec["batch"], **kw)
    label = np.empty(spec["batch"], np.float32)
    for _ in range(spec["epochs"]):
        t0, c0 = time.perf_counter(), time.thread_time()
        data = None
        n = 0
        with measure() as bud:
            while (plan := b.next_plan()) is not None:
                if data is None or data.shape != plan.data_shape:
                    data = np.empty(plan.data_shape, plan.dtype)
                b.fill(plan, data, label[: len(plan)])
                n += 1
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
        gils.append(1e6 * bud.held / max(n, 1))
    b.close()
print(json.dumps({
    "file": blobpipe.__file__, "cpu": min(cpus[1:]), "wall": min(walls[1:]), "first": walls[0],
    "gil": statistics.median(gils[1:]),
}))
"""


def _measure(checkout: Path, spec: dict[str, object]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        cwd=checkout,  # ``-c`` puts the working directory first on sys.path
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    got: dict[str, float] = json.loads(out.splitlines()[-1])
    here = Path(str(got["file"])).resolve()
    if not here.is_relative_to(checkout.resolve()):
        raise SystemExit(f"{checkout}: imported blobpipe from {here}, not from the checkout")
    return got


def _other_package(checkout: Path) -> Any:
    """The other checkout's ``blobpipe``, imported as ``blobpipe_other``."""
    folder = Path(tempfile.mkdtemp(prefix="bench_ab_"))
    atexit.register(shutil.rmtree, folder, True)  # (the link only: the checkout stays)
    (folder / "blobpipe_other").symlink_to((checkout / "blobpipe").resolve())
    sys.path.insert(0, str(folder))
    package = importlib.import_module("blobpipe_other")
    try:  # without it small batches take another path: the pairing would mislead
        importlib.import_module("blobpipe_other._io._rowkernel")
    except ImportError:
        raise SystemExit(
            f"{checkout}: its row kernel is not built; run `python setup.py build_ext --inplace` "
            "there"
        ) from None
    return package


def in_process(other: Path, chosen: list[tuple[Any, bool]], rounds: int, data_dir: Any) -> None:
    """The ``--in-process`` pairing (the module docstring), one table row per case."""
    from _workloads_data import prepare, warm_page_cache
    from bench_pairs import interval, within
    from bench_planners import epoch_of, later_epoch, options_of

    import blobpipe

    theirs = _other_package(other)
    print(f"in one process, {rounds} rounds, later epochs, µs a batch; other: {theirs.__file__}")
    print("| case | this | other | again | this / other (90%) | A/A this / again (90%) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for w, mean in chosen:
        pre = prepare(w.db, data_dir)
        warm_page_cache(pre)
        options = options_of(w.recipe, pre.mean_file if mean else None)
        t = options["transform"]
        fields = ("scale", "mirror", "crop_size", "mean_file", "mean_value", "dtype", "layout")
        loaders = {}
        with contextlib.ExitStack() as stack:
            for name, package, path in (
                ("this", blobpipe, pre.path),
                ("other", theirs, pre.copy),
                ("again", blobpipe, pre.path),
            ):
                own = dict(
                    options, transform=package.Transform(**{f: getattr(t, f) for f in fields})
                )
                loader = package.Loader(str(path), device="cpu", workers=2, mode="epoch", **own)
                loaders[name] = stack.enter_context(loader)

            runs = {name: epoch_of(loader) for name, loader in loaders.items()}
            for run in runs.values():
                run()  # the first epoch: opened, indexed, every slot filled
            times: dict[str, list[float]] = {name: [] for name in runs}
            for r in range(rounds):
                for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                    runs[name]()  # what the one before left running is done
                    times[name].append(later_epoch(runs[name]))
        med = {k: statistics.median(v) for k, v in times.items()}
        ab = [a / b for a, b in zip(times["this"], times["other"], strict=True)]
        aa = [a / b for a, b in zip(times["this"], times["again"], strict=True)]
        (lo, hi), (alo, ahi) = interval(ab), interval(aa)
        mark = "" if within(alo, ahi) else " *"
        print(
            f"| {w.name} | {med['this']:.1f} | {med['other']:.1f} | {med['again']:.1f} | "
            f"{statistics.median(ab):.3f}× ({lo:.3f}–{hi:.3f}){mark} | "
            f"{statistics.median(aa):.3f}× ({alo:.3f}–{ahi:.3f}) |",
            flush=True,
        )
    print("(*: unresolved, the A/A interval is not within ±5% of 1×)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("other", type=Path, help="the other checkout (its root folder)")
    ap.add_argument("--pairs", type=int, default=8, help="alternating pairs (default 8)")
    ap.add_argument("--epochs", type=int, default=4, help="epochs per process (default 4)")
    ap.add_argument(
        "--workloads", default="W1,W2,W3,W4", help="of W1,W2,W3,W3-test,W4,W5; default W1-W4"
    )
    ap.add_argument(
        "--loader",
        nargs="?",
        const="blocking",
        choices=["blocking", "async"],
        help="a Loader (blocking form, or async for), not Batches",
    )
    ap.add_argument(
        "--control", action="store_true", help="an A/A control: this checkout run twice a pair"
    )
    ap.add_argument(
        "--point",
        action="append",
        default=[],
        metavar="NAME",
        help="a point of bench_sweep.py by name, its database and recipe ('raw 3x48x48 TEST, "
        "scale'; repeatable; with only --point, no workloads)",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="Loaders of both checkouts paired in one process (see the module docstring)",
    )
    ap.add_argument("--rounds", type=int, default=31, help="with --in-process (default 31)")
    ap.add_argument("--data-dir", type=Path, help="LMDB cache (default bench/_data)")
    ap.add_argument("--quick", action="store_true", help="tiny databases: a smoke test")
    ap.add_argument(
        "--no-heap-pad",
        dest="heap_pad",
        action="store_false",
        help="no random shift of the heap per pair (see the module docstring)",
    )
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.epochs < 2:
        ap.error("--pairs must be >= 1 and --epochs >= 2 (the first epoch is not counted)")
    if not (args.other / "blobpipe" / "__init__.py").is_file():
        ap.error(f"{args.other} holds no blobpipe/ package")

    sys.path.insert(0, str(HERE))
    from _workloads_data import prepare
    from bench_sweep import db_spec, point_from_name
    from bench_workloads import Workload, workloads

    try:
        points = [point_from_name(name) for name in args.point]
    except ValueError as exc:
        ap.error(str(exc))
    explicit = any(a == "--workloads" or a.startswith("--workloads=") for a in argv or sys.argv)
    wanted = {w.strip() for w in args.workloads.split(",")} if explicit or not points else set()
    # each with whether it reads its database's mean file (a workload's database has one
    # only when its recipe wants it; a point's raw database always has one)
    chosen = [(w, True) for w in workloads(args.quick) if w.name in wanted]
    chosen += [
        (Workload(p.name, p.name, db_spec(p, args.quick), p.recipe), p.recipe.mean_file is not None)
        for p in points
    ]
    if args.in_process:
        if args.rounds < 3:
            ap.error("--rounds must be >= 3 (an interval needs rounds)")
        in_process(args.other, chosen, 3 if args.quick else args.rounds, args.data_dir)
        return 0
    figure = (
        f"Loader ({args.loader} form): process CPU s and wall s of the best later epoch, "
        "wall s of the first (open to close)"
        if args.loader
        else "Batches: thread CPU s of the best later epoch"
    )
    figure += "; µs holding the GIL a batch (_io/_budget.py), the median of the later epochs"
    print(f"paired A/B: this checkout ({ROOT}) / {args.other}; {figure}")
    pad = "heap shifted per pair" if args.heap_pad else "no heap shift"
    print(
        f"{args.pairs} pairs, {args.epochs} epochs a process, {pad}, load {os.getloadavg()[0]:.2f}"
    )
    head = "| workload | figure | this: min · median | other: min · median | this / other |"
    rule = "| --- | --- | ---: | ---: | ---: |"
    if args.control:
        head += " A/A: median (range) |"
        rule += " ---: |"
    print(head)
    print(rule)
    for w, mean in chosen:
        pre = prepare(w.db, args.data_dir)
        r = w.recipe
        spec = {
            "db": str(pre.path),
            "batch": r.batch,
            "phase": r.phase,
            "order": "shuffle" if r.shuffle else "key",
            "epochs": args.epochs,
            "loader": args.loader,
            "transform": {
                "scale": r.scale,
                "mirror": r.mirror,
                "crop_size": r.crop,
                "mean_file": None if pre.mean_file is None or not mean else str(pre.mean_file),
                "mean_value": list(r.mean_value),
                "dtype": r.dtype,
                "layout": r.layout,
            },
        }
        sides = [("this", ROOT), ("other", args.other)]
        if args.control:
            sides.append(("again", ROOT))
        got: dict[str, list[dict[str, float]]] = {name: [] for name, _ in sides}
        pads = random.Random(f"{w.name}/{args.pairs}")
        for k in range(args.pairs):
            spec["pad"] = 16 * pads.randrange(8192) if args.heap_pad else 0
            for name, checkout in sides[k % len(sides) :] + sides[: k % len(sides)]:
                got[name].append(_measure(checkout, spec))
                time.sleep(0.2)
        for key in ("cpu", "wall", "first", "gil") if args.loader else ("cpu", "gil"):
            a = [m[key] for m in got["this"]]
            b = [t[key] for t in got["other"]]
            ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
            unit, f = ("GIL µs a batch", ".0f") if key == "gil" else (f"{key} s", ".3f")
            row = (
                f"| {w.name} | {unit} | {min(a):{f}} · {statistics.median(a):{f}} | "
                f"{min(b):{f}} · {statistics.median(b):{f}} | {ratio:.2f}× |"
            )
            if args.control:
                aa = [x / y[key] for x, y in zip(a, got["again"], strict=True)]
                row += f" {statistics.median(aa):.2f}× ({min(aa):.2f}–{max(aa):.2f}) |"
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
