"""NVIDIA DALI's CPU pipeline as a contender, set up to give exactly Caffe's output.

DALI is an optional extra (``pip install -e '.[bench-dali]'``: the ``nvidia-dali-cuda120``
wheel from PyPI, which runs on the CPU alone with ``device_id=None``); without it the
rows say so and are skipped.

The pipeline is what a DALI user writes for a Caffe LMDB, with the settings that make
its batches Caffe's (each checked against ``blobpipe.Transform`` given the same crop
offsets and flips: :meth:`DaliPipeline.rows_of` with ``check_against_transform``):

* ``fn.readers.caffe`` reads the records (``random_shuffle`` when the workload shuffles:
  DALI's own shuffle buffer; ``pad_last_batch`` so that an epoch is whole batches).
* A raw Datum comes out as uint8 labelled ``H×W×C`` while its bytes are Caffe's
  ``C×H×W``: ``fn.reshape(src_dims=[2, 0, 1], layout="CHW")`` relabels it, no copy.
* An encoded record is decoded by ``fn.decoders.image(output_type=types.BGR)`` (Caffe's
  OpenCV decode is BGR), or with ``roi=True`` by ``fn.decoders.image_crop``, which
  decodes only the crop window (libjpeg-turbo's partial decoding).
* Caffe's crop offset in TRAIN is ``Rand(side - crop + 1)``: an integer drawn from a
  uniform in [0, 1), given to DALI as the relative position ``offset / (side - crop)``
  (DALI places the window at ``pos × (side − crop)`` rounded); in TEST the centre,
  ``(side - crop) // 2``. The mirror is ``fn.random.coin_flip``.
* A mean *value* and the scale go to ``fn.crop_mirror_normalize`` (``std=1``,
  ``scale=``), which also crops, mirrors, transposes and converts in one pass.
* A mean *file* is cropped at the same offsets and mirrored with the image (Caffe
  subtracts the mean at the pixel's source position), then subtracted and scaled with
  DALI's arithmetic operators.

``num_threads`` is the Loader's worker count (2); CPU-only (``device_id=None``).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import time
from pathlib import Path
from typing import Any

import numpy as np
from _contenders import (
    WORKERS,
    Contender,
    Draw,
    Files,
    Recipe,
    Records,
    Sample,
    shared_env,
    timed,
)

__all__ = ["DaliPipeline", "dali_version"]

DIST = "nvidia-dali-cuda120"


def dali_version() -> str | None:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return None
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _graph(recipe: Recipe, db: Path, roi: bool, fed: bool) -> tuple[Any, Any]:
    """The pipeline's outputs (data, label); inside a ``pipeline_def``. ``fed``: the crop
    offsets and flips come from external sources named "h0", "w0", "flip" (for
    :meth:`DaliPipeline.rows_of`) instead of DALI's random generators."""
    from nvidia.dali import fn, math, types

    r = recipe
    records, labels = fn.readers.caffe(
        path=str(db),
        name="Reader",
        random_shuffle=r.shuffle and not fed,
        pad_last_batch=True,
    )
    if r.encoded:
        shape = fn.peek_image_shape(records)  # H, W, C
        height, width = shape[0], shape[1]
    else:
        records = fn.reshape(records, src_dims=[2, 0, 1], layout="CHW")
        shape = records.shape()  # C, H, W
        height, width = shape[1], shape[2]

    crop_args: dict[str, Any] = {}
    if r.crop:
        c = r.crop
        span_h, span_w = height - c, width - c
        if fed:
            h0 = fn.external_source(name="h0", dtype=types.INT32)
            w0 = fn.external_source(name="w0", dtype=types.INT32)
        elif r.phase == "train":
            h0 = math.min(math.floor(fn.random.uniform(range=[0.0, 1.0]) * (span_h + 1)), span_h)
            w0 = math.min(math.floor(fn.random.uniform(range=[0.0, 1.0]) * (span_w + 1)), span_w)
        else:
            h0, w0 = span_h // 2, span_w // 2
        # a window as tall as the image has the only position 0, whatever pos says
        crop_args = {
            "crop": (c, c),
            "crop_pos_y": h0 / math.max(span_h, 1),
            "crop_pos_x": w0 / math.max(span_w, 1),
        }
    flip: Any = 0
    if r.mirror:
        if fed:
            flip = fn.external_source(name="flip", dtype=types.INT32)
        else:
            flip = fn.random.coin_flip(probability=0.5)

    if r.encoded:
        if roi and crop_args:
            images = fn.decoders.image_crop(records, output_type=types.BGR, **crop_args)
            crop_args = {}
        else:
            images = fn.decoders.image(records, output_type=types.BGR)
        layout_in = "HWC"
    else:
        images = records
        layout_in = "CHW"

    out_dtype = types.FLOAT if r.dtype == "float32" else types.UINT8
    mean = Records(r).mean  # the mean file as (C, H, W) float32, or None
    if mean is None:
        trivial = not crop_args and not r.mirror and not r.mean_value and r.scale == 1.0
        if trivial and r.dtype == "uint8" and layout_in == r.layout[1:]:
            return images, labels
        data = fn.crop_mirror_normalize(
            images,
            dtype=out_dtype,
            output_layout=r.layout[1:],
            mirror=flip,
            mean=list(r.mean_value) or [0.0],
            std=[1.0],
            scale=r.scale,
            **crop_args,
        )
        return data, labels

    if layout_in == "HWC":
        images = fn.transpose(images, perm=[2, 0, 1], layout="CHW")
    means = types.Constant(mean, layout="CHW", device="cpu")
    if crop_args:
        images = fn.crop(images, **crop_args)
        means = fn.crop(means, **crop_args)
    if r.mirror:
        images = fn.flip(images, horizontal=flip)
        means = fn.flip(means, horizontal=flip)
    data = images - means  # uint8 - float32: float32, Caffe's (x - mean); no mean value with it
    if r.scale != 1.0:
        data = data * types.Constant(np.float32(r.scale))
    if r.layout == "NHWC":
        data = fn.transpose(data, perm=[1, 2, 0], layout="HWC")
    if r.dtype == "uint8":
        data = fn.cast(data, dtype=types.UINT8)
    return data, labels


def _build(recipe: Recipe, db: Path, roi: bool, fed: bool = False, batch: int | None = None) -> Any:
    from nvidia.dali import pipeline_def

    @pipeline_def(batch_size=batch or recipe.batch, num_threads=WORKERS, device_id=None, seed=12345)
    def pipe() -> tuple[Any, Any]:
        return _graph(recipe, db, roi, fed)

    p = pipe()
    p.build()
    return p


def _epoch(pipe: Any, keep: bool) -> tuple[int, np.ndarray | None]:
    """One epoch (whole batches: the reader pads the last); the images it holds."""
    size = int(pipe.epoch_size("Reader"))
    batch = pipe.max_batch_size
    first = None
    images = 0
    while images < size:
        data, _labels = pipe.run()
        if keep and first is None:
            first = np.array(data.as_tensor())
        images += min(batch, size - images)
    return images, first


class DaliPipeline(Contender):
    """DALI's CPU pipeline (see the module docstring); ``roi``: decode only the crop."""

    def __init__(self, files: Files, recipe: Recipe, roi: bool = False) -> None:
        self.files = files
        self.recipe = recipe
        self.roi = roi
        self.key = "dali-roi" if roi else "dali"
        self.label = f"DALI CPU{' ROI decode' if roi else ''} ({WORKERS} threads)"
        self.pipe: Any = None
        if dali_version() is None:
            self.skipped = "skipped (DALI not installed: pip install -e '.[bench-dali]')"
        elif roi and not (recipe.encoded and recipe.crop):
            self.skipped = "skipped (ROI decode: JPEG records with a crop only)"

    def rows_of(self, values: list[bytes], draws: list[Draw]) -> list[np.ndarray]:
        """What the pipeline makes of the first ``len(values)`` records of
        ``files.plain`` (which must be ``values``, in key order) with the crop offsets and
        flips ``draws`` give in Caffe's arithmetic (for ``check_against_transform``)."""
        rec = Records(self.recipe)
        with shared_env(self.files.plain).begin() as txn:
            records = txn.cursor().iternext(keys=False)
            head = [bytes(v) for v in itertools.islice(records, len(values))]
        if head != values:
            raise ValueError("rows_of: values are not the first records of files.plain")
        choices = [
            rec.choices(rec.pixels(v)[0].shape, u) for v, u in zip(values, draws, strict=True)
        ]
        columns = dict(zip(("h0", "w0", "flip"), zip(*choices, strict=True), strict=True))
        fed = (["h0", "w0"] if self.recipe.crop else []) + (["flip"] if self.recipe.mirror else [])
        pipe = _build(self.recipe, self.files.plain, self.roi, fed=True, batch=len(values))
        for name in fed:
            pipe.feed_input(name, [np.array(int(v), np.int32) for v in columns[name]])
        data, _ = pipe.run()
        return [np.array(data[i]) for i in range(len(values))]

    def first_here(self, keep: bool = False) -> Sample:
        t0 = time.perf_counter()
        pipe = _build(self.recipe, self.files.first, self.roi)
        images, batch = _epoch(pipe, keep)
        del pipe
        return Sample(images, time.perf_counter() - t0, batch)

    def start(self) -> None:
        self.pipe = _build(self.recipe, self.files.loader, self.roi)
        _epoch(self.pipe, False)

    def later(self, keep: bool = False, epochs: int = 1) -> Sample:
        # DALI prefetches across the boundary like the Loader: an epoch, then the timed ones
        _epoch(self.pipe, False)
        return timed(lambda k: _epoch(self.pipe, k), keep, epochs)

    def close(self) -> None:
        self.pipe = None
