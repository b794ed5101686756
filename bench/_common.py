"""What the benchmarks share: the synthetic Datum LMDBs and how they are cached.

``write_db`` writes ``n`` Datums cycling through 64 distinct smooth-ish images
(realistic JPEG sizes, fast to generate), keys ``%08d``, labels ``i % 1000``.
``cached_db`` keeps one LMDB per (kind, shape, count) under ``bench/_data/``
(git-ignored) and writes it only when it is missing or incomplete.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blobpipe._proto import caffe_pb2

__all__ = ["DATA_DIR", "cached_db", "write_db"]

DATA_DIR = Path(__file__).resolve().parent / "_data"
# Bump when write_db's output changes, so stale caches are not reused.
_FORMAT = 2
_COMPLETE = "complete"


def write_db(path: Path, n: int, encoded: bool, shape: tuple[int, int, int] = (3, 64, 64)) -> None:
    """Write ``n`` raw (or JPEG, quality 95) Datums of ``shape`` to a new LMDB at ``path``.

    Raw databases need only NumPy and lmdb (the GPU machine may lack OpenCV); JPEG
    ones import OpenCV.
    """
    c, h, w = shape
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (64, *shape), dtype=np.uint8).astype(np.float32)
    # a 5×5 box blur (wrapping at the edges): smooth-ish images, realistic JPEG sizes
    for axis in (2, 3):
        noise = sum(np.roll(noise, k, axis=axis) for k in range(-2, 3)) / 5
    base = np.rint(noise).astype(np.uint8)
    values = []
    for img in base:
        if encoded:
            import cv2

            ok, enc = cv2.imencode(".jpg", img.transpose(1, 2, 0), [cv2.IMWRITE_JPEG_QUALITY, 95])
            assert ok
            d = caffe_pb2.Datum(data=enc.tobytes(), encoded=True)
        else:
            d = caffe_pb2.Datum(channels=c, height=h, width=w, data=img.tobytes())
        values.append(d)
    per_record = max(len(v.data) for v in values) + 64
    map_size = max(1 << 26, 2 * n * (per_record + 64))
    env = lmdb.open(str(path), map_size=map_size)
    try:
        with env.begin(write=True) as txn:
            for i in range(n):
                d = values[i % 64]
                d.label = i % 1000
                txn.put(f"{i:08d}".encode(), d.SerializeToString())
    finally:
        env.close()


def cached_db(
    kind: str,
    n: int,
    shape: tuple[int, int, int] = (3, 64, 64),
    data_dir: Path | None = None,
) -> tuple[Path, bool]:
    """The LMDB of ``n`` ``kind`` ("raw" or "jpeg") Datums; written if missing.

    Returns ``(path, written)``; ``written`` is False when the cache was reused.
    """
    if kind not in ("raw", "jpeg"):
        raise ValueError(f"kind must be 'raw' or 'jpeg', got {kind!r}")
    root = DATA_DIR if data_dir is None else Path(data_dir)
    c, h, w = shape
    path = root / f"{kind}_{c}x{h}x{w}_{n}_v{_FORMAT}"
    if (path / _COMPLETE).exists():
        return path, False
    # Written aside and renamed, so an interrupted run leaves no half database behind.
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_db(tmp, n, kind == "jpeg", shape)
    (tmp / _COMPLETE).touch()
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path, True
