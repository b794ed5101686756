"""The contenders of the workload benchmark: each turns one workload into batches.

Every contender offers two measurements, both returning a :class:`Sample`:

* ``first()``: a first epoch: open, one full pass, close (what a short job, an
  evaluation, or the first epoch of training pays). The plain loop, the torch recipe and
  the Loader run it in a fresh Python process (``python _make.py SPEC``), its
  libraries imported before the clock starts: nothing an earlier pass left in the
  process (pooled batch memory, started threads, one-time checks, warm caches) helps
  it, as nothing helps a job's first epoch;
* ``later(epochs=1)``: later epochs of a pipeline kept open across epochs (opened by
  ``start()``, its own first epoch untimed), ``epochs`` of them back to back, timed
  together. For the pipelines that work in the background (blobpipe, torch workers,
  DALI) one call runs one more epoch first, untimed, and the timing starts at its
  end: the pipeline meets the timed epochs exactly as it would in training, whatever
  it prefetched (or not) across the boundary, and nothing it did while the benchmark
  ran other contenders is counted. Several epochs a pass make a small database's
  pass long enough to measure (the sweep).

Contenders (``Recipe`` says what each record goes through, Caffe's ``DataTransformer``):

* :class:`PlainLoop`: the ten lines a user writes, one thread: py-lmdb (a cursor in
  key order; ``txn.get`` over a new permutation of the keys per epoch when the
  workload shuffles), a fresh ``Datum`` per record, ``np.frombuffer`` (or
  ``cv2.imdecode(..., cv2.IMREAD_COLOR)`` and a transpose to CHW for JPEG), a slice
  for the crop, ``[..., ::-1]`` for the mirror, one assignment into a preallocated
  float32 batch; a mean *value* is subtracted and the scale applied once per batch.
  A mean *file* is taken at the crop's position and mirrored with it (Caffe's
  arithmetic), so it is subtracted in the assignment itself,
  ``np.subtract(crop, mean_crop, out=row)``: one fused pass, the fastest plain form.
  Crop offsets and flips are drawn once per batch with NumPy.
* :class:`TorchRecipe`: PyTorch's usual LMDB recipe: a map-style Dataset opening its
  LMDB environment lazily in each worker, the same per-record work (mean and scale
  per record, as a Dataset returns finished samples), ``DataLoader(num_workers=2,
  shuffle=<workload>)``, default collate; first epochs start a new DataLoader (its
  worker processes), later epochs use ``persistent_workers=True``.
* :class:`LoaderAsync` / :class:`LoaderBlocking`: ``blobpipe.Loader(..., device="cpu",
  workers=2, mode="epoch")`` consumed with ``async for`` on an anyio event loop (a
  thread of its own, like a training script's loop) or with ``with``/``for``.
* :class:`Memcpy`: one ``np.copyto`` of all the records' pixel bytes between two
  preallocated (touched) arrays: the bound for a pass-through.
* :class:`DecodeOnly`: ``cv2.imdecode`` of every JPEG file, one thread, from memory:
  how much of a JPEG loop is the decoder alone.

Only blobpipe's public API makes the batches. The plain loop and the torch recipe need
Caffe's ``Datum`` message: a user imports their own ``caffe_pb2`` (generated from Caffe's
``caffe.proto``); here the same message (the fields and numbers of ``caffe.proto``) is
declared at run time through ``google.protobuf``. The one private import is the
benchmark's own instrument: every pass timed in this process is timed inside
``blobpipe._io._budget.measure``, which also splits its CPU time into GIL-free work and
the rest (:attr:`Sample.budget`: the GIL budget).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import mmap
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.from_thread
import cv2
import lmdb
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

import blobpipe
from blobpipe._io._budget import Budget, measure

__all__ = [
    "AsyncHost",
    "BatchesLoop",
    "Contender",
    "Datum",
    "DecodeOnly",
    "Files",
    "LoaderAsync",
    "LoaderBlocking",
    "Memcpy",
    "PlainLoop",
    "Recipe",
    "Records",
    "Sample",
    "TorchRecipe",
    "check_against_transform",
    "close_shared_envs",
    "private_empty",
    "shared_env",
    "torch_version",
]

WORKERS = 2
#: MiB of huge pages each first epoch's fresh process touches and unmaps before its
#: clock (``_fresh.prefault``: a VM host's faults out of the fresh memory's cost; 0: none)
PREFAULT_MIB = 0


# -- the user's own caffe_pb2.Datum ----------------------------------------------------------


def _datum_class() -> Any:
    """Caffe's ``Datum`` message (caffe.proto: channels 1, height 2, width 3, data 4,
    label 5, float_data 6, encoded 7), as the user's own ``caffe_pb2.Datum`` would be."""
    F = descriptor_pb2.FieldDescriptorProto
    fields = (
        ("channels", 1, F.TYPE_INT32, F.LABEL_OPTIONAL),
        ("height", 2, F.TYPE_INT32, F.LABEL_OPTIONAL),
        ("width", 3, F.TYPE_INT32, F.LABEL_OPTIONAL),
        ("data", 4, F.TYPE_BYTES, F.LABEL_OPTIONAL),
        ("label", 5, F.TYPE_INT32, F.LABEL_OPTIONAL),
        ("float_data", 6, F.TYPE_FLOAT, F.LABEL_REPEATED),
        ("encoded", 7, F.TYPE_BOOL, F.LABEL_OPTIONAL),
    )
    file = descriptor_pb2.FileDescriptorProto(
        name="bench_user_caffe.proto", package="bench_user_caffe", syntax="proto2"
    )
    msg = file.message_type.add(name="Datum")
    for name, number, type_, label in fields:
        msg.field.add(name=name, number=number, type=type_, label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench_user_caffe.Datum"))


Datum = _datum_class()


# -- what the workloads ask ------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """Caffe's data layer for one workload: ``(x - mean) * scale``, crop, mirror, order."""

    batch: int
    phase: Literal["train", "test"]
    shuffle: bool = False
    crop: int = 0
    mirror: bool = False
    mean_file: Path | None = None
    mean_value: tuple[float, ...] = ()
    scale: float = 1.0
    dtype: Literal["float32", "uint8"] = "float32"
    encoded: bool = False
    layout: Literal["NCHW", "NHWC"] = "NCHW"

    @property
    def deterministic(self) -> bool:
        """Whether two contenders must produce the same first batch (no random choice)."""
        return not self.mirror and not self.shuffle and (self.crop == 0 or self.phase == "test")

    def transform(self) -> blobpipe.Transform:
        return blobpipe.Transform(
            scale=self.scale,
            mirror=self.mirror,
            crop_size=self.crop,
            mean_file=self.mean_file,
            mean_value=self.mean_value,
            dtype=self.dtype,
            layout=self.layout,
        )

    def out_shape(self, channels: int, height: int, width: int) -> tuple[int, int, int]:
        h, w = (self.crop, self.crop) if self.crop else (height, width)
        return (h, w, channels) if self.layout == "NHWC" else (channels, h, w)

    def to_doc(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["mean_file"] = None if self.mean_file is None else str(self.mean_file)
        doc["mean_value"] = list(self.mean_value)
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Recipe:
        mean_file = None if doc["mean_file"] is None else Path(doc["mean_file"])
        return cls(**{**doc, "mean_file": mean_file, "mean_value": tuple(doc["mean_value"])})


@dataclass(frozen=True)
class Files:
    """The byte-identical copies of one database (see ``_workloads_data.py`` for why):
    ``loader`` for the kept-open Loaders, ``first`` for every first epoch and the torch
    workers (nothing holds it between passes), ``plain`` for the plain loop kept open and
    for loading the ceilings' bytes."""

    loader: Path
    first: Path
    plain: Path


@dataclass
class Sample:
    """One timed pass: ``images`` delivered in ``seconds``; the first batch when asked."""

    images: int
    seconds: float
    first_batch: np.ndarray | None = None
    #: the pass's CPU time, GIL-free and not (passes timed in this process), and the
    #: epochs it covers: the timed ones, and for a pipeline the untimed one before them
    #: (what its ring prefetched before the clock started is filled in that one, so
    #: the budget leaves out only what was prefetched before it)
    budget: Budget | None = None
    budget_epochs: int = 0


def timed(
    epoch: Callable[[bool], tuple[int, np.ndarray | None]], keep: bool, epochs: int
) -> Sample:
    """``epochs`` passes of ``epoch(keep)`` back to back, timed together (the first
    pass's first batch kept when ``keep``)."""
    with measure() as budget:
        images, first = epoch(keep)
        for _ in range(epochs - 1):
            images += epoch(False)[0]
    return Sample(images, budget.wall, first, budget, epochs)


class Contender:
    """A way to turn a workload into batches (see the module docstring)."""

    key = ""
    label = ""
    #: measured in rounds of its own, after the others (it forks worker processes)
    forks = False
    #: why it does not run (None: it runs)
    skipped: str | None = None
    #: first epochs run in a fresh process (set for the contenders ``_make.make`` builds)
    fresh_first = False
    out_shape: tuple[int, int, int] = (0, 0, 0)  # one output row
    files: Files
    recipe: Recipe

    def start(self) -> None:
        """Open what ``later()`` keeps open, and run its first epoch (untimed)."""

    def first(self, keep: bool = False) -> Sample:
        """A first epoch; ``keep``: return a copy of its first batch."""
        if self.fresh_first:
            return _first_in_fresh_process(self, keep)
        return self.first_here(keep)

    def first_here(self, keep: bool = False) -> Sample:
        """A first epoch in this process."""
        raise NotImplementedError

    def later(self, keep: bool = False, epochs: int = 1) -> Sample:
        """``epochs`` later epochs back to back, timed together (see the module docstring)."""
        raise NotImplementedError

    def close(self) -> None:
        """Close what ``start()`` opened."""


def private_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed (touched: no page fault is timed) array in anonymous memory that child
    processes do not inherit: pages shared with a forked worker would be copied on the
    next write, charging a bulk copy one page fault per 4 KiB after every fork."""
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))
    if hasattr(mmap, "MADV_DONTFORK"):
        buf.madvise(mmap.MADV_DONTFORK)
    arr = np.frombuffer(buf, dtype, count=count).reshape(shape)
    arr.fill(0)
    return arr


def _open_env(path: Path) -> Any:
    return lmdb.open(str(path), readonly=True, lock=False, readahead=False, max_readers=16)


_ENVS: dict[Path, Any] = {}


def shared_env(path: Path) -> Any:
    """One environment per file for the whole run (LMDB opens a file once per process):
    the plain loops of workloads on one database share it."""
    env = _ENVS.get(path)
    if env is None:
        env = _ENVS[path] = _open_env(path)
    return env


def close_shared_envs() -> None:
    while _ENVS:
        _ENVS.popitem()[1].close()


def _list_keys(env: Any) -> list[bytes]:
    with env.begin() as txn:
        return list(txn.cursor().iternext(keys=True, values=False))


# -- the plain loop and the torch recipe: the same per-record work ----------------------------


# three uniforms in [0, 1): the crop's row and column offsets, the flip
Draw = tuple[float, float, float]


class Records:
    """The per-record work of the torch recipe (the plain loop writes it inline): a
    Datum's pixels as CHW uint8, Caffe's crop, mirror and mean-file subtraction into one
    output row, then the mean value and the scale."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.mean: np.ndarray | None = None
        if recipe.mean_file is not None:
            mean = blobpipe.read_blobproto(recipe.mean_file)
            try:
                arr = np.array(mean.cpu_data(), np.float32)
            finally:
                mean.close()
            self.mean = arr.reshape(arr.shape[-3:])
        self.mean_col = (
            np.asarray(recipe.mean_value, np.float32).reshape(
                -1 if recipe.layout == "NHWC" else (-1, 1, 1)
            )
            if recipe.mean_value
            else None
        )
        self.scale = np.float32(recipe.scale)

    def pixels(self, value: bytes) -> tuple[np.ndarray, int]:
        d = Datum.FromString(value)
        if d.encoded:
            img = cv2.imdecode(np.frombuffer(d.data, np.uint8), cv2.IMREAD_COLOR)
            return img.transpose(2, 0, 1), d.label
        return np.frombuffer(d.data, np.uint8).reshape(d.channels, d.height, d.width), d.label

    def choices(self, shape: tuple[int, ...], u: Draw) -> tuple[int, int, bool]:
        """Caffe's crop offset (random from ``u``'s first two uniforms in TRAIN, centred in
        TEST) and flip (when mirroring and ``u[2] < 0.5``) for a record of ``shape``."""
        r = self.recipe
        h0 = w0 = 0
        if r.crop:
            _, h, w = shape
            if r.phase == "train":
                h0, w0 = int(u[0] * (h - r.crop + 1)), int(u[1] * (w - r.crop + 1))
            else:
                h0, w0 = (h - r.crop) // 2, (w - r.crop) // 2
        return h0, w0, r.mirror and u[2] < 0.5

    def place(self, chw: np.ndarray, row: np.ndarray, u: Draw) -> None:
        """Crop and mirror (see :meth:`choices`) and subtract the mean file at the crop,
        into ``row``: one assignment (or one fused subtraction)."""
        c = self.recipe.crop
        mean = self.mean
        h0, w0, flip = self.choices(chw.shape, u)
        if c:
            chw = chw[:, h0 : h0 + c, w0 : w0 + c]
            if mean is not None:
                mean = mean[:, h0 : h0 + c, w0 : w0 + c]
        if flip:
            chw = chw[..., ::-1]
            if mean is not None:
                mean = mean[..., ::-1]
        if self.recipe.layout == "NHWC":
            chw = chw.transpose(1, 2, 0)
            if mean is not None:
                mean = mean.transpose(1, 2, 0)
        if mean is not None:
            np.subtract(chw, mean, out=row)
        else:
            row[...] = chw

    def finish(self, rows: np.ndarray) -> None:
        """The mean value and the scale, on one row or a whole batch at once."""
        if self.mean_col is not None:
            rows -= self.mean_col
        if self.recipe.scale != 1.0:
            rows *= self.scale


def check_against_transform(
    recipe: Recipe, db: Path, fill: Callable[[list[bytes], list[Draw]], Sequence[np.ndarray]]
) -> float:
    """The largest difference between the rows ``fill(values, draws)`` makes of the first
    records of ``db`` and what ``blobpipe.Transform`` makes of them given the same crop
    offsets and flips (``params=``): a contender computes what Caffe computes."""
    rec = Records(recipe)
    transform = recipe.transform()
    with shared_env(db).begin() as txn:
        values = [bytes(v) for v in itertools.islice(txn.cursor().iternext(keys=False), 16)]
    rng = np.random.default_rng(1)
    draws: list[Draw] = [(0.0, 0.0, 0.0), (1 - 1e-9, 1 - 1e-9, 1 - 1e-9)]
    draws += [tuple(u) for u in rng.random((len(values) - 2, 3)).tolist()]  # type: ignore[misc]
    rows = fill(values, draws)
    worst = 0.0
    for value, u, mine in zip(values, draws, rows, strict=True):
        chw, _ = rec.pixels(value)
        h0, w0, flip = rec.choices(chw.shape, u)
        theirs = np.empty(recipe.out_shape(*chw.shape), recipe.dtype)
        params = blobpipe.RecordParams(h_off=h0, w_off=w0, mirror=flip)
        transform.apply_into(chw, theirs, phase=recipe.phase, params=params)
        diff = np.abs(mine.astype(np.float64) - theirs.astype(np.float64))
        worst = max(worst, float(diff.max()))
    return worst


class PlainLoop(Contender):
    """One thread, the ten lines a user writes (see the module docstring)."""

    key = "plain"
    label = "plain loop (1 thread)"

    def __init__(self, files: Files, recipe: Recipe, out_shape: tuple[int, int, int]) -> None:
        self.files = files
        self.recipe = recipe
        self.records = Records(recipe)
        self.data = np.zeros((recipe.batch, *out_shape), recipe.dtype)
        self.labels = np.zeros(recipe.batch, np.float32)
        self.rng = np.random.default_rng(0)
        self.env: Any = None
        self.keys: list[bytes] | None = None

    def _epoch(
        self, env: Any, keys: list[bytes] | None, keep: bool
    ) -> tuple[int, np.ndarray | None]:
        """One pass: over ``keys`` in a new random order, or (None) with a cursor."""
        r, rec, rng = self.recipe, self.records, self.rng
        data = self.data
        n = env.stat()["entries"] if keys is None else len(keys)
        random_draws = r.mirror or (r.crop and r.phase == "train")
        first = None
        with env.begin() as txn:
            if keys is not None:
                values: Iterator[bytes] = map(txn.get, [keys[i] for i in rng.permutation(n)])
            else:
                values = txn.cursor().iternext(keys=False, values=True)
            for b0 in range(0, n, r.batch):
                m = min(r.batch, n - b0)
                draws = rng.random((m, 3)).tolist() if random_draws else [(0.5, 0.5, 1.0)] * m
                self._fill(values, draws)
                batch = data[:m]
                if rec.mean_col is not None:
                    batch -= rec.mean_col
                if r.scale != 1.0:
                    batch *= rec.scale
                if keep and first is None:
                    first = batch.copy()
        return n, first

    def _fill(self, values: Iterator[bytes], draws: list[Draw]) -> None:
        """Rows ``0..len(draws)`` of the batch from the next records: the loop as a user
        writes it, inline (no call per record but the library's)."""
        r = self.recipe
        data, labels, mean = self.data, self.labels, self.records.mean
        crop, train, mirror, encoded = r.crop, r.phase == "train", r.mirror, r.encoded
        hwc = r.layout == "NHWC"
        from_string, frombuffer, subtract = Datum.FromString, np.frombuffer, np.subtract
        for i, u in enumerate(draws):
            d = from_string(next(values))
            if encoded:
                img = cv2.imdecode(frombuffer(d.data, np.uint8), cv2.IMREAD_COLOR)
                chw = img.transpose(2, 0, 1)
            else:
                chw = frombuffer(d.data, np.uint8).reshape(d.channels, d.height, d.width)
            m = mean
            if crop:
                _, h, w = chw.shape
                if train:
                    h0, w0 = int(u[0] * (h - crop + 1)), int(u[1] * (w - crop + 1))
                else:
                    h0, w0 = (h - crop) // 2, (w - crop) // 2
                chw = chw[:, h0 : h0 + crop, w0 : w0 + crop]
                if m is not None:
                    m = m[:, h0 : h0 + crop, w0 : w0 + crop]
            if mirror and u[2] < 0.5:
                chw = chw[..., ::-1]
                if m is not None:
                    m = m[..., ::-1]
            if hwc:
                chw = chw.transpose(1, 2, 0)
                if m is not None:
                    m = m.transpose(1, 2, 0)
            if m is None:
                data[i] = chw
            else:
                subtract(chw, m, out=data[i])
            labels[i] = d.label

    def rows_of(self, values: list[bytes], draws: list[Draw]) -> np.ndarray:
        """What the loop makes of ``values`` with ``draws`` (for a check: not timed)."""
        out = []
        for lo in range(0, len(values), self.recipe.batch):
            part = draws[lo : lo + self.recipe.batch]
            self._fill(iter(values[lo : lo + len(part)]), part)
            batch = self.data[: len(part)].copy()
            self.records.finish(batch)
            out.append(batch)
        return np.concatenate(out)

    def first_here(self, keep: bool = False) -> Sample:
        t0 = time.perf_counter()
        env = _open_env(self.files.first)
        try:
            keys = _list_keys(env) if self.recipe.shuffle else None
            images, batch = self._epoch(env, keys, keep)
        finally:
            env.close()
        return Sample(images, time.perf_counter() - t0, batch)

    def start(self) -> None:
        self.env = shared_env(self.files.plain)
        self.keys = _list_keys(self.env) if self.recipe.shuffle else None
        self._epoch(self.env, self.keys, False)

    def later(self, keep: bool = False, epochs: int = 1) -> Sample:
        return timed(lambda k: self._epoch(self.env, self.keys, k), keep, epochs)

    def close(self) -> None:
        self.env = None  # shared: see close_shared_envs


def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


class LmdbDataset:
    """PyTorch's usual map-style LMDB Dataset: the environment opened lazily, once in
    each worker process; each item a finished float32 CHW tensor and its label."""

    def __init__(self, path: Path, keys: list[bytes], recipe: Recipe) -> None:
        self.path = path
        self.keys = keys
        self.records = Records(recipe)
        self.env: Any = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch

        if self.env is None:
            self.env = _open_env(self.path)
        with self.env.begin() as txn:
            value = txn.get(self.keys[i])
        out, label = self.sample(value, (random.random(), random.random(), random.random()))
        return torch.from_numpy(out), label

    def rows_of(self, values: list[bytes], draws: list[Draw]) -> list[np.ndarray]:
        """What :meth:`sample` makes of ``values`` with ``draws`` (for a check)."""
        return [self.sample(v, u)[0] for v, u in zip(values, draws, strict=True)]

    def sample(self, value: bytes, u: Draw) -> tuple[np.ndarray, int]:
        """One record's finished CHW array (crop and flip from ``u``) and its label."""
        rec = self.records
        chw, label = rec.pixels(value)
        out = np.empty(rec.recipe.out_shape(*chw.shape), rec.recipe.dtype)
        rec.place(chw, out, u)
        rec.finish(out)
        return out, label


class TorchRecipe(Contender):
    """``torch.utils.data.DataLoader`` over :class:`LmdbDataset`, ``num_workers=2``."""

    key = "torch"
    label = f"torch DataLoader ({WORKERS} workers)"
    forks = True

    def __init__(self, files: Files, recipe: Recipe) -> None:
        self.files = files
        self.recipe = recipe
        self.kept: Any = None
        if torch_version() is None:
            self.skipped = "skipped (torch not installed)"

    def _loader(self, keys: list[bytes], persistent: bool) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(
            LmdbDataset(self.files.first, keys, self.recipe),  # type: ignore[arg-type]
            batch_size=self.recipe.batch,
            shuffle=self.recipe.shuffle,
            num_workers=WORKERS,
            persistent_workers=persistent,
        )

    @staticmethod
    def _epoch(loader: Any, keep: bool) -> tuple[int, np.ndarray | None]:
        images = 0
        first = None
        for data, _label in loader:
            if keep and first is None:
                first = data.numpy().copy()
            images += len(data)
        return images, first

    def first_here(self, keep: bool = False) -> Sample:
        t0 = time.perf_counter()
        env = _open_env(self.files.first)
        try:
            keys = _list_keys(env)
        finally:
            env.close()
        images, batch = self._epoch(self._loader(keys, persistent=False), keep)
        return Sample(images, time.perf_counter() - t0, batch)

    def start(self) -> None:
        env = _open_env(self.files.first)
        try:
            keys = _list_keys(env)
        finally:
            env.close()
        self.kept = self._loader(keys, persistent=True)
        self._epoch(self.kept, False)

    def later(self, keep: bool = False, epochs: int = 1) -> Sample:
        self._epoch(self.kept, False)
        return timed(lambda k: self._epoch(self.kept, k), keep, epochs)

    def close(self) -> None:
        self.kept = None  # its workers end with it


# -- blobpipe --------------------------------------------------------------------------------


class AsyncHost:
    """An anyio event loop on a thread of its own, where the async contenders run (a
    training script's loop); the benchmark's thread waits for each pass."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.portal = self._stack.enter_context(anyio.from_thread.start_blocking_portal())

    def close(self) -> None:
        self._stack.close()


def _make_loader(db: Path, recipe: Recipe, workers: int = WORKERS) -> blobpipe.Loader:
    return blobpipe.Loader(
        db,
        batch_size=recipe.batch,
        device="cpu",
        transform=recipe.transform(),
        phase=recipe.phase,
        order="shuffle" if recipe.shuffle else "key",
        workers=workers,
        mode="epoch",
    )


async def _consume_async(loader: blobpipe.Loader, keep: bool) -> tuple[int, np.ndarray | None]:
    images = 0
    first = None
    async for batch in loader:
        data = batch.data.cpu_data()
        if keep and first is None:
            first = np.array(data)
        images += len(batch)
    return images, first


def _consume(loader: blobpipe.Loader, keep: bool) -> tuple[int, np.ndarray | None]:
    images = 0
    first = None
    for batch in loader:
        data = batch.data.cpu_data()
        if keep and first is None:
            first = np.array(data)
        images += len(batch)
    return images, first


class BatchesLoop(Contender):
    """``blobpipe.Batches`` driven by hand in one thread: ``next_plan`` and ``fill`` into
    one preallocated array per shape, no Loader, no other thread. Not a target: it
    shows what the batch work costs without a pipeline's thread hand-offs."""

    key = "batches"
    label = "Batches, one thread (no pipeline)"

    def __init__(self, files: Files, recipe: Recipe) -> None:
        self.files = files
        self.recipe = recipe
        self.batches: blobpipe.Batches | None = None

    def _open(self, db: Path) -> blobpipe.Batches:
        r = self.recipe
        order = "shuffle" if r.shuffle else "key"
        return blobpipe.Batches(
            db, r.batch, transform=r.transform(), phase=r.phase, order=order, mode="epoch"
        )

    @staticmethod
    def _epoch(batches: blobpipe.Batches, keep: bool) -> tuple[int, np.ndarray | None]:
        images = 0
        first = None
        data: np.ndarray | None = None
        label = np.empty(batches.batch_size, np.float32)
        while (plan := batches.next_plan()) is not None:
            if data is None or data.shape != plan.data_shape:
                data = np.empty(plan.data_shape, plan.dtype)
            batches.fill(plan, data, label[: len(plan)])
            if keep and first is None:
                first = data.copy()
            images += len(plan)
        return images, first

    def first_here(self, keep: bool = False) -> Sample:
        t0 = time.perf_counter()
        with self._open(self.files.first) as batches:
            images, batch = self._epoch(batches, keep)
        return Sample(images, time.perf_counter() - t0, batch)

    def start(self) -> None:
        self.batches = self._open(self.files.loader)
        self._epoch(self.batches, False)

    def later(self, keep: bool = False, epochs: int = 1) -> Sample:
        batches = self.batches
        assert batches is not None
        return timed(lambda k: self._epoch(batches, k), keep, epochs)

    def close(self) -> None:
        if self.batches is not None:
            self.batches.close()
            self.batches = None


class LoaderAsync(Contender):
    """``async with blobpipe.Loader(...)`` / ``async for``, on the :class:`AsyncHost`; a
    first epoch without one (``host`` None: a fresh process's) in an event loop of the
    calling thread (``anyio.run``), as a training script's ``asyncio.run(main())``."""

    key = "async"
    label = f"Loader, async for ({WORKERS} workers)"

    def __init__(self, files: Files, recipe: Recipe, host: AsyncHost | None) -> None:
        self.files = files
        self.recipe = recipe
        self.host = host
        self.kept: Any = None
        self.loader: blobpipe.Loader | None = None

    async def _first(self, keep: bool) -> Sample:
        t0 = time.perf_counter()
        async with _make_loader(self.files.first, self.recipe) as loader:
            images, batch = await _consume_async(loader, keep)
        return Sample(images, time.perf_counter() - t0, batch)

    async def _later(self, keep: bool, epochs: int) -> Sample:
        assert self.loader is not None
        with measure() as budget:
            await _consume_async(self.loader, False)
            t0 = time.perf_counter()
            images, batch = await _consume_async(self.loader, keep)
            for _ in range(epochs - 1):
                images += (await _consume_async(self.loader, False))[0]
            seconds = time.perf_counter() - t0
        return Sample(images, seconds, batch, budget, epochs + 1)

    def first_here(self, keep: bool = False) -> Sample:
        sample: Sample
        if self.host is None:
            sample = anyio.run(self._first, keep)
        else:
            sample = self.host.portal.call(self._first, keep)
        return sample

    def _portal(self) -> Any:
        assert self.host is not None, "later epochs run on an AsyncHost"
        return self.host.portal

    def start(self) -> None:
        loader = _make_loader(self.files.loader, self.recipe)
        self.kept = self._portal().wrap_async_context_manager(loader)
        self.loader = self.kept.__enter__()
        self._portal().call(_consume_async, self.loader, False)

    def later(self, keep: bool = False, epochs: int = 1) -> Sample:
        sample: Sample = self._portal().call(self._later, keep, epochs)
        return sample

    def close(self) -> None:
        if self.kept is not None:
            self.kept.__exit__(None, None, None)
            self.kept = self.loader = None


class LoaderBlocking(Contender):
    """``with blobpipe.Loader(...)`` / ``for``: the blocking form, on the caller's thread."""

    key = "blocking"
    label = f"Loader, blocking for ({WORKERS} workers)"

    def __init__(
        self, files: Files, recipe: Recipe, workers: int = WORKERS, again: bool = False
    ) -> None:
        self.files = files
        self.recipe = recipe
        self.workers = workers
        self.loader: blobpipe.Loader | None = None
        if workers != WORKERS:
            self.key = f"blocking{workers}"
            self.label = f"Loader, blocking for ({workers} worker{'s' if workers > 1 else ''})"
        if again:  # the same contender a second time: its ratio to the first is the noise
            self.key = "again"
            self.label = f"Loader, blocking for ({workers} workers), again (A/A control)"

    def first_here(self, keep: bool = False) -> Sample:
        t0 = time.perf_counter()
        with _make_loader(self.files.first, self.recipe, self.workers) as loader:
            images, batch = _consume(loader, keep)
        return Sample(images, time.perf_counter() - t0, batch)

    def start(self) -> None:
        self.loader = _make_loader(self.files.loader, self.recipe, self.workers)
        self.loader.__enter__()
        _consume(self.loader, False)

    def later(self, keep: bool = False, epochs: int = 1) -> Sample:
        loader = self.loader
        assert loader is not None
        with measure() as budget:
            _consume(loader, False)
            sample = timed(lambda k: _consume(loader, k), keep, epochs)
        return dataclasses.replace(sample, budget=budget, budget_epochs=epochs + 1)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader = None


# -- ceilings --------------------------------------------------------------------------------


def _read_all(db: Path, take: Callable[[Any], Any]) -> list[Any]:
    with shared_env(db).begin() as txn:
        return [take(Datum.FromString(v)) for v in txn.cursor().iternext(keys=False)]


class Memcpy(Contender):
    """One ``np.copyto`` of every record's pixel bytes (in key order, loaded beforehand)
    into a preallocated, touched array of the same size; a first epoch is the same copy."""

    key = "memcpy"
    label = "memcpy (one np.copyto)"

    def __init__(self, files: Files, recipe: Recipe) -> None:
        datums = _read_all(files.plain, lambda d: (d.data, (d.channels, d.height, d.width)))
        shape = datums[0][1]
        self.src = private_empty((len(datums), *shape), np.uint8)
        for i, (data, _) in enumerate(datums):
            self.src[i] = np.frombuffer(data, np.uint8).reshape(shape)
        self.dst = private_empty(self.src.shape, np.uint8)
        self.batch = recipe.batch

    def start(self) -> None:
        np.copyto(self.dst, self.src)

    def first_here(self, keep: bool = False) -> Sample:
        return self.later(keep)

    def later(self, keep: bool = False, epochs: int = 1) -> Sample:
        return timed(self._copy, keep, epochs)

    def _copy(self, keep: bool) -> tuple[int, np.ndarray | None]:
        np.copyto(self.dst, self.src)
        return len(self.src), self.dst[: self.batch].copy() if keep else None


class DecodeOnly(Contender):
    """``cv2.imdecode(..., cv2.IMREAD_COLOR)`` of every JPEG file, held in memory, one
    thread: the decoder alone, without LMDB, Datum or transform; a first epoch is the same."""

    key = "decode"
    label = "cv2.imdecode only (1 thread)"

    def __init__(self, files: Files) -> None:
        self.files = [np.frombuffer(f, np.uint8) for f in _read_all(files.plain, lambda d: d.data)]

    def start(self) -> None:
        self.later()

    def first_here(self, keep: bool = False) -> Sample:
        return self.later(keep)

    def later(self, keep: bool = False, epochs: int = 1) -> Sample:
        return timed(self._decode, keep, epochs)

    def _decode(self, keep: bool) -> tuple[int, np.ndarray | None]:
        for f in self.files:
            cv2.imdecode(f, cv2.IMREAD_COLOR)
        return len(self.files), None


# -- first epochs in a fresh process ------------------------------------------------------------


def _first_in_fresh_process(contender: Contender, keep: bool) -> Sample:
    with tempfile.TemporaryDirectory() as tmp:
        batch = Path(tmp) / "first.npy"
        spec = {
            "key": contender.key,
            "files": {k: str(v) for k, v in dataclasses.asdict(contender.files).items()},
            "recipe": contender.recipe.to_doc(),
            "out_shape": list(contender.out_shape),
            "batch": str(batch) if keep else None,
            "prefault": PREFAULT_MIB,
        }
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("_make.py")), json.dumps(spec)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{contender.label}: the first epoch in a fresh process failed "
                f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        first = np.load(batch) if keep else None
    return Sample(int(result["images"]), float(result["seconds"]), first)
