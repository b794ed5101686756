"""Caffe's ImageData layer: a list file and its images, equal to real Caffe and OpenCV."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

import cv2
import numpy as np
import pytest

from blobpipe import (
    ArgumentError,
    Batches,
    DataError,
    FileMissingError,
    ImageList,
    Loader,
    ProtoError,
    Transform,
    read_data_layer,
)

from .conftest import CAFFE

IMAGES = CAFFE / "images"


def caffe_reference(case: str) -> list[tuple[np.ndarray, np.ndarray]]:
    ref = CAFFE / "ref" / case
    n = len(list(ref.glob("data_b*.npy")))
    return [(np.load(ref / f"data_b{k}.npy"), np.load(ref / f"label_b{k}.npy")) for k in range(n)]


def lines(listing: Path) -> list[tuple[str, int]]:
    out = []
    for line in listing.read_text().splitlines():
        path, _, label = line.rpartition(" ")
        out.append((path, int(label)))
    return out


@pytest.mark.parametrize(("case", "batch"), [("imagedata_color_b8", 8),
                                             ("imagedata_varsize_b1", 1)])  # fmt: skip
@pytest.mark.parametrize("via", ["prototxt", "python"])
def test_equals_caffes_imagedata_layer(
    case: str, batch: int, via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(CAFFE)
    ref = caffe_reference(case)
    if via == "prototxt":
        loader = Loader.from_prototxt(f"ref/{case}/net.prototxt", "test", device="cpu")
    elif case == "imagedata_color_b8":
        source = ImageList("list_color.txt", "images/", new_height=32, new_width=40)
        loader = Loader(source, batch, device="cpu", phase="test")
    else:
        loader = Loader(ImageList("list_varsize.txt", "images/"), 1, device="cpu")
    with loader:
        for k, got in enumerate(loader):
            if k == len(ref):
                break
            assert np.array_equal(got.data.cpu_data(), ref[k][0]), k
            assert np.array_equal(got.label.cpu_data(), ref[k][1]), k


def test_colour_equals_the_data_layer_on_caffes_lmdb(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    t = Transform(crop_size=24, mean_value=(104, 117, 123))
    source = ImageList("list_color.txt", "images/", new_height=32, new_width=40)
    with Batches(source, 50, transform=t, phase="test", mode="epoch") as a, Batches(
        CAFFE / "lmdb" / "raw_color", 50, transform=t, phase="test", mode="epoch"
    ) as b:
        x, y = next(iter(a)), next(iter(b))
    assert np.array_equal(x.data, y.data)
    assert np.array_equal(x.label, y.label)
    assert x.keys == y.keys  # Caffe's %08d_<path> keys


def test_caffes_aborts_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    loader = Loader.from_prototxt("ref/imagedata_gray_missing_b8/net.prototxt", "test",
                                  device="cpu", prefetch=1, workers=1)  # fmt: skip
    seen = []
    with loader, pytest.raises(DataError, match=r"line 21 of the image list 'list_gray.txt' "
                               r"names 'gray/missing_on_purpose.png', but "
                               r"'images/gray/missing_on_purpose.png' cannot be read \(no such "
                               r"file\); Caffe's ImageData layer aborts here"):  # fmt: skip
        seen.extend(batch.data.shape for batch in loader)
    assert seen == [(8, 1, 28, 28)] * 2  # batches 0 and 1 come; batch 2 holds line 21
    config = read_data_layer("ref/imagedata_varsize_b4_nocrop/net.prototxt", "test")
    with Batches(**config.batches_kwargs()) as b, pytest.raises(
        DataError,
        match=r"record b'00000001_varsize/v01_32x32.png' has shape \(3, 32, 32\).*first record "
        r"b'00000000_varsize/v00_20x30.png' has shape \(3, 20, 30\).*new_height/new_width",
    ):
        next(iter(b))


def _reference(listing: Path, root: Path, flag: int, size: tuple[int, int] | None) -> list:
    out = []
    for path, label in lines(listing):
        img = cv2.imread(str(root / path), flag)
        if size is not None:
            img = cv2.resize(img, (size[1], size[0]))
        img = img[:, :, None] if img.ndim == 2 else img
        out.append((img.transpose(2, 0, 1), label))
    return out


def test_gray_decodes_as_opencvs_imread(tmp_path: Path) -> None:
    listing = tmp_path / "gray.txt"  # Caffe's gray list without its missing line
    kept = [line for line in (CAFFE / "list_gray.txt").read_text().splitlines()
            if "missing" not in line]  # fmt: skip
    listing.write_text("\n".join(kept) + "\n")
    expected = _reference(listing, IMAGES, cv2.IMREAD_GRAYSCALE, (28, 28))
    source = ImageList(listing, f"{IMAGES}/", new_height=28, new_width=28, is_color=False)
    with Batches(source, len(expected), phase="test", mode="epoch") as b:
        batch = next(iter(b))
    assert batch.data.shape == (len(expected), 1, 28, 28)
    for row, (chw, label) in enumerate(expected):
        assert np.array_equal(batch.data[row], chw.astype(np.float32)), row
        assert batch.label[row] == label
    # the last four lines are colour JPEGs: gray at decode time, not cvtColor's
    jpeg = cv2.imread(str(IMAGES / lines(listing)[-1][0]), cv2.IMREAD_COLOR)
    assert jpeg.ndim == 3


def test_crops_of_mixed_sizes_with_a_mean_value_and_a_seeded_shuffle(tmp_path: Path) -> None:
    expected = _reference(CAFFE / "list_varsize.txt", IMAGES, cv2.IMREAD_COLOR, None)
    crop = 12
    mean = np.array([10.0, 20.0, 30.0], np.float32).reshape(3, 1, 1)
    t = Transform(crop_size=crop, mean_value=(10, 20, 30), scale=0.5)
    source = ImageList(CAFFE / "list_varsize.txt", f"{IMAGES}/")
    with Batches(source, 4, transform=t, phase="test", mode="epoch") as b:
        rows = np.concatenate([batch.data for batch in b])
    for row, (chw, _) in enumerate(expected):
        _, h, w = chw.shape
        top, left = (h - crop) // 2, (w - crop) // 2
        want = (chw[:, top : top + crop, left : left + crop].astype(np.float32) - mean) * 0.5
        assert np.array_equal(rows[row], want), row
    runs = []
    for _ in range(2):
        with Batches(source, 4, transform=t, phase="test", order="shuffle", seed=5,
                     mode="epoch") as b:  # fmt: skip
            runs.append(np.concatenate([batch.label for batch in b]))
    assert np.array_equal(runs[0], runs[1])
    assert sorted(runs[0].tolist()) == list(range(12))
    assert runs[0].tolist() != list(range(12))


def test_resize_equals_opencv_and_batches_wrap_mid_batch() -> None:
    expected = _reference(CAFFE / "list_color.txt", IMAGES, cv2.IMREAD_COLOR, (20, 16))
    source = ImageList(CAFFE / "list_color.txt", f"{IMAGES}/", new_height=20, new_width=16)
    with Batches(source, 32, phase="test") as b:  # 50 lines: batch 1 wraps to line 0
        got = list(islice(iter(b), 2))
    rows = np.concatenate([x.data for x in got])
    for row in range(64):
        assert np.array_equal(rows[row], expected[row % 50][0].astype(np.float32)), row


def test_workers_read_in_parallel_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    source = ImageList("list_color.txt", "images/", new_height=32, new_width=40)
    outs = []
    for workers in (1, 2):
        with Loader(source, 5, device="cpu", workers=workers, prefetch=4, mode="epoch",
                    phase="test") as loader:  # fmt: skip
            outs.append(np.concatenate([b.data.cpu_data().copy() for b in loader]))
    assert np.array_equal(outs[0], outs[1])


def test_list_parsing_and_argument_errors(tmp_path: Path) -> None:
    listing = tmp_path / "list.txt"
    listing.write_text("a b.png 7\nc.png 12abc\nnolabel.png\n")
    source = ImageList(listing)
    assert list(source.keys()) == [b"00000000_a b.png", b"00000001_c.png", b"00000002_nolabel.png"]
    assert source.file(0) == "a b.png"
    with pytest.raises(KeyError, match="is not a line"):
        source.get(b"00000009_x.png")
    with pytest.raises(ArgumentError, match="both > 0"):
        ImageList(listing, new_height=5)
    with pytest.raises(FileMissingError, match="image list file does not exist"):
        ImageList(tmp_path / "none.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="is empty"):
        ImageList(tmp_path / "empty.txt")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    listing.write_text("bad.png 1\n")
    with pytest.raises(DataError, match=r"line 1 .*bad.png' cannot be decoded"):
        ImageList(listing, f"{tmp_path}/").get(b"00000000_bad.png")
    # root_folder is joined as a string, as in Caffe: no separator is added
    listing.write_text("color/china_00.jpg 0\n")
    with pytest.raises(DataError, match=r"'.*imagescolor/china_00.jpg' cannot be read"):
        ImageList(listing, str(IMAGES)).get(b"00000000_color/china_00.jpg")
    net = tmp_path / "net.prototxt"
    net.write_text('layer { name: "i" type: "ImageData" top: "data" top: "label" '
                   'image_data_param { source: "x" batch_size: 2 new_height: 4 } }')  # fmt: skip
    with pytest.raises(ProtoError, match=r"sets only one of image_data_param\.new_height"):
        read_data_layer(net)


@pytest.mark.parametrize("case", ["imagedata_color_b8", "hdf5_b4", "leveldb_raw_color_b8"])
def test_inspect_and_show_take_a_nets_data_layer(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from blobpipe._cli import main

    pytest.importorskip("h5py")
    monkeypatch.chdir(CAFFE)
    net = f"ref/{case}/net.prototxt"
    assert main(["inspect", net]) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["type"] == {"imagedata": "ImageData", "hdf5": "HDF5Data"}.get(
        case.split("_")[0], "Data"
    )
    if case == "imagedata_color_b8":
        assert (described["records"], described["first_shape"]) == (50, [3, 32, 40])
    elif case == "hdf5_b4":
        assert described["records"] == 15
        assert described["row_shapes"] == {"data": [3, 8, 10], "label": []}
    else:
        assert described["database"]["kind"] == "leveldb"
    out = tmp_path / "grid.png"
    assert main(["show", net, "-o", str(out), "--count", "6", "-q"]) == 0
    assert cv2.imread(str(out)) is not None
