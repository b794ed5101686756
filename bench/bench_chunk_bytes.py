"""The consumer's chunk limits, paired in one process: the current ones against others.

Run: ``python bench/bench_chunk_bytes.py [--workloads W1,W2] [--point NAME ...]
[--against CHUNK_MIB,ALONE_MIB[,ROWS,BATCHES]] [--rounds N] [--data-dir DIR] [--quick]``

While the consumer plans small raw batches, past its first epoch, a chunk holds up to
``HERE_CHUNK_BYTES`` of output, ``HERE_CHUNK_ROWS`` rows and ``HERE_CHUNK_BATCHES``
batches, and a batch of more than ``HERE_ALONE_BYTES`` goes alone, to the fillers
(``blobpipe/_loader/_chunk.py``). This benchmark opens one Loader a case (2 workers,
device "cpu", the blocking form; ``bench_workloads.py``'s workloads, default W1 and W2,
or ``bench_sweep.py``'s points by name) and runs its later epochs under the current
limits, under ``--against``'s (default 4,2: the fillers' 4 MiB chunks, batches of more
than 2 MiB alone; ROWS and BATCHES, when given, the rows and batches limits, else the
current ones), and under the current ones again as the A/A control, switching the
limits between epochs (each switch followed by one untimed epoch that settles the ring),
in an order reversed every other round. It prints the medians of µs a batch and of the
per-round ratios, other over current (above 1: the current limits are faster) and the
control's, each with its 90% bootstrap interval (``bench_pairs.py``'s); a ratio is
resolved when the control's interval lies within ±5% of 1×.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import blobpipe
from blobpipe._loader import _chunk

ROUNDS = 20
#: the consumer's chunk limits this benchmark switches, in ``--against``'s order
LIMITS = ("HERE_CHUNK_BYTES", "HERE_ALONE_BYTES", "HERE_CHUNK_ROWS", "HERE_CHUNK_BATCHES")
Limits = tuple[int, int, int, int]


def current_limits() -> Limits:
    chunk, alone, rows, batches = (int(getattr(_chunk, name)) for name in LIMITS)
    return chunk, alone, rows, batches


def set_limits(limits: Limits) -> None:
    for name, value in zip(LIMITS, limits, strict=True):
        setattr(_chunk, name, value)


def epoch(loader: Any) -> float:
    """µs a batch of one epoch of ``loader``, each batch's data read on the host."""
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        batch.data.cpu_data()
        n += 1
    return (time.perf_counter() - t0) / max(n, 1) * 1e6


def measure(
    db: str, options: dict[str, Any], limits: dict[str, Limits], rounds: int
) -> dict[str, list[float]]:
    """Each setting's µs a batch, a round each, on one Loader."""
    saved = current_limits()
    loader = blobpipe.Loader(db, device="cpu", workers=2, mode="epoch", **options)
    try:
        with loader:
            for name in limits:  # opened, indexed, every slot of each setting filled
                set_limits(limits[name])
                epoch(loader)
                epoch(loader)
            times: dict[str, list[float]] = {name: [] for name in limits}
            for r in range(rounds):
                order = list(limits) if r % 2 == 0 else list(limits)[::-1]
                for name in order:
                    set_limits(limits[name])
                    epoch(loader)  # the ring settles under these limits
                    times[name].append(epoch(loader))
            return times
    finally:
        set_limits(saved)


def main(argv: list[str] | None = None) -> None:
    from bench_planners import case_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    case_arguments(parser, "W1,W2", ROUNDS)
    parser.add_argument(
        "--against",
        default="4,2",
        help="CHUNK_MIB,ALONE_MIB[,ROWS,BATCHES] (default 4,2 and the current rows and batches)",
    )
    args = parser.parse_args(argv)
    from bench_pairs import interval, within
    from bench_planners import prepared, rounds_of

    current = current_limits()
    values = args.against.split(",")
    if len(values) not in (2, 4):
        parser.error("--against takes CHUNK_MIB,ALONE_MIB or CHUNK_MIB,ALONE_MIB,ROWS,BATCHES")
    mib = 1 << 20
    rows, batches = (int(v) for v in values[2:]) if len(values) == 4 else current[2:]
    other = (int(float(values[0]) * mib), int(float(values[1]) * mib), rows, batches)
    limits = {"current": current, "other": other, "again": current}  # (again: the A/A control)
    rounds = rounds_of(parser, args)

    def spell(limits: Limits) -> str:
        chunk, alone, rows, batches = limits
        return (
            f"{chunk / mib:g} MiB chunks of at most {rows} rows and {batches} batches, "
            f"batches over {alone / mib:g} MiB alone"
        )

    print(
        f"the consumer's chunk limits paired in one process, {rounds} rounds, later epochs: "
        f"current {spell(current)}; other {spell(limits['other'])}"
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
