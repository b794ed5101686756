"""Caffe's other inputs, each against its plain loop: records/s into float32 batches.

Run: ``python bench/bench_inputs.py [--records 4000] [--images 2400] [--workers 2] [--quick]``

Writes its data into a temporary directory, then times one epoch of each contender,
best of ``--repeat`` runs; every contender produces the same float32 batches (checked):

* LevelDB (raw 3x64x64 Datums, written by LevelDB itself through plyvel, snappy, then
  opened once so the records sit in a table, as Caffe leaves a database it read):
  ``plyvel loop`` (iterate a copy, parse each Datum, ``np.frombuffer`` into the batch);
  ``Batches`` (one thread, the reader's open included) and ``Loader xN`` (N workers);
* ImageData (JPEG files of 256x256 and a list file): ``imread loop`` (``cv2.imread`` in one
  thread into the batch) and ``Batches`` / ``Loader xN`` over an :class:`~blobpipe.ImageList`;
* HDF5Data (three ``.h5`` files of float32 3x32x32 rows and labels): ``h5py slicing``
  (``ds[a:b]`` per batch, across file ends) and ``Batches`` / ``Loader xN`` over an
  :class:`~blobpipe.Hdf5Data`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blobpipe import Batches, Hdf5Data, ImageList, Loader, encode_raw_datum
from blobpipe._proto import caffe_pb2

BATCH = 64


def best(fn: Callable[[], np.ndarray], repeat: int) -> tuple[float, np.ndarray]:
    """The shortest of ``repeat`` runs of ``fn`` (seconds) and its last result."""
    times = []
    out = np.empty(0)
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def epoch_of(make: Callable[[], object], loader: bool) -> np.ndarray:
    """The first batch of one epoch of a Batches or Loader, after reading all of it."""
    first = None
    with make() as source:  # type: ignore[attr-defined]
        for batch in source:
            data = batch.data.cpu_data() if loader else batch.data
            if first is None:
                first = np.array(data)
    assert first is not None
    return first


# -- LevelDB ------------------------------------------------------------------------------------


def write_leveldb(path: Path, n: int) -> None:
    import plyvel

    rng = np.random.default_rng(0)
    db = plyvel.DB(str(path), create_if_missing=True, block_size=65536,
                   write_buffer_size=256 << 20)  # Caffe's options  # fmt: skip
    with db.write_batch() as wb:
        for i in range(n):
            pixels = rng.integers(0, 64, (3, 64, 64), dtype=np.uint8)  # compressible
            wb.put(b"%08d_img%d.jpg" % (i, i), encode_raw_datum(pixels, i % 1000))
    db.close()
    plyvel.DB(str(path)).close()  # the records move into a table, as after Caffe reads


def plyvel_loop(path: Path, scratch: Path) -> np.ndarray:
    import plyvel

    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(path, scratch)  # plyvel's open rewrites the directory
    batch = np.empty((BATCH, 3, 64, 64), np.float32)
    labels = np.empty(BATCH, np.float32)
    first = None
    i = 0
    with plyvel.DB(str(scratch)) as db:
        for _, value in db.iterator():
            d = caffe_pb2.Datum()
            d.ParseFromString(value)
            batch[i] = np.frombuffer(d.data, np.uint8).reshape(3, 64, 64)
            labels[i] = d.label
            i += 1
            if i == BATCH:
                first = batch.copy() if first is None else first
                i = 0
    assert first is not None
    return first


# -- ImageData ----------------------------------------------------------------------------------


def write_images(root: Path, n: int) -> Path:
    rng = np.random.default_rng(1)
    base = cv2.GaussianBlur(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8), (9, 9), 0)
    lines = []
    for i in range(n):
        img = np.roll(base, i * 7, axis=1)
        cv2.imwrite(str(root / f"im{i:05d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 90])
        lines.append(f"im{i:05d}.jpg {i % 10}")
    listing = root / "list.txt"
    listing.write_text("\n".join(lines) + "\n")
    return listing


def imread_loop(root: Path, listing: Path) -> np.ndarray:
    batch = np.empty((BATCH, 3, 256, 256), np.float32)
    labels = np.empty(BATCH, np.float32)
    first = None
    i = 0
    for line in listing.read_text().splitlines():
        path, _, label = line.rpartition(" ")
        img = cv2.imread(str(root / path), cv2.IMREAD_COLOR)
        batch[i] = img.transpose(2, 0, 1)
        labels[i] = int(label)
        i += 1
        if i == BATCH:
            first = batch.copy() if first is None else first
            i = 0
    assert first is not None
    return first


# -- HDF5 ---------------------------------------------------------------------------------------


def write_h5(root: Path, n: int) -> list[Path]:
    import h5py

    rng = np.random.default_rng(2)
    files = []
    for k, rows in enumerate((n // 2, n // 3, n - n // 2 - n // 3)):
        path = root / f"part{k}.h5"
        with h5py.File(path, "w") as f:
            f["data"] = rng.normal(size=(rows, 3, 32, 32)).astype(np.float32)
            f["label"] = rng.integers(0, 10, rows).astype(np.float32)
        files.append(path)
    return files


def h5py_slicing(files: list[Path]) -> np.ndarray:
    import h5py

    batch = np.empty((BATCH, 3, 32, 32), np.float32)
    labels = np.empty(BATCH, np.float32)
    first = None
    filled = 0
    for path in files:
        with h5py.File(path, "r") as f:
            data, label = f["data"], f["label"]
            at, n = 0, data.shape[0]
            while at < n:
                take = min(BATCH - filled, n - at)
                batch[filled : filled + take] = data[at : at + take]
                labels[filled : filled + take] = label[at : at + take]
                filled += take
                at += take
                if filled == BATCH:
                    first = batch.copy() if first is None else first
                    filled = 0
    assert first is not None
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=4000)
    ap.add_argument("--images", type=int, default=2400)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small data, one run each")
    ap.add_argument("--only", choices=["leveldb", "imagedata", "hdf5"], help="one input alone")
    ap.add_argument("--data-dir", help="ignored (the data is written to a temporary directory)")
    args = ap.parse_args()
    if args.quick:
        args.records, args.images, args.rows, args.repeat = 256, 128, 1024, 1
    w = args.workers
    rows: list[tuple[str, str, int, float]] = []

    def run(group: str, name: str, n: int, fn: Callable[[], np.ndarray], ref: np.ndarray) -> None:
        seconds, first = best(fn, args.repeat)
        assert np.array_equal(first, ref), (group, name)
        rows.append((group, name, n, seconds))

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        db = root / "leveldb"
        wanted = {"leveldb", "imagedata", "hdf5"} if args.only is None else {args.only}
        if "leveldb" in wanted:
            leveldb(root, db, args.records, w, run)
        if "imagedata" in wanted:
            imagedata(root, args.images, w, run)
        if "hdf5" in wanted:
            hdf5(root, args.rows, w, run)
    report(rows)


Run = Callable[[str, str, int, Callable[[], np.ndarray], np.ndarray], None]


def leveldb(root: Path, db: Path, n: int, w: int, run: Run) -> None:
    write_leveldb(db, n)
    ref = plyvel_loop(db, root / "copy")
    run("LevelDB", "plyvel loop", n, lambda: plyvel_loop(db, root / "copy"), ref)
    run("LevelDB", "Batches", n, lambda: epoch_of(
        lambda: Batches(db, BATCH, mode="epoch"), False), ref)  # fmt: skip
    run("LevelDB", f"Loader x{w}", n, lambda: epoch_of(
        lambda: Loader(db, BATCH, device="cpu", workers=w, mode="epoch"),
        True), ref)  # fmt: skip


def imagedata(root: Path, n: int, w: int, run: Run) -> None:
    images = root / "images"
    images.mkdir()
    listing = write_images(images, n)
    ref = imread_loop(images, listing)
    source = ImageList(listing, f"{images}/")
    run("ImageData", "imread loop", n, lambda: imread_loop(images, listing), ref)
    run("ImageData", "Batches", n, lambda: epoch_of(
        lambda: Batches(source, BATCH, mode="epoch"), False), ref)  # fmt: skip
    run("ImageData", "Loader x1", n, lambda: epoch_of(
        lambda: Loader(source, BATCH, device="cpu", workers=1, mode="epoch"),
        True), ref)  # fmt: skip
    run("ImageData", f"Loader x{w}", n, lambda: epoch_of(
        lambda: Loader(source, BATCH, device="cpu", workers=w, mode="epoch"),
        True), ref)  # fmt: skip


def hdf5(root: Path, n: int, w: int, run: Run) -> None:
    files = write_h5(root, n)
    ref = h5py_slicing(files)
    run("HDF5Data", "h5py slicing", n, lambda: h5py_slicing(files), ref)
    run("HDF5Data", "Batches", n, lambda: epoch_of(
        lambda: Batches(Hdf5Data(files), BATCH, mode="epoch"), False), ref)  # fmt: skip
    run("HDF5Data", f"Loader x{w}", n, lambda: epoch_of(
        lambda: Loader(Hdf5Data(files), BATCH, device="cpu", workers=w, mode="epoch"),
        True), ref)  # fmt: skip


def report(rows: list[tuple[str, str, int, float]]) -> None:
    print(f"| input | contender | records | records/s | vs plain loop |  (batch {BATCH})")
    print("| --- | --- | ---: | ---: | ---: |")
    base = 0.0
    for group, name, n, seconds in rows:
        rate = n / seconds
        if name.endswith(("loop", "slicing")):
            base = rate
        print(f"| {group} | {name} | {n} | {rate:,.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
