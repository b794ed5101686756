"""The persistent index of an LMDB (``_io/_indexcache.py``) and the packed keys.

The index is used only for the exact snapshot it was built from (a commit, a
replaced file, a damaged or cut index: rebuilt), is shared by processes opening the
database at once (one walks, the others read what it wrote), and a process killed
while writing it leaves no index that is trusted.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import blobpipe
from blobpipe import LmdbReader
from blobpipe._io import _indexcache
from blobpipe._io._keys import PackedKeys
from tests._helpers import key, open_lmdb, raw_db, run_script, write_lmdb


def data_file(db: Path) -> str:
    return str(db / "data.mdb")


def walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the B-tree walks of this process (each call appends 1)."""
    calls: list[int] = []
    real = _indexcache.read_tree

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_indexcache, "read_tree", counted)
    return calls


def read_all(db: Path, **kwargs: Any) -> tuple[list[bytes], list[bytes]]:
    with LmdbReader(db, **kwargs) as r:
        keys = list(r.keys())
        return keys, [r.get(k) for k in keys]


def test_the_second_open_reads_the_index_not_the_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = raw_db(tmp_path / "db", 300)
    calls = walks(monkeypatch)
    first = read_all(db)
    assert calls == [1]
    path = _indexcache.index_path(data_file(db), "cache")
    assert path is not None and os.path.exists(path)
    assert path.startswith(os.environ["BLOBPIPE_CACHE_DIR"])
    assert read_all(db) == first
    assert calls == [1]  # no walk: the index of this snapshot was read


def test_the_index_is_rebuilt_after_any_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = raw_db(tmp_path / "db", 50)
    calls = walks(monkeypatch)
    read_all(db)
    with open_lmdb(db) as env, env.begin(write=True) as txn:  # a commit that adds a key
        txn.put(key(50), blobpipe.encode_raw_datum(np.zeros((3, 10, 12), np.uint8), 7))
    keys, _ = read_all(db)
    assert len(calls) == 2 and keys[-1] == key(50) and len(keys) == 51
    with open_lmdb(db) as env, env.begin(write=True) as txn:  # one that only replaces a value
        txn.put(key(3), b"x" * 40)
    keys, values = read_all(db)
    assert len(calls) == 3 and values[3] == b"x" * 40
    read_all(db)
    assert len(calls) == 3


def test_an_index_of_another_snapshot_or_damaged_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = raw_db(tmp_path / "a", 40)
    b = write_lmdb(tmp_path / "b", ((key(i), b"v" * (i + 1)) for i in range(40)))
    calls = walks(monkeypatch)
    read_all(a)
    read_all(b)
    pa = _indexcache.index_path(data_file(a), "cache")
    pb = _indexcache.index_path(data_file(b), "cache")
    assert pa is not None and pb is not None
    expected = read_all(b)
    assert len(calls) == 2
    os.replace(pa, pb)  # a's index where b's belongs: another file, another snapshot
    assert read_all(b) == expected
    assert len(calls) == 3
    good = Path(pb).read_bytes()
    mid = 112 + 40 * 8 + 4  # in the second value length (after the header and offsets)
    for damage in (
        good[: len(good) // 2],  # cut short
        good[:mid] + bytes([good[mid] ^ 1]) + good[mid + 1 :],  # a flipped bit: the checksum
        good[:-8] + b"BADMAGIC",  # another footer
    ):
        Path(pb).write_bytes(damage)
        before = len(calls)
        assert read_all(b) == expected
        assert len(calls) == before + 1  # walked again, and stored a good one
        assert Path(pb).read_bytes() == good


def test_a_damaged_database_is_refused_with_an_index_present(tmp_path: Path) -> None:
    db = raw_db(tmp_path / "db", 200)
    read_all(db)
    raw = bytearray(Path(data_file(db)).read_bytes())
    psize = int.from_bytes(raw[40:44], "little")
    with LmdbReader(db, index=None) as r:
        assert len(r) == 200
    # the root page's header names another page number
    meta = 0 if int.from_bytes(raw[144:152], "little") >= int.from_bytes(
        raw[psize + 144 : psize + 152], "little"
    ) else psize  # fmt: skip
    root = int.from_bytes(raw[meta + 128 : meta + 136], "little")
    raw[root * psize] ^= 0xFF
    time.sleep(0.01)
    Path(data_file(db)).write_bytes(bytes(raw))
    with pytest.raises(blobpipe.DataError, match="damaged"):
        LmdbReader(db)


@pytest.mark.parametrize("place", ["beside", None])
def test_index_places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, place: Any) -> None:
    db = raw_db(tmp_path / "db", 30)
    calls = walks(monkeypatch)
    expected = read_all(db, index=place)
    assert read_all(db, index=place) == expected
    beside = Path(data_file(db) + ".blobpipe-index")
    if place == "beside":
        assert beside.exists() and calls == [1]
    else:
        assert not beside.exists() and calls == [1, 1]
        assert _indexcache.load(
            str(_indexcache.index_path(data_file(db), "cache")), _snapshot(db)
        ) is None  # fmt: skip
    with pytest.raises(ValueError, match="index must be"):
        LmdbReader(db, index="near")  # type: ignore[arg-type]


def _snapshot(db: Path) -> _indexcache.Snapshot:
    raw = np.fromfile(data_file(db), np.uint8)
    meta = _indexcache.meta_of(raw)
    assert meta is not None
    return _indexcache.snapshot_of(os.stat(data_file(db)), meta)


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOBPIPE_CACHE_DIR", "/somewhere/own")
    assert _indexcache.cache_dir() == "/somewhere/own"
    monkeypatch.delenv("BLOBPIPE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert _indexcache.cache_dir() == "/xdg/blobpipe"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: ignored, as XDG says
    monkeypatch.setenv("HOME", "/home/u")
    assert _indexcache.cache_dir() == "/home/u/.cache/blobpipe"


def test_an_unwritable_cache_still_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = raw_db(tmp_path / "db", 20)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("BLOBPIPE_CACHE_DIR", str(blocker / "cache"))
    calls = walks(monkeypatch)
    assert len(read_all(db)[0]) == 20
    assert len(read_all(db)[0]) == 20
    assert calls == [1, 1]


def _child_open(db: Path, marks: Path, expected: list[bytes]) -> int:
    """Open ``db`` in this (forked) process; leave a mark file per walk."""
    real = _indexcache.read_tree

    def slow(*args: Any, **kwargs: Any) -> Any:
        (marks / f"walk-{os.getpid()}").touch()
        time.sleep(0.2)  # the others reach the lock meanwhile
        return real(*args, **kwargs)

    _indexcache.read_tree = slow  # type: ignore[assignment]
    with LmdbReader(db) as r:
        return 0 if list(r.keys()) == expected else 3


def fork(fn: Any) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    return pid


def test_concurrent_opens_share_one_index(tmp_path: Path) -> None:
    db = raw_db(tmp_path / "db", 400)
    with LmdbReader(db, index=None) as r:
        expected = list(r.keys())
    marks = tmp_path / "marks"
    marks.mkdir()
    pids = [fork(lambda: _child_open(db, marks, expected)) for _ in range(6)]
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    assert codes == [0] * 6
    assert len(list(marks.iterdir())) == 1  # one walked; five waited and read its index
    path = _indexcache.index_path(data_file(db), "cache")
    assert path is not None
    tree = _indexcache.load(path, _snapshot(db))
    assert tree is not None and list(tree.keys) == expected


def test_killed_while_writing_leaves_no_trusted_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = raw_db(tmp_path / "db", 300)
    path = _indexcache.index_path(data_file(db), "cache")
    assert path is not None

    def killed_at_fsync() -> int:
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment]
        LmdbReader(db)
        return 0

    pid = fork(killed_at_fsync)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert code == -signal.SIGKILL
    assert not os.path.exists(path)  # only a temporary file, never renamed
    leftovers = [p for p in os.listdir(os.path.dirname(path)) if p.endswith(".tmp")]
    assert leftovers
    calls = walks(monkeypatch)
    expected = read_all(db)
    assert calls == [1] and os.path.exists(path)
    assert read_all(db) == expected and calls == [1]


@settings(max_examples=60, deadline=None)
@given(st.sets(st.binary(min_size=1, max_size=12), max_size=40), st.binary(max_size=12))
def test_packed_keys_behave_as_the_tuple(keys: set[bytes], probe: bytes) -> None:
    ordered = tuple(sorted(keys))
    packed = PackedKeys.of(ordered)
    assert len(packed) == len(ordered)
    assert tuple(packed) == ordered and packed == ordered
    assert [packed[i] for i in range(-len(ordered), len(ordered))] == list(ordered * 2)
    assert packed[1:5] == ordered[1:5]
    assert (probe in packed) == (probe in ordered)
    if probe in ordered:
        assert packed.index(probe) == ordered.index(probe)
    else:
        with pytest.raises(ValueError, match="not among"):
            packed.index(probe)
    with pytest.raises(IndexError):
        packed[len(ordered)]
    assert PackedKeys.of(ordered) == packed
    picks = [i % len(ordered) for i in range(0, 7 * len(ordered), 3)] if ordered else []
    mapped = PackedKeys(np.frombuffer(bytes(packed.buffer), np.uint8), packed.ends)
    for each in (packed, mapped):  # the joined keys as bytes, and as a mapped array
        if picks:
            assert each.take(picks) == tuple(ordered[i] for i in picks)


# -- the cache directory: only regular files, only a private directory ---------------------------

_OPEN_AND_COUNT = """
    import sys
    from blobpipe import LmdbReader

    with LmdbReader(sys.argv[1]) as r:
        print(len(r))
"""


def _open_in_a_child(db: Path) -> str:
    """The record count an open of ``db`` in a fresh interpreter prints; a hang fails
    the test after 20 seconds instead of stalling the run."""
    try:
        done = run_script(_OPEN_AND_COUNT, str(db), timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"opening {db} hung (over 20 s)")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo()")
def test_a_fifo_at_the_index_path_is_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO where the index belongs (its name is predictable) would block an open
    for reading until a writer came: it is not opened as an index, and the index
    written after the walk replaces it."""
    db = raw_db(tmp_path / "db", 20)
    path = _indexcache.index_path(data_file(db), "cache")
    assert path is not None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    assert _open_in_a_child(db) == "20"
    assert stat.S_ISREG(os.lstat(path).st_mode)
    calls = walks(monkeypatch)
    assert len(read_all(db)[0]) == 20 and calls == []  # the index replaced the FIFO


def test_a_lock_file_that_is_a_link_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``<index>.lock`` as a link to a path that does not exist: nothing is created where
    it points (as root, that could be any path); the open walks the tree, and a warning
    names the link and says to remove it."""
    db = raw_db(tmp_path / "db", 20)
    path = _indexcache.index_path(data_file(db), "cache")
    assert path is not None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    target = tmp_path / "nologin"
    os.symlink(target, path + ".lock")
    calls = walks(monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"\.index\.lock' is not a regular file.*remove it"):
        assert len(read_all(db)[0]) == 20
    assert not target.exists() and not os.path.lexists(path)  # no lock: nothing stored
    os.unlink(path + ".lock")
    assert len(read_all(db)[0]) == 20
    assert calls == [1, 1] and os.path.exists(path)


def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int) -> Path:
    """A cache directory of ``mode`` in a private folder, as ``$BLOBPIPE_CACHE_DIR``."""
    folder = tmp_path / "cache"
    folder.mkdir()
    folder.chmod(mode)
    monkeypatch.setenv("BLOBPIPE_CACHE_DIR", str(folder))
    return folder


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o702])
def test_a_cache_directory_others_can_write_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    """Anyone who can write to the cache directory could put a forged index in it, a
    FIFO, or a lock held forever: a directory writable by group or others (sticky or
    not) is not used, with a warning that names it and says how to fix it."""
    db = raw_db(tmp_path / "db", 20)
    folder = _cache(tmp_path, monkeypatch, 0o700)
    calls = walks(monkeypatch)
    expected = read_all(db)
    assert len(os.listdir(folder)) == 2  # the index and its lock
    folder.chmod(mode)
    warning = rf"'{folder}' is writable by (group|others).*chmod go-w"
    with pytest.warns(RuntimeWarning, match=warning):
        assert read_all(db) == expected
    assert read_all(db) == expected  # warned once a process; walked each time
    assert calls == [1, 1, 1]


def test_a_cache_directory_under_a_directory_others_can_write_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the cache directory, a directory others can write (and not sticky, as
    ``/tmp`` is) lets them rename the cache directory away and put theirs instead."""
    db = raw_db(tmp_path / "db", 20)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "cache").mkdir(mode=0o700)
    monkeypatch.setenv("BLOBPIPE_CACHE_DIR", str(shared / "cache"))
    calls = walks(monkeypatch)
    shared.chmod(0o777)
    warning = rf"'{shared}', is writable by group and others and not sticky"
    with pytest.warns(RuntimeWarning, match=warning):
        read_all(db)
    assert os.listdir(shared / "cache") == []
    shared.chmod(0o1777)  # sticky: others cannot rename or remove what is not theirs
    read_all(db)
    read_all(db)
    assert calls == [1, 1] and len(os.listdir(shared / "cache")) == 2


def test_a_missing_cache_directory_is_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = raw_db(tmp_path / "db", 20)
    folder = tmp_path / "new" / "cache"
    monkeypatch.setenv("BLOBPIPE_CACHE_DIR", str(folder))
    read_all(db)
    assert stat.S_IMODE(folder.stat().st_mode) & 0o077 == 0
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in folder.iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to give files to another user)")
def test_a_cache_directory_or_index_of_another_user_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run as root with another user's cache directory (``sudo`` keeping ``$HOME``):
    that user could have put anything there; an index file in our own directory that
    another user owns is not trusted either (it is rebuilt and replaced)."""
    db = raw_db(tmp_path / "db", 20)
    folder = _cache(tmp_path, monkeypatch, 0o700)
    calls = walks(monkeypatch)
    expected = read_all(db)
    path = _indexcache.index_path(data_file(db), "cache")
    assert path is not None
    os.chown(path, 12345, 12345)
    assert read_all(db) == expected
    assert calls == [1, 1] and os.stat(path).st_uid == 0  # replaced by our own
    os.chown(folder, 12345, 12345)
    with pytest.warns(RuntimeWarning, match=rf"'{folder}' is owned by uid 12345"):
        assert read_all(db) == expected
    assert calls == [1, 1, 1]


def test_a_data_file_rewritten_in_place_with_its_mtime_restored_is_walked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another database of the same size, transaction, root page and entry count copied
    over the data file in place (same inode), its modification time set back: the
    index's snapshot also holds the file's change time, which no one can set back."""
    a = write_lmdb(tmp_path / "a", ((b"a%03d" % i, b"v" * 30) for i in range(40)))
    b = write_lmdb(tmp_path / "b", ((b"b%03d" % i, b"v" * 30) for i in range(40)))
    assert read_all(a)[0][0] == b"a000"
    before = os.stat(data_file(a))
    assert before.st_size == os.stat(data_file(b)).st_size
    time.sleep(0.05)  # past the file system's clock tick
    with open(data_file(a), "r+b") as f:
        f.write(Path(data_file(b)).read_bytes())
    os.utime(data_file(a), ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(data_file(a))
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns
    )  # fmt: skip
    calls = walks(monkeypatch)
    keys, _ = read_all(a)
    assert keys[0] == b"b000" and calls == [1]
