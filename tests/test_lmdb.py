"""LmdbReader: Caffe's databases read-only, shared per process, across threads and forks."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest

from blobpipe._errors import (
    DatabaseNotFoundError,
    DataError,
    RecordNotFoundError,
    StateError,
)
from blobpipe._io import _lmdbenv
from blobpipe._io._datum import decode_datum, decode_datum_into
from blobpipe._io._lmdb import LmdbReader
from blobpipe._proto.caffe_pb2 import BlobProto
from tests._helpers import (
    dupsort_db,
    image,
    in_forked_child,
    key,
    lmdb_items,
    open_lmdb,
    write_lmdb,
)

CAFFE = Path(__file__).parent / "data" / "caffe"
RAW = CAFFE / "lmdb" / "raw_color"
ENCODED = CAFFE / "lmdb" / "encoded_jpg"


RAW_ITEMS = lmdb_items(RAW)


@pytest.fixture(autouse=True)
def _no_leaked_environments() -> Iterator[None]:
    yield
    assert _lmdbenv.REGISTRY.envs == {}, "a test left an LmdbReader open"


@pytest.fixture
def raw() -> Iterator[LmdbReader]:
    with LmdbReader(RAW) as reader:
        yield reader


# -- reading -----------------------------------------------------------------------------------


def test_keys_are_in_byte_order_cached_and_include_spaces(raw: LmdbReader) -> None:
    assert len(raw) == 50
    keys = raw.keys()
    assert list(keys) == [k for k, _ in RAW_ITEMS]
    assert list(keys) == sorted(keys)
    assert b"00000037_color/synth 07 with space.png" in keys
    assert raw.keys() is keys
    assert list(raw) == list(keys)
    assert raw.path == str(RAW)


def test_get_items_values_datums_match_lmdb(raw: LmdbReader) -> None:
    for k, v in RAW_ITEMS:
        assert raw.get(k) == v
        assert k in raw
    assert list(raw.items()) == RAW_ITEMS
    assert list(raw.values()) == [v for _, v in RAW_ITEMS]
    datums = list(raw.datums())
    assert [k for k, _ in datums] == [k for k, _ in RAW_ITEMS]
    assert all((d.channels, d.height, d.width) == (3, 32, 40) for _, d in datums)
    for k, d in datums:
        chw, _ = decode_datum(d, key=k, path=raw.path)
        assert chw.shape == (3, 32, 40)


def test_encoded_database_decodes_to_3_by_h_by_w() -> None:
    with LmdbReader(ENCODED) as reader:
        for key, datum in reader.datums():
            assert datum.encoded
            chw, _ = decode_datum(datum, key=key)
            assert chw.ndim == 3
            assert chw.shape[0] == 3


def test_missing_keys_raise_record_not_found(raw: LmdbReader) -> None:
    key = b"00000050_color/none.png"
    with pytest.raises(RecordNotFoundError, match="no record under this key") as info:
        raw.get(key)
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, DataError)
    assert info.value.key == key
    assert str(RAW) in str(info.value)
    for bad in (b"", b"x" * 600):
        with pytest.raises(RecordNotFoundError):
            raw.get(bad)
        assert bad not in raw
    assert "str" not in raw
    with pytest.raises(TypeError):
        raw.get("00000000_color/china_00.jpg")  # type: ignore[arg-type]


def test_zero_copy_transaction_and_read(raw: LmdbReader) -> None:
    keys = raw.keys()
    batch = np.empty((4, 3, 32, 40), np.float32)
    with raw.transaction() as txn:
        views = [txn.get(k) for k in keys[:4]]
        assert all(isinstance(v, memoryview) and v.readonly for v in views)
        labels = [decode_datum_into(v, batch[i]) for i, v in enumerate(views)]
        assert keys[0] in txn
        assert b"nope" not in txn
        assert [k for k, _ in txn.items()] == list(keys)
        with pytest.raises(RecordNotFoundError):
            txn.get(b"nope")
    expected = [decode_datum(v) for _, v in RAW_ITEMS[:4]]
    assert np.array_equal(batch, np.stack([e[0] for e in expected]).astype(np.float32))
    assert labels == [e[1] for e in expected]
    with pytest.raises(StateError, match="has ended"):
        txn.get(keys[0])
    assert raw.read(keys[2], bytes) == RAW_ITEMS[2][1]
    assert raw.read(keys[2], len) == len(RAW_ITEMS[2][1])
    with pytest.raises(RecordNotFoundError):
        raw.read(b"nope", bytes)


def test_transaction_belongs_to_its_thread(raw: LmdbReader) -> None:
    errors: list[BaseException] = []
    with raw.transaction() as txn:

        def other() -> None:
            try:
                txn.get(raw.keys()[0])
            except StateError as exc:
                errors.append(exc)

        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(errors) == 1
    assert "thread" in str(errors[0])


def test_blobprotos(tmp_path: Path) -> None:
    protos = [
        BlobProto(num=1, channels=1, height=1, width=i + 1, data=[1.0] * (i + 1)) for i in range(3)
    ]
    write_lmdb(
        tmp_path / "db", [(b"%02d" % i, p.SerializeToString()) for i, p in enumerate(protos)]
    )
    with LmdbReader(tmp_path / "db") as reader:
        got = list(reader.blobprotos())
    assert [k for k, _ in got] == [b"00", b"01", b"02"]
    assert [p for _, p in got] == protos
    write_lmdb(tmp_path / "bad", [(b"k", b"\x0a\x05ab")])
    with (
        LmdbReader(tmp_path / "bad") as reader,
        pytest.raises(DataError, match="BlobProto") as info,
    ):
        list(reader.blobprotos())
    assert info.value.key == b"k"


def test_bad_datum_in_datums_names_key_and_path(tmp_path: Path) -> None:
    write_lmdb(tmp_path / "db", [(b"a", RAW_ITEMS[0][1]), (b"b", b"\x22\x09abc")])
    with LmdbReader(tmp_path / "db") as reader:
        it = reader.datums()
        assert next(it)[0] == b"a"
        with pytest.raises(DataError, match=r"not a valid caffe\.Datum") as info:
            next(it)
    assert info.value.key == b"b"
    assert info.value.path == str(tmp_path / "db")


def test_key_gaps_are_kept(tmp_path: Path) -> None:
    items = [(b"%08d_x.png" % i, RAW_ITEMS[i][1]) for i in (0, 1, 5, 9)]
    write_lmdb(tmp_path / "db", items)
    with LmdbReader(tmp_path / "db") as reader:
        assert list(reader.keys()) == [k for k, _ in items]
        assert reader.get(b"00000005_x.png") == RAW_ITEMS[5][1]


# -- opening -----------------------------------------------------------------------------------


def test_missing_and_non_lmdb_paths_raise_database_not_found(tmp_path: Path) -> None:
    with pytest.raises(DatabaseNotFoundError, match="no such file or directory") as info:
        LmdbReader(tmp_path / "nope")
    assert isinstance(info.value, FileNotFoundError)
    assert str(tmp_path / "nope") in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatabaseNotFoundError, match=r"holds no data\.mdb"):
        LmdbReader(tmp_path / "empty")
    assert os.listdir(tmp_path / "empty") == []  # nothing created
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "data.mdb").write_bytes(b"x" * 8192)
    with pytest.raises(DatabaseNotFoundError, match="not an LMDB database"):
        LmdbReader(tmp_path / "junk")
    (tmp_path / "file").write_bytes(b"y" * 100)
    with pytest.raises(DatabaseNotFoundError, match="not an LMDB database"):
        LmdbReader(tmp_path / "file")


def test_data_file_path_and_symlink_share_one_environment(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(RAW.resolve())
    with (
        LmdbReader(RAW) as a,
        LmdbReader(RAW / "data.mdb") as b,
        LmdbReader(tmp_path / "link") as c,
    ):
        assert a._shared is b._shared is c._shared
        assert a._shared.refs == 3
        assert b.get(a.keys()[3]) == RAW_ITEMS[3][1]
        assert len(c) == 50


def test_read_only_directory_opens_and_nothing_is_written(tmp_path: Path) -> None:
    db = tmp_path / "ro"
    shutil.copytree(RAW, db)
    (db / "data.mdb").chmod(0o444)
    db.chmod(0o555)
    try:
        before = sorted(os.listdir(db))
        mtime = (db / "data.mdb").stat().st_mtime_ns
        with LmdbReader(db) as reader:
            assert [v for _, v in reader.items()] == [v for _, v in RAW_ITEMS]
        assert sorted(os.listdir(db)) == before == ["data.mdb"]  # no lock.mdb
        assert (db / "data.mdb").stat().st_mtime_ns == mtime
    finally:
        db.chmod(stat.S_IRWXU)


def test_last_close_closes_the_environment_so_others_can_open(tmp_path: Path) -> None:
    a = LmdbReader(RAW)
    b = LmdbReader(RAW)
    a.close()
    a.close()  # idempotent
    assert b.get(b.keys()[0]) == RAW_ITEMS[0][1]
    b.close()
    assert _lmdbenv.REGISTRY.envs == {}
    env = lmdb.open(str(RAW), readonly=True, lock=False, create=False)  # py-lmdb agrees
    try:
        with pytest.raises(DataError, match="already open in this process outside blobpipe"):
            LmdbReader(RAW)
    finally:
        env.close()
    with LmdbReader(RAW) as c:
        assert len(c) == 50


def test_use_after_close_raises_state_error() -> None:
    reader = LmdbReader(RAW)
    key = reader.keys()[0]
    reader.close()
    assert reader.closed
    assert "closed" in repr(reader)
    for call in (
        lambda: reader.get(key),
        lambda: len(reader),
        reader.keys,
        reader.items,
        reader.values,
        reader.datums,
        lambda: reader.read(key, bytes),
        lambda: reader.transaction().__enter__(),
        lambda: key in reader,
        lambda: pickle.dumps(reader),
    ):
        with pytest.raises(StateError, match="is closed; open a new LmdbReader"):
            call()


def test_close_inside_a_transaction_waits_for_it() -> None:
    reader = LmdbReader(RAW)
    key = reader.keys()[0]
    with reader.transaction() as txn:
        view = txn.get(key)
        reader.close()
        with pytest.raises(StateError):
            reader.get(key)
        assert bytes(view) == RAW_ITEMS[0][1]  # still mapped
        assert bytes(txn.get(key)) == RAW_ITEMS[0][1]
        assert _lmdbenv.REGISTRY.envs != {}
    assert _lmdbenv.REGISTRY.envs == {}


def test_close_while_iterating_stops_the_iterator() -> None:
    reader = LmdbReader(RAW)
    it = reader.items()
    next(it)
    reader.close()
    with pytest.raises(StateError):
        next(it)
    assert _lmdbenv.REGISTRY.envs == {}


def test_pickle_reopens_the_path(raw: LmdbReader) -> None:
    clone = pickle.loads(pickle.dumps(raw))
    try:
        assert clone is not raw
        assert clone._shared is raw._shared
        assert clone.get(raw.keys()[1]) == RAW_ITEMS[1][1]
    finally:
        clone.close()


# -- threads and processes -----------------------------------------------------------------------


def test_threads_read_concurrently(raw: LmdbReader) -> None:
    keys = raw.keys()
    expected = {k: decode_datum(v)[0] for k, v in RAW_ITEMS}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            barrier.wait()
            for _ in range(30):
                order = rng.permutation(len(keys))[:8]
                batch = np.empty((8, 3, 32, 40), np.uint8)
                with raw.transaction() as txn:
                    for i, j in enumerate(order):
                        decode_datum_into(txn.get(keys[j]), batch[i])
                for i, j in enumerate(order):
                    assert np.array_equal(batch[i], expected[keys[j]])
                assert raw.get(keys[order[0]]) == RAW_ITEMS[order[0]][1]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_threads_open_and_close_readers_of_one_path() -> None:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                with LmdbReader(RAW) as reader:
                    assert reader.get(RAW_ITEMS[7][0]) == RAW_ITEMS[7][1]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_child_reopens_and_reads(raw: LmdbReader) -> None:
    keys = raw.keys()
    raw.get(keys[0])  # this thread holds a transaction in the parent

    def child() -> bool:
        ok = raw.get(keys[4]) == RAW_ITEMS[4][1]
        ok &= raw._generation == _lmdbenv.REGISTRY.generation
        with raw.transaction() as txn:
            ok &= bytes(txn.get(keys[9])) == RAW_ITEMS[9][1]
        with LmdbReader(RAW) as other:
            ok &= other._shared is raw._shared
        ok &= list(raw.values()) == [v for _, v in RAW_ITEMS]
        raw.close()
        inherited = _lmdbenv.REGISTRY.envs[raw._shared.file_id]
        return ok and inherited.inherited and inherited.env is not None  # kept open

    assert in_forked_child(child) == 0
    assert raw.get(keys[4]) == RAW_ITEMS[4][1]  # the parent is untouched
    assert _lmdbenv.REGISTRY.envs[raw._shared.file_id] is raw._shared


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_inside_a_transaction_and_close_in_child(raw: LmdbReader) -> None:
    key = raw.keys()[3]
    with raw.transaction() as txn:
        txn.get(key)

        def child() -> bool:
            try:
                txn.get(key)
            except StateError:
                pass
            else:
                return False
            raw.close()  # closing an inherited reader opens nothing
            inherited = list(_lmdbenv.REGISTRY.envs.values())
            return raw.closed and all(s.inherited and s.refs == 0 for s in inherited)

        assert in_forked_child(child) == 0
        assert bytes(txn.get(key)) == RAW_ITEMS[3][1]


def _read_in_a_subprocess(path: Path) -> subprocess.CompletedProcess[str]:
    """Open ``path`` with blobpipe and read one batch, in a fresh interpreter: a crash
    (SIGBUS) shows as a negative return code instead of killing the test run."""
    code = (
        "import sys, blobpipe\n"
        "try:\n"
        "    with blobpipe.Batches(sys.argv[1], 4) as b:\n"
        "        next(iter(b))\n"
        "except blobpipe.BlobpipeError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "    sys.exit(3)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60
    )


def test_a_truncated_data_file_is_a_clean_error(tmp_path: Path) -> None:
    """A data.mdb cut short (a copy interrupted) is refused before LMDB maps it: no SIGBUS."""
    path = write_lmdb(tmp_path / "db", RAW_ITEMS[:40])
    data = path / "data.mdb"
    whole = data.read_bytes()
    data.write_bytes(whole[: len(whole) // 2])
    proc = _read_in_a_subprocess(path)
    assert proc.returncode == 3, proc
    assert "DataError" in proc.stdout and "is cut short" in proc.stdout
    assert str(path) in proc.stdout


def test_an_empty_or_odd_data_file_is_a_clean_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.mdb").write_bytes(b"")
    with pytest.raises(DatabaseNotFoundError, match=r"not an LMDB database .*holds 0 bytes"):
        LmdbReader(tmp_path / "empty")
    if hasattr(os, "mkfifo"):
        (tmp_path / "fifo").mkdir()
        os.mkfifo(tmp_path / "fifo" / "data.mdb")  # opening it for reading would hang
        with pytest.raises(DataError, match="is not a regular file"):
            LmdbReader(tmp_path / "fifo")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_closing_releases_every_map_and_descriptor_at_once(tmp_path: Path) -> None:
    """While open: LMDB's map and blobpipe's (for the record index), each with its
    descriptor, and the descriptor the shrink check stats (where the compiled module
    is built); after close(), none, with no garbage collection in between."""
    from blobpipe._io import _lmdbenv
    from blobpipe._io._batches import Batches

    fds_open = 3 if _lmdbenv._file_size is not None else 2

    path = write_lmdb(tmp_path / "db", RAW_ITEMS[:40])
    data = str((path / "data.mdb").resolve())

    def held() -> tuple[int, int]:
        with open("/proc/self/maps") as f:
            maps = sum(line.rstrip().endswith(data) for line in f)
        fds = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                fds += os.readlink(f"/proc/self/fd/{fd}") == data
        return maps, fds

    gc.collect()
    gc.disable()
    try:
        with Batches(path, 4) as b:
            next(iter(b))
            assert b._filler._index is not None  # blobpipe's own map of the file is in use
            assert held() == (2, fds_open)
        assert held() == (0, 0)
        reader = LmdbReader(path)
        reader.get(RAW_ITEMS[0][0])
        assert held() == (2, fds_open)
        reader.close()
        assert held() == (0, 0)
    finally:
        gc.enable()


def test_a_listed_key_that_cannot_be_read_says_the_database_changed(tmp_path: Path) -> None:
    path = write_lmdb(tmp_path / "db", RAW_ITEMS[:10])
    with LmdbReader(path) as reader:
        keys = reader.keys()
        delete = (
            "import sys, lmdb\n"
            "env = lmdb.open(sys.argv[1])\n"
            "with env.begin(write=True) as txn:\n"
            "    txn.delete(bytes.fromhex(sys.argv[2]))\n"
            "env.close()\n"
        )
        subprocess.run([sys.executable, "-c", delete, str(path), keys[3].hex()], check=True)
        errors: list[BaseException] = []

        def read(key: bytes) -> None:  # a new thread: a read transaction of its own
            try:
                reader.get(key)
            except BaseException as exc:
                errors.append(exc)

        for key in (keys[3], b"not-a-key"):
            thread = threading.Thread(target=read, args=(key,))
            thread.start()
            thread.join()
    assert [type(e) for e in errors] == [RecordNotFoundError, RecordNotFoundError]
    assert "listed but cannot be read now: the database was changed since it was opened (" in (
        str(errors[0])
    )
    assert "no record under this key; list" in str(errors[1])
    with LmdbReader(path) as reader:  # unchanged since opened: only damage explains a miss
        missed = reader._missing(reader.keys()[0])
    assert "has not changed since it was opened: its B-tree is damaged" in str(missed)


def test_a_dupsort_database_is_refused_not_read_by_key(tmp_path: Path) -> None:
    """Reading a DUPSORT database's keys, then each by key, gives the first duplicate
    twice (labels 0,0,2,2,...; LMDB's cursor gives 0-7): it is refused, clearly."""
    import blobpipe

    items = [(key(i // 2), blobpipe.encode_raw_datum(image(i), i)) for i in range(8)]
    path = dupsort_db(tmp_path / "dup", items)
    labels = [blobpipe.parse_datum(v).label for _, v in lmdb_items(path)]
    assert sorted(labels) == list(range(8))  # a real DUPSORT database: LMDB reads 8 records
    refused = r"not a database blobpipe reads: .*sorted duplicates \(flags 0x4: MDB_DUPSORT\)"
    with pytest.raises(DataError, match=refused) as info:
        LmdbReader(path)
    assert str(path) in str(info.value)
    with pytest.raises(DataError, match=refused), blobpipe.Batches(path, 8, mode="epoch") as b:
        next(iter(b))


def test_records_in_a_named_sub_database_are_refused_at_open(tmp_path: Path) -> None:
    """The reader refuses it when opened, so every way in (datums, inspect, Batches)
    says the records sit in a named sub-database, not "not a valid caffe.Datum: field
    number 0"."""
    path = tmp_path / "named"
    with open_lmdb(path, max_dbs=2) as env:
        sub = env.open_db(b"train")
        with env.begin(write=True, db=sub) as txn:
            txn.put(b"00000000", b"")
    with pytest.raises(DataError, match=r"named sub-databases \(b'train'\), not records"):
        LmdbReader(path)


def test_a_branch_key_that_misleads_lookups_is_refused_at_open(tmp_path: Path) -> None:
    """A branch key raised past its child's first key (still in order in its page):
    LMDB's cursor lists that record, its key lookup cannot find it. Refused when
    opened, naming the page, rather than a "listed but cannot be read" later."""
    from blobpipe._io._lmdbfile import picked_meta
    from tests._helpers import raw_db

    path = raw_db(tmp_path / "db", 200)
    data = bytearray((path / "data.mdb").read_bytes())
    psize = int.from_bytes(data[40:44], "little")
    ids = [int.from_bytes(data[m + 144 : m + 152], "little") for m in (0, psize)]
    meta = psize * picked_meta(*ids)
    root = int.from_bytes(data[meta + 128 : meta + 136], "little")
    assert data[root * psize + 10] & 0x01  # a branch page: the root of a two-level tree
    ptr = int.from_bytes(data[root * psize + 20 : root * psize + 22], "little")  # node 2
    ksize = int.from_bytes(data[root * psize + ptr + 6 : root * psize + ptr + 8], "little")
    at = root * psize + ptr + 8
    separator = bytes(data[at : at + ksize])
    data[at + ksize - 1] += 1  # "00000036" -> "00000037": 36 now routes left, not found
    (path / "data.mdb").write_bytes(data)
    assert separator in [k for k, _ in lmdb_items(path)]
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            assert txn.get(separator) is None  # LMDB's lookup misses a listed record
    finally:
        env.close()
    with pytest.raises(
        DataError, match=rf"a branch key that does not separate its children \(page {root}\)"
    ):
        LmdbReader(path)


def test_key_comparison_is_byte_order() -> None:
    """The page walker's vectorised key comparison agrees with bytes' own order,
    zero bytes and prefixes included (keys here are short and mostly 0, 1, 2)."""
    from blobpipe._io._lmdbfile import _compare

    rng = np.random.default_rng(0)
    for _ in range(100):
        keys = [bytes(rng.integers(0, 3, rng.integers(1, 6)).astype(np.uint8)) for _ in range(80)]
        file = np.frombuffer(b"".join(keys), np.uint8)
        sizes = np.array([len(k) for k in keys], np.int64)
        offsets = np.cumsum(sizes) - sizes
        got = _compare(file, offsets[:40], sizes[:40], offsets[40:], sizes[40:])
        want = [(a > b) - (a < b) for a, b in zip(keys[:40], keys[40:], strict=True)]
        assert got.tolist() == want
