"""Images/s of blobpipe.Loader vs a plain protobuf loop, PyTorch's LMDB recipe and memory ceilings.

Run: ``python bench/bench_loader.py [--records 20480] [--jpeg-records 10000] [--repeats 5]
[--workers 1 2 4] [--quick] [--json OUT] [--data-dir DIR] [--no-torch]``

Two LMDBs of 3×64×64 Datums (raw uint8 and JPEG quality 95) are generated once
and cached under ``bench/_data/`` (git-ignored). Every contender turns them into
batches of 64, scale 1/256, on the CPU, one pass over the same whole batches
(``records // 64 * 64`` records) per repetition; the repetitions are
interleaved (each round runs every contender once) so the load of a shared
machine spreads over all rows, and the table shows medians.

Rows (raw LMDB):

* ``memcpy ceiling``: as the issue defines it, one bulk memcpy of the same
  pixel bytes: every record's pixels, preloaded into one array, copied by one
  call into a preallocated array of the same size (touched beforehand, so no
  page fault is timed). The uint8 target is a ratio to this row;
* ``u8→f32 ceiling``: one bulk uint8→float32 conversion of the same bytes into
  a preallocated float32 array, one thread;
* for orientation, the same two done batch by batch (64 records at a time) into
  one warm batch that stays in the CPU cache: a cache-resident destination is
  faster than any real pipeline's memory can be, so these rows only bound the
  per-batch copy (the conversion also split over two threads).
* ``plain loop``: py-lmdb cursor, a fresh ``caffe_pb2.Datum`` per record, its
  bytes converted (``np.copyto``) into a preallocated float32 batch, which is
  scaled once per batch — the fastest plain form we found;
* ``blobpipe float32/uint8``: ``blobpipe.Loader(..., device="cpu",
  transform=Transform(scale=1/256), phase="test", prefetch=4, mode="epoch",
  last="drop")`` iterated with ``async for`` (and ``for``, the portal form);
  uint8 is ``Transform(dtype="uint8")`` (raw pixels, no scale). A pass is one
  epoch of a Loader that stays open, as in training, after a first epoch that
  is not timed; after each pass the benchmark waits, untimed, until the
  Loader's fillers have filled its slots with the next epoch's first batches
  and stopped (so no row's prefetch runs into the next row), and those
  ``prefetch`` batches are not counted in the next pass; the "incl.
  open+close" rows time a first epoch per pass (open, index the file, meet
  every record once, close);
* ``torch DataLoader``: the common recipe (a ``Dataset`` opening its LMDB
  environment lazily in each worker, ``txn.get`` + ``Datum.FromString`` +
  ``astype(float32) * scale`` per record, default collate), ``num_workers`` 0
  and 2 (a new DataLoader per pass, so each pass starts its worker processes as
  an epoch does), and 2 with ``persistent_workers=True`` (one DataLoader for all
  passes: the median is a warm epoch); skipped when torch is not installed.
  These rows run their rounds after all the others: they fork, and pages a
  child shares are copied on the parent's next write, a cost that would
  otherwise land on the rows after them.

Rows (JPEG LMDB): a single-thread OpenCV loop (fresh Datum, ``cv2.imdecode``
with Caffe's flag, into a preallocated float32 batch, scaled per batch: the
baseline of the JPEG target), the same loop run on two threads at once over
alternate batches (what two cores of this machine allow with OpenCV at that
moment), the same two with simplejpeg's ``decode_jpeg`` (libjpeg-turbo's
TurboJPEG API, which blobpipe uses where it gives OpenCV's pixels: the bound
for blobpipe), blobpipe with ``workers`` 1 and 2, blobpipe's first epoch
(open+close per pass: every JPEG goes through LMDB and the Datum checks once),
and blobpipe with JPEG decoding left to OpenCV alone (as with
``BLOBPIPE_JPEG_DECODER=opencv``).

Every contender's first batch is checked equal to the baseline's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import mmap
import os
import platform
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import cv2
import lmdb
import numpy as np
import simplejpeg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import baseline_copy, cached_db

import blobpipe
from blobpipe._io import _image
from blobpipe._proto import caffe_pb2

BATCH = 64
SCALE = 1 / 256
SCALE32 = np.float32(SCALE)
SHAPE = (3, 64, 64)

# (rows, first batch) for one pass over ``n`` records
Pass = Callable[[], tuple[int, np.ndarray]]


@dataclass
class Row:
    key: str
    label: str
    group: str  # "raw" or "jpeg"
    run: Pass | None  # None: skipped (see note)
    baseline: str | None = None  # key of the row the ratio is taken against
    target: float | None = None  # ratio to reach
    note: str = ""
    check: str | None = None  # key of the row whose first batch must be equal
    last: bool = False  # measured after the interleaved rounds (it forks processes)
    rates: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.rates) if self.rates else float("nan")


# -- ceilings ----------------------------------------------------------------


def load_pixels(path: Path, n: int) -> np.ndarray:
    """Every record's pixels, in key order, as one (n, C, H, W) uint8 array."""
    out = np.empty((n, *SHAPE), np.uint8)
    with blobpipe.LmdbReader(path) as reader, reader.transaction() as txn:
        for i, key in enumerate(reader.keys()[:n]):
            chw, _ = blobpipe.datum_view(txn.get(key))
            out[i] = chw
    return out


def private_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed array in anonymous memory that child processes do not inherit.

    The torch rows fork worker processes; pages shared with a child are copied
    on the parent's next write, which would charge a bulk copy's destination
    one page-copy fault per 4 KiB after every fork. MADV_DONTFORK keeps the
    ceilings' destinations out of the children.
    """
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_DONTFORK"):
        buf.madvise(mmap.MADV_DONTFORK)
    arr = np.frombuffer(buf, dtype, count=int(np.prod(shape))).reshape(shape)
    arr.fill(0)  # touched once here: page faults are not timed
    return arr


def bulk_memcpy(src: np.ndarray) -> Pass:
    """One copy of all the bytes into a preallocated (touched) array of the same size."""
    dst = private_empty(src.shape, src.dtype)

    def run() -> tuple[int, np.ndarray]:
        np.copyto(dst, src)
        return len(src), dst[:BATCH].copy()

    return run


def bulk_u8_to_f32(src: np.ndarray) -> Pass:
    """One conversion of all the bytes into a preallocated (touched) float32 array."""
    dst = private_empty(src.shape, np.float32)

    def run() -> tuple[int, np.ndarray]:
        np.multiply(src, SCALE32, out=dst, dtype=np.float32)
        return len(src), dst[:BATCH].copy()

    return run


def memcpy_per_batch(src: np.ndarray) -> Pass:
    def run() -> tuple[int, np.ndarray]:
        dst = np.empty((BATCH, *SHAPE), np.uint8)
        dst.fill(0)  # warm: page faults are not timed
        first = None
        for lo in range(0, len(src), BATCH):
            np.copyto(dst, src[lo : lo + BATCH])
            if first is None:
                first = dst.copy()
        assert first is not None
        return len(src), first

    return run


def u8_to_f32_per_batch(src: np.ndarray, threads: int) -> Pass:
    def run() -> tuple[int, np.ndarray]:
        dst = np.empty((BATCH, *SHAPE), np.float32)
        dst.fill(0)
        first = None
        half = BATCH // 2
        pool = ThreadPoolExecutor(threads) if threads > 1 else None
        try:
            for lo in range(0, len(src), BATCH):
                if pool is None:
                    np.multiply(src[lo : lo + BATCH], SCALE32, out=dst, dtype=np.float32)
                else:
                    a = pool.submit(
                        np.multiply, src[lo : lo + half], SCALE32, out=dst[:half], dtype=np.float32
                    )
                    np.multiply(
                        src[lo + half : lo + BATCH], SCALE32, out=dst[half:], dtype=np.float32
                    )
                    a.result()
                if first is None:
                    first = dst.copy()
        finally:
            if pool is not None:
                pool.shutdown()
        assert first is not None
        return len(src), first

    return run


# -- plain loops ----------------------------------------------------------------


def plain_loop(path: Path, n: int) -> Pass:
    """Fresh Datum per record, bytes converted into a preallocated float32 batch."""

    def run() -> tuple[int, np.ndarray]:
        data = np.empty((BATCH, *SHAPE), np.float32)
        label = np.empty(BATCH, np.float32)
        first = None
        env = lmdb.open(str(path), readonly=True, lock=False, readahead=False)
        try:
            with env.begin() as txn:
                cursor = txn.cursor()
                cursor.first()
                for _ in range(n // BATCH):
                    for i in range(BATCH):
                        d = caffe_pb2.Datum.FromString(cursor.value())
                        pix = np.frombuffer(d.data, np.uint8)
                        np.copyto(data[i], pix.reshape(d.channels, d.height, d.width))
                        label[i] = d.label
                        cursor.next()
                    data *= SCALE32
                    if first is None:
                        first = data.copy()
        finally:
            env.close()
        assert first is not None
        return n // BATCH * BATCH, first

    return run


def _cv_decode(buf: bytes) -> np.ndarray:
    img: np.ndarray = cv2.imdecode(np.frombuffer(buf, np.uint8), cv2.IMREAD_UNCHANGED)
    return img


def _sj_decode(buf: bytes) -> np.ndarray:
    img: np.ndarray = simplejpeg.decode_jpeg(buf, colorspace="BGR")
    return img


def _decode_batches(
    env: Any, n: int, threads: int, k: int, decode: Callable[[bytes], np.ndarray]
) -> np.ndarray | None:
    """The decode loop over batches ``k, k + threads, ...`` of the first ``n`` records:
    a fresh Datum per record, ``decode`` (OpenCV's ``imdecode`` with Caffe's flag, or
    simplejpeg) into a float32 batch scaled once per batch. Returns the first batch."""
    data = np.empty((BATCH, *SHAPE), np.float32)
    label = np.empty(BATCH, np.float32)
    first = None
    with env.begin() as txn:
        cursor = txn.cursor()
        cursor.first()
        for b in range(n // BATCH):
            if b % threads != k:
                for _ in range(BATCH):
                    cursor.next()
                continue
            for i in range(BATCH):
                d = caffe_pb2.Datum.FromString(cursor.value())
                np.copyto(data[i], decode(d.data).transpose(2, 0, 1))
                label[i] = d.label
                cursor.next()
            data *= SCALE32
            if first is None:
                first = data.copy()
    return first


def decode_loop(
    path: Path, n: int, threads: int = 1, decode: Callable[[bytes], np.ndarray] = _cv_decode
) -> Pass:
    """The decode loop on ``threads`` threads at once, each on its own batches, with
    nothing else: no batch order, no hand-over, no consumer. One thread (the
    caller's) with OpenCV is the JPEG baseline; two are what two cores allow."""

    def run() -> tuple[int, np.ndarray]:
        env = lmdb.open(str(path), readonly=True, lock=False, readahead=False)
        try:
            if threads == 1:
                firsts = [_decode_batches(env, n, 1, 0, decode)]
            else:
                with ThreadPoolExecutor(threads) as pool:
                    firsts = list(
                        pool.map(
                            _decode_batches,
                            [env] * threads,
                            [n] * threads,
                            [threads] * threads,
                            range(threads),
                            [decode] * threads,
                        )
                    )
        finally:
            env.close()
        assert firsts[0] is not None
        return n // BATCH * BATCH, firsts[0]

    return run


class _OpenCVOnly:
    """A pass with blobpipe's JPEG decoding left to OpenCV alone (what
    ``BLOBPIPE_JPEG_DECODER=opencv`` does), for the row that shows what the
    libjpeg-turbo path adds; the other rows' loaders are idle meanwhile."""

    def __init__(self, make: Callable[[], Pass]) -> None:
        off = _image._Fast()
        off.started = True  # started, with no fast decoder: OpenCV decodes
        self._off = off
        with self:
            self._run = make()

    def __enter__(self) -> None:
        self._saved = _image._fast
        _image._fast = self._off

    def __exit__(self, *exc: object) -> None:
        _image._fast = self._saved

    def __call__(self) -> tuple[int, np.ndarray]:
        with self:
            return self._run()

    def settle(self) -> None:
        settle = getattr(self._run, "settle", None)
        if settle is not None:
            with self:
                settle()


# -- blobpipe ----------------------------------------------------------------


def _loader(path: Path, workers: int, dtype: str) -> blobpipe.Loader:
    transform = (
        blobpipe.Transform(scale=SCALE) if dtype == "float32" else blobpipe.Transform(dtype="uint8")
    )
    return blobpipe.Loader(
        path,
        batch_size=BATCH,
        device="cpu",
        transform=transform,
        phase="test",
        workers=workers,
        prefetch=4,
        mode="epoch",
        last="drop",
    )


def blobpipe_async(path: Path, workers: int, dtype: str = "float32") -> Pass:
    """One pass = open a Loader, iterate one epoch with ``async for``, close it."""

    async def epoch() -> tuple[int, np.ndarray]:
        async with _loader(path, workers, dtype) as loader:
            return await _async_epoch(loader)

    return lambda: anyio.run(epoch)


async def _async_epoch(loader: blobpipe.Loader, head_start: int = 0) -> tuple[int, np.ndarray]:
    rows = 0
    first = None
    async for batch in loader:
        data = batch.data.cpu_data()
        if first is None:
            first = data.copy()
        rows += len(batch)
    assert first is not None
    return rows - min(head_start, rows // BATCH // 2) * BATCH, first


def _head_start(loader: blobpipe.Loader) -> int:
    """Batches a Loader kept open may have filled between two passes, outside the
    timed window (it prefetches the next epoch's first batches): not counted."""
    return loader.prefetch


def _wait_idle(loader: blobpipe.Loader, timeout: float = 5.0) -> None:
    """Wait (untimed) until the Loader's fillers have filled every slot and stopped,
    so that no row's prefetch for its next epoch runs during the next row. Reads the
    loader's private hand-off: benchmark code only."""
    deadline = time.perf_counter() + timeout
    while len(loader._handoff) < loader.prefetch and time.perf_counter() < deadline:
        time.sleep(0.0005)


class _KeptOpen:
    """A pass over a Loader kept open, and how to let it settle after the pass."""

    def __init__(self, run: Callable[[], tuple[int, np.ndarray]], loader: blobpipe.Loader):
        self._run = run
        self._loader = loader

    def __call__(self) -> tuple[int, np.ndarray]:
        return self._run()

    def settle(self) -> None:
        _wait_idle(self._loader)


_SESSIONS: list[_WarmAsync] = []


class _WarmAsync:
    """A Loader kept open in an event loop on a background thread, as in training:
    each pass iterates one epoch with ``async for`` there. Between passes the
    loader prefetches the next epoch's first batches, as it does between
    epochs; those ``prefetch`` batches are not counted (see ``_head_start``)."""

    def __init__(
        self, path: Path, workers: int, dtype: str, loader: blobpipe.Loader | None = None
    ) -> None:
        self._requests: queue.SimpleQueue[concurrent.futures.Future[Any] | None] = (
            queue.SimpleQueue()
        )
        self._loader = _loader(path, workers, dtype) if loader is None else loader
        self._thread = threading.Thread(target=anyio.run, args=(self._main,), daemon=True)
        self._thread.start()
        _SESSIONS.append(self)

    async def _main(self) -> None:
        async with self._loader as loader:
            while True:
                request = await anyio.to_thread.run_sync(self._requests.get)
                if request is None:
                    return
                try:
                    request.set_result(await _async_epoch(loader, _head_start(loader)))
                except BaseException as exc:
                    request.set_exception(exc)
                    raise

    def run(self) -> tuple[int, np.ndarray]:
        request: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._requests.put(request)
        result: tuple[int, np.ndarray] = request.result()
        return result

    def close(self) -> None:
        self._requests.put(None)
        self._thread.join()


def blobpipe_warm(path: Path, workers: int, dtype: str = "float32") -> Pass:
    """One pass = one epoch of ``async for`` on a Loader that stays open; its first
    epoch runs here, untimed (the "incl. open+close" rows time first epochs)."""
    session = _WarmAsync(path, workers, dtype)
    kept = _KeptOpen(session.run, session._loader)
    kept()
    kept.settle()
    return kept


def close_sessions() -> None:
    while _SESSIONS:
        _SESSIONS.pop().close()


def blobpipe_sync(path: Path, workers: int, dtype: str = "float32") -> Pass:
    """One pass = one epoch of ``for`` (the blocking form) on a Loader that stays open."""
    loader = _loader(path, workers, dtype)
    loader.__enter__()

    class _Closer:
        def close(self) -> None:
            loader.close()

    _SESSIONS.append(_Closer())  # type: ignore[arg-type]

    def run() -> tuple[int, np.ndarray]:
        rows = 0
        first = None
        for batch in loader:
            data = batch.data.cpu_data()
            if first is None:
                first = data.copy()
            rows += len(batch)
        assert first is not None
        return rows - min(_head_start(loader), rows // BATCH // 2) * BATCH, first

    kept = _KeptOpen(run, loader)
    kept()  # the first epoch, untimed, as for blobpipe_warm
    kept.settle()
    return kept


# -- PyTorch -------------------------------------------------------------------------------------


class _LmdbDataset:
    """The usual LMDB Dataset: environment opened lazily, once per worker process."""

    def __init__(self, path: Path, n: int) -> None:
        self.path = str(path)
        self.keys = [f"{i:08d}".encode() for i in range(n)]
        self.env: Any = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        if self.env is None:
            self.env = lmdb.open(
                self.path, readonly=True, lock=False, readahead=False, meminit=False
            )
        with self.env.begin() as txn:
            value = txn.get(self.keys[i])
        d = caffe_pb2.Datum.FromString(value)
        pix = np.frombuffer(d.data, np.uint8).reshape(d.channels, d.height, d.width)
        return torch.from_numpy(pix.astype(np.float32) * SCALE32), d.label


def torch_loader(path: Path, n: int, num_workers: int, persistent: bool = False) -> Pass:
    """One epoch of the recipe; ``persistent`` keeps one DataLoader (and its workers)
    across passes, so only the first pass pays for starting the worker processes."""
    kept: list[Any] = []

    def make() -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(
            _LmdbDataset(path, n),  # type: ignore[arg-type]
            batch_size=BATCH,
            shuffle=False,
            num_workers=num_workers,
            drop_last=True,
            persistent_workers=persistent,
        )

    def run() -> tuple[int, np.ndarray]:
        if not persistent:
            loader = make()
        else:
            if not kept:
                kept.append(make())
            loader = kept[0]
        rows = 0
        first = None
        for data, _label in loader:
            if first is None:
                first = data.numpy().copy()
            rows += len(data)
        assert first is not None
        return rows, first

    return run


def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


# -- driver ----------------------------------------------------------------


def build_rows(
    raw: Path,
    jpeg: Path,
    n: int,
    n_jpeg: int,
    sweep: list[int],
    torch_skip: str | None,
    raw_copy: Path,
    jpeg_copy: Path,
) -> list[Row]:
    """The contenders; ``torch_skip`` says why the torch rows are skipped (None: run them).

    blobpipe reads ``raw``/``jpeg``; the baselines read byte-identical copies
    (py-lmdb opens a database file once per process; blobpipe's stay open).
    """
    cpus = os.cpu_count() or 1
    main_w = cpus
    pixels = load_pixels(raw_copy, n // BATCH * BATCH)
    rows = [
        Row("memcpy", "memcpy ceiling (one bulk copy)", "raw", bulk_memcpy(pixels)),
        Row(
            "u8f32",
            "u8→f32 ceiling (one bulk conversion, 1 thread)",
            "raw",
            bulk_u8_to_f32(pixels),
            baseline="memcpy",
            check="plain",
        ),
        Row(
            "memcpy_b",
            "memcpy batch by batch into a cache-resident batch",
            "raw",
            memcpy_per_batch(pixels),
            baseline="memcpy",
            check="memcpy",
        ),
        Row(
            "u8f32_b",
            "u8→f32 batch by batch into a cache-resident batch, 1 thread",
            "raw",
            u8_to_f32_per_batch(pixels, 1),
            baseline="u8f32",
            check="plain",
        ),
        Row(
            "u8f32x2_b",
            "u8→f32 batch by batch into a cache-resident batch, 2 threads",
            "raw",
            u8_to_f32_per_batch(pixels, 2),
            baseline="u8f32_b",
            check="plain",
        ),
        Row("plain", "plain protobuf loop (float32)", "raw", plain_loop(raw_copy, n)),
    ]
    for w in sorted({*sweep, main_w}):
        target = 1.5 if w == main_w else None
        rows.append(
            Row(
                f"bp_f32_w{w}",
                f"blobpipe float32, async, workers={w}",
                "raw",
                blobpipe_warm(raw, w),
                baseline="plain",
                target=target,
                check="plain",
            )
        )
    rows += [
        Row(
            f"bp_f32_cold_w{main_w}",
            f"blobpipe float32, async, workers={main_w}, incl. open+close",
            "raw",
            blobpipe_async(raw, main_w),
            baseline="plain",
            check="plain",
        ),
        Row(
            f"bp_f32_sync_w{main_w}",
            f"blobpipe float32, sync, workers={main_w}",
            "raw",
            blobpipe_sync(raw, main_w),
            baseline="plain",
            check="plain",
        ),
        Row(
            f"bp_u8_w{main_w}",
            f"blobpipe uint8, async, workers={main_w}",
            "raw",
            blobpipe_warm(raw, main_w, "uint8"),
            baseline="memcpy",
            target=0.25,
            check="memcpy",
        ),
    ]
    for nw, persistent in ((0, False), (2, False), (2, True)):
        run = torch_loader(raw_copy, n, nw, persistent) if torch_skip is None else None
        rows.append(
            Row(
                f"torch_nw{nw}" + ("_persistent" if persistent else ""),
                f"torch DataLoader recipe, num_workers={nw}"
                + (", persistent_workers" if persistent else ""),
                "raw",
                run,
                baseline="plain",
                check="plain",
                note=torch_skip or "",
                last=True,
            )
        )
    rows += [
        Row("cv", "OpenCV imdecode loop (1 thread)", "jpeg", decode_loop(jpeg_copy, n_jpeg)),
        Row(
            "cv_x2",
            "the same loop on 2 threads at once (what 2 cores allow with OpenCV)",
            "jpeg",
            decode_loop(jpeg_copy, n_jpeg, 2),
            baseline="cv",
            check="cv",
        ),
        Row(
            "sj",
            "the same loop with simplejpeg (libjpeg-turbo; blobpipe's JPEG decoder), 1 thread",
            "jpeg",
            decode_loop(jpeg_copy, n_jpeg, 1, _sj_decode),
            baseline="cv",
            check="cv",
        ),
        Row(
            "sj_x2",
            "the simplejpeg loop on 2 threads at once (what 2 cores allow with it)",
            "jpeg",
            decode_loop(jpeg_copy, n_jpeg, 2, _sj_decode),
            baseline="cv",
            check="cv",
        ),
    ]
    rows.append(
        Row(
            f"bp_jpeg_cold_w{main_w}",
            f"blobpipe JPEG float32, async, workers={main_w}, incl. open+close",
            "jpeg",
            blobpipe_async(jpeg, main_w),
            baseline="cv",
            check="cv",
        )
    )
    for w in sorted({*sweep, 1, main_w}):
        target = 1.6 if w == main_w else None
        rows.append(
            Row(
                f"bp_jpeg_w{w}",
                f"blobpipe JPEG float32, async, workers={w}",
                "jpeg",
                blobpipe_warm(jpeg, w),
                baseline="cv",
                target=target,
                check="cv",
            )
        )
    rows.append(
        Row(
            f"bp_jpeg_cv_w{main_w}",
            f"blobpipe JPEG float32, async, workers={main_w}, OpenCV decoding only",
            "jpeg",
            _OpenCVOnly(lambda: blobpipe_warm(jpeg, main_w)),
            baseline="cv",
            check="cv",
        )
    )
    return rows


_PROBE = b"\x5a" * (1 << 20)


def _hash(n: int) -> None:
    for _ in range(n):
        hashlib.sha256(_PROBE).digest()


def parallel_headroom(threads: int = 2, n: int = 64) -> float:
    """Speedup of a GIL-free workload (sha256 of 1 MiB) on ``threads`` threads over one.

    ``threads``× means that many idle cores; on a shared machine it shows how
    much parallelism the workers sweep could have had at that moment.
    """
    t0 = time.perf_counter()
    _hash(n)
    one = time.perf_counter() - t0
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        for f in [pool.submit(_hash, n // threads) for _ in range(threads)]:
            f.result()
        many = time.perf_counter() - t0
    return one / many


def measure(rows: list[Row], repeats: int) -> list[float]:
    """Run every row ``repeats`` times, interleaved; returns the headroom per round.

    Rows marked ``last`` (the torch recipe, which forks worker processes) run
    their rounds after all the others: after a fork, every page the parent
    shares with a child is copied on the parent's next write to it, a cost
    that would land on whichever rows ran next.
    """
    firsts: dict[str, np.ndarray] = {}
    headroom = []
    for phase in (False, True):
        for rep in range(repeats):
            if not phase:
                headroom.append(parallel_headroom())
            for row in rows:
                if row.last != phase:
                    continue
                _run_once(row, rep, firsts)
    for row in rows:
        if row.check is not None and row.key in firsts:
            same = np.array_equal(firsts[row.key], firsts[row.check])
            assert same, f"{row.label}: first batch differs from {row.check}'s"
    return headroom


def measure_all(rows: list[Row], repeats: int) -> tuple[float, list[float], float]:
    """:func:`measure`, then close the kept-open loaders: (load average at the start,
    the headroom per round, seconds taken)."""
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        headroom = measure(rows, repeats)
    finally:
        close_sessions()
    return load0, headroom, time.perf_counter() - t0


def _run_once(row: Row, rep: int, firsts: dict[str, np.ndarray]) -> None:
    if row.run is None:
        return
    t0 = time.perf_counter()
    count, first = row.run()
    dt = time.perf_counter() - t0
    row.rates.append(count / dt)
    if rep == 0:
        firsts[row.key] = first
    settle = getattr(row.run, "settle", None)
    if settle is not None:
        settle()  # untimed: the loader's prefetch ends before the next row starts


def ratio(rows: list[Row], row: Row) -> float | None:
    if row.baseline is None or row.run is None:
        return None
    base = next(r for r in rows if r.key == row.baseline)
    return row.median / base.median


def markdown(rows: list[Row]) -> str:
    by_key = {r.key: r for r in rows}
    lines = [
        "| row | img/s (median) | ratio | to | target | result |",
        "| --- | ---: | ---: | --- | ---: | --- |",
    ]
    for row in rows:
        r = ratio(rows, row)
        if row.run is None:
            lines.append(f"| {row.label} | — | — | — | — | {row.note} |")
            continue
        base = by_key[row.baseline].label if row.baseline else "—"
        target = f"≥ {row.target:.2f}×" if row.target is not None else ""
        verdict = ""
        if row.target is not None and r is not None:
            verdict = "PASS" if r >= row.target else f"FAIL ({r / row.target:.0%} of target)"
        ratio_s = f"{r:.2f}×" if r is not None else "—"
        lines.append(
            f"| {row.label} | {row.median:,.0f} | {ratio_s} | {base} | {target} | {verdict} |"
        )
    return "\n".join(lines)


def sweep_markdown(rows: list[Row], sweep: list[int]) -> str:
    by_key = {r.key: r for r in rows}
    lines = [
        "| workers | float32 raw img/s | vs plain loop | JPEG img/s | vs OpenCV loop |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for w in sweep:
        raw = by_key[f"bp_f32_w{w}"]
        jpg = by_key[f"bp_jpeg_w{w}"]
        lines.append(
            f"| {w} | {raw.median:,.0f} | {ratio(rows, raw):.2f}× "
            f"| {jpg.median:,.0f} | {ratio(rows, jpg):.2f}× |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--records", type=int, default=20_480, help="raw records (default 20480)")
    ap.add_argument("--jpeg-records", type=int, default=10_000, help="JPEG records (default 10000)")
    ap.add_argument("--repeats", type=int, default=5, help="passes per row; medians reported")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="the workers sweep")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one pass: a smoke test")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write every sample to OUT")
    ap.add_argument("--data-dir", type=Path, help="LMDB cache (default bench/_data)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")
    args = ap.parse_args(argv)
    if args.quick:
        args.records, args.jpeg_records, args.repeats = 1024, 256, 1
    if args.records < BATCH or args.jpeg_records < BATCH or args.repeats < 1:
        ap.error(f"--records and --jpeg-records must be >= {BATCH}, --repeats >= 1")
    tv = None if args.no_torch else torch_version()
    torch_skip = None
    if args.no_torch:
        torch_skip = "skipped: --no-torch"
    elif tv is None:
        torch_skip = "skipped: torch is not installed (pip install torch)"

    t0 = time.perf_counter()
    raw, wrote_raw = cached_db("raw", args.records, SHAPE, args.data_dir)
    jpeg, wrote_jpeg = cached_db("jpeg", args.jpeg_records, SHAPE, args.data_dir)
    setup = time.perf_counter() - t0
    rows = build_rows(
        raw,
        jpeg,
        args.records,
        args.jpeg_records,
        args.workers,
        torch_skip,
        baseline_copy(raw),
        baseline_copy(jpeg),
    )
    load0, headroom, elapsed = measure_all(rows, args.repeats)

    cpus = os.cpu_count() or 1
    print(
        f"blobpipe.Loader, {'×'.join(map(str, SHAPE))} uint8 Datums, batch {BATCH}, "
        f"scale 1/256, device cpu; median of {args.repeats} interleaved passes; "
        f"{args.records // BATCH * BATCH} raw / {args.jpeg_records // BATCH * BATCH} JPEG "
        f"records per pass"
    )
    print(
        f"{cpus} CPU cores (ceilings: one thread, one bulk call; the issue's definition); "
        f"load average {load0:.2f} at start; python {platform.python_version()}, "
        f"numpy {np.__version__}, opencv {cv2.__version__}, "
        f"torch {tv or '(rows skipped)'}"
    )
    print(
        f"parallel headroom: a GIL-free workload ran {statistics.median(headroom):.2f}× faster "
        f"on 2 threads than on 1 (median of rounds {', '.join(f'{h:.2f}' for h in headroom)}; "
        "2.00× = two idle cores)"
    )
    print(
        f"LMDBs: {raw} ({'written' if wrote_raw else 'cached'}), "
        f"{jpeg} ({'written' if wrote_jpeg else 'cached'}), {setup:.1f} s; "
        f"measured in {elapsed:.1f} s\n"
    )
    print(markdown(rows))
    print()
    print(f"workers sweep (blobpipe async, float32, scale 1/256; {cpus} cores):\n")
    print(sweep_markdown(rows, sorted(set(args.workers))))

    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "shape": SHAPE,
            "batch": BATCH,
            "records": args.records // BATCH * BATCH,
            "jpeg_records": args.jpeg_records // BATCH * BATCH,
            "repeats": args.repeats,
            "cpus": cpus,
            "loadavg_start": load0,
            "parallel_headroom_2_threads": headroom,
            "versions": {
                "python": platform.python_version(),
                "numpy": np.__version__,
                "opencv": cv2.__version__,
                "torch": tv,
            },
            "rows": [
                {
                    "key": r.key,
                    "label": r.label,
                    "group": r.group,
                    "img_per_s": r.rates,
                    "median": r.median if r.rates else None,
                    "baseline": r.baseline,
                    "ratio": ratio(rows, r),
                    "target": r.target,
                    "passed": (
                        None
                        if r.target is None or r.run is None
                        else bool((ratio(rows, r) or 0.0) >= r.target)
                    ),
                    "note": r.note,
                }
                for r in rows
            ],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
