"""Who plans small batches, paired in one process: the consumer (its rows written by the
row kernel's native threads) against the fillers, and both against ``Batches`` alone.

Run: ``python bench/bench_planners.py [--workloads W1,W2] [--point NAME ...] [--rounds N]
[--data-dir DIR] [--quick]``

For each workload (``bench_workloads.py``'s databases and recipes; default W1 and W2, the
small-record ones) or sweep point (``--point``, ``bench_sweep.py``'s name), one process
opens two Loaders on the same database (2 workers, device "cpu", the blocking form): one
as it is, whose consumer plans small raw batches (``docs/design.md``, "Small raw batches
are planned by the consumer"), and one whose consumer never does (the fillers fill the
chunks, as where the row kernel is not built), and drives ``Batches`` in one thread as the
pairing benchmark does, and a second Loader whose consumer plans, as the A/A control.
Each round runs a later epoch of each, in an order reversed every other round, reading
each batch's data on the host, each after an untimed epoch of the same contender (the
one before it ran another, whose threads may still have been filling its ring then:
they would slow this one and give the other a head start). It prints the medians of µs
a batch and the medians of the per-round ratios: ``Batches`` over each Loader (above 1:
the Loader is faster), the fillers over the consumer (above 1: the consumer's planning
is faster), and the control over the consumer with its 90% bootstrap interval
(``bench_pairs.py``'s). In one process every contender sees the same drift of the
machine's speed. A row reads item 2's target
(the Loader with 2 workers ≥ 1.5× ``Batches`` in one thread) as PASS or MISS, resolved
when the control's interval lies within ±5% of 1×, as ``bench_pairs.py`` reads it.

**Rows alone** is the bound the consumer's Loader works against: the row-kernel calls
its consumer started in one epoch (recorded), replayed in the same rounds with no
Python between them: a pool of the Loader's threads and the calling thread writing the
same rows, from the same records, with the same transform, into as many buffers of the
same sizes (huge pages, as the ring's), in the same chunks, as many started at once.
"bound" is ``Batches`` over it: the most the Loader could reach here if its planning,
hand-off and iteration cost nothing. Where it is under 1.50× (and not under the
Loader's own ratio), the target lies past what this machine's memory moves (the rows
are written to fresh memory a batch, as the batch contract asks; ``Batches`` rewrites
one cached buffer): such a miss reads "MISS, past the bound". Where the replay ran
slower than the Loader, it bounds nothing in that run: the row reads ", no bound".

**Rows, cached** replays the same calls into one chunk's buffers, every chunk into the
same ones, written through the caches: the rows' time where their output stays in
cache, as ``Batches``' one buffer does (a ring cannot: its chunks in flight hold their
own slots, the batch contract's). Against rows alone it shows how much of a batch's
rows is the memory their slots are written to, not the writing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import blobpipe

ROUNDS = 9


def later_epoch(run: Callable[[], int]) -> float:
    """µs a batch of one epoch of ``run`` (which returns the batches it made)."""
    t0 = time.perf_counter()
    n = run()
    return (time.perf_counter() - t0) / max(n, 1) * 1e6


def epoch_of(loader: Any) -> Callable[[], int]:
    """A later epoch of ``loader`` (its blocking form), reading each batch's data on the
    host and keeping nothing, as a training loop does; returns the batches it made."""

    def epoch() -> int:
        n = 0
        for batch in loader:
            batch.data.cpu_data()
            n += 1
        return n

    return epoch


class Recorded:
    """The row-kernel calls a consumer-planning Loader started in one epoch (``calls``:
    :func:`record`), replayed (:meth:`epoch`) on a pool of its own, into buffers of its
    own."""

    def __init__(self, calls: list[tuple[Any, ...]], stream: bool, depth: int) -> None:
        from blobpipe._backends._hostmem import alloc
        from blobpipe._io._kernels import row_pool
        from blobpipe._loader._chunk import pool_threads

        self.stream = stream
        self.depth = depth
        self._pool = row_pool(pool_threads(self.depth))
        self._pool.stream = self.stream
        # each call's outputs (argument 8: one array, or a tuple of consecutive batches')
        outs = [c[8] if isinstance(c[8], tuple) else (c[8],) for c in calls]
        # the ring's buffers, by address: one of ours each, as large as the largest
        # array seen there (an epoch's last batch may be short)
        sizes: dict[int, int] = {}
        for o in (o for group in outs for o in group):
            sizes[o.ctypes.data] = max(sizes.get(o.ctypes.data, 0), o.nbytes)
        mine = {at: alloc(n) for at, n in sizes.items()}
        for buffer in mine.values():
            buffer[:] = 0  # touched once: no first-touch faults in the timed epochs

        def own(out: np.ndarray) -> np.ndarray:
            return mine[out.ctypes.data][: out.nbytes].view(out.dtype).reshape(out.shape)

        # one chunk's buffers, which every call writes (the k-th batch of each into the
        # k-th): what its lines hold stays in cache from one call to the next (the calls
        # in flight at once write the same ones: a timing, their values are not kept)
        one = [alloc(max(sizes.values())) for _ in range(max(len(group) for group in outs))]
        for buffer in one:
            buffer[:] = 0

        def ours(k: int, out: np.ndarray) -> np.ndarray:
            return one[k][: out.nbytes].view(out.dtype).reshape(out.shape)

        self.calls: list[tuple[Any, ...]] = []
        self.cached_calls: list[tuple[Any, ...]] = []
        for call, group in zip(calls, outs, strict=True):
            for made, replaced in (
                (self.calls, tuple(own(o) for o in group)),
                (self.cached_calls, tuple(ours(k, o) for k, o in enumerate(group))),
            ):
                out = replaced if isinstance(call[8], tuple) else replaced[0]
                made.append((*call[:8], out, *call[9:]))
        self.batches = sum(len(group) for group in outs)

    def epoch(self) -> int:
        """The recorded calls, as many started at once as the Loader starts; the
        batches written."""
        return self._replay(self.calls, self.stream)

    def epoch_cached(self) -> int:
        """:meth:`epoch` into one chunk's buffers, written through the caches."""
        return self._replay(self.cached_calls, False)

    def _replay(self, calls: list[tuple[Any, ...]], stream: bool) -> int:
        self._pool.stream = stream
        started: list[Any] = []
        for call in calls:
            started.append(self._pool.start(*call))
            if len(started) > self.depth - 1:
                started.pop(0).synchronize()
        for job in started:
            job.synchronize()
        return self.batches

    def close(self) -> None:
        """Join the pool's threads and let go of the calls (they reference the
        database's map)."""
        self._pool.close()
        self.calls.clear()
        self.cached_calls.clear()


def record(loader: Any) -> Recorded | None:
    """:class:`Recorded` from the row-kernel calls ``loader``'s consumer starts in its next
    epoch; None where it started none (its fillers filled every batch: the row kernel is
    not built, or batches did not look small on a loaded machine)."""
    from blobpipe._loader import _chunk

    calls: list[tuple[Any, ...]] = []
    pools: list[Any] = []
    start_chunk = _chunk.start_chunk

    class Recording:  # a pool, its starts noted
        def __init__(self, pool: Any) -> None:
            object.__setattr__(self, "pool", pool)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.pool, name)

        def start(self, *args: Any) -> Any:
            calls.append((args[0], np.array(args[1]), *args[2:]))
            return self.pool.start(*args)

    def recording(batches: Any, plans: Any, arrays: Any, pool: Any) -> Any:
        pools.append(pool)
        return start_chunk(batches, plans, arrays, Recording(pool))

    _chunk.start_chunk = recording  # (the Pipeline calls it as _chunk.start_chunk)
    try:
        epoch_of(loader)()
    finally:
        _chunk.start_chunk = start_chunk
    if not calls:
        return None
    return Recorded(calls, bool(pools[-1].stream), loader._pipe._here_depth)


def contenders(db: str, options: dict[str, Any]) -> tuple[dict[str, Callable[[], int]], list[Any]]:
    """The ways to read an epoch of ``db`` (``Batches``, the two planners, the control,
    and the consumer's rows alone: :class:`Recorded`), and what to close after."""
    loaders = {}
    for name, here in (("consumer", True), ("fillers", False), ("again", True)):
        loader = blobpipe.Loader(db, device="cpu", workers=2, mode="epoch", **options)
        if not here:
            loader._pipe._here_ok = False  # the fillers fill the chunks
        loader.__enter__()
        loaders[name] = loader

    batches = blobpipe.Batches(db, mode="epoch", **options)
    label = np.empty(options["batch_size"], np.float32)
    data: list[np.ndarray] = []

    def alone() -> int:
        n = 0
        while (plan := batches.next_plan()) is not None:
            if not data or data[0].shape != plan.data_shape:
                data[:] = [np.empty(plan.data_shape, plan.dtype)]
            batches.fill(plan, data[0], label[: len(plan)])
            n += 1
        return n

    for _ in range(2):  # its first epoch, and the one its chunks and ring grow in
        epoch_of(loaders["consumer"])()
    rows = record(loaders["consumer"])
    runs = {
        "Batches": alone,
        "consumer": epoch_of(loaders["consumer"]),
        "fillers": epoch_of(loaders["fillers"]),
        "again": epoch_of(loaders["again"]),  # the A/A control
    }
    if rows is None:  # the consumer planned no batch: no bound to show
        return runs, [*loaders.values(), batches]
    runs["rows"] = rows.epoch
    runs["cached"] = rows.epoch_cached
    return runs, [rows, *loaders.values(), batches]  # (the replay first: it reads their maps)


def measure(db: str, options: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    runs, opened = contenders(db, options)
    try:
        for run in runs.values():
            run()  # the first epoch: opened, indexed, every slot filled
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(rounds):
            order = list(runs) if r % 2 == 0 else list(runs)[::-1]
            for name in order:
                runs[name]()  # steady: what the others left running is done
                times[name].append(later_epoch(runs[name]))
        return times
    finally:
        for thing in opened:
            thing.close()


def ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def options_of(recipe: Any, mean_file: Path | None) -> dict[str, Any]:
    """A workload's or point's recipe as Loader and Batches options."""
    return {
        "batch_size": recipe.batch,
        "phase": recipe.phase,
        "order": "shuffle" if recipe.shuffle else "key",
        "transform": blobpipe.Transform(
            scale=recipe.scale,
            mirror=recipe.mirror,
            crop_size=recipe.crop,
            mean_file=None if mean_file is None else str(mean_file),
            mean_value=list(recipe.mean_value),
            dtype=recipe.dtype,
            layout=recipe.layout,
        ),
    }


def case_arguments(parser: argparse.ArgumentParser, workloads: str, rounds: int) -> None:
    """The options of a benchmark run case by case (:func:`cases`)."""
    parser.add_argument("--workloads", default=workloads, help=f"{workloads} by default")
    parser.add_argument("--point", action="append", default=[], help="a bench_sweep point")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="small databases, 3 rounds")


def cases(names: str, points: list[str], quick: bool) -> list[tuple[Any, bool]]:
    """The workloads named (``bench_workloads.select``: W3 is W3 and W3-test) and the sweep
    points, each with whether its recipe uses the database's mean file."""
    from bench_sweep import db_spec, point_from_name
    from bench_workloads import Workload, select, workloads

    chosen = [(w, True) for w in select(workloads(quick), names)]
    for name in points:
        p = point_from_name(name)
        workload = Workload(p.name, p.name, db_spec(p, quick), p.recipe)
        chosen.append((workload, p.recipe.mean_file is not None))
    return chosen


def rounds_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The rounds :func:`case_arguments` asked for (3 with ``--quick``); at least 3, the
    fewest a bootstrap interval is read from."""
    rounds = 3 if args.quick else args.rounds
    if rounds < 3:
        parser.error("--rounds must be >= 3 (an interval needs rounds)")
    return int(rounds)


def prepared(args: argparse.Namespace) -> Iterator[tuple[Any, str, dict[str, Any]]]:
    """The cases the options of :func:`case_arguments` chose, each as its workload, its
    database's path (generated if needed, its pages cached) and its Loader options."""
    from _workloads_data import prepare, warm_page_cache

    for w, mean in cases(args.workloads, args.point, args.quick):
        pre = prepare(w.db, args.data_dir)
        warm_page_cache(pre)
        yield w, str(pre.path), options_of(w.recipe, pre.mean_file if mean else None)


def read_target(speed: float, bound: float | None) -> str:
    """Item 2's target read from the consumer's ratio ``speed`` and the replay's
    ``bound`` (None: no replay): PASS or MISS, a miss "past the bound" where the rows
    alone miss it too (and run no slower than the Loader), ", no bound" where the replay
    ran slower than the Loader (it bounds nothing in that run)."""
    from bench_pairs import PIPELINE_TARGET

    verdict = "PASS" if speed >= PIPELINE_TARGET else "MISS"
    if bound is None:
        return verdict
    if bound < speed:
        return verdict + ", no bound"
    if speed < PIPELINE_TARGET and bound < PIPELINE_TARGET:
        return verdict + ", past the bound"
    return verdict


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    case_arguments(parser, "W1,W2", ROUNDS)
    args = parser.parse_args(argv)
    from bench_pairs import PIPELINE_TARGET, interval, within

    rounds = rounds_of(parser, args)
    print(f"planners paired in one process, {rounds} rounds, later epochs, µs a batch (medians)")
    print(
        "| case | Batches | consumer | fillers | rows alone | rows, cached | Batches / consumer "
        "| Batches / fillers | fillers / consumer | bound: Batches / rows alone "
        f"| A/A (90%) | consumer ≥ {PIPELINE_TARGET:.2f}× Batches |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for w, path, options in prepared(args):
        t = measure(path, options, rounds)
        med = {k: statistics.median(v) for k, v in t.items()}
        # the control: the consumer's speed over its twin's (as bench_pairs' rates)
        aa = [b / a for a, b in zip(t["again"], t["consumer"], strict=True)]
        lo, hi = interval(aa)
        resolved = within(lo, hi)
        speed = ratio(t["Batches"], t["consumer"])
        bound = ratio(t["Batches"], t["rows"]) if "rows" in t else None
        verdict = read_target(speed, bound)
        rows = "—" if bound is None else f"{med['rows']:.1f}"
        cached = "—" if bound is None else f"{med['cached']:.1f}"
        print(
            f"| {w.name} | {med['Batches']:.1f} | {med['consumer']:.1f} | {med['fillers']:.1f} "
            f"| {rows} | {cached} | {speed:.2f}× | {ratio(t['Batches'], t['fillers']):.2f}× "
            f"| {ratio(t['fillers'], t['consumer']):.2f}× "
            f"| {'—' if bound is None else f'{bound:.2f}×'} "
            f"| {statistics.median(aa):.2f}× ({lo:.2f}–{hi:.2f}) "
            f"| {verdict}{'' if resolved else ' (unresolved)'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
