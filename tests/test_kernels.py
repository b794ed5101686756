"""The transform kernel against Caffe's formula, element by element, every way it runs.

The reference below is written from ``data_transformer.cpp`` directly, one
element at a time: ``top[c, h, w] = (float(x[c, h_off + h, w_off + sw]) -
mean[c, h_off + h, w_off + sw]) * scale``, with ``sw = crop - 1 - w`` when
mirrored. The kernel runs as a block (rows that share a crop offset), row by row
(large rows, or rows with offsets of their own), as a list of rows of several
sizes, and on pixels already cropped and flipped (the device half of a device
transform), over NumPy and, with a GPU, CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blobpipe._io._kernels import (
    Geometry,
    KernelSpec,
    apply,
    draw_geometry,
    draw_word,
    draw_words,
)
from tests.conftest import cupy_backend_or_skip


def reference(
    x: np.ndarray, h_off: int, w_off: int, flip: bool, crop: int, mean: np.ndarray | None,
    scale: float, layout: str, dtype: Any,
) -> np.ndarray:  # fmt: skip
    c, h, w = x.shape
    ch, cw = (crop, crop) if crop else (h, w)
    out = np.empty((c, ch, cw), dtype)
    for k in range(c):
        for i in range(ch):
            for j in range(cw):
                sj = cw - 1 - j if flip else j
                v = x[k, h_off + i, w_off + sj]
                if dtype == np.uint8:
                    out[k, i, j] = v
                    continue
                r = np.float32(v)
                if mean is not None:
                    m = mean[k, 0, 0] if mean.shape[1] == 1 else mean[k, h_off + i, w_off + sj]
                    r = np.float32(r - m)
                if scale != 1:
                    r = np.float32(r * np.float32(scale))
                out[k, i, j] = r
    return out if layout == "NCHW" else out.transpose(1, 2, 0)


def xp_params() -> list[Any]:
    gpu = pytest.mark.gpu
    return [pytest.param("numpy", id="numpy"), pytest.param("cupy", id="cupy", marks=gpu)]


@pytest.fixture(params=xp_params())
def xp(request: pytest.FixtureRequest) -> Any:
    if request.param == "numpy":
        return np
    return cupy_backend_or_skip().xp  # fails instead with BLOBPIPE_REQUIRE_GPU=1


CASES = {
    "plain": {"crop": 0, "mean": None, "scale": 1.0},
    "scale": {"crop": 0, "mean": None, "scale": 0.017},
    "mean_file_crop": {"crop": 5, "mean": "file", "scale": 0.5},
    "mean_value_crop": {"crop": 6, "mean": "value", "scale": 1.0},
    "mean_file": {"crop": 0, "mean": "file", "scale": 1.0},
}


def _mean(kind: str | None, shape: tuple[int, int, int]) -> np.ndarray | None:
    rng = np.random.default_rng(1)
    if kind == "file":
        return rng.uniform(0, 255, shape).astype(np.float32)
    if kind == "value":
        return np.array([104.0, 117.5, 123.25], np.float32)[: shape[0], None, None]
    return None


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float32, np.uint8])
@pytest.mark.parametrize("form", ["block", "rows", "cropped", "cropped_block", "big"])
def test_kernel_equals_caffe(xp: Any, case: str, layout: str, dtype: Any, form: str) -> None:
    cfg = CASES[case]
    crop, scale = int(cfg["crop"]), float(cfg["scale"])  # type: ignore[call-overload]
    shape = (3, 40, 48) if form == "big" else (3, 9, 11)
    n = 7
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    mean = _mean(cfg["mean"], shape)  # type: ignore[arg-type]
    train = form not in ("block", "cropped_block")  # block forms: one (centre) offset
    words = draw_words(3, np.zeros(n, np.int64), np.arange(n))
    geo = draw_geometry(shape[1], shape[2], crop, True, train, words)
    if dtype == np.uint8:
        mean, scale = None, 1.0
    want = np.stack(
        [reference(x[i], *geo.row(i), crop, mean, scale, layout, dtype) for i in range(n)]
    )
    spec = KernelSpec(crop, None if mean is None else xp.asarray(mean), np.float32(scale), layout)
    out = xp.zeros(want.shape, dtype)
    if form in ("cropped", "cropped_block"):
        # the host half: crop and flip into uint8 NCHW; the device half: the rest
        staged = np.stack([reference(x[i], *geo.row(i), crop, None, 1, "NCHW", np.uint8)
                           for i in range(n)])  # fmt: skip
        apply(xp, xp.asarray(staged), out, geo, spec, cropped=True)
    elif form == "rows":
        apply(xp, [xp.asarray(r) for r in x], out, geo, spec)
    else:
        apply(xp, xp.asarray(x), out, geo, spec)
    got = out if xp is np else out.get()
    assert got.dtype == want.dtype
    assert np.array_equal(got, want)


def test_rows_of_several_sizes_crop_to_one() -> None:
    rng = np.random.default_rng(2)
    rows = [
        rng.integers(0, 256, (3, h, w), dtype=np.uint8) for h, w in [(9, 9), (12, 10), (15, 20)]
    ]
    words = draw_words(0, [1, 1, 1], [0, 1, 2])
    parts = [draw_geometry(r.shape[1], r.shape[2], 8, True, True, words[i : i + 1])
             for i, r in enumerate(rows)]  # fmt: skip
    geo = Geometry(*(np.concatenate(a) for a in zip(*(p.arrays() for p in parts), strict=True)))
    mean = np.array([1.5, 2.0, 3.0], np.float32)[:, None, None]
    out = np.empty((3, 3, 8, 8), np.float32)
    apply(np, rows, out, geo, KernelSpec(8, mean, np.float32(0.25), "NCHW"))
    for i, r in enumerate(rows):
        assert np.array_equal(out[i], reference(r, *geo.row(i), 8, mean, 0.25, "NCHW", np.float32))


def test_float_records_go_through_the_same_arithmetic() -> None:
    x = np.random.default_rng(3).normal(0, 50, (4, 2, 6, 6)).astype(np.float32)
    mean = np.random.default_rng(4).normal(0, 5, (2, 6, 6)).astype(np.float32)
    geo = draw_geometry(6, 6, 4, True, True, draw_words(9, [0] * 4, range(4)))
    out = np.empty((4, 2, 4, 4), np.float32)
    apply(np, x, out, geo, KernelSpec(4, mean, np.float32(3.0), "NCHW"))
    for i in range(4):
        assert np.array_equal(
            out[i], reference(x[i], *geo.row(i), 4, mean, 3.0, "NCHW", np.float32)
        )


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    epochs=st.lists(st.integers(0, 2**40), min_size=1, max_size=8),
    index=st.integers(0, 2**40),
)
def test_draw_words_equal_draw_word(seed: int, epochs: list[int], index: int) -> None:
    indices = [index + k for k in range(len(epochs))]
    got = draw_words(seed, epochs, indices).tolist()
    assert got == [draw_word(seed, e, i) for e, i in zip(epochs, indices, strict=True)]


class _CountingNumpy:
    """NumPy, counting the ufunc calls the kernel makes (a stand-in namespace)."""

    def __init__(self) -> None:
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(np, name)
        if name in ("subtract", "multiply"):

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return attr(*args, **kwargs)

            return counted
        return attr


@pytest.mark.parametrize("shape", [(3, 64, 64), (3, 128, 128), (1, 28, 28)])
def test_a_block_written_in_one_pass_is_one_call_whatever_the_row_size(
    shape: tuple[int, int, int],
) -> None:
    # rows of one offset (TEST, no crop) with a scale only: one ufunc call for the
    # whole block, not one per row, however large the rows
    n = 16
    x = np.random.default_rng(5).integers(0, 256, (n, *shape), dtype=np.uint8)
    geo = draw_geometry(shape[1], shape[2], 0, False, False, np.zeros(n, np.uint64))
    xp = _CountingNumpy()
    out = np.empty((n, *shape), np.float32)
    apply(xp, x, out, geo, KernelSpec(0, None, np.float32(0.00390625), "NCHW"))
    assert xp.calls == 1
    assert np.array_equal(out, x.astype(np.float32) * np.float32(0.00390625))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 9),
    chunk_rows=st.integers(1, 10),
    case=st.sampled_from(sorted(CASES)),
    layout=st.sampled_from(["NCHW", "NHWC"]),
    mirror=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_blocks_in_chunks_equal_caffe(
    n: int, chunk_rows: int, case: str, layout: str, mirror: bool, seed: int
) -> None:
    # a block done in chunks of any size (the host's two-pass blocks) gives
    # Caffe's values: mean and scale, mixed flips fixed up chunk by chunk
    import blobpipe._io._kernels as kernels

    cfg = CASES[case]
    crop, scale = int(cfg["crop"]), float(cfg["scale"])  # type: ignore[call-overload]
    shape = (3, 9, 11)
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    mean = _mean(cfg["mean"], shape)  # type: ignore[arg-type]
    geo = draw_geometry(9, 11, crop, mirror, False, rng.integers(0, 2**63, n, dtype=np.uint64))
    want = np.stack(
        [reference(x[i], *geo.row(i), crop, mean, scale, layout, np.float32) for i in range(n)]
    )
    spec = KernelSpec(crop, mean, np.float32(scale), layout)
    out = np.zeros(want.shape, np.float32)
    row_bytes = out[0].nbytes
    saved = kernels._CHUNK_BYTES
    kernels._CHUNK_BYTES = chunk_rows * row_bytes
    try:
        apply(np, x, out, geo, spec)
    finally:
        kernels._CHUNK_BYTES = saved
    assert np.array_equal(out, want)
