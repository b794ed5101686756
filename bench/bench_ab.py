"""Paired A/B of blobpipe's batch work between two checkouts, on the workload databases.

Run: ``python bench/bench_ab.py OTHER_CHECKOUT [--pairs N] [--epochs N] [--workloads W1,W2]
[--loader] [--data-dir DIR] [--quick]``

For each workload (W1–W4 of ``bench_workloads.py``, the same databases and recipes) it
starts one fresh process per side, alternating (this checkout, the other, this, ...), each
reading ``--epochs`` epochs and reporting its best later epoch: with ``Batches`` driven by
hand in one thread (the workload benchmark's "Batches, one thread" row), the thread's CPU
seconds; with ``--loader``, a blocking ``Loader`` (2 workers, device "cpu"), the whole
process's CPU seconds and the wall-clock seconds. It prints, per workload, both sides'
minimum and median and the median over pairs of this side / the other side: below 1.00
means this checkout spends less. Pairing keeps the ratio meaningful when the machine's
speed drifts; on a shared VM single runs differ by ±20%, so use 8 pairs or more.

The other checkout is put first on ``PYTHONPATH``, so its ``blobpipe`` is the one imported
(e.g. ``git worktree add ../before HEAD~3``). Databases are made on first use and cached
under ``bench/_data`` (as the workload benchmark's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# One measurement, run in a fresh process of either side: prints a JSON line.
_CHILD = r"""
import json, sys, time
import numpy as np
import blobpipe
spec = json.loads(sys.argv[1])
t = blobpipe.Transform(**spec["transform"])
kw = dict(transform=t, phase=spec["phase"], order=spec["order"], mode="epoch")
walls, cpus = [], []
if spec["loader"]:
    with blobpipe.Loader(spec["db"], spec["batch"], device="cpu", workers=2, **kw) as loader:
        for _ in range(spec["epochs"]):
            t0, c0 = time.perf_counter(), time.process_time()
            for batch in loader:
                batch.data.cpu_data()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
else:
    b = blobpipe.Batches(spec["db"], spec["batch"], **kw)
    label = np.empty(spec["batch"], np.float32)
    for _ in range(spec["epochs"]):
        t0, c0 = time.perf_counter(), time.thread_time()
        data = None
        while (plan := b.next_plan()) is not None:
            if data is None or data.shape != plan.data_shape:
                data = np.empty(plan.data_shape, plan.dtype)
            b.fill(plan, data, label[: len(plan)])
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    b.close()
print(json.dumps({"file": blobpipe.__file__, "cpu": min(cpus[1:]), "wall": min(walls[1:])}))
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("other", type=Path, help="the other checkout (its root folder)")
    ap.add_argument("--pairs", type=int, default=8, help="alternating pairs (default 8)")
    ap.add_argument("--epochs", type=int, default=4, help="epochs per process (default 4)")
    ap.add_argument("--workloads", default="W1,W2,W3,W4", help="default W1,W2,W3,W4")
    ap.add_argument("--loader", action="store_true", help="a blocking Loader, not Batches")
    ap.add_argument("--data-dir", type=Path, help="LMDB cache (default bench/_data)")
    ap.add_argument("--quick", action="store_true", help="tiny databases: a smoke test")
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.epochs < 2:
        ap.error("--pairs must be >= 1 and --epochs >= 2 (the first epoch is not counted)")
    if not (args.other / "blobpipe" / "__init__.py").is_file():
        ap.error(f"{args.other} holds no blobpipe/ package")

    sys.path.insert(0, str(HERE))
    from _workloads_data import prepare
    from bench_workloads import workloads

    wanted = {w.strip() for w in args.workloads.split(",")}
    figure = "process CPU s and wall s (Loader)" if args.loader else "thread CPU s (Batches)"
    print(f"paired A/B: this checkout ({ROOT}) / {args.other}; best later epoch, {figure}")
    print(f"{args.pairs} pairs, {args.epochs} epochs a process, load {os.getloadavg()[0]:.2f}")
    print("| workload | figure | this: min · median | other: min · median | this / other |")
    print("| --- | --- | ---: | ---: | ---: |")
    for w in workloads(args.quick):
        if w.name not in wanted:
            continue
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
                "mean_file": None if pre.mean_file is None else str(pre.mean_file),
                "mean_value": list(r.mean_value),
                "dtype": r.dtype,
                "layout": r.layout,
            },
        }
        mine: list[dict[str, float]] = []
        theirs: list[dict[str, float]] = []
        for _ in range(args.pairs):
            mine.append(_measure(ROOT, spec))
            theirs.append(_measure(args.other, spec))
            time.sleep(0.2)
        for key in ("cpu", "wall") if args.loader else ("cpu",):
            a = [m[key] for m in mine]
            b = [t[key] for t in theirs]
            ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
            print(
                f"| {w.name} | {key} s | {min(a):.3f} · {statistics.median(a):.3f} | "
                f"{min(b):.3f} · {statistics.median(b):.3f} | {ratio:.2f}× |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
