"""How often a Loader's threads let go of the GIL, per batch, and where.

Run (as root, with Linux ``perf``): ``python bench/gil_releases.py [--point NAME ...]
[--epochs N] [--workers N] [--async] [--data-dir DIR] [--top N]``

A release of the GIL is not free while another thread waits for it: it wakes that thread,
and when the other thread wins it the releasing one sleeps until the other lets go (tens
of µs on a VM; ``docs/design.md``, "Per-batch Python keeps the GIL"). So a filler should
release it once a batch (a chunk of small batches), in the kernel or decoder call, and
the consumer when it waits for a batch. This counts every ``PyEval_SaveThread`` call
(every ``Py_BEGIN_ALLOW_THREADS``) with a ``perf`` uprobe on libpython (added for the run,
removed after unless it was there before), in later epochs
of a Loader (device "cpu", blocking form unless ``--async``) on the sweep's databases,
and prints them per batch by the C function that released it: the kernel
(``transform_rows``, ``decode_*``), lock waits (``acquire_timed``: the consumer waiting
for a batch, a filler for a slot), and anything else, which is a finding (NumPy releases
it in ``arange``, in gathers of 2-D arrays and in element-wise work over 500 elements;
``os`` calls around their system call). Counts per epoch (the order, read-ahead) show as
fractions of a batch. Points are named as the sweep names them (default: three small raw
ones).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_sweep as bs
from _workloads_data import DATA_DIR, prepare, warm_page_cache

DEFAULT_POINTS = (
    "raw 3x64x64 TEST, scale",
    "raw 3x32x32 TRAIN, mirror, mean values",
    "raw 1x28x28 TEST, scale",
)
EVENT = "probe_libpython3:PyEval_SaveThread"

# The child: warm epochs, then the counted ones between two CLOCK_MONOTONIC stamps.
_CHILD = """
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1])
import _contenders as cs
spec = json.loads(sys.argv[2])
recipe = cs.Recipe.from_doc(spec["recipe"])
loader = cs._make_loader(cs.Path(spec["db"]), recipe, workers=spec["workers"])

async def run_async(epochs):
    n = 0
    async with loader:
        for e in range(epochs):
            if e == 2:
                t0 = time.monotonic()
            async for batch in loader:
                batch.data.cpu_data()
                n += e >= 2
    return t0, n

def run(epochs):
    n = 0
    with loader:
        for e in range(epochs):
            if e == 2:
                t0 = time.monotonic()
            for batch in loader:
                batch.data.cpu_data()
                n += e >= 2
    return t0, n

epochs = 2 + spec["epochs"]
t0, n = asyncio.run(run_async(epochs)) if spec["async"] else run(epochs)
print(json.dumps({"t0": t0, "t1": time.monotonic(), "batches": n}))
"""


def libpython() -> str:
    out = subprocess.run(["ldd", sys.executable], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "libpython" in line and "=>" in line:
            return line.split("=>")[1].split()[0]
    raise SystemExit("this Python links libpython statically: nothing to probe")


def add_probe(lib: str) -> bool:
    """The uprobe on ``lib``'s ``PyEval_SaveThread``; True when this call added it (then
    :func:`remove_probe` takes it away again), False when it was there."""
    done = subprocess.run(
        ["perf", "probe", "-x", lib, "-a", "PyEval_SaveThread"], capture_output=True, text=True
    )
    if done.returncode and "already exists" in done.stderr:
        return False
    if done.returncode:
        raise SystemExit(f"perf probe failed (needs root and uprobes): {done.stderr.strip()}")
    return True


def remove_probe() -> None:
    subprocess.run(["perf", "probe", "-d", EVENT], capture_output=True, text=True)


def count(
    point: bs.Point, root: Path, epochs: int, workers: int, use_async: bool
) -> dict[str, Any]:
    prepared = prepare(bs.db_spec(point, False), root)
    warm_page_cache(prepared)
    recipe = bs.recipe_for(point, prepared)
    spec = {
        "db": str(prepared.path),
        "recipe": recipe.to_doc(),
        "epochs": epochs,
        "workers": workers,
        "async": use_async,
    }
    here = str(Path(__file__).resolve().parent)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        record = ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-g", "-e", EVENT, "-o", data]
        child = subprocess.run(
            [*record, sys.executable, "-c", _CHILD, here, json.dumps(spec)],
            capture_output=True,
            text=True,
        )
        if child.returncode:
            raise SystemExit(child.stderr[-2000:])
        stamps = json.loads(child.stdout.strip().splitlines()[-1])
        script = subprocess.run(
            ["perf", "script", "-i", data, "-F", "time,ip,sym"], capture_output=True, text=True
        ).stdout
    return {"batches": stamps["batches"], "callers": callers_of(script, stamps["t0"], stamps["t1"])}


def callers_of(script: str, t0: float, t1: float) -> collections.Counter[str]:
    """The callers of the probed function in ``perf script -F time,ip,sym`` output (each
    sample a ``TIME:`` line, then its stack, the probed function first), counted over the
    samples taken from ``t0`` to ``t1``."""
    callers: collections.Counter[str] = collections.Counter()
    when: float | None = None
    depth = 0
    for line in script.splitlines():
        head = re.match(r"\s*(\d+\.\d+):", line)
        if head:
            when, depth = float(head.group(1)), 0
            continue
        if when is None or not line.strip():
            continue
        depth += 1
        if depth == 2 and t0 <= when <= t1:  # the caller's frame
            callers[line.split()[1].split("+")[0]] += 1
    return callers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", action="append", default=[], help="a sweep point by name")
    parser.add_argument("--epochs", type=int, default=20, help="epochs counted (default 20)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--top", type=int, default=8, help="callers shown per point (0: all)")
    args = parser.parse_args(argv)
    added = add_probe(libpython())
    try:
        report(args)
    finally:
        if added:
            remove_probe()
    return 0


def report(args: argparse.Namespace) -> None:
    form = "async for" if args.use_async else "for"
    print(
        f"GIL releases per batch by caller: Loader ({args.workers} workers, {form}), "
        f"{args.epochs} later epochs"
    )
    for name in args.point or DEFAULT_POINTS:
        point = bs.point_from_name(name)
        got = count(point, args.data_dir, args.epochs, args.workers, args.use_async)
        n = max(got["batches"], 1)
        total = sum(got["callers"].values())
        print(f"\n{point.name}: {total / n:.2f} a batch ({got['batches']} batches)")
        for caller, k in got["callers"].most_common(args.top or None):
            print(f"  {k / n:6.2f}  {caller}")


if __name__ == "__main__":
    sys.exit(main())
