"""Loader throughput on the host by worker count: W3 and W4 with 1, 2, 4, 8, 16 workers.

Run: ``python bench/bench_workers.py [--quick] [--workers 1,2,4,8,16] [--seconds 1]
[--data-dir DIR] [--json OUT]`` (``scripts/gpu_check.sh`` runs it on the 16-core GPU
machine: the only many-core figures this project gets).

Workloads as the workload benchmark has them (``bench_workloads.workloads``, its LMDB
cache): W3, raw 3×256×256 Datums, TRAIN (shuffle, crop 227, mirror, the mean file),
and W4, JPEG Datums of 240 to 500 pixels a side, TRAIN (shuffle, crop 227, mirror,
mean values); batch 64, ``device="cpu"``. Each row: a Loader opened with that many
workers, a few batches as warm-up, then batches taken as fast as the caller can for
``--seconds`` (each batch's data read once, ``cpu_data()``); images per second, and per
worker, and the speed-up over one worker. W4 needs OpenCV; without it only W3 runs.

Exit status 0 (no targets: the figures are what this measures).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _contenders as cs
from _workloads_data import Prepared, prepare
from bench_workloads import Workload, workloads

import blobpipe


def throughput(db: Prepared, recipe: cs.Recipe, workers: int, seconds: float) -> dict[str, Any]:
    """Images per second of one Loader with ``workers`` workers, for about ``seconds``."""
    # the workload benchmark's recipe, its mean file the prepared database's
    transform = dataclasses.replace(recipe, mean_file=db.mean_file).transform()
    with blobpipe.Loader(
        db.path,
        batch_size=recipe.batch,
        device="cpu",
        transform=transform,
        phase=recipe.phase,
        order="shuffle" if recipe.shuffle else "key",
        workers=workers,
        mode="wrap",
    ) as loader:
        it = iter(loader)
        for _ in range(3):  # warm-up: the pipeline filled once
            next(it).data.cpu_data()
        images = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            batch = next(it)
            batch.data.cpu_data()
            images += len(batch)
        wall = time.perf_counter() - t0
        actual = loader.workers
    return {"workers": actual, "img_per_s": images / wall, "seconds": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the workloads' tiny forms")
    ap.add_argument("--workers", default="1,2,4,8,16", help="worker counts, comma-separated")
    ap.add_argument("--seconds", type=float, default=1.0, help="per row")
    ap.add_argument("--data-dir", type=Path, help="LMDB cache (default bench/_data)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write the results to OUT")
    args = ap.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    names = ["W3", "W4"] if importlib.util.find_spec("cv2") is not None else ["W3"]
    chosen: list[Workload] = [w for w in workloads(args.quick) if w.name in names]
    print(f"{os.cpu_count()} CPUs; host only (device='cpu'); batch 64; {args.seconds:g} s a row\n")
    print("| workload | workers | img/s | img/s per worker | vs 1 worker |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows = []
    for w in chosen:
        db = prepare(w.db, args.data_dir)
        base = None
        for n in counts:
            r = throughput(db, w.recipe, n, args.seconds)
            base = base or r["img_per_s"]
            r.update(workload=w.name, speedup=r["img_per_s"] / base)
            rows.append(r)
            print(
                f"| {w.name} {w.title} | {r['workers']} | {r['img_per_s']:,.0f} | "
                f"{r['img_per_s'] / r['workers']:,.0f} | {r['speedup']:.2f}× |",
                flush=True,
            )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"cpus": os.cpu_count(), "seconds": args.seconds, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
