"""Blob: Caffe's semantics (mirroring src/caffe/test/test_blob.cpp) and ours."""

from __future__ import annotations

import gc
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from blobpipe._backends import Backend, EmulatedBackend, HostBackend
from blobpipe._blob import MAX_BLOB_AXES, Blob
from blobpipe._errors import (
    BackendUnavailableError,
    BlobIndexError,
    BlobpipeError,
    ProtoError,
    ShapeError,
    StateError,
    UnsupportedOperationError,
)
from blobpipe._pool import get_pool
from blobpipe._proto import caffe_pb2
from blobpipe._syncedmem import Head
from tests.conftest import to_numpy

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FLOATS = [np.float32, np.float64]
INTS = [np.int32, np.uint32, np.int64]


@pytest.fixture
def host() -> HostBackend:
    return HostBackend()


def filled(
    shape: tuple[int, ...], backend: Backend, dtype: Any = np.float32, seed: int = 0
) -> Blob:
    """A blob whose data is uniform in [-3, 3) (Caffe's filler in the math tests)."""
    blob = Blob(shape, dtype, backend=backend)
    rng = np.random.default_rng(seed)
    blob.mutable_cpu_data()[...] = rng.uniform(-3, 3, size=shape)
    return blob


# -- construction and shape --------------------------------------------------------------


def test_initialization(host: HostBackend) -> None:
    # Caffe: TestInitialization
    pre = Blob((2, 3, 4, 5), backend=host)
    assert (pre.num, pre.channels, pre.height, pre.width) == (2, 3, 4, 5)
    assert pre.count() == 120
    assert pre.shape == (2, 3, 4, 5)
    assert isinstance(pre.shape, tuple)
    assert pre.num_axes == 4
    assert pre.capacity == 120
    assert pre.dtype == np.float32
    default = Blob(backend=host)
    assert default.num_axes == 0
    assert default.count() == 0
    assert default.capacity == 0
    assert default.shape_string() == "(0)"


def test_scalar_blob_has_count_one(host: HostBackend) -> None:
    # Caffe: Reshape({}) gives a 0-axis blob of count 1.
    blob = Blob((), backend=host)
    assert blob.count() == 1
    assert blob.shape_string() == "(1)"
    assert blob.cpu_data().shape == ()
    blob.mutable_cpu_data()[...] = 4.5
    assert blob.data_at(()) == 4.5
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 1, 1, 1)


def test_default_blob_accessors_need_a_shape(host: HostBackend) -> None:
    blob = Blob(backend=host)
    with pytest.raises(StateError, match=r"no shape yet.*reshape\(\) first"):
        blob.cpu_data()
    assert blob.asum_data() == 0.0
    assert blob.sumsq_diff() == 0.0
    blob.scale_data(2.0)  # nothing to scale
    blob.reshape((2, 2))
    assert blob.cpu_data().shape == (2, 2)


@pytest.mark.parametrize("dtype", [*FLOATS, *INTS])
def test_dtypes(host: HostBackend, dtype: Any) -> None:
    blob = Blob((2, 3), dtype, backend=host)
    assert blob.dtype == np.dtype(dtype)
    views = (blob.cpu_data(), blob.mutable_cpu_data(), blob.cpu_diff(), blob.mutable_cpu_diff())
    for view in views:
        assert view.dtype == np.dtype(dtype)
        assert view.shape == (2, 3)
    assert blob.data.size == 6 * np.dtype(dtype).itemsize


@pytest.mark.parametrize("dtype", [np.float16, np.int16, np.bool_, np.int8, ">f4", "not-a-dtype"])
def test_unsupported_dtype(host: HostBackend, dtype: Any) -> None:
    with pytest.raises(ShapeError, match="unsupported blob dtype"):
        Blob((2,), dtype, backend=host)


def test_reshape_legacy_and_sequences(host: HostBackend) -> None:
    blob = Blob(backend=host)
    blob.reshape(2, 3, 4, 5)  # Caffe: TestReshape
    assert (blob.num, blob.channels, blob.height, blob.width) == (2, 3, 4, 5)
    assert blob.count() == 120
    blob.reshape([np.int64(3), 4])
    assert blob.shape == (3, 4)
    assert all(type(d) is int for d in blob.shape)
    shape = caffe_pb2.BlobShape(dim=[5, 6])
    blob.reshape(shape)
    assert blob.shape == (5, 6)


def test_reshape_zero(host: HostBackend) -> None:
    # Caffe: TestReshapeZero
    blob = Blob(backend=host)
    blob.reshape((0, 5))
    assert blob.count() == 0
    assert blob.cpu_data().shape == (0, 5)


def test_reshape_bad_arguments(host: HostBackend) -> None:
    blob = Blob((2, 3), backend=host)
    with pytest.raises(TypeError, match="one shape sequence"):
        blob.reshape(2, 3)
    with pytest.raises(TypeError, match="sequence of ints"):
        blob.reshape(6)
    with pytest.raises(TypeError, match="sequence of ints"):
        blob.reshape("23")
    with pytest.raises(TypeError, match="dimension 0 must be an int"):
        blob.reshape((2.0, 3))
    with pytest.raises(TypeError, match="dimension 1 must be an int"):
        blob.reshape((2, True))
    assert blob.shape == (2, 3)


def test_reshape_negative_dim(host: HostBackend) -> None:
    blob = Blob((2, 3), backend=host)
    with pytest.raises(ShapeError, match=r"dimension 1 .* >= 0, got -3 \(shape 2 -3 "):
        blob.reshape((2, -3))
    assert blob.shape == (2, 3)  # a failing reshape changes nothing
    with pytest.raises(ValueError, match="got -1"):
        Blob((-1,), backend=host)


def test_axis_limit(host: HostBackend) -> None:
    blob = Blob((1,) * MAX_BLOB_AXES, backend=host)
    assert blob.num_axes == 32
    with pytest.raises(ShapeError, match="at most 32 axes, got 33"):
        blob.reshape((1,) * 33)
    with pytest.raises(BlobpipeError, match="at most 32 axes"):
        Blob((1,) * 33, backend=host)


def test_absurd_size_is_refused_before_allocating(host: HostBackend) -> None:
    with pytest.raises(ShapeError, match="more than this platform can address"):
        Blob((2**40, 2**40), backend=host)


def test_reshape_like(host: HostBackend) -> None:
    a = Blob((2, 3, 4), backend=host)
    b = Blob((1,), np.float64, backend=host)
    b.reshape_like(a)
    assert b.shape == (2, 3, 4)
    assert b.dtype == np.float64


def test_reshape_within_capacity_keeps_memory(host: HostBackend) -> None:
    pool = get_pool(host, "host")
    blob = Blob((4, 5), backend=host)
    data = blob.mutable_cpu_data()
    data[...] = np.arange(20).reshape(4, 5)
    mem = blob.data
    misses = pool.statistics().misses
    blob.reshape((2, 5))  # shrink
    assert blob.capacity == 20
    assert blob.data is mem
    np.testing.assert_array_equal(blob.cpu_data(), np.arange(10).reshape(2, 5))
    blob.reshape((5, 4))  # re-grow within capacity: bytes kept
    assert blob.data is mem
    np.testing.assert_array_equal(blob.cpu_data().ravel(), np.arange(20))
    assert pool.statistics().misses == misses


def test_reshape_beyond_capacity_reallocates_and_returns_old_block(host: HostBackend) -> None:
    pool = get_pool(host, "host")
    blob = Blob((10,), backend=host)
    blob.mutable_cpu_data()[...] = 1
    blob.mutable_cpu_diff()[...] = 1
    old = blob.data
    before = pool.statistics()
    assert before.used_bytes > 0
    blob.reshape((1000,))
    assert blob.capacity == 1000
    assert blob.data is not old
    assert old.closed
    after = pool.statistics()
    assert after.used_bytes == 0  # both old blocks went back, the new ones are lazy
    assert after.free_blocks == before.free_blocks + 2
    assert blob.asum_data() == 0.0  # new memory is uninitialised (zero when touched)
    assert float(blob.cpu_data().sum()) == 0.0


def test_shape_string(host: HostBackend) -> None:
    assert Blob((2, 3, 4, 5), backend=host).shape_string() == "2 3 4 5 (120)"
    assert Blob((7,), backend=host).shape_string() == "7 (7)"
    assert Blob((3, 0), backend=host).shape_string() == "3 0 (0)"


def test_shape_at_and_canonical_axis(host: HostBackend) -> None:
    blob = Blob((2, 3, 4, 5), backend=host)
    assert [blob.shape_at(i) for i in range(4)] == [2, 3, 4, 5]
    assert [blob.shape_at(-i) for i in range(1, 5)] == [5, 4, 3, 2]
    assert blob.canonical_axis_index(-1) == 3
    assert blob.canonical_axis_index(2) == 2
    message = r"axis 4 out of range for 4-D Blob with shape 2 3 4 5 \(120\)"
    with pytest.raises(BlobIndexError, match=message):
        blob.shape_at(4)
    with pytest.raises(IndexError, match="axis -5 out of range"):
        blob.canonical_axis_index(-5)
    with pytest.raises(BlobIndexError, match="axis 0 out of range for 0-D Blob"):
        Blob((), backend=host).shape_at(0)


def test_count_ranges(host: HostBackend) -> None:
    blob = Blob((2, 3, 4, 5), backend=host)
    assert blob.count() == 120
    assert blob.count(0) == 120
    assert blob.count(1) == 60
    assert blob.count(1, 3) == 12
    assert blob.count(2, 2) == 1
    assert blob.count(4) == 1
    for bad in [(3, 2), (-1, 2), (0, 5), (5, None)]:
        with pytest.raises(BlobIndexError, match=r"count\(.*num_axes \(4\).*2 3 4 5 \(120\)"):
            blob.count(*bad)
    # Caffe: the default blob's count() is 0, but count(0) is an empty product.
    default = Blob(backend=host)
    assert default.count() == 0
    assert default.count(0) == 1


def test_count_is_a_python_int_without_overflow(host: HostBackend) -> None:
    blob = Blob((0, 2**31, 2**31, 4), backend=host)  # Caffe would refuse > INT_MAX
    assert blob.count(1) == 2**64
    assert isinstance(blob.count(1), int)


def test_legacy_accessors_pad_with_ones(host: HostBackend) -> None:
    blob = Blob((3, 2), backend=host)
    assert (blob.num, blob.channels, blob.height, blob.width) == (3, 2, 1, 1)
    assert blob.legacy_shape(-1) == 2
    assert blob.legacy_shape(-2) == 3
    assert blob.legacy_shape(-3) == 1
    assert blob.legacy_shape(-4) == 1
    with pytest.raises(BlobIndexError, match=r"legacy axis 4 out of range \[-4, 4\)"):
        blob.legacy_shape(4)
    with pytest.raises(BlobIndexError, match="legacy axis -5"):
        blob.legacy_shape(-5)


def test_legacy_accessors_refuse_more_than_four_axes(host: HostBackend) -> None:
    blob = Blob((2, 3, 4, 5, 6), backend=host)
    for name in ("num", "channels", "height", "width"):
        with pytest.raises(ShapeError, match=r"more than 4 axes: shape 2 3 4 5 6 \(720\)"):
            getattr(blob, name)
    with pytest.raises(ShapeError, match="more than 4 axes"):
        blob.offset(0, 0, 0, 0)
    assert blob.offset((1, 2, 3, 4, 5)) == 719


# -- offsets and element access ------------------------------------------------------------


def test_offset_worked_example(host: HostBackend) -> None:
    blob = Blob((4, 3, 8, 16), backend=host)
    assert blob.offset(2, 1, 3, 9) == ((2 * 3 + 1) * 8 + 3) * 16 + 9 == 953
    assert blob.offset((2, 1, 3, 9)) == 953
    assert blob.offset([2, 1]) == blob.offset(2, 1) == ((2 * 3 + 1) * 8) * 16
    assert blob.offset(np.array([2, 1, 3, 9])) == 953


def test_offset_legacy_padding(host: HostBackend) -> None:
    blob = Blob((3, 2), backend=host)
    assert blob.offset(2, 1) == 5
    assert blob.offset(2, 1, 0, 0) == 5
    with pytest.raises(BlobIndexError, match=r"index height=1 out of range \[0, 1\)"):
        blob.offset(0, 0, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 0, 0, 0), r"index num=2 out of range \[0, 2\) for Blob with shape 2 3 4 5 \(120\)"),
        ((0, 3), r"index channels=3 out of range \[0, 3\)"),
        ((0, 0, 4), r"index height=4"),
        ((0, 0, 0, 5), r"index width=5"),
        ((-1,), r"index num=-1"),
        (((2, 0),), r"index 2 out of range \[0, 2\) for axis 0 of Blob with shape 2 3 4 5"),
        (((0, 0, 0, -1),), r"index -1 out of range \[0, 5\) for axis 3"),
        (((0, 0, 0, 0, 0),), r"5 indices given for a 4-D Blob with shape 2 3 4 5 \(120\)"),
    ],
)
def test_offset_out_of_range(host: HostBackend, args: tuple[Any, ...], message: str) -> None:
    # Caffe's offset() lets n == num (and c == channels ...) through; ours does not.
    blob = Blob((2, 3, 4, 5), backend=host)
    with pytest.raises(BlobIndexError, match=message):
        blob.offset(*args)


def test_offset_argument_types(host: HostBackend) -> None:
    blob = Blob((2, 3), backend=host)
    with pytest.raises(TypeError, match="one sequence only"):
        blob.offset((1, 1), 1)
    with pytest.raises(TypeError, match="must be an int"):
        blob.offset(1, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ints or a sequence of ints"):
        blob.offset("1")  # type: ignore[arg-type]


@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    data=st.data(),
)
def test_offset_matches_numpy_ravel(shape: list[int], data: st.DataObject) -> None:
    blob = Blob(tuple(shape), backend=HostBackend())
    index = tuple(data.draw(st.integers(0, d - 1)) for d in shape)
    expected = int(np.ravel_multi_index(index, shape))
    assert blob.offset(index) == expected
    if len(shape) <= 4:
        assert blob.offset(*index) == expected
    blob.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint32])
def test_data_at_and_diff_at(host: HostBackend, dtype: Any) -> None:
    blob = Blob((2, 3, 4, 5), dtype, backend=host)
    blob.mutable_cpu_data()[...] = np.arange(120).reshape(2, 3, 4, 5)
    blob.mutable_cpu_diff()[...] = 2 * np.arange(120).reshape(2, 3, 4, 5)
    assert blob.data_at(1, 2, 3, 4) == 119
    assert blob.data_at((1, 2, 3, 4)) == 119
    assert blob.data_at(1) == 60
    assert blob.diff_at(1, 0, 1, 2) == 2 * (60 + 5 + 2)
    assert blob.diff_at([0, 1]) == 40
    value = blob.data_at(0, 0, 0, 1)
    assert type(value) is (float if np.dtype(dtype).kind == "f" else int)
    with pytest.raises(BlobIndexError, match="index num=2"):
        blob.data_at(2, 0, 0, 0)


def test_data_at_with_empty_trailing_axis(host: HostBackend) -> None:
    blob = Blob((2, 0), backend=host)
    assert blob.offset((1,)) == 0
    message = r"no element at offset 0 in Blob with shape 2 0 \(0\)"
    with pytest.raises(BlobIndexError, match=message):
        blob.data_at((1,))


# -- typed views and heads ---------------------------------------------------------------------


def test_read_only_views(any_backend: Backend) -> None:
    blob = Blob((2, 3), backend=any_backend)
    ro = blob.cpu_data()
    assert isinstance(ro, np.ndarray)
    assert not ro.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        ro[0, 0] = 1
    rw = blob.mutable_cpu_data()
    assert rw.flags.writeable
    rw[0, 0] = 7
    assert blob.cpu_data()[0, 0] == 7
    assert not blob.cpu_diff().flags.writeable
    assert blob.mutable_cpu_diff().flags.writeable


def test_gpu_accessors_on_host_backend_raise(host: HostBackend) -> None:
    blob = Blob((2, 3), backend=host)
    for name in ("gpu_data", "mutable_gpu_data", "gpu_diff", "mutable_gpu_diff"):
        with pytest.raises(BackendUnavailableError, match="needs a GPU"):
            getattr(blob, name)()
    with pytest.raises(BackendUnavailableError, match="needs a GPU"):
        blob.set_gpu_data(np.zeros((2, 3), np.float32))


def test_gpu_accessors_and_heads(device_backend: Backend) -> None:
    blob = Blob((2, 3, 4), np.float64, backend=device_backend)
    stats0 = device_backend.statistics()
    blob.mutable_cpu_data()[...] = np.arange(24).reshape(2, 3, 4)
    assert blob.data.head is Head.HEAD_AT_CPU
    g = blob.gpu_data()
    assert g.shape == (2, 3, 4)
    assert g.dtype == np.float64
    np.testing.assert_array_equal(to_numpy(g), np.arange(24).reshape(2, 3, 4))
    assert blob.data.head is Head.SYNCED
    if isinstance(g, np.ndarray):
        assert not g.flags.writeable
    gm = blob.mutable_gpu_data()
    assert blob.data.head is Head.HEAD_AT_GPU
    gm *= 2
    np.testing.assert_array_equal(blob.cpu_data(), 2 * np.arange(24).reshape(2, 3, 4))
    assert blob.data.head is Head.SYNCED
    stats = device_backend.statistics()
    assert stats.h2d_copies - stats0.h2d_copies == 1
    assert stats.d2h_copies - stats0.d2h_copies == 1
    gd = blob.mutable_gpu_diff()
    assert gd.shape == (2, 3, 4)
    assert blob.diff.head is Head.HEAD_AT_GPU
    blob.close()


def test_views_cover_only_count_elements(host: HostBackend) -> None:
    blob = Blob((10,), backend=host)
    blob.reshape((3,))
    assert blob.cpu_data().shape == (3,)
    assert blob.nbytes == 12
    assert blob.data.size == 40


def test_set_cpu_data_borrows(host: HostBackend) -> None:
    blob = Blob((2, 3), backend=host)
    external = np.arange(6, dtype=np.float32)
    blob.set_cpu_data(external)
    assert blob.data.head is Head.HEAD_AT_CPU
    np.testing.assert_array_equal(blob.cpu_data(), external.reshape(2, 3))
    blob.mutable_cpu_data()[0, 0] = 42
    assert external[0] == 42
    blob.close()
    assert external[0] == 42  # borrowed: never returned to a pool


def test_set_cpu_data_after_shrink_fits_memories(host: HostBackend) -> None:
    # Caffe (master) replaces data and diff when the sizes differ; we also fix capacity.
    blob = Blob((10,), backend=host)
    blob.reshape((4,))
    external = np.ones(4, np.float32)
    blob.set_cpu_data(external)
    assert blob.capacity == 4
    assert blob.data.size == 16
    assert blob.diff.size == 16
    blob.reshape((5,))  # beyond the new capacity: fresh memory
    assert blob.capacity == 5


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros(6, np.float64), "dtype is float64, this blob's is float32"),
        (np.zeros(5, np.float32), r"has 5 elements, the blob 2 3 \(6\) needs 6"),
        (np.zeros((3, 4), np.float32)[:, :2], "C-contiguous"),
    ],
)
def test_set_cpu_data_validation(host: HostBackend, array: Any, message: str) -> None:
    blob = Blob((2, 3), backend=host)
    with pytest.raises(ShapeError, match=message):
        blob.set_cpu_data(array)


def test_set_cpu_data_needs_an_array(host: HostBackend) -> None:
    blob = Blob((2,), backend=host)
    with pytest.raises(TypeError, match="expects a numpy array, got list"):
        blob.set_cpu_data([1.0, 2.0])  # type: ignore[arg-type]


def test_set_gpu_data(device_backend: Backend) -> None:
    xp = device_backend.xp
    blob = Blob((2, 2), backend=device_backend)
    external = xp.arange(4, dtype=xp.float32)
    blob.set_gpu_data(external)
    assert blob.data.head is Head.HEAD_AT_GPU
    np.testing.assert_array_equal(blob.cpu_data(), [[0, 1], [2, 3]])
    with pytest.raises(ShapeError, match="dtype"):
        blob.set_gpu_data(xp.arange(4, dtype=xp.float64))
    blob.close()


# -- math --------------------------------------------------------------------------------------


def _touch(blob: Blob, which: str, side: str) -> None:
    """A mutable access on ``side`` so the math runs there (as Caffe's tests do)."""
    getattr(blob, f"mutable_{side}_{which}")()


@pytest.mark.parametrize("dtype", FLOATS)
def test_sum_of_squares(any_backend: Backend, dtype: Any) -> None:
    # Caffe: TestSumOfSquares, on each side the backend has.
    blob = Blob((2, 3, 4, 5), dtype, backend=any_backend)
    assert blob.sumsq_data() == 0
    assert blob.sumsq_diff() == 0
    rng = np.random.default_rng(1)
    values = rng.uniform(-3, 3, size=(2, 3, 4, 5)).astype(dtype)
    blob.mutable_cpu_data()[...] = values
    expected = float((values.astype(np.float64) ** 2).sum())
    sides = ["cpu", "gpu"] if any_backend.has_device else ["cpu"]
    for side in sides:
        _touch(blob, "data", side)
        result = blob.sumsq_data()
        assert type(result) is float
        assert result == pytest.approx(expected, rel=1e-6)
        assert blob.sumsq_diff() == 0
    blob.mutable_cpu_diff()[...] = 7 * values
    for side in sides:
        _touch(blob, "diff", side)
        assert blob.sumsq_diff() == pytest.approx(expected * 49, rel=1e-6)
    blob.close()


@pytest.mark.parametrize("dtype", FLOATS)
def test_asum(any_backend: Backend, dtype: Any) -> None:
    # Caffe: TestAsum
    blob = Blob((2, 3, 4, 5), dtype, backend=any_backend)
    assert blob.asum_data() == 0
    assert blob.asum_diff() == 0
    values = np.random.default_rng(2).uniform(-3, 3, size=(2, 3, 4, 5)).astype(dtype)
    blob.mutable_cpu_data()[...] = values
    expected = float(np.abs(values.astype(np.float64)).sum())
    sides = ["cpu", "gpu"] if any_backend.has_device else ["cpu"]
    for side in sides:
        _touch(blob, "data", side)
        assert blob.asum_data() == pytest.approx(expected, rel=1e-6)
        assert blob.asum_diff() == 0
    blob.mutable_cpu_diff()[...] = 7 * values
    for side in sides:
        _touch(blob, "diff", side)
        assert blob.asum_diff() == pytest.approx(expected * 7, rel=1e-6)
    blob.close()


@pytest.mark.parametrize("dtype", FLOATS)
def test_scale_data_and_diff(any_backend: Backend, dtype: Any) -> None:
    # Caffe: TestScaleData
    sides = ["cpu", "gpu"] if any_backend.has_device else ["cpu"]
    for side in sides:
        blob = Blob((2, 3, 4, 5), dtype, backend=any_backend)
        blob.scale_data(3)  # uninitialised: nothing happens
        assert blob.data.head is Head.UNINITIALIZED
        values = np.random.default_rng(3).uniform(-3, 3, size=(2, 3, 4, 5)).astype(dtype)
        blob.mutable_cpu_data()[...] = values
        before = blob.asum_data()
        _touch(blob, "data", side)
        blob.scale_data(3)
        assert blob.asum_data() == pytest.approx(before * 3, rel=1e-6)
        assert blob.asum_diff() == 0
        blob.mutable_cpu_diff()[...] = 7 * blob.cpu_data()
        _touch(blob, "diff", side)
        blob.scale_diff(3)
        assert blob.asum_diff() == pytest.approx(before * 3 * 7 * 3, rel=1e-6)
        np.testing.assert_allclose(blob.cpu_diff(), values * 63, rtol=1e-5)
        blob.close()


@pytest.mark.parametrize("dtype", FLOATS)
def test_update_on_host(host: HostBackend, dtype: Any) -> None:
    blob = Blob((3, 4), dtype, backend=host)
    blob.mutable_cpu_data()[...] = 10
    blob.mutable_cpu_diff()[...] = np.arange(12).reshape(3, 4)
    blob.update()
    np.testing.assert_array_equal(blob.cpu_data(), 10 - np.arange(12).reshape(3, 4))
    assert blob.data.head is Head.HEAD_AT_CPU


@pytest.mark.parametrize("head", ["gpu", "synced"])
def test_update_on_device_stays_on_device(device_backend: Backend, head: str) -> None:
    blob = Blob((3, 4), backend=device_backend)
    xp = device_backend.xp
    if head == "gpu":
        blob.mutable_gpu_data()[...] = 10
    else:
        blob.mutable_cpu_data()[...] = 10
        blob.gpu_data()
        assert blob.data.head is Head.SYNCED
    blob.mutable_gpu_diff()[...] = xp.arange(12, dtype=xp.float32).reshape(3, 4)
    d2h = device_backend.statistics().d2h_copies
    blob.update()
    assert blob.data.head is Head.HEAD_AT_GPU  # computed on the device
    assert device_backend.statistics().d2h_copies == d2h  # no trip to the host
    np.testing.assert_array_equal(blob.cpu_data(), 10 - np.arange(12).reshape(3, 4))
    blob.close()


def test_update_uninitialised_raises(host: HostBackend) -> None:
    # Caffe: LOG(FATAL) << "Syncedmem not initialized."
    blob = Blob((2,), backend=host)
    with pytest.raises(StateError, match=r"never initialised.*mutable_cpu_data\(\)"):
        blob.update()


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("update", ()),
        ("asum_data", ()),
        ("asum_diff", ()),
        ("sumsq_data", ()),
        ("sumsq_diff", ()),
        ("scale_data", (2,)),
        ("scale_diff", (2,)),
    ],
)
def test_math_on_integer_blobs_is_not_implemented(
    host: HostBackend, dtype: Any, method: str, args: tuple[Any, ...]
) -> None:
    blob = Blob((2,), dtype, backend=host)
    blob.mutable_cpu_data()[...] = 1
    name = np.dtype(dtype).name
    message = rf"{method}\(\) is not implemented for {name}"
    with pytest.raises(UnsupportedOperationError, match=message):
        getattr(blob, method)(*args)
    with pytest.raises(TypeError):
        getattr(blob, method)(*args)


# -- sharing -------------------------------------------------------------------------------------


def test_share_data_and_diff(any_backend: Backend) -> None:
    a = Blob((2, 3), backend=any_backend)
    b = Blob((3, 2), backend=any_backend)  # same count, other shape: allowed
    b.share_data(a)
    assert b.data is a.data
    assert b.diff is not a.diff
    a.mutable_cpu_data()[...] = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(b.cpu_data(), np.arange(6).reshape(3, 2))
    b.share_diff(a)
    assert b.diff is a.diff
    b.mutable_cpu_diff()[0, 1] = 5
    assert a.diff_at(0, 1) == 5
    a.close()
    b.close()


def test_share_data_refcounts_memory(host: HostBackend) -> None:
    pool = get_pool(host, "host")
    a = Blob((4,), backend=host)
    b = Blob((4,), backend=host)
    a.mutable_cpu_data()[...] = 3
    own = b.data
    b.share_data(a)
    assert own.closed  # b's own data memory had no other user
    a.close()  # b still uses a's data
    assert not b.data.closed
    np.testing.assert_array_equal(b.cpu_data(), [3, 3, 3, 3])
    b.close()
    assert pool.statistics().used_bytes == 0


def test_share_data_then_reshape_beyond_capacity_ends_sharing(host: HostBackend) -> None:
    a = Blob((4,), backend=host)
    b = Blob((2, 8), backend=host)
    b.reshape((4,))
    b.share_data(a)
    assert b.capacity == 4  # limited by the shared memory
    b.reshape((8,))
    assert b.data is not a.data
    assert not a.data.closed


def test_share_errors(host: HostBackend) -> None:
    a = Blob((2, 3), backend=host)
    with pytest.raises(ShapeError, match=r"counts differ, this blob 5 \(5\), the other 2 3 \(6\)"):
        Blob((5,), backend=host).share_data(a)
    with pytest.raises(ShapeError, match="dtype mismatch"):
        Blob((6,), np.float64, backend=host).share_diff(a)
    with pytest.raises(UnsupportedOperationError, match="different backends"):
        Blob((6,), backend=HostBackend()).share_data(a)
    with pytest.raises(TypeError, match="expects a Blob"):
        a.share_data(np.zeros(6))  # type: ignore[arg-type]


# -- copy_from ---------------------------------------------------------------------------------


def test_copy_from_data_and_diff(any_backend: Backend) -> None:
    src = filled((2, 3), any_backend)
    src.mutable_cpu_diff()[...] = 9
    dst = Blob((2, 3), backend=any_backend)
    dst.copy_from(src)
    np.testing.assert_array_equal(dst.cpu_data(), src.cpu_data())
    assert dst.asum_diff() == 0
    dst.copy_from(src, copy_diff=True)
    np.testing.assert_array_equal(dst.cpu_diff(), np.full((2, 3), 9))


def test_copy_from_shape_mismatch(host: HostBackend) -> None:
    src = filled((2, 3), host)
    dst = Blob((3, 2), backend=host)
    message = r"different shapes, source 2 3 \(6\), destination 3 2 \(6\)"
    with pytest.raises(ShapeError, match=message):
        dst.copy_from(src)
    dst.copy_from(src, reshape=True)
    assert dst.shape == (2, 3)
    np.testing.assert_array_equal(dst.cpu_data(), src.cpu_data())
    with pytest.raises(ShapeError, match="dtype mismatch"):
        Blob((2, 3), np.float64, backend=host).copy_from(src)


def test_copy_from_runs_on_device_when_source_head_is_there(device_backend: Backend) -> None:
    src = filled((4, 5), device_backend)
    src.mutable_gpu_data()  # head at the GPU
    dst = Blob((4, 5), backend=device_backend)
    before = device_backend.statistics()
    dst.copy_from(src)
    after = device_backend.statistics()
    assert after.d2h_copies == before.d2h_copies  # no trip through the host
    assert dst.data.head is Head.HEAD_AT_GPU
    np.testing.assert_array_equal(dst.cpu_data(), src.cpu_data())


def test_copy_from_across_backends(device_backend: Backend) -> None:
    src = filled((3,), device_backend)
    src.mutable_gpu_data()
    dst = Blob((3,), backend=HostBackend())
    dst.copy_from(src)
    np.testing.assert_array_equal(dst.cpu_data(), src.cpu_data())


def test_copy_from_empty(host: HostBackend) -> None:
    dst = Blob(backend=host)
    dst.copy_from(Blob((0, 3), backend=host), reshape=True)
    assert dst.shape == (0, 3)


# -- protobuf ------------------------------------------------------------------------------------


def _proto(dims: list[int], **fields: Any) -> Any:
    return caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=dims), **fields)


def test_legacy_proto_shape_equals(host: HostBackend) -> None:
    # Caffe: TestLegacyBlobProtoShapeEquals
    blob = Blob(backend=host)
    proto = caffe_pb2.BlobProto()
    blob.reshape((3, 2))
    proto.num, proto.channels, proto.height, proto.width = 1, 1, 3, 2
    assert blob.shape_equals(proto)
    proto.num = 0
    assert not blob.shape_equals(proto)
    proto.num = 3
    assert not blob.shape_equals(proto)
    blob.reshape((1, 3, 2))
    proto.num = 1
    assert blob.shape_equals(proto)
    blob.reshape((2, 3, 2))
    assert not blob.shape_equals(proto)
    blob.reshape((1, 1, 1, 3, 2))  # more than 4 axes never equals a legacy shape
    assert not blob.shape_equals(proto)


def test_shape_equals_new_field(host: HostBackend) -> None:
    blob = Blob((3, 2), backend=host)
    assert blob.shape_equals(caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[3, 2])))
    assert not blob.shape_equals(caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[1, 3, 2])))


@pytest.mark.parametrize("dtype", FLOATS)
def test_proto_round_trip(any_backend: Backend, dtype: Any) -> None:
    src = filled((2, 3, 4), any_backend, dtype)
    src.mutable_cpu_diff()[...] = -src.cpu_data()
    if any_backend.has_device:
        src.mutable_gpu_data()  # to_proto reads the data back from the device
    proto = src.to_proto(write_diff=True)
    assert list(proto.shape.dim) == [2, 3, 4]
    assert not proto.HasField("num")
    double = np.dtype(dtype) == np.float64
    assert len(proto.double_data if double else proto.data) == 24
    assert len(proto.data if double else proto.double_data) == 0
    assert len(proto.double_diff if double else proto.diff) == 24
    dst = Blob(dtype=dtype, backend=any_backend)
    dst.from_proto(caffe_pb2.BlobProto.FromString(proto.SerializeToString()))
    assert dst.shape == (2, 3, 4)
    np.testing.assert_array_equal(dst.cpu_data(), src.cpu_data())
    np.testing.assert_array_equal(dst.cpu_diff(), src.cpu_diff())


def test_to_proto_without_diff_and_into_given_proto(host: HostBackend) -> None:
    blob = filled((2, 2), host)
    target = caffe_pb2.BlobProto(num=1, channels=1, height=2, width=2, double_data=[1, 2, 3, 4])
    result = blob.to_proto(proto=target)
    assert result is target
    assert not target.HasField("num")  # cleared: the legacy fields would win on reading
    assert len(target.double_data) == 0
    assert len(target.diff) == 0
    np.testing.assert_array_equal(np.array(target.data, np.float32), blob.cpu_data().ravel())


def test_from_proto_legacy_fields_win(host: HostBackend) -> None:
    proto = caffe_pb2.BlobProto(
        num=1, channels=2, height=1, width=3, shape=caffe_pb2.BlobShape(dim=[6]), data=range(6)
    )
    blob = Blob(backend=host)
    blob.from_proto(proto)
    assert blob.shape == (1, 2, 1, 3)
    # Unset legacy fields read 0, as in Caffe.
    only_channels = caffe_pb2.BlobProto(channels=3)
    blob.from_proto(only_channels)
    assert blob.shape == (0, 3, 0, 0)


def test_from_proto_double_data_into_float_blob(host: HostBackend) -> None:
    proto = caffe_pb2.BlobProto(
        shape=caffe_pb2.BlobShape(dim=[2]), data=[9, 9], double_data=[0.5, 1.25]
    )
    blob = Blob(backend=host)
    blob.from_proto(proto)
    np.testing.assert_array_equal(blob.cpu_data(), np.array([0.5, 1.25], np.float32))


def test_from_proto_without_reshape(host: HostBackend) -> None:
    blob = Blob((3, 2), backend=host)
    legacy = caffe_pb2.BlobProto(num=1, channels=1, height=3, width=2, data=range(6))
    blob.from_proto(legacy, reshape=False)
    assert blob.shape == (3, 2)  # kept
    np.testing.assert_array_equal(blob.cpu_data().ravel(), np.arange(6))
    other = caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[2, 3]), data=range(6))
    message = r"shape mismatch \(reshape not set\): blob 3 2 \(6\), proto 2 3"
    with pytest.raises(ShapeError, match=message):
        blob.from_proto(other, reshape=False)


def test_from_proto_keeps_diff_when_proto_has_none(host: HostBackend) -> None:
    blob = Blob((2,), backend=host)
    blob.mutable_cpu_diff()[...] = 4
    blob.from_proto(caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[2]), data=[1, 2]))
    np.testing.assert_array_equal(blob.cpu_diff(), [4, 4])


@pytest.mark.parametrize(
    ("proto", "message"),
    [
        (_proto([2, 3], data=range(5)), r"2 3 \(6\) has 5 values in data, expected 6"),
        (_proto([2], double_data=[1.0]), "has 1 values in double_data, expected 2"),
        (_proto([2], data=[1, 2], diff=[1]), r"1 values in diff, expected 2 \(or none\)"),
        (_proto([2, -1]), "unusable shape: dimension 1 .* >= 0"),
        (_proto([1] * 33), "unusable shape: .*at most 32 axes"),
        (caffe_pb2.BlobProto(num=-1, channels=1, height=1, width=1), "unusable shape"),
    ],
)
def test_from_proto_rejects_bad_protos(host: HostBackend, proto: Any, message: str) -> None:
    blob = Blob((4,), backend=host)
    with pytest.raises(ProtoError, match=message):
        blob.from_proto(proto)
    assert blob.shape == (4,)  # validated before anything changed


def test_from_proto_huge_claimed_shape_allocates_nothing(host: HostBackend) -> None:
    pool = get_pool(host, "host")
    blob = Blob(backend=host)
    proto = caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[2**20, 2**20, 2**10]))
    with pytest.raises(ProtoError, match="has 0 values in data, expected 1125899906842624"):
        blob.from_proto(proto)
    assert pool.statistics().allocations == 0


@pytest.mark.parametrize("dtype", INTS)
def test_integer_blobs_have_no_proto_form(host: HostBackend, dtype: Any) -> None:
    blob = Blob((2,), dtype, backend=host)
    with pytest.raises(UnsupportedOperationError, match="no integer fields"):
        blob.to_proto()
    with pytest.raises(UnsupportedOperationError, match="float or double values"):
        blob.from_proto(caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[2]), data=[1, 2]))


# -- lifetime ----------------------------------------------------------------------------------


def test_close_returns_blocks_and_blocks_access(any_backend: Backend) -> None:
    host_pool = get_pool(any_backend, "host")
    blob = Blob((8, 8), backend=any_backend)
    blob.mutable_cpu_data()[...] = 1
    blob.cpu_diff()
    if any_backend.has_device:
        blob.gpu_data()
    assert host_pool.statistics().used_bytes > 0
    blob.close()
    blob.close()  # idempotent
    assert blob.closed
    assert host_pool.statistics().used_bytes == 0
    if any_backend.has_device:
        assert get_pool(any_backend, "device").statistics().used_bytes == 0
    for name in ("cpu_data", "mutable_cpu_diff", "asum_data", "update", "to_proto"):
        with pytest.raises(StateError, match=r"this Blob \(shape 8 8 \(64\)\) was closed"):
            getattr(blob, name)()
    with pytest.raises(StateError, match="was closed"):
        _ = blob.data
    with pytest.raises(StateError, match="was closed"):
        blob.reshape((2,))
    with pytest.raises(StateError, match="was closed"):
        Blob((8, 8), backend=any_backend).copy_from(blob)
    assert blob.shape == (8, 8)  # metadata stays readable
    assert "closed" in repr(blob)


def test_context_manager(host: HostBackend) -> None:
    pool = get_pool(host, "host")
    with Blob((4,), backend=host) as blob:
        blob.mutable_cpu_data()[...] = 1
        assert pool.statistics().used_bytes > 0
    assert blob.closed
    assert pool.statistics().used_bytes == 0


def test_finalizer_is_a_safety_net(host: HostBackend) -> None:
    pool = get_pool(host, "host")
    blob = Blob((16,), backend=host)
    blob.mutable_cpu_data()
    assert pool.statistics().used_bytes > 0
    del blob
    gc.collect()
    assert pool.statistics().used_bytes == 0


def test_repr(host: HostBackend) -> None:
    assert repr(Blob((2, 3), backend=host)) == "<Blob float32 (2, 3) on host>"
    assert repr(Blob(dtype=np.int32, backend=host)) == "<Blob int32 unshaped on host>"


def test_default_backend_is_resolved_lazily() -> None:
    """``import blobpipe`` resolves no backend: a bad BLOBPIPE_DEVICE fails only when a
    Blob without a backend is made, and a good one is what that Blob gets."""
    code = (
        "import blobpipe\n"
        "try:\n"
        "    blobpipe.Blob((2,))\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
    )
    env = {**os.environ, "BLOBPIPE_DEVICE": "bogus"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "refused: unknown device 'bogus'" in out.stdout
    env["BLOBPIPE_DEVICE"] = "cpu"
    code = "import blobpipe\nprint(blobpipe.Blob((2,)).backend.name)\n"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "host", out.stderr


# -- DLPack ---------------------------------------------------------------------------------------


def test_dlpack_on_host_is_zero_copy(host: HostBackend) -> None:
    blob = filled((2, 3), host)
    assert blob.__dlpack_device__() == (1, 0)
    arr = np.from_dlpack(blob)
    assert arr.shape == (2, 3)
    assert arr.dtype == np.float32
    arr[0, 0] = 123
    assert blob.data_at(0, 0) == 123  # same memory
    assert blob.data.head is Head.HEAD_AT_CPU


def test_dlpack_exports_the_device_side_when_the_head_is_there() -> None:
    backend = EmulatedBackend()
    blob = filled((4,), backend)
    blob.gpu_data()  # SYNCED: the device side is exported
    arr = np.from_dlpack(blob)
    assert blob.data.head is Head.HEAD_AT_GPU  # a writable alias moves the head
    arr[:] = 5
    np.testing.assert_array_equal(blob.cpu_data(), [5, 5, 5, 5])  # it was the device buffer
    blob.close()


def test_dlpack_unshaped_blob(host: HostBackend) -> None:
    with pytest.raises(StateError, match="no shape yet"):
        np.from_dlpack(Blob(backend=host))


@pytest.mark.gpu
def test_dlpack_cupy_device() -> None:
    from tests.conftest import cupy_backend_or_skip

    backend = cupy_backend_or_skip()
    blob = filled((4,), backend)
    blob.mutable_gpu_data()
    assert blob.__dlpack_device__()[0] == 2  # kDLCUDA
    cp = backend.xp
    arr = cp.from_dlpack(blob)
    arr += 1
    np.testing.assert_allclose(to_numpy(arr), blob.cpu_data())
    blob.close()


# -- the example -------------------------------------------------------------------------------


def test_blob_basics_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    example = runpy.run_path(str(EXAMPLES / "blob_basics.py"), run_name="example")
    assert example["main"]() == 0
    out = capsys.readouterr().out
    assert "all as the tutorial says" in out
    assert "differs" not in out


def test_bench_runs_quickly(capsys: pytest.CaptureFixture[str]) -> None:
    bench = runpy.run_path(str(EXAMPLES.parent / "bench" / "bench_blob.py"), run_name="bench")
    assert bench["main"](["--quick"]) == 0
    assert "reshape within capacity" in capsys.readouterr().out


def test_a_view_shares_memory_and_outlives_source() -> None:
    src = Blob((2, 3), backend="cpu")
    src.mutable_cpu_data()[:] = 4
    view = src.view()
    assert view.shape == (2, 3) and view.dtype == src.dtype
    assert np.shares_memory(view.cpu_data(), src.cpu_data())
    src.close()  # the view keeps the memory alive
    assert view.cpu_data().tolist() == [[4.0] * 3] * 2
    view.close()
    with pytest.raises(StateError, match="closed"):
        view.cpu_data()


def test_a_host_export_keeps_its_memory_from_the_pool(host: HostBackend) -> None:
    """An array exported through DLPack holds the memory: closing the blob does not let
    the pool hand the bytes to another blob while the array lives; they go back when
    it does."""
    backend = host
    pool = get_pool(backend, "host")
    blob = Blob((1000,), np.float32, backend=backend)
    blob.mutable_cpu_data()[:] = 1.5
    view = np.from_dlpack(blob)
    used = pool.statistics().used_bytes
    blob.close()
    gc.collect()
    assert pool.statistics().used_bytes == used  # still held by the view
    other = Blob((1000,), np.float32, backend=backend)
    other.mutable_cpu_data()[:] = 7.0
    assert (view == 1.5).all()  # not the other blob's bytes
    other.close()
    del view
    gc.collect()
    assert pool.statistics().used_bytes < used
