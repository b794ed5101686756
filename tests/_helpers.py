"""Helpers shared by test modules: tiny LMDBs of generated records."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import cv2
import lmdb
import numpy as np

import blobpipe


def write_lmdb(path: Path, items: Iterable[tuple[bytes, bytes]]) -> Path:
    """An LMDB at ``path`` holding ``items`` (key, value)."""
    env = lmdb.open(str(path), map_size=1 << 28)
    with env.begin(write=True) as txn:
        for k, v in items:
            txn.put(k, v)
    env.close()
    return path


def image(i: int, shape: tuple[int, int, int] = (3, 6, 8)) -> np.ndarray:
    """Random uint8 pixels (C, H, W), the same for the same ``i``."""
    rng = np.random.default_rng(i)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def key(i: int) -> bytes:
    """The key of record ``i`` in the databases below (Caffe's ``%08d`` prefix)."""
    return f"{i:08d}".encode()


def raw_db(path: Path, n: int, shape: tuple[int, int, int] = (3, 10, 12)) -> Path:
    """``n`` raw Datums: record i holds ``image(i, shape)`` and label ``i``."""
    return write_lmdb(
        path, ((key(i), blobpipe.encode_raw_datum(image(i, shape), i)) for i in range(n))
    )


def encoded_db(path: Path, n: int, ext: str, shape: tuple[int, int, int] = (3, 10, 12)) -> Path:
    """``n`` encoded Datums (``ext`` ".jpg" or ".png") of ``image(i, shape)`` as HWC."""

    def encode(i: int) -> bytes:
        hwc = np.ascontiguousarray(image(i, shape).transpose(1, 2, 0))
        ok, buf = cv2.imencode(ext, hwc)
        assert ok
        return blobpipe.encode_encoded_datum(buf.tobytes(), i)

    return write_lmdb(path, ((key(i), encode(i)) for i in range(n)))


def float_db(path: Path, n: int, shape: tuple[int, int, int] = (3, 5, 6)) -> Path:
    """``n`` float_data Datums of normal noise; record i has label ``i``."""

    def value(i: int) -> bytes:
        x = np.random.default_rng(i).normal(0, 10, shape).astype(np.float32)
        return blobpipe.encode_float_datum(x, i)

    return write_lmdb(path, ((key(i), value(i)) for i in range(n)))
