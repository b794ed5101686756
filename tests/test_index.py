"""The record index: value extents read from the LMDB file, and batches filled from it.

Every batch filled from the index must equal what the checked path (LMDB lookups
and Datum parsing, as in a source without a file) gives, and Caffe's arrays.
"""

from __future__ import annotations

import os
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blobpipe
from blobpipe._errors import DataError
from blobpipe._io._batches import ArrayBatch, Batches
from blobpipe._io._kernels import Geometry
from blobpipe._io._lmdbfile import NamedDatabases, value_extents
from blobpipe._io._records import ENCODED, PARSED, RAW
from blobpipe._io._transform import Transform
from tests._helpers import (
    encoded_db,
    epochs,
    float_db,
    image,
    in_forked_child,
    key,
    lmdb_items,
    lmdb_stat,
    open_lmdb,
    raw_db,
    write_lmdb,
)
from tests.conftest import REF_CASES

CAFFE = Path(__file__).parent / "data" / "caffe"


class PlainSource:
    """The same records with no file behind them: Batches reads them the checked way."""

    def __init__(self, path: Path) -> None:
        with blobpipe.LmdbReader(path) as reader:
            self._items = {k: reader.get(k) for k in reader}
        self.path = str(path)

    def keys(self) -> list[bytes]:
        return sorted(self._items)

    def get(self, key: bytes) -> bytes:
        return self._items[key]


def values_of(path: Path) -> list[bytes]:
    return [v for _, v in lmdb_items(path)]


def check_extents(path: Path) -> None:
    with blobpipe.LmdbReader(path) as reader:
        file = reader._mapped_file()
        assert file is not None
        extents = value_extents(file, reader.keys())
        assert extents is not None
        got = [
            file[o : o + n].tobytes()
            for o, n in zip(extents.offsets.tolist(), extents.lengths.tolist(), strict=True)
        ]
    assert got == values_of(path)


# -- extents -----------------------------------------------------------------------------------


@pytest.mark.parametrize("db", ["raw_color", "encoded_jpg"])
def test_extents_of_caffe_databases(db: str) -> None:
    check_extents(CAFFE / "lmdb" / db)


def test_extents_inline_overflow_and_deep_trees(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    # small values stay in the leaf pages, large ones go to overflow pages;
    # 300-byte keys make a tree of several branch levels
    items = [
        (f"{i:06d}".encode() + b"k" * int(rng.integers(0, 300)), rng.bytes(int(n)))
        for i, n in enumerate(rng.choice([1, 40, 900, 2100, 5000, 20000], 3000))
    ]
    path = write_lmdb(tmp_path / "mixed", items)
    assert lmdb_stat(path)["depth"] >= 3
    check_extents(path)


def test_extents_after_deletes_and_rewrites(tmp_path: Path) -> None:
    path = raw_db(tmp_path / "db", 200)
    with open_lmdb(path) as env, env.begin(write=True) as txn:
        for i in range(0, 200, 3):
            txn.delete(key(i))
        for i in range(0, 200, 7):
            txn.put(key(i), blobpipe.encode_raw_datum(image(1000 + i), 7))
    check_extents(path)


def test_extents_refuse_what_they_do_not_understand(tmp_path: Path) -> None:
    path = raw_db(tmp_path / "db", 30)
    with blobpipe.LmdbReader(path) as reader:
        file = reader._mapped_file()
        assert file is not None
        keys = list(reader.keys())
        assert value_extents(file, keys) is not None
        assert value_extents(file, keys[:-1]) is None  # not the same keys
        assert value_extents(file, [*keys[:-1], b"00000029x"]) is None
        assert value_extents(file, list(reversed(keys))) is None
        assert value_extents(np.zeros(1 << 16, np.uint8), keys) is None
        assert value_extents(file[: file.size // 2], keys) is None  # truncated
        junk = np.random.default_rng(1).integers(0, 256, file.size, dtype=np.uint8)
        junk[: 2 * 4096] = file[: 2 * 4096]  # valid meta pages, garbage tree
        assert value_extents(junk, keys) is None
        flagged = file.copy()
        for meta in (0, 4096):
            flagged[meta + 92] = 0x04  # the main database's md_flags: MDB_DUPSORT
        assert value_extents(flagged, keys) is None
    named = tmp_path / "named"
    with open_lmdb(named, max_dbs=2) as env:
        sub = env.open_db(b"sub")
        with env.begin(write=True) as txn:
            txn.put(b"a", b"1", db=sub)
    # the main database holds the sub-database's record: not records, and said so
    with pytest.raises(NamedDatabases) as info:
        value_extents(np.fromfile(named / "data.mdb", np.uint8), [b"sub"])
    assert info.value.args == (b"sub",)


# -- batches from the index equal the checked path --------------------------------------------


def indexed_equals_checked(path: Path, batch_size: int, n: int, **kwargs: Any) -> Any:
    """``n`` epochs from the file (indexed) equal those of the checked path; the index."""
    with Batches(PlainSource(path), batch_size, **kwargs) as plain:
        expected = epochs(plain, n)
    with Batches(path, batch_size, **kwargs) as b:
        got = epochs(b, n)
        index = b._filler._index
    assert b._filler._index is None  # closing drops the index and its map of the file
    for e in range(n):
        assert_same(got[e], expected[e])
    return index


def assert_same(a: list[ArrayBatch], b: list[ArrayBatch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys == y.keys
        assert x.data.dtype == y.data.dtype
        assert np.array_equal(x.data, y.data)
        assert np.array_equal(x.label, y.label)


CONFIGS: dict[str, dict[str, Any]] = {
    "float32": {"transform": Transform()},
    "scale": {"transform": Transform(scale=1 / 256)},
    "uint8": {"transform": Transform(dtype="uint8")},
    "mean_scale": {"transform": Transform(mean_value=(10.5, 20, 30.25), scale=0.017)},
    "mean_value_crop_test": {
        "transform": Transform(mean_value=(104, 117, 123), crop_size=8),
        "phase": "test",
    },
    "crop_mirror_train": {"transform": Transform(crop_size=8, mirror=True), "phase": "train"},
    "mirror_test_nhwc": {
        "transform": Transform(mirror=True, layout="NHWC", scale=0.5),
        "phase": "test",
    },
    "uint8_shuffle": {"transform": Transform(dtype="uint8"), "order": "shuffle"},
    "scale_shuffle": {"transform": Transform(scale=0.25), "order": "shuffle"},
    "buffer_pad": {"transform": Transform(), "order": "buffer", "buffer_size": 9, "last": "pad"},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("kind", ["raw", "jpg", "png"])
def test_index_batches_equal_the_checked_path(tmp_path: Path, config: str, kind: str) -> None:
    if kind == "raw":
        path = raw_db(tmp_path / "db", 70)
    else:
        path = encoded_db(tmp_path / "db", 70, "." + kind)
    kwargs = {"mode": "epoch", "phase": "test", **CONFIGS[config]}
    index = indexed_equals_checked(path, 16, 3, **kwargs)
    assert index is not None
    # every record noted, random crops (TRAIN: row by row) included
    loc = index.locate(np.arange(70))
    assert (loc.kind == (RAW if kind == "raw" else ENCODED)).all()
    assert (loc.shape == (3, 10, 12)).all()


def refuse_lmdb(b: Batches) -> None:
    """Make every LMDB read of ``b`` fail the test."""
    reader: Any = b._reader

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("LMDB read")

    reader.transaction = refuse
    reader.get = refuse


def test_known_batches_do_not_touch_lmdb(tmp_path: Path) -> None:
    """After the first epoch, batches come from the file map only."""
    for path, t in [
        (raw_db(tmp_path / "raw", 40), Transform(scale=0.5)),
        (encoded_db(tmp_path / "jpg", 40, ".jpg"), Transform(scale=0.5)),
    ]:
        with Batches(path, 8, transform=t, mode="epoch") as b:
            first = epochs(b, 1)[0]
            refuse_lmdb(b)
            again = epochs(b, 1)[0]
        assert_same(again, first)


@pytest.mark.parametrize("kind", ["raw", "jpg"])
def test_random_crops_come_from_the_index_too(tmp_path: Path, kind: str) -> None:
    """TRAIN with random crops and flips goes row by row: from the file map after the
    first epoch, with each row's own crop and flip, equal to the checked path's."""
    path = raw_db(tmp_path / "db", 40) if kind == "raw" else encoded_db(tmp_path / "db", 40, ".jpg")
    kwargs: dict[str, Any] = {
        "transform": Transform(crop_size=6, mirror=True, scale=0.5),
        "phase": "train",
        "mode": "epoch",
        "order": "shuffle",
        "seed": 3,
    }
    with Batches(PlainSource(path), 8, **kwargs) as plain:
        expected = epochs(plain, 2)
    with Batches(path, 8, **kwargs) as b:
        first = epochs(b, 1)[0]
        refuse_lmdb(b)
        second = epochs(b, 1)[0]
    assert_same(first, expected[0])
    assert_same(second, expected[1])
    assert not all(np.array_equal(x.data, y.data) for x, y in zip(first, second, strict=True))


def test_mixed_databases_take_the_checked_path_where_needed(tmp_path: Path) -> None:
    ok, jpg = cv2.imencode(".jpg", np.ascontiguousarray(image(5).transpose(1, 2, 0)))
    assert ok
    items = {key(i): blobpipe.encode_raw_datum(image(i), i) for i in range(20)}
    items[key(5)] = blobpipe.encode_encoded_datum(jpg.tobytes(), 5)
    items[key(9)] = blobpipe.encode_float_datum(image(9).astype(np.float32) / 3, 9)
    path = write_lmdb(tmp_path / "mixed", sorted(items.items()))
    for t in (Transform(), Transform(scale=0.5)):
        for bs in (1, 4):
            index = indexed_equals_checked(path, bs, 3, transform=t, mode="epoch")
            if bs == 4:
                assert index is not None
                kinds = index.locate(np.arange(20)).kind
                assert kinds[9] == PARSED  # float data: read through the parser
                assert kinds[5] == ENCODED  # the JPEG
                assert (kinds[[0, 1, 2, 3, 12, 19]] == RAW).all()
    items[key(12)] = blobpipe.encode_raw_datum(image(12, (3, 4, 4)), 12)  # another shape
    path = write_lmdb(tmp_path / "mixed2", sorted(items.items()))
    for _ in range(2):  # the same error in a second Batches over the same file
        with Batches(path, 4, mode="epoch") as b:
            assert len(list(islice(iter(b), 3))) == 3
            with pytest.raises(DataError, match="record key b'00000013'"):
                next(iter(b))  # record 12 is 3×4×4, the others of its batch 3×10×12
    with Batches(float_db(tmp_path / "f", 12), 4, mode="epoch") as b:
        assert len(epochs(b, 2)[1]) == 3


def test_caffe_references_through_the_index() -> None:
    """Epoch 2 (indexed) of each reference case equals Caffe's arrays."""
    for case, (db, kwargs) in REF_CASES.items():
        ref = CAFFE / "ref" / case
        n = len(list(ref.glob("data_b*.npy")))
        t = Transform(**kwargs)  # type: ignore[arg-type]
        with Batches(CAFFE / "lmdb" / db, 8, transform=t, phase="test", mode="epoch") as b:
            list(b)  # epoch 1: learns the records
            got = list(islice(iter(b), n))
            assert b._filler._index is not None
        for k, batch in enumerate(got):
            assert np.array_equal(batch.data, np.load(ref / f"data_b{k}.npy")), (case, k)
            assert np.array_equal(batch.label, np.load(ref / f"label_b{k}.npy")), (case, k)


def test_loader_threads_over_the_index(tmp_path: Path) -> None:
    path = raw_db(tmp_path / "db", 300)
    t = Transform(scale=1 / 3)
    with Batches(PlainSource(path), 16, transform=t, mode="epoch", order="shuffle") as plain:
        expected = [np.concatenate([x.data for x in e]) for e in epochs(plain, 3)]
    loader = blobpipe.Loader(
        path, batch_size=16, device="cpu", transform=t, mode="epoch", order="shuffle", workers=3
    )
    with loader:
        for e in range(3):
            got = np.concatenate([batch.data.cpu_data().copy() for batch in loader])
            assert np.array_equal(got, expected[e]), e


@pytest.mark.parametrize("ext", [".jpg", ".png"])
@pytest.mark.parametrize("flags", [{}, {"force_color": True}, {"force_gray": True}])
def test_gray_and_color_images_through_the_index(
    tmp_path: Path, ext: str, flags: dict[str, bool]
) -> None:
    def encode(i: int) -> bytes:
        img = image(i, (3, 9, 7))
        pix = img[0] if i % 2 else np.ascontiguousarray(img.transpose(1, 2, 0))  # gray, color
        ok, buf = cv2.imencode(ext, pix)
        assert ok
        return blobpipe.encode_encoded_datum(buf.tobytes(), i)

    # gray and color images in separate halves, so batches of 4 share a shape
    items = [(key(i), encode(2 * i + 1)) for i in range(12)]
    items += [(key(100 + i), encode(2 * i)) for i in range(12)]
    path = write_lmdb(tmp_path / "db", items)
    kwargs: dict[str, Any] = {
        "transform": Transform(scale=0.5, **flags),
        "mode": "epoch",
        "phase": "test",
    }
    index = indexed_equals_checked(path, 4, 3, **kwargs)
    assert index is not None
    gray, color = (1, 9, 7), (3, 9, 7)
    if flags:
        gray = color = color if "force_color" in flags else gray
    for rows, shape in ((range(12), gray), (range(12, 24), color)):
        loc = index.locate(np.asarray(rows))  # every image noted, decoded as the flags say
        assert (loc.kind == ENCODED).all() and (loc.shape == shape).all()


def test_extents_refuse_page_numbers_past_the_file(tmp_path: Path) -> None:
    path = write_lmdb(tmp_path / "db", [(key(i), bytes(3000)) for i in range(400)])
    with blobpipe.LmdbReader(path) as reader:
        file = reader._mapped_file()
        assert file is not None
        keys = list(reader.keys())
        assert value_extents(file, keys) is not None
        bad = file.copy()
        for meta in (0, 4096):
            # the main database's root moved 2**52 pages on: past the file, and the
            # same page modulo 2**64 once multiplied by the page size
            root = int.from_bytes(bad[meta + 128 : meta + 136].tobytes(), "little")
            if root == 2**64 - 1:
                continue  # an older meta page of the empty database (no root)
            moved = (root + 2**52).to_bytes(8, "little")
            bad[meta + 128 : meta + 136] = np.frombuffer(moved, np.uint8)
        assert value_extents(bad, keys) is None


def test_a_file_replaced_after_opening_is_read_as_opened(tmp_path: Path) -> None:
    """The map of the data file is made when the database is opened: replacing the file
    at that path afterwards changes neither what LMDB nor what the index reads."""
    path = raw_db(tmp_path / "db", 20)
    with blobpipe.LmdbReader(path) as reader:
        replacement = write_lmdb(
            tmp_path / "other",
            ((key(i), blobpipe.encode_raw_datum(image(500 + i), 500 + i)) for i in range(20)),
        )
        (path / "data.mdb").rename(tmp_path / "old.mdb")  # LMDB keeps the old file open
        (replacement / "data.mdb").rename(path / "data.mdb")
        with Batches(reader, 4, mode="epoch") as b:
            batches = list(b)
            assert b._filler._index is not None
    assert [int(i) for x in batches for i in x.label] == list(range(20))
    for x in batches:
        for r, i in enumerate(x.indices):
            assert np.array_equal(x.data[r], image(i, (3, 10, 12)).astype(np.float32))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.binary(min_size=1, max_size=300),  # key
            st.integers(0, 20_000),  # value size: inline and overflow values
            st.booleans(),  # deleted in a later transaction
        ),
        min_size=1,
        max_size=120,
        unique_by=lambda t: t[0],
    ),
    st.integers(0, 2**32 - 1),
)
def test_extents_of_random_databases(
    tmp_path: Path, items: list[tuple[bytes, int, bool]], seed: int
) -> None:
    """Random keys and value sizes, written over several transactions with deletes and
    rewrites: every value's extent holds exactly LMDB's bytes."""
    rng = np.random.default_rng(seed)
    path = Path(tempfile.mkdtemp(dir=tmp_path))  # one database per example
    # several commits: pages are freed and reused
    write_lmdb(path, [(k, rng.bytes(n)) for k, n, _ in items], commit_every=40)
    with open_lmdb(path) as env, env.begin(write=True) as txn:
        for k, n, deleted in items:
            if deleted:
                txn.delete(k)
            elif n % 3 == 0:
                txn.put(k, rng.bytes(n // 2 + 1))  # rewritten, another size
    if all(deleted for *_, deleted in items):
        return  # an empty database: nothing to read
    check_extents(path)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.parametrize("kind", ["raw", "jpg"])
def test_index_in_a_forked_child(tmp_path: Path, kind: str) -> None:
    """Batches indexed in the parent keep reading right in a fork child (the map is
    inherited; the child's reader reopens its own environment)."""
    path = raw_db(tmp_path / "db", 40) if kind == "raw" else encoded_db(tmp_path / "db", 40, ".jpg")
    with Batches(path, 8, transform=Transform(scale=0.5), mode="epoch") as b:
        first = epochs(b, 2)  # learned; the second epoch came from the index
        assert b._filler._index is not None

        def child() -> bool:
            again = epochs(b, 1)[0]
            return len(again) == len(first[1]) and all(
                np.array_equal(x.data, y.data) and np.array_equal(x.label, y.label)
                for x, y in zip(again, first[1], strict=True)
            )

        assert in_forked_child(child) == 0


def _mean_file(path: Path, shape: tuple[int, int, int]) -> Path:
    from blobpipe._proto import caffe_pb2

    mean = np.random.default_rng(9).uniform(0, 255, shape).astype(np.float32)
    proto = caffe_pb2.BlobProto(num=1, channels=shape[0], height=shape[1], width=shape[2])
    proto.data.extend(mean.reshape(-1).tolist())
    path.write_bytes(proto.SerializeToString())
    return path


TRAIN_CROPS: dict[str, dict[str, Any]] = {
    "mean_file": {"crop_size": 7, "mirror": True, "scale": 0.017, "mean": True},
    "mean_value_nhwc": {
        "crop_size": 9,
        "mirror": True,
        "mean_value": (1, 2.5, 3),
        "layout": "NHWC",
    },
    "uint8": {"crop_size": 5, "mirror": True, "dtype": "uint8"},
    "no_mirror": {"crop_size": 10, "scale": 0.5},
    "full_crop": {"crop_size": 10, "mirror": True},  # the crop is the whole height
}


@pytest.mark.parametrize("config", sorted(TRAIN_CROPS))
@pytest.mark.parametrize("kind", ["raw", "jpg"])
@pytest.mark.parametrize("batch_size", [1, 6])
def test_train_crops_from_the_index_equal_the_checked_path(
    tmp_path: Path, config: str, kind: str, batch_size: int
) -> None:
    """TRAIN crops from the file map equal those of a source with no file: pixels,
    labels and the params a device transform receives."""
    path = raw_db(tmp_path / "db", 23) if kind == "raw" else encoded_db(tmp_path / "db", 23, ".jpg")
    kw = dict(TRAIN_CROPS[config])
    if kw.pop("mean", False):
        kw["mean_file"] = _mean_file(tmp_path / "mean.binaryproto", (3, 10, 12))
    kwargs: dict[str, Any] = {
        "transform": Transform(**kw),
        "phase": "train",
        "mode": "epoch",
        "order": "shuffle",
        "seed": 11,
    }
    index = indexed_equals_checked(path, batch_size, 3, **kwargs)
    assert index is not None
    loc = index.locate(np.arange(23))
    assert (loc.kind == (ENCODED if kind == "jpg" else RAW)).all()

    def geometry_of(source: Any) -> list[Geometry]:
        out = []
        with Batches(source, batch_size, **kwargs) as b:
            for _ in range(2):  # the second epoch comes from the index
                while (plan := b.next_plan()) is not None:
                    data = np.empty(plan.data_shape, plan.dtype)
                    geometry = Geometry.zeros(len(plan))
                    b.fill(plan, data, np.empty(len(plan), np.float32), geometry_out=geometry)
                    out.append(geometry)
        return out

    got, want = geometry_of(path), geometry_of(PlainSource(path))
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a.arrays(), b.arrays(), strict=True))


@settings(max_examples=200, deadline=None)
@given(
    words=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=20),
    h=st.integers(1, 40),
    w=st.integers(1, 40),
    crop=st.integers(0, 40),
    mirror=st.booleans(),
    phase=st.sampled_from(["train", "test"]),
)
def test_geometry_equals_record_params(
    words: list[int], h: int, w: int, crop: int, mirror: bool, phase: Any
) -> None:
    if crop > min(h, w):
        crop = min(h, w)
    t = Transform(crop_size=crop, mirror=mirror)
    h_off, w_off, flip = t.geometry((3, h, w), phase, np.array(words, np.uint64)).arrays()
    for i, word in enumerate(words):
        p = t.record_params((3, h, w), phase=phase, word=word)
        assert (int(h_off[i]), int(w_off[i]), bool(flip[i])) == (p.h_off, p.w_off, p.mirror)


@pytest.mark.parametrize("ext", [".jpg", ".png"])
def test_train_crops_over_images_of_several_sizes(tmp_path: Path, ext: str) -> None:
    """Encoded images of different sizes, cropped to one (TRAIN): after the first
    epoch every batch comes from the file map, one pass per size, equal to the
    checked path (pixels, labels, crop params)."""
    sizes = [(10, 12), (12, 10), (14, 16), (9, 9)]

    def encode(i: int) -> bytes:
        h, w = sizes[i % len(sizes)]
        pix = np.ascontiguousarray(image(i, (3, h, w)).transpose(1, 2, 0))
        ok, buf = cv2.imencode(ext, pix)
        assert ok
        return blobpipe.encode_encoded_datum(buf.tobytes(), i)

    path = write_lmdb(tmp_path / "db", [(key(i), encode(i)) for i in range(30)])
    kwargs: dict[str, Any] = {
        "transform": Transform(crop_size=8, mirror=True, mean_value=(3, 2, 1), scale=0.5),
        "phase": "train",
        "mode": "epoch",
        "order": "shuffle",
        "seed": 5,
    }
    with Batches(PlainSource(path), 7, **kwargs) as plain:
        expected = epochs(plain, 3)
    with Batches(path, 7, **kwargs) as b:
        got = epochs(b, 1)
        refuse_lmdb(b)
        got += epochs(b, 2)
        index = b._filler._index
        assert index is not None
        loc = index.locate(np.arange(30))
    for e in range(3):
        assert_same(got[e], expected[e])
    assert (loc.kind == ENCODED).all()
    assert {tuple(s) for s in loc.shape.tolist()} == {(3, h, w) for h, w in sizes}
    assert index.shapes_known  # every record decoded once: later fills look for none


def test_images_of_many_sizes_share_one_output_and_one_fit(tmp_path: Path) -> None:
    """Where the crop fits every image and no mean file ties rows to a size, a plan's
    output and a record's fit are decided once for all sizes (Transform.output_class),
    not once per size; an image the crop does not fit is its own class, refused."""
    sizes = [(10 + i % 5, 9 + i % 7) for i in range(35)]

    def encode(i: int) -> bytes:
        h, w = sizes[i]
        pix = np.ascontiguousarray(image(i, (3, h, w)).transpose(1, 2, 0))
        ok, buf = cv2.imencode(".png", pix)
        assert ok
        return blobpipe.encode_encoded_datum(buf.tobytes(), i)

    path = write_lmdb(tmp_path / "db", [(key(i), encode(i)) for i in range(len(sizes))])
    t = Transform(crop_size=8, mirror=True, mean_value=(3, 2, 1))
    with Batches(path, 5, transform=t, phase="train", mode="epoch", order="shuffle") as b:
        epochs(b, 2)
        assert len(b._out_shapes) == 1 and len(b._filler._fit) <= 1
    two = write_lmdb(tmp_path / "two", [(key(0), encode(0)), (key(1), encode(1))])
    with Batches(two, 1, transform=Transform(crop_size=10), mode="epoch") as b:
        with pytest.raises(DataError, match=r"crop_size 10 is larger .*height 10, width 9"):
            b.next_plan()
        assert b.next_plan() is not None  # 11x10: the crop fits
        assert list(b._out_shapes) == [(0, (3, -1, -1))]


def test_shapes_are_known_once_the_last_encoded_record_is_noted(tmp_path: Path) -> None:
    """``shapes_known`` turns true when the last encoded record's shape is noted, not
    before, however the notes repeat rows (in one call or across calls)."""
    n = 12
    with Batches(encoded_db(tmp_path / "db", n, ".jpg"), 4) as b:
        index = b._filler.index()
        assert index is not None
        rows = np.arange(n, dtype=np.intp)
        assert not index.shapes_known  # nothing classified yet
        index.locate(rows)  # every record classified: encoded, no shape known
        assert not index.shapes_known

        def note(at: list[int]) -> None:
            index.note_shapes(np.array(at, np.intp), np.full((len(at), 3), 5, np.int32))

        note([0, 1, 1, 2])
        note([2, 3])
        note(list(range(n - 1)))
        assert not index.shapes_known  # record n - 1 is not noted yet
        note([0, n - 1, n - 1])
        assert index.shapes_known
        note([n - 1])
        assert index.shapes_known


def test_the_walker_reads_the_meta_page_lmdb_reads(tmp_path: Path) -> None:
    """When both meta pages claim the same transaction (one bit flipped in a txnid),
    LMDB reads meta 0: so must the page walker, or batches hold the other tree's data."""
    path = tmp_path / "db"
    with open_lmdb(path) as env:
        for generation in (0, 100):  # two commits: meta 1, then meta 0, two trees
            with env.begin(write=True) as txn:
                for i in range(12):
                    txn.put(key(i), blobpipe.encode_raw_datum(image(i), generation + i))
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    psize = int.from_bytes(raw[40:44], "little")
    txnid = slice(144, 152)
    older = min(
        raw[txnid], raw[psize + 144 : psize + 152], key=lambda b: int.from_bytes(b, "little")
    )
    raw[txnid] = raw[psize + 144 : psize + 152] = older  # a tie: LMDB reads meta 0
    data.write_bytes(bytes(raw))
    want = [blobpipe.parse_datum(v).label for _, v in lmdb_items(path)]
    with Batches(path, 12, mode="epoch") as b:
        got = next(iter(b))
        assert b._filler._index is not None  # read through the walker's offsets
    assert got.label.tolist() == want


def test_a_database_rewritten_while_read_is_refused_not_torn(tmp_path: Path) -> None:
    """A writer rewriting every record between two epochs: the second epoch must not mix
    one generation's labels with another's pixels (what a stale index of offsets would
    read); blobpipe reads one snapshot and says the database changed."""
    import subprocess
    import sys

    path = raw_db(tmp_path / "db", 24)
    with Batches(path, 8, mode="epoch") as b:
        first = epochs(b, 1)[0]
        assert [x.label.tolist() for x in first] == [list(range(k, k + 8)) for k in (0, 8, 16)]
        rewrite = (
            "import sys, lmdb, blobpipe, numpy as np\n"
            "env = lmdb.open(sys.argv[1], map_size=1 << 28)\n"
            "for g in range(1, 4):  # generations: freed pages get reused\n"
            "    with env.begin(write=True) as txn:\n"
            "        for i in range(24):\n"
            "            pix = np.full((3, 10, 12), 200 - i - g, np.uint8)\n"
            "            txn.put(b'%08d' % i, blobpipe.encode_raw_datum(pix, 1000 * g + i))\n"
            "env.close()\n"
        )
        subprocess.run([sys.executable, "-c", rewrite, str(path)], check=True, timeout=60)

        def second_epoch() -> None:
            for batch in iter(b):
                # without the check: the index's old labels, and whatever the pages hold now
                for r, i in enumerate(batch.indices):
                    assert batch.label[r] == i
                    assert np.array_equal(batch.data[r], image(i, (3, 10, 12)).astype(np.float32))

        with pytest.raises(DataError, match="the database changed while it was being read"):
            second_epoch()


def test_records_in_a_named_sub_database_are_a_clear_error(tmp_path: Path) -> None:
    """Records written into a named sub-database leave the main database holding only its
    name: said so, not "not a valid caffe.Datum: field number 0"."""
    path = tmp_path / "db"
    with open_lmdb(path, max_dbs=2) as env:
        sub = env.open_db(b"train")
        with env.begin(write=True, db=sub) as txn:
            for i in range(4):
                txn.put(key(i), blobpipe.encode_raw_datum(image(i), i))
    with (
        pytest.raises(DataError, match=r"named sub-databases \(b'train'\), not records"),
        Batches(path, 2) as b,
    ):
        next(iter(b))


def _index_of(tmp_path: Path, count: int) -> Any:
    import blobpipe._io._index as index_module

    items = [(key(i), blobpipe.encode_raw_datum(image(i), i)) for i in range(count)]
    db = write_lmdb(tmp_path / "db", items)
    file = np.fromfile(Path(db) / "data.mdb", np.uint8)
    extents = value_extents(file, [k for k, _ in items])
    assert extents is not None
    return index_module.RecordIndex(file, extents.offsets, extents.lengths)


def test_records_in_key_order_are_classified_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range read in key order classifies the records after it in the same pass,
    also when some of its own records are known already (each batch's first record,
    read to plan the batch): the next batches' records are not classified one by one."""
    import blobpipe._io._index as index_module

    passes: list[int] = []
    real = index_module.classify

    def classify(buffer: Any, offsets: Any, *args: Any) -> Any:
        passes.append(len(offsets))
        return real(buffer, offsets, *args)

    monkeypatch.setattr(index_module, "classify", classify)
    index = _index_of(tmp_path, 400)
    for first in (0, 32, 64):  # batch firsts, read one by one to plan the batches
        index.locate(np.array([first], np.intp))
    assert passes == [1, 1, 1]
    got = index.locate(np.arange(0, 96, dtype=np.intp), image(0).shape)  # three batches
    assert (got.kind == RAW).all() and got.label.tolist() == list(range(96))
    # the range's unknown records and as many after it (the index's first pass ahead)
    assert passes[3] == 96 - 3 + 96
    assert index.locate(np.arange(96, 192, dtype=np.intp), image(0).shape).kind.all()
    assert len(passes) == 4  # the next three batches: classified ahead
    rest = index.locate(np.arange(192, 400, dtype=np.intp), image(0).shape)
    assert (rest.kind == RAW).all() and rest.label.tolist() == list(range(192, 400))
    assert passes[4:] == [400 - 192]  # twice as far ahead: every record left
    assert len(index.locate(np.arange(400, dtype=np.intp)).kind) == 400
    assert len(passes) == 5  # nothing left to classify


def test_the_reach_ahead_doubles_from_the_first_batch_up_to_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches read in key order: the first pass takes its batch's records and as many
    after them, each later pass twice as many as the one before, up to ``_AHEAD``
    records: the first batch does not wait for a classification of 8 MiB of others."""
    import blobpipe._io._index as index_module

    passes: list[tuple[int, int]] = []
    real = index_module.classify

    def classify(buffer: Any, offsets: Any, *args: Any) -> Any:
        passes.append((int(offsets[0]), len(offsets)))
        return real(buffer, offsets, *args)

    monkeypatch.setattr(index_module, "_AHEAD", 64)
    index = _index_of(tmp_path, 400)
    record_at = {int(at): i for i, at in enumerate(index._value_offset)}
    monkeypatch.setattr(index_module, "classify", classify)
    for first in range(0, 400, 10):
        got = index.locate(np.arange(first, first + 10, dtype=np.intp), image(0).shape)
        assert (got.kind == RAW).all() and got.label.tolist() == list(range(first, first + 10))
    firsts = [record_at[at] for at, _ in passes]
    sizes = [n for _, n in passes]
    assert firsts == [0, 20, 50, 100, 174, 244, 314, 384]
    assert sizes == [20, 30, 50, 74, 70, 70, 70, 16]  # a batch's unknown records, then those ahead


def test_threads_reading_consecutive_batches_classify_each_record_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fillers reading consecutive batches at once (key order) do not classify
    the same range ahead twice: the second waits for the first's pass and finds its
    records known; every record is classified exactly once, and right."""
    import threading

    import blobpipe._io._index as index_module

    classified: list[int] = []
    inside = threading.Event()
    real = index_module.classify

    def classify(buffer: Any, offsets: Any, *args: Any) -> Any:
        classified.extend(offsets.tolist())
        inside.set()
        time.sleep(0.05)  # the other thread asks meanwhile
        return real(buffer, offsets, *args)

    monkeypatch.setattr(index_module, "classify", classify)
    index = _index_of(tmp_path, 300)
    shape = image(0).shape
    got: dict[int, Any] = {}

    def read(first: int) -> None:
        got[first] = index.locate(np.arange(first, first + 32, dtype=np.intp), shape)

    one = threading.Thread(target=read, args=(0,))
    one.start()
    assert inside.wait(10)
    two = threading.Thread(target=read, args=(32,))
    two.start()
    one.join(10)
    two.join(10)
    # once each: the first pass took its batch and as many records ahead, the second
    # batch's (the second thread waited for it and found them known)
    assert len(classified) == len(set(classified)) == 64
    for first, located in got.items():
        assert (located.kind == RAW).all()
        assert located.label.tolist() == list(range(first, first + 32))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_fork_while_another_thread_classifies_leaves_the_child_free(tmp_path: Path) -> None:
    """The classify lock held by a parent's thread at the fork does not block the
    child: it classifies with a lock of its own."""
    index = _index_of(tmp_path, 64)
    index._classifying.acquire()  # as if another thread were classifying at the fork
    try:

        def child() -> bool:
            got = index.locate(np.arange(0, 64, dtype=np.intp), image(0).shape)
            return bool((got.kind == RAW).all()) and got.label.tolist() == list(range(64))

        assert in_forked_child(child) == 0
    finally:
        index._classifying.release()


@pytest.mark.parametrize("gray", [False, True])
@pytest.mark.parametrize("ext", [".jpg", ".png"])
def test_encoded_rows_of_the_batch_shape_and_others_crop_as_each_record_alone(
    tmp_path: Path, ext: str, gray: bool
) -> None:
    """A TRAIN batch of encoded images, some of the batch's record shape (one crop
    draw serves them) and some of other sizes (a draw each): every row equals the
    record decoded whole, cropped and flipped by its own record_params, with
    Caffe's arithmetic, and the geometry written out is those params."""
    sizes = [(12, 14), (12, 14), (16, 12), (12, 14), (11, 11), (12, 14)]

    def pixels(i: int) -> np.ndarray:
        h, w = sizes[i % len(sizes)]
        return np.ascontiguousarray(image(i, (3, h, w)).transpose(1, 2, 0))

    def encode(i: int) -> bytes:
        ok, buf = cv2.imencode(ext, pixels(i))
        assert ok
        return blobpipe.encode_encoded_datum(buf.tobytes(), i)

    count = 12
    path = write_lmdb(tmp_path / "db", [(key(i), encode(i)) for i in range(count)])
    means = (3,) if gray else (3, 2, 1)
    t = Transform(crop_size=10, mirror=True, mean_value=means, scale=0.5, force_gray=gray)
    mean = np.array(means, np.float32)[:, None, None]
    with Batches(path, count, transform=t, phase="train", seed=4) as b:
        for _ in range(2):  # the second time from the index, the shapes known
            plan = b.next_plan()
            assert plan is not None
            data = np.empty(plan.data_shape, np.float32)
            geometry = Geometry.zeros(count)
            b.fill(plan, data, np.empty(count, np.float32), geometry_out=geometry)
            for row in range(count):
                i = int(plan.indices[row])
                _, buf = cv2.imencode(ext, pixels(i))
                if gray:
                    chw = cv2.imdecode(buf, cv2.IMREAD_GRAYSCALE)[None]
                else:
                    chw = cv2.imdecode(buf, cv2.IMREAD_COLOR).transpose(2, 0, 1)
                p = t.record_params(chw.shape, phase="train", word=int(plan.words[row]))
                assert geometry.row(row) == (p.h_off, p.w_off, p.mirror)
                crop = chw[:, p.h_off : p.h_off + 10, p.w_off : p.w_off + 10]
                if p.mirror:
                    crop = crop[:, :, ::-1]
                want = (crop.astype(np.float32) - mean) * np.float32(0.5)
                assert np.array_equal(data[row], want), row


def _index_over(tmp_path: Path, values: list[bytes]) -> Any:
    import blobpipe._io._index as index_module

    items = [(key(i), v) for i, v in enumerate(values)]
    db = write_lmdb(tmp_path / "db", items)
    file = np.fromfile(Path(db) / "data.mdb", np.uint8)
    extents = value_extents(file, [k for k, _ in items])
    assert extents is not None
    return index_module.RecordIndex(file, extents.offsets, extents.lengths)


def _odd_values(odd: dict[int, str]) -> list[bytes]:
    """200 raw 3x10x12 records, those of ``odd`` another shape, bad, encoded or float."""
    shape = (3, 10, 12)
    values = [blobpipe.encode_raw_datum(image(i, shape), i) for i in range(200)]
    for at, what in odd.items():
        if what == "other shape":
            values[at] = blobpipe.encode_raw_datum(image(at, (3, 10, 11)), at)
        elif what == "bad":
            values[at] = b"\xff\xff not a Datum"
        elif what == "encoded":
            ok, buf = cv2.imencode(".png", np.zeros((10, 12, 3), np.uint8))
            assert ok
            values[at] = blobpipe.encode_encoded_datum(buf.tobytes(), at)
        else:
            values[at] = blobpipe.encode_float_datum(np.zeros(shape, np.float32), at)
    return values


@pytest.mark.parametrize("at", [0, 77, 199])
@pytest.mark.parametrize("odd", [None, "other shape", "bad", "encoded", "float"])
def test_an_index_of_raw_records_of_one_shape_locates_without_gathers(
    tmp_path: Path, odd: str | None, at: int
) -> None:
    """Once every record is classified and all are raw of one shape, ``locate``
    gathers only offsets and labels and says the shape (``raw_shape``), with the same
    rows it gave before; one record of another kind or shape anywhere (the first, one
    in the middle, the last: classified first, among, last) keeps the per-row path."""
    shape = (3, 10, 12)
    index = _index_over(tmp_path, _odd_values({} if odd is None else {at: odd}))
    rows = np.array([5, 150, 5, 199, 0], np.intp)
    before = index.locate(rows)  # classifies these rows only, then locates them
    assert before.raw_shape == (None if odd and at in rows else shape)
    for first in range(0, 200, 50):  # every record, in ranges
        index.locate(np.arange(first, first + 50, dtype=np.intp), shape)
    after = index.locate(rows)
    # these rows are raw of the shape: located so, whatever other records hold
    assert after.raw_shape == (None if odd and at in rows else shape)
    assert index.uniform_shape == (None if odd else shape)
    for got, want in zip(after[:6], before[:6], strict=True):
        np.testing.assert_array_equal(got, want)
    assert after.shape.shape == (len(rows), 3) and after.kind.dtype == np.int8
    empty = index.locate(np.array([], np.intp))
    assert len(empty.offset) == len(empty.kind) == 0 and empty.shape.shape == (0, 3)


def test_batches_over_a_classified_database_fill_the_same_rows(tmp_path: Path) -> None:
    """The epoch after the one that classified every record fills the same bytes."""
    db = raw_db(tmp_path / "db", 96, (3, 8, 9))
    t = Transform(scale=0.5, mean_value=[1, 2, 3])
    with Batches(db, 32, transform=t, mode="epoch") as b:
        first = [np.array(x.data) for x in b]
        assert b._filler._index._raw_shape == (3, 8, 9)
        again = [np.array(x.data) for x in b]
    assert len(first) == len(again) == 3
    for x, y in zip(first, again, strict=True):
        np.testing.assert_array_equal(x, y)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    odd=st.dictionaries(
        st.integers(0, 199), st.sampled_from(["other shape", "bad", "encoded", "float"]), max_size=4
    ),
    batches=st.lists(
        st.lists(st.integers(0, 199), min_size=1, max_size=600), min_size=1, max_size=6
    ),
)
def test_rows_known_raw_of_one_shape_locate_without_gathers(
    tmp_path_factory: pytest.TempPathFactory, odd: dict[int, str], batches: list[list[int]]
) -> None:
    """A batch whose rows are all raw records of the common shape (a raw record's of the
    first classification pass), known or classified by this call, is located as when
    every record is (a shard's reader: the other records are never classified):
    ``raw_shape`` said, kind, length and shape broadcast; a row of another kind or shape
    keeps the per-row path.
    Either way each row's fields are the ones classification found (batches of up to
    600 rows: the gather in C beyond 500)."""
    index = _index_over(tmp_path_factory.mktemp("odd"), _odd_values(odd))
    for picked in batches:
        rows = np.array(picked, np.intp)
        got = index.locate(rows)  # classifies what it has not seen, then locates
        common = index._common
        fast = common is not None and bool(index._of_common[rows].all())
        assert got.raw_shape == (common if fast else None)
        np.testing.assert_array_equal(got.kind, index._kind[rows])
        np.testing.assert_array_equal(got.offset, index._offset[rows])
        np.testing.assert_array_equal(got.length, index._length[rows])
        np.testing.assert_array_equal(got.shape, index._shape[rows])
        np.testing.assert_array_equal(got.label, index._label[rows])
        if got.raw_shape is not None:  # every row a raw record of that shape
            assert (index._kind[rows] == RAW).all()
            assert (index._shape[rows] == got.raw_shape).all()
        # the flags: 1 exactly for the classified raw records of the common shape
        if index._common is None:  # no raw record classified yet: no flags made
            assert not (index._kind == RAW).any() and not len(index._of_common)
            continue
        done = index._kind != 0
        want = done & (index._kind == RAW) & (index._shape == index._common).all(axis=1)
        np.testing.assert_array_equal(index._of_common.astype(bool), want)


@pytest.mark.parametrize("order", ["key", "shuffle"])
def test_a_shard_reader_locates_its_records_without_gathers(tmp_path: Path, order: str) -> None:
    """A rank's Batches reads its shard only (shuffled: other records each epoch): its
    batches are located without per-row gathers, those of its first epoch included,
    though most records were never classified, and fill what the checked path fills."""
    db = raw_db(tmp_path / "db", 96, (3, 8, 9))
    kw: dict[str, Any] = dict(mode="epoch", order=order, shard=(1, 4), seed=2)
    with Batches(db, 8, transform=Transform(scale=0.5), **kw) as b:
        index = b._filler.index()  # made now (else on the first batch)
        assert index is not None
        seen: list[Any] = []
        real = index.locate
        index.locate = lambda rows, hint=None: seen.append(real(rows, hint)) or seen[-1]
        got = [np.array(x.data) for epoch in epochs(b, 3) for x in epoch]
        assert index.uniform_shape is None  # a quarter of the records an epoch
    assert seen and all(loc.raw_shape == (3, 8, 9) for loc in seen)
    with Batches(PlainSource(db), 8, transform=Transform(scale=0.5), **kw) as plain:
        want = [np.array(x.data) for epoch in epochs(plain, 3) for x in epoch]
    assert len(got) == len(want) == 9
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(x, y)


def test_learn_classifies_rows_once_the_common_shape_is_known(tmp_path: Path) -> None:
    """``learn`` classifies a call's rows in one pass with the common shape as the hint;
    before any raw record was classified it does nothing (a pass without a hint parses
    each record alone)."""
    index = _index_over(tmp_path, _odd_values({7: "encoded", 9: "bad"}))
    rows = np.array([30, 7, 5, 9, 120], np.intp)
    index.learn(rows)
    assert (index._kind[rows] == 0).all()  # nothing known yet: nothing learned
    index.locate(np.array([0, 1], np.intp))  # the first pass: the common shape
    assert index._common == (3, 10, 12)
    index.learn(rows)
    assert (index._kind[rows] != 0).all()
    assert index._of_common[rows].tolist() == [1, 0, 1, 0, 1]
    assert index.locate(rows[[0, 2, 4]]).raw_shape == (3, 10, 12)


@pytest.mark.parametrize("shard", [None, (1, 4)])
def test_a_shuffled_epoch_classifies_its_records_in_few_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard: tuple[int, int] | None
) -> None:
    """Records not seen yet (a shuffled epoch, a shard's new records) are classified
    when a batch of them is planned, with those the epoch reads next (as far ahead as
    the index's reach, up to 8,192 records or 8 MiB of values), in one pass: not once
    for each batch's first record and again for its fill."""
    from blobpipe._io._index import RecordIndex

    db = raw_db(tmp_path / "db", 192, (3, 8, 9))
    passes: list[int] = []
    real = RecordIndex._classify

    def counted(self: RecordIndex, rows: Any, hint: Any) -> None:
        passes.append(1)
        real(self, rows, hint)

    monkeypatch.setattr(RecordIndex, "_classify", counted)
    with Batches(db, 8, mode="epoch", order="shuffle", seed=3, shard=shard) as b:
        batches = epochs(b, 1)[0]
    assert len(batches) == (24 if shard is None else 6)
    # the first batch: its first record alone (no shape known yet), then the rest; then
    # a pass a batch planned with new records, each taking twice as many records ahead
    # as the one before (8, 16, 32, ...): 5 passes for 176 records, 2 for 40, not one
    # a batch (24, 6)
    assert len(passes) == (2 + 5 if shard is None else 2 + 2)


def test_learning_ahead_stops_at_the_byte_and_record_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records ahead are classified up to ``_AHEAD`` of them and ``_AHEAD_BYTES`` of their
    values, in the order given (a shuffled epoch's): no further."""
    from blobpipe._io import _index as index_module

    index = _index_over(tmp_path, _odd_values({}))
    index.locate(np.array([0], np.intp))  # the common shape
    index._ahead = index_module._AHEAD  # the reach ahead grown to its bound (_reach)
    length = int(index._value_length[1])
    monkeypatch.setattr(index_module, "_AHEAD_BYTES", 3 * length + 10)  # labels: 1-2 bytes
    ahead = np.array([150, 20, 90, 60, 199, 3], np.int64)
    index.learn(np.array([5], np.intp), ahead)
    assert (index._kind[[5, 150, 20, 90]] != 0).all()
    assert (index._kind[[60, 199, 3]] == 0).all()
    monkeypatch.setattr(index_module, "_AHEAD", 2)
    index.learn(np.array([7], np.intp), np.array([60, 199, 3], np.int64))
    assert (index._kind[[7, 60, 199]] != 0).all() and index._kind[3] == 0


def test_learn_checks_the_file_only_before_a_pass(tmp_path: Path) -> None:
    """``before`` (the file's shrink check, a system call) runs where ``learn`` is about
    to read records, not where everything asked for is known (a bad record included)."""
    index = _index_over(tmp_path, _odd_values({9: "bad"}))
    index.locate(np.array([0, 9], np.intp))  # the common shape; 9 known bad
    calls: list[int] = []

    def check() -> None:
        calls.append(1)

    for rows, want in (([0], 0), ([9], 0), ([0, 9], 0), ([5, 9], 1), ([5], 1), ([9, 5], 1)):
        index.learn(np.array(rows, np.intp), None, before=check)
        assert len(calls) == want, rows
    ahead = np.array([77, 78], np.int64)
    index._ahead = 1  # the reach ahead: 2 records (_reach)
    index.learn(np.array([9], np.intp), ahead, before=check)  # 9 is not common: the pass
    assert len(calls) == 2 and (index._kind[[77, 78]] != 0).all()


def test_a_file_that_shrank_before_learning_fails_the_batch_that_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shrink check failing while a call plans ahead loses nothing: the batch whose
    records it read raises it (from its first record or its fill), as without learning."""
    from blobpipe._io._fill import Filler

    db = raw_db(tmp_path / "db", 64, (3, 8, 9))
    with Batches(db, 8, mode="epoch", order="shuffle", seed=1) as b:
        first = b.next_plans(2)  # the index made, the common shape known
        assert all(p is not None for p in first)
        calls = {"n": 0}
        real = Filler.index

        def shrunk(self: Filler) -> Any:
            calls["n"] += 1
            raise DataError("the data file shrank", path=str(db))

        monkeypatch.setattr(Filler, "index", shrunk)
        with pytest.raises(DataError, match="shrank"):
            b.next_plans(3)
        assert calls["n"] >= 1
        monkeypatch.setattr(Filler, "index", real)
        after = b.next_plans(1)[0]  # the batch after the one that failed, none skipped
        assert after is not None and after.positions[0] == 24
