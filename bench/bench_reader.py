"""Records/s of decode + transform into batches: blobpipe against a plain protobuf loop.

Run: ``python bench/bench_reader.py [--records 20000] [--jpeg-records 4000] [--threads 2]``

Writes a temporary LMDB of raw 3x64x64 Datums and one of JPEG Datums, then times
one epoch of each contender, best of ``--repeat`` runs:

* ``plain loop``: py-lmdb cursor, a fresh ``caffe_pb2.Datum()`` per record,
  ``np.frombuffer`` of ``data`` (or ``cv2.imdecode`` for JPEG) converted into a
  preallocated float32 batch with scale 1/256;
* ``Batches iter``: ``for batch in Batches(...)`` (allocates each batch);
* ``plan+fill``: ``next_plan()`` + ``fill()`` into one preallocated batch, as
  the loader does, single thread;
* ``plan+fill xN``: the same with the rows of each batch split over N threads.

All produce the same float32 NCHW batches of 256 (checked on the first batch).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from _common import write_db

from blobpipe._io._batches import Batches
from blobpipe._io._transform import Transform
from blobpipe._proto import caffe_pb2

BATCH = 256
SCALE = 1 / 256
SHAPE = (3, 64, 64)


def plain_loop(path: Path, n: int) -> np.ndarray:
    """The baseline: fresh Datum per record, frombuffer/imdecode, into a float32 batch."""
    env = lmdb.open(str(path), readonly=True, lock=False)
    batch = np.empty((BATCH, *SHAPE), np.float32)
    labels = np.empty(BATCH, np.float32)
    first: np.ndarray | None = None
    i = 0
    with env.begin() as txn:
        for _, value in txn.cursor():
            d = caffe_pb2.Datum()
            d.ParseFromString(value)
            if d.encoded:
                img = cv2.imdecode(np.frombuffer(d.data, np.uint8), cv2.IMREAD_UNCHANGED)
                batch[i] = img.transpose(2, 0, 1)
                batch[i] *= SCALE
            else:
                pix = np.frombuffer(d.data, np.uint8).reshape(d.channels, d.height, d.width)
                batch[i] = pix * np.float32(SCALE)
            labels[i] = d.label
            i += 1
            if i == BATCH:
                if first is None:
                    first = batch.copy()
                i = 0
    env.close()
    assert first is not None
    return first


def batches_iter(path: Path, n: int) -> np.ndarray:
    first = None
    with Batches(path, BATCH, transform=Transform(scale=SCALE), mode="epoch", last="drop") as b:
        for batch in b:
            if first is None:
                first = batch.data
    assert first is not None
    return first


def plan_fill(threads: int) -> Callable[[Path, int], np.ndarray]:
    def run(path: Path, n: int) -> np.ndarray:
        first = None
        pool = ThreadPoolExecutor(threads) if threads > 1 else None
        data = np.empty((BATCH, *SHAPE), np.float32)
        label = np.empty(BATCH, np.float32)
        bounds = np.linspace(0, BATCH, threads + 1).astype(int)
        with Batches(path, BATCH, transform=Transform(scale=SCALE), mode="epoch", last="drop") as b:
            while (plan := b.next_plan()) is not None:
                if pool is None:
                    b.fill(plan, data, label)
                else:
                    futs = [
                        pool.submit(b.fill, plan, data, label, int(lo), int(hi))
                        for lo, hi in itertools.pairwise(bounds)
                    ]
                    for f in futs:
                        f.result()
                if first is None:
                    first = data.copy()
        if pool is not None:
            pool.shutdown()
        assert first is not None
        return first

    return run


def best_rate(fn: Callable[[Path, int], np.ndarray], path: Path, n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(path, n)
        best = min(best, time.perf_counter() - t0)
    return (n // BATCH) * BATCH / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--jpeg-records", type=int, default=4_000)
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    threads = max(2, args.threads)
    contenders: list[tuple[str, Callable[[Path, int], np.ndarray]]] = [
        ("plain loop", plain_loop),
        ("Batches iter", batches_iter),
        ("plan+fill x1", plan_fill(1)),
        (f"plan+fill x{threads}", plan_fill(threads)),
    ]
    print(f"batch {BATCH}, float32 NCHW, scale 1/256, best of {args.repeat}; {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        for kind, n, encoded in [
            ("raw 3x64x64", args.records, False),
            ("jpeg 3x64x64", args.jpeg_records, True),
        ]:
            path = Path(tmp) / kind.replace(" ", "_")
            t0 = time.perf_counter()
            write_db(path, n, encoded)
            print(f"\n{kind}: {n} records written in {time.perf_counter() - t0:.1f} s")
            ref = contenders[0][1](path, n)
            for name, fn in contenders[1:]:
                assert np.array_equal(fn(path, n), ref), name
            print(f"  {'contender':<16}{'records/s':>12}{'vs plain':>10}")
            base = 0.0
            for name, fn in contenders:
                rate = best_rate(fn, path, n, args.repeat)
                base = base or rate
                print(f"  {name:<16}{rate:>12,.0f}{rate / base:>9.2f}x")


if __name__ == "__main__":
    main()
