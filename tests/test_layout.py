"""NCHW (Caffe's layout) and NHWC conversion and offsets."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from blobpipe._backends import Backend, HostBackend
from blobpipe._blob import Blob
from blobpipe._errors import BlobIndexError, ShapeError
from blobpipe._layout import nchw_offset, nchw_to_nhwc, nhwc_offset, nhwc_to_nchw
from tests.conftest import to_numpy

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_worked_offset() -> None:
    shape = (4, 3, 8, 16)
    assert nchw_offset(shape, 2, 1, 3, 9) == ((2 * 3 + 1) * 8 + 3) * 16 + 9 == 953
    assert nhwc_offset(shape, 2, 1, 3, 9) == ((2 * 8 + 3) * 16 + 9) * 3 + 1 == 940
    blob = Blob(shape, backend=HostBackend())
    assert blob.offset(2, 1, 3, 9) == 953


@given(
    shape=st.tuples(*[st.integers(1, 5)] * 4),
    data=st.data(),
)
def test_offsets_address_the_same_element(
    shape: tuple[int, int, int, int], data: st.DataObject
) -> None:
    n, c, h, w = (data.draw(st.integers(0, d - 1)) for d in shape)
    nchw = np.arange(int(np.prod(shape))).reshape(shape)
    nhwc = nchw_to_nhwc(nchw)
    assert nchw.ravel()[nchw_offset(shape, n, c, h, w)] == nchw[n, c, h, w]
    assert nhwc.ravel()[nhwc_offset(shape, n, c, h, w)] == nchw[n, c, h, w]


def test_offset_errors() -> None:
    with pytest.raises(BlobIndexError, match=r"index c=3 out of range \[0, 3\)"):
        nchw_offset((1, 3, 2, 2), 0, 3, 0, 0)
    with pytest.raises(BlobIndexError, match="index n=-1"):
        nhwc_offset((1, 3, 2, 2), -1, 0, 0, 0)
    with pytest.raises(ShapeError, match="4-D shape"):
        nchw_offset((3, 2, 2), 0, 0, 0, 0)  # type: ignore[arg-type]


def test_conversion_shapes_and_contiguity(any_backend: Backend) -> None:
    xp = any_backend.xp if any_backend.has_device else np
    x = xp.arange(2 * 3 * 4 * 5, dtype=xp.float32).reshape(2, 3, 4, 5)
    y = nchw_to_nhwc(x)
    assert y.shape == (2, 4, 5, 3)
    assert y.flags.c_contiguous
    assert float(y[1, 2, 3, 0]) == float(x[1, 0, 2, 3])
    back = nhwc_to_nchw(y)
    assert back.shape == (2, 3, 4, 5)
    assert back.flags.c_contiguous
    np.testing.assert_array_equal(to_numpy(back), to_numpy(x))


def test_conversion_of_single_images() -> None:
    chw = np.arange(3 * 4 * 5).reshape(3, 4, 5)
    hwc = nchw_to_nhwc(chw)
    assert hwc.shape == (4, 5, 3)
    np.testing.assert_array_equal(hwc[..., 2], chw[2])
    np.testing.assert_array_equal(nhwc_to_nchw(hwc), chw)


def test_conversion_without_copy_is_a_view() -> None:
    x = np.zeros((1, 3, 2, 2))
    view = nchw_to_nhwc(x, copy=False)
    assert not view.flags.c_contiguous
    view[0, 1, 1, 2] = 7
    assert x[0, 2, 1, 1] == 7


@pytest.mark.parametrize("shape", [(3,), (2, 3), (1, 2, 3, 4, 5)])
def test_conversion_rejects_other_ranks(shape: tuple[int, ...]) -> None:
    with pytest.raises(ShapeError, match=rf"4-D batch or a 3-D image, got .*{shape}"):
        nchw_to_nhwc(np.zeros(shape))
    with pytest.raises(ShapeError, match="nhwc_to_nchw"):
        nhwc_to_nchw(np.zeros(shape))


def test_rgb_to_gray_in_both_layouts() -> None:
    # BT.601 luma. Caffe's Datums are BGR: channel 0 is blue.
    weights_bgr = np.array([0.114, 0.587, 0.299], np.float32)
    rng = np.random.default_rng(0)
    nchw = rng.integers(0, 256, size=(2, 3, 8, 16)).astype(np.float32)
    gray_nchw = np.einsum("nchw,c->nhw", nchw, weights_bgr)
    nhwc = nchw_to_nhwc(nchw)
    gray_nhwc = nhwc @ weights_bgr
    np.testing.assert_allclose(gray_nchw, gray_nhwc, rtol=1e-6)
    pixel = nchw[1, :, 3, 9]
    assert gray_nchw[1, 3, 9] == pytest.approx(float(pixel @ weights_bgr), rel=1e-6)


def test_layout_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    example = runpy.run_path(str(EXAMPLES / "layout.py"), run_name="example")
    assert example["main"]() == 0
    out = capsys.readouterr().out
    assert "= 953" in out
    assert "= 940" in out
