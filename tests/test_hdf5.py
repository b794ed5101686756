"""Caffe's HDF5Data layer: equal to real Caffe, to h5py slicing, with clear errors."""

from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blobpipe import (
    ArgumentError,
    Batches,
    DataError,
    FileMissingError,
    Hdf5Data,
    Loader,
    MissingDependencyError,
    ProtoError,
    Transform,
    read_data_layer,
)

from .conftest import CAFFE

h5py = pytest.importorskip("h5py")

H5 = CAFFE / "hdf5"


def caffe_reference(case: str) -> list[tuple[np.ndarray, np.ndarray]]:
    ref = CAFFE / "ref" / case
    n = len(list(ref.glob("data_b*.npy")))
    return [(np.load(ref / f"data_b{k}.npy"), np.load(ref / f"label_b{k}.npy")) for k in range(n)]


@pytest.mark.parametrize("case", ["hdf5_b4", "hdf5_b4_single_file"])
@pytest.mark.parametrize("via", ["prototxt", "python"])
def test_equals_caffes_hdf5data_layer(case: str, via: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    ref = caffe_reference(case)
    if via == "prototxt":
        loader = Loader.from_prototxt(f"ref/{case}/net.prototxt", "test", device="cpu")
    else:
        listing = "hdf5/list.txt" if case == "hdf5_b4" else "hdf5/list_single.txt"
        loader = Loader(Hdf5Data(listing), 4, device="cpu")
    with loader:
        for k, batch in enumerate(loader):
            if k == len(ref):
                break
            assert batch.names == ["data", "label"]
            assert np.array_equal(batch["data"].cpu_data(), ref[k][0]), k
            assert np.array_equal(batch["label"].cpu_data(), ref[k][1]), k
            assert batch["data"].cpu_data().dtype == np.float32


def test_config_and_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    config = read_data_layer("ref/hdf5_b4/net.prototxt", "test")
    assert (config.type, config.tops, config.batch_size) == ("HDF5Data", ("data", "label"), 4)
    kwargs = config.batches_kwargs()
    assert isinstance(kwargs["source"], Hdf5Data)
    assert kwargs["source"].rows == 15
    with Batches(**kwargs) as b:
        first = next(iter(b))
    assert np.array_equal(first["data"], caffe_reference("hdf5_b4")[0][0])


def _numpy_rows(files: list[Path], top: str, dtype: Any = np.float32) -> np.ndarray:
    parts = []
    for f in files:
        with h5py.File(f, "r") as h:
            parts.append(np.asarray(h[top][()]).astype(dtype))
    return np.concatenate(parts)


def _write(path: Path, **datasets: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        for name, values in datasets.items():
            f[name] = values
    return path


def test_multi_top_typed_datasets_against_numpy(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    files = [
        _write(tmp_path / f"p{i}.h5", data=rng.normal(size=(n, 2, 3)).astype(np.float64),
               label=rng.integers(-5, 5, size=(n, 1)).astype(np.int32),
               extra=rng.integers(0, 255, size=(n, 4)).astype(np.uint8))
        for i, n in enumerate((3, 5, 2))
    ]
    tops = ("data", "label", "extra")
    expected = {t: _numpy_rows(files, t) for t in tops}
    n = 10
    with Batches(Hdf5Data(files, tops), 4, mode="wrap") as b:
        got = [next(iter(b)) for _ in range(5)]  # 20 rows: wraps twice, mid-batch
    for top in tops:
        rows = np.concatenate([batch[top] for batch in got])
        want = np.concatenate([expected[top], expected[top]])
        assert rows.dtype == np.float32
        assert rows.shape == (2 * n, *expected[top].shape[1:])
        assert np.array_equal(rows, want), top
    with Batches(Hdf5Data(files, tops), 4, blob_dtype="float64", mode="epoch") as b:
        rows = np.concatenate([batch["data"] for batch in b])
    assert np.array_equal(rows, _numpy_rows(files, "data", np.float64))


def test_shuffle_with_a_seed_is_a_permutation_of_the_rows() -> None:
    files = sorted(H5.glob("part*.h5"))
    expected = _numpy_rows(files, "extra")
    runs = []
    for _ in range(2):
        with Batches(Hdf5Data(files, ("extra", "label")), 5, order="shuffle", seed=3,
                     mode="epoch") as b:  # fmt: skip
            runs.append(np.concatenate([batch["extra"] for batch in b]))
    assert np.array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], expected)
    assert sorted(map(tuple, runs[0].tolist())) == sorted(map(tuple, expected.tolist()))


def test_typed_file_like_caffe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    with Batches(Hdf5Data("hdf5/list_typed.txt"), 2, mode="epoch") as b:
        batch = next(iter(b))
    with h5py.File(H5 / "typed.h5", "r") as f:
        assert f["data"].dtype == np.float64 and f["label"].dtype == np.int32
        assert np.array_equal(batch["data"], f["data"][:2].astype(np.float32))
        assert batch["label"].shape == (2, 1)
        assert np.array_equal(batch["label"], f["label"][:2].astype(np.float32))


def test_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = _write(tmp_path / "good.h5", data=np.zeros((4, 3), np.float32),
                  label=np.zeros(4, np.float32))  # fmt: skip
    no_label = _write(tmp_path / "nolabel.h5", data=np.zeros((4, 3), np.float32))
    with pytest.raises(DataError, match=r"nolabel.h5' has no dataset 'label' \(it holds "
                       r"'data'\): each top"):  # fmt: skip
        Hdf5Data([good, no_label])
    mismatched = _write(tmp_path / "mismatch.h5", data=np.zeros((4, 3), np.float32),
                        label=np.zeros(5, np.float32))  # fmt: skip
    with pytest.raises(DataError, match=r"dataset 'label' has 5 rows but 'data' has 4: a "
                       r"file's datasets .* first dimensions must be equal"):  # fmt: skip
        Hdf5Data([mismatched])
    other = _write(tmp_path / "other.h5", data=np.zeros((2, 4), np.float32),
                   label=np.zeros(2, np.float32))  # fmt: skip
    with pytest.raises(DataError, match=r"dataset 'data' has rows of shape \(4,\) in .*other.h5"):
        Hdf5Data([good, other])
    strings = _write(tmp_path / "s.h5", data=np.array([b"a", b"b"]), label=np.zeros(2))
    with pytest.raises(DataError, match="holding floats or integers"):
        Hdf5Data([strings])
    (tmp_path / "list.txt").write_text(f"{good}\n  {tmp_path / 'missing.h5'}\n")
    with pytest.raises(FileMissingError, match=r"the HDF5 file \(listed in"):
        Hdf5Data(tmp_path / "list.txt")
    with pytest.raises(FileMissingError, match="the HDF5 list file does not exist"):
        Hdf5Data(tmp_path / "nolist.txt")
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(DataError, match="names no file"):
        Hdf5Data(tmp_path / "empty.txt")
    with pytest.raises(ArgumentError, match="tops must be distinct"):
        Hdf5Data([good], ("data", "data"))
    with pytest.raises(ArgumentError, match="does not transform data"):
        Batches(Hdf5Data([good]), 2, transform={"data": Transform(scale=2.0), "label": None})
    net = tmp_path / "net.prototxt"
    net.write_text('layer { name: "h" type: "HDF5Data" top: "data" transform_param { scale: 2 }'
                   ' hdf5_data_param { source: "x" batch_size: 2 } }')  # fmt: skip
    with pytest.raises(ProtoError, match="Caffe refuses it"):
        read_data_layer(net)


def test_without_h5py_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.__import__

    def no_h5py(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "h5py":
            raise ImportError("No module named 'h5py'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_h5py)
    with pytest.raises(MissingDependencyError, match=r"needs h5py: pip install 'blobpipe\[hdf5\]'"):
        Hdf5Data([H5 / "part0.h5"])
