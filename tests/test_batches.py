"""Batches: Caffe DataLayer batches, order modes, shards, resume, the plan/fill API."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Iterable
from itertools import islice
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blobpipe
from blobpipe._errors import (
    ArgumentError,
    ArgumentTypeError,
    DatabaseNotFoundError,
    DataError,
    ShapeError,
    StateError,
)
from blobpipe._io._batches import ArrayBatch, Batches
from blobpipe._io._kernels import Geometry
from blobpipe._io._plan import BatchPlan, merged
from blobpipe._io._prototxt import read_data_layer
from blobpipe._io._transform import Transform
from blobpipe._proto import caffe_pb2
from tests._helpers import encoded_db, image, raw_db, write_lmdb
from tests.conftest import REF_CASES

CAFFE = Path(__file__).parent / "data" / "caffe"


# -- helpers ---------------------------------------------------------------------------------


def raw_datum(chw: np.ndarray, label: int = 0) -> bytes:
    d = caffe_pb2.Datum(channels=chw.shape[0], height=chw.shape[1], width=chw.shape[2])
    d.data = np.ascontiguousarray(chw, dtype=np.uint8).tobytes()
    d.label = label
    d.encoded = False
    return d.SerializeToString()


def float_datum(chw: np.ndarray, label: int = 0) -> bytes:
    d = caffe_pb2.Datum(channels=chw.shape[0], height=chw.shape[1], width=chw.shape[2])
    d.float_data.extend(chw.astype(np.float32).reshape(-1).tolist())
    d.label = label
    return d.SerializeToString()


def encoded_datum(img_hwc_or_hw: np.ndarray, ext: str, label: int = 0) -> bytes:
    ok, enc = cv2.imencode(ext, img_hwc_or_hw)
    assert ok
    d = caffe_pb2.Datum(data=enc.tobytes(), label=label, encoded=True)
    return d.SerializeToString()


@pytest.fixture
def db10(tmp_path: Path) -> Path:
    """10 raw 3x6x8 records; record i has label i and pixels image(i)."""
    return write_lmdb(
        tmp_path / "db10",
        ((f"{i:08d}_r".encode(), raw_datum(image(i), i)) for i in range(10)),
    )


def labels(batches: Iterable[ArrayBatch]) -> list[list[int]]:
    return [[int(x) for x in b.label] for b in batches]


def take(b: Batches, n: int) -> list[ArrayBatch]:
    return list(islice(iter(b), n))


# -- Caffe reference -------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(REF_CASES))
@pytest.mark.parametrize("via", ["params", "prototxt"])
def test_matches_caffe_datalayer(
    case: str, via: str, monkeypatch: pytest.MonkeyPatch, row_kernel: str
) -> None:
    ref_dir = CAFFE / "ref" / case
    n = len(list(ref_dir.glob("data_b*.npy")))
    if via == "params":
        db, kwargs = REF_CASES[case]
        b = Batches(CAFFE / "lmdb" / db, 8, transform=Transform(**kwargs), phase="test")  # type: ignore[arg-type]
    else:
        monkeypatch.chdir(CAFFE)
        b = Batches(**read_data_layer(f"ref/{case}/net.prototxt", "test").batches_kwargs())
    with b:
        got = take(b, n)
    for k, batch in enumerate(got):
        assert batch.data.dtype == np.float32
        assert np.array_equal(batch.data, np.load(ref_dir / f"data_b{k}.npy")), k
        assert np.array_equal(batch.label, np.load(ref_dir / f"label_b{k}.npy")), k


def test_reference_keys_in_key_order_with_space() -> None:
    with Batches(CAFFE / "lmdb" / "raw_color", 50, phase="test") as b:
        batch = next(iter(b))
    assert batch.keys == sorted(batch.keys)
    assert b"00000037_color/synth 07 with space.png" in batch.keys


# -- record kinds ----------------------------------------------------------------------------


def test_key_gaps(tmp_path: Path) -> None:
    keys = [b"00000000_a", b"00000002_c", b"00000005_f", b"00000009_j"]
    db = write_lmdb(tmp_path / "gaps", ((k, raw_datum(image(i), i)) for i, k in enumerate(keys)))
    with Batches(db, 4) as b:
        batch = next(iter(b))
    assert batch.keys == keys
    assert batch.indices == (0, 1, 2, 3)
    assert np.array_equal(batch.data, np.stack([image(i) for i in range(4)]).astype(np.float32))


def test_float_data_records(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    imgs = [rng.normal(0, 10, (2, 3, 4)).astype(np.float32) for _ in range(3)]
    db = write_lmdb(
        tmp_path / "f", ((f"{i}".encode(), float_datum(x, i)) for i, x in enumerate(imgs))
    )
    t = Transform(scale=0.5, mean_value=(1.5, -2.0))
    with Batches(db, 3, transform=t) as b:
        batch = next(iter(b))
    expected = (np.stack(imgs) - np.array([1.5, -2.0], np.float32)[:, None, None]) * np.float32(0.5)
    assert np.array_equal(batch.data, expected)
    with (
        Batches(db, 3, transform=Transform(dtype="uint8")) as b,
        pytest.raises(
            DataError, match=r"dtype='uint8' output needs uint8 records.*record key b'0'"
        ),
    ):
        next(iter(b))


@pytest.mark.parametrize("ext", [".png", ".jpg"])
def test_encoded_records(tmp_path: Path, ext: str) -> None:
    imgs = [image(i, (10, 12, 3)) for i in range(4)]
    db = write_lmdb(
        tmp_path / "enc", ((f"{i}".encode(), encoded_datum(x, ext, i)) for i, x in enumerate(imgs))
    )
    with Batches(db, 4, phase="test") as b:
        batch = next(iter(b))
    for i, x in enumerate(imgs):
        if ext == ".png":
            expected = x
        else:
            _, enc = cv2.imencode(ext, x)
            expected = cv2.imdecode(enc, cv2.IMREAD_ANYCOLOR)
        assert np.array_equal(batch.data[i], expected.transpose(2, 0, 1).astype(np.float32))
    assert batch.label.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_gray_and_force_color_force_gray(tmp_path: Path) -> None:
    gray = image(1, (1, 5, 7))[0]
    color = image(2, (5, 7, 3))
    db = write_lmdb(
        tmp_path / "g",
        [(b"a_gray", encoded_datum(gray, ".png")), (b"b_color", encoded_datum(color, ".png"))],
    )
    with Batches(db, 1, phase="test") as b:
        first, second = take(b, 2)
    assert first.data.shape == (1, 1, 5, 7)
    assert np.array_equal(first.data[0, 0], gray.astype(np.float32))
    assert second.data.shape == (1, 3, 5, 7)
    with Batches(db, 2, transform=Transform(force_color=True)) as b:
        both = next(iter(b))
    assert both.data.shape == (2, 3, 5, 7)
    assert np.array_equal(both.data[0], np.repeat(gray[None], 3, 0).astype(np.float32))
    with Batches(db, 2, transform=Transform(force_gray=True)) as b:
        both = next(iter(b))
    assert both.data.shape == (2, 1, 5, 7)
    _, png = cv2.imencode(".png", color)
    assert np.array_equal(both.data[1, 0], cv2.imdecode(png, cv2.IMREAD_GRAYSCALE))
    # Without a force flag, gray and color records cannot share a batch.
    with (
        Batches(db, 2) as b,
        pytest.raises(
            DataError,
            match=r"record b'b_color' has shape \(3, 5, 7\).*first record b'a_gray' has shape "
            r"\(1, 5, 7\)",
        ),
    ):
        next(iter(b))


def test_variable_size_records(tmp_path: Path) -> None:
    shapes = [(3, 6, 8), (3, 9, 7), (3, 5, 5), (3, 12, 10)]
    db = write_lmdb(
        tmp_path / "var",
        ((f"{i}".encode(), raw_datum(image(i, s), i)) for i, s in enumerate(shapes)),
    )
    with Batches(db, 1, phase="test") as b:
        got = take(b, 4)
    assert [g.data.shape[1:] for g in got] == shapes
    with Batches(db, 4, transform=Transform(crop_size=5), phase="train") as b:
        batch = next(iter(b))
    assert batch.data.shape == (4, 3, 5, 5)
    with (
        Batches(db, 2) as b,
        pytest.raises(
            DataError,
            match=r"record b'1' has shape \(3, 9, 7\) \(output \(3, 9, 7\)\) but the batch's first "
            r"record b'0' has shape \(3, 6, 8\) \(output \(3, 6, 8\)\).*sizes differ \(6×8 and "
            r"9×7\).*--resize_height/--resize_width.*crop_size.*batch_size=1; record key b'1'; "
            r"database",
        ),
    ):
        next(iter(b))
    with (
        Batches(db, 4, transform=Transform(crop_size=6)) as b,
        pytest.raises(
            DataError,
            match=r"crop_size 6 is larger than the record \(height 5, width 5\); record key",
        ),
    ):
        next(iter(b))


# -- order, wrap, epochs -----------------------------------------------------------------------


def test_wrap_around_mid_batch_like_caffe(db10: Path) -> None:
    with Batches(db10, 4) as b:
        got = take(b, 4)
    assert labels(got) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5]]
    assert [g.plan.epochs.tolist() for g in got[2:]] == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert [g.epoch for g in got] == [0, 0, 0, 1]
    assert all(g.valid == 4 for g in got)
    with pytest.raises(TypeError, match="endless"):
        len(b)


def test_a_plans_rows_are_read_only_arrays(db10: Path) -> None:
    """A plan's indices, epochs and positions are read-only int64 arrays, its words a
    read-only uint64 array (``draw(seed, epoch, index)`` each), its keys a tuple of
    bytes; a batch's indices stay a tuple of ints. ``take`` keeps those types."""
    with Batches(db10, 4, transform=Transform(mirror=True), seed=3) as b:
        b.next_plan()
        b.next_plan()
        plan = b.next_plan()  # the last 2 records of epoch 0, the first 2 of epoch 1
        assert plan is not None
        batch = b.make_batch(plan)
    for name, dtype in [("indices", np.int64), ("epochs", np.int64),
                        ("positions", np.int64), ("words", np.uint64)]:  # fmt: skip
        a = getattr(plan, name)
        assert isinstance(a, np.ndarray) and a.dtype == dtype, name
        assert not a.flags.writeable, name
    assert plan.indices.tolist() == [8, 9, 0, 1]
    assert plan.epochs.tolist() == [0, 0, 1, 1] and plan.epoch == 0
    assert plan.positions.tolist() == [8, 9, 0, 1]
    drawn = [Transform.draw(3, e, i) for e, i in [(0, 8), (0, 9), (1, 0), (1, 1)]]
    assert plan.words.tolist() == drawn
    assert plan.keys == tuple(f"{i:08d}_r".encode() for i in (8, 9, 0, 1))
    assert batch.indices == (8, 9, 0, 1) and all(type(i) is int for i in batch.indices)
    assert plan.first_decoded is None  # raw records: the header tells the shape
    part = plan.take(np.array([1, 3]), np.array([5, 6]))
    assert part.keys == (plan.keys[1], plan.keys[3]) and part.valid == 2
    assert part.indices.tolist() == [5, 6] and part.epochs.tolist() == [0, 1]
    assert part.positions.tolist() == [9, 1] and part.words.tolist() == plan.words[[1, 3]].tolist()
    for a in (part.indices, part.epochs, part.positions, part.words):
        assert not a.flags.writeable


def test_a_plan_keeps_the_first_record_it_decoded(tmp_path: Path) -> None:
    """An encoded first record is decoded to learn the batch's shape: the plan holds its
    pixels and label (``first_decoded``) for filling row 0, and passes them on to a
    part holding row 0 only."""
    db = write_lmdb(tmp_path / "enc", encoded_items(4, ".png"))
    with Batches(db, 4) as b:
        plan = b.next_plan()
        assert plan is not None
        assert plan.first_decoded is not None
        pixels, label = plan.first_decoded
        assert pixels.shape == (3, 10, 12) and label == 0
        assert np.array_equal(pixels, image(0, (10, 12, 3)).transpose(2, 0, 1))
        assert plan.take([0, 2], [0, 2]).first_decoded is plan.first_decoded
        assert plan.take([1, 2], [1, 2]).first_decoded is None
        assert "first_decoded" not in repr(plan)
        batch = b.make_batch(plan)
    assert np.array_equal(batch.data[0], pixels.astype(np.float32))


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        ("keep", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]),
        ("drop", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("pad", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]),
    ],
)
def test_epoch_mode_last_batch(db10: Path, last: str, expected: list[list[int]]) -> None:
    with Batches(db10, 4, mode="epoch", last=last) as b:  # type: ignore[arg-type]
        assert len(b) == len(expected)
        first = list(b)
        second = list(b)
    assert labels(first) == expected
    assert labels(second) == expected
    assert {g.epoch for g in first} == {0}
    assert {g.epoch for g in second} == {1}
    assert first[-1].valid == (4 if last == "drop" else 2)  # pad: 2 real rows + 2 repeats
    if last == "pad":
        assert np.array_equal(first[-1].data[2:], first[0].data[:2])


def test_shuffle_is_a_seeded_permutation_per_epoch(db10: Path) -> None:
    def epochs(seed: int) -> list[list[int]]:
        with Batches(db10, 10, order="shuffle", seed=seed) as b:
            return labels(take(b, 3))

    a = epochs(1)
    assert a == epochs(1)
    assert a != epochs(2)
    assert all(sorted(e) == list(range(10)) for e in a)
    assert a[0] != a[1]


def test_shuffle_buffer(tmp_path: Path) -> None:
    n = 200
    db = write_lmdb(
        tmp_path / "big", ((f"{i:05d}".encode(), raw_datum(image(0), i)) for i in range(n))
    )
    with Batches(db, n, order="buffer", buffer_size=16, seed=3) as b:
        e0, e1 = (np.array(x) for x in labels(take(b, 2)))
    assert sorted(e0.tolist()) == list(range(n))
    assert e0.tolist() != list(range(n))
    assert e0.tolist() != e1.tolist()
    # a record leaves the buffer at most 15 places before it would in key order
    assert (e0 <= np.arange(n) + 15).all()
    with pytest.raises(ValueError, match=r"order='buffer' needs buffer_size >= 1"):
        Batches(db, 4, order="buffer")
    with pytest.raises(ValueError, match=r"buffer_size is only used with order='buffer'"):
        Batches(db, 4, buffer_size=3)


# -- sharding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shard_mode", ["strided", "contiguous"])
@pytest.mark.parametrize("order", ["key", "shuffle", "buffer"])
def test_shards_are_disjoint_and_complete(db10: Path, shard_mode: str, order: str) -> None:
    world = 3
    extra: dict[str, Any] = {"buffer_size": 4} if order == "buffer" else {}
    per_rank = []
    for rank in range(world):
        with Batches(
            db10,
            1,
            order=order,
            shard=(rank, world),
            shard_mode=shard_mode,
            mode="epoch",  # type: ignore[arg-type]
            seed=5,
            pad_shards=False,
            **extra,
        ) as b:
            per_rank.append([lab for batch in labels(b) for lab in batch])
    flat = [x for r in per_rank for x in r]
    assert sorted(flat) == list(range(10))
    assert [len(r) for r in per_rank] == [4, 3, 3]
    if order == "key":
        if shard_mode == "strided":
            assert per_rank[1] == [1, 4, 7]
        else:
            assert per_rank[1] == [4, 5, 6]


def test_shard_auto(db10: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with Batches(db10, 2, shard="auto") as b:
        assert b.shard == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with Batches(db10, 2, shard="auto") as b:
        assert b.shard == (1, 4)
        assert labels(take(b, 2)) == [[1, 5], [9, 1]]
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match=r"both RANK and WORLD_SIZE as integers.*RANK='x'"):
        Batches(db10, 2, shard="auto")
    monkeypatch.delenv("RANK")  # half set: refused, not silently unsharded
    with pytest.raises(ValueError, match=r"RANK=None WORLD_SIZE='4'"):
        Batches(db10, 2, shard="auto")


def test_shard_errors(db10: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"0 <= rank < world_size, got \(3, 3\)"):
        Batches(db10, 2, shard=(3, 3))
    with pytest.raises(TypeError, match="shard must be None, 'auto' or"):
        Batches(db10, 2, shard=[0, 1])  # type: ignore[arg-type]
    small = write_lmdb(tmp_path / "small", [(b"k", raw_datum(image(0)))])
    for pad in (False, "drop"):
        with pytest.raises(
            DataError, match=r"shard rank 1 of 2 holds no records \(the database has 1\)"
        ):
            Batches(small, 1, shard=(1, 2), pad_shards=pad)  # type: ignore[arg-type]
    with Batches(small, 1, shard=(1, 2), mode="epoch") as b:  # padded: the record again
        assert [x.keys for x in b] == [[b"k"]]
    with pytest.raises(ValueError, match="pad_shards must be True, False or 'drop'"):
        Batches(small, 1, pad_shards="pad")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shard", "which"),
    [
        ((0.5, 2), "rank"),  # was truncated to rank 0
        ((1, 2.5), "world_size"),  # was world 2
        ((True, 2), "rank"),
        ((0, "2"), "world_size"),
        ((np.float64(1), 2), "rank"),
        ((None, 2), "rank"),
    ],
)
def test_a_rank_or_world_size_that_is_no_integer_is_a_type_error(
    db10: Path, shard: Any, which: str
) -> None:
    with pytest.raises(ArgumentTypeError, match=rf"shard's {which} must be an integer, got "):
        Batches(db10, 2, shard=shard)


@pytest.mark.parametrize(
    ("shard", "match"),
    [
        ((0, 0), r"world_size must be between 1 and 2\*\*31 - 1 .*, got 0"),
        ((0, -3), r"world_size must be between 1 and 2\*\*31 - 1 .*, got -3"),
        ((0, 2**31), r"world_size must be between 1 and 2\*\*31 - 1 .*, got 2147483648"),
        ((0, 2**40), r"world_size must be between"),
        ((-1, 2), r"0 <= rank < world_size, got \(-1, 2\)"),
        ((2, 2), r"0 <= rank < world_size, got \(2, 2\)"),
    ],
)
@pytest.mark.parametrize("shard_mode", ["strided", "node"])
def test_a_rank_or_world_size_out_of_bounds_is_refused_before_anything_is_sized_by_it(
    db10: Path, shard: Any, match: str, shard_mode: str
) -> None:
    """``shard=(0, 2**40)`` in node mode with one rank per node sized a list by the
    2**40 nodes (a bare MemoryError): refused as an argument first."""
    with pytest.raises(ArgumentError, match=match):
        Batches(db10, 2, shard=shard, shard_mode=shard_mode, ranks_per_node=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("shard_mode", ["strided", "contiguous", "node"])
def test_the_largest_world_costs_what_its_records_cost(db10: Path, shard_mode: str) -> None:
    """Nothing is sized by the world or the node count: the last rank of a world of
    2**31 - 1 (as many nodes in node mode) reads its one padded record at once."""
    world = 2**31 - 1
    with Batches(
        db10, 2, shard=(np.int64(world - 1), world), shard_mode=shard_mode, ranks_per_node=1,
        mode="epoch",
    ) as b:  # fmt: skip
        assert b.shard == (world - 1, world) and type(b.shard[0]) is int
        assert b.records_per_epoch == 1
        assert len([x for x in b]) == 1


@pytest.mark.parametrize(
    ("per_node", "error", "match"),
    [
        (2.0, ArgumentTypeError, r"ranks_per_node must be an integer, got 2\.0"),
        (True, ArgumentTypeError, r"ranks_per_node must be an integer, got True"),
        ("2", ArgumentTypeError, r"ranks_per_node must be an integer, got '2'"),
        (0, ArgumentError, r"ranks_per_node must divide the world size 4 .*got 0"),
        (3, ArgumentError, r"ranks_per_node must divide the world size 4 .*got 3"),
        (8, ArgumentError, r"ranks_per_node must divide the world size 4 .*got 8"),
    ],
)
def test_ranks_per_node_is_checked_as_an_integer(
    db10: Path, per_node: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Batches(db10, 2, shard=(0, 4), shard_mode="node", ranks_per_node=per_node)


def test_local_world_size_must_be_an_integer(db10: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2.0")
    with pytest.raises(ArgumentError, match=r"LOCAL_WORLD_SIZE must be an integer, got '2\.0'"):
        Batches(db10, 2, shard=(0, 4), shard_mode="node")


# -- randomness ---------------------------------------------------------------------------------


def test_train_randomness_reproducible_and_varies_across_epochs(db10: Path) -> None:
    t = Transform(crop_size=4, mirror=True)

    def run(seed: int) -> list[np.ndarray]:
        with Batches(db10, 10, transform=t, phase="train", seed=seed) as b:
            return [g.data for g in take(b, 2)]

    a, a2, c = run(0), run(0), run(1)
    assert all(np.array_equal(x, y) for x, y in zip(a, a2, strict=True))
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[0], a[1])  # same records, another epoch
    # a record's randomness does not depend on the order or the shard
    with Batches(db10, 1, transform=t, order="shuffle", shard=(1, 2), seed=0) as b:
        g = next(iter(b))
    assert np.array_equal(g.data[0], a[0][g.indices[0]])


def test_test_phase_is_deterministic_centre_crop(db10: Path) -> None:
    with Batches(db10, 2, transform=Transform(crop_size=4), phase="test") as b:
        g = next(iter(b))
    assert np.array_equal(g.data[0], image(0)[:, 1:5, 2:6].astype(np.float32))


# -- resume ------------------------------------------------------------------------------------


RESUME_CONFIGS: list[dict[str, Any]] = [
    {},
    {"order": "shuffle", "seed": 4},
    {"order": "buffer", "buffer_size": 3, "seed": 2, "shard": (1, 2)},
    {
        "order": "shuffle",
        "transform": Transform(crop_size=3, mirror=True),
        "shard": (0, 3),
        "shard_mode": "contiguous",
    },
    {"mode": "epoch", "last": "pad", "order": "shuffle"},
]


@pytest.mark.parametrize("config", RESUME_CONFIGS)
@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_resume_equals_uninterrupted(db10: Path, config: dict[str, Any], cut: int) -> None:
    def stream(b: Batches, n: int) -> list[ArrayBatch]:
        out: list[ArrayBatch] = []
        while len(out) < n:
            out.extend(islice(iter(b), n - len(out)))
        return out

    with Batches(db10, 3, **config) as b:
        full = stream(b, 8)
    with Batches(db10, 3, **config) as b:
        stream(b, cut)
        state = b.state_dict()
    assert state == full[cut - 1].state
    with Batches(db10, 3, state=state, **config) as b:
        rest = stream(b, 8 - cut)
    for x, y in zip(full[cut:], rest, strict=True):
        assert x.keys == y.keys
        assert np.array_equal(x.data, y.data)
        assert np.array_equal(x.label, y.label)
        assert np.array_equal(x.plan.epochs, y.plan.epochs)
    # load_state_dict on a running instance
    with Batches(db10, 3, **config) as b:
        b.load_state_dict(full[cut - 1].state)
        assert [g.keys for g in stream(b, 2)] == [g.keys for g in full[cut : cut + 2]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9)), min_size=1, max_size=12))
def test_state_sources_are_each_places_state(places: list[tuple[int, int]]) -> None:
    """``state_sources``: one source per ``(epoch, pos)``, in order, each making the
    state of its place's record in that epoch's order, for places in any order and
    runs of epochs (one and many)."""
    from blobpipe._io._resume import make_state, state_sources

    keys = [f"k{i}".encode() for i in range(10)]
    orders = {e: np.random.default_rng(e).permutation(10) for e in range(4)}
    settings, shard = {"seed": 1}, (0, 1)
    got = state_sources(keys, settings, shard, orders.__getitem__, places)
    assert [source() for source in got] == [
        make_state(e, p, keys[int(orders[e][p])], settings, shard) for e, p in places
    ]


def test_resume_errors(db10: Path, tmp_path: Path) -> None:
    with Batches(db10, 3, order="shuffle", seed=1) as b:
        take(b, 2)
        state = b.state_dict()
    assert state["epoch"] == 0
    assert state["position"] == 6
    with pytest.raises(ValueError, match="saved with seed=1, but seed=2 was given"):
        Batches(db10, 3, order="shuffle", seed=2, state=state)
    with pytest.raises(ValueError, match="saved with order='shuffle'"):
        Batches(db10, 3, seed=1, state=state)
    with pytest.raises(ValueError, match=r"saved for shard \(0, 1\) but this one is shard"):
        Batches(db10, 3, order="shuffle", seed=1, shard=(0, 2), state=state)
    with pytest.raises(ValueError, match="malformed resume state"):
        Batches(db10, 3, state={"epoch": 0})
    # the same number of records, one key renamed
    changed = write_lmdb(
        tmp_path / "changed",
        ((f"{i:08d}_{'r' if i != 3 else 'z'}".encode(), raw_datum(image(i), i)) for i in range(10)),
    )
    with Batches(db10, 3, order="key") as b:
        take(b, 1)
        key_state = b.state_dict()
    with pytest.raises(
        DataError,
        match=r"dataset changed: position 3 of epoch 0 holds key b'00000003_z', the state "
        r"expected b'00000003_r'",
    ):
        Batches(changed, 3, state=key_state)
    fewer = write_lmdb(
        tmp_path / "fewer", ((f"{i}".encode(), raw_datum(image(i))) for i in range(4))
    )
    with pytest.raises(DataError, match="saved with 10 records, the database now has 4"):
        Batches(fewer, 3, state=key_state)


# The fields of a state that say where it stands; every other field says how the
# order is made, and must match.
CURSOR = ("epoch", "position", "key")


def _changed(value: Any) -> list[Any]:
    """Values a state field could be changed to, each unlike ``value`` (in value or in
    type: state_dict() never writes a float, a bool for an int, a str for a list; a
    tuple for the shard's list is the same shard)."""
    if isinstance(value, bool):
        out: list[Any] = [not value, int(value), "drop", None]
    elif isinstance(value, int):
        out = [value + 1, value - 1, float(value), str(value), None, [value]]
    elif isinstance(value, str):
        out = [value + "x", "key", "shuffle", "strided", "node", "contiguous", None, 0]
    elif isinstance(value, list):
        out = [[value[0], value[1] + 1], [value[0] + 1, value[1]], value[:1], None]
        out += [[float(value[0]), value[1]], [value[0], str(value[1])]]
    else:
        out = [0, 1, "x", [1]]
    return [v for v in out if not (type(v) is type(value) and v == value)]


STATE_OPTIONS = [
    {},
    {"order": "shuffle", "seed": 5, "shard": (1, 3), "shard_mode": "contiguous",
     "pad_shards": "drop"},
    {"order": "buffer", "buffer_size": 4, "shard": (1, 4), "shard_mode": "node",
     "ranks_per_node": 2},
    {"order": "quasi", "buffer_size": 8, "shard": (0, 2), "shard_mode": "node",
     "ranks_per_node": 1, "pad_shards": False},
]  # fmt: skip


@pytest.mark.parametrize("options", STATE_OPTIONS)
def test_every_field_a_state_writes_is_compared_when_it_is_loaded(
    db10: Path, options: dict[str, Any]
) -> None:
    """The fields are taken from state_dict() itself, so a field added to it later is
    covered here too: each one changed (or dropped) is refused, except pad_shards of
    an unsharded state, which changes nothing (shown: the same batches follow)."""
    with Batches(db10, 1, mode="epoch", **options) as b:
        it = iter(b)
        next(it)
        state = b.state_dict()
        after = [x.keys for x in islice(it, 3)]
        unsharded = state["shard"][1] == 1
        for name in sorted(set(state) - set(CURSOR)):
            dropped = {k: v for k, v in state.items() if k != name}
            for changed in [*({**state, name: v} for v in _changed(state[name])), dropped]:
                # unsharded, padding changes nothing; absent, it is False (older states)
                legacy = changed is dropped and state["pad_shards"] is False
                if name == "pad_shards" and (unsharded or legacy):
                    b.load_state_dict(changed)
                    assert [x.keys for x in islice(iter(b), 3)] == after
                    continue
                with pytest.raises((ArgumentError, ArgumentTypeError, DataError)) as info:
                    b.load_state_dict(changed)
                assert name in str(info.value) or "version" in str(info.value), (name, changed)
        b.load_state_dict(state)  # the state itself still resumes
        assert [x.keys for x in islice(iter(b), 3)] == after


def test_a_state_of_another_ranks_per_node_is_refused_where_the_key_agrees(
    tmp_path: Path,
) -> None:
    """Saved with ranks_per_node=2 at a position whose record the order of
    ranks_per_node=1 holds too: the key check passed and the epoch went on in the
    other order (records skipped and repeated, silently)."""
    db = raw_db(tmp_path / "db", 200, shape=(1, 2, 2))
    common: dict[str, Any] = {"shard": (0, 4), "shard_mode": "node", "order": "shuffle"}
    for seed in range(50):
        with (
            Batches(db, 1, ranks_per_node=2, seed=seed, mode="epoch", **common) as two,
            Batches(db, 1, ranks_per_node=1, seed=seed, mode="epoch", **common) as one,
        ):
            a, b = two.epoch_order(0), one.epoch_order(0)
            agree = [p for p in range(1, min(len(a), len(b))) if a[p] == b[p]]
            if not agree:
                continue
            it = iter(two)
            for _ in range(agree[0]):
                next(it)
            state = two.state_dict()
            assert state["position"] == agree[0] and state["ranks_per_node"] == 2
            with pytest.raises(
                ArgumentError, match=r"saved with ranks_per_node=2, but ranks_per_node=1"
            ):
                one.load_state_dict(state)
            return
    pytest.fail("no seed gave a position where the two orders agree")


@pytest.mark.parametrize(
    ("field", "value"), [("epoch", 1.5), ("position", 2.7), ("epoch", "1"), ("position", True)]
)
def test_a_state_whose_cursor_is_no_integer_is_refused(db10: Path, field: str, value: Any) -> None:
    """A float position was truncated to the position before it (where its key may agree)."""
    with Batches(db10, 1, order="key") as b:
        state = {**b.state_dict(), field: value}
        with pytest.raises(ArgumentError, match=rf"malformed resume state.*{field}"):
            b.load_state_dict(state)


# -- errors ------------------------------------------------------------------------------------


def test_bad_record_fails_its_batch_only(tmp_path: Path) -> None:
    items = [(f"{i:02d}".encode(), raw_datum(image(i), i)) for i in range(8)]
    items[5] = (b"05", b"\x08\x03\x10garbage")
    db = write_lmdb(tmp_path / "bad", items)
    got = []
    with Batches(db, 2) as b:
        it = iter(b)
        got.append(next(it))
        got.append(next(it))
        with pytest.raises(DataError, match=r"record key b'05'; database '.*bad'"):
            next(it)
        # the cursor moved past the bad batch
        assert labels([next(iter(b))]) == [[6, 7]]
    assert labels(got) == [[0, 1], [2, 3]]


def _same_plans(got: Any, want: Any) -> None:
    """Every field of two plans (or both None) is equal; per-row arrays read-only."""
    if want is None or got is None:
        assert want is got
        return
    assert got.keys == want.keys and got.state == want.state
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name in ("key_source", "state_source"):
            continue
        if f.name == "extra":
            assert [n for n, _ in a] == [n for n, _ in b]
            for (_, x), (_, y) in zip(a, b, strict=True):
                _same_plans(x, y)
        elif f.name == "first_decoded":
            assert (a is None) == (b is None)
            if a is not None:
                assert np.array_equal(a[0], b[0]) and a[1] == b[1]
        elif isinstance(b, np.ndarray):
            assert np.array_equal(a, b) and not a.flags.writeable, f.name
        else:
            assert a == b, f.name


def _mixed_db(tmp_path: Path) -> Path:
    """10 raw records; 3, 4 and 8 of another shape: chunks whose batches differ."""
    return write_lmdb(
        tmp_path / "mixed",
        (
            (
                f"{i:08d}".encode(),
                raw_datum(image(i, (3, 4, 5) if i in (3, 4, 8) else (3, 6, 8)), i),
            )
            for i in range(10)
        ),
    )


def _encoded_db(tmp_path: Path) -> Path:
    return encoded_db(tmp_path / "png", 10, ".png", shape=(3, 6, 8))


def _two_sources(tmp_path: Path) -> dict[str, Path]:
    return {
        "data": raw_db(tmp_path / "a", 10, (3, 6, 8)),
        "label": raw_db(tmp_path / "b", 10, (1, 2, 2)),
    }


# how a cursor moves: the ends of epochs, padding, dropped tails, wrapping, shuffling
PLANNING_OPTIONS: list[dict[str, Any]] = [
    {"mode": "epoch", "last": "keep"},
    {"mode": "epoch", "last": "pad"},
    {"mode": "epoch", "last": "drop"},
    {"mode": "wrap"},
    {"mode": "epoch", "order": "shuffle", "seed": 3},
    {"mode": "wrap", "order": "shuffle", "seed": 3, "transform": Transform(mirror=True)},
]


@pytest.mark.parametrize("count", [1, 2, 3, 7])
@pytest.mark.parametrize("options", PLANNING_OPTIONS)
@pytest.mark.parametrize("source", ["raw", "mixed shapes", "encoded", "two sources"])
def test_next_plans_are_next_plan_in_steps(
    db10: Path, tmp_path: Path, count: int, options: dict[str, Any], source: str
) -> None:
    """``next_plans(k)`` makes the plans ``k`` calls of ``next_plan`` make, every field,
    stopping after an epoch's end, across epochs, padding and dropped tails; over
    records of one shape, of two shapes (the batches of a call differ), encoded ones
    (each batch decodes its first record) and two sources read in lockstep."""
    src: Any = {
        "raw": lambda: db10,
        "mixed shapes": lambda: _mixed_db(tmp_path),
        "encoded": lambda: _encoded_db(tmp_path),
        "two sources": lambda: _two_sources(tmp_path),
    }[source]()
    if source == "two sources" and "transform" in options:
        options = {**options, "transform": {"data": options["transform"]}}
    with Batches(src, 3, phase="train", **options) as one, Batches(
        src, 3, phase="train", **options
    ) as many:  # fmt: skip
        want = [one.next_plan() for _ in range(12)]
        got: list[Any] = []
        while len(got) < 12:
            step = many.next_plans(count)
            assert 1 <= len(step) <= count
            assert all(p is not None for p in step[:-1])  # None only last
            got += step
        for w, g in zip(want, got, strict=False):
            _same_plans(g, w)
        assert many.state_dict() == one.state_dict() or len(got) > 12


def test_next_plans_needs_a_positive_count(db10: Path) -> None:
    with Batches(db10, 3) as b:
        for count in (0, -1, 1.5, True, "2"):
            with pytest.raises(ArgumentError, match="count must be a positive integer"):
                b.next_plans(count)  # type: ignore[arg-type]
        assert len(b.next_plans(2)) == 2


@pytest.mark.parametrize("bad_batch", [0, 1, 3])
def test_next_plans_stop_before_a_batch_that_fails(tmp_path: Path, bad_batch: int) -> None:
    """A batch whose first record fails: the plans before it are returned, the cursor
    is past it, and the next call raises its error (then planning goes on)."""
    items = [(f"{i:02d}".encode(), raw_datum(image(i), i)) for i in range(12)]
    bad = 2 * bad_batch
    items[bad] = (f"{bad:02d}".encode(), b"\x08\x03\x10garbage")
    db = write_lmdb(tmp_path / "bad", items)
    with Batches(db, 2, mode="epoch") as b:
        if bad_batch:
            before = b.next_plans(5)
            assert [p.positions[0] for p in before if p is not None] == [
                2 * i for i in range(bad_batch)
            ]
        with pytest.raises(DataError, match=f"record key b'{bad:02d}'"):
            b.next_plans(5)
        after = b.next_plans(1)[0]
        assert after is not None and after.positions[0] == bad + 2


def test_constructor_errors(db10: Path, tmp_path: Path) -> None:
    with pytest.raises(DatabaseNotFoundError):
        Batches(tmp_path / "missing", 2)
    empty = write_lmdb(tmp_path / "empty", [])
    with pytest.raises(DataError, match="the database holds no records"):
        Batches(empty, 2)
    for kwargs, msg in [
        ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
        ({"order": "random"}, "order must be 'key', 'shuffle', 'buffer' or 'quasi', got 'random'"),
        ({"mode": "loop"}, "mode must be 'wrap' or 'epoch'"),
        ({"last": "x"}, "last must be 'keep', 'drop' or 'pad'"),
        ({"shard_mode": "x"}, "shard_mode must be 'strided', 'contiguous' or 'node'"),
        ({"phase": "val"}, "phase must be 'train' or 'test'"),
        ({"seed": -1}, "seed must be a non-negative integer"),
    ]:
        args: dict[str, Any] = {"batch_size": 2, **kwargs}
        with pytest.raises(ValueError, match=msg):
            Batches(db10, **args)


def test_closed(db10: Path) -> None:
    b = Batches(db10, 2)
    b.close()
    b.close()
    with pytest.raises(StateError, match="closed"):
        b.next_plan()


def test_mean_file_shape_mismatch_names_key(db10: Path) -> None:
    t = Transform(mean_file=CAFFE / "raw_color_mean.binaryproto")
    with (
        Batches(db10, 2, transform=t) as b,
        pytest.raises(
            DataError,
            match=r"has shape \(3, 32, 40\) but the record has shape \(3, 6, 8\).*record key",
        ),
    ):
        next(iter(b))


# -- the low-level API ---------------------------------------------------------------------------


def test_plan_and_threaded_fill_equal_make_batch(db10: Path) -> None:
    t = Transform(crop_size=4, mirror=True, mean_value=(10, 20, 30), scale=0.5, layout="NHWC")
    with Batches(db10, 7, transform=t, order="shuffle", seed=9) as ref:
        expected = take(ref, 3)
    with Batches(db10, 7, transform=t, order="shuffle", seed=9) as b:
        for exp in expected:
            plan = b.next_plan()
            assert plan is not None
            assert plan.data_shape == (7, 4, 4, 3)
            assert plan.dtype == np.float32
            assert plan.keys == tuple(exp.keys)
            data = np.full(plan.data_shape, np.nan, plan.dtype)
            label = np.full(len(plan), np.nan, np.float32)
            geometry = Geometry.zeros(len(plan))
            ranges = [(0, 2), (2, 3), (3, 7)]
            threads = [
                threading.Thread(
                    target=b.fill,
                    args=(plan, data, label, i, j),
                    kwargs={"geometry_out": geometry},
                )
                for i, j in ranges
            ]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert np.array_equal(data, exp.data)
            assert np.array_equal(label, exp.label)
            for row in range(len(plan)):
                p = t.record_params(plan.record_shape, phase="train", word=int(plan.words[row]))
                assert geometry.row(row) == (p.h_off, p.w_off, p.mirror)


def test_uint8_output_plus_params_reproduce_float_output(db10: Path) -> None:
    """What a device kernel does after a dtype='uint8' batch must equal the CPU float path."""
    kw: dict[str, Any] = {"crop_size": 4, "mirror": True, "scale": 0.25}
    mean = np.random.default_rng(0).uniform(0, 255, (3, 6, 8)).astype(np.float32)
    proto = caffe_pb2.BlobProto(num=1, channels=3, height=6, width=8)
    proto.data.extend(mean.reshape(-1).tolist())
    mean_path = db10.parent / "m.binaryproto"
    mean_path.write_bytes(proto.SerializeToString())
    f32 = Transform(mean_file=mean_path, **kw)
    u8 = Transform(mean_file=mean_path, dtype="uint8", **kw)
    with Batches(db10, 5, transform=f32, seed=1) as a:
        expected = next(iter(a)).data
    with Batches(db10, 5, transform=u8, seed=1) as b:
        plan = b.next_plan()
        assert plan is not None
        raw = np.empty(plan.data_shape, np.uint8)
        geometry = Geometry.zeros(5)
        b.fill(plan, raw, np.empty(5, np.float32), geometry_out=geometry)
    m = u8.mean_array(plan.record_shape)
    assert m is not None
    for row in range(5):
        h, w, flip = geometry.row(row)
        mrow = m[:, h : h + 4, w : w + 4]
        if flip:
            mrow = mrow[:, :, ::-1]
        dev = (raw[row].astype(np.float32) - mrow) * u8.scale
        assert np.array_equal(dev, expected[row])


def test_fill_checks_outputs(db10: Path) -> None:
    with Batches(db10, 2) as b:
        plan = b.next_plan()
        assert plan is not None
        with pytest.raises(ShapeError, match=r"data_out has shape \(2, 3, 6, 7\) dtype float32"):
            b.fill(plan, np.empty((2, 3, 6, 7), np.float32), np.empty(2, np.float32))
        with pytest.raises(ShapeError, match=r"label_out has shape \(3,\)"):
            b.fill(plan, np.empty(plan.data_shape, np.float32), np.empty(3, np.float32))
        with pytest.raises(ValueError, match=r"rows \[1:5\] are outside the plan's 2 rows"):
            b.fill(plan, np.empty(plan.data_shape, np.float32), np.empty(2, np.float32), 1, 5)
        data, label = np.empty(plan.data_shape, np.float32), np.empty(2, np.float32)
        with pytest.raises(TypeError, match=r"geometry_out must be a Geometry .* got ndarray"):
            b.fill(plan, data, label, geometry_out=np.zeros((2, 3), np.int32))  # type: ignore[arg-type]
        ok = Geometry.zeros(2)
        for bad, match in [
            (
                Geometry(np.zeros(3, np.intp), ok.w_off, ok.mirror),
                r"geometry_out.h_off has shape \(3,\)",
            ),
            (
                Geometry(ok.h_off, np.zeros(2, np.int32), ok.mirror),
                r"geometry_out.w_off .* dtype int32",
            ),
            (Geometry(ok.h_off, ok.w_off, np.zeros(2, np.uint8)), r"needs shape \(2,\) dtype bool"),
        ]:
            with pytest.raises(ShapeError, match=match):
                b.fill(plan, data, label, geometry_out=bad)
        ok.mirror.setflags(write=False)
        with pytest.raises(ValueError, match=r"geometry_out.mirror is read-only"):
            b.fill(plan, data, label, geometry_out=ok)


def _parts_source(tmp_path: Path, kind: str) -> tuple[Any, dict[str, Any]]:
    """A source and Batches options for each way rows are filled."""
    train = {"phase": "train", "mode": "wrap"}
    crop = Transform(crop_size=6, mirror=True, mean_value=(1, 2, 3), scale=0.5)
    if kind == "raw":
        return raw_db(tmp_path / "raw", 30), {"mode": "wrap"}
    if kind == "raw-shuffled-crop":
        return raw_db(tmp_path / "raw", 30), {**train, "order": "shuffle", "transform": crop}
    if kind == "raw-nhwc-uint8":
        t = Transform(crop_size=6, mirror=True, dtype="uint8", layout="NHWC")
        return raw_db(tmp_path / "raw", 30), {**train, "transform": t}
    if kind in ("jpeg-crop", "png-sizes"):
        ext = ".jpg" if kind == "jpeg-crop" else ".png"

        def record(i: int) -> bytes:
            hw = (10, 12) if kind == "jpeg-crop" else (10 + i % 3, 12 + i % 2)
            return encoded_datum(image(i, (3, *hw)).transpose(1, 2, 0).copy(), ext, i)

        db = write_lmdb(tmp_path / kind, ((f"{i:04d}".encode(), record(i)) for i in range(30)))
        return db, {**train, "order": "shuffle", "transform": crop}
    if kind == "blobproto":
        db = tmp_path / "blobs"
        values = (
            np.full((2, 3, 4), i, np.float32) + np.arange(24).reshape(2, 3, 4) for i in range(30)
        )
        blobpipe.write_lmdb(db, values, record="blobproto")
        return db, {"mode": "wrap"}
    assert kind == "concat"
    dbs = [raw_db(tmp_path / "a", 13), raw_db(tmp_path / "b", 17)]
    return dbs, {**train, "order": "shuffle", "transform": crop}


@pytest.mark.parametrize(
    "kind",
    ["raw", "raw-shuffled-crop", "raw-nhwc-uint8", "jpeg-crop", "png-sizes", "blobproto", "concat"],
)
def test_fill_parts_fills_each_part_as_fill_does(tmp_path: Path, kind: str) -> None:
    """A plan merged from consecutive batches' (or one plan) filled into several parts
    gives each part what filling its own plan (its rows) gives: data, labels, crops
    and flips; across an epoch's end, for every kind of record and source."""
    source, options = _parts_source(tmp_path, kind)
    with Batches(source, 4, **options) as one, Batches(source, 4, **options) as many:
        merged_fills = 0
        for _ in range(4):  # 16 batches of 4: past the end of the 30 records
            plans = [many.next_plan() for _ in range(4)]
            want = [one.next_plan() for _ in range(4)]
            assert all(p is not None for p in plans + want)
            expected = []
            for plan in want:
                assert plan is not None
                data = np.empty(plan.data_shape, plan.dtype)
                label = np.empty(len(plan), plan.label_dtype)
                geometry = Geometry.zeros(len(plan))
                one.fill(plan, data, label, geometry_out=geometry)
                expected.append((data, label, geometry))
            whole = merged([p for p in plans if p is not None])
            if whole is None:  # first records of different shapes: each plan in parts
                cases = [(p, [(0, 1), (1, 4)]) for p in plans if p is not None]
            else:
                merged_fills += 1
                cases = [(whole, [(4 * k, 4 * k + 4) for k in range(4)])]
            got = []
            for plan, spans in cases:
                parts = [
                    (
                        np.full((b - a, *plan.data_shape[1:]), 77, plan.dtype),
                        np.full(b - a, -1, plan.label_dtype),
                        Geometry.zeros(b - a),
                    )
                    for a, b in spans
                ]
                many.fill_parts(plan, parts)
                got += parts
            got_rows = [np.concatenate([g[i] for g in got]) for i in range(2)]
            assert np.array_equal(got_rows[0], np.concatenate([e[0] for e in expected]))
            assert np.array_equal(got_rows[1], np.concatenate([e[1] for e in expected]))
            for name in ("h_off", "w_off", "mirror"):
                a = np.concatenate([getattr(g[2], name) for g in got])
                b = np.concatenate([getattr(e[2], name) for e in expected])
                assert np.array_equal(a, b), name
        assert merged_fills > 0 or kind == "png-sizes"


@pytest.mark.parametrize(
    "kind",
    ["raw", "raw-shuffled-crop", "raw-nhwc-uint8", "jpeg-crop", "png-sizes", "blobproto", "concat"],
)
@pytest.mark.parametrize("count", [2, 3, 7])
def test_merged_plans_planned_together_are_the_joined_plan(
    tmp_path: Path, kind: str, count: int
) -> None:
    """Plans made by one ``next_plans`` call merge as views of their one array of each
    per-row field (no join): every consecutive run of them merges into the plan that
    joining their fields makes, across epochs' ends, shuffles, random words and
    sources of several shapes; a run that straddles two calls, or skips a plan, is
    joined."""
    from blobpipe._io import _plan

    source, options = _parts_source(tmp_path, kind)
    spanned = 0
    with Batches(source, 4, **options) as b:
        plans: list[Any] = []
        for _ in range(5):  # 5 calls, past the end of the 30 records
            made = [p for p in b.next_plans(count) if p is not None]
            spanned += sum(_plan._SPANNED in p.__dict__ for p in made)
            plans += made
    runs = [plans[a:z] for a in range(len(plans)) for z in range(a + 1, len(plans) + 1)]
    runs += [plans[a::2][:3] for a in range(len(plans))]  # not consecutive: joined
    for run in runs:
        got = merged(run)
        # the same plans without their span: merged by joining their fields
        bare = [p._replaced() for p in run]
        assert all(_plan._SPANNED not in p.__dict__ for p in bare)
        want = merged(bare)
        if want is None:
            assert got is None
            continue
        assert got is not None
        assert got is run[0] if len(run) == 1 else _plan._SPANNED not in got.__dict__
        _same_plans(got, want)
        assert got.valid == want.valid and got.state == run[-1].state
    if kind in ("raw", "raw-shuffled-crop", "raw-nhwc-uint8", "jpeg-crop"):
        assert spanned > 0  # the fast path was taken


def test_fill_parts_checks_its_parts(tmp_path: Path, db10: Path) -> None:
    with Batches(db10, 4) as b:
        plan = b.next_plan()
        assert plan is not None
        row = plan.data_shape[1:]

        def part(n: int, shape: tuple[int, ...] | None = None, dtype: Any = np.float32) -> Any:
            return (np.empty(shape or (n, *row), dtype), np.empty(n, np.float32), None)

        with pytest.raises(ValueError, match="the parts hold 3 rows; the plan has 4"):
            b.fill_parts(plan, [part(1), part(2)])
        with pytest.raises(ShapeError, match=r"parts\[1\] data has shape \(2, 3, 6, 7\)"):
            b.fill_parts(plan, [part(2), part(2, (2, 3, 6, 7))])
        with pytest.raises(ShapeError, match=r"parts\[1\] data .* dtype float64"):
            b.fill_parts(plan, [part(2), part(2, dtype=np.float64)])
        bad_label = (np.empty((2, *row), np.float32), np.empty(2, np.int64), None)
        with pytest.raises(ShapeError, match=r"parts\[1\] label array has shape \(2,\) dtype i"):
            b.fill_parts(plan, [part(2), bad_label])
        bad_geometry = (np.empty((2, *row), np.float32), np.empty(2, np.float32), Geometry.zeros(3))
        with pytest.raises(ShapeError, match=r"geometry_out.h_off has shape \(3,\)"):
            b.fill_parts(plan, [part(2), bad_geometry])
    images = raw_db(tmp_path / "images", 6, (3, 4, 5))
    labels = tmp_path / "labels"
    blobpipe.write_lmdb(
        labels, (np.zeros((1, 4, 5), np.float32) for _ in range(6)), record="blobproto"
    )
    with Batches({"data": images, "label": labels}, 2) as b:
        plan = b.next_plan()
        assert plan is not None and plan.extra
        with pytest.raises(ValueError, match="other sources read in lockstep is filled with fill"):
            b.fill_parts(plan, [part(2)])


def test_open_reader_source_is_not_closed(db10: Path) -> None:
    from blobpipe._io._lmdb import LmdbReader

    with LmdbReader(db10) as reader:
        with Batches(reader, 5) as b:
            assert labels(take(b, 1)) == [[0, 1, 2, 3, 4]]
        assert len(reader.keys()) == 10
        assert reader.get(b"00000000_r")


class DictSource:
    """A minimal in-memory source: keys() and get(), optionally transaction()."""

    def __init__(self, items: dict[bytes, bytes]) -> None:
        self._items = items
        self.path = "<dict>"
        self.transactions = 0

    def keys(self) -> list[bytes]:
        return sorted(self._items)

    def get(self, key: bytes) -> bytes:
        return self._items[key]


class TxnDictSource(DictSource):
    def transaction(self) -> Any:
        source = self

        class Txn:
            def __enter__(self) -> Txn:
                source.transactions += 1
                return self

            def __exit__(self, *exc: object) -> None:
                pass

            def get(self, key: bytes) -> memoryview:
                return memoryview(source._items[key])

        return Txn()


@pytest.mark.parametrize("cls", [DictSource, TxnDictSource])
def test_any_record_source(cls: type[DictSource]) -> None:
    src = cls({f"{i}".encode(): raw_datum(image(i), i) for i in range(5)})
    with Batches(src, 5, transform=Transform(scale=0.5)) as b:
        batch = next(iter(b))
    assert np.array_equal(batch.data, np.stack([image(i) for i in range(5)]) * np.float32(0.5))
    assert src.get(b"0")  # not closed: the caller owns it
    if isinstance(src, TxnDictSource):
        assert src.transactions == 1
    bad = cls({b"a": raw_datum(image(0)), b"b": b"\xff"})
    with (
        Batches(bad, 2) as b,
        pytest.raises(DataError, match=r"record key b'b'; database '<dict>'"),
    ):
        next(iter(b))


def test_drop_never_plans_an_empty_epoch(tmp_path: Path) -> None:
    db = raw_db(tmp_path / "db3", 3)
    with pytest.raises(ValueError, match="never fills a batch of 4: every epoch would be empty"):
        Batches(db, 4, mode="epoch", last="drop")


def test_drop_resume_state_points_at_the_next_epoch(tmp_path: Path) -> None:
    db = raw_db(tmp_path / "db10", 10)
    with Batches(db, 4, mode="epoch", last="drop") as it:
        batches = list(it)
        assert len(batches) == 2
        state = batches[-1].state
        assert (state["epoch"], state["position"]) == (1, 0)
    with Batches(db, 4, mode="epoch", last="drop", state=state) as resumed:
        assert [b.indices for b in resumed] == [(0, 1, 2, 3), (4, 5, 6, 7)]


@pytest.mark.parametrize("shard_mode", ["strided", "contiguous"])
def test_padded_shards_have_equal_batch_counts(tmp_path: Path, shard_mode: str) -> None:
    """DDP needs every rank to see the same number of batches (DistributedSampler)."""
    db = raw_db(tmp_path / "db10", 10)
    counts, seen = [], []
    for rank in range(3):
        with Batches(
            db,
            2,
            mode="epoch",
            last="drop",
            shard=(rank, 3),
            shard_mode=shard_mode,  # type: ignore[arg-type]
            pad_shards=True,
            order="shuffle",
            seed=5,
        ) as it:
            batches = list(it)
            counts.append(len(batches))
            assert len(it) == len(batches)
            seen += [i for b in batches for i in b.indices]
    assert counts == [2, 2, 2]  # 4 records per rank; unpadded: 2, 1, 1 batches
    assert sorted(set(seen)) == list(range(10))  # every record, two of them twice
    assert len(seen) == 12
    with Batches(db, 2, mode="epoch", shard=(0, 3), pad_shards=True) as it:
        state = next(iter(it)).state
    with pytest.raises(ValueError, match="pad_shards=True"):
        Batches(db, 2, mode="epoch", shard=(0, 3), pad_shards=False, state=state)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("crop", [0, 24])
@pytest.mark.parametrize("mean", [None, (104.0, 117.0, 123.0)])
def test_block_path_equals_caffe_arithmetic(
    layout: str, crop: int, mean: tuple[float, ...] | None, row_kernel: str
) -> None:
    """The whole-batch paths against Caffe's formula computed record by record."""
    from blobpipe import decode_datum
    from blobpipe._io._lmdb import LmdbReader

    scale = np.float32(0.017)
    t = Transform(
        scale=float(scale),
        crop_size=crop,
        mean_value=mean or (),
        layout=layout,  # type: ignore[arg-type]
    )
    with (
        LmdbReader(CAFFE / "lmdb" / "raw_color") as reader,
        Batches(reader, 16, transform=t, phase="test", mode="epoch") as it,
    ):
        batch = next(iter(it))
        for row, key in enumerate(batch.keys):
            x, _ = decode_datum(reader.get(key))
            c, h, w = x.shape
            if crop:
                h0, w0 = (h - crop) // 2, (w - crop) // 2
                x = x[:, h0 : h0 + crop, w0 : w0 + crop]
            ref = x.astype(np.float32)
            if mean is not None:
                ref = ref - np.asarray(mean, np.float32).reshape(c, 1, 1)
            ref = ref * scale
            if layout == "NHWC":
                ref = ref.transpose(1, 2, 0)
            assert np.array_equal(batch.data[row], ref), (row, key)


def test_fill_into_a_strided_uint8_output(tmp_path: Path) -> None:
    """fill() accepts any writable view of the right shape, not only contiguous ones."""
    db = raw_db(tmp_path / "db4", 4)
    with Batches(db, 4, transform=Transform(dtype="uint8"), mode="epoch") as it:
        plan = it.next_plan()
        assert plan is not None
        big = np.zeros((8, *plan.data_shape[1:]), np.uint8)
        data = big[::2]  # every other row: not C-contiguous
        label = np.zeros(4, np.float32)
        it.fill(plan, data, label)
    want = [image(i, (3, 10, 12)) for i in range(4)]
    assert all(np.array_equal(data[i], want[i]) for i in range(4))
    assert label.tolist() == [0, 1, 2, 3]


def test_fill_mixed_layouts_into_a_strided_uint8_output(tmp_path: Path) -> None:
    """The per-record path must write into the caller's view, never into a copy of it."""
    from blobpipe import encode_raw_datum

    def record(i: int) -> bytes:
        pixels = image(i, (3, 10, 12))
        if i % 2:  # no label field at all: not convert_imageset's layout
            datum = caffe_pb2.Datum(channels=3, height=10, width=12, data=pixels.tobytes())
            return datum.SerializeToString()
        return encode_raw_datum(pixels, i)

    records = [(b"%08d" % i, record(i)) for i in range(4)]
    db = write_lmdb(tmp_path / "mixed", records)
    with Batches(db, 4, transform=Transform(dtype="uint8"), mode="epoch") as it:
        plan = it.next_plan()
        assert plan is not None
        n, c, h, w = plan.data_shape
        big = np.zeros((n, c, 2 * h, w), np.uint8)
        data = big[:, :, ::2, :]  # every other image row: a row cannot be viewed flat
        label = np.zeros(4, np.float32)
        it.fill(plan, data, label)
    assert all(np.array_equal(data[i], image(i, (3, 10, 12))) for i in range(4))
    assert label.tolist() == [0, 0, 2, 0]  # an absent label is 0, as in protobuf


@pytest.mark.parametrize(
    "transform",
    [
        Transform(),
        Transform(scale=0.5),
        Transform(mean_value=(10, 20, 30), scale=0.25),
        Transform(crop_size=4),
        Transform(layout="NHWC"),
        Transform(dtype="uint8"),
    ],
    ids=["plain", "scale", "mean_scale", "crop", "nhwc", "uint8"],
)
@pytest.mark.parametrize("lead", [0, 1])
def test_raw_and_encoded_records_in_one_batch(
    tmp_path: Path, transform: Transform, lead: int
) -> None:
    """A batch may mix encoded and raw records of one shape, led by either: each row
    equals the record transformed on its own (batch_size=1)."""
    items = []
    for i in range(8):
        if i % 3 == lead:
            items.append(
                (f"{i:08d}".encode(), encoded_datum(image(i).transpose(1, 2, 0), ".png", i))
            )
        else:
            items.append((f"{i:08d}".encode(), raw_datum(image(i), i)))
    db = write_lmdb(tmp_path / "mixed", items)
    with Batches(db, 1, transform=transform, phase="test", mode="epoch") as b:
        one = [x for e in range(2) for x in islice(iter(b), 8)]
    with Batches(db, 4, transform=transform, phase="test", mode="epoch") as b:
        four = [x for e in range(2) for x in islice(iter(b), 2)]  # two epochs
    rows = np.concatenate([x.data for x in four])
    assert np.array_equal(rows, np.concatenate([x.data for x in one]))
    assert np.array_equal(
        np.concatenate([x.label for x in four]), np.concatenate([x.label for x in one])
    )


@pytest.mark.parametrize("phase", ["test", "train"])
def test_encoded_first_reads_equal_caffe_record_by_record(tmp_path: Path, phase: Any) -> None:
    """A batch led by an encoded record, first read (every row checked, decoded in one
    run, transformed as a block): each row equals Caffe's per-record arithmetic on
    OpenCV's pixels; a raw row and a PNG among JPEGs take the per-row path."""
    import blobpipe

    items = []
    for i in range(12):
        pix = image(i, (10, 12, 3))
        if i == 4:
            value = raw_datum(pix.transpose(2, 0, 1), i)
        else:
            value = encoded_datum(pix, ".png" if i == 7 else ".jpg", i)
        items.append((f"{i:02d}".encode(), value))
    db = write_lmdb(tmp_path / "mixed", items)
    t = Transform(mean_value=(5, 10, 15), scale=0.25, mirror=True)
    with Batches(db, 6, transform=t, phase=phase, seed=3, mode="epoch") as b:
        got = list(islice(iter(b), 2))
    values = dict(items)
    for batch in got:
        for row, key in enumerate(batch.keys):
            chw, label = blobpipe.decode_datum(values[key])
            want = t(chw, phase=phase, seed=3, epoch=0, index=int(key))
            assert np.array_equal(batch.data[row], want), key
            assert batch.label[row] == label


def encoded_items(n: int, ext: str = ".jpg") -> list[tuple[bytes, bytes]]:
    """``n`` encoded 10×12 color Datums keyed ``00``, ``01``, ... with label = index."""
    return [(f"{i:02d}".encode(), encoded_datum(image(i, (10, 12, 3)), ext, i)) for i in range(n)]


@pytest.mark.parametrize("bad", ["truncated", "huge"])
def test_a_bad_image_fails_its_encoded_batch_naming_the_key(tmp_path: Path, bad: str) -> None:
    items = encoded_items(8)
    jpeg = cv2.imencode(".jpg", image(5, (10, 12, 3)))[1].tobytes()
    if bad == "truncated":
        broken = jpeg[:30]
    else:  # the frame header announces 60000×60000 pixels
        at = jpeg.index(b"\xff\xc0")
        broken = jpeg[: at + 5] + (60000).to_bytes(2, "big") * 2 + jpeg[at + 9 :]
    items[5] = (b"05", caffe_pb2.Datum(data=broken, encoded=True, label=5).SerializeToString())
    db = write_lmdb(tmp_path / "bad", items)
    message = "cannot decode" if bad == "truncated" else "announces 60000×60000 pixels"
    with Batches(db, 4, phase="test") as b:
        it = iter(b)
        first = next(it)
        with pytest.raises(DataError, match=rf"{message}.*record key b'05'"):
            next(it)
    assert first.label.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_an_image_opencv_refuses_fails_its_encoded_batch_naming_the_key(tmp_path: Path) -> None:
    """A format blobpipe cannot size (BMP) whose header claims more pixels than OpenCV
    allows: OpenCV refuses it, and the batch fails with a DataError naming the record."""

    def bmp(i: int) -> bytes:
        return cv2.imencode(".bmp", image(i, (10, 12, 3)))[1].tobytes()

    huge = bytearray(bmp(2))
    huge[18:26] = (20000).to_bytes(4, "little") * 2  # BITMAPINFOHEADER width, height
    items = encoded_items(4, ".bmp")
    items[2] = (b"02", caffe_pb2.Datum(data=bytes(huge), encoded=True, label=2).SerializeToString())
    db = write_lmdb(tmp_path / "bmp", items)
    with Batches(db, 4, phase="test") as b, pytest.raises(DataError, match=r"record key b'02'"):
        next(iter(b))


@pytest.mark.parametrize("workers", [1, 3])
def test_encoded_first_reads_with_train_crops_equal_caffe_record_by_record(
    tmp_path: Path, workers: int
) -> None:
    """TRAIN crops on first reads of an encoded batch (rows checked, decoded in one run,
    cropped per image size in one gather each): every row equals Caffe's per-record
    arithmetic; a raw row, a PNG and images of three sizes share the batches."""
    import blobpipe

    sizes = [(10, 12), (12, 14), (9, 9)]
    items = []
    for i in range(15):
        h, w = sizes[i % 3]
        pix = image(i, (h, w, 3))
        if i == 4:
            value = raw_datum(pix.transpose(2, 0, 1), i)
        else:
            value = encoded_datum(pix, ".png" if i == 7 else ".jpg", i)
        items.append((f"{i:02d}".encode(), value))
    db = write_lmdb(tmp_path / "crops", items)
    t = Transform(crop_size=8, mirror=True, mean_value=(5, 10, 15), scale=0.25)
    kwargs: dict[str, Any] = {"transform": t, "phase": "train", "seed": 4, "mode": "epoch"}
    with Batches(db, 5, **kwargs) as b:
        got: list[tuple[tuple[bytes, ...], np.ndarray, np.ndarray]] = []
        if workers == 1:
            got = [(x.keys, x.data, x.label) for x in islice(iter(b), 3)]
        else:  # the rows of each batch split over threads, as a loader may
            while (plan := b.next_plan()) is not None:
                data = np.empty(plan.data_shape, plan.dtype)
                label = np.empty(len(plan), np.float32)
                cuts = [(0, 2), (2, 4), (4, len(plan))]
                threads = [
                    threading.Thread(target=b.fill, args=(plan, data, label, lo, hi))
                    for lo, hi in cuts
                ]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                got.append((plan.keys, data, label))
    values = dict(items)
    assert sum(len(keys) for keys, _, _ in got) == 15
    for keys, data, labels in got:
        for row, key in enumerate(keys):
            chw, label = blobpipe.decode_datum(values[key])
            want = t(chw, phase="train", seed=4, epoch=0, index=int(key))
            assert np.array_equal(data[row], want), key
            assert labels[row] == label


@pytest.mark.parametrize("odd", ["smaller_than_crop", "gray_among_color"])
def test_train_crops_name_the_record_that_does_not_fit(tmp_path: Path, odd: str) -> None:
    items = encoded_items(6)
    if odd == "smaller_than_crop":
        bad = encoded_datum(image(3, (5, 5, 3)), ".jpg", 3)
        message = r"crop_size 8 is larger than the record.*record key b'03'"
    else:
        bad = encoded_datum(image(3, (10, 12, 1))[..., 0], ".png", 3)
        message = r"record b'03' has shape \(1, 10, 12\)"
    items[3] = (b"03", bad)
    db = write_lmdb(tmp_path / "odd", items)
    t = Transform(crop_size=8, mirror=True)
    with Batches(db, 6, transform=t, phase="train") as b, pytest.raises(DataError, match=message):
        next(iter(b))


@pytest.mark.parametrize("pad", ["default", True, "drop"])
@pytest.mark.parametrize("shard_mode", ["strided", "contiguous"])
@pytest.mark.parametrize("last", ["keep", "drop", "pad"])
def test_every_rank_gets_the_same_number_of_batches(
    tmp_path: Path, pad: Any, shard_mode: str, last: str
) -> None:
    """What keeps distributed training from hanging at an all-reduce: with the default
    equal shards (padded, or with the tail dropped), every rank's epoch has the same
    number of batches, for record counts and batch sizes that do not divide evenly,
    in shuffled epochs and after a resume."""
    for n, world, batch in [(103, 2, 17), (103, 4, 5), (10, 3, 3), (7, 3, 2)]:
        db = raw_db(tmp_path / f"db{n}", n, shape=(1, 2, 2))
        options: dict[str, Any] = {
            "mode": "epoch", "last": last, "order": "shuffle", "seed": 3,
            "shard_mode": shard_mode,
            **({} if pad == "default" else {"pad_shards": pad}),
        }  # fmt: skip
        counts, seen = [], []
        for rank in range(world):
            with Batches(db, batch, shard=(rank, world), **options) as b:
                epochs = [list(b), list(b)]
                assert len(epochs[0]) == len(epochs[1]) == len(b)
                counts.append(len(b))
                seen.append([i for x in epochs[0] for i in x.indices[: x.valid]])
                if len(epochs[0]) > 1:  # resumed after the first batch: the same rest
                    with Batches(db, batch, shard=(rank, world), **options) as again:
                        first = next(iter(again))
                    with Batches(db, batch, shard=(rank, world), state=first.state, **options) as r:
                        assert [x.keys for x in r] == [x.keys for x in epochs[0][1:]]
        assert len(set(counts)) == 1, (n, world, batch, counts)
        records = [i for r in seen for i in r]
        if pad != "drop":  # every record, some twice (as DistributedSampler pads)
            assert sorted(set(records)) == list(range(n)) or last == "drop"
        else:  # "drop": disjoint shards of n // world records each
            assert len(records) == len(set(records))
            assert all(len(r) == len(seen[0]) for r in seen) or last == "drop"


def test_shard_auto_reads_an_initialised_torch_process_group(
    db10: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mp.spawn + init_process_group(rank=..., world_size=...) sets no environment
    variables: "auto" reads the process group (torch itself is never imported)."""
    import types

    dist = types.ModuleType("torch.distributed")
    dist.is_available = lambda: True  # type: ignore[attr-defined]
    dist.is_initialized = lambda: True  # type: ignore[attr-defined]
    dist.get_rank = lambda: 2  # type: ignore[attr-defined]
    dist.get_world_size = lambda: 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with Batches(db10, 2, shard="auto") as b:
        assert b.shard == (2, 3)
    dist.is_initialized = lambda: False  # type: ignore[attr-defined]
    with Batches(db10, 2, shard="auto") as b:
        assert b.shard == (0, 1)


def test_labels_as_int64_are_the_records_exact_labels(tmp_path: Path) -> None:
    """label_dtype="int64": class indices as CrossEntropyLoss takes them, exact even where
    float32 (Caffe's output) rounds (2**24 + 1)."""
    big = [0, 7, 2**24 + 1, -3, 2**31 - 1]
    items = [(f"{i:08d}".encode(), raw_datum(image(i), lab)) for i, lab in enumerate(big)]
    db = write_lmdb(tmp_path / "db", items)
    with Batches(db, 5, mode="epoch", label_dtype="int64") as b:
        batch = next(iter(b))
        assert batch.label.dtype == np.int64 and batch.label.tolist() == big
        plan = b.next_plan() or b.next_plan()
        assert plan is not None and plan.label_dtype == np.int64
        with pytest.raises(ShapeError, match=r"label_out has shape .* the plan needs .* int64"):
            b.fill(plan, np.empty(plan.data_shape, plan.dtype), np.empty(5, np.float32))
    with Batches(db, 5, mode="epoch") as b:  # Caffe's float32, rounded as Caffe rounds
        assert next(iter(b)).label.tolist() == [float(np.float32(x)) for x in big]
    with pytest.raises(ValueError, match="label_dtype must be 'float32' or 'int64'"):
        Batches(db, 5, label_dtype="int32")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "transform",
    [
        Transform(scale=0.5),
        Transform(mean_value=(10, 20, 30), scale=0.25),
        Transform(crop_size=32),
        Transform(crop_size=32, mirror=True, mean_value=(1, 2, 3)),
        Transform(layout="NHWC", mirror=True),
        Transform(dtype="uint8"),
    ],
    ids=["scale", "mean_scale", "crop", "crop_mirror_mean", "nhwc_mirror", "uint8"],
)
@pytest.mark.parametrize("phase", ["test", "train"])
def test_raw_rows_in_runs_of_one_stride_equal_rows_one_at_a_time(
    tmp_path: Path,
    transform: Transform,
    phase: Any,
    monkeypatch: pytest.MonkeyPatch,
    row_kernel: str,
) -> None:
    """Raw records that overflow a page lie one after another in key order, with a
    page of the tree between them now and then: a batch is read as a few runs of
    rows at one stride (NumPy's path; the compiled row kernel takes every raw row
    in one call). Every row equals the record read alone (batch_size=1)."""
    from blobpipe._io import _fill

    runs_seen: list[int] = []
    original = _fill._stride_runs

    def spy(offsets: list[int], most: int) -> Any:
        got = original(offsets, most)
        if got is not None:
            runs_seen.append(len(got))
        return got

    monkeypatch.setattr(_fill, "_stride_runs", spy)
    db = raw_db(tmp_path / "big", 200, (3, 40, 40))
    with Batches(db, 64, transform=transform, phase=phase, mode="epoch", seed=3) as b:
        many = [x for _ in range(2) for x in islice(iter(b), 4)]  # two epochs
    if row_kernel == "numpy":
        assert any(n >= 2 for n in runs_seen), runs_seen  # the runs path was taken
    with Batches(db, 1, transform=transform, phase=phase, mode="epoch", seed=3) as b:
        one = [x for _ in range(2) for x in islice(iter(b), 200)]
    assert np.array_equal(
        np.concatenate([x.data for x in many]), np.concatenate([x.data for x in one])
    )
    assert np.array_equal(
        np.concatenate([x.label for x in many]), np.concatenate([x.label for x in one])
    )


@given(
    offsets=st.lists(st.integers(0, 60), min_size=1, max_size=40).map(
        lambda steps: np.cumsum(steps).tolist()
    ),
    most=st.integers(1, 40),
)
@settings(max_examples=300, deadline=None)
def test_stride_runs_cover_the_rows_in_order_each_at_one_stride(
    offsets: list[int], most: int
) -> None:
    from blobpipe._io._fill import _stride_runs

    runs = _stride_runs(offsets, most)
    if runs is None:  # more than `most` runs
        assert len(_stride_runs(offsets, len(offsets)) or []) > most
        return
    assert len(runs) <= most
    assert [lo for lo, _, _ in runs] == [0] + [hi for _, hi, _ in runs[:-1]]
    assert runs[-1][1] == len(offsets)
    for lo, hi, stride in runs:
        assert [offsets[lo] + k * stride for k in range(hi - lo)] == offsets[lo:hi]
    # greedy: a run ends only where the next row breaks its stride
    for lo, hi, stride in runs[:-1]:
        assert hi - lo == 1 or offsets[hi] - offsets[hi - 1] != stride


@pytest.mark.parametrize("ext", [".jpg", ".png"])
def test_images_decoded_before_skip_the_header_and_give_the_same_pixels(
    tmp_path: Path, ext: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a crop, an image whose shape the index noted (it decoded in this
    snapshot before) is decoded without reading its header again for the size check;
    the pixels are the same in every epoch."""
    from blobpipe._io import _image
    from tests._helpers import encoded_db

    db = encoded_db(tmp_path / "img", 12, ext, (3, 16, 20))
    parsed: list[int] = []
    original = _image.image_size

    def spy(data: Any) -> Any:
        parsed.append(len(data))
        return original(data)

    monkeypatch.setattr(_image, "image_size", spy)
    t = Transform(scale=0.5)
    with Batches(db, 4, transform=t, phase="test", mode="epoch") as b:
        first = [x.data.copy() for x in b]
        in_first = len(parsed)
        second = [x.data.copy() for x in b]
    compiled = _image._compiled("_pngrows" if ext == ".png" else "_jpegwindow")
    if compiled is None:
        assert in_first >= 12  # every image's header read once in the first epoch
    # (where the compiled decoder is built, a batch's images are decoded in one call
    # that reads each header there, in C: none is read here but to plan a batch)
    assert len(parsed) - in_first <= 3  # later: at most each batch's first, to plan it
    assert all(np.array_equal(a, c) for a, c in zip(first, second, strict=True))


@pytest.mark.parametrize("shape", [(3, 6, 8), (3, 96, 100)], ids=["small", "large"])
def test_scattered_raw_rows_equal_rows_one_at_a_time(
    tmp_path: Path, shape: tuple[int, int, int], row_kernel: str
) -> None:
    """Shuffled raw rows (no run of one stride): NumPy's path gathers small rows in one
    call and takes large ones a view each, the compiled kernel takes them all at once;
    every row equals the record read alone (batch_size=1)."""
    db = raw_db(tmp_path / "scattered", 48, shape)
    t = Transform(mean_value=(5, 6, 7), scale=0.5, mirror=True)
    with Batches(db, 16, transform=t, phase="train", order="shuffle", seed=4, mode="epoch") as b:
        many = list(b)
    with Batches(db, 1, transform=t, phase="train", order="shuffle", seed=4, mode="epoch") as b:
        one = list(b)
    assert [k for x in many for k in x.keys] == [k for x in one for k in x.keys]
    assert np.array_equal(
        np.concatenate([x.data for x in many]), np.concatenate([x.data for x in one])
    )


def test_with_rows_is_replace(db10: Path) -> None:
    """``BatchPlan.with_rows`` (no ``__init__``) makes the plan ``dataclasses.replace``
    makes, with neither the other plan's cached keys and state nor its decoded first
    record."""
    with Batches(_encoded_db_at(db10.parent), 3) as b:
        first, second = b.next_plans(2)
    assert first is not None and second is not None and first.first_decoded is not None
    first.keys, first.state  # noqa: B018 - cached in the plan
    made = first.with_rows(
        second.key_source, second.indices, second.epochs, second.positions, second.words,
        second.valid, second.state_source,
    )  # fmt: skip
    want = dataclasses.replace(
        first, key_source=second.key_source, indices=second.indices, epochs=second.epochs,
        positions=second.positions, words=second.words, valid=second.valid,
        state_source=second.state_source, first_decoded=None,
    )  # fmt: skip
    assert "_keys" not in made.__dict__ and "_state" not in made.__dict__
    _same_plans(made, want)
    assert made.keys == second.keys != first.keys and made.state == second.state
    # rows_like: the same plans, many from one copy of the other fields
    make = first.rows_like()
    for _ in range(2):
        again = make(
            second.key_source, second.indices, second.epochs, second.positions, second.words,
            second.valid, second.state_source,
        )  # fmt: skip
        assert set(again.__dict__) == {f.name for f in dataclasses.fields(BatchPlan)}
        _same_plans(again, want)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.valid = 1  # type: ignore[misc]


@pytest.mark.parametrize("n", [0, 1, 500, 501, 1024])
def test_column_is_n_times_its_value_read_only_and_kept_a_while(n: int) -> None:
    """``column(n, value)``: ``n`` times ``value``, read-only, a view of the same array
    again while it is among the last few made (a chunk's epochs), which cannot be made
    writable; a bounded number kept."""
    from blobpipe._io import _plan

    for value in (0, 3, 2**40):
        got = _plan.column(n, value)
        assert got.shape == (n,) and got.dtype == np.int64 and not got.flags.writeable
        assert np.array_equal(got, np.full(n, value, np.int64))
        again = _plan.column(n, value)
        assert again.base is got.base is not None  # kept: views of one array
        with pytest.raises(ValueError, match="WRITEABLE"):
            again.flags.writeable = True  # nobody writes to what others share
    for value in range(3 * _plan._COLUMNS_KEPT):
        assert np.array_equal(_plan.column(n, value), np.full(n, value, np.int64))
        assert len(_plan._COLUMNS) <= _plan._COLUMNS_KEPT


def _encoded_db_at(where: Path) -> Path:
    return encoded_db(where / "png_at", 10, ".png", shape=(3, 6, 8))


@pytest.mark.parametrize(
    ("options", "calls"),
    [
        ({"mode": "epoch", "last": "keep"}, [(0, 0, 9), (0, 9, 10)]),
        ({"mode": "epoch", "last": "pad"}, [(0, 0, 9), (0, 9, 10), (0, 0, 2)]),
        ({"mode": "wrap"}, [(0, 0, 9), (0, 9, 10), (1, 0, 8)]),
    ],
)
def test_next_plans_tells_the_read_ahead_once_a_stretch(
    db10: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], calls: list[Any]
) -> None:
    """A call planning consecutive batches tells the read-ahead once for their positions
    together (not once a batch), and again only where positions jump: a padded tail
    back to the epoch's start, a batch running into the next epoch."""
    from blobpipe._io._readahead import ReadAhead

    seen: list[tuple[int, int, int]] = []
    monkeypatch.setattr(ReadAhead, "planned", lambda self, order, e, a, b: seen.append((e, a, b)))
    with Batches(db10, 3, **options) as b:
        b.next_plans(3)  # rows 0-8
        b.next_plans(3 if options["mode"] == "wrap" else 2)  # the tail (wrap: and 3 more)
    assert seen == calls


@pytest.fixture(scope="module")
def db23(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """23 raw 3x6x8 records (a prime count: no batch size divides it)."""
    return raw_db(tmp_path_factory.mktemp("db23") / "db", 23, (3, 6, 8))


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 7),
    counts=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    options=st.sampled_from(
        [
            *PLANNING_OPTIONS,
            {"mode": "epoch", "last": "drop", "shard": (1, 3)},
            {"mode": "wrap", "shard": (2, 3), "pad_shards": False},
        ]
    ),
    warm=st.booleans(),
)
def test_next_plans_are_next_plan_in_steps_swept(
    db23: Path, batch: int, counts: list[int], options: dict[str, Any], warm: bool
) -> None:
    """Any sequence of ``next_plans`` calls makes the plans ``next_plan`` makes, every
    field and resume state, over batch sizes, epoch ends, padding, dropped tails and
    shards; cold (the index knows no shape) and warm (every record filled once: later
    plans of a call made from the first without reading a record)."""
    with Batches(db23, batch, phase="train", **options) as one, Batches(
        db23, batch, phase="train", **options
    ) as many:  # fmt: skip
        if warm:
            for b in (one, many):
                for _ in range(-(-23 // batch) + 1):  # past an epoch's end
                    plan = b.next_plan()
                    if plan is not None:
                        b.fill(
                            plan,
                            np.empty(plan.data_shape, plan.dtype),
                            np.empty(len(plan), np.float32),
                        )
            if "shard" not in options:  # a shard's reader sees a third of the records
                assert many._sources[0].filler.uniform_shape() == (3, 6, 8)
        got: list[Any] = []
        for count in counts:
            step = many.next_plans(count)
            assert 1 <= len(step) <= count and all(p is not None for p in step[:-1])
            got += step
        want = [one.next_plan() for _ in range(len(got))]
        for w, g in zip(want, got, strict=True):
            _same_plans(g, w)
        assert many.state_dict() == one.state_dict()


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 60),
    pos=st.integers(0, 59),
    batch=st.integers(1, 9),
    count=st.integers(0, 12),
    mode_last=st.sampled_from(
        [("epoch", "keep"), ("epoch", "pad"), ("epoch", "drop"), ("wrap", "keep")]
    ),
)
def test_inner_count_is_what_advance_gives(
    size: int, pos: int, batch: int, count: int, mode_last: tuple[str, str]
) -> None:
    """The batches ``inner_count`` counts are, step by step, what ``advance`` gives from
    the same cursor: one run of a whole batch each, inside the epoch; it counts as many
    as fit before the one that ends the epoch (and at most ``count``)."""
    from blobpipe._io._plan import advance, inner_count

    pos %= size
    mode, last = mode_last
    n = inner_count(pos, batch, size, mode, last, count)
    assert 0 <= n <= count
    p = pos
    for _ in range(n):
        want = advance(3, p, batch, size, mode, last)
        assert want.runs == [(3, p, p + batch)] and want.valid == batch
        assert not want.end and (want.epoch, want.pos) == (3, p + batch)
        p += batch
    if n < count:  # the next batch ends the epoch (or runs into the next one)
        nxt = advance(3, p, batch, size, mode, last)
        assert nxt.end or nxt.epoch != 3
