"""First epochs of small databases: what a Loader's first epoch pays besides its batches,
stage by stage, against what the plain loop pays.

Run: ``python bench/bench_first.py [--quick] [--rounds N] [--points SUBSTR,...]
[--point NAME ...] [--cold-index] [--prefault MIB] [--data-dir DIR] [--json OUT] [--markdown]``

The sweep (``bench_sweep.py``) gives a first epoch's ratio to the plain loop; on its
small databases (a few thousand records, tens of milliseconds an epoch) the costs a
first epoch pays once weigh as much as its batches. This benchmark takes them apart, on
the sweep's databases and recipes (its points by name substring, ``--points``; points
the grid does not hold by name, ``--point 'raw 3x48x48 TEST, scale'``; default: the
held-out points of issue 40 and the grid's raw points of up to 3×96×96).

Each round runs, per point, three fresh Python processes in an order rotated each round
(libraries imported before the clock starts, as for the sweep's first epochs), after
waiting until two threads hash at least 1.7× as fast as one (up to 20 s):

* **plain**: the sweep's plain loop (``_contenders.PlainLoop``: py-lmdb, a Datum per
  record, NumPy, one thread): ``open`` (the environment, and the keys when it
  shuffles), ``1st batch`` (until its first batch is filled), the whole first epoch
  (open to close), ``close``; then, in the same process, a later epoch (the same
  environment, timed alone);
* **Loader** (``Loader(..., device="cpu", workers=2)``, blocking form, as the sweep's
  ``blocking`` row): ``open`` (the constructor: the database opened and checked, its
  index read from the persistent index cache, or walked and written with
  ``--cold-index``, the first records read), ``start`` (``__enter__``: the ring's
  slots, the filler threads), ``1st batch``, the whole first epoch, ``close``; the
  fresh memory its ring took from the pool (the host pool's bytes allocated, all of
  it first touched in this epoch), the minor page faults of the process over the
  epoch, and the CPU time of all its threads; then, in the same process, a second
  Loader on the same database (``reopen``: what the first epoch costs once the
  process has its memory, imports and threads' first calls behind it) and its later
  epoch (its third, timed alone: its second grows the consumer's chunks, and with them
  the ring, whose new slots are fresh memory);
* **Loader again**: the same as Loader, an A/A control: the ratio of the two first
  epochs is how far two measurements of the same code differ at that point.

Each process imports the ``blobpipe`` of the working directory (``python -c`` puts it
first on the path): run from another checkout's root to measure that one (the header
names the one used). The table gives medians over rounds (milliseconds, memory in MiB),
``fixed``: the first epoch less the later one (what the first epoch pays once), and the
first-epoch ratio plain / Loader (median over rounds of the ratio within the round, with
its range) against the A/A control's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _fresh as fresh_memory
import bench_sweep as bs
import bench_workloads as bw
from _workloads_data import DATA_DIR, prepare, warm_page_cache

HERE = Path(__file__).resolve().parent
#: the held-out points of issue 40 (shapes the sweep's grid does not hold)
HELD_OUT = (
    "raw 3x48x48 TEST, scale",
    "raw 3x80x80 TRAIN, crop 64, mirror, mean file",
)
#: the grid's points measured by default: raw records of at most this many pixels
SMALL_PIXELS = 3 * 96 * 96
KINDS = ("plain", "loader", "again")

# One process: a first epoch, stage by stage, then a reopen and a later epoch. Prints JSON.
_CHILD = r"""
import json, resource, sys, time
import numpy as np
import numpy.random  # noqa: F401  (as the sweep's first epochs: imported before the clock)
sys.path.insert(0, sys.argv[2])
import _contenders as cs
import blobpipe
from _fresh import prefault

spec = json.loads(sys.argv[1])
recipe = cs.Recipe.from_doc(spec["recipe"])
db = spec["db"]
out = {"prefault": prefault(spec["prefault"])}


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


if spec["kind"] == "plain":
    class Timed(cs.PlainLoop):
        t_first = 0.0
        calls = 0

        def _fill(self, values, draws):
            self.calls += 1
            if self.calls == 2:
                self.t_first = time.perf_counter()
            super()._fill(values, draws)

    files = cs.Files(loader=db, first=db, plain=db)
    plain = Timed(files, recipe, tuple(spec["out_shape"]))
    c0, f0 = time.process_time(), faults()
    t0 = time.perf_counter()
    env = cs._open_env(db)
    keys = cs._list_keys(env) if recipe.shuffle else None
    t1 = time.perf_counter()
    images, _ = plain._epoch(env, keys, False)
    t2 = time.perf_counter()
    env.close()
    t3 = time.perf_counter()
    out.update(open=t1 - t0, first_batch=(plain.t_first or t2) - t0, epoch=t3 - t0,
               close=t3 - t2, cpu=time.process_time() - c0, faults=faults() - f0)
    t0 = time.perf_counter()
    env = cs._open_env(db)
    plain._epoch(env, keys, False)
    t1 = time.perf_counter()
    plain._epoch(env, keys, False)
    out.update(reopen=t1 - t0, later=time.perf_counter() - t1)
    env.close()
else:
    def make():
        return blobpipe.Loader(
            db, batch_size=recipe.batch, device="cpu", transform=recipe.transform(),
            phase=recipe.phase, order="shuffle" if recipe.shuffle else "key", workers=2,
            mode="epoch",
        )

    c0, f0 = time.process_time(), faults()
    t0 = time.perf_counter()
    loader = make()
    t1 = time.perf_counter()
    loader.__enter__()
    t2 = time.perf_counter()
    it = iter(loader)
    batch = next(it)
    batch.data.cpu_data()
    images = len(batch)
    t3 = time.perf_counter()
    for batch in it:
        batch.data.cpu_data()
        images += len(batch)
    del batch
    stats = loader.statistics()
    t4 = time.perf_counter()
    loader.close()
    t5 = time.perf_counter()
    out.update(open=t1 - t0, start=t2 - t1, first_batch=t3 - t0, epoch=t5 - t0, close=t5 - t4,
               cpu=time.process_time() - c0, faults=faults() - f0,
               fresh=stats.pool.total_bytes, slots=stats.slots)
    t0 = time.perf_counter()
    with make() as loader:
        for batch in loader:
            batch.data.cpu_data()
        t1 = time.perf_counter()
        # the second epoch grows the consumer's chunks and the ring (fresh slots): untimed
        for batch in loader:
            batch.data.cpu_data()
        t2 = time.perf_counter()
        for batch in loader:
            batch.data.cpu_data()
        t3 = time.perf_counter()
        del batch
    out.update(reopen=t1 - t0, second=t2 - t1, later=t3 - t2)
out["images"] = images
out["blobpipe"] = blobpipe.__file__
print(json.dumps(out))
"""


def _run(kind: str, spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps({**spec, "kind": kind}), str(HERE)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} at {spec['name']}: exit {proc.returncode}\n{proc.stderr}")
    got: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if got["images"] != spec["count"]:
        raise RuntimeError(f"{kind} at {spec['name']}: {got['images']} images of {spec['count']}")
    return got


def points(args: argparse.Namespace) -> list[bs.Point]:
    grid = bs.grid(False)
    if args.points:
        wanted = [t.strip() for t in args.points.split(",")]
        chosen = [p for p in grid if any(t in p.name for t in wanted)]
    elif args.point:
        chosen = []
    else:
        chosen = [bs.point_from_name(n) for n in HELD_OUT]
        if args.quick:
            return chosen
        chosen += [
            p
            for p in grid
            if p.kind == "raw" and p.shape[0] * p.shape[1] * p.shape[2] <= SMALL_PIXELS
        ]
    return chosen + [bs.point_from_name(n) for n in args.point]


def measure(
    point: bs.Point,
    root: Path,
    rounds: int,
    cold_index: bool,
    quick: bool = False,
    prefault: int = 0,
) -> dict[str, list[dict[str, float]]]:
    prepared = prepare(bs.db_spec(point, quick), root)
    warm_page_cache(prepared)
    recipe = bs.recipe_for(point, prepared)
    spec = {
        "name": point.name,
        "db": str(prepared.first),
        "count": prepared.count,
        "recipe": recipe.to_doc(),
        "out_shape": list(recipe.out_shape(*point.shape)),
        "prefault": prefault,
    }
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    samples["headroom"] = []
    for rnd in range(rounds):
        samples["headroom"].append({"headroom": bw.quiet_headroom()})
        shift = rnd % len(KINDS)
        for kind in KINDS[shift:] + KINDS[:shift]:
            env = dict(os.environ)
            with tempfile.TemporaryDirectory() as cache:
                if cold_index:  # a cache of its own: the index is walked and written
                    env["BLOBPIPE_CACHE_DIR"] = cache
                samples[kind].append(_run(kind, spec, env))
    samples["records"] = [{"count": prepared.count}]
    return samples


def _med(rows: list[dict[str, float]], key: str, scale: float = 1e3) -> float:
    return statistics.median(r[key] for r in rows) * scale


def _ratios(samples: dict[str, list[dict[str, float]]], key: str) -> list[float]:
    return [p["epoch"] / r["epoch"] for p, r in zip(samples["plain"], samples[key], strict=True)]


HEADER = (
    "point",
    "records",
    "plain open",
    "1st batch",
    "first",
    "close",
    "later",
    "fixed",
    "Loader open",
    "start",
    "1st batch",
    "first",
    "close",
    "reopen",
    "later",
    "fixed",
    "fresh MiB",
    "faults",
    "prefault ms/MiB",
    "CPU plain / Loader",
    "first: plain / Loader",
    "A/A",
)


def _prefaulted(samples: dict[str, list[dict[str, float]]]) -> str:
    """The prefault's cost a MiB (median and range over every process), or "—"."""
    got = [r["prefault"] for k in KINDS for r in samples[k] if r.get("prefault")]
    if not got:
        return "—"
    return f"{statistics.median(got):.2f} ({min(got):.2f}–{max(got):.2f})"


def table(results: dict[str, dict[str, list[dict[str, float]]]]) -> list[tuple[str, ...]]:
    lines = []
    for name, s in results.items():
        p, ld = s["plain"], s["loader"]
        mine, aa = (
            _ratios(s, "loader"),
            [a["epoch"] / b["epoch"] for a, b in zip(s["loader"], s["again"], strict=True)],
        )
        lines.append(
            (
                name,
                f"{s['records'][0]['count']:,}",
                f"{_med(p, 'open'):.2f}",
                f"{_med(p, 'first_batch'):.2f}",
                f"{_med(p, 'epoch'):.1f}",
                f"{_med(p, 'close'):.2f}",
                f"{_med(p, 'later'):.1f}",
                f"{_med(p, 'epoch') - _med(p, 'later'):.1f}",
                f"{_med(ld, 'open'):.2f}",
                f"{_med(ld, 'start'):.2f}",
                f"{_med(ld, 'first_batch'):.2f}",
                f"{_med(ld, 'epoch'):.1f}",
                f"{_med(ld, 'close'):.2f}",
                f"{_med(ld, 'reopen'):.1f}",
                f"{_med(ld, 'later'):.1f}",
                f"{_med(ld, 'epoch') - _med(ld, 'later'):.1f}",
                f"{_med(ld, 'fresh', 2**-20):.1f}",
                f"{_med(ld, 'faults', 1):.0f}",
                _prefaulted(s),
                f"{_med(p, 'cpu') / _med(ld, 'cpu'):.2f}×",
                f"{statistics.median(mine):.2f}× ({min(mine):.2f}–{max(mine):.2f})",
                f"{statistics.median(aa):.2f}× ({min(aa):.2f}–{max(aa):.2f})",
            )
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny databases, one round: a smoke test")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 5, quick 1)")
    ap.add_argument("--points", metavar="SUBSTR,...", help="the grid's points whose name has one")
    ap.add_argument(
        "--point", action="append", default=[], metavar="NAME", help="a point by name (repeatable)"
    )
    ap.add_argument(
        "--cold-index",
        action="store_true",
        help="every process with an empty index cache (a user's first open of a database)",
    )
    fresh_memory.add_option(ap)
    ap.add_argument("--data-dir", type=Path, help="LMDB cache (default bench/_data)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write every sample to OUT")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.prefault < 0:
        ap.error("--prefault must be >= 0")
    try:
        chosen = points(args)
    except ValueError as exc:
        ap.error(str(exc))
    root = DATA_DIR if args.data_dir is None else args.data_dir
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    results = {}
    for point in chosen:
        results[point.name] = measure(
            point, root, args.rounds, args.cold_index, args.quick, args.prefault
        )
        print(
            f"[{time.perf_counter() - t0:6.1f} s] {len(results)}/{len(chosen)} {point.name}",
            file=sys.stderr,
            flush=True,
        )
    cache = "empty (walked, written)" if args.cold_index else "as earlier opens left it"
    fresh = f"; {note}" if (note := fresh_memory.note(args.prefault)) else ""
    used = sorted(
        {str(Path(r["blobpipe"]).parent.parent) for s in results.values() for r in s["loader"]}
    )
    print(
        f"blobpipe first epochs: {len(results)} points, {args.rounds} interleaved rounds, "
        f"medians (ms; fresh memory in MiB); index cache {cache}; "
        f"machine: {os.cpu_count()} CPU cores, load average {load0:.2f} at start; "
        f"{time.perf_counter() - t0:.0f} s; blobpipe from {', '.join(used)}{fresh}"
    )
    print(bw.render(HEADER, table(results), args.markdown, set(range(1, len(HEADER)))))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "benchmark": "bench_first",
                    "rounds": args.rounds,
                    "quick": args.quick,
                    "cold_index": args.cold_index,
                    "prefault": args.prefault,
                    "points": results,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
