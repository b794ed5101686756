"""The consumer's chunk limits, paired in one process: the current ones against others.

Run: ``python bench/bench_chunk_bytes.py [--workloads W1,W2] [--point NAME ...]
[--against CHUNK_MIB,ALONE_MIB] [--rounds N] [--data-dir DIR] [--quick]``

While the consumer plans small raw batches, a chunk holds up to ``HERE_CHUNK_BYTES`` of
output, and a batch of more than ``HERE_ALONE_BYTES`` goes alone, to the fillers
(``blobpipe/_loader/_chunk.py``). This benchmark opens, for each case
(``bench_workloads.py``'s workloads, default W1 and W2, or ``bench_sweep.py``'s points by
name), three Loaders in one process (2 workers, device "cpu", the blocking form): one
under the current limits, one under ``--against``'s (default 4,2: the fillers' 4 MiB
chunks, batches of more than 2 MiB alone) and one under the current ones again as the
A/A control. Each Loader always runs under its own limits, which are set before each of
its epochs: a ring grows with its chunks and never shrinks, so one Loader switched from
larger chunks to smaller ones would keep the larger ring (which costs cache misses of
its own: 64-batch chunks read 1.24× faster than 16-batch ones on W1 that way, and
level with a Loader each). Later epochs are timed in turn, the order reversed every
other round, each after an untimed epoch of the same Loader (the one before it ran
another Loader, whose fillers may still have been filling its ring then). It prints the
medians of µs a batch and of the per-round ratios, other over current (above 1: the
current limits are faster) and the control's, each with its 90% bootstrap interval
(``bench_pairs.py``'s); a ratio is resolved when the control's interval lies within ±5%
of 1×.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import blobpipe
from blobpipe._loader import _chunk

ROUNDS = 20


def epoch(loader: Any) -> float:
    """µs a batch of one epoch of ``loader``, each batch's data read on the host."""
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        batch.data.cpu_data()
        n += 1
    return (time.perf_counter() - t0) / max(n, 1) * 1e6


def measure(
    db: str, options: dict[str, Any], limits: dict[str, tuple[int, int]], rounds: int
) -> dict[str, list[float]]:
    """Each setting's µs a batch, a round each, each on a Loader of its own."""
    saved = _chunk.HERE_CHUNK_BYTES, _chunk.HERE_ALONE_BYTES
    try:
        with contextlib.ExitStack() as stack:
            loaders = {}
            for name in limits:  # opened, indexed, its ring grown to its chunks
                _chunk.HERE_CHUNK_BYTES, _chunk.HERE_ALONE_BYTES = limits[name]
                loaders[name] = stack.enter_context(
                    blobpipe.Loader(db, device="cpu", workers=2, mode="epoch", **options)
                )
                for _ in range(3):
                    epoch(loaders[name])
            times: dict[str, list[float]] = {name: [] for name in limits}
            for r in range(rounds):
                order = list(limits) if r % 2 == 0 else list(limits)[::-1]
                for name in order:
                    _chunk.HERE_CHUNK_BYTES, _chunk.HERE_ALONE_BYTES = limits[name]
                    epoch(loaders[name])  # steady: what the others left running is done
                    times[name].append(epoch(loaders[name]))
            return times
    finally:
        _chunk.HERE_CHUNK_BYTES, _chunk.HERE_ALONE_BYTES = saved


def main(argv: list[str] | None = None) -> None:
    from bench_planners import case_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    case_arguments(parser, "W1,W2", ROUNDS)
    parser.add_argument("--against", default="4,2", help="CHUNK_MIB,ALONE_MIB (default 4,2)")
    args = parser.parse_args(argv)
    from bench_pairs import interval, within
    from bench_planners import prepared, rounds_of

    chunk_mib, alone_mib = (float(x) for x in args.against.split(","))
    current = (_chunk.HERE_CHUNK_BYTES, _chunk.HERE_ALONE_BYTES)
    limits = {
        "current": current,
        "other": (int(chunk_mib * (1 << 20)), int(alone_mib * (1 << 20))),
        "again": current,  # the A/A control
    }
    rounds = rounds_of(parser, args)
    mib = 1 << 20
    print(
        f"the consumer's chunk limits paired in one process, {rounds} rounds, later epochs: "
        f"current {current[0] / mib:g} MiB chunks, batches over {current[1] / mib:g} MiB "
        f"alone; other {chunk_mib:g} MiB, over {alone_mib:g} MiB alone"
    )
    print("| case | current µs a batch | other µs a batch | other / current (90%) | A/A (90%) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for w, path, options in prepared(args):
        t = measure(path, options, limits, rounds)
        cells = []
        for name in ("other", "again"):  # (the A/A control last: its interval stays)
            ratios = [b / a for a, b in zip(t["current"], t[name], strict=True)]
            lo, hi = interval(ratios)
            cells.append(f"{statistics.median(ratios):.2f}× ({lo:.2f}–{hi:.2f})")
        resolved = within(lo, hi)
        print(
            f"| {w.name} | {statistics.median(t['current']):.1f} "
            f"| {statistics.median(t['other']):.1f} | {cells[0]}{'' if resolved else ' *'} "
            f"| {cells[1]} |",
            flush=True,
        )
    print("(*: unresolved, the A/A interval is not within ±5% of 1×)")


if __name__ == "__main__":
    main()
