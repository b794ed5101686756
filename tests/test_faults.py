"""Fault injection: seeded byte flips over a small database, each read in a worker process;
a database cut short and rewritten in place while it is read; fork while threads read.

Every flip's copy is read twice, by py-lmdb's own cursor and by one epoch of
:class:`blobpipe.Batches`, each in worker processes (``tests/_faults.py``) that
report one line per flip; a worker that dies or hangs is replaced and the flip it
was on re-run alone. blobpipe must give LMDB's data exactly or a clean
:class:`~blobpipe.BlobpipeError` naming the copy: never a signal, a hang, another
exception, or a batch that differs from what LMDB's cursor reads.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import blobpipe
from tests._faults import Flip, run_flips
from tests._helpers import lmdb_stat, run_script, write_lmdb

FLIPS = {"meta": 60, "branch": 120, "leaf": 140, "value": 80}  # 400 in all


def build(path: Path) -> Path:
    """300 raw Datums under keys of 18 to 408 bytes (a tree of three levels); one in
    seven holds a 3x40x44 image, larger than a page (overflow pages), the others a
    3x10x12 one, stored in the leaf."""
    rng = np.random.default_rng(5)
    items = []
    for i in range(300):
        key = f"{i:08d}_".encode() + b"k" * int(rng.integers(10, 400))
        shape = (3, 40, 44) if i % 7 == 3 else (3, 10, 12)
        pixels = rng.integers(0, 256, shape, dtype=np.uint8)
        items.append((key, blobpipe.encode_raw_datum(pixels, int(rng.integers(0, 1000)))))
    return write_lmdb(path, items, map_size=1 << 24)


def page_kinds(data: bytes) -> tuple[int, dict[str, list[int]]]:
    """The page size, and the pages of each kind: meta, branch, leaf, value (overflow)."""
    psize = int.from_bytes(data[40:44], "little")
    kinds: dict[str, list[int]] = {"meta": [0, 1], "branch": [], "leaf": [], "value": []}
    page, count = 2, len(data) // psize
    while page < count:
        header = data[page * psize : page * psize + 16]
        flags = int.from_bytes(header[10:12], "little")
        if flags & 0x04:  # P_OVERFLOW: mp_pages pages hold one value
            run = int.from_bytes(header[12:16], "little")
            kinds["value"] += range(page, min(page + run, count))
            page += run
            continue
        if flags & 0x01:
            kinds["branch"].append(page)
        elif flags & 0x02:
            kinds["leaf"].append(page)
        page += 1
    return psize, kinds


def flips(data: bytes, seed: int) -> list[tuple[Flip, str]]:
    """``FLIPS`` seeded flips: half of those in tree pages hit the page header and node
    offsets, the rest anywhere in the page; meta pages mostly in their 160 used bytes."""
    rng = np.random.default_rng(seed)
    psize, kinds = page_kinds(data)
    out: list[tuple[Flip, str]] = []
    for kind, count in FLIPS.items():
        for _ in range(count):
            page = int(rng.choice(kinds[kind]))
            start = page * psize
            if kind == "meta":
                at = int(rng.integers(0, 160 if rng.random() < 0.9 else psize))
            elif kind != "value" and rng.random() < 0.5:
                lower = int.from_bytes(data[start + 12 : start + 14], "little")
                at = int(rng.integers(0, lower))
            else:
                at = int(rng.integers(0, psize))
            bit = rng.random() < 0.5
            mask = 1 << int(rng.integers(0, 8)) if bit else int(rng.integers(1, 256))
            out.append(((len(out), start + at, mask), kind))
    return out


@pytest.mark.slow
def test_byte_flips_give_lmdbs_data_or_a_clean_error(tmp_path: Path) -> None:
    base = build(tmp_path / "base") / "data.mdb"
    assert lmdb_stat(base.parent)["depth"] == 3
    data = base.read_bytes()
    planned = flips(data, seed=13)
    psize, kinds = page_kinds(data)
    assert all(kinds.values()), kinds  # every kind of page exists, and is hit
    work = tmp_path / "work"
    work.mkdir()
    outcomes: dict[str, dict[int, str]] = {}

    def run(mode: str) -> None:
        outcomes[mode] = run_flips(mode, base, work, [f for f, _ in planned])

    threads = [threading.Thread(target=run, args=(mode,)) for mode in ("lmdb", "blobpipe")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tally: Counter[tuple[str, str]] = Counter()
    wrong = []
    for (number, offset, mask), kind in planned:
        ref, got = outcomes["lmdb"][number], outcomes["blobpipe"][number]
        if got.startswith("data ") and got == ref:
            tally[kind, "same data"] += 1
        elif got.startswith("error clean "):
            tally[kind, "clean error, LMDB: " + ref.split()[0]] += 1
        else:
            where = f"page {offset // psize} byte {offset % psize} ^ 0x{mask:02x}"
            wrong.append(f"flip {number} ({kind}, {where}): blobpipe {got[:200]}; LMDB {ref[:80]}")
    summary = ", ".join(f"{k}/{v}: {n}" for (k, v), n in sorted(tally.items()))
    assert not wrong, "\n".join([*wrong, summary])
    same = sum(n for (_, v), n in tally.items() if v == "same data")
    assert same >= len(planned) // 3, summary  # the flips did not all break the database
    print(summary)


_CUT_IN_PLACE = """
    import sys
    from pathlib import Path
    import numpy as np
    import blobpipe

    root, how = Path(sys.argv[1]), sys.argv[2]
    if how.endswith("-uncompiled"):  # the check through the map's own fstat
        import blobpipe._io._lmdbenv
        blobpipe._io._lmdbenv._file_size = None
        how = how.removesuffix("-uncompiled")
    rng = np.random.default_rng(0)
    def records(n):
        return [(rng.integers(0, 256, (3, 40, 40), dtype=np.uint8), i % 10) for i in range(n)]
    blobpipe.write_lmdb(str(root / "big"), records(400))
    blobpipe.write_lmdb(str(root / "small"), records(10))
    smaller = (root / "small" / "data.mdb").read_bytes()

    def _wait_until_idle(loader):
        # The fillers run ahead into the next epoch; a cut that lands inside one of
        # their reads (past its size check) is the one window no check can close, so
        # the test cuts once they are idle: the ring is full, decode time stands still.
        import time
        last = -1.0
        while (now := loader.statistics().decode_time) != last:
            last = now
            time.sleep(0.3)

    def cut() -> None:  # what cp does to the file it copies over
        with open(root / "big" / "data.mdb", "r+b") as f:
            f.truncate(0)
            f.write(smaller)

    db = str(root / "big")
    try:
        if how == "reader":
            reader = blobpipe.LmdbReader(db)
            keys = reader.keys()
            reader.get(keys[-1])
            cut()
            reader.get(keys[-1])
        else:
            if how == "loader":
                # batches of 4: the ring (grown for chunks of small batches) holds
                # fewer rows than an epoch, so the next epoch reads after the cut
                it = blobpipe.Loader(db, 4, device="cpu", mode="epoch", shuffle=True, prefetch=2)
            else:
                it = blobpipe.Batches(db, 16, mode="epoch", order="shuffle")
            with it:
                for n, _ in enumerate(it):  # cut in the middle of the epoch, or after it
                    if how == "batches-mid" and n == 3:
                        cut()
                if how == "loader":  # cut while no filler is inside a read (see below)
                    _wait_until_idle(it)
                if how != "batches-mid":
                    cut()
                for _ in it:
                    pass
        print("no error")
    except blobpipe.DataError as exc:
        print("clean:", exc)
"""


@pytest.mark.parametrize(
    "how", ["loader", "batches", "batches-mid", "reader", "reader-uncompiled", "loader-uncompiled"]
)
def test_a_data_file_cut_and_rewritten_in_place_is_a_clean_error(tmp_path: Path, how: str) -> None:
    """``cp`` over a database being read (the file truncated, then rewritten shorter):
    the next read is a DataError saying the database changed, never SIGBUS."""
    done = run_script(_CUT_IN_PLACE, str(tmp_path), how)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("clean: the database changed while it was being read"), (
        done.stdout
    )
    assert "copied over in place" in done.stdout and str(tmp_path / "big") in done.stdout


_FORK_UNDER_THREADS = """
    import os, sys, threading, time
    import blobpipe

    db = sys.argv[1]
    keys = blobpipe.LmdbReader(db).keys()
    stop = threading.Event()

    def gets(shared: blobpipe.LmdbReader | None) -> None:
        while not stop.is_set():
            for k in keys:  # a new reader per get opens and releases the environment
                (shared or blobpipe.LmdbReader(db)).get(k)

    def batches() -> None:
        with blobpipe.Batches(db, 4, order="shuffle", mode="wrap") as b:
            for _ in b:
                if stop.is_set():
                    return

    def loader() -> None:
        with blobpipe.Loader(db, 4, device="cpu", shuffle=True, workers=2) as l:
            for _ in l:
                if stop.is_set():
                    return

    one = blobpipe.LmdbReader(db)
    threads = [threading.Thread(target=gets, args=(r,)) for r in (None, None, one, one)]
    threads += [threading.Thread(target=batches), threading.Thread(target=loader)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    outcome = "ok"
    for attempt in range(int(sys.argv[2])):
        pid = os.fork()
        if pid == 0:
            try:
                with blobpipe.LmdbReader(db) as r:
                    ok = r.get(keys[7]) == blobpipe.LmdbReader(db).get(keys[7])
                with blobpipe.Batches(db, 8, mode="epoch") as b:
                    ok &= sum(len(x.keys) for x in b) == len(keys)
            finally:
                os._exit(0 if ok else 3)
        deadline = time.monotonic() + 8
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                if code:
                    outcome = f"child {attempt} exited {code}"
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                outcome = f"child {attempt} hung"
                break
            time.sleep(0.005)
        if outcome != "ok":
            break
    stop.set()
    for t in threads:
        t.join()
    print(outcome)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_while_threads_read_through_every_entry_point() -> None:
    """fork() while four threads get records through new readers, one iterates
    Batches and a blocking Loader's workers fill batches: every child reads the
    database through a reader and Batches and exits, none hangs in the fork hook."""
    db = str(Path(__file__).parent / "data" / "caffe" / "lmdb" / "raw_color")
    done = run_script(_FORK_UNDER_THREADS, db, "60")
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "ok", done.stdout


_MEAN_FILES = """
    import os, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a failure must not swap
    import blobpipe

    fifo = os.path.join(sys.argv[1], "mean.fifo")
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero", sys.argv[1]):
        try:
            blobpipe.Transform(mean_file=path)
            print(path, "accepted")
        except blobpipe.ProtoError as exc:
            print("refused:", exc)
        except BaseException as exc:
            print(path, "raised", type(exc).__name__, exc)
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo()")
def test_a_mean_file_that_is_no_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO (whose open or read would wait for a writer forever), /dev/zero (endless)
    and a directory are refused before anything is read from them."""
    done = run_script(_MEAN_FILES, str(tmp_path), timeout=15)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("refused:") for line in lines), lines
    assert all("is not a regular file" in line for line in lines), lines
    assert "mean.fifo" in lines[0] and "/dev/zero" in lines[1]


def test_a_mean_file_is_read_by_its_size(tmp_path: Path) -> None:
    """A mean file is read whole by its size: a good one loads, one cut short or with
    bytes after its message is a ProtoError naming the file."""
    mean = Path(__file__).parent / "data" / "caffe" / "raw_color_mean.binaryproto"
    good = blobpipe.load_mean_file(mean)
    assert good.shape == (3, 32, 40)
    cut = tmp_path / "cut.binaryproto"
    cut.write_bytes(mean.read_bytes()[:-100])
    with pytest.raises(blobpipe.ProtoError, match=r"cut\.binaryproto"):
        blobpipe.load_mean_file(cut)


_LOCK_ACROSS_FORK = """
    import os, sys, threading, time
    from blobpipe._io import _indexcache

    path = os.path.join(sys.argv[1], "index")
    held, release = threading.Event(), threading.Event()

    def build() -> None:  # a thread building the index, holding its lock, at the fork
        with _indexcache._locked(path):
            held.set()
            release.wait()

    t = threading.Thread(target=build)
    t.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        with _indexcache._locked(path) as locked:  # waits for the parent, not for itself
            os._exit(0 if locked else 3)
    time.sleep(0.3)
    release.set()
    t.join()
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child exited", os.waitstatus_to_exitcode(status))
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("child hung")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_fork_child_takes_the_index_lock_once_the_parent_lets_it_go(tmp_path: Path) -> None:
    """A thread holds the index's build lock when the process forks: the child's open
    waits for the parent to let it go, then proceeds (a lock the child inherited
    would wait for itself forever)."""
    done = run_script(_LOCK_ACROSS_FORK, str(tmp_path))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "child exited 0", done.stdout


_FINALIZER_UNDER_THE_REGISTRY = """
    import gc, sys
    import blobpipe
    from blobpipe._io import _lmdbenv

    reader = blobpipe.LmdbReader(sys.argv[1])
    reader.cycle = reader  # collected only by the garbage collector, at any allocation
    del reader
    with _lmdbenv.REGISTRY.lock:  # as an open walking a tree holds it
        gc.collect()  # the reader's finalizer releases its environment here
    print(len(_lmdbenv.REGISTRY.envs))
"""


def test_a_reader_collected_while_the_registry_is_held_does_not_deadlock() -> None:
    """The garbage collector may finalize a reader (releasing its environment) in a
    thread that holds the registry's lock, e.g. in the middle of an open."""
    db = str(Path(__file__).parent / "data" / "caffe" / "lmdb" / "raw_color")
    done = run_script(_FINALIZER_UNDER_THE_REGISTRY, db, timeout=10)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "0", done.stdout
