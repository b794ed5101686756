"""Per-batch Python keeps the GIL outside the kernel (``docs/design.md``, "Per-batch
Python keeps the GIL"): the helpers that replace the NumPy and OS calls that release it for a few
microseconds (``np.arange``, a gather of rows of a 2-D array, ``mmap.size``/``os.fstat``)
give the same results as those calls, in every case a batch can hand them."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blobpipe
from blobpipe._io._index import RecordIndex
from blobpipe._io._kernels import row_kernel
from blobpipe._io._plan import read_only, span


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1 << 40), st.integers(-3, 4100))
def test_span_is_arange(a: int, n: int) -> None:
    """Both sides of the 500 that a slice of the cached range covers, of the 4,000
    made in additions of 500 (and an empty span, whichever way round)."""
    got = span(a, a + n)
    want = np.arange(a, a + n, dtype=np.int64)
    assert got.dtype == np.int64 and got.shape == want.shape
    for edge in (499, 500, 501, 999, 1000, 1001, 3999, 4000, 4001):
        np.testing.assert_array_equal(span(a, a + edge), np.arange(a, a + edge))
    np.testing.assert_array_equal(got, want)
    read_only(got)  # a new array each time: made read-only, nothing else is
    again = span(a, a + n)
    assert again.flags.writeable and again is not got
    if n > 0:
        again[0] = -1  # writing one leaves the next span whole
        assert span(a, a + n)[0] == a


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 200), st.data())
def test_located_shapes_are_the_rows_of_the_shape_array(n: int, data: st.DataObject) -> None:
    index = RecordIndex(np.zeros(8, np.uint8), np.zeros(n, np.int64), np.zeros(n, np.int64))
    index._shape[:] = np.arange(3 * n, dtype=np.int32).reshape(n, 3)
    rows = np.asarray(
        data.draw(st.lists(st.integers(0, n - 1), max_size=70)) if n else [], dtype=np.intp
    )
    got = index.locate(rows).shape
    assert got.dtype == np.int32 and got.shape == (len(rows), 3)
    np.testing.assert_array_equal(got, index._shape[rows])
    assert not np.shares_memory(got, index._shape)  # a copy, as the 2-D gather's


def _kernel_or_skip() -> object:
    kernel = row_kernel()
    if kernel is None:
        pytest.skip("the compiled row kernel is not built here")
    return kernel


def test_file_size_is_fstat_and_follows_a_truncation(tmp_path: Path) -> None:
    kernel = _kernel_or_skip()
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10_000)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert kernel.file_size(fd) == os.fstat(fd).st_size == 10_000  # type: ignore[attr-defined]
        os.truncate(path, 123)
        assert kernel.file_size(fd) == 123  # type: ignore[attr-defined]
    finally:
        os.close(fd)
    with pytest.raises(OSError, match="Bad file descriptor"):
        kernel.file_size(fd)  # type: ignore[attr-defined]  # closed
    with pytest.raises(ValueError, match="not a file descriptor"):
        kernel.file_size(-1)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="not a file descriptor"):
        kernel.file_size(1 << 40)  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        kernel.file_size("3")  # type: ignore[attr-defined]


def test_an_open_reader_holds_its_data_file_open_until_the_last_one_closes(
    tmp_path: Path,
) -> None:
    """The descriptor the shrink check stats is the mapped file's, and goes with the map."""
    _kernel_or_skip()
    db = tmp_path / "db"
    blobpipe.write_lmdb(str(db), [(np.zeros((1, 2, 2), np.uint8), 0)] * 3)
    first = blobpipe.LmdbReader(str(db))
    second = blobpipe.LmdbReader(str(db))
    shared = first._shared
    assert shared is second._shared and shared.fd is not None
    fd = shared.fd
    data = os.stat(db / "data.mdb")
    assert (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == (data.st_dev, data.st_ino)
    assert shared.shrunk() is None
    first.close()
    assert shared.fd == fd and os.fstat(fd).st_ino == data.st_ino  # still in use
    second.close()
    assert shared.fd is None
    # closed: the number is free, or another file's now
    link = Path(f"/proc/self/fd/{fd}")
    assert not link.exists() or os.stat(link).st_ino != data.st_ino


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([np.int64, np.int32, np.uint64, np.float32]),
    st.integers(1, 3000),
    st.lists(st.integers(0, 2999), min_size=0, max_size=1500),
)
def test_gather_is_numpys_take(dtype: type, n: int, rows: list[int]) -> None:
    """The index's gather (the row kernel's ``take`` beyond 500 rows) gives
    ``src[rows]``: every item size it takes, both sides of 500 rows."""
    from blobpipe._io._index import gather

    src = np.arange(n).astype(dtype) * 3
    at = np.array([r % n for r in rows], np.intp)
    got = gather(src, at)
    assert got.dtype == src.dtype and np.array_equal(got, src[at])


def test_take_in_c_checks_its_arrays() -> None:
    kernel = _kernel_or_skip()
    src = np.arange(10, dtype=np.int64)
    with pytest.raises(IndexError, match="row 1 is 10"):
        kernel.take(src, np.array([0, 10], np.intp), np.empty(2, np.int64))  # type: ignore[attr-defined]
    with pytest.raises(IndexError, match="row 0 is -1"):
        kernel.take(src, np.array([-1], np.intp), np.empty(1, np.int64))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="4 or 8 bytes"):
        kernel.take(src.astype(np.int16), np.array([0], np.intp), np.empty(1, np.int16))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="the same in both"):
        kernel.take(src, np.array([0], np.intp), np.empty(1, np.int32))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="one item per row"):
        kernel.take(src, np.array([0, 1], np.intp), np.empty(3, np.int64))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="intp"):
        kernel.take(src, np.array([0], np.int32), np.empty(1, np.int64))  # type: ignore[attr-defined]


@given(st.integers(0, 5000), st.integers(-(2**62), 2**62))
def test_column_and_zero_words_are_full_and_zeros(n: int, value: int) -> None:
    """A plan's epochs column and zero words equal ``np.full`` and ``np.zeros``, are
    read-only, and a later longer request leaves earlier zero words intact."""
    from blobpipe._io._kernels import shared_zeros
    from blobpipe._io._plan import column

    col = column(n, value)
    assert col.dtype == np.int64 and np.array_equal(col, np.full(n, value, np.int64))
    assert not col.flags.writeable
    zeros = shared_zeros(n, np.uint64)
    assert zeros.dtype == np.uint64 and zeros.flags.c_contiguous and not zeros.flags.writeable
    assert np.array_equal(zeros, np.zeros(n, np.uint64))
    longer = shared_zeros(2 * n + 7, np.uint64)
    assert len(longer) == 2 * n + 7 and not longer.any() and not zeros.any()
