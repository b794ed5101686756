"""Cold against warm first epochs: W3's database read right after its file left the page cache.

Run: ``python bench/bench_cold.py [--rounds N] [--workload W3|W2-shuffled] [--quick]
[--data-dir DIR] [--db LMDB [--mean FILE] [--crop N] [--batch N]] [--other CHECKOUT]
[--json OUT]``

The database is W3's (``_workloads_data.imagenet_raw``: 2,048 raw 3×256×256 Datums,
411 MB, its ``lmdb_first`` copy, which no other benchmark keeps open; ``--quick``: 192
of 3×96×96, crop 80), or with ``--workload W2-shuffled`` W2's (CIFAR-10: 50,000 raw
3×32×32, 206 MB; batch 100, no crop), or ``--db``. Each measurement runs in a fresh
Python process (libraries imported and the ``Transform`` built before the clock
starts) and times one first epoch from the ``Loader``'s construction to its last batch:
``Loader(db, 64, transform=Transform(crop_size=227, mirror=True, mean_file=...),
phase="train", order="shuffle", device="cpu", workers=2, mode="epoch")``, every other
argument its default. Persistent indexes go to ``<data dir>/cold_index_cache``.

Rows, each round in this order, so that load on a shared machine hits every row alike
(the order rotates from round to round):

* ``warm``: the data file read once by this (parent) process first, so it is all in the
  page cache;
* ``warm again``: the same, a second time: the A/A control (how far two measurements of
  the same thing differ in this run);
* ``cold``: the data file and its persistent index evicted first
  (``posix_fadvise(POSIX_FADV_DONTNEED)``, in the child before it opens anything; the
  child checks with ``mincore`` that none of the data file is cached);
* ``read the file once, cold (IO floor)``: no Loader; the evicted data file requested
  whole at once (``posix_fadvise(WILLNEED)`` in pieces of the most one call reads), timed
  until ``mincore`` finds 99% of it cached: how long this disk needs for the bytes a cold
  epoch must read, so that a cold epoch can be no faster than the larger of this and
  the warm epoch;
* with ``--other``: ``other warm`` and ``other cold``, the same with the other checkout's
  ``blobpipe`` first on ``PYTHONPATH`` (e.g. ``git worktree add ../before HEAD~3``; build
  its extensions with ``python setup.py build_ext --inplace`` there).

Printed: per row the median, min and max seconds and images/s (MB/s for the floor); per
round the ratios warm / cold (the cold epoch's rate as a share of the warm one's),
max(warm, floor) / cold (the share of what this disk allows) and warm / warm again, their
medians and ranges; the target is a cold first epoch ≥ 0.90× the warm one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET = 0.90

# One first epoch in a fresh process; prints a JSON line.
_CHILD = r"""
import ctypes, json, mmap, os, sys, time
spec = json.loads(sys.argv[1])
data = os.path.join(spec["db"], "data.mdb")


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages (a database just written) are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached(path):
    # the share of the file's pages in the page cache (mincore over a map of it)
    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    a = np.frombuffer(m, np.uint8)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(size), vec):
        raise OSError(ctypes.get_errno(), "mincore")
    share = float(np.frombuffer(vec, np.uint8).astype(bool).mean())
    del a
    m.close()
    return share


import blobpipe
from blobpipe._io import _indexcache

index = _indexcache.index_path(data, "cache")
if spec["cold"]:
    evict(data)
    if index is not None and os.path.exists(index):
        evict(index)
before = cached(data)
if spec.get("floor"):
    # how fast this disk gives the file: all of it requested at once (WILLNEED in pieces
    # of the most one call reads), until mincore finds it all cached
    from blobpipe._io._readahead import advice_cap

    fd = os.open(data, os.O_RDONLY)
    size = os.fstat(fd).st_size
    piece = advice_cap(os.fstat(fd).st_dev)
    t0 = time.perf_counter()
    for at in range(0, size, piece):
        os.posix_fadvise(fd, at, min(piece, size - at), os.POSIX_FADV_WILLNEED)
    while cached(data) < 0.99 and time.perf_counter() - t0 < 20:
        time.sleep(0.002)
    seconds = time.perf_counter() - t0
    os.close(fd)
    print(json.dumps({"seconds": seconds, "cached_before": before, "blobpipe": blobpipe.__file__}))
    sys.exit(0)
transform = blobpipe.Transform(crop_size=spec["crop"], mirror=True, mean_file=spec["mean"])
c0 = os.times()
t0 = time.perf_counter()
first = None
images = 0
with blobpipe.Loader(
    spec["db"], spec["batch"], transform=transform, phase="train", order="shuffle", device="cpu",
    workers=2, mode="epoch",
) as loader:
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        images += batch.valid
seconds = time.perf_counter() - t0
c1 = os.times()
print(json.dumps({
    "seconds": seconds, "first_batch": first, "images": images, "cached_before": before,
    "cpu": (c1.user - c0.user) + (c1.system - c0.system), "blobpipe": blobpipe.__file__,
}))
"""


def read_whole(path: Path) -> None:
    """Read ``path`` once, so that it is all in the page cache."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 << 20)
        while f.readinto(buf):
            pass


def run_child(spec: dict[str, Any], checkout: Path, cache_dir: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]),
        "BLOBPIPE_CACHE_DIR": str(cache_dir),
    }
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        env=env, cwd=str(checkout), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{spec}: {done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["blobpipe"].startswith(str(checkout)):
        raise RuntimeError(f"imported {result['blobpipe']}, not {checkout}'s blobpipe")
    if spec["cold"] and result["cached_before"] > 0.01:
        print(
            f"  warning: the file was not evicted ({result['cached_before']:.1%} of it cached "
            "before the cold run: a file system without a page cache to evict?)",
            flush=True,
        )
    return result


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}× ({min(values):.2f}–{max(values):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--data-dir", type=Path, default=HERE / "_data")
    ap.add_argument(
        "--workload", choices=("W3", "W2-shuffled"), default="W3",
        help="W3 (default) or W2-shuffled: CIFAR-10's 50,000 raw 3×32×32 Datums, W2's "
        "recipe (batch 100, mirror, mean file) in a shuffled order",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a tiny W3 (smoke test)")
    ap.add_argument("--db", type=Path, help="another LMDB (default: the workload's)")
    ap.add_argument("--mean", type=Path, help="its mean file (with --db)")
    ap.add_argument("--crop", type=int, help="crop_size (with --db; default 0)")
    ap.add_argument("--batch", type=int, help="batch size (with --db; default 64)")
    ap.add_argument("--other", type=Path, help="another checkout, measured alike")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.db is None:
        sys.path.insert(0, str(ROOT))
        from bench._workloads_data import DbSpec, imagenet_raw, prepare

        if args.workload == "W3":
            spec, crop = imagenet_raw(args.quick)
            batch = 64
        else:  # bench_workloads' W2 database
            spec = DbSpec(
                name="cifar10", kind="raw", count=50_000, pool=1000, keys="index",
                shape=(3, 32, 32), mean_file=True, labels=10,
            )  # fmt: skip
            crop, batch = 0, 100
        made = prepare(spec, args.data_dir)
        db, mean = Path(made.first), made.mean_file
    else:
        db, mean = args.db, args.mean
        crop, batch = args.crop or 0, args.batch or 64
    data = db / "data.mdb"
    cache_dir = args.data_dir / "cold_index_cache"  # never the user's cache
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    sides = {"": ROOT.resolve()}
    if args.other is not None:
        sides["other "] = args.other.resolve()
    rows: dict[str, tuple[Path, bool]] = {}
    for prefix, checkout in sides.items():
        rows[f"{prefix}warm"] = (checkout, False)
        if not prefix:
            rows["warm again (A/A control)"] = (checkout, False)
        rows[f"{prefix}cold"] = (checkout, True)
    rows["read the file once, cold (IO floor)"] = (sides[""], True)
    base = {"db": str(db), "mean": str(mean) if mean else None, "crop": crop, "batch": batch}
    # each side once, untimed: its persistent index written, its modules compiled
    for checkout in sides.values():
        read_whole(data)
        run_child({**base, "cold": False}, checkout, cache_dir)
    print(
        f"bench_cold: {db} ({data.stat().st_size / 1e6:.0f} MB), {args.rounds} rounds, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start; "
        "each row a fresh process; cold = data file and index evicted "
        "(posix_fadvise DONTNEED), checked uncached with mincore",
        flush=True,
    )
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
    names = list(rows)
    for r in range(args.rounds):
        turn = names[r % len(names) :] + names[: r % len(names)]
        for name in turn:
            checkout, cold = rows[name]
            if not cold:
                read_whole(data)
            floor = name.startswith("read the file")
            results[name].append(
                run_child({**base, "cold": cold, "floor": floor}, checkout, cache_dir)
            )
        line = "  ".join(f"{n} {results[n][-1]['seconds']:.3f}" for n in names)
        print(f"  round {r + 1}: {line} s", flush=True)
    head = (
        f"{'median s':>9} {'min s':>7} {'max s':>7} {'img/s':>7} {'1st batch s':>11} "
        f"{'cached before':>13}"
    )
    print(f"\n{'row':36} {head}")
    mb = data.stat().st_size / 1e6
    for name in names:
        s = [x["seconds"] for x in results[name]]
        share = statistics.median(x["cached_before"] for x in results[name])
        if "images" not in results[name][0]:
            rate, first = f"{mb / statistics.median(s):7.0f}", "  (MB/s)"
        else:
            rate = f"{results[name][0]['images'] / statistics.median(s):7.0f}"
            first = f"{statistics.median(x['first_batch'] for x in results[name]):11.3f}"
        print(
            f"{name:36} {statistics.median(s):9.3f} {min(s):7.3f} {max(s):7.3f} {rate} "
            f"{first:>11} {share:13.1%}"
        )
    print()
    for prefix in sides:
        warm = [x["seconds"] for x in results[f"{prefix}warm"]]
        cold = [x["seconds"] for x in results[f"{prefix}cold"]]
        ratios = [w / c for w, c in zip(warm, cold, strict=True)]
        verdict = "PASS" if statistics.median(ratios) >= TARGET else "MISS"
        print(
            f"{prefix}cold / warm (rate), per round: {spread(ratios)}; target ≥ {TARGET:.2f}×: "
            f"{verdict}"
        )
        # the best a cold epoch can do: no faster than warm, nor than the disk reads the file
        floor = [x["seconds"] for x in results["read the file once, cold (IO floor)"]]
        bound = [max(w, f) / c for w, f, c in zip(warm, floor, cold, strict=True)]
        print(f"{prefix}cold / max(warm, IO floor) (rate), per round: {spread(bound)}")
    again = [
        w / a
        for w, a in zip(
            [x["seconds"] for x in results["warm"]],
            [x["seconds"] for x in results["warm again (A/A control)"]],
            strict=True,
        )
    ]
    print(f"A/A control: warm again / warm (rate), per round: {spread(again)}")
    if args.other is not None:
        this = [x["seconds"] for x in results["cold"]]
        other = [x["seconds"] for x in results["other cold"]]
        print(
            "cold: other / this (seconds), per round: "
            f"{spread([o / t for t, o in zip(this, other, strict=True)])}"
        )
    if args.json:
        doc = {"benchmark": "bench_cold", "db": str(db), "rounds": args.rounds, "rows": results}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
