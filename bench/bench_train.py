"""Images/s of blobpipe.Loader in Caffe's TRAIN recipe (random crop, mirror, shuffle) vs a loop.

Run: ``python bench/bench_train.py [--records 20480] [--jpeg-records 10000] [--repeats 5]
[--quick] [--json OUT] [--data-dir DIR]``

The LMDBs of ``bench_loader.py`` (3×64×64 raw and JPEG Datums, cached under
``bench/_data/``) are read as a training run reads them: a new shuffled order
per epoch, a random 56×56 crop and a random mirror per record, scale 1/256,
float32 batches of 64, device cpu. Rows, interleaved over the rounds, medians:

* ``plain loop``: one thread; py-lmdb ``txn.get`` in a shuffled key order, a fresh
  ``caffe_pb2.Datum`` per record, ``np.frombuffer`` (raw) or ``cv2.imdecode``
  with Caffe's flag (JPEG), the batch's crop offsets and flips drawn at once
  with NumPy, each crop (flipped when drawn so) copied into a preallocated
  float32 batch, scaled once per batch;
* ``blobpipe``: ``Loader(..., transform=Transform(crop_size=56, mirror=True,
  scale=1/256), phase="train", order="shuffle", workers=2, prefetch=4,
  mode="epoch", last="drop")`` with ``async for``, kept open as in training
  (its first epoch untimed; it waits idle after each pass, and the batches it
  prefetched between passes are not counted), and a first epoch per pass
  ("incl. open+close").

Crops are random, so batches are not compared with the baseline here;
``tests/test_index.py`` holds the indexed TRAIN path equal to the checked one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import cv2
import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import baseline_copy, cached_db
from bench_loader import (
    BATCH,
    SCALE,
    SCALE32,
    SHAPE,
    Pass,
    Row,
    _async_epoch,
    _KeptOpen,
    _WarmAsync,
    markdown,
    measure_all,
)

import blobpipe
from blobpipe._proto import caffe_pb2

CROP = 56
WORKERS = 2


def plain_train_loop(path: Path, n: int, encoded: bool) -> Pass:
    """One thread: the TRAIN recipe written plainly (see the module docstring)."""
    keys = [f"{i:08d}".encode() for i in range(n)]
    count = n // BATCH * BATCH
    c, h, w = SHAPE
    epoch = [0]

    def run() -> tuple[int, np.ndarray]:
        rng = np.random.default_rng(epoch[0])
        epoch[0] += 1
        order = rng.permutation(n)[:count].tolist()
        data = np.empty((BATCH, c, CROP, CROP), np.float32)
        label = np.empty(BATCH, np.float32)
        first = None
        env = lmdb.open(str(path), readonly=True, lock=False, readahead=False)
        try:
            with env.begin() as txn:
                for b in range(count // BATCH):
                    offs = rng.integers(0, [h - CROP + 1, w - CROP + 1], (BATCH, 2)).tolist()
                    flips = rng.integers(0, 2, BATCH).tolist()
                    for i in range(BATCH):
                        d = caffe_pb2.Datum.FromString(txn.get(keys[order[b * BATCH + i]]))
                        if encoded:
                            img = cv2.imdecode(
                                np.frombuffer(d.data, np.uint8), cv2.IMREAD_UNCHANGED
                            )
                            chw = img.transpose(2, 0, 1)
                        else:
                            chw = np.frombuffer(d.data, np.uint8).reshape(
                                d.channels, d.height, d.width
                            )
                        h0, w0 = offs[i]
                        crop = chw[:, h0 : h0 + CROP, w0 : w0 + CROP]
                        np.copyto(data[i], crop[:, :, ::-1] if flips[i] else crop)
                        label[i] = d.label
                    data *= SCALE32
                    if first is None:
                        first = data.copy()
        finally:
            env.close()
        assert first is not None
        return count, first

    return run


def _train_loader(path: Path) -> blobpipe.Loader:
    return blobpipe.Loader(
        path,
        batch_size=BATCH,
        device="cpu",
        transform=blobpipe.Transform(crop_size=CROP, mirror=True, scale=SCALE),
        phase="train",
        order="shuffle",
        seed=0,
        workers=WORKERS,
        prefetch=4,
        mode="epoch",
        last="drop",
    )


def blobpipe_train_warm(path: Path) -> Pass:
    session = _WarmAsync(path, WORKERS, "float32", loader=_train_loader(path))
    kept = _KeptOpen(session.run, session._loader)
    kept()  # the first epoch, untimed
    kept.settle()
    return kept


def blobpipe_train_first(path: Path) -> Pass:
    async def epoch() -> tuple[int, np.ndarray]:
        async with _train_loader(path) as loader:
            return await _async_epoch(loader)

    run: Callable[[], tuple[int, np.ndarray]] = lambda: anyio.run(epoch)  # noqa: E731
    return run


def build_rows(
    raw: Path, jpeg: Path, n: int, n_jpeg: int, raw_copy: Path, jpeg_copy: Path
) -> list[Row]:
    rows = []
    for group, path, copy, count, encoded in (
        ("raw", raw, raw_copy, n, False),
        ("jpeg", jpeg, jpeg_copy, n_jpeg, True),
    ):
        name = "JPEG" if encoded else "raw"
        rows += [
            Row(
                f"plain_{group}",
                f"plain loop, TRAIN recipe ({name})",
                group,
                plain_train_loop(copy, count, encoded),
            ),
            Row(
                f"bp_{group}",
                f"blobpipe, TRAIN recipe ({name}), async, workers={WORKERS}",
                group,
                blobpipe_train_warm(path),
                baseline=f"plain_{group}",
            ),
            Row(
                f"bp_{group}_first",
                f"blobpipe, TRAIN recipe ({name}), async, workers={WORKERS}, incl. open+close",
                group,
                blobpipe_train_first(path),
                baseline=f"plain_{group}",
            ),
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--records", type=int, default=20_480, help="raw records (default 20480)")
    ap.add_argument("--jpeg-records", type=int, default=10_000, help="JPEG records (default 10000)")
    ap.add_argument("--repeats", type=int, default=5, help="passes per row; medians reported")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one pass: a smoke test")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write every sample to OUT")
    ap.add_argument("--data-dir", type=Path, help="LMDB cache (default bench/_data)")
    args = ap.parse_args(argv)
    if args.quick:
        args.records, args.jpeg_records, args.repeats = 1024, 256, 1
    if args.records < BATCH or args.jpeg_records < BATCH or args.repeats < 1:
        ap.error(f"--records and --jpeg-records must be >= {BATCH}, --repeats >= 1")
    raw, _ = cached_db("raw", args.records, SHAPE, args.data_dir)
    jpeg, _ = cached_db("jpeg", args.jpeg_records, SHAPE, args.data_dir)
    rows = build_rows(
        raw, jpeg, args.records, args.jpeg_records, baseline_copy(raw), baseline_copy(jpeg)
    )
    load0, headroom, elapsed = measure_all(rows, args.repeats)
    print(
        f"TRAIN recipe: {'×'.join(map(str, SHAPE))} uint8 Datums, random {CROP}×{CROP} crop, "
        f"mirror, shuffle, scale 1/256, batch {BATCH}, device cpu; median of {args.repeats} "
        f"interleaved passes; {os.cpu_count()} CPU cores; load average {load0:.2f} at start; "
        f"python {platform.python_version()}, numpy {np.__version__}, opencv {cv2.__version__}"
    )
    print(
        f"parallel headroom: {statistics.median(headroom):.2f}× on 2 threads "
        f"(2.00× = two idle cores); measured in {elapsed:.1f} s\n"
    )
    print(markdown(rows))
    if args.json is not None:
        doc: dict[str, Any] = {
            "crop": CROP,
            "batch": BATCH,
            "repeats": args.repeats,
            "parallel_headroom_2_threads": headroom,
            "rows": [
                {"key": r.key, "label": r.label, "img_per_s": r.rates, "median": r.median}
                for r in rows
            ],
        }
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
