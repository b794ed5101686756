"""Fuzzing the edges of the newest features: the index cache directory, shard arguments
and resume states (the compiled entry points are fuzzed in ``test_c_boundary.py``).

The properties: an open of a database gives its records, whatever else holds the
cache directory's names (a file of any type, a link anywhere, another user's file,
loose permissions, another process replacing them meanwhile), never waits, and
creates nothing outside the cache directory; every rank of a sharded epoch has the
same number of records (padded modes) and every record is read once per epoch (as
each mode promises); a resume state with any field changed is refused with an error
naming it, or resumes where the state says. Every test is derandomized and bounded
(the file takes about ten seconds).
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blobpipe import Batches, LmdbReader
from blobpipe._errors import ArgumentError, ArgumentTypeError, DataError
from blobpipe._io import _indexcache
from blobpipe._io._order import MAX_WORLD, EpochOrder
from blobpipe._io._resume import CURSOR
from tests._helpers import raw_db, write_lmdb

_FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def fuzz(examples: int) -> settings:
    """Derandomized, without an example database, ``examples`` examples."""
    return settings(_FUZZ, max_examples=examples)


# -- the cache directory ------------------------------------------------------------------------

# What may hold the index's name or its lock's: each made by _plant.
KINDS = [
    "absent", "garbage", "empty", "other index", "loose file", "fifo", "socket", "directory",
    "dangling link", "link to a file", "link to a fifo", "link to /dev/zero", "hard link",
    "another user's file", "device",
]  # fmt: skip
ROOT_ONLY = {"another user's file", "device"}
# Cache directory modes: private, readable, or writable by group or others (sticky or not).
MODES = [0o700, 0o755, 0o711, 0o750, 0o770, 0o777, 0o1777, 0o702]


def _plant(path: str, kind: str, outside: Path, other_index: bytes) -> None:
    """Make ``path`` a ``kind`` (KINDS); links point into ``outside``."""
    if kind == "absent":
        return
    if kind == "garbage":
        Path(path).write_bytes(b"BPINDEX1" + os.urandom(200))
    elif kind == "empty":
        Path(path).write_bytes(b"")
    elif kind == "other index":
        Path(path).write_bytes(other_index)
    elif kind == "loose file":
        Path(path).write_bytes(b"")
        os.chmod(path, 0o666)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        os.mknod(path, 0o600 | stat.S_IFSOCK)
    elif kind == "directory":
        os.mkdir(path)
        Path(path, "inside").write_bytes(b"x")
    elif kind == "dangling link":
        os.symlink(outside / "created-through-a-link", path)
    elif kind == "link to a file":
        os.symlink(outside / "victim", path)
    elif kind == "link to a fifo":
        os.symlink(outside / "fifo", path)
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "hard link":
        os.link(outside / "victim", path)
    elif kind == "another user's file":
        Path(path).write_bytes(other_index)
        os.chown(path, 12345, 12345)
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's
    else:
        raise AssertionError(kind)


def _outside(folder: Path) -> dict[str, Any]:
    """What lies outside the cache directory, to show that nothing there changed."""
    return {p.name: (p.lstat().st_mode, p.read_bytes() if p.is_file() else b"") for p in
            folder.iterdir()}  # fmt: skip


@pytest.fixture(scope="module")
def cache_db(tmp_path_factory: pytest.TempPathFactory) -> CacheDb:
    """A database, its keys, its last value, and the index of another database (a
    well-formed index of another snapshot)."""
    root = tmp_path_factory.mktemp("cache_db")
    db = raw_db(root / "db", 25, shape=(1, 2, 3))
    with LmdbReader(db, index=None) as r:
        keys = list(r.keys())
        last = bytes(r.get(keys[-1]))
    other = write_lmdb(root / "other", ((b"k%02d" % i, b"v") for i in range(25)))
    with LmdbReader(other, index="beside"):
        pass
    return CacheDb(db, keys, last, Path(other, "data.mdb.blobpipe-index").read_bytes())


class CacheDb(NamedTuple):
    db: Path
    keys: list[bytes]
    last: bytes
    other_index: bytes


def _index_in(folder: Path, db: Path) -> str:
    """Where the index of ``db`` lives with ``folder`` as the cache directory."""
    name = os.path.basename(str(_indexcache.index_path(str(db / "data.mdb"), "cache")))
    return os.path.join(folder, name)


@fuzz(60)
@given(
    index_kind=st.sampled_from(KINDS),
    lock_kind=st.sampled_from(KINDS),
    mode=st.sampled_from(MODES),
)
def test_the_cache_directory_holding_anything_never_stalls_or_misleads_an_open(
    tmp_path_factory: pytest.TempPathFactory,
    cache_db: CacheDb,
    index_kind: str,
    lock_kind: str,
    mode: int,
) -> None:
    root = os.geteuid() == 0
    if not root and (index_kind in ROOT_ONLY or lock_kind in ROOT_ONLY):
        return
    db, keys, last, other_index = cache_db
    base = tmp_path_factory.mktemp("cache")
    outside = base / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    os.mkfifo(outside / "fifo")
    folder = base / "cache"
    folder.mkdir(mode=0o700)
    path = _index_in(folder, db)
    _plant(path, index_kind, outside, other_index)
    _plant(path + ".lock", lock_kind, outside, other_index)
    folder.chmod(mode)
    before = _outside(outside)
    names_before = sorted(os.listdir(folder))
    safe = not mode & 0o022
    old = os.environ.get("BLOBPIPE_CACHE_DIR")
    os.environ["BLOBPIPE_CACHE_DIR"] = str(folder)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # the second open reads what the first wrote, if anything
                started = time.monotonic()
                with LmdbReader(db) as r:
                    assert list(r.keys()) == keys
                    assert r.get(keys[-1]) == last
                assert time.monotonic() - started < 10, "an open waited"
    finally:
        if old is None:
            del os.environ["BLOBPIPE_CACHE_DIR"]
        else:
            os.environ["BLOBPIPE_CACHE_DIR"] = old
        folder.chmod(0o700)
    assert _outside(outside) == before, "something outside the cache directory changed"
    assert not (outside / "created-through-a-link").exists()
    messages = [str(w.message) for w in caught]
    assert all(w.category is RuntimeWarning for w in caught), messages
    assert all(m.startswith("blobpipe does not ") for m in messages), messages
    if not safe:
        assert any(str(folder) in m and "writable by" in m for m in messages), messages
        assert sorted(os.listdir(folder)) == names_before  # nothing written there
        return
    lock_ok = lock_kind in ("absent", "garbage", "empty", "other index", "hard link")
    if not lock_ok:
        assert any(".lock" in m for m in messages), messages
    if lock_ok and index_kind != "directory":
        st_index = os.lstat(path)  # written (replacing whatever held its name), ours
        assert stat.S_ISREG(st_index.st_mode) and st_index.st_uid == os.geteuid()
        assert not st_index.st_mode & 0o077


_RACER = """
import os, sys, time
from blobpipe import LmdbReader

db, expected, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + seconds
opens = 0
while time.monotonic() < deadline:
    with LmdbReader(db) as r:
        assert len(r) == expected and r.get(r.keys()[-1]) is not None
    opens += 1
print(opens)
"""


def _mutate(path: str, outside: Path, other_index: bytes, stop: Path) -> int:
    """Replace the index's and the lock's names with FIFOs, links, garbage, nothing,
    one after another, until ``stop`` exists (a forked child; returns how many times)."""
    rng = np.random.default_rng(7)
    kinds = [k for k in KINDS if k not in ROOT_ONLY and k != "directory"]
    deadline = time.monotonic() + 60
    changes = 0
    while not stop.exists() and time.monotonic() < deadline:
        name = path if rng.random() < 0.5 else path + ".lock"
        tmp = f"{name}.mutating"
        try:
            # (rename() leaves tmp in place where both names link the same file)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            _plant(tmp, str(rng.choice(kinds)), outside, other_index)
            if os.path.lexists(tmp):
                os.replace(tmp, name)
            else:
                os.unlink(name)
        except OSError:
            pass
        changes += 1
        time.sleep(0.001)
    return changes


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_two_processes_opening_while_the_names_are_swapped_underneath(
    tmp_path: Path, cache_db: CacheDb
) -> None:
    """Two processes open the database over and over while a third swaps the index's
    and the lock's names for FIFOs, links and garbage: every open gives the records,
    none waits, nothing outside the cache directory is touched. (The swapper writes
    as this user: what a private cache directory still allows.)"""
    db, keys, _, other_index = cache_db
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    os.mkfifo(outside / "fifo")
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    path = _index_in(folder, db)
    stop = tmp_path / "stop"
    env = {**os.environ, "BLOBPIPE_CACHE_DIR": str(folder), "PYTHONWARNINGS": "ignore"}
    seconds = 1.5
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(db), str(len(keys)), str(seconds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=Path(__file__).parent.parent,
        )
        for _ in range(2)
    ]
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the swapper
        code = 1
        try:
            code = 0 if _mutate(path, outside, other_index, stop) else 2
        finally:
            os._exit(code)
    try:
        outputs = [p.communicate(timeout=60) for p in racers]
    finally:
        stop.touch()
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    for p, (out, err) in zip(racers, outputs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert int(out) >= 2, out
    assert not (outside / "created-through-a-link").exists()
    assert (outside / "victim").read_bytes() == b"precious"
    assert stat.S_ISFIFO((outside / "fifo").lstat().st_mode)


# -- shard arguments ----------------------------------------------------------------------------


@st.composite
def _shards(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 300))
    mode = draw(st.sampled_from(["strided", "contiguous", "node"]))
    per_node = draw(st.integers(1, 4)) if mode == "node" else 1
    world = per_node * draw(st.integers(1, 8)) if mode == "node" else draw(st.integers(1, 24))
    order = draw(st.sampled_from(["key", "shuffle", "buffer", "quasi"]))
    return {
        "n": n, "world": world, "shard_mode": mode, "ranks_per_node": per_node,
        "order": order, "buffer_size": draw(st.integers(1, 64)) if order in ("buffer", "quasi")
        else None, "pad_shards": draw(st.sampled_from([True, False, "drop"])),
        "seed": draw(st.integers(0, 2**32)),
    }  # fmt: skip


@fuzz(150)
@given(_shards())
def test_every_rank_reads_as_many_records_and_every_record_is_read_once(a: dict[str, Any]) -> None:
    """Over ranks, worlds, node sizes, database sizes and orders: with padding every
    rank reads ceil(n / world) records (floor with "drop"), so DDP's ranks have as
    many batches; every record is read at least once (True), exactly once (False), at
    most once ("drop")."""
    n, world, pad = a["n"], a["world"], a["pad_shards"]
    for epoch in (0, 1):
        shards = [
            EpochOrder(
                n, a["order"], a["buffer_size"], a["seed"], (rank, world), a["shard_mode"], pad,
                a["ranks_per_node"],
            ).order(epoch).tolist()
            for rank in range(world)
        ]  # fmt: skip
        lengths = {len(s) for s in shards}
        counts = Counter(i for s in shards for i in s)
        assert set(counts) <= set(range(n))
        if world == 1:
            assert sorted(shards[0]) == list(range(n))
        elif pad is True:
            assert lengths == {-(-n // world)} and set(counts) == set(range(n))
        elif pad == "drop":
            assert lengths == {n // world} and max(counts.values(), default=1) == 1
        else:
            assert counts == Counter(range(n)) and max(lengths) - min(lengths) <= 1


@pytest.fixture(scope="module")
def db40(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return raw_db(tmp_path_factory.mktemp("db40") / "db", 40, shape=(1, 2, 2))


@fuzz(25)
@given(
    n=st.integers(1, 40),
    world=st.integers(1, 9),
    per_node=st.integers(1, 3),
    batch=st.integers(1, 7),
    pad=st.sampled_from([True, "drop"]),
)
def test_sharded_loaders_have_as_many_batches_on_every_rank(
    tmp_path_factory: pytest.TempPathFactory, n: int, world: int, per_node: int, batch: int,
    pad: Any,
) -> None:  # fmt: skip
    """Through Batches, in node mode (the one that failed): the same len() and the same
    batches read on every rank, or the same DataError on every rank (no records at all:
    "drop" with fewer records than ranks)."""
    world *= per_node
    db = raw_db(tmp_path_factory.mktemp("db") / "db", n, shape=(1, 1, 1))
    outcomes = []
    for rank in range(world):
        try:
            with Batches(
                db, batch, shard=(rank, world), shard_mode="node", ranks_per_node=per_node,
                pad_shards=pad, mode="epoch", order="shuffle",
            ) as b:  # fmt: skip
                read = sum(1 for _ in b)
                outcomes.append((len(b), read))
        except DataError as exc:
            outcomes.append(("refused", str(exc).split(";")[0].replace(f"rank {rank} ", "")))
    assert len(set(outcomes)) == 1, outcomes


_ANY = (
    st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, 2, 3, 2**31 - 1, 2**31, 2**40, 2**63 - 1, -1])
    | st.floats(allow_nan=True)
    | st.booleans()
    | st.none()
    | st.text(max_size=3)
    | st.builds(np.int64, st.integers(-(2**63), 2**63 - 1))
    | st.builds(np.float32, st.floats(width=32))
)


@fuzz(200)
@given(rank=_ANY, world=_ANY, per_node=_ANY | st.just("unset"), node=st.booleans())
def test_any_rank_world_and_node_size_is_taken_or_refused_as_an_argument(
    db40: Path, rank: Any, world: Any, per_node: Any, node: bool
) -> None:
    """Never truncated, never a MemoryError or OverflowError: an integer in bounds, or
    a TypeError for another type, or a ValueError for a value out of bounds."""
    options: dict[str, Any] = {"shard": (rank, world), "mode": "epoch"}
    if node:
        options["shard_mode"] = "node"
        options["ranks_per_node"] = (
            1 if isinstance(per_node, str) and per_node == "unset" else per_node
        )
    error: Exception | None = None
    try:
        with Batches(db40, 4, **options) as b:
            shard, per_epoch = b.shard, b.records_per_epoch
    except (ArgumentTypeError, ArgumentError) as exc:
        error = exc
    if isinstance(error, ArgumentTypeError):
        assert "must be an integer" in str(error)
    elif error is not None:
        assert "shard" in str(error) or "ranks_per_node" in str(error), error
        assert not isinstance(rank, float | bool | np.floating)
    else:
        assert shard == (rank, world) and all(type(x) is int for x in shard)
        assert 0 <= shard[0] < shard[1] <= MAX_WORLD
        assert not isinstance(rank, bool | float | np.floating)
        assert per_epoch == -(-40 // shard[1])


# -- resume states ------------------------------------------------------------------------------

_STATE_OPTIONS = [
    {},
    {"order": "shuffle", "seed": 3, "shard": (1, 2)},
    {"order": "quasi", "buffer_size": 8, "shard": (2, 3), "shard_mode": "contiguous",
     "pad_shards": "drop"},
    {"order": "buffer", "buffer_size": 5, "shard": (3, 4), "shard_mode": "node",
     "ranks_per_node": 2},
    {"order": "key", "shard": (0, 4), "shard_mode": "node", "ranks_per_node": 4,
     "pad_shards": False},
]  # fmt: skip

_FIELD_VALUES = (
    _ANY
    | st.sampled_from(["key", "shuffle", "buffer", "quasi", "strided", "contiguous", "node"])
    | st.sampled_from(["drop", True, False, None])
    | st.lists(st.integers(-1, 5), max_size=3)
    | st.binary(max_size=12)
    | st.text(max_size=12)
)


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` may stand for ``b`` in a state: equal, an int for an int (NumPy's
    too), a bool for a bool; no float for an int."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    kinds = [
        "bool" if isinstance(x, bool | np.bool_) else "int" if isinstance(x, int | np.integer)
        else type(x).__name__
        for x in (a, b)
    ]  # fmt: skip
    return kinds[0] == kinds[1] and bool(a == b)


@fuzz(250)
@given(options=st.sampled_from(_STATE_OPTIONS), data=st.data(), skip=st.integers(0, 25))
def test_a_state_with_any_field_changed_is_refused_or_resumes_where_it_says(
    db40: Path, options: dict[str, Any], data: st.DataObject, skip: int
) -> None:
    """Fields taken from state_dict() (so a new one is fuzzed too), one to three
    changed or dropped: refused with an error naming the problem, or (only where the
    change cannot matter, or the cursor moved to a position holding the state's
    key) the stream resumes at a position whose record is the state's key."""
    with Batches(db40, 1, mode="epoch", **options) as b:
        it = iter(b)
        for _ in range(skip % b.records_per_epoch):
            next(it)
        state = b.state_dict()
        fields = sorted(state)
        changed = dict(state)
        for name in data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3)):
            if data.draw(st.booleans()):
                changed.pop(name, None)
            else:
                changed[name] = data.draw(_FIELD_VALUES)
        refused = ""
        try:
            b.load_state_dict(changed)
        except (ArgumentError, ArgumentTypeError, DataError) as exc:
            refused = str(exc) or f"{type(exc).__name__} without a message"
        if refused:
            assert "without a message" not in refused
            return
        settled = b.state_dict()
        for name in set(state) - set(CURSOR):
            if name == "pad_shards" and (b.shard[1] == 1 or name not in changed):
                continue  # unsharded it changes nothing; absent, the older default
            assert name in changed and _same(changed[name], state[name]), (name, changed)
        key = changed["key"]
        key = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else key
        assert settled["epoch"] == changed["epoch"] and settled["position"] == changed["position"]
        order = b.epoch_order(settled["epoch"])
        with LmdbReader(db40, index=None) as r:
            assert r.keys()[int(order[settled["position"]])] == key
        assert next(iter(b)).keys == [key]
