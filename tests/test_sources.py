"""BlobProto databases as batches, and several databases read in lockstep.

A database of ``caffe.BlobProto`` records (features, targets, label maps written
with ``Blob.to_proto`` or ``write_lmdb(record="blobproto")``) makes batches of
``(N, *blob shape)``; ``Batches({"data": ..., "label": ...})`` and the Loader read
several databases row by row as one dataset. Checked against values computed here
from the records, on the host and the emulated device.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blobpipe
from blobpipe import Batches, DataError, Geometry, Loader, Transform
from blobpipe._codec import blobproto_bytes
from blobpipe.testing import EmulatedBackend
from tests._helpers import image, key, raw_db, write_lmdb


def blob_values(i: int, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """Record ``i``'s values: ``i`` plus a ramp, so rows and positions are told apart."""
    return (i * 1000 + np.arange(int(np.prod(shape))).reshape(shape)).astype(dtype) / 7


def blob_db(
    path: Path, n: int, shape: tuple[int, ...] = (2, 3, 4), *, dtype: Any = np.float32,
    legacy: bool = False,
) -> Path:  # fmt: skip
    """``n`` BlobProto records of ``blob_values(i, shape)``."""
    return write_lmdb(
        path,
        ((key(i), blobproto_bytes(blob_values(i, shape, dtype), legacy=legacy)) for i in range(n)),
    )


def label_map(i: int, hw: tuple[int, int]) -> np.ndarray:
    """A (1, H, W) label map of record i: its image's first channel, as floats."""
    return image(i, (3, *hw))[:1].astype(np.float32)


def segmentation_dbs(tmp_path: Path, n: int, hw: tuple[int, int] = (10, 12)) -> dict[str, Path]:
    images = raw_db(tmp_path / "images", n, (3, *hw))
    labels = tmp_path / "labels"
    blobpipe.write_lmdb(labels, (label_map(i, hw) for i in range(n)), record="blobproto")
    return {"data": images, "label": labels}


# -- BlobProto databases -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "legacy"),
    [((5,), False), ((2, 3, 4), False), ((2, 1, 3, 4), False), ((1, 2, 3, 4), True)],
    ids=["1d", "3d", "4d", "legacy"],
)
def test_blobproto_batches(tmp_path: Path, shape: tuple[int, ...], legacy: bool) -> None:
    db = blob_db(tmp_path / "db", 7, shape, legacy=legacy)
    with Batches(db, 3, mode="epoch") as b:
        assert b.record_kind() == "blobproto"
        batches = list(b)
    assert [len(x.keys) for x in batches] == [3, 3, 1]
    rows = np.concatenate([x.data for x in batches])
    assert rows.dtype == np.float32 and rows.shape == (7, *shape)
    want = np.stack([blob_values(i, shape) for i in range(7)])
    np.testing.assert_array_equal(rows, want)
    assert all(x.label is None for x in batches)
    assert batches[0]["data"] is batches[0].data


def test_blobproto_double_values_exact(tmp_path: Path) -> None:
    db = blob_db(tmp_path / "db", 4, (3, 2), dtype=np.float64)
    with Batches(db, 4, blob_dtype="float64") as b:
        got = next(iter(b)).data
    assert got.dtype == np.float64
    np.testing.assert_array_equal(
        got, np.stack([blob_values(i, (3, 2), np.float64) for i in range(4)])
    )
    with Batches(db, 4) as b:  # float32 by default, as Caffe's float blobs
        got32 = next(iter(b)).data
    assert got32.dtype == np.float32
    np.testing.assert_array_equal(got32, got.astype(np.float32))


def test_blobproto_shapes_change_between_batches(tmp_path: Path) -> None:
    items = [(key(i), blobproto_bytes(blob_values(i, (2, 3) if i < 4 else (5,)))) for i in range(8)]
    db = write_lmdb(tmp_path / "db", items)
    with Batches(db, 4, mode="epoch") as b:
        shapes = [x.data.shape for x in b]
    assert shapes == [(4, 2, 3), (4, 5)]
    with Batches(db, 3, mode="epoch") as b, pytest.raises(DataError) as info:
        list(b)
    msg = str(info.value)
    assert "b'00000004'" in msg and "(5,)" in msg and "(2, 3)" in msg and str(db) in msg


def test_blobproto_bad_count_names_key_and_path(tmp_path: Path) -> None:
    good = [(key(i), blobproto_bytes(blob_values(i, (2, 3)))) for i in range(3)]
    proto = blobpipe.Blob((2, 3))
    bad = proto.to_proto()
    bad.shape.dim[1] = 4  # 8 values claimed, 6 held
    db = write_lmdb(tmp_path / "db", [*good, (key(3), bad.SerializeToString())])
    proto.close()
    with Batches(db, 2, mode="epoch") as b, pytest.raises(DataError) as info:
        list(b)
    msg = str(info.value)
    assert "b'00000003'" in msg and str(db) in msg
    assert "BlobProto of shape 2 4 (8) has 6 values in data, expected 8" in msg


def test_mixed_record_kinds_are_a_clear_error(tmp_path: Path) -> None:
    datum = blobpipe.encode_raw_datum(image(9, (3, 2, 2)), 1)
    blobs = [(key(i), blobproto_bytes(blob_values(i, (3, 2, 2)))) for i in range(3)]
    db = write_lmdb(tmp_path / "blobs", [*blobs, (key(3), datum)])
    with Batches(db, 2, mode="epoch") as b, pytest.raises(DataError) as info:
        list(b)
    assert "b'00000003'" in str(info.value) and "one kind of record" in str(info.value)
    db2 = raw_db(tmp_path / "datums", 3, (3, 2, 2))
    write_lmdb(db2, [(key(3), blobproto_bytes(blob_values(3, (3, 2, 2))))])
    with Batches(db2, 2, mode="epoch") as b, pytest.raises(DataError) as info:
        list(b)
    assert "b'00000003'" in str(info.value) and "is a caffe.BlobProto, not a Datum" in str(
        info.value
    )


def test_record_kind_can_be_named(tmp_path: Path) -> None:
    db = blob_db(tmp_path / "db", 2)
    with Batches(db, 2, record="blobproto") as b:
        assert next(iter(b)).data.shape == (2, 2, 3, 4)
    with Batches(db, 2, record="datum") as b, pytest.raises(DataError, match="not a Datum"):
        next(iter(b))
    with pytest.raises(ValueError, match="record must be"):
        Batches(db, 2, record="blob")  # type: ignore[arg-type]


def caffe_blob_transform(
    x: np.ndarray, h: int, w: int, crop: int, flip: bool, mean: np.ndarray | None, scale: float
) -> np.ndarray:
    """Caffe's DataTransformer::Transform(Blob*) for one (C, H, W) item: mean over
    the whole item, then crop, mirror, scale, in float32."""
    y = x.astype(np.float32)
    if mean is not None:
        y = (y - mean).astype(np.float32)
    if crop:
        y = y[:, h : h + crop, w : w + crop]
    if flip:
        y = y[:, :, ::-1]
    return (y * np.float32(scale)).astype(np.float32) if scale != 1 else y


@pytest.mark.parametrize("shape", [(3, 8, 9), (2, 3, 8, 9)], ids=["chw", "nchw"])
def test_blobproto_transform_is_caffes(tmp_path: Path, shape: tuple[int, ...]) -> None:
    db = blob_db(tmp_path / "db", 6, shape)
    t = Transform(crop_size=5, mirror=True, mean_value=(1.5, 2.0, -3.0), scale=0.25)
    with Batches(db, 6, transform=t, phase="train", seed=3) as b:
        plan = b.next_plan()
        assert plan is not None
        data = np.empty(plan.data_shape, plan.dtype)
        label = np.empty(6, np.float32)
        geometry = Geometry.zeros(6)
        b.fill(plan, data, label, geometry_out=geometry)
    assert data.shape == (6, *shape[:-2], 5, 5)
    mean = np.array([1.5, 2.0, -3.0], np.float32).reshape(3, 1, 1)
    flips = set()
    for r in range(6):
        h, w, flip = geometry.row(r)
        flips.add(bool(flip))
        x = blob_values(r, shape).reshape(-1, 3, 8, 9)
        want = np.stack([caffe_blob_transform(item, h, w, 5, bool(flip), mean, 0.25) for item in x])
        np.testing.assert_array_equal(data[r].reshape(-1, 3, 5, 5), want)
    assert flips == {False, True}


def test_blobproto_transform_refused_where_caffe_has_none(tmp_path: Path) -> None:
    db = blob_db(tmp_path / "db", 2, (8, 9))
    with (
        Batches(db, 2, transform=Transform(crop_size=4)) as b,
        pytest.raises(DataError, match=r"to \(C, H, W\) or \(N, C, H, W\) records only"),
    ):
        next(iter(b))
    db3 = blob_db(tmp_path / "db3", 2, (3, 8, 9))
    with (
        Batches(db3, 2, transform=Transform(dtype="uint8")) as b,
        pytest.raises(DataError, match="dtype='uint8' output is for Datum pixels"),
    ):
        next(iter(b))


# -- sources in lockstep --------------------------------------------------------------------


def test_lockstep_rows_agree(tmp_path: Path) -> None:
    dbs = segmentation_dbs(tmp_path, 11)
    with Batches(dbs, 4, order="shuffle", seed=5, mode="epoch") as b:
        assert b.names == ("data", "label")
        assert b.record_kind("label") == "blobproto"
        batches = list(b)
    seen = []
    for x in batches:
        assert x.label is x["label"] and x.label.shape == (len(x.keys), 1, 10, 12)
        for r, k in enumerate(x.keys):
            i = int(k)
            seen.append(i)
            np.testing.assert_array_equal(x.data[r], image(i, (3, 10, 12)).astype(np.float32))
            np.testing.assert_array_equal(x["label"][r], label_map(i, (10, 12)))
    assert sorted(seen) == list(range(11)) and seen != list(range(11))


def test_lockstep_shards_and_resume(tmp_path: Path) -> None:
    dbs = segmentation_dbs(tmp_path, 13)
    options: dict[str, Any] = {"order": "shuffle", "seed": 2, "mode": "epoch", "pad_shards": False}
    keys = []
    for rank in range(3):
        with Batches(dbs, 2, shard=(rank, 3), **options) as b:
            for x in b:
                for r, k in enumerate(x.keys):
                    np.testing.assert_array_equal(x["label"][r], label_map(int(k), (10, 12)))
                keys += x.keys
    assert sorted(keys) == [key(i) for i in range(13)]
    with Batches(dbs, 3, **options) as b:
        it = iter(b)
        next(it)
        state = next(it).state
        rest = [x.keys for x in it]
    with Batches(dbs, 3, state=state, **options) as b:
        resumed = list(b)
    assert [x.keys for x in resumed] == rest
    for x in resumed:
        for r, k in enumerate(x.keys):
            np.testing.assert_array_equal(x["label"][r], label_map(int(k), (10, 12)))


def test_lockstep_keys_must_agree(tmp_path: Path) -> None:
    images = raw_db(tmp_path / "images", 5)
    other = write_lmdb(
        tmp_path / "other",
        [
            (key(i) if i != 3 else b"00000003x", blobproto_bytes(blob_values(i, (2,))))
            for i in range(5)
        ],
    )
    with pytest.raises(DataError) as info:
        Batches({"data": images, "label": other}, 2)
    msg = str(info.value)
    assert "b'00000003'" in msg and "'label'" in msg and str(other) in msg
    fewer = blob_db(tmp_path / "fewer", 4, (2,))
    with pytest.raises(DataError, match=r"key b'00000004' of 'data'"):
        Batches({"data": images, "label": fewer}, 2)


def test_shared_crop_cuts_image_and_label_map_alike(tmp_path: Path) -> None:
    dbs = segmentation_dbs(tmp_path, 16, (12, 14))
    transform = {
        "data": Transform(crop_size=7, mirror=True, mean_value=(10, 20, 30)),
        "label": Transform(crop_size=7, mirror=True),
    }
    with Batches(dbs, 16, transform=transform, phase="train", share_random=True) as b:
        x = next(iter(b))
    # the label map is the image's channel 0: after the same crop and flip, pixel for pixel
    np.testing.assert_array_equal(x["label"][:, 0], x.data[:, 0] + 10)
    unflipped = [
        np.array_equal(x["label"][r, 0], image(int(k), (3, 12, 14))[0, :7, :7])
        for r, k in enumerate(x.keys)
    ]
    assert not all(unflipped)  # crops and flips did happen
    # without sharing, the label map draws its own crops and flips
    with Batches(dbs, 16, transform=transform, phase="train") as b:
        y = next(iter(b))
    np.testing.assert_array_equal(y.data, x.data)  # the image's own draws are unchanged
    assert not np.array_equal(y["label"][:, 0], y.data[:, 0] + 10)


def test_lockstep_argument_errors(tmp_path: Path) -> None:
    dbs = segmentation_dbs(tmp_path, 4)
    with pytest.raises(ValueError, match="give transform as a mapping"):
        Batches(dbs, 2, transform=Transform(scale=2))
    with pytest.raises(ValueError, match="'labels', which is not a source"):
        Batches(dbs, 2, transform={"labels": Transform()})
    with pytest.raises(ValueError, match="share_random names 'x'"):
        Batches(dbs, 2, share_random=["x"])
    with pytest.raises(ValueError, match="crop_size 3 and 0"):
        Batches(dbs, 2, transform={"data": Transform(crop_size=3)}, share_random=True)
    shared = {"data": Transform(crop_size=3), "label": Transform(crop_size=3)}
    other = tmp_path / "small"
    blobpipe.write_lmdb(other, (label_map(i, (5, 6)) for i in range(4)), record="blobproto")
    with (
        Batches({"data": dbs["data"], "label": other}, 2, transform=shared, share_random=True) as b,
        pytest.raises(DataError, match="shared crops need records of one height and width"),
    ):
        next(iter(b))


# -- the Loader ------------------------------------------------------------------------------


def loader_backends() -> list[Any]:
    return [
        pytest.param("cpu", id="host"),
        pytest.param("emulated", id="emulated"),
    ]


def make_device(name: str) -> Any:
    return EmulatedBackend(delay=0.002) if name == "emulated" else name


@pytest.mark.parametrize("small", [True, False], ids=["small", "large"])
@pytest.mark.parametrize("device", loader_backends())
def test_loader_lockstep_matches_batches(
    tmp_path: Path, device: str, small: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sources read in lockstep go into their slots batch by batch, also while batches
    count as small (no chunks: a chunk has one source)."""
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 60.0 if small else 0.0)
    dbs = segmentation_dbs(tmp_path, 10, (12, 14))
    transform = {
        "data": Transform(crop_size=7, mirror=True, mean_value=(10, 20, 30)),
        "label": Transform(crop_size=7, mirror=True),
    }
    options: dict[str, Any] = {
        "transform": transform, "phase": "train", "share_random": True, "order": "shuffle",
        "seed": 4, "mode": "epoch",
    }  # fmt: skip
    with Batches(dbs, 4, **options) as b:
        want = list(b)
    got = []
    with Loader(dbs, 4, device=make_device(device), prefetch=3, workers=2, **options) as loader:
        for batch in loader:
            assert batch.names == ["data", "label"]
            assert batch.label is batch["label"]
            got.append((batch.keys, batch.data.cpu_data().copy(), batch["label"].cpu_data().copy()))
            if batch.data.backend.has_device:
                np.testing.assert_array_equal(
                    np.asarray(batch["label"].gpu_data()), batch["label"].cpu_data()
                )
    assert len(got) == len(want)
    for (keys, data, label), w in zip(got, want, strict=True):
        assert keys == tuple(w.keys)
        np.testing.assert_array_equal(data, w.data)
        np.testing.assert_array_equal(label, w["label"])
        np.testing.assert_array_equal(label[:, 0], data[:, 0] + 10)


@pytest.mark.anyio
@pytest.mark.parametrize("small", [True, False], ids=["chunks", "one-by-one"])
@pytest.mark.parametrize("device", loader_backends())
async def test_loader_blobproto_database(
    tmp_path: Path, device: str, small: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 60.0 if small else 0.0)
    db = blob_db(tmp_path / "db", 5, (3, 4))
    async with Loader(db, 2, device=make_device(device), mode="epoch") as loader:
        assert not loader.device_transform  # float values: nothing to stage as uint8
        rows = []
        async for batch in loader:
            assert batch.label is None
            rows.append(batch.data.cpu_data().copy())
    np.testing.assert_array_equal(
        np.concatenate(rows), np.stack([blob_values(i, (3, 4)) for i in range(5)])
    )


def test_loader_device_transform_needs_datums(tmp_path: Path) -> None:
    db = blob_db(tmp_path / "db", 2, (3, 4))
    with pytest.raises(ValueError, match="device_transform=True needs Datum records"):
        Loader(db, 2, device=EmulatedBackend(), device_transform=True)


def test_write_lmdb_blobproto_round_trip(tmp_path: Path) -> None:
    arrays = [np.arange(6, dtype=np.uint8).reshape(2, 3) + i for i in range(3)]
    n = blobpipe.write_lmdb(tmp_path / "db", arrays, record="blobproto")
    assert n == 3
    with blobpipe.LmdbReader(tmp_path / "db") as reader:
        blobs = [p for _, p in reader.blobprotos()]
    assert [list(b.shape.dim) for b in blobs] == [[2, 3]] * 3
    assert list(blobs[2].data) == [float(v) for v in arrays[2].ravel()]


def test_cli_inspect_and_export_blobproto(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from blobpipe._cli import main

    db = blob_db(tmp_path / "db", 5, (2, 3))
    assert main(["inspect", str(db)]) == 0
    text = capsys.readouterr().out
    assert "kinds:     blobproto 5" in text and "2 x 3: 5" in text
    assert main(["inspect", "--json", str(db)]) == 0
    assert '"blobproto": 5' in capsys.readouterr().out
    out = tmp_path / "o.npz"
    assert main(["export", str(db), str(out)]) == 0
    with np.load(out) as z:
        np.testing.assert_array_equal(
            z["data"], np.stack([blob_values(i, (2, 3)) for i in range(5)])
        )


# -- several databases as one ----------------------------------------------------------------


def two_dbs(tmp_path: Path, shape: tuple[int, int, int] = (3, 6, 8)) -> tuple[list[Path], dict]:
    """Two raw databases (5 and 4 records, keys that repeat across them); the
    expected pixels and label of each global record."""
    a = raw_db(tmp_path / "a", 5, shape)
    b = write_lmdb(
        tmp_path / "b",
        ((key(i), blobpipe.encode_raw_datum(image(100 + i, shape), 100 + i)) for i in range(4)),
    )
    want = {i: (image(i, shape), i) for i in range(5)}
    want.update({5 + i: (image(100 + i, shape), 100 + i) for i in range(4)})
    return [a, b], want


@pytest.mark.parametrize("order", ["key", "shuffle"])
def test_databases_as_one(tmp_path: Path, order: str) -> None:
    dbs, want = two_dbs(tmp_path)
    with Batches(dbs, 4, order=order, seed=1, mode="epoch", last="keep") as b:
        assert b.num_records == 9
        batches = list(b)
    seen = []
    for x in batches:
        for r, i in enumerate(x.indices):
            seen.append(i)
            np.testing.assert_array_equal(x.data[r], want[i][0].astype(np.float32))
            assert x.label[r] == want[i][1]
    assert sorted(seen) == list(range(9))
    if order == "key":
        assert seen == list(range(9))
    else:  # rows of both databases interleave within a batch
        assert any(len({i >= 5 for i in x.indices}) == 2 for x in batches)


@pytest.mark.parametrize("order", ["key", "shuffle"])
def test_databases_as_one_report_each_rows_geometry(tmp_path: Path, order: str) -> None:
    """``geometry_out`` holds the crop and flip each row was transformed with, whether
    a database's rows make one run (key order: filled in place) or interleave with
    the other's (shuffled: filled apart and scattered), range by range."""
    dbs, want = two_dbs(tmp_path)
    t = Transform(crop_size=4, mirror=True)
    ranges = [(0, 4), (4, 9)]
    with Batches(dbs, 9, order=order, seed=0, mode="epoch", transform=t, phase="train") as b:
        plan = b.next_plan()
        assert plan is not None
        data = np.empty(plan.data_shape, plan.dtype)
        label = np.empty(9, np.float32)
        geometry = Geometry.zeros(9)
        for start, stop in ranges:
            b.fill(plan, data, label, start, stop, geometry_out=geometry)
    if order == "shuffle":  # rows of the second database at 0 and 3: filled apart
        assert [int(i) >= 5 for i in plan.indices[:4]] == [True, False, False, True]
    flips = set()
    for r, i in enumerate(plan.indices):
        p = t.record_params((3, 6, 8), phase="train", word=int(plan.words[r]))
        h, w, flip = geometry.row(r)
        assert (h, w, flip) == (p.h_off, p.w_off, p.mirror)
        x = want[int(i)][0][:, h : h + 4, w : w + 4]
        if flip:
            x = x[:, :, ::-1]
        np.testing.assert_array_equal(data[r], x.astype(np.float32))
        flips.add(flip)
    assert flips == {False, True}


def test_databases_as_one_shards_resume_and_loader(tmp_path: Path) -> None:
    dbs, _ = two_dbs(tmp_path)
    t = Transform(crop_size=4, mirror=True)
    options: dict[str, Any] = {
        "order": "shuffle", "seed": 3, "mode": "epoch", "transform": t, "phase": "train",
    }  # fmt: skip
    seen = []
    for rank in range(2):
        with Batches(dbs, 2, shard=(rank, 2), pad_shards=False, **options) as b:
            seen += [i for x in b for i in x.indices]
    assert sorted(seen) == list(range(9))
    with Batches(dbs, 3, **options) as b:
        it = iter(b)
        state = next(it).state
        rest = [(x.indices, x.data) for x in it]
    with Batches(dbs, 3, state=state, **options) as b:
        resumed = [(x.indices, x.data) for x in b]
    assert [r[0] for r in resumed] == [r[0] for r in rest]
    for (_, a), (_, c) in zip(resumed, rest, strict=True):
        np.testing.assert_array_equal(a, c)
    for device, small in itertools.product(("cpu", EmulatedBackend(delay=0.002)), (60.0, 0.0)):
        # every fill small (chunks) or large (a batch per slot)
        pipeline = blobpipe._loader._pipeline
        pipeline.SMALL_FILL, was = small, pipeline.SMALL_FILL
        with Batches(dbs, 3, **options) as b:
            expect = list(b)
        try:
            with Loader(dbs, 3, device=device, **options) as loader:
                got = [(batch.indices, batch.data.cpu_data().copy()) for batch in loader]
        finally:
            pipeline.SMALL_FILL = was
        assert [g[0] for g in got] == [tuple(e.indices) for e in expect]
        for (_, data), e in zip(got, expect, strict=True):
            np.testing.assert_array_equal(data, e.data)


def test_databases_as_one_errors(tmp_path: Path) -> None:
    dbs, _ = two_dbs(tmp_path)
    blobs = blob_db(tmp_path / "blobs", 2)
    with pytest.raises(DataError, match="hold different kinds of record") as info:
        Batches([dbs[0], blobs], 2)
    assert str(blobs) in str(info.value)
    other = raw_db(tmp_path / "other", 3, (3, 7, 8))
    with pytest.raises(DataError) as info:
        Batches([dbs[0], other], 7, mode="epoch")
    assert str(other) in str(info.value) and "b'00000000'" in str(info.value)
    with pytest.raises(ValueError, match="empty list"):
        Batches([], 2)


@pytest.mark.parametrize(
    ("shape", "fix"),
    [
        ((1, 6, 8), "force_color=True or force_gray=True"),
        ((3, 9, 9), "--resize_height/--resize_width"),
    ],
    ids=["channels", "size"],
)
def test_databases_whose_records_differ_in_shape_are_refused_at_open(
    tmp_path: Path, shape: tuple[int, int, int], fix: str
) -> None:
    """Checked at open from each database's first record: the error names both records
    (key and database) and the fix for what differs; a crop that makes the rows one
    shape makes them fine."""
    a = raw_db(tmp_path / "a", 5, (3, 6, 8))
    b = write_lmdb(
        tmp_path / "b",
        [(b"x%07d" % i, blobpipe.encode_raw_datum(image(i, shape), i)) for i in range(2)],
    )
    for order in ("key", "shuffle"):
        with pytest.raises(DataError) as info:
            Batches([a, b], 4, order=order)
        msg = str(info.value)
        assert f"record b'00000000' of {a}" in msg and f"record b'x0000000' of {b}" in msg
        assert fix in msg and str(shape) in msg
    if shape[0] == 3:
        with Batches([a, b], 7, mode="epoch", transform=Transform(crop_size=6)) as batches:
            assert [x.data.shape for x in batches] == [(7, 3, 6, 6)]


def test_lockstep_sources_of_several_databases(tmp_path: Path) -> None:
    dbs, want = two_dbs(tmp_path, (3, 10, 12))
    labels = []
    for k, (n, base) in enumerate([(5, 0), (4, 100)]):
        path = tmp_path / f"labels{k}"
        blobpipe.write_lmdb(
            path, (label_map(base + i, (10, 12)) for i in range(n)), record="blobproto"
        )
        labels.append(path)
    seen = []
    with Batches({"data": dbs, "label": labels}, 4, order="shuffle", mode="epoch") as b:
        for x in b:
            for r, i in enumerate(x.indices):
                image_i = int(want[i][1])
                np.testing.assert_array_equal(x.data[r], want[i][0])
                np.testing.assert_array_equal(x["label"][r], label_map(image_i, (10, 12)))
                seen.append(i)
    assert sorted(seen) == list(range(9))  # every record of both databases, once
