"""LevelDB databases: read from their files, equal to LevelDB itself and to real Caffe.

The reader never changes the directory, reads a read-only copy and serves several
processes at once; damaged files raise a DataError naming the file and the fix.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import shutil
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blobpipe import (
    Batches,
    DatabaseNotFoundError,
    DataError,
    LevelDbReader,
    LmdbReader,
    Loader,
    ProtoError,
    RecordNotFoundError,
    StateError,
    Transform,
    compute_mean,
    inspect_db,
    read_data_layer,
)
from blobpipe._cli import main
from blobpipe._io._database import database_kind, open_reader

from ._helpers import in_forked_child
from .conftest import CAFFE

LEVELDB = CAFFE / "leveldb" / "raw_color"  # after one open by LevelDB: a table file
AS_WRITTEN = CAFFE / "leveldb_as_written" / "raw_color"  # as convert_imageset left it: a log
LMDB = CAFFE / "lmdb" / "raw_color"
STATES = {"table": LEVELDB, "log": AS_WRITTEN}
MEAN = CAFFE / "mean_leveldb.binaryproto"
REF_CASES: dict[str, dict[str, Any]] = {
    "leveldb_raw_color_b8": {},
    "leveldb_raw_color_b8_meanfile_scale": {"scale": 0.017, "mean_file": MEAN},
}


def snapshot(path: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file of a directory: its bytes' digest, mode and modification time."""
    out = {}
    for p in sorted(path.iterdir()):
        st_ = p.stat()
        out[p.name] = (hashlib.sha256(p.read_bytes()).digest(), st_.st_mode, st_.st_mtime_ns)
    return out


def copy_db(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in [dst, *dst.iterdir()]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    return dst


def caffe_reference(case: str) -> list[tuple[np.ndarray, np.ndarray]]:
    ref = CAFFE / "ref" / case
    n = len(list(ref.glob("data_b*.npy")))
    return [(np.load(ref / f"data_b{k}.npy"), np.load(ref / f"label_b{k}.npy")) for k in range(n)]


# -- real Caffe --------------------------------------------------------------------------------


@pytest.mark.parametrize("state", sorted(STATES))
def test_both_states_hold_the_lmdbs_records(state: str) -> None:
    with LevelDbReader(STATES[state]) as db, LmdbReader(LMDB) as lmdb:
        assert list(db.keys()) == list(lmdb.keys())
        assert list(db.items()) == list(lmdb.items())
        assert len(db) == 50
        key = db.keys()[37]
        assert key == b"00000037_color/synth 07 with space.png"
        assert db.get(key) == lmdb.get(key)
        assert db.read(key, len) == len(lmdb.get(key))
        with db.transaction() as txn:
            assert bytes(txn.get(key)) == lmdb.get(key)
            assert key in txn


@pytest.mark.parametrize("state", sorted(STATES))
@pytest.mark.parametrize("case", sorted(REF_CASES))
def test_batches_equal_caffes_datalayer(state: str, case: str) -> None:
    ref = caffe_reference(case)
    t = Transform(**REF_CASES[case])
    with Batches(STATES[state], 8, transform=t, phase="test") as b:
        for k, batch in enumerate(b):
            if k == len(ref):
                break
            assert np.array_equal(batch.data, ref[k][0]), k
            assert np.array_equal(batch.label, ref[k][1]), k


@pytest.mark.parametrize("case", sorted(REF_CASES))
def test_from_prototxt_equals_caffe(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    ref = caffe_reference(case)
    config = read_data_layer(f"ref/{case}/net.prototxt", "test")
    assert config.backend == "leveldb"
    with Batches(**config.batches_kwargs()) as b:
        got = [next(iter(b)) for _ in range(len(ref))]
    for k, batch in enumerate(got):
        assert np.array_equal(batch.data, ref[k][0]), k
    with Loader.from_prototxt(f"ref/{case}/net.prototxt", "test", device="cpu") as loader:
        for k, batch in enumerate(loader):
            if k == len(ref):
                break
            assert np.array_equal(batch.data.cpu_data(), ref[k][0]), k
            assert np.array_equal(batch.label.cpu_data(), ref[k][1]), k


def test_compute_mean_equals_caffes(tmp_path: Path) -> None:
    out = tmp_path / "mean.binaryproto"
    compute_mean(LEVELDB, out)
    assert out.read_bytes() == MEAN.read_bytes()
    assert main(["compute-mean", "-backend=leveldb", str(AS_WRITTEN), str(tmp_path / "m2")]) == 0
    assert (tmp_path / "m2").read_bytes() == MEAN.read_bytes()


def test_tools_read_a_leveldb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    info = inspect_db(AS_WRITTEN)
    assert (info.kind, info.records, info.kinds) == ("leveldb", 50, {"raw": 50})
    assert main(["inspect", str(LEVELDB)]) == 0
    assert "(LevelDB," in capsys.readouterr().out
    assert main(["show", str(LEVELDB), "-o", str(tmp_path / "grid.png"), "--count", "4"]) == 0
    assert (tmp_path / "grid.png").stat().st_size > 0
    out = tmp_path / "out.npz"
    assert main(["export", "--format", "npz", str(LEVELDB), str(out), "--limit", "5"]) == 0
    assert out.exists()
    assert main(["bench", str(AS_WRITTEN), "--batches", "3", "--warmup", "1", "-q"]) == 0


def test_lists_and_lockstep_sources_mix_the_kinds() -> None:
    with Batches([LEVELDB, LMDB], 100, phase="test", mode="epoch") as b:
        (batch,) = list(b)
    with Batches(LMDB, 50, phase="test", mode="epoch") as b:
        (one,) = list(b)
    assert np.array_equal(batch.data, np.concatenate([one.data, one.data]))
    with Batches({"data": AS_WRITTEN, "other": LMDB}, 10, phase="test", mode="epoch") as b:
        first = next(iter(b))
        assert np.array_equal(first["data"], first["other"])


# -- read-only, many processes -----------------------------------------------------------------


@pytest.mark.parametrize("state", sorted(STATES))
def test_reading_leaves_the_directory_unchanged(state: str, tmp_path: Path) -> None:
    db = copy_db(STATES[state], tmp_path / "db")
    before = snapshot(db)
    with Loader(db, 8, device="cpu", phase="test", mode="epoch", shuffle=True) as loader:
        assert sum(len(b.label.cpu_data()) for b in loader) == 50
    with open_reader(db) as reader:
        list(reader.items())
    inspect_db(db)
    assert snapshot(db) == before


def test_a_read_only_copy_reads(tmp_path: Path) -> None:
    db = copy_db(AS_WRITTEN, tmp_path / "db")
    for p in [*db.iterdir(), db]:
        p.chmod(stat.S_IRUSR | stat.S_IXUSR * p.is_dir())
    try:
        with LevelDbReader(db) as reader, LmdbReader(LMDB) as lmdb:
            assert list(reader.items()) == list(lmdb.items())
    finally:
        db.chmod(0o755)


def _read_all(path: str, queue: Any) -> None:
    with Batches(path, 8, phase="test", mode="epoch") as b:
        queue.put(hashlib.sha256(b"".join(x.data.tobytes() for x in b)).hexdigest())


def test_two_processes_read_one_database_at_once(tmp_path: Path) -> None:
    db = copy_db(LEVELDB, tmp_path / "db")
    before = snapshot(db)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_read_all, args=(str(db), queue)) for _ in range(2)]
    with LevelDbReader(db):  # a third reader holds it open meanwhile
        for p in procs:
            p.start()
        digests = [queue.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    with Batches(db, 8, phase="test", mode="epoch") as b:
        mine = hashlib.sha256(b"".join(x.data.tobytes() for x in b)).hexdigest()
    assert digests == [mine, mine]
    assert snapshot(db) == before


def test_a_forked_child_reads_through_the_parents_reader() -> None:
    with LevelDbReader(LEVELDB) as reader, LmdbReader(LMDB) as lmdb:
        expected = list(lmdb.items())
        reader.get(reader.keys()[0])
        assert in_forked_child(lambda: list(reader.items()) == expected) == 0


# -- the API and its errors ----------------------------------------------------------------------


def test_kind_is_told_from_the_directory(tmp_path: Path) -> None:
    assert database_kind(LEVELDB) == "leveldb"
    assert database_kind(LMDB) == "lmdb"
    assert isinstance(open_reader(AS_WRITTEN), LevelDbReader)
    (tmp_path / "neither").mkdir()
    (tmp_path / "neither" / "notes.txt").write_text("x")
    with pytest.raises(DatabaseNotFoundError, match=r"neither data.mdb \(an LMDB\) nor CURRENT "
                       r"\(a LevelDB\); it holds 'notes.txt'"):  # fmt: skip
        Batches(tmp_path / "neither", 4)
    with pytest.raises(DatabaseNotFoundError, match="it is empty"):
        open_reader(tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else tmp_path)


def test_reader_api_errors() -> None:
    reader = LevelDbReader(LEVELDB)
    with pytest.raises(RecordNotFoundError, match="no record under this key"):
        reader.get(b"nope")
    with pytest.raises(TypeError, match="keys are bytes"):
        reader.get("00000000_color/china_00.jpg")  # type: ignore[arg-type]
    assert b"nope" not in reader and reader.keys()[0] in reader
    assert "50 records" in repr(reader)
    reader.close()
    reader.close()
    with pytest.raises(StateError, match="closed"):
        len(reader)
    with pytest.raises(DatabaseNotFoundError, match="no such directory"):
        LevelDbReader(CAFFE / "missing")


def test_prototxt_backend_must_match_the_directory(tmp_path: Path) -> None:
    net = tmp_path / "net.prototxt"
    net.write_text(
        f'layer {{ name: "d" type: "Data" top: "data" data_param {{ source: "{LMDB}" '
        "batch_size: 4 } }"
    )
    with pytest.raises(ProtoError, match=r"backend LEVELDB \(LEVELDB is protobuf's default"
                       r".*holds an LMDB.*set `backend: LMDB`"):  # fmt: skip
        read_data_layer(net)
    net.write_text(net.read_text().replace("batch_size: 4", "batch_size: 4 backend: LMDB")
                   .replace(str(LMDB), str(LEVELDB)))  # fmt: skip
    with pytest.raises(ProtoError, match=r"holds an? LevelDB"):
        read_data_layer(net)


# -- damaged databases -------------------------------------------------------------------------


def test_a_flipped_byte_in_a_table_block_is_a_checksum_error(tmp_path: Path) -> None:
    db = copy_db(LEVELDB, tmp_path / "db")
    table = db / "000005.ldb"
    data = bytearray(table.read_bytes())
    data[70_000] ^= 0x01  # inside the second data block (stored)
    table.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"table 000005.ldb is damaged: the checksum of the "
                       r"data block at offset 66087 does not match.*copy the database "
                       r"again"):  # fmt: skip
        LevelDbReader(db)


def test_a_truncated_log_names_the_log_and_the_fix(tmp_path: Path) -> None:
    db = copy_db(AS_WRITTEN, tmp_path / "db")
    log = db / "000003.log"
    log.write_bytes(log.read_bytes()[:100_000])
    with pytest.raises(DataError, match=r"write-ahead log 000003.log is cut short.*copy it"):
        Batches(db, 4)


def test_a_flipped_byte_in_the_log_is_a_checksum_error(tmp_path: Path) -> None:
    db = copy_db(AS_WRITTEN, tmp_path / "db")
    log = db / "000003.log"
    data = bytearray(log.read_bytes())
    data[50_000] ^= 0x80
    log.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"000003.log is damaged: the checksum of the log record"):
        LevelDbReader(db)


def test_a_table_damaged_after_open_raises_when_read(tmp_path: Path) -> None:
    db = copy_db(LEVELDB, tmp_path / "db")
    reader = LevelDbReader(db)
    table = db / "000005.ldb"
    data = bytearray(table.read_bytes())
    data[140_000] ^= 0x01  # the third (snappy) block
    table.write_bytes(bytes(data))
    with pytest.raises(DataError, match="the checksum of the data block at offset 132161"):
        reader.get(reader.keys()[-1])


def test_missing_or_bad_manifest(tmp_path: Path) -> None:
    db = copy_db(LEVELDB, tmp_path / "db")
    (db / "CURRENT").write_bytes(b"garbage")
    with pytest.raises(DataError, match="CURRENT file does not name a MANIFEST"):
        LevelDbReader(db)
    (db / "CURRENT").write_bytes(b"MANIFEST-000011\n")
    (db / "000005.ldb").unlink()
    with pytest.raises(DataError, match=r"a file the database lists is missing .*000005.ldb"):
        LevelDbReader(db)


_FILES = ("000005.ldb", "MANIFEST-000011", "CURRENT")


@settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    which=st.sampled_from(["table", "log"]),
    at=st.floats(0, 1, exclude_max=True),
    how=st.sampled_from(["flip", "truncate", "zero"]),
    bit=st.integers(0, 7),
)
def test_damaged_bytes_raise_data_error_or_read_the_same(
    tmp_path_factory: pytest.TempPathFactory, which: str, at: float, how: str, bit: int
) -> None:
    """Any one damage to any file: a DataError, or (a byte no reader relies on, e.g. a
    filter or LevelDB's own LOG) the same records; never another exception."""
    src = STATES[which]
    db = copy_db(src, tmp_path_factory.mktemp("db") / "db")
    files = sorted(p for p in db.iterdir() if p.stat().st_size and p.name not in ("LOG", "LOCK"))
    target = files[int(at * len(files))]
    data = bytearray(target.read_bytes())
    pos = int(at * 7919 * len(data)) % len(data)
    if how == "flip":
        data[pos] ^= 1 << bit
    elif how == "truncate":
        del data[pos:]
    else:
        data[pos : pos + 64] = bytes(len(data[pos : pos + 64]))
    target.write_bytes(bytes(data))
    with LmdbReader(LMDB) as lmdb:
        expected = list(lmdb.items())
    try:
        with LevelDbReader(db) as reader:
            got = list(reader.items())
    except DataError as exc:
        message = str(exc)
    else:
        message = ""
    if message:
        assert str(db) in message
        return
    if how == "truncate" and target.suffix == ".log" and pos == 0:
        expected = []  # an empty log is a valid one: no write since the tables
    assert got == expected


# -- against LevelDB itself ------------------------------------------------------------------------


def _generated(path: Path, seed: int) -> dict[bytes, bytes]:
    """A database written by LevelDB (plyvel) with random puts, overwrites and deletes,
    block sizes, compression and flushes; returns what it holds."""
    plyvel = pytest.importorskip("plyvel")
    rng = random.Random(seed)
    options = {
        "create_if_missing": True,
        "block_size": rng.choice([256, 4096, 65536]),
        "compression": rng.choice(["snappy", None]),
        "write_buffer_size": rng.choice([64 << 10, 1 << 20, 64 << 20]),
        "block_restart_interval": rng.choice([1, 4, 16]),
    }
    held: dict[bytes, bytes] = {}
    db = plyvel.DB(str(path), **options)
    for _ in range(rng.randint(1, 6)):
        with db.write_batch() as wb:
            for _ in range(rng.randint(0, 300)):
                key = b"%08d_k" % rng.randrange(400) + bytes(rng.randrange(3))
                if held and rng.random() < 0.15:
                    victim = rng.choice(sorted(held))
                    wb.delete(victim)
                    held.pop(victim)
                    continue
                size = rng.choice([0, 3, 100, 3000, 70_000])
                value = rng.randbytes(size) if rng.random() < 0.5 else bytes([size % 251]) * size
                wb.put(key, value)
                held[key] = value
        if rng.random() < 0.3:
            db.compact_range()
    db.close()
    if rng.random() < 0.5:  # a second open: LevelDB replays the log into a table
        plyvel.DB(str(path)).close()
    return held


@pytest.mark.parametrize("seed", range(12))
def test_equals_leveldb_on_generated_databases(tmp_path: Path, seed: int) -> None:
    plyvel = pytest.importorskip("plyvel")
    held = _generated(tmp_path / "db", seed)
    before = snapshot(tmp_path / "db")
    with LevelDbReader(tmp_path / "db") as reader:
        got = list(reader.items())
    assert snapshot(tmp_path / "db") == before
    assert got == sorted(held.items())
    copy = copy_db(tmp_path / "db", tmp_path / "copy")
    with plyvel.DB(str(copy)) as db:
        assert got == list(db.iterator())


def test_zstd_blocks_and_other_comparators_are_refused_clearly(tmp_path: Path) -> None:
    db = copy_db(LEVELDB, tmp_path / "db")
    manifest = db / "MANIFEST-000011"
    data = manifest.read_bytes()
    assert b"leveldb.BytewiseComparator" in data
    # a VersionEdit naming another comparator, appended as a FULL record
    edit = bytes([1, 9]) + b"my.cmp.v1"
    from blobpipe._io._leveldbfile import masked_crc

    record = struct.pack("<IHB", masked_crc(bytes([1]) + edit), len(edit), 1) + edit
    manifest.write_bytes(data + record)
    with pytest.raises(DataError, match=r"comparator b'my\.cmp\.v1'"):
        LevelDbReader(db)


def test_no_file_is_opened_for_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = copy_db(AS_WRITTEN, tmp_path / "db")
    real_open = os.open
    flags_seen: list[int] = []

    def spy(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        flags_seen.append(flags)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    with LevelDbReader(db) as reader:
        list(reader.items())
    assert flags_seen
    assert all(f & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) == 0 for f in flags_seen)


# -- writing: convert-imageset --backend=leveldb ---------------------------------------------------


def test_convert_imageset_writes_caffes_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(CAFFE)
    out = tmp_path / "raw_color"
    argv = ["convert-imageset", "--backend=leveldb", "--resize_height=32", "--resize_width=40",
            "images/", "list_color.txt", str(out), "-q"]  # fmt: skip
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["000003.log", "CURRENT", "LOCK",
                                                     "MANIFEST-000002"]  # fmt: skip
    for name in ("000003.log", "CURRENT", "MANIFEST-000002", "LOCK"):
        assert (out / name).read_bytes() == (AS_WRITTEN / name).read_bytes(), name
    plyvel = pytest.importorskip("plyvel")
    with plyvel.DB(str(copy_db(out, tmp_path / "copy"))) as db, LmdbReader(LMDB) as lmdb:
        assert list(db.iterator()) == list(lmdb.items())


def test_the_writer_splits_batches_across_blocks_and_resumes_after_a_torn_one(
    tmp_path: Path,
) -> None:
    from blobpipe._tools._leveldbwrite import LevelDbWriter

    rng = random.Random(4)
    items = [(b"%06d" % i, rng.randbytes(rng.choice([0, 10, 5000, 40000]))) for i in range(60)]
    with LevelDbWriter(tmp_path / "db") as w:
        for a in range(0, 60, 7):
            w.put_many(items[a : a + 7])
        assert w.entries() == 60
    log = tmp_path / "db" / "000003.log"
    whole = log.read_bytes()
    log.write_bytes(whole + whole[100:5000])  # a batch cut short by a writer that died
    with LevelDbWriter(tmp_path / "db") as w:  # resumes after the last whole batch
        assert w.entries() == 60
        w.put_many([(b"000003", b"new")])
    expected = dict(items) | {b"000003": b"new"}
    with LevelDbReader(tmp_path / "db") as reader:
        assert list(reader.items()) == sorted(expected.items())
    plyvel = pytest.importorskip("plyvel")
    with plyvel.DB(str(copy_db(tmp_path / "db", tmp_path / "copy"))) as db:
        assert list(db.iterator()) == sorted(expected.items())


def test_many_table_files_stay_within_the_open_file_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from blobpipe._io import _leveldb

    plyvel = pytest.importorskip("plyvel")
    monkeypatch.setattr(_leveldb, "_OPEN_FILES", 3)
    db = plyvel.DB(str(tmp_path / "db"), create_if_missing=True, write_buffer_size=64 << 10)
    expected = {}
    for i in range(12):  # each flush makes a table file
        batch = {b"%04d" % (i * 10 + j): bytes([i]) * 20_000 for j in range(10)}
        for k, v in batch.items():
            db.put(k, v)
        expected |= batch
    db.close()
    tables = list((tmp_path / "db").glob("*.ldb"))
    assert len(tables) > 3
    before = len(os.listdir("/proc/self/fd"))
    with LevelDbReader(tmp_path / "db") as reader:
        assert len(os.listdir("/proc/self/fd")) <= before + 3
        assert list(reader.items()) == sorted(expected.items())
        reader.close()
        with pytest.raises(StateError):
            reader.get(b"0000")


@settings(max_examples=600, derandomize=True, deadline=None)
@given(data=st.binary(max_size=600), kind=st.integers(0, 6))
def test_the_format_parsers_raise_damaged_and_nothing_else(data: bytes, kind: int) -> None:
    """Random bytes, raw or framed with valid checksums (so that the parsers behind
    the checksum see them): a result within the bytes, or Damaged."""
    from blobpipe._io import _leveldbfile as f
    from blobpipe._tools._leveldbwrite import _records

    if kind in (4, 5):  # a log record, checksum right, holding random bytes
        data = _records(data, 0)[0]
    elif kind == 6:  # a stored or snappy block, checksum right
        raw = data + bytes([len(data) % 2])
        data = raw + struct.pack("<I", f.masked_crc(raw))

    def drain() -> None:
        if kind in (0, 4):
            for record in f.log_records(data):
                list(f.write_batch(record.data))
        elif kind in (1, 5):
            f.manifest_of(data)
        elif kind == 2:
            for key, start, length in f.block_entries(data):
                assert 0 <= start <= start + length <= len(data)
                f.internal_key(key)
            f.data_block_handles(data, len(data))
        elif kind == 3:
            f.table_index(data[-48:].rjust(48, b"\0"), len(data) + 48)
        else:
            contents = f.block_contents(data, "the block")
            assert len(contents) <= 22 * len(data) + 64
            for _ in f.block_entries(contents):
                pass

    try:
        drain()
    except f.Damaged:
        pass


def test_a_snappy_block_announcing_more_than_it_can_hold_is_refused() -> None:
    from blobpipe._io import _leveldbfile as f

    body = b"\xff\xff\xff\xff\x0f" + b"\x00" * 10  # announces 4 GiB from 15 bytes
    raw = body + b"\x01" + struct.pack("<I", f.masked_crc(body + b"\x01"))
    with pytest.raises(f.Damaged, match="more than snappy can expand to"):
        f.block_contents(raw, "the block")


def test_resume_shards_and_quasi_order_work_as_on_lmdb() -> None:
    def rows(src: Path, **kwargs: Any) -> list[np.ndarray]:
        with Batches(src, 8, phase="test", mode="epoch", **kwargs) as b:
            return [x.data.copy() for x in b]

    for kwargs in ({"order": "shuffle", "seed": 3}, {"shard": (1, 3)},
                   {"order": "quasi", "buffer_size": 16}):
        got, want = rows(LEVELDB, **kwargs), rows(LMDB, **kwargs)
        assert len(got) == len(want), kwargs
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), kwargs
    with Batches(AS_WRITTEN, 8, order="shuffle", seed=5) as b:
        it = iter(b)
        next(it)
        state = b.state_dict()
        expected = [next(it).data.copy() for _ in range(3)]
    with Batches(AS_WRITTEN, 8, order="shuffle", seed=5, state=state) as b:
        it = iter(b)
        assert all(np.array_equal(next(it).data, e) for e in expected)
