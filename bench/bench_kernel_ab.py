"""Paired A/B of the compiled row kernel between two checkouts, in one process.

Run: ``python bench/bench_kernel_ab.py OTHER_CHECKOUT [--recipes SUBSTR,...] [--rounds N]
[--data-dir DIR] [--quick]``

The kernel's time is bound by memory on large rows, and on this project's shared VMs a
machine's memory bandwidth drifts by ±30% within a minute, so two processes timed one after
the other differ by more than a kernel change does. Here both builds of
``_rowkernel`` (this checkout's and OTHER_CHECKOUT's, each built in place with
``python setup.py build_ext --inplace``) are loaded into one process and run on the same
arguments, alternating, ``--rounds`` times (the first of each pair rotated): each recipe's
raw rows are planned once by this checkout's ``Batches`` (the databases of
``bench_workloads.py``'s W1, 1×28×28, W2, 3×32×32 with its mean file, and W3, 3×256×256
with its mean file) and every batch's ``transform_rows`` call is recorded, then replayed
through each build. It prints ns an image for each (medians) and the median and range of
this / other over the rounds: below 1.00 this checkout's kernel is faster. The outputs of
the two builds are compared byte for byte first (a difference is an error).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _workloads_data import DATA_DIR, prepare
from bench_workloads import workloads

import blobpipe
from blobpipe._io import _fill, _kernels

ROOT = Path(__file__).resolve().parent.parent
SO = "blobpipe/_io/_rowkernel" + importlib.machinery.EXTENSION_SUFFIXES[0]

# (name, database, batch, phase, transform arguments, batches recorded); "MEAN" stands for
# the database's mean file
RECIPES: list[tuple[str, str, int, str, dict[str, Any], int]] = [
    ("1x28x28 TEST scale (W1)", "mnist", 64, "test", {"scale": 0.00390625}, 200),
    ("1x28x28 TRAIN crop 24 mirror scale", "mnist", 64, "train",
     {"crop_size": 24, "mirror": True, "scale": 0.00390625}, 200),
    ("3x32x32 TRAIN mirror mean file (W2)", "cifar", 100, "train",
     {"mirror": True, "mean_file": "MEAN"}, 100),
    ("3x32x32 TRAIN crop 28 mirror mean values", "cifar", 100, "train",
     {"crop_size": 28, "mirror": True, "mean_value": [104, 117, 123]}, 100),
    ("3x32x32 TRAIN crop 28 mirror mean file NHWC", "cifar", 100, "train",
     {"crop_size": 28, "mirror": True, "mean_file": "MEAN", "layout": "NHWC"}, 100),
    ("3x256x256 TRAIN crop 227 mirror mean file (W3)", "imagenet", 64, "train",
     {"crop_size": 227, "mirror": True, "mean_file": "MEAN"}, 20),
    ("3x256x256 TEST crop 227 scale", "imagenet", 64, "test",
     {"crop_size": 227, "scale": 0.017}, 20),
    ("3x256x256 TRAIN crop 227 mirror mean file NHWC", "imagenet", 64, "train",
     {"crop_size": 227, "mirror": True, "mean_file": "MEAN", "layout": "NHWC"}, 20),
    ("3x256x256 TRAIN crop 227 mirror uint8", "imagenet", 64, "train",
     {"crop_size": 227, "mirror": True, "dtype": "uint8"}, 20),
    ("3x256x256 TRAIN crop 227 mirror uint8 NHWC", "imagenet", 64, "train",
     {"crop_size": 227, "mirror": True, "dtype": "uint8", "layout": "NHWC"}, 20),
]  # fmt: skip


def load_kernel(tag: str, checkout: Path) -> ModuleType:
    """The ``_rowkernel`` built in ``checkout``, loaded under a name of its own."""
    path = checkout / SO
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `python setup.py build_ext --inplace` there")
    spec = importlib.util.spec_from_file_location(f"{tag}._rowkernel", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(db: Path, mean: Path | None, batch: int, phase: str, kw: dict[str, Any], n: int):
    """The ``transform_rows`` arguments of ``n`` batches of the recipe (this checkout)."""
    kw = {k: (str(mean) if v == "MEAN" else v) for k, v in kw.items()}
    calls: list[tuple[Any, ...]] = []

    def grab(buffer, offsets, shape, out, geometry, spec, defer=None):  # type: ignore[no-untyped-def]
        args = _kernels.kernel_args(out, geometry, spec)
        if args is None:
            return False
        calls.append((buffer, np.ascontiguousarray(offsets, np.int64), shape, *args))
        return True

    batches = blobpipe.Batches(
        db, batch, transform=blobpipe.Transform(**kw), phase=phase, order="key", mode="wrap"
    )
    real, _fill.apply_raw = _fill.apply_raw, grab
    try:
        plans = [batches.next_plan() for _ in range(n)]
        data = np.empty(plans[0].data_shape, plans[0].dtype)
        label = np.empty(batch, np.float32)
        for plan in plans:
            batches.fill(plan, data, label)
    finally:
        _fill.apply_raw = real
    if not calls:
        raise SystemExit("the recipe's rows did not reach the row kernel (not built here?)")
    return calls, data, batches


def outputs(args: tuple[Any, ...]) -> list[np.ndarray]:
    out = args[8]
    return list(out) if isinstance(out, (list, tuple)) else [out]


def run(kernel: ModuleType, calls: list[tuple[Any, ...]]) -> float:
    t0 = time.perf_counter()
    for args in calls:
        kernel.transform_rows(*args)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", type=Path, help="the other checkout (its kernel built in place)")
    ap.add_argument("--recipes", metavar="SUBSTR,...", help="only recipes whose name has one")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR)
    ap.add_argument("--quick", action="store_true", help="tiny databases, 3 rounds")
    a = ap.parse_args()
    rounds = 3 if a.quick else a.rounds
    this = load_kernel("this", ROOT)
    other = load_kernel("other", a.other.resolve())
    specs = {w.name: w.db for w in workloads(a.quick)}  # W1's, W2's and W3's databases
    dbs = {
        db: prepare(specs[w], a.data_dir)
        for db, w in (("mnist", "W1"), ("cifar", "W2"), ("imagenet", "W3"))
    }
    wanted = a.recipes.split(",") if a.recipes else None
    print(f"this: {ROOT}  other: {a.other.resolve()}  rounds: {rounds}")
    print("| recipe | other ns/img | this ns/img | this / other: median (range) |")
    print("| --- | ---: | ---: | ---: |")
    for name, db, batch, phase, kw, n in RECIPES:
        if wanted and not any(w in name for w in wanted):
            continue
        if a.quick:
            if "crop_size" in kw:
                kw = {**kw, "crop_size": min(kw["crop_size"], 80 if db == "imagenet" else 24)}
            n = min(n, 8)
        prep = dbs[db]
        calls, _, batches = record(prep.path, prep.mean_file, batch, phase, kw, n)
        last = calls[-1]
        run(other, [last])
        expected = [o.copy() for o in outputs(last)]
        run(this, [last])
        if any(not np.array_equal(e, o) for e, o in zip(expected, outputs(last), strict=True)):
            raise SystemExit(f"{name}: the two kernels wrote different outputs")
        run(this, calls), run(other, calls)  # warm both
        t_this: list[float] = []
        t_other: list[float] = []
        for r in range(rounds):
            pair = [(this, t_this), (other, t_other)]
            for kernel, times in pair if r % 2 == 0 else pair[::-1]:
                times.append(run(kernel, calls))
        images = sum(len(c[1]) for c in calls)
        ratios = [t / o for t, o in zip(t_this, t_other, strict=True)]
        print(
            f"| {name} | {statistics.median(t_other) / images * 1e9:,.0f} "
            f"| {statistics.median(t_this) / images * 1e9:,.0f} "
            f"| {statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}) |",
            flush=True,
        )
        batches.close()


if __name__ == "__main__":
    main()
