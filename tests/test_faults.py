"""Fault injection: seeded byte flips over a small database, each read in a worker process.

Every flip's copy is read twice, by py-lmdb's own cursor and by one epoch of
:class:`blobpipe.Batches`, each in worker processes (``tests/_faults.py``) that
report one line per flip; a worker that dies or hangs is replaced and the flip it
was on re-run alone. blobpipe must give LMDB's data exactly or a clean
:class:`~blobpipe.BlobpipeError` naming the copy: never a signal, a hang, another
exception, or a batch that differs from what LMDB's cursor reads.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import blobpipe
from tests._faults import Flip, run_flips
from tests._helpers import lmdb_stat, write_lmdb

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
