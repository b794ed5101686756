"""ImageNet-scale databases: open, first batch, memory, cold and larger-than-memory epochs.

Run: ``python bench/bench_scale.py [--counts 10000,100000,1281167] [--rounds N]
[--data-dir DIR] [--seconds S] [--no-epochs] [--json OUT]``

Databases (generated once, cached under ``bench/_data/scale_<count>_v1/``, not part of
the test suite): ``count`` raw 3×32×32 Datums (one overflow page per value, as a
resized ImageNet has one run of pages per value) under ImageNet-like keys
(``%08d_nXXXXXXXX/nXXXXXXXX_N.JPEG``), labels ``i % 1000``; 1,281,167 records make
5.3 GB. blobpipe's persistent indexes go to ``<data dir>/scale_index_cache``
(``BLOBPIPE_CACHE_DIR``), never the user's cache.

**Cold** means the data file (and, where it says so, the index file) evicted from the
page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` just before the step, in a
fresh process. Every measurement runs in a fresh Python process (libraries imported
before the clock starts), rounds interleaved so that load on a shared machine hits
every row alike; medians are shown. Each round first reads the data file once, then runs
the warm rows (each run once untimed first, so that what it reads is cached), then the
cold rows.

Rows, per record count:

* ``open``: ``LmdbReader(path)`` and its key list: the first open of a cold file
  (no index yet: it walks the checked B-tree with readahead hints, then writes the
  index), later opens through the index (warm; and cold, index file evicted too),
  and the walk with no index (``index=None``, warm).
* ``first batch``: from the start of the process's open to a shuffled first batch
  of 256 of a ``Loader(..., order="shuffle", device="cpu")``.
* ``anon MB`` / ``B/record``: anonymous memory (``RssAnon``) the open added, and
  after the first batch.
* the py-lmdb cursor as Caffe reads (open + the first 256 values in key order), and
  py-lmdb with the keys listed for a shuffle (open, list every key, 256 shuffled gets).

Epochs:

* W3 (``_workloads_data.imagenet_raw``: 2,048 raw 3×256×256, its TRAIN recipe, batch
  64, 2 workers) first epoch, warm and cold, and cold with no read-ahead of the
  next batches' values (for comparison); its index written by an untimed run first.
  The ratio depends on the load: a CPU-starved warm epoch hides the cold one's reads
  (at load average ~7 a cold epoch ran at 1.06× the warm one, at ~2 at 0.6×), so
  ``bench/bench_cold.py`` measures it with an A/A control and the disk's own time for
  the file.
* the largest database read for ``--seconds`` with ``order="quasi"``
  (``buffer_size=65536``) and with ``order="shuffle"``, batch 256, while a thread
  evicts the file (``LmdbReader.evict``: our map's pages and the page cache) every
  second: an epoch of a database larger than memory.

Targets at 1.28M records: warm open with the index ≤ 0.3 s, first cold open ≤ 3 s,
≤ 64 B/record of anonymous memory after open, a cold first epoch of W3 ≥ 0.9× warm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DATA_DIR = Path(__file__).resolve().parent / "_data"
VERSION = 1
IMAGENET = 1_281_167
BATCH = 256


# -- databases ----------------------------------------------------------------------------------


def scale_key(i: int) -> bytes:
    label = i % 1000
    synset = f"n{1440764 + label * 1009:08d}"
    return f"{i:08d}_{synset}/{synset}_{10026 + i}.JPEG".encode()


def prepare(count: int, root: Path) -> Path:
    """The database of ``count`` records under ``root`` (written once)."""
    import lmdb

    import blobpipe

    folder = root / f"scale_{count}_v{VERSION}"
    if (folder / "complete").exists():
        return folder / "lmdb"
    tmp = folder.with_name(folder.name + ".partial")
    if tmp.exists():
        for p in sorted(tmp.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        tmp.rmdir()
    (tmp / "lmdb").mkdir(parents=True)
    rng = np.random.default_rng(count)
    pool = [rng.integers(0, 256, (3, 32, 32), dtype=np.uint8) for _ in range(64)]
    env = lmdb.open(
        str(tmp / "lmdb"), map_size=count * 4400 + (64 << 20), writemap=True, sync=False,
        metasync=False,
    )  # fmt: skip
    t0 = time.perf_counter()
    try:
        i = 0
        while i < count:
            with env.begin(write=True) as txn:
                for j in range(i, min(count, i + 65536)):
                    value = blobpipe.encode_raw_datum(pool[j % 64], j % 1000)
                    txn.put(scale_key(j), value, append=True)
            i = j + 1
            print(f"  wrote {i:,} of {count:,} records", file=sys.stderr)
        env.sync(True)
    finally:
        env.close()
    print(f"  {count:,} records in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    (tmp / "complete").touch()
    tmp.rename(folder)
    return folder / "lmdb"


# -- measurements in a fresh process -------------------------------------------------------------


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_whole(path: Path) -> None:
    """Read ``path`` once, so that it is in the page cache."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 << 20)
        while f.readinto(buf):
            pass


def child(task: dict[str, Any]) -> dict[str, Any]:
    import lmdb

    import blobpipe
    from blobpipe._io import _indexcache, _readahead

    kind = task["kind"]
    path = task["path"]
    data = os.path.join(path, "data.mdb")
    index = _indexcache.index_path(data, "cache")
    assert index is not None
    if task.get("drop_index") and os.path.exists(index):
        os.unlink(index)
    if task.get("cold"):
        evict(data)
        if os.path.exists(index):
            evict(index)
    if task.get("no_ahead"):  # no read-ahead of the next batches' values at all
        _readahead.ReadAhead.planned = lambda *args: None  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    base = rss_anon()
    if kind == "open":
        t0 = time.perf_counter()
        reader = blobpipe.LmdbReader(path, index=task["index"])
        n = len(reader.keys())
        out["open_s"] = time.perf_counter() - t0
        out["anon_open"] = rss_anon() - base
        with blobpipe.Loader(
            reader, BATCH, order="shuffle", device="cpu", workers=2, prefetch=2, mode="epoch"
        ) as loader:
            batch = next(iter(loader))
            assert batch.valid == BATCH
            out["first_batch_s"] = time.perf_counter() - t0
            out["anon_batch"] = rss_anon() - base
        out["records"] = n
        reader.close()
    elif kind == "lmdb":
        t0 = time.perf_counter()
        env = lmdb.open(path, readonly=True, lock=False, readahead=False)
        with env.begin(buffers=True) as txn, txn.cursor() as cur:
            if task["listed"]:
                keys = [bytes(k) for k in cur.iternext(keys=True, values=False)]
                pick = np.random.default_rng(0).permutation(len(keys))[:BATCH]
                vals = [bytes(txn.get(keys[i])) for i in pick.tolist()]
            else:
                vals = []
                for _, v in cur:
                    vals.append(bytes(v))
                    if len(vals) == BATCH:
                        break
        out["first_batch_s"] = time.perf_counter() - t0
        env.close()
    elif kind == "w3":
        transform = blobpipe.Transform(crop_size=task["crop"], mirror=True, mean_file=task["mean"])
        t0 = time.perf_counter()
        with blobpipe.Loader(
            path, 64, transform=transform, phase="train", shuffle=True, device="cpu",
            workers=2, prefetch=4, mode="epoch",
        ) as loader:  # fmt: skip
            images = sum(b.valid for b in loader)
        out["seconds"] = time.perf_counter() - t0
        out["images_per_s"] = images / out["seconds"]
    elif kind == "ltm":
        import threading

        reader = blobpipe.LmdbReader(path)
        stop = threading.Event()

        def evictor() -> None:
            while not stop.wait(1.0):
                reader.evict()

        options: dict[str, Any] = {"order": task["order"]}
        if task["order"] == "quasi":
            options["buffer_size"] = 65536
        images = 0
        thread = threading.Thread(target=evictor, daemon=True)
        with blobpipe.Loader(
            reader, BATCH, device="cpu", workers=2, prefetch=4, mode="epoch", **options
        ) as loader:
            thread.start()
            t0 = time.perf_counter()
            for b in loader:
                images += b.valid
                if time.perf_counter() - t0 > task["seconds"]:
                    break
            out["seconds"] = time.perf_counter() - t0
        stop.set()
        thread.join()
        reader.close()
        out["images_per_s"] = images / out["seconds"]
    return out


def run_child(task: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(task)],
        env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{task}: {done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--counts", default=f"10000,100000,{IMAGENET}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR)
    ap.add_argument("--no-epochs", action="store_true")
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    root = args.data_dir
    counts = [int(c) for c in args.counts.split(",")]
    paths = {c: prepare(c, root) for c in counts}
    if args.prepare_only:
        return 0
    env = {**os.environ, "BLOBPIPE_CACHE_DIR": str(root / "scale_index_cache")}
    print(
        f"bench_scale: {os.cpu_count()} CPUs, {args.rounds} rounds (median), each step in a "
        "fresh process; cold = the file evicted from the page cache with "
        "posix_fadvise(POSIX_FADV_DONTNEED) first. A shared machine: figures as measured "
        "under others' load."
    )
    results: dict[str, Any] = {"opens": {}, "epochs": {}}
    # warm cases first in each round, right after the file is read once; then the cold
    cases = {
        "warm open, index": {"kind": "open", "index": "cache"},
        "warm open, no index (index=None: the walk)": {"kind": "open", "index": None},
        "py-lmdb cursor, warm": {"kind": "lmdb", "listed": False},
        "py-lmdb keys listed + shuffled gets, warm": {"kind": "lmdb", "listed": True},
        "first cold open (no index: walk + write it)": {
            "kind": "open", "index": "cache", "cold": True, "drop_index": True,
        },
        "cold open, index (both files evicted)": {"kind": "open", "index": "cache", "cold": True},
        "py-lmdb cursor, cold": {"kind": "lmdb", "listed": False, "cold": True},
    }  # fmt: skip
    for count in counts:
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
        run_child({"kind": "open", "index": "cache", "path": str(paths[count])}, env)  # the index
        for _ in range(args.rounds):
            read_whole(paths[count] / "data.mdb")
            for name, case in cases.items():
                task = {**case, "path": str(paths[count])}
                if not case.get("cold"):
                    run_child(task, env)  # warm: the same step once first, untimed
                rows[name].append(run_child(task, env))
        results["opens"][count] = rows
        print(f"\n{count:,} records ({os.path.getsize(paths[count] / 'data.mdb') / 1e9:.2f} GB):")
        print(f"  {'':46} {'open s':>8} {'1st batch s':>11} {'anon MB':>8} {'B/rec':>6} "
              f"{'B/rec 1st batch':>15}")  # fmt: skip
        for name, rs in rows.items():
            if "open_s" in rs[0]:
                a = med(rs, "anon_open")
                print(
                    f"  {name:46} {med(rs, 'open_s'):8.3f} {med(rs, 'first_batch_s'):11.3f} "
                    f"{a / 1e6:8.1f} {a / count:6.1f} {med(rs, 'anon_batch') / count:15.1f}"
                )
            else:
                print(f"  {name:46} {'':8} {med(rs, 'first_batch_s'):11.3f}")
    if not args.no_epochs:
        from bench._workloads_data import imagenet_raw
        from bench._workloads_data import prepare as prepare_w3

        spec, crop = imagenet_raw()
        w3 = prepare_w3(spec, root)
        base = {"kind": "w3", "path": str(w3.first), "crop": crop, "mean": str(w3.mean_file)}
        w3_cases = {
            "W3 first epoch, warm": base,
            "W3 first epoch, cold": {**base, "cold": True},
            "W3 first epoch, cold, no read-ahead of values": {
                **base, "cold": True, "no_ahead": True,
            },
        }  # fmt: skip
        w3_rows: dict[str, list[dict[str, Any]]] = {name: [] for name in w3_cases}
        read_whole(Path(w3.first) / "data.mdb")
        run_child(base, env)  # untimed: W3's persistent index written before the rounds
        for _ in range(args.rounds):
            read_whole(Path(w3.first) / "data.mdb")
            for name, case in w3_cases.items():
                w3_rows[name].append(run_child(case, env))
        results["epochs"]["w3"] = w3_rows
        warm = med(w3_rows["W3 first epoch, warm"], "images_per_s")
        print(f"\nW3 ({w3.count} × 3×256×256 raw, batch 64, 2 workers), first epoch incl. open:")
        for name, rs in w3_rows.items():
            rate = med(rs, "images_per_s")
            print(f"  {name:46} {rate:8.0f} img/s  {rate / warm:5.2f}× warm")
        largest = max(counts)
        ltm_cases = {
            "quasi (buffer_size=65536), file evicted every 1 s": {"order": "quasi"},
            "shuffle, file evicted every 1 s": {"order": "shuffle"},
        }
        ltm_rows: dict[str, list[dict[str, Any]]] = {name: [] for name in ltm_cases}
        for _ in range(args.rounds):
            for name, case in ltm_cases.items():
                task = {**case, "kind": "ltm", "path": str(paths[largest]), "cold": True,
                        "seconds": args.seconds}  # fmt: skip
                ltm_rows[name].append(run_child(task, env))
        results["epochs"]["ltm"] = ltm_rows
        print(f"\nlarger than memory: {largest:,} records, batch 256, {args.seconds:.0f} s each:")
        shuffle = med(ltm_rows["shuffle, file evicted every 1 s"], "images_per_s")
        for name, rs in ltm_rows.items():
            rate = med(rs, "images_per_s")
            print(f"  {name:52} {rate:8.0f} img/s  {rate / shuffle:5.2f}× shuffle")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
