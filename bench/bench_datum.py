"""Records per second for reading caffe.Datum records (3×64×64 raw uint8 by default).

    python bench/bench_datum.py [--records N] [--shape C H W]

Rows:
  parse_datum            blobpipe's wire reader (no message, no copy)
  FromString (fresh)     protobuf (upb): a new Datum per record
  ParseFromString reuse  protobuf: one Datum reused, with its process memory growth
  ... + pixels           the same, through to a (C, H, W) uint8 array view / batch slot
  LMDB txn + into f32    LmdbReader.transaction() + decode_datum_into a float32 batch

Runs in well under 30 s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blobpipe import datum_view, decode_datum_into, encode_raw_datum, parse_datum
from blobpipe._io._lmdb import LmdbReader
from blobpipe._proto.caffe_pb2 import Datum


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rate(fn: Callable[[memoryview], object], records: list[memoryview], n: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(n):
            fn(records[i % len(records)])
        best = min(best, time.perf_counter() - t0)
    return n / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--shape", type=int, nargs=3, default=(3, 64, 64))
    args = ap.parse_args()
    shape = tuple(args.shape)
    n = args.records
    rng = np.random.default_rng(0)
    raw = [encode_raw_datum(rng.integers(0, 256, shape, dtype=np.uint8), i) for i in range(256)]
    records = [memoryview(r) for r in raw]
    out8 = np.empty(shape, np.uint8)

    rows: list[tuple[str, float, str]] = []
    rows.append(("parse_datum", _rate(parse_datum, records, n), ""))
    rows.append(("FromString (fresh)", _rate(Datum.FromString, records, n), ""))
    # A reused message keeps every parse's payload in its arena: memory grows without
    # bound (known upstream behaviour), so this row runs fewer records.
    reused = Datum()
    n_reuse = min(n, 2000)
    rss0 = _rss_mib()
    rate = _rate(reused.ParseFromString, records, n_reuse)
    growth = (_rss_mib() - rss0) / (3 * n_reuse / 1000)
    rows.append(("ParseFromString reuse", rate, f"RSS grows {growth:.1f} MiB per 1000 records"))

    rows.append(
        ("datum_view + copyto", _rate(lambda r: np.copyto(out8, datum_view(r)[0]), records, n), "")
    )

    def pb_pixels(r: memoryview) -> None:
        d = Datum.FromString(r)
        np.copyto(out8, np.frombuffer(d.data, np.uint8).reshape(d.channels, d.height, d.width))

    rows.append(("FromString + copyto", _rate(pb_pixels, records, n), ""))
    rows.append(
        ("decode_datum_into u8", _rate(lambda r: decode_datum_into(r, out8), records, n), "")
    )

    with tempfile.TemporaryDirectory() as tmp:
        env = lmdb.open(tmp, map_size=1 << 30)
        with env.begin(write=True) as txn:
            for i, r in enumerate(raw):
                txn.put(b"%08d_img.png" % i, r)
        env.close()
        with LmdbReader(tmp) as reader:
            keys = reader.keys()
            batch = np.empty((64, *shape), np.float32)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                done = 0
                while done < n:
                    with reader.transaction() as txn:
                        for i in range(64):
                            decode_datum_into(txn.get(keys[(done + i) % len(keys)]), batch[i])
                    done += 64
                best = min(best, time.perf_counter() - t0)
            rows.append(("LMDB txn + into f32", done / best, "batch 64, one copy from the map"))

    print(f"caffe.Datum {'×'.join(map(str, shape))} raw uint8, {n} records per run, best of 3")
    print(f"{'path':<24}{'records/s':>12}{'us/record':>11}  note")
    for name, r, note in rows:
        print(f"{name:<24}{r:>12,.0f}{1e6 / r:>11.2f}  {note}")


if __name__ == "__main__":
    main()
