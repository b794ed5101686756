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
@given(st.integers(0, 1 << 40), st.integers(-3, 1100))
def test_span_is_arange(a: int, n: int) -> None:
    """Both sides of the 500 that a slice of the cached range covers (and an empty
    span, whichever way round)."""
    got = span(a, a + n)
    want = np.arange(a, a + n, dtype=np.int64)
    assert got.dtype == np.int64 and got.shape == want.shape
    for edge in (499, 500, 501):
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
