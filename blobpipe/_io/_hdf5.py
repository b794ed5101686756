"""Caffe's HDF5Data layer as sources: a list of ``.h5`` files, one dataset per top.

``HDF5DataLayer`` (``layers/hdf5_data_layer.cpp``, ``util/hdf5.cpp``), kept exactly:

* the source list is split on white space (``ifstream >> string``): paths cannot
  hold spaces, blank lines are nothing; paths are relative to the working directory;
* each top is the dataset of that name in every file, of at least one axis and of
  HDF5's float or integer class, read converted to float32 by HDF5 itself
  (``H5LTread_dataset_float``; float64 for ``blob_dtype="float64"``, Caffe's double);
  a top's rows are ``dims[1:]``, so an ``(N, 1)`` label dataset gives ``(B, 1)``;
* rows are walked file by file in list order; a batch runs across a file's end, and
  after the last file it wraps to the first mid-batch (``mode="wrap"``); there is
  no transform.

Caffe checks that the datasets of one file share their first dimension; blobpipe
also checks, at open, that a top's rows have one shape in every file (Caffe would
copy the wrong bytes) and that no file is empty. ``shuffle: true`` draws Caffe's
order from C's ``rand()``, which Caffe never seeds; here it is ``order="shuffle"``
with a seed, over all rows.

Each file's datasets are read whole when a batch first needs them, as Caffe does,
and the last two files read are kept.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, overload

import numpy as np
import numpy.typing as npt

from .._codec import blobproto_bytes
from .._errors import ArgumentError, DataError, FileMissingError, MissingDependencyError
from ._fill import Part, store_geometry
from ._kernels import Deferral, Geometry
from ._plan import BatchPlan
from ._records import BLOBPROTO, RecordKind
from ._transform import Phase, Transform

__all__ = ["Hdf5Data"]

_KEPT_FILES: Final = 2


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as exc:
        raise MissingDependencyError(
            "reading HDF5 files (Caffe's HDF5Data layer) needs h5py: "
            "pip install 'blobpipe[hdf5]' (or pip install h5py)"
        ) from exc
    return h5py


class _Files:
    """The files of the list, what each holds, and the datasets read so far."""

    def __init__(self, paths: list[str], tops: tuple[str, ...], listed_in: str | None) -> None:
        h5py = _h5py()
        self.paths = paths
        self.tops = tops
        self.rows: list[int] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[int, str, str], np.ndarray] = OrderedDict()
        where = f" (listed in {listed_in!r})" if listed_in else ""
        for path in paths:
            try:
                f = h5py.File(path, "r")
            except FileNotFoundError as exc:
                raise FileMissingError(f"the HDF5 file{where} does not exist", path=path) from exc
            except OSError as exc:
                raise DataError(f"cannot open {path!r}{where} as an HDF5 file: {exc}") from exc
            with f:
                self.rows.append(self._check(f, path))
        self.starts = np.cumsum([0, *self.rows], dtype=np.int64)
        self._prefixes = [b"%08d_%s[" % (f, os.fsencode(p)) for f, p in enumerate(paths)]

    def _check(self, f: Any, path: str) -> int:
        """The rows of file ``f``, its datasets checked (see the module docstring)."""
        h5py = _h5py()
        first: tuple[str, int] | None = None
        for top in self.tops:
            ds = f.get(top)
            if not isinstance(ds, h5py.Dataset):
                held = ", ".join(repr(k) for k in f) or "nothing"
                raise DataError(
                    f"{path!r} has no dataset {top!r} (it holds {held}): each top of an "
                    "HDF5Data layer is a dataset of that name in every file; rename the "
                    "dataset or the top"
                )
            if ds.ndim < 1 or ds.dtype.kind not in "fiu":
                raise DataError(
                    f"dataset {top!r} of {path!r} is {ds.dtype} of shape {ds.shape}; Caffe "
                    "reads datasets of at least one axis holding floats or integers: "
                    "write it so"
                )
            n, shape = int(ds.shape[0]), tuple(int(d) for d in ds.shape[1:])
            if first is None:
                first = (top, n)
            elif n != first[1]:
                raise DataError(
                    f"in {path!r}, dataset {top!r} has {n} rows but {first[0]!r} has "
                    f"{first[1]}: a file's datasets are read row by row together, so their "
                    "first dimensions must be equal (Caffe aborts here)"
                )
            seen = self.shapes.setdefault(top, shape)
            if shape != seen:
                raise DataError(
                    f"dataset {top!r} has rows of shape {shape} in {path!r} but {seen} in "
                    f"{self.paths[0]!r}: a top's rows share one shape in every file (Caffe "
                    "would read the wrong values); write the files alike"
                )
        assert first is not None
        if first[1] == 0:
            raise DataError(f"{path!r} holds no rows (its datasets are empty): remove it")
        return first[1]

    def locate(self, rows: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.intp], np.ndarray]:
        """The file of each global row, and the row within it."""
        files = np.searchsorted(self.starts, rows, side="right") - 1
        return files, rows - self.starts[files]

    def dataset(self, file: int, top: str, dtype: np.dtype[Any]) -> np.ndarray:
        """Dataset ``top`` of file ``file``, whole, converted by HDF5 to ``dtype``."""
        key = (file, top, dtype.str)
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                return found
            with _h5py().File(self.paths[file], "r") as f:
                ds = f[top]  # HDF5 converts, as H5LTread_dataset_float does
                values = np.asarray(ds[()] if ds.dtype == dtype else ds.astype(dtype)[()])
            values.setflags(write=False)
            self._kept[key] = values
            files = list(dict.fromkeys(k[0] for k in self._kept))
            for old in files[:-_KEPT_FILES]:
                for k in [k for k in self._kept if k[0] == old]:
                    del self._kept[k]
            return values

    def keys(self, rows: npt.NDArray[np.int64]) -> tuple[bytes, ...]:
        """The keys of global rows ``rows``: ``%08d_<file>[<row>]``."""
        files, local = self.locate(rows)
        prefixes = self._prefixes
        return tuple(
            [prefixes[f] + b"%d]" % r for f, r in zip(files.tolist(), local.tolist(), strict=True)]
        )

    def gather(self, top: str, dtype: np.dtype[Any], rows: npt.NDArray[np.int64],
               out: np.ndarray) -> None:  # fmt: skip
        """Global rows ``rows`` of ``top`` into ``out``: each run of rows of one file
        as a slice where they are consecutive, else by index."""
        files, local = self.locate(rows)
        n = len(rows)
        cuts = [0, *(np.flatnonzero(files[1:] != files[:-1]) + 1).tolist(), n]
        for a, b in itertools.pairwise(cuts):
            values = self.dataset(int(files[a]), top, dtype)
            lo, hi = int(local[a]), int(local[b - 1])
            if hi - lo == b - a - 1 and (b - a < 3 or bool((np.diff(local[a:b]) == 1).all())):
                out[a:b] = values[lo : hi + 1]
            else:
                out[a:b] = values[local[a:b]]


class _RowKeys(Sequence[bytes]):
    """One key per row, ``%08d_<file>[<row>]`` (the file's place in the list), made
    when asked for."""

    def __init__(self, files: _Files) -> None:
        self._files = files
        self._n = int(files.starts[-1])

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(self._n)))
        j = int(i) + (self._n if int(i) < 0 else 0)
        if not 0 <= j < self._n:
            raise IndexError(f"row {i} out of range for {self._n} rows")
        return self._files.keys(np.array([j], np.int64))[0]

    def take(self, indices: npt.ArrayLike) -> tuple[bytes, ...]:
        """The keys at positions ``indices`` (each in range), in that order."""
        return self._files.keys(np.asarray(indices, np.int64))


class Hdf5Top:
    """One top of an :class:`Hdf5Data`: the rows of its dataset across the files."""

    record_kind: RecordKind = BLOBPROTO

    def __init__(self, files: _Files, top: str, keys: _RowKeys, path: str) -> None:
        self._files = files
        self.top = top
        self._keys = keys
        self.path = path

    def keys(self) -> Sequence[bytes]:
        """One key per row, in list order."""
        return self._keys

    def row(self, index: int, dtype: Any = np.float32) -> np.ndarray:
        """Row ``index`` (a global row) of this top's dataset, converted to ``dtype``."""
        files, local = self._files.locate(np.array([index], np.int64))
        values = self._files.dataset(int(files[0]), self.top, np.dtype(dtype))
        return np.asarray(values[int(local[0])])

    def get(self, key: bytes) -> bytes:
        """Row ``key`` as a serialized ``caffe.BlobProto`` (float32).

        Raises:
            KeyError: no such row.
        """
        head = key.partition(b"_")[0]
        for index in range(len(self._keys)) if not head.isdigit() else self._near(int(head)):
            if self._keys[index] == key:
                return blobproto_bytes(np.asarray(self.row(index), np.float32))
        raise KeyError(f"{key!r} is not a row of {self.path!r}")

    def _near(self, file: int) -> range:
        starts = self._files.starts
        if not 0 <= file < len(starts) - 1:
            return range(0)
        return range(int(starts[file]), int(starts[file + 1]))

    def row_filler(
        self, transform: Transform, phase: Phase, path: object, blob_dtype: np.dtype[Any]
    ) -> _RowFiller:
        """The filler of this top's rows (no transform: Caffe's HDF5Data has none).

        Raises:
            ArgumentError: a transform that is not the identity.
        """
        if not transform.is_identity:
            raise ArgumentError(
                f"HDF5 top {self.top!r}: Caffe's HDF5Data layer does not transform data; "
                "give no transform (transform=None)"
            )
        return _RowFiller(self, transform, np.dtype(blob_dtype))


class _RowFiller:
    """Rows copied from the datasets, converted as Caffe converts them."""

    kind: RecordKind = BLOBPROTO

    def __init__(self, top: Hdf5Top, transform: Transform, blob_dtype: np.dtype[Any]) -> None:
        self._top = top
        self._transform = transform
        self.blob_dtype = blob_dtype

    @property
    def transform(self) -> Transform:
        return self._transform

    def output(self, record_shape: tuple[int, ...], key: bytes) -> tuple[tuple[int, ...], Any]:
        return record_shape, self.blob_dtype

    def uniform_shape(self) -> None:
        """None: :meth:`first` reads a row's values, which the plan keeps."""
        return None

    def learn(self, indices: npt.NDArray[np.int64], ahead: npt.NDArray[np.int64]) -> None:
        """Nothing to learn: every row of a top has its shape."""

    def first(self, index: int) -> tuple[tuple[int, ...], tuple[np.ndarray, int] | None]:
        values = self._top.row(index, self.blob_dtype)
        return tuple(values.shape), (values, 0)

    def fill(
        self, plan: BatchPlan, start: int, parts: Sequence[Part], defer: Deferral | None = None
    ) -> None:
        """Rows of ``plan`` from ``start`` on into ``parts``, in this call (``defer`` is
        not used)."""
        stop = start + sum(len(part.label) for part in parts)
        rows = plan.indices[start:stop]
        files, top = self._top._files, self._top.top
        if len(parts) == 1:
            files.gather(top, self.blob_dtype, rows, parts[0].data)
        else:
            out = np.empty((stop - start, *plan.record_shape), self.blob_dtype)
            files.gather(top, self.blob_dtype, rows, out)
            a = 0
            for part in parts:
                part.data[...] = out[a : a + len(part.label)]
                a += len(part.label)
        for part in parts:
            if part.geometry is not None:
                store_geometry(part.geometry, slice(None), Geometry.zeros(len(part.label)))

    def close(self) -> None:
        """Nothing to release (the files' datasets go with the source)."""


class Hdf5Data(Mapping[str, Hdf5Top]):
    """The rows of a Caffe HDF5Data layer's files, one source per top (see the module
    docstring); a mapping ``{top: source}`` for :class:`~blobpipe.Batches` and
    :class:`~blobpipe.Loader`, whose batches give each top as ``batch["name"]``::

        with blobpipe.Loader(blobpipe.Hdf5Data("train_h5.txt"), 64) as loader:
            for batch in loader:
                x, y = batch["data"], batch["label"]

    Args:
        source: a list file naming the ``.h5`` files (Caffe's
            ``hdf5_data_param.source``), or a list of ``.h5`` paths.
        tops: the datasets to read, one top each; the first is ``batch.data``.

    Raises:
        MissingDependencyError: h5py is not installed (``pip install 'blobpipe[hdf5]'``).
        FileMissingError: the list file or a file it names does not exist.
        DataError: an empty list; a file without a top's dataset, with datasets of
            different first dimensions, of another kind than numbers, empty, or
            whose rows differ in shape from the first file's.
        ArgumentError: no tops, or a top named twice.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        tops: Sequence[str] = ("data", "label"),
    ) -> None:
        names = tuple(tops)
        if not names or len(set(names)) != len(names) or not all(isinstance(t, str) for t in names):
            raise ArgumentError(f"tops must be distinct dataset names, at least one; got {tops!r}")
        listed_in: str | None = None
        if isinstance(source, (str, os.PathLike)):
            listed_in = listing = os.fsdecode(os.fspath(source))
            try:
                with open(listing, "rb") as f:
                    paths = [os.fsdecode(p) for p in f.read().split()]
            except FileNotFoundError as exc:
                raise FileMissingError("the HDF5 list file does not exist",
                                       path=listing) from exc  # fmt: skip
            if not paths:
                raise DataError(f"the HDF5 list {listing!r} names no file (Caffe requires "
                                "at least one)")  # fmt: skip
        else:
            paths = [os.fsdecode(os.fspath(p)) for p in source]
            if not paths:
                raise ArgumentError("source is an empty list: name at least one .h5 file")
        files = _Files(paths, names, listed_in)
        keys = _RowKeys(files)
        where = listed_in if listed_in is not None else paths[0]
        self._tops = {t: Hdf5Top(files, t, keys, where) for t in names}
        self._files = files

    def __getitem__(self, top: str) -> Hdf5Top:
        return self._tops[top]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tops)

    def __len__(self) -> int:
        return len(self._tops)

    @property
    def rows(self) -> int:
        """Rows in all the files (a file listed twice counts twice)."""
        return int(self._files.starts[-1])

    @property
    def files(self) -> tuple[str, ...]:
        """The files, in list order."""
        return tuple(self._files.paths)

    def __repr__(self) -> str:
        return f"<Hdf5Data {len(self.files)} files, {self.rows} rows, tops {list(self._tops)}>"
