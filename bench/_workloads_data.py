"""The workload benchmark's LMDBs: generated once, cached, keyed by a format version.

Each database is written as Caffe's tools write it (``blobpipe.encode_raw_datum`` /
``blobpipe.encode_encoded_datum``: the bytes of ``convert_imageset``), into its own
folder under the cache root (``bench/_data/`` unless ``--data-dir``)::

    <root>/<spec.key>/lmdb/              the database the kept-open Loaders read
    <root>/<spec.key>/lmdb_first/        a byte-identical copy for first epochs
    <root>/<spec.key>/lmdb_copy/         another, for the plain loop kept open
    <root>/<spec.key>/mean.binaryproto   the per-pixel mean (raw databases that need one)
    <root>/<spec.key>/meta.json          what was written (counts, sizes)

Why copies: LMDB (py-lmdb) opens one database file once per process, and blobpipe
shares that one environment (and its memory map) among the Loaders open on a file. The
benchmark keeps pipelines open across rounds; a first epoch must open a file nothing
else holds, so it pays for the open and the first touch of every page as a first epoch
does (the page cache is warm for all); and the plain loop's own environment cannot be
on a file blobpipe holds. A forked torch worker inherits its parent's list of open
files, so the torch recipe reads ``lmdb_first`` too, which no pipeline holds between
passes. A folder is written aside and renamed into place, so an interrupted run leaves
no half database; the key holds ``FORMAT``, so a change to what is written here (bump
it) rebuilds the caches.

Generation is quick on two cores: a small pool of distinct base images is made from
one smooth multi-octave noise canvas (natural-ish content: JPEG sizes and decode times
close to photographs), and the records cycle over the pool.
"""

from __future__ import annotations

import json
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lmdb
import numpy as np

import blobpipe

__all__ = [
    "DATA_DIR",
    "FORMAT",
    "DbSpec",
    "Prepared",
    "imagenet_raw",
    "prepare",
    "warm_page_cache",
]

DATA_DIR = Path(__file__).resolve().parent / "_data"
# Bump when what is written here changes: the cache key holds it, stale caches are rebuilt.
FORMAT = 2
_COMPLETE = "complete"


@dataclass(frozen=True)
class DbSpec:
    """One generated database.

    ``shape`` is the raw records' ``(C, H, W)``; JPEG records have 3 channels and
    sides drawn independently per image from ``sides`` (inclusive), or (``fixed``)
    every image ``shape``; PNG records are 3-channel images of ``shape``.
    """

    name: str  # e.g. "imagenet_raw"
    kind: Literal["raw", "jpeg", "png"]
    count: int
    pool: int  # distinct base images, cycled over the records
    keys: Literal["index", "imagenet"]  # "%08d", or convert_imageset's "%08d_<file>"
    shape: tuple[int, int, int] = (3, 256, 256)
    sides: tuple[int, int] = (240, 500)
    quality: int = 90
    mean_file: bool = False
    labels: int = 1000
    fixed: bool = False

    @property
    def key(self) -> str:
        if self.kind == "raw" or self.kind == "png":
            dims = "x".join(map(str, self.shape))
        elif self.fixed:
            dims = "x".join(map(str, self.shape)) + f"q{self.quality}"
        else:
            dims = f"{self.sides[0]}-{self.sides[1]}q{self.quality}"
        return f"{self.name}_{self.count}_{dims}_p{self.pool}_v{FORMAT}"


def imagenet_raw(quick: bool = False) -> tuple[DbSpec, int]:
    """W3's database (caffenet's train_val over ``create_imagenet.sh`` output): raw
    3×256×256 Datums with a mean file, and its crop (227); tiny with ``quick``.
    The workload benchmark's W3/W3-test/W5 and the GPU benchmark read it."""
    side, crop = (96, 80) if quick else (256, 227)
    spec = DbSpec(
        name="imagenet_raw",
        kind="raw",
        count=192 if quick else 2048,
        pool=16 if quick else 64,
        keys="imagenet",
        shape=(3, side, side),
        mean_file=True,
    )
    return spec, crop


@dataclass(frozen=True)
class Prepared:
    """A database ready to read, and what it holds."""

    spec: DbSpec
    path: Path  # the LMDB the kept-open Loaders read
    first: Path  # a byte-identical copy for first epochs (and the torch workers)
    copy: Path  # a byte-identical copy for the plain loop kept open (and the ceilings)
    mean_file: Path | None
    count: int
    value_bytes: float  # mean size of a stored record (the serialized Datum)
    payload_bytes: float  # mean size of its data field (raw pixels or the JPEG file)
    pixels: float  # mean decoded uint8 values per image (C·H·W)
    written: bool  # False when the cache was reused
    seconds: float  # spent preparing (writing, or checking the cache)


# -- content ----------------------------------------------------------------------------------


def _canvas(rng: np.random.Generator, side: int = 1024) -> np.ndarray:
    """A natural-ish BGR canvas (float32, 0..255): a luminance of upsampled noise octaves
    (amplitude falling as 1/f^0.6, so fine detail remains), sharp edges where a mid-scale
    field changes sign (object boundaries), weaker low-frequency colour, sensor grain."""
    import cv2

    def octaves(cells_list: tuple[int, ...], power: float, channels: int) -> np.ndarray:
        out = np.zeros((side, side, channels), np.float32)
        for cells in cells_list:
            noise = rng.standard_normal((cells, cells, channels)).astype(np.float32)
            up = cv2.resize(noise, (side, side), interpolation=cv2.INTER_CUBIC)
            out += up.reshape(side, side, channels) * cells**-power
        return out / max(float(out.std()), 1e-6)

    luma = octaves((4, 8, 16, 32, 64, 128, 256, 512), 0.4, 1)
    edges = np.sign(octaves((12, 24, 48), 0.3, 1))
    chroma = octaves((3, 6, 12, 24), 1.0, 3)
    out = 118.0 + 38.0 * luma + 22.0 * edges + 18.0 * chroma
    out += rng.standard_normal(out.shape).astype(np.float32) * 4.0
    return np.clip(out, 0, 255)


def _window(
    rng: np.random.Generator, canvas: np.ndarray, h: int, w: int, zoom: float = 1.0
) -> np.ndarray:
    """An ``h``×``w`` HWC uint8 window of the canvas (``zoom`` × larger, resized down),
    with a random per-channel gain and offset: each call a distinct image."""
    import cv2

    sh, sw = int(h * zoom), int(w * zoom)
    y = int(rng.integers(0, canvas.shape[0] - sh + 1))
    x = int(rng.integers(0, canvas.shape[1] - sw + 1))
    win = canvas[y : y + sh, x : x + sw]
    if zoom != 1.0:
        win = cv2.resize(win, (w, h), interpolation=cv2.INTER_AREA)
    gain = rng.uniform(0.75, 1.25, 3).astype(np.float32)
    offset = rng.uniform(-25, 25, 3).astype(np.float32)
    return np.clip(win * gain + offset, 0, 255).astype(np.uint8)


def _pool(spec: DbSpec, rng: np.random.Generator) -> list[np.ndarray] | list[bytes]:
    """The distinct base images: CHW uint8 arrays (raw) or JPEG files (jpeg)."""
    import cv2

    canvas = _canvas(rng)
    if spec.kind in ("jpeg", "png"):
        files = []
        for _ in range(spec.pool):
            if spec.kind == "png" or spec.fixed:  # small images: a wider scene, resized
                h, w = spec.shape[1:]
                zoom = min(4.0, (canvas.shape[0] - 1) / max(h, w))
            else:
                h, w = (int(v) for v in rng.integers(spec.sides[0], spec.sides[1] + 1, 2))
                zoom = 1.0
            img = _window(rng, canvas, h, w, zoom)
            if spec.kind == "png":
                ok, enc = cv2.imencode(".png", img)
            else:
                ok, enc = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, spec.quality])
            assert ok
            files.append(enc.tobytes())
        return files
    c, h, w = spec.shape
    zoom = min(4.0, (canvas.shape[0] - 1) / max(h, w))  # small images: a wider scene, resized
    images = []
    for _ in range(spec.pool):
        img = _window(rng, canvas, h, w, zoom)
        if c == 1:  # MNIST-like: bright strokes on black
            gray = img.mean(axis=2)
            img = np.clip((gray - 150.0) * 6.0, 0, 255).astype(np.uint8)[:, :, None]
        elif c != 3:
            raise ValueError(f"raw databases have 1 or 3 channels, not {c}")
        images.append(np.ascontiguousarray(img.transpose(2, 0, 1)))
    return images


def _key(spec: DbSpec, i: int, label: int) -> bytes:
    if spec.keys == "index":
        return f"{i:08d}".encode()
    synset = f"n{1440764 + label * 1009:08d}"  # shaped like ImageNet's wnids
    return f"{i:08d}_{synset}/{synset}_{10026 + i}.JPEG".encode()


def _write(spec: DbSpec, folder: Path) -> dict[str, float]:
    """Write ``spec`` into ``folder`` (lmdb/ and its copies, mean.binaryproto); returns meta."""
    rng = np.random.default_rng(zlib.crc32(spec.key.encode()))
    pool = _pool(spec, rng)
    values = [
        blobpipe.encode_encoded_datum(item, 0)
        if isinstance(item, bytes)
        else blobpipe.encode_raw_datum(item, 0)
        for item in pool
    ]
    total = sum(len(values[i % spec.pool]) + 64 for i in range(spec.count))
    env = lmdb.open(str(folder / "lmdb"), map_size=2 * total + (64 << 20), sync=False)
    value_bytes = 0
    try:
        with env.begin(write=True) as txn:
            for i in range(spec.count):
                label = i % spec.labels
                item = pool[i % spec.pool]
                # a fresh encoding per record (the label differs), as convert_imageset writes it
                value = (
                    blobpipe.encode_encoded_datum(item, label)
                    if isinstance(item, bytes)
                    else blobpipe.encode_raw_datum(item, label)
                )
                txn.put(_key(spec, i, label), value, append=True)
                value_bytes += len(value)
        env.sync(True)
    finally:
        env.close()
    uses = np.bincount(np.arange(spec.count) % spec.pool, minlength=spec.pool)
    payload = [len(p) if isinstance(p, bytes) else p.nbytes for p in pool]
    if spec.kind != "raw":
        import cv2

        shapes = [cv2.imdecode(np.frombuffer(p, np.uint8), cv2.IMREAD_COLOR).shape for p in pool]
        pixels = [int(np.prod(s)) for s in shapes]
    else:
        pixels = payload
    if spec.mean_file:
        acc = np.zeros(spec.shape, np.float64)
        for n_uses, img in zip(uses.tolist(), pool, strict=True):
            acc += n_uses * np.asarray(img, np.float64)
        mean = np.asarray(acc / spec.count, np.float32)
        blob = blobpipe.Blob((1, *spec.shape), backend="cpu")
        try:
            blob.mutable_cpu_data()[...] = mean
            blobpipe.write_blobproto(blob, folder / "mean.binaryproto")
        finally:
            blob.close()
    for copy in ("lmdb_first", "lmdb_copy"):
        shutil.copytree(folder / "lmdb", folder / copy)
    return {
        "count": spec.count,
        "value_bytes": value_bytes / spec.count,
        "payload_bytes": float(np.dot(uses, payload)) / spec.count,
        "pixels": float(np.dot(uses, pixels)) / spec.count,
    }


def prepare(spec: DbSpec, data_dir: Path | None = None) -> Prepared:
    """The database of ``spec`` under ``data_dir`` (default ``bench/_data``); written if
    missing or incomplete."""
    t0 = time.perf_counter()
    root = DATA_DIR if data_dir is None else Path(data_dir)
    folder = root / spec.key
    written = False
    if not (folder / _COMPLETE).exists():
        tmp = folder.with_name(folder.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        meta = _write(spec, tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / _COMPLETE).touch()
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        written = True
    meta = json.loads((folder / "meta.json").read_text())
    mean = folder / "mean.binaryproto"
    return Prepared(
        spec=spec,
        path=folder / "lmdb",
        first=folder / "lmdb_first",
        copy=folder / "lmdb_copy",
        mean_file=mean if mean.exists() else None,
        count=int(meta["count"]),
        value_bytes=float(meta["value_bytes"]),
        payload_bytes=float(meta["payload_bytes"]),
        pixels=float(meta["pixels"]),
        written=written,
        seconds=time.perf_counter() - t0,
    )


def warm_page_cache(prepared: Prepared) -> None:
    """Read the databases' files once, so no contender's first pass reads the disk."""
    for db in (prepared.path, prepared.first, prepared.copy):
        with open(db / "data.mdb", "rb", buffering=0) as f:
            buf = bytearray(1 << 22)
            while f.readinto(buf):
                pass
