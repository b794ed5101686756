"""Fuzzing every input a user hands blobpipe: records, images, list files, states, mean files.

The property everywhere: a correct result, or a :class:`~blobpipe.BlobpipeError` that
says what is wrong (naming the record key and the database for a bad record), never
another exception, a signal, a hang, or memory sized by the bytes instead of the
batch. Every test is derandomized (the same examples on every run, no example
database), so CI is deterministic; the examples are bounded to keep the file near
ten seconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import pickle
import resource
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blobpipe
from blobpipe._errors import DataError, ProtoError
from blobpipe._io._image import Undecodable, decode_image
from blobpipe._proto import caffe_pb2
from blobpipe._tools import read_list_file
from tests._helpers import write_lmdb
from tests._images import FORMATS, announcing, encoded

_FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def fuzz(examples: int) -> settings:
    """Derandomized, without an example database, ``examples`` examples."""
    return settings(_FUZZ, max_examples=examples)


_GOOD = [np.full((3, 4, 5), i + 1, np.uint8) for i in range(3)]


def _maxrss_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _read_all(db: Path, **kw: Any) -> list[Any]:
    with blobpipe.Batches(db, 2, mode="epoch", **kw) as b:
        return list(b)


def _check_bad_record_error(exc: DataError, db: Path) -> None:
    assert exc.path is not None and str(exc.path) == str(db), exc
    assert exc.key is not None, exc


# -- regressions: BlobProto shapes and states ---------------------------------------------------


def _blobproto_db(path: Path, dims: list[int], values: int) -> Path:
    proto = caffe_pb2.BlobProto()
    proto.shape.dim.extend(dims)
    proto.data.extend([0.5] * values)
    return write_lmdb(path, [(b"%02d" % i, proto.SerializeToString()) for i in range(4)])


@pytest.mark.parametrize(
    ("dims", "values", "match"),
    [
        ([1] * 33, 1, "BlobProto of 33 axes; a Caffe blob has at most 32"),
        ([1] * 70, 1, "BlobProto of 70 axes"),
        ([2**31, 0, 2**31], 0, "dimension above 2147483647"),
        ([2**30, 2**30, 0, 2**30], 0, "no array can have"),
    ],
)
def test_a_blobproto_record_of_an_impossible_shape_names_key_and_path(
    tmp_path: Path, dims: list[int], values: int, match: str
) -> None:
    db = _blobproto_db(tmp_path / "db", dims, values)
    with pytest.raises(DataError, match=match) as info:
        _read_all(db, record="blobproto")
    _check_bad_record_error(info.value, db)
    with (
        pytest.raises(DataError, match=match),
        blobpipe.Loader(db, 2, device="cpu", record="blobproto", mode="epoch") as loader,
    ):
        for _ in loader:
            pass


@pytest.mark.parametrize("order", ["key", "shuffle"])
@pytest.mark.parametrize("epoch", [2**62 + 1, 2**63, 2**64 + 5])
def test_a_state_with_an_epoch_out_of_range_says_so(order: str, epoch: int) -> None:
    db = Path(__file__).parent / "data" / "caffe" / "lmdb" / "raw_color"
    t = blobpipe.Transform(crop_size=8, mirror=True)
    with blobpipe.Batches(db, 4, order=order, transform=t, phase="train") as b:
        state = {**b.state_dict(), "epoch": epoch}
        with pytest.raises(ValueError, match=f"epoch {epoch} is out of range"):
            b.load_state_dict(state)
    state["epoch"] = 2**62  # the largest epoch runs, and so does the one after it
    with blobpipe.Batches(db, 25, order=order, transform=t, phase="train") as b:
        state["key"] = blobpipe.LmdbReader(db).keys()[int(b.epoch_order(2**62)[0])]
        b.load_state_dict(state)
        it = iter(b)
        assert [next(it).epoch for _ in range(3)] == [2**62, 2**62, 2**62 + 1]


def test_a_batch_larger_than_max_batch_bytes_is_refused_before_it_is_allocated(
    tmp_path: Path,
) -> None:
    """Each image is within the pixel bound, but 64 of them would need 12 GiB: refused
    at planning, naming the record, with the option that raises the bound."""
    png = cv2.imencode(".png", np.zeros((4096, 4096, 3), np.uint8))[1].tobytes()
    assert len(png) < 100_000
    db = tmp_path / "db"
    blobpipe.write_lmdb(db, [(png, i) for i in range(3)])
    match = r"64 rows of shape \(3, 4096, 4096\) \(float32\) needs 12.0 GiB.*max_batch_bytes"
    with pytest.raises(DataError, match=match) as info, blobpipe.Batches(db, 64) as batches:
        batches.next_plan()
    _check_bad_record_error(info.value, db)
    with pytest.raises(DataError, match=match), blobpipe.Loader(db, 64, device="cpu") as loader:
        next(iter(loader))
    with blobpipe.Batches(db, 64, max_batch_bytes=13 << 30) as b:
        plan = b.next_plan()
        assert plan is not None and plan.data_shape == (64, 3, 4096, 4096)  # planned only
    with blobpipe.Batches(db, 1, transform=blobpipe.Transform(crop_size=16)) as b:
        assert next(iter(b)).data.shape == (1, 3, 16, 16)


def _next_batch(batches: blobpipe.Batches) -> tuple[list[bytes], float]:
    with batches:
        batch = next(iter(batches))
        return list(batch.keys), float(batch.data.sum())


def test_batches_pickle_for_spawned_workers_and_resume_where_they_were() -> None:
    db = Path(__file__).parent / "data" / "caffe" / "lmdb" / "raw_color"
    mean = Path(__file__).parent / "data" / "caffe" / "raw_color_mean.binaryproto"
    t = blobpipe.Transform(crop_size=8, mirror=True, mean_file=mean)
    with blobpipe.Batches(db, 4, transform=t, order="shuffle", seed=3, shard=(1, 2)) as b:
        next(iter(b))
        copy = pickle.loads(pickle.dumps(b))
        context = multiprocessing.get_context("spawn")
        with context.Pool(1) as pool:
            spawned = pool.apply(_next_batch, (b,))
        want = next(iter(b))
    assert spawned == (list(want.keys), float(want.data.sum()))
    with copy:
        got = next(iter(copy))
        assert got.keys == want.keys and np.array_equal(got.data, want.data)
    with pytest.raises(blobpipe.StateError, match="closed; pickle Batches that are open"):
        pickle.dumps(b)


# -- random Datums ------------------------------------------------------------------------------

_datum_fields = st.fixed_dictionaries(
    {},
    optional={
        "channels": st.integers(-3, 2**31 - 1) | st.integers(0, 8),
        "height": st.integers(-3, 2**31 - 1) | st.integers(0, 8),
        "width": st.integers(-3, 2**31 - 1) | st.integers(0, 8),
        "data": st.binary(max_size=300),
        "float_data": st.lists(st.floats(width=32, allow_nan=False), max_size=80),
        "label": st.integers(-(2**31), 2**31 - 1),
        "encoded": st.booleans(),
    },
)


@fuzz(40)
@given(fields=_datum_fields, at=st.integers(1, 3))
def test_random_datums_give_their_batches_or_an_error_naming_them(
    tmp_path_factory: pytest.TempPathFactory, fields: dict[str, Any], at: int
) -> None:
    """A database of good 3×4×5 records with one random Datum among them (after the
    first): the batches of the good records, exactly, or a DataError naming a key."""
    datum = caffe_pb2.Datum(**fields)
    items = [(b"%02d" % i, blobpipe.encode_raw_datum(p, i)) for i, p in enumerate(_GOOD)]
    items.insert(at, (b"%02d-fuzz" % at, datum.SerializeToString()))
    db = write_lmdb(tmp_path_factory.mktemp("db") / "db", items)
    try:
        batches = _read_all(db)
    except DataError as exc:
        _check_bad_record_error(exc, db)
        return
    rows = {
        k: (d, label) for b in batches for k, d, label in zip(b.keys, b.data, b.label, strict=True)
    }
    for i, pixels in enumerate(_GOOD):
        data, label = rows[b"%02d" % i]
        assert np.array_equal(data, pixels) and label == i


# -- random BlobProtos --------------------------------------------------------------------------


@fuzz(60)
@given(
    dims=st.lists(st.integers(0, 6) | st.integers(-2, 2**40), max_size=40),
    legacy=st.booleans(),
    values=st.integers(0, 200),
    double=st.booleans(),
)
def test_random_blobprotos_give_their_batches_or_an_error_naming_them(
    tmp_path_factory: pytest.TempPathFactory,
    dims: list[int],
    legacy: bool,
    values: int,
    double: bool,
) -> None:
    proto = caffe_pb2.BlobProto()
    if legacy:
        for name, d in zip(("num", "channels", "height", "width"), dims, strict=False):
            setattr(proto, name, max(-(2**31), min(d, 2**31 - 1)))
    else:
        proto.shape.dim.extend(dims)
    (proto.double_data if double else proto.data).extend([0.25] * values)
    items = [(b"%02d" % i, proto.SerializeToString()) for i in range(3)]
    db = write_lmdb(tmp_path_factory.mktemp("db") / "db", items)
    before = _maxrss_mib()
    try:
        batches = _read_all(db, record="blobproto")
    except DataError as exc:
        _check_bad_record_error(exc, db)
    else:
        assert sum(len(b.keys) for b in batches) == 3
        assert all(b.data.size == len(b.keys) * values for b in batches)
    assert _maxrss_mib() - before < 64


# -- random image headers, every format OpenCV reads --------------------------------------------

_SIDES = st.integers(1, 300) | st.integers(1, 2**16) | st.integers(2**16, 2**32 - 1)


@fuzz(250)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    width=_SIDES,
    height=_SIDES,
    flips=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4),
    flag=st.sampled_from([-1, 0, 1]),
)
def test_random_image_headers_decode_within_the_bound_or_are_refused(
    fmt: str, width: int, height: int, flips: list[tuple[int, int]], flag: int
) -> None:
    """An image of every format announcing a random size, its header bytes then
    changed at random: OpenCV's image, never larger than ``max_pixels``, or a
    reason; OpenCV never allocates what a header asks beyond the bound."""
    data = bytearray(announcing(fmt, width, height))
    for at, value in flips:
        data[at % len(data)] = value
    before = _maxrss_mib()
    got = decode_image(bytes(data), flag, max_pixels=1 << 16)
    if isinstance(got, Undecodable):
        assert got.reason
    else:
        assert got.shape[0] * got.shape[1] <= 1 << 16, (fmt, got.shape)
    assert _maxrss_mib() - before < 64


def test_the_fuzzed_images_are_genuine_where_untouched() -> None:
    """The fuzzing starts from images OpenCV decodes (else it would test nothing)."""
    for fmt in FORMATS:
        got = decode_image(encoded(fmt), 1)  # colour: 8-bit also for PFM and HDR
        assert isinstance(got, np.ndarray) and got.shape[:2] == (70, 110), fmt


# -- random list-file lines ---------------------------------------------------------------------

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
_LIBC.atoi.argtypes = [ctypes.c_char_p]
_LIBC.atoi.restype = ctypes.c_int

_line = st.lists(
    st.sampled_from([b"a", b"/", b".png", b" ", b"\t", b"-", b"+", b"_", b"0", b"7", b"9", b"x"])
    | st.binary(min_size=1, max_size=3),
    max_size=12,
).map(b"".join)


@fuzz(200)
@given(lines=st.lists(_line.filter(lambda x: b"\n" not in x), min_size=1, max_size=6))
def test_random_list_lines_parse_as_caffe_or_name_their_line(
    tmp_path_factory: pytest.TempPathFactory, lines: list[bytes]
) -> None:
    """Every label equals C's ``atoi`` of the text after the last space (the libc
    one, called through ctypes), or the error names the line that has none."""
    lst = tmp_path_factory.mktemp("l") / "list.txt"
    lst.write_bytes(b"\n".join(lines) + b"\n")
    try:
        entries = read_list_file(lst)
    except DataError as exc:
        error = str(exc)
    else:
        error = ""
    if error:
        assert "line " in error and "list.txt" in error
        return
    assert len(entries) == len(lines)
    for line, (path, label) in zip(lines, entries, strict=True):
        if not line.strip():
            assert (path, label) == (b"", 0)
            continue
        pos = line.rfind(b" ")
        assert path == line[:pos]
        tail = line[pos + 1 :].split(b"\0")[0]
        assert label == _LIBC.atoi(tail), (line, label)


# -- random state dicts -------------------------------------------------------------------------

_values = (
    st.integers(-(2**70), 2**70)
    | st.integers(-3, 60)
    | st.none()
    | st.booleans()
    | st.text(max_size=4)
    | st.binary(max_size=30)
    | st.lists(st.integers(-2, 3), max_size=3)
    | st.floats()
)


@fuzz(200)
@given(
    changes=st.dictionaries(
        st.sampled_from(
            [
                "version",
                "epoch",
                "position",
                "key",
                "seed",
                "order",
                "buffer_size",
                "shard",
                "shard_mode",
                "num_records",
                "pad_shards",
                "other",
            ]
        ),
        _values | st.just("<drop>"),
        max_size=3,
    ),
    order=st.sampled_from(["key", "shuffle"]),
)
def test_random_states_resume_or_are_refused_with_a_clear_error(
    changes: dict[str, Any], order: str
) -> None:
    db = Path(__file__).parent / "data" / "caffe" / "lmdb" / "raw_color"
    t = blobpipe.Transform(crop_size=8, mirror=True)
    with blobpipe.Batches(db, 8, order=order, transform=t, phase="train") as b:
        state = b.state_dict()
        for name, value in changes.items():
            if value == "<drop>":
                state.pop(name, None)
            else:
                state[name] = value
        try:
            b.load_state_dict(state)
        except (ValueError, TypeError) as exc:  # DataError is a ValueError
            refused = str(exc)
        else:
            refused = ""
        if refused:
            return  # a ValueError or TypeError that says why; nothing else may escape
        it = iter(b)
        for _ in range(8):  # past the end of the epoch
            batch = next(it)
            assert batch.data.shape == (8, 3, 8, 8)


# -- random mean files --------------------------------------------------------------------------


@fuzz(80)
@given(
    dims=st.lists(st.integers(-1, 40), max_size=5),
    values=st.integers(0, 5000),
    legacy=st.booleans(),
    garbage=st.binary(max_size=40),
)
def test_random_mean_files_load_or_are_refused_naming_the_file(
    tmp_path_factory: pytest.TempPathFactory,
    dims: list[int],
    values: int,
    legacy: bool,
    garbage: bytes,
) -> None:
    proto = caffe_pb2.BlobProto()
    if legacy:
        for name, d in zip(("num", "channels", "height", "width"), dims, strict=False):
            setattr(proto, name, d)
    else:
        proto.shape.dim.extend(dims)
    proto.data.extend([1.0] * values)
    path = tmp_path_factory.mktemp("m") / "mean.binaryproto"
    path.write_bytes(proto.SerializeToString() + garbage)
    try:
        t = blobpipe.Transform(mean_file=path)
    except ProtoError as exc:
        refused = str(exc)
    else:
        refused = ""
    if refused:
        assert "mean.binaryproto" in refused
        return
    db = Path(__file__).parent / "data" / "caffe" / "lmdb" / "raw_color"
    try:
        batches = _read_all(db, transform=t, phase="test")
    except DataError as exc:
        failed: DataError | None = exc
    else:
        failed = None
    if failed is not None:
        _check_bad_record_error(failed, db)
        assert "mean" in str(failed)
        return
    assert sum(len(b.keys) for b in batches) == 50
