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

import itertools
from pathlib import Path
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
    last_level_cache,
    row_kernel,
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
                    m = (
                        mean[k, 0, 0]
                        if mean.shape[1:] == (1, 1)
                        else mean[k, h_off + i, w_off + sj]
                    )
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


def _numpy_draw(*args: Any) -> Geometry:
    """:func:`draw_geometry` with the compiled kernel taken away (NumPy's arithmetic)."""
    import blobpipe._io._kernels as kernels

    saved = kernels._rowkernel
    kernels._rowkernel = None
    try:
        return draw_geometry(*args)
    finally:
        kernels._rowkernel = saved


@settings(max_examples=300, deadline=None)
@given(
    words=st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=40),
    crop=st.integers(0, 40),
    extra=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 300)), min_size=40, max_size=40),
    per_row=st.booleans(),
    mirror=st.booleans(),
    train=st.booleans(),
    strided=st.booleans(),
)
def test_the_compiled_draw_equals_numpys(
    words: list[int], crop: int, extra: list[tuple[int, int]], per_row: bool, mirror: bool,
    train: bool, strided: bool,
) -> None:  # fmt: skip
    # every crop offset and flip the kernel draws is NumPy's, for sides given once or one
    # per row (a strided column of (H, W) sizes, as a batch of JPEGs gives them), up to
    # the 2**31 a side may be, words of every bit pattern
    if row_kernel() is None:
        pytest.skip("the compiled row kernel was not built (no C compiler at install)")
    n = len(words)
    w = np.array(words, np.uint64)
    sizes = np.array([[crop + a, crop + b] for a, b in extra[:n]], np.intp).reshape(n, 2)
    height: Any
    width: Any
    if per_row:
        height, width = sizes[:, 0], sizes[:, 1]
        if not strided:
            height, width = height.copy(), width.copy()
    else:
        height, width = crop + extra[0][0], np.int64(crop + extra[0][1])
    got = draw_geometry(height, width, crop, mirror, train, w)
    want = _numpy_draw(height, width, crop, mirror, train, w)
    for a, b in zip(got.arrays(), want.arrays(), strict=True):
        assert a.dtype == b.dtype and a.shape == (n,)
        assert np.array_equal(a, b)


def test_the_compiled_draw_refuses_a_side_smaller_than_the_crop() -> None:
    # (the caller checks the crop first; the kernel checks it again, naming the row)
    if row_kernel() is None:
        pytest.skip("the compiled row kernel was not built (no C compiler at install)")
    with pytest.raises(ValueError, match="row 1's 7x9 is smaller than the crop 8"):
        draw_geometry(np.array([9, 7, 9]), 9, 8, True, True, np.arange(3, dtype=np.uint64))


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


def _row_kernel_or_skip() -> None:
    from blobpipe._io._kernels import row_kernel

    if row_kernel() is None:
        pytest.skip("the compiled row kernel was not built (no C compiler at install)")


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 7),
    channels=st.sampled_from([1, 3, 4]),
    height=st.integers(1, 40),  # crops on both sides of 8 and 32 pixels (the kernel's steps)
    width=st.integers(1, 40),
    crop_from=st.floats(0, 1),
    mean=st.sampled_from([None, "file", "value"]),
    scale=st.sampled_from([1.0, 0.017, 0.00390625, 3.5]),
    layout=st.sampled_from(["NCHW", "NHWC"]),
    dtype=st.sampled_from([np.float32, np.uint8]),
    gaps=st.lists(st.integers(0, 40), min_size=7, max_size=7),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_row_kernel_equals_caffe(
    n: int, channels: int, height: int, width: int, crop_from: float, mean: str | None,
    scale: float, layout: str, dtype: Any, gaps: list[int], seed: int,
) -> None:  # fmt: skip
    """The compiled row kernel (raw rows anywhere in one buffer, each with its own
    crop and flip) against the element-by-element reference, every arithmetic."""
    from blobpipe._io._kernels import apply_raw

    _row_kernel_or_skip()
    rng = np.random.default_rng(seed)
    shape = (channels, height, width)
    size = channels * height * width
    offsets = np.cumsum([g + (size if i else 0) for i, g in enumerate(gaps[:n])]).astype(np.int64)
    buffer = rng.integers(0, 256, int(offsets[-1]) + size + int(rng.integers(0, 5)), np.uint8)
    crop = int(crop_from * min(height, width))
    if mean == "file":
        m: np.ndarray | None = rng.uniform(0, 255, shape).astype(np.float32)
    elif mean == "value":
        m = rng.uniform(0, 255, (channels, 1, 1)).astype(np.float32)
    else:
        m = None
    geo = draw_geometry(height, width, crop, True, True, rng.integers(0, 2**63, n, np.uint64))
    rows = [buffer[o : o + size].reshape(shape) for o in offsets.tolist()]
    want = np.stack(
        [reference(rows[i], *geo.row(i), crop, m, scale, layout, dtype) for i in range(n)]
    )
    out = np.full(want.shape, 7, dtype)
    spec = KernelSpec(crop, m, np.float32(scale), layout)  # type: ignore[arg-type]
    assert apply_raw(memoryview(buffer.tobytes()), offsets, shape, out, geo, spec)
    assert np.array_equal(out, want)
    # the rows into several arrays (consecutive batches), in order, in one call
    cuts = sorted(rng.integers(0, n + 1, int(rng.integers(0, 3))).tolist())
    bounds = [0, *cuts, n]
    parts = [np.full((b - a, *want.shape[1:]), 7, dtype) for a, b in itertools.pairwise(bounds)]
    assert apply_raw(memoryview(buffer.tobytes()), offsets, shape, parts, geo, spec)
    assert np.array_equal(np.concatenate(parts), want)


@pytest.mark.parametrize("width", [1, 2, 31, 32, 33, 1023, 1024, 1025, 1100])
@pytest.mark.parametrize("mean", ["file", "value", None])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float32, np.uint8])
def test_wide_and_narrow_lines_equal_caffe_either_side_of_the_stack_line(
    width: int, mean: str | None, layout: str, dtype: Any
) -> None:
    """Lines up to 1024 pixels (the C kernel's ``FLIP_LINE``) go through lines on its
    stack: a mirrored line of a mean file is computed forward and copied reversed, and
    an NHWC row's three channels (float32 or uint8) are made a line each and
    interleaved; wider lines go the direct way. Both sides, mirrored or not, equal
    the element-by-element reference."""
    from blobpipe._io._kernels import apply_raw

    _row_kernel_or_skip()
    rng = np.random.default_rng(width)
    shape = (3, 2, width)
    size = int(np.prod(shape))
    buffer = rng.integers(0, 256, 2 * size + 3, np.uint8)
    offsets = np.array([0, size + 3], np.int64)
    m = None
    if mean == "file":
        m = rng.uniform(0, 255, shape).astype(np.float32)
    elif mean == "value":
        m = rng.uniform(0, 255, (3, 1, 1)).astype(np.float32)
    geo = Geometry(np.zeros(2, np.intp), np.zeros(2, np.intp), np.array([True, False]))
    rows = [buffer[o : o + size].reshape(shape) for o in offsets.tolist()]
    for scale in (1.0, 0.017):
        want = np.stack(
            [reference(rows[i], *geo.row(i), 0, m, scale, layout, dtype) for i in range(2)]
        )
        out = np.full(want.shape, 7, dtype)
        spec = KernelSpec(0, m, np.float32(scale), layout)  # type: ignore[arg-type]
        assert apply_raw(memoryview(buffer.tobytes()), offsets, shape, out, geo, spec)
        assert np.array_equal(out, want)


@pytest.mark.parametrize("width", [1, 2, 33, 1023, 1024, 1025, 1100])
@pytest.mark.parametrize("mean", ["file", "value", None])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float32, np.uint8])
def test_decoded_images_equal_caffe_either_side_of_the_stack_line(
    width: int, mean: str | None, layout: str, dtype: Any
) -> None:
    """Decoded images ((H, W, 3) pixels) into NHWC rows go through three channel lines
    on the C kernel's stack, interleaved (reversed where mirrored), up to 1024 pixels
    a line; wider lines go the direct way. Both sides, mirrored or not, and NCHW,
    equal the element-by-element reference."""
    import blobpipe._io._kernels as kernels

    _row_kernel_or_skip()
    rng = np.random.default_rng(width)
    rows = [rng.integers(0, 256, (2, width, 3), np.uint8).transpose(2, 0, 1) for _ in range(2)]
    m = None if mean is None else _mean(mean, (3, 2, width))
    geo = Geometry(np.zeros(2, np.intp), np.zeros(2, np.intp), np.array([True, False]))
    for scale in (1.0, 0.017):
        want = np.stack(
            [reference(rows[i], *geo.row(i), 0, m, scale, layout, dtype) for i in range(2)]
        )
        out = np.full(want.shape, 7, dtype)
        kernels.apply(np, rows, out, geo, KernelSpec(0, m, np.float32(scale), layout))  # type: ignore[arg-type]
        assert np.array_equal(out, want)


def test_the_row_kernel_refuses_rows_outside_its_buffers() -> None:
    from blobpipe._io._kernels import apply_raw

    _row_kernel_or_skip()
    shape = (3, 4, 5)
    buffer = bytes(100)
    out = np.zeros((1, 3, 4, 5), np.float32)
    spec = KernelSpec(0, None, np.float32(1), "NCHW")
    ok = Geometry.zeros(1)
    for offset in (-1, 41, 10**12):
        with pytest.raises(ValueError, match="outside the buffer"):
            apply_raw(buffer, np.array([offset], np.int64), shape, out, ok, spec)
    apply_raw(buffer, np.array([40], np.int64), shape, out, ok, spec)  # the last that fits
    crop_spec = KernelSpec(3, None, np.float32(1), "NCHW")
    far = Geometry(np.array([2], np.intp), np.array([0], np.intp), np.zeros(1, np.bool_))
    with pytest.raises(ValueError, match="crop does not fit"):
        apply_raw(
            buffer,
            np.array([0], np.int64),
            shape,
            np.zeros((1, 3, 3, 3), np.float32),
            far,
            crop_spec,
        )
    with pytest.raises(ValueError, match="out must hold"):
        apply_raw(
            buffer, np.array([0], np.int64), shape, np.zeros((2, 3, 4, 5), np.float32), ok, spec
        )
    # several outputs: as many rows as there are offsets, each a whole number of rows
    two = np.array([0, 40], np.int64)
    with pytest.raises(ValueError, match="out must hold"):
        apply_raw(buffer, two, shape, [out, out, out], Geometry.zeros(2), spec)
    halves = [np.zeros(30, np.float32), np.zeros(90, np.float32)]  # 1.5 rows, then 0.5
    with pytest.raises(ValueError, match="a whole number of rows"):
        apply_raw(buffer, two, shape, halves, Geometry.zeros(2), spec)
    apply_raw(
        buffer, two, shape, [out, np.zeros((0, 3, 4, 5), np.float32), out], Geometry.zeros(2), spec
    )
    # an output the kernel does not write (not contiguous, or float64, or of two
    # dtypes): NumPy's path
    assert not apply_raw(buffer, np.array([0], np.int64), shape, out[:, :, ::2], ok, spec)
    assert not apply_raw(buffer, np.array([0], np.int64), shape, np.zeros((1, 3, 4, 5)), ok, spec)
    mixed = [out, np.zeros((1, 3, 4, 5), np.uint8)]
    assert not apply_raw(buffer, two, shape, mixed, Geometry.zeros(2), spec)


@pytest.mark.parametrize("shape", [(3, 1, 7), (2, 6, 1)])
def test_a_mean_file_of_one_row_or_column_is_cropped_as_a_mean_file(
    shape: tuple[int, int, int],
) -> None:
    """A mean file whose records are one pixel high (or wide) is still a mean file:
    cropped at each row's offset, never taken for one value per channel."""
    rng = np.random.default_rng(4)
    x = rng.integers(0, 256, (4, *shape), dtype=np.uint8)
    mean = rng.uniform(0, 255, shape).astype(np.float32)
    geo = draw_geometry(shape[1], shape[2], 1, True, True, rng.integers(0, 2**63, 4, np.uint64))
    want = np.stack(
        [reference(x[i], *geo.row(i), 1, mean, 0.5, "NCHW", np.float32) for i in range(4)]
    )
    out = np.zeros(want.shape, np.float32)
    apply(np, x, out, geo, KernelSpec(1, mean, np.float32(0.5), "NCHW"))
    assert np.array_equal(out, want)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 4),
    sizes=st.lists(st.tuples(st.integers(4, 11), st.integers(4, 11)), min_size=4, max_size=4),
    crop=st.integers(0, 4),
    hwc=st.booleans(),
    mean=st.sampled_from([None, "value", "file"]),
    scale=st.sampled_from([1.0, 0.017, 3.5]),
    layout=st.sampled_from(["NCHW", "NHWC"]),
    dtype=st.sampled_from([np.float32, np.uint8]),
    compiled=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_rows_one_at_a_time_equal_caffe_compiled_or_not(
    n: int, sizes: list[tuple[int, int]], crop: int, hwc: bool, mean: str | None,
    scale: float, layout: str, dtype: Any, compiled: bool, seed: int,
) -> None:  # fmt: skip
    """A list of rows (decoded images: (C, H, W) views of (H, W, C) pixels, or
    (C, H, W) arrays), each with its own crop and flip, through the compiled row
    kernel and through NumPy: Caffe's values either way. A mean file needs one
    record size; without a crop, so do the rows of one batch."""
    import blobpipe._io._kernels as kernels

    if compiled:
        _row_kernel_or_skip()
    rng = np.random.default_rng(seed)
    if mean == "file" or not crop:
        sizes = [sizes[0]] * n
    rows = []
    for h, w in sizes[:n]:
        pixels = rng.integers(0, 256, (h, w, 3) if hwc else (3, h, w), dtype=np.uint8)
        rows.append(pixels.transpose(2, 0, 1) if hwc else pixels)
    h0, w0 = sizes[0]
    m = None if mean is None else _mean(mean, (3, h0, w0))
    words = rng.integers(0, 2**63, n, np.uint64)
    geos = [
        draw_geometry(r.shape[1], r.shape[2], crop, True, True, words[i : i + 1])
        for i, r in enumerate(rows)
    ]
    geo = Geometry(
        np.concatenate([g.h_off for g in geos]),
        np.concatenate([g.w_off for g in geos]),
        np.concatenate([g.mirror for g in geos]),
    )
    want = np.stack(
        [reference(rows[i], *geo.row(i), crop, m, scale, layout, dtype) for i in range(n)]
    )
    out = np.full(want.shape, 7, dtype)
    saved = kernels._rowkernel
    if not compiled:
        kernels._rowkernel = None
    try:
        apply(np, rows, out, geo, KernelSpec(crop, m, np.float32(scale), layout))  # type: ignore[arg-type]
    finally:
        kernels._rowkernel = saved
    assert np.array_equal(out, want)


def test_compiled_row_kernel_says_whether_the_module_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    import blobpipe
    import blobpipe._io._kernels as kernels

    built = kernels.row_kernel() is not None
    assert blobpipe.compiled_row_kernel() is built
    monkeypatch.setattr(kernels, "_rowkernel", None)
    assert blobpipe.compiled_row_kernel() is False


@pytest.fixture(scope="module")
def kernel_without_vector_types(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The row kernel built with ``-DBLOBPIPE_NO_VEC8``: the build a compiler without
    GCC's and Clang's vector types makes (``lines_f32`` calling the one-line loop a
    line), loaded under a name of its own."""
    import importlib.util
    from pathlib import Path

    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    _row_kernel_or_skip()
    root = Path(__file__).resolve().parent.parent
    out = tmp_path_factory.mktemp("novec8")
    ext = Extension(
        "_rowkernel",
        sources=[str(root / "blobpipe" / "_io" / "_rowkernel.c")],
        extra_compile_args=["-O3", "-ffp-contract=off", "-DBLOBPIPE_NO_VEC8"],
    )
    cmd = build_ext(Distribution({"ext_modules": [ext]}))
    cmd.build_lib, cmd.build_temp = str(out), str(out / "build")
    cmd.ensure_finalized()
    try:
        cmd.run()
    except Exception as exc:  # no compiler here: the installed kernel was built elsewhere
        pytest.skip(f"could not build the row kernel here: {exc}")
    spec = importlib.util.spec_from_file_location(
        "novec8._rowkernel", cmd.get_ext_fullpath("_rowkernel")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "crop"), [((3, 2, 5), 0), ((3, 2, 33), 0), ((3, 2, 1025), 0), ((3, 9, 9), 6)]
)
@pytest.mark.parametrize("mean", ["file", "value", None])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_the_kernel_without_vector_types_equals_caffe(
    kernel_without_vector_types: Any,
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, int, int],
    crop: int,
    mean: str | None,
    layout: str,
) -> None:
    """Where the compiler has no vector types, a channel's lines go a line a call
    through the one-line loop (its mirrored mean-file lines through ``FLIP_LINE``'s
    stack line): whole lines and crops, mirrored or not, with and without scale,
    float32 and uint8, the same values as the element-by-element reference."""
    from blobpipe._io import _kernels
    from blobpipe._io._kernels import apply_raw

    monkeypatch.setattr(_kernels, "row_kernel", lambda: kernel_without_vector_types)
    rng = np.random.default_rng(shape[2] + crop)
    size = int(np.prod(shape))
    buffer = rng.integers(0, 256, 3 * size, np.uint8)
    offsets = np.array([0, size, 2 * size], np.int64)
    m = None
    if mean == "file":
        m = rng.uniform(0, 255, shape).astype(np.float32)
    elif mean == "value":
        m = rng.uniform(0, 255, (3, 1, 1)).astype(np.float32)
    corners = [(0, 0), (3, 1), (2, 3)] if crop else [(0, 0)] * 3
    geo = Geometry(
        np.array([h for h, _ in corners], np.intp),
        np.array([w for _, w in corners], np.intp),
        np.array([True, False, True]),
    )
    rows = [buffer[o : o + size].reshape(shape) for o in offsets.tolist()]
    for dtype, scale in ((np.float32, 1.0), (np.float32, 0.017), (np.uint8, 1.0)):
        if dtype == np.uint8 and m is not None:
            continue
        want = np.stack(
            [reference(rows[i], *geo.row(i), crop, m, scale, layout, dtype) for i in range(3)]
        )
        out = np.full(want.shape, 7, dtype)
        spec = KernelSpec(crop, m, np.float32(scale), layout)  # type: ignore[arg-type]
        assert apply_raw(memoryview(buffer.tobytes()), offsets, shape, out, geo, spec)
        assert np.array_equal(out, want)


def test_last_level_cache_reads_the_largest_data_cache(tmp_path: Path) -> None:
    """Linux's ``cache/index*/{type,size}``: the largest cache that holds data; 0 where
    nothing can be read (then the row pool never streams)."""
    for name, kind, size in [
        ("index0", "Data", "48K"),
        ("index1", "Instruction", "64M"),  # not data: ignored however large
        ("index2", "Unified", "1024K"),
        ("index3", "Unified", "32768K"),
        ("index4", "Unified", "lots"),  # unreadable: skipped
        ("power", "Unified", "1G"),  # not an index
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "type").write_text(kind + "\n")
        (tmp_path / name / "size").write_text(size + "\n")
    assert last_level_cache(str(tmp_path)) == 32 << 20
    assert last_level_cache(str(tmp_path / "missing")) == 0
    assert last_level_cache() >= 0  # this machine's, read once
