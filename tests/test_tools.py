"""Dataset tools: convert_imageset, compute_mean, export, inspect, bench, progress."""

from __future__ import annotations

import errno
import io
import logging
import os
import re
import shutil
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

import blobpipe
from blobpipe import _errors
from blobpipe._errors import DatabaseNotFoundError, DataError, FileMissingError
from blobpipe._io._batches import Batches
from blobpipe._io._transform import Transform
from blobpipe._proto import caffe_pb2
from blobpipe._tools import (
    OutputExistsError,
    Progress,
    _convert,
    bench,
    compute_mean,
    convert_imageset,
    export,
    inspect_db,
    read_list_file,
)
from blobpipe._tools._bench import time_batches
from blobpipe._tools._lmdbwrite import LmdbWriter
from blobpipe._tools._output import MARKER_NAME, read_marker
from tests._helpers import lmdb_items

CAFFE = Path(__file__).parent / "data" / "caffe"
ROOT = CAFFE / "images"
LIST = CAFFE / "list_color.txt"
CAFFE_FLAGS: dict[str, dict[str, Any]] = {
    "raw_color": {"resize_height": 32, "resize_width": 40},
    "encoded_jpg": {"resize_height": 32, "resize_width": 40, "encoded": True, "encode_type": "jpg"},
}


def datum(value: bytes) -> caffe_pb2.Datum:
    d = caffe_pb2.Datum()
    d.ParseFromString(value)
    return d


def write_list(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# -- convert_imageset: Caffe's bytes --------------------------------------------------


@pytest.mark.parametrize("name", ["raw_color", "encoded_jpg"])
def test_convert_is_byte_identical_to_caffe(tmp_path: Path, name: str) -> None:
    out = tmp_path / name
    # a 16 KiB map and 7-record commits exercise map doubling and chunking
    result = convert_imageset(
        f"{ROOT}/", LIST, out, map_size=1 << 14, commit_every=7, **CAFFE_FLAGS[name]
    )
    assert result.records == 50
    assert result.skipped == ()
    assert lmdb_items(out) == lmdb_items(CAFFE / "lmdb" / name)
    assert sorted(os.listdir(out)) == ["data.mdb", "lock.mdb"]
    assert not (tmp_path / f"{name}.partial").exists()


def test_root_without_trailing_slash_is_joined(tmp_path: Path) -> None:
    convert_imageset(ROOT, LIST, tmp_path / "db", **CAFFE_FLAGS["raw_color"])
    assert lmdb_items(tmp_path / "db") == lmdb_items(CAFFE / "lmdb" / "raw_color")


def test_raw_datums_are_bgr_chw_with_explicit_encoded_false(tmp_path: Path) -> None:
    convert_imageset(
        ROOT, write_list(tmp_path / "l.txt", ["color/china_00.jpg 3"]), tmp_path / "db"
    )
    [(key, value)] = lmdb_items(tmp_path / "db")
    assert key == b"00000000_color/china_00.jpg"
    d = datum(value)
    assert d.HasField("encoded")
    assert not d.encoded
    img = cv2.imread(str(ROOT / "color" / "china_00.jpg"), cv2.IMREAD_COLOR)
    assert (d.channels, d.height, d.width) == (3, *img.shape[:2])
    np.testing.assert_array_equal(
        np.frombuffer(d.data, np.uint8).reshape(3, *img.shape[:2]), img.transpose(2, 0, 1)
    )


def test_gray_gives_one_channel(tmp_path: Path) -> None:
    convert_imageset(ROOT, LIST, tmp_path / "db", gray=True, resize_height=8, resize_width=8)
    values = [datum(v) for _, v in lmdb_items(tmp_path / "db")]
    assert {(d.channels, d.height, d.width) for d in values} == {(1, 8, 8)}


def test_encoded_without_resize_stores_matching_files_as_is(tmp_path: Path) -> None:
    lines = ["color/china_00.jpg 1", "color/flower_00.png 2"]
    lst = write_list(tmp_path / "l.txt", lines)
    convert_imageset(ROOT, lst, tmp_path / "jpg", encode_type="jpg")
    (_, jpg), (_, png) = lmdb_items(tmp_path / "jpg")
    assert datum(jpg).data == (ROOT / "color" / "china_00.jpg").read_bytes()
    assert not datum(jpg).HasField("channels")
    reencoded = datum(png)
    assert reencoded.encoded
    assert reencoded.data[:2] == b"\xff\xd8"
    # --encoded without a type keeps each file's own format and bytes
    convert_imageset(ROOT, lst, tmp_path / "own", encoded=True)
    (_, a), (_, b) = lmdb_items(tmp_path / "own")
    assert datum(a).data == (ROOT / "color" / "china_00.jpg").read_bytes()
    assert datum(b).data == (ROOT / "color" / "flower_00.png").read_bytes()


def test_encoded_with_one_size_reencodes_without_resizing(tmp_path: Path) -> None:
    lst = write_list(tmp_path / "l.txt", ["color/china_00.jpg 1"])
    convert_imageset(ROOT, lst, tmp_path / "db", encode_type="jpg", resize_height=10)
    [(_, value)] = lmdb_items(tmp_path / "db")
    data = datum(value).data
    assert data != (ROOT / "color" / "china_00.jpg").read_bytes()
    decoded = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert decoded.shape == cv2.imread(str(ROOT / "color" / "china_00.jpg")).shape


# -- list files and unreadable inputs --------------------------------------------------


def test_read_list_file_splits_at_last_space(tmp_path: Path) -> None:
    lst = tmp_path / "l.txt"
    lst.write_bytes(b"a b c.png 7\n\nd.jpg -2\r\n")
    assert read_list_file(lst) == [(b"a b c.png", 7), (b"", 0), (b"d.jpg", -2)]


@pytest.mark.parametrize("line", ["nolabel.jpg", "x.jpg seven", "x.jpg 99999999999"])
def test_bad_list_line_names_the_line(tmp_path: Path, line: str) -> None:
    lst = write_list(tmp_path / "l.txt", ["color/china_00.jpg 1", line])
    with pytest.raises(DataError, match=r"line 2"):
        convert_imageset(ROOT, lst, tmp_path / "db")
    assert not (tmp_path / "db").exists()
    assert not (tmp_path / "db.partial").exists()


def test_labels_are_read_as_caffes_atoi_reads_them(tmp_path: Path) -> None:
    """``atoi``: leading white space and a sign, then digits; the rest is ignored."""
    lst = tmp_path / "l.txt"
    lines = [b"a.png 1_000", b"b.png +7", b"c.png -3x", b"d.png \t42abc", b"e.png 007", b"f.png 5 "]
    lst.write_bytes(b"\n".join(lines[:-1]) + b"\n")
    assert [label for _, label in read_list_file(lst)] == [1, 7, -3, 42, 7]
    lst.write_bytes(b"g.png 1e3\nh.png 0x10\n")
    assert read_list_file(lst) == [(b"g.png", 1), (b"h.png", 0)]
    for bad in (b"x.png _1", b"x.png +", b"x.png 5 "):  # no digits after the last space
        lst.write_bytes(b"ok.png 1\n" + bad + b"\n")
        with pytest.raises(DataError, match="line 2: expected 'path label'"):
            read_list_file(lst)


def test_labels_that_are_not_integers_are_counted_and_reported_once(tmp_path: Path) -> None:
    """``3.7`` and ``12abc`` are read as Caffe's atoi reads them (3 and 12), but
    counted and reported once, with the first; ``strict_labels`` refuses them."""
    lst = write_list(
        tmp_path / "l.txt",
        ["color/china_00.jpg 3.7", "color/china_01.jpg 1", "color/china_02.jpg 12abc"],
    )
    seen: list[str] = []
    result = convert_imageset(ROOT, lst, tmp_path / "db", report=seen.append)
    assert [datum(v).label for _, v in lmdb_items(tmp_path / "db")] == [3, 1, 12]
    assert result.loose_labels == 2
    assert len(seen) == 1, seen
    assert re.fullmatch(
        r"list file '.*l\.txt' line 1: label '3\.7' is not an integer; read as Caffe's atoi "
        r"reads it, as 3 \(2 such labels in the list\); pass strict_labels=True to refuse "
        r"such labels",
        seen[0],
    ), seen[0]
    with pytest.raises(
        DataError, match=r"line 1: label '3\.7' is not an integer \(strict_labels=True; Caffe"
    ):
        convert_imageset(ROOT, lst, tmp_path / "strict", strict_labels=True)
    assert not (tmp_path / "strict").exists() and not (tmp_path / "strict.partial").exists()
    with pytest.raises(DataError, match=r"line 3: label '12abc' is not an integer"):
        read_list_file(
            write_list(tmp_path / "m.txt", ["a 1", "b 2", "c 12abc"]), strict_labels=True
        )
    # integers with white space around them (CRLF lists) are plain integers
    lst.write_bytes(b"color/china_00.jpg 3\r\ncolor/china_01.jpg +1\t\n")
    seen.clear()
    assert convert_imageset(ROOT, lst, tmp_path / "crlf", report=seen.append).loose_labels == 0
    assert seen == []


def test_a_conversion_that_writes_nothing_fails_and_leaves_no_database(tmp_path: Path) -> None:
    lst = write_list(tmp_path / "l.txt", ["gone/a.jpg 1", "gone/b.jpg 2"])
    with pytest.raises(
        DataError,
        match=r"no record written: all 2 list entries were skipped \(the first, 'gone/a\.jpg': "
        r"file not found\); the list's paths are read relative to the image root",
    ):
        convert_imageset(ROOT, lst, tmp_path / "db", report=lambda _: None)
    assert not (tmp_path / "db").exists() and not (tmp_path / "db.partial").exists()
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"nothing to convert: the list file .* holds no lines"):
        convert_imageset(ROOT, tmp_path / "empty.txt", tmp_path / "db")
    assert not (tmp_path / "db").exists() and not (tmp_path / "db.partial").exists()


def test_an_image_opencv_cannot_encode_names_opencvs_reason(tmp_path: Path) -> None:
    """OpenCV's error is the cause, and its words are in the message (not swallowed)."""
    from blobpipe._io._image import encode_image

    with pytest.raises(DataError, match="could not find encoder") as info:
        encode_image(np.zeros((4, 4, 3), np.uint8), "xyz")
    assert isinstance(info.value.__cause__, cv2.error)
    with pytest.raises(
        DataError,
        match=r"china_00\.jpg': OpenCV cannot encode .* as 'xyz' \(.*could not find encoder.*"
        r"\); encode_type='jpg' or encode_type='png'",
    ):
        convert_imageset(ROOT, LIST, tmp_path / "db", encoded=True, encode_type="xyz")


def test_a_path_too_long_for_an_lmdb_key_names_its_line(tmp_path: Path) -> None:
    lst = tmp_path / "l.txt"
    lst.write_bytes(b"ok.png 1\n" + b"d/" * 304 + b" 2\n")  # a 608-byte path
    with pytest.raises(DataError, match=r"l\.txt' line 2: the path is 608 bytes.*511-byte key"):
        read_list_file(lst)
    lst.write_bytes(b"x" * 502 + b" 2\n")  # '00000000_' + 502 bytes: 511, the limit
    assert read_list_file(lst) == [(b"x" * 502, 2)]


_NOT_UTF8 = """
    import os, sys
    import cv2, numpy as np
    import blobpipe
    from blobpipe._tools import convert_imageset

    root = sys.argv[1]
    pixels = np.random.default_rng(0).integers(0, 256, (8, 9, 3), dtype=np.uint8)
    cv2.imwrite(os.path.join(root, "plain.png"), pixels)
    name = os.path.join(root, "caf").encode() + b"\\xe9.png"
    os.rename(os.path.join(root, "plain.png").encode(), name)
    with open(os.path.join(root, "list.txt"), "wb") as f:
        f.write(b"caf\\xe9.png 1\\n")
    result = convert_imageset(root, os.path.join(root, "list.txt"), os.path.join(root, "db"))
    reader = blobpipe.LmdbReader(os.path.join(root, "db"))
    (key,) = reader.keys()
    chw, label = blobpipe.decode_datum(reader.get(key))
    print(result.records, key, label, bool((chw == pixels.transpose(2, 0, 1)).all()))
"""


def test_a_list_file_name_that_is_not_utf8_is_read_as_caffe_reads_it(tmp_path: Path) -> None:
    """The file's bytes are read by their bytes path and decoded from memory (OpenCV's
    imread cannot take such a name: it crashed the process)."""
    from tests._helpers import run_script

    done = run_script(_NOT_UTF8, str(tmp_path))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["1", "b'00000000_caf\\xe9.png'", "1", "True"]


def test_unreadable_images_are_skipped_but_keep_their_index(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(ROOT / "color", root / "color")
    (root / "color" / "broken.jpg").write_bytes(b"not a jpeg")
    lst = write_list(
        tmp_path / "l.txt",
        [
            "color/china_00.jpg 1",
            "color/missing.jpg 2",
            "",
            "color/broken.jpg 3",
            "color/synth 07 with space.png 4",
        ],
    )
    seen: list[str] = []
    result = convert_imageset(root, lst, tmp_path / "db", report=seen.append)
    keys = [k for k, _ in lmdb_items(tmp_path / "db")]
    assert keys == [b"00000000_color/china_00.jpg", b"00000004_color/synth 07 with space.png"]
    assert [(s.index, s.reason) for s in result.skipped[:2]] == [
        (1, "file not found"),
        (2, "file not found"),
    ]
    # the image module's reason: what OpenCV could not do, and why
    assert result.skipped[2].index == 3
    assert result.skipped[2].reason.startswith("OpenCV cannot decode the encoded image (10 bytes")
    assert len(seen) == 3
    assert "00000001_color/missing.jpg" in seen[0]
    assert "missing.jpg" in seen[0]


def test_missing_root_or_list_is_a_clear_error(tmp_path: Path) -> None:
    """A missing root or list file is a FileMissingError (a FileNotFoundError), as
    the error tree says of files the caller names."""
    with pytest.raises(FileMissingError, match=r"the image root does not exist: .*nope'") as e:
        convert_imageset(tmp_path / "nope", LIST, tmp_path / "db")
    assert e.value.filename == str(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match=r"image root .*file' is not a directory"):
        convert_imageset(tmp_path / "file", LIST, tmp_path / "db")
    for call in (
        lambda: convert_imageset(ROOT, tmp_path / "nope.txt", tmp_path / "db"),
        lambda: read_list_file(tmp_path / "nope.txt"),
    ):
        with pytest.raises(FileMissingError, match=r"the list file does not exist: .*nope\.txt"):
            call()
    assert not (tmp_path / "db").exists()


def test_check_size_stops_at_the_first_mismatch(tmp_path: Path) -> None:
    lst = write_list(tmp_path / "l.txt", ["color/china_00.jpg 1", "color/astronaut.jpg 2"])
    with pytest.raises(DataError, match=r"has shape .*check_size.*00000001_color/astronaut"):
        convert_imageset(ROOT, lst, tmp_path / "db", check_size=True)
    assert not (tmp_path / "db").exists()
    # resized, the same list passes
    convert_imageset(ROOT, lst, tmp_path / "ok", check_size=True, resize_height=4, resize_width=4)


def test_bad_options_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"resize sizes must be >= 0"):
        convert_imageset(ROOT, LIST, tmp_path / "db", resize_height=-1)
    with pytest.raises(ValueError, match=r"seed is only meaningful with shuffle"):
        convert_imageset(ROOT, LIST, tmp_path / "db", seed=1)


# -- shuffle -----------------------------------------------------------------------------


def test_shuffle_with_seed_is_reproducible(tmp_path: Path) -> None:
    a = convert_imageset(
        ROOT, LIST, tmp_path / "a", shuffle=True, seed=3, resize_height=4, resize_width=4
    )
    convert_imageset(
        ROOT, LIST, tmp_path / "b", shuffle=True, seed=3, resize_height=4, resize_width=4
    )
    c = convert_imageset(ROOT, LIST, tmp_path / "c", shuffle=True, resize_height=4, resize_width=4)
    assert a.seed == 3
    assert isinstance(c.seed, int)
    items = lmdb_items(tmp_path / "a")
    assert items == lmdb_items(tmp_path / "b")
    paths = [k[9:] for k, _ in items]
    listed = [p for p, _ in read_list_file(LIST)]
    assert paths != listed
    assert sorted(paths) == sorted(listed)
    # keys are numbered in shuffled order, so byte order is the shuffled order
    assert [k[:8] for k, _ in items] == [b"%08d" % i for i in range(50)]


# -- outputs: refusal, force, transactions ----------------------------------------------


def test_output_exists_error_is_one_class_everywhere() -> None:
    assert blobpipe.OutputExistsError is OutputExistsError is _errors.OutputExistsError
    assert issubclass(OutputExistsError, _errors.BlobpipeError)
    assert issubclass(OutputExistsError, FileExistsError)
    assert "OutputExistsError" in _errors.__all__


def test_existing_output_is_never_overwritten_without_force(tmp_path: Path) -> None:
    out = tmp_path / "db"
    out.mkdir()
    (out / "precious").write_text("keep")
    with pytest.raises(OutputExistsError, match=r"already exists; pass force=True to replace it$"):
        convert_imageset(ROOT, LIST, out)
    assert (out / "precious").read_text() == "keep"
    convert_imageset(ROOT, LIST, out, force=True, **CAFFE_FLAGS["raw_color"])
    assert lmdb_items(out) == lmdb_items(CAFFE / "lmdb" / "raw_color")
    assert not (tmp_path / "db.replaced").exists()


def test_interrupt_leaves_a_resumable_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "db"
    real = _convert._read_image
    calls = 0

    def flaky(filename: str, is_color: bool) -> Any:
        nonlocal calls
        calls += 1
        if calls == 23:
            raise KeyboardInterrupt
        return real(filename, is_color)

    monkeypatch.setattr(_convert, "_read_image", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert_imageset(ROOT, LIST, out, commit_every=5, **CAFFE_FLAGS["raw_color"])
    partial = tmp_path / "db.partial"
    assert not out.exists()
    marker = read_marker(partial)
    assert marker is not None
    assert marker["next_index"] == 20
    assert not marker["complete"]
    assert len(lmdb_items(partial)) == 20
    info = inspect_db(partial)
    assert not info.complete
    assert info.progress == (20, 50)
    assert info.records == 20

    monkeypatch.setattr(_convert, "_read_image", real)
    result = convert_imageset(ROOT, LIST, out, commit_every=5, **CAFFE_FLAGS["raw_color"])
    assert result.resumed_at == 20
    assert result.records == 50
    assert lmdb_items(out) == lmdb_items(CAFFE / "lmdb" / "raw_color")
    assert not partial.exists()
    assert not (out / MARKER_NAME).exists()


def test_partial_from_other_options_starts_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "db"
    monkeypatch.setattr(_convert, "_read_image", _raise_after(12))
    with pytest.raises(KeyboardInterrupt):
        convert_imageset(ROOT, LIST, out, commit_every=4, gray=True)
    monkeypatch.undo()
    notes: list[str] = []
    result = convert_imageset(ROOT, LIST, out, report=notes.append, **CAFFE_FLAGS["raw_color"])
    assert result.resumed_at == 0
    assert any("starting over" in n for n in notes)
    assert lmdb_items(out) == lmdb_items(CAFFE / "lmdb" / "raw_color")


def _raise_after(n: int) -> Any:
    real = _convert._read_image
    count = 0

    def read(filename: str, is_color: bool) -> Any:
        nonlocal count
        count += 1
        if count > n:
            raise KeyboardInterrupt
        return real(filename, is_color)

    return read


def test_foreign_partial_directory_is_not_deleted(tmp_path: Path) -> None:
    partial = tmp_path / "db.partial"
    partial.mkdir()
    (partial / "mine.txt").write_text("x")
    with pytest.raises(OutputExistsError, match=r"not written by blobpipe"):
        convert_imageset(ROOT, LIST, tmp_path / "db")
    assert (partial / "mine.txt").exists()


def test_map_grows_by_doubling(tmp_path: Path) -> None:
    with LmdbWriter(tmp_path / "db", map_size=1 << 14) as w:
        start = w.map_size
        w.put_many([(b"%04d" % i, bytes(4096)) for i in range(64)])
        assert w.grow_count >= 4
        assert w.map_size >= start * 16
        assert w.entries() == 64


# -- compute_mean ---------------------------------------------------------------------------


def test_mean_file_is_byte_identical_to_caffe(tmp_path: Path) -> None:
    out = tmp_path / "mean.binaryproto"
    result = compute_mean(CAFFE / "lmdb" / "raw_color", out)
    assert out.read_bytes() == (CAFFE / "raw_color_mean.binaryproto").read_bytes()
    assert result.count == 50
    assert result.mean.shape == (3, 32, 40)
    proto = caffe_pb2.BlobProto()
    proto.ParseFromString(out.read_bytes())
    assert not proto.HasField("shape")
    assert (proto.num, proto.channels) == (1, 3)
    expected = result.mean.reshape(3, -1).astype(np.float64).mean(axis=1)
    np.testing.assert_allclose(result.channel_means, expected, rtol=1e-5)
    with pytest.raises(OutputExistsError):
        compute_mean(CAFFE / "lmdb" / "raw_color", out)


def test_mean_of_encoded_db_decodes_natively() -> None:
    result = compute_mean(CAFFE / "lmdb" / "encoded_jpg")
    total = np.zeros((3, 32, 40), np.float32)
    for _, value in lmdb_items(CAFFE / "lmdb" / "encoded_jpg"):
        img = cv2.imdecode(np.frombuffer(datum(value).data, np.uint8), cv2.IMREAD_UNCHANGED)
        total += img.transpose(2, 0, 1)
    assert result.path is None
    assert result.count == 50
    np.testing.assert_array_equal(result.mean, total / np.float32(50))


def test_mean_refuses_mixed_sizes_and_empty_dbs(tmp_path: Path) -> None:
    lst = write_list(tmp_path / "l.txt", ["color/china_00.jpg 1", "color/astronaut.jpg 2"])
    convert_imageset(ROOT, lst, tmp_path / "mixed")
    with pytest.raises(DataError, match=r"first record had .*00000001_color/astronaut"):
        compute_mean(tmp_path / "mixed")
    with LmdbWriter(tmp_path / "empty"):
        pass
    with pytest.raises(DataError, match=r"database is empty"):
        compute_mean(tmp_path / "empty")
    with pytest.raises(DatabaseNotFoundError, match=r"no such file or directory"):
        compute_mean(tmp_path / "none")


# -- export ------------------------------------------------------------------------------------


def reference_batches(case: str) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    folder = CAFFE / "ref" / case
    n = len(list(folder.glob("data_b*.npy")))
    data = np.concatenate([np.load(folder / f"data_b{k}.npy") for k in range(n)])
    labels = np.concatenate([np.load(folder / f"label_b{k}.npy") for k in range(n)])
    return data, labels


def read_export(path: Path, fmt: str) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    if fmt == "npy":
        return np.load(path / "data.npy"), np.load(path / "labels.npy")
    if fmt == "npz":
        with np.load(path) as z:
            return z["data"], z["labels"]
    vec = caffe_pb2.BlobProtoVector()
    vec.ParseFromString(path.read_bytes())
    data, labels = vec.blobs
    return (
        np.asarray(data.data, np.float32).reshape(tuple(data.shape.dim)),
        np.asarray(labels.data, np.float32).reshape(tuple(labels.shape.dim)),
    )


@pytest.mark.parametrize(
    ("fmt", "name"), [("npy", "out"), ("npz", "out.npz"), ("binaryproto", "out.binaryproto")]
)
@pytest.mark.parametrize(
    ("case", "transform"),
    [
        ("raw_color_b8", {}),
        (
            "raw_color_b8_meanfile_scale",
            {"mean_file": CAFFE / "raw_color_mean.binaryproto", "scale": 0.017},
        ),
        ("raw_color_b8_meanvalue_crop24", {"mean_value": (104, 117, 123), "crop_size": 24}),
    ],
)
def test_export_equals_caffe_data_layer(
    tmp_path: Path, fmt: str, name: str, case: str, transform: dict[str, Any]
) -> None:
    ref_data, ref_labels = reference_batches(case)
    out = tmp_path / name
    result = export(
        CAFFE / "lmdb" / "raw_color",
        out,
        transform=Transform(**transform),
        limit=len(ref_data),
        batch_size=3,
    )
    assert result.format == fmt
    assert result.count == len(ref_data)
    data, labels = read_export(out, fmt)
    np.testing.assert_array_equal(data, ref_data)
    np.testing.assert_array_equal(labels, ref_labels)
    assert not (tmp_path / f"{name}.partial").exists()


def test_export_round_trip_equals_the_loader_batches(tmp_path: Path) -> None:
    db = CAFFE / "lmdb" / "encoded_jpg"
    tf = Transform(crop_size=20, scale=0.5, dtype="float32")
    with Batches(db, 8, transform=tf, phase="test", mode="epoch", shard=(1, 3)) as loader:
        batches = list(loader)
    expected = np.concatenate([b.data for b in batches])
    export(db, tmp_path / "o.npz", transform=tf, shard=(1, 3))
    data, labels = read_export(tmp_path / "o.npz", "npz")
    np.testing.assert_array_equal(data, expected)
    np.testing.assert_array_equal(labels, np.concatenate([b.label for b in batches]))
    assert len(data) == len(range(1, 50, 3))


def test_binaryproto_export_equals_protobufs_own_encoding(tmp_path: Path) -> None:
    out = tmp_path / "o.binaryproto"
    export(CAFFE / "lmdb" / "raw_color", out, limit=5)
    data, labels = read_export(out, "binaryproto")
    vec = caffe_pb2.BlobProtoVector()
    for arr in (data, labels):
        blob = vec.blobs.add()
        blob.shape.dim.extend(arr.shape)
        blob.data.extend(arr.ravel().tolist())
    assert out.read_bytes() == vec.SerializeToString()


def test_export_uint8_nhwc_and_limit(tmp_path: Path) -> None:
    export(
        CAFFE / "lmdb" / "raw_color",
        tmp_path / "o",
        limit=4,
        transform=Transform(dtype="uint8", layout="NHWC"),
    )
    data = np.load(tmp_path / "o" / "data.npy")
    assert data.dtype == np.uint8
    assert data.shape == (4, 32, 40, 3)
    d0 = datum(lmdb_items(CAFFE / "lmdb" / "raw_color")[0][1])
    np.testing.assert_array_equal(
        data[0], np.frombuffer(d0.data, np.uint8).reshape(3, 32, 40).transpose(1, 2, 0)
    )


def test_export_streams_in_bounded_memory(tmp_path: Path) -> None:
    db = tmp_path / "big"
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(3, 64, 64), dtype=np.uint8)
    raw = caffe_pb2.Datum(
        channels=3, height=64, width=64, data=img.tobytes(), label=1, encoded=False
    ).SerializeToString()
    with LmdbWriter(db) as w:
        w.put_many([(b"%08d" % i, raw) for i in range(1500)])
    total = 1500 * 3 * 64 * 64 * 4  # 74 MB of float32
    tracemalloc.start()
    try:
        export(db, tmp_path / "o", batch_size=32)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < total / 8, f"peak {peak} bytes for a {total}-byte export"
    data = np.load(tmp_path / "o" / "data.npy", mmap_mode="r")
    assert data.shape == (1500, 3, 64, 64)
    np.testing.assert_array_equal(data[-1], img.astype(np.float32))


def test_export_errors(tmp_path: Path) -> None:
    (tmp_path / "o.npz").write_bytes(b"old")
    with pytest.raises(OutputExistsError):
        export(CAFFE / "lmdb" / "raw_color", tmp_path / "o.npz")
    assert (tmp_path / "o.npz").read_bytes() == b"old"
    export(CAFFE / "lmdb" / "raw_color", tmp_path / "o.npz", force=True, limit=2)
    with pytest.raises(DataError, match=r"nothing to export"):
        export(CAFFE / "lmdb" / "raw_color", tmp_path / "e", limit=0)
    with pytest.raises(DatabaseNotFoundError):
        export(tmp_path / "missing", tmp_path / "x")
    lst = write_list(tmp_path / "l.txt", ["color/china_00.jpg 1", "color/astronaut.jpg 2"])
    convert_imageset(ROOT, lst, tmp_path / "mixed")
    with pytest.raises(DataError, match=r"must share a shape.*00000001_color/astronaut"):
        export(tmp_path / "mixed", tmp_path / "m")
    with pytest.raises(DataError, match=r"records of one size.*00000001_color/astronaut"):
        export(tmp_path / "mixed", tmp_path / "m", batch_size=1)
    assert not (tmp_path / "m").exists()
    export(tmp_path / "mixed", tmp_path / "m", transform=Transform(crop_size=24))
    assert np.load(tmp_path / "m" / "data.npy").shape == (2, 3, 24, 24)


@pytest.mark.parametrize("name", ["o.npz", "o.binaryproto", "o"])
def test_an_interrupted_export_leaves_no_partial_output(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (or an error) in the middle of an export removes ``OUT.partial``; one left
    by a killed run is removed by the next export, which says so."""
    from blobpipe._tools import _export

    calls = 0

    def interrupt(self: object, n: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(_export.Progress, "advance", interrupt)
    out = tmp_path / name
    with pytest.raises(KeyboardInterrupt):
        export(CAFFE / "lmdb" / "raw_color", out, batch_size=8)
    assert calls == 2
    assert not out.exists() and not (tmp_path / f"{name}.partial").exists()
    monkeypatch.undo()
    stale = tmp_path / f"{name}.partial"  # what a killed run leaves
    stale.mkdir()
    (stale / MARKER_NAME).write_text('{"kind": "export", "complete": false}')
    (stale / "data.npy").write_bytes(b"half")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("blobpipe").addHandler(handler)
    try:
        export(CAFFE / "lmdb" / "raw_color", out, batch_size=8)
    finally:
        logging.getLogger("blobpipe").removeHandler(handler)
    assert out.exists() and not stale.exists()
    assert any("an unfinished export left by an interrupted run" in m for m in seen), seen


# -- inspect and bench ---------------------------------------------------------------------------


def test_inspect_summarises_caffe_dbs() -> None:
    info = inspect_db(CAFFE / "lmdb" / "encoded_jpg", first=2)
    assert info.records == info.scanned == 50
    assert info.complete
    assert info.first_keys == (b"00000000_color/china_00.jpg", b"00000001_color/china_01.jpg")
    assert info.kinds == {"encoded": 50}
    assert info.shapes == {(3, 32, 40): 50}
    summary = info.label_summary()
    assert summary["min"] == 0
    assert summary["max"] == 1099
    assert summary["distinct"] == 44
    assert info.size_bytes > 0
    js = inspect_db(CAFFE / "lmdb" / "raw_color", limit=10).to_json()
    assert js["kinds"] == {"raw": 10}
    assert js["scanned"] == 10
    assert js["records"] == 50


def test_inspect_points_at_an_unfinished_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_convert, "_read_image", _raise_after(5))
    with pytest.raises(KeyboardInterrupt):
        convert_imageset(ROOT, LIST, tmp_path / "db", commit_every=2)
    with pytest.raises(DatabaseNotFoundError, match=r"db\.partial.*rerun the same"):
        inspect_db(tmp_path / "db")


def test_bench_counts_batches() -> None:
    result = bench(CAFFE / "lmdb" / "raw_color", batch_size=8, batches=10, seconds=None)
    assert result.batches == 10
    assert result.records >= 10 * 2
    assert result.records_per_s > 0
    assert result.mb_per_s > 0
    with pytest.raises(ValueError, match=r"give seconds or batches"):
        bench(CAFFE / "lmdb" / "raw_color", seconds=None)


def test_time_batches_takes_any_iterable_of_batches() -> None:
    class FakeBatch:
        def __init__(self, n: int) -> None:
            self.data = np.zeros((n, 3, 4, 4), np.float32)

    ticks = iter(range(100))
    result = time_batches(
        [FakeBatch(8), FakeBatch(8), FakeBatch(8), FakeBatch(5)],
        seconds=None,
        batches=10,
        warmup=1,
        clock=lambda: float(next(ticks)),
    )
    # clock: 0 start, 1 warm-up batch, 2 and 3 and 4 timed batches, 5 end; the source ran out.
    assert (result.batches, result.records, result.seconds) == (3, 21, 4.0)
    assert result.bytes == 21 * 3 * 4 * 4 * 4
    assert result.first_batch_s == 1.0
    with pytest.raises(DataError, match=r"no batches"):
        time_batches([], seconds=1.0)


# -- progress --------------------------------------------------------------------------------------


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal_only() -> None:
    now = [0.0]
    tty = FakeTTY()
    with Progress(100, "convert", stream=tty, clock=lambda: now[0]) as bar:
        for _ in range(50):
            now[0] += 0.1
            bar.advance()
    text = tty.getvalue()
    assert text.startswith("\rconvert")
    assert text.endswith("\n")
    assert "50/100 records" in text
    assert "records/s" in text
    assert "ETA 0:00:05" in text

    for stream, quiet in ((io.StringIO(), False), (FakeTTY(), True)):
        with Progress(10, "x", stream=stream, quiet=quiet) as bar:
            bar.advance(10)
        assert stream.getvalue() == ""


def test_progress_render_without_total() -> None:
    bar = Progress(
        None, "bench", unit="batches", enabled=True, stream=io.StringIO(), clock=lambda: 2.0
    )
    bar.done = 10
    assert bar.render(now=bar._start + 2.0) == "bench  10 batches  5.0 batches/s  elapsed 0:00:02"


# -- write_lmdb ----------------------------------------------------------------------------


def test_write_lmdb_writes_what_caffes_tools_write(tmp_path: Path) -> None:
    import cv2

    from tests._helpers import image

    raw = [image(i, (3, 8, 10)) for i in range(5)]
    n = blobpipe.write_lmdb(tmp_path / "raw", ((x, i) for i, x in enumerate(raw)))
    assert n == 5
    items = lmdb_items(tmp_path / "raw")
    assert [k for k, _ in items] == [b"%08d" % i for i in range(5)]
    assert [v for _, v in items] == [blobpipe.encode_raw_datum(x, i) for i, x in enumerate(raw)]
    floats = [x.astype(np.float32) / 7 for x in raw]
    keys = [b"b", b"a", b"c", b"d", b"e"]
    blobpipe.write_lmdb(tmp_path / "f", [(x, 1) for x in floats], keys=keys)
    with blobpipe.Batches(tmp_path / "f", 5, mode="epoch") as b:
        batch = next(iter(b))
    assert batch.keys == [b"a", b"b", b"c", b"d", b"e"]  # LMDB's byte order
    assert np.array_equal(batch.data[0], floats[1])
    jpg = [cv2.imencode(".jpg", x.transpose(1, 2, 0).copy())[1].tobytes() for x in raw]
    blobpipe.write_lmdb(tmp_path / "jpg", [(j, 3) for j in jpg])
    chw, label = blobpipe.decode_datum(lmdb_items(tmp_path / "jpg")[2][1])
    want = cv2.imdecode(np.frombuffer(jpg[2], np.uint8), cv2.IMREAD_UNCHANGED)
    assert label == 3 and np.array_equal(chw, want.transpose(2, 0, 1))


def test_write_lmdb_grows_the_map_refuses_overwrites_and_leaves_nothing_half_done(
    tmp_path: Path,
) -> None:
    big = [np.full((3, 64, 64), i, np.uint8) for i in range(40)]  # ~490 KB
    out = tmp_path / "db"
    assert blobpipe.write_lmdb(out, ((x, i) for i, x in enumerate(big)), map_size=1 << 16,
                               commit_every=7) == 40  # fmt: skip
    assert len(lmdb_items(out)) == 40
    with pytest.raises(blobpipe.OutputExistsError, match="already exists"):
        blobpipe.write_lmdb(out, [(big[0], 0)])
    blobpipe.write_lmdb(out, [(big[0], 9)], force=True)
    assert len(lmdb_items(out)) == 1
    with pytest.raises(blobpipe.DataError, match=r"two records have the key b'k'"):
        blobpipe.write_lmdb(tmp_path / "dup", [(big[0], 0), (big[1], 1)], keys=[b"k", b"k"])
    with pytest.raises(ValueError, match="keys ran out after 1"):
        blobpipe.write_lmdb(tmp_path / "short", [(big[0], 0), (big[1], 1)], keys=[b"k"])
    with pytest.raises(blobpipe.ShapeError):
        blobpipe.write_lmdb(tmp_path / "bad", [(np.zeros((2, 2), np.uint8), 0)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db"]  # no partial left behind


# -- a full disk ------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a disk that fills up (needs root; skipped without)."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full-disk test mounts a small tmpfs, which needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs: {done.stderr.decode(errors='replace')}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _cli(*args: str, patch: str = "") -> Any:
    """``blobpipe ARGS`` in a subprocess (a SIGBUS there fails the test, not pytest)."""
    import subprocess
    import sys

    code = f"import sys\n{patch}\nfrom blobpipe._cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("name", ["out.npy", "out.npz", "out.binaryproto"])
def test_export_to_a_full_disk_is_a_clean_error(small_disk: Path, name: str) -> None:
    """The space an export needs is checked first; nothing is left behind."""
    done = _cli("export", str(CAFFE / "lmdb" / "raw_color"), str(small_disk / name))
    assert done.returncode == 1, done
    assert "error: no space left on device: an export of shape (50, 3, 32, 40) needs" in (
        done.stderr
    )
    assert list(small_disk.iterdir()) == []
    with pytest.raises(blobpipe.DiskFullError, match="no space left on device") as info:
        blobpipe.export(CAFFE / "lmdb" / "raw_color", small_disk / name)
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert list(small_disk.iterdir()) == []


def test_export_when_the_disk_fills_while_writing_is_a_clean_error(small_disk: Path) -> None:
    """The disk fills after the check (another writer): ENOSPC from an ordinary write,
    not a SIGBUS in a memory map; the partial output is removed."""
    out = small_disk / "out.npy"
    skip_check = "import blobpipe._tools._export as e\ne.check_space = lambda *args: None"
    done = _cli("export", str(CAFFE / "lmdb" / "raw_color"), str(out), patch=skip_check)
    assert done.returncode == 1, done
    assert "error: no space left on device: the disk holding" in done.stderr
    assert "the partial export was removed" in done.stderr
    assert list(small_disk.iterdir()) == []


def test_convert_imageset_to_a_full_disk_says_so(small_disk: Path) -> None:
    out = small_disk / "db"
    done = _cli("convert-imageset", "-q", str(ROOT), str(LIST), str(out))
    assert done.returncode == 1, done
    assert "error: no space left on device: a commit of" in done.stderr, done.stderr
    assert "Input/output error;" in done.stderr  # what LMDB said, kept
    marker = read_marker(small_disk / "db.partial")
    assert marker is not None and marker["complete"] is False  # marked incomplete
    assert not out.exists()
