"""Sharded Loaders as distributed training uses them: what keeps DDP from hanging.

A rank with one batch more than another waits in DDP's gradient all-reduce until the
process group times out. So with the default options every rank's epoch has the same
number of batches, whatever the record count, batch size and world size, and the
shards together are exactly what each ``pad_shards`` mode promises: every record once
plus the padding (True), every record once (False), every record but the epoch's
last ``n % world`` once (``"drop"``). ``Batches``' own shard tests are in
``test_batches.py``; these run the :class:`~blobpipe.Loader`, two epochs and a resume
per rank. The last test runs real torch processes (``mp.spawn``), skipped without torch.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from blobpipe import Loader
from tests._helpers import raw_db

# record count, world size, batch size: none divides evenly
UNEVEN = [(103, 2, 17), (103, 4, 5), (10, 3, 3), (7, 3, 2)]


def run_rank(db: Path, batch: int, rank: int, world: int, **options: Any) -> list[list[int]]:
    """Each of two epochs of rank ``rank`` as the records of its batches (real rows)."""
    with Loader(
        db, batch, device="cpu", workers=1, prefetch=2, shard=(rank, world), **options
    ) as loader:
        epochs = []
        for _ in range(2):
            batches = [list(b.indices[: b.valid]) for b in loader]
            assert len(batches) == len(loader)
            epochs.append(batches)
    return [[i for b in epoch for i in b] for epoch in epochs]


@pytest.mark.parametrize("shard_mode", ["strided", "contiguous"])
@pytest.mark.parametrize("pad_shards", ["default", "drop", False])
@pytest.mark.parametrize(("n", "world", "batch"), UNEVEN)
def test_ranks_get_equal_batches_and_exact_shards(
    tmp_path: Path, n: int, world: int, batch: int, shard_mode: str, pad_shards: Any
) -> None:
    db = raw_db(tmp_path / "db", n, shape=(1, 2, 2))
    options: dict[str, Any] = {"mode": "epoch", "shuffle": True, "seed": 7}
    options["shard_mode"] = shard_mode
    if pad_shards != "default":
        options["pad_shards"] = pad_shards
    counts = []
    ranks = []
    for rank in range(world):
        with Loader(db, batch, device="cpu", shard=(rank, world), **options) as loader:
            counts.append(len(loader))
        ranks.append(run_rank(db, batch, rank, world, **options))
    for epoch in range(2):
        records = Counter(i for r in ranks for i in r[epoch])
        per_rank = [len(r[epoch]) for r in ranks]
        if pad_shards == "default":  # DistributedSampler: ceil(n / world) each, padded
            per = -(-n // world)
            assert set(records) == set(range(n))
            assert sorted(records.values(), reverse=True) == [2] * (per * world - n) + [1] * (
                n - (per * world - n)
            )
        elif pad_shards == "drop":  # n // world each, disjoint: the epoch's last n % world unread
            per = n // world
            assert max(records.values()) == 1
            assert len(records) == per * world
        else:  # disjoint and complete; lengths differ by at most one
            per = -1
            assert records == Counter(range(n))
            assert max(per_rank) - min(per_rank) <= 1
        if pad_shards is not False:
            assert per_rank == [per] * world
            assert len(set(counts)) == 1, counts  # the property DDP needs
    # shuffled: the second epoch is another order, the same records per epoch when
    # nothing is left out
    assert [r[0] for r in ranks] != [r[1] for r in ranks]
    assert counts == [-(-len(r[0]) // batch) for r in ranks]  # last="keep": a partial last


@pytest.mark.parametrize("shard_mode", ["strided", "contiguous"])
def test_a_resumed_rank_reads_the_rest_of_its_shard(tmp_path: Path, shard_mode: str) -> None:
    """Resumed mid-epoch (``load_state_dict``), each rank reads what its uninterrupted
    run would have: the same batch count to the end of the epoch, the same records."""
    n, world, batch = 103, 3, 5
    db = raw_db(tmp_path / "db", n, shape=(1, 2, 2))
    options: dict[str, Any] = {
        "device": "cpu", "workers": 1, "mode": "epoch", "shuffle": True, "seed": 3,
        "shard_mode": shard_mode,
    }  # fmt: skip
    for rank in range(world):
        with Loader(db, batch, shard=(rank, world), **options) as loader:
            whole = [list(b.indices) for b in loader] + [list(b.indices) for b in loader]
        with Loader(db, batch, shard=(rank, world), **options) as loader:
            it = iter(loader)
            head = [list(next(it).indices) for _ in range(4)]
            state = loader.state_dict()
        resumed = Loader(db, batch, shard=(rank, world), **options)
        resumed.load_state_dict(state)
        with resumed:
            rest = [list(b.indices) for b in resumed] + [list(b.indices) for b in resumed]
        first_epoch = len(whole) // 2
        assert head + rest[: first_epoch - 4] == whole[:first_epoch]
        assert rest[first_epoch - 4 :] == whole[first_epoch:]


# -- shard="auto" with a real torch process group ----------------------------------------------


def _spawned_rank(rank: int, world: int, init: str, db: str, out: str) -> None:
    """One ``mp.spawn`` process: a process group from ``init_process_group(rank=,
    world_size=)`` (no RANK/WORLD_SIZE in the environment), then ``shard="auto"``."""
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(name, None)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        with Loader(db, 4, device="cpu", workers=1, mode="epoch", shard="auto") as loader:
            records = [int(i) for b in loader for i in b.indices[: b.valid]]
            counts = [len(loader)]
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, counts)
        Path(out, f"rank{rank}.json").write_text(json.dumps([gathered, records]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shard_auto_reads_a_process_group_started_by_mp_spawn(tmp_path: Path) -> None:
    torch_mp = pytest.importorskip("torch.multiprocessing")
    n, world = 11, 2
    db = raw_db(tmp_path / "db", n, shape=(1, 2, 2))
    init = f"file://{tmp_path / 'pg'}"
    torch_mp.spawn(_spawned_rank, args=(world, init, str(db), str(tmp_path)), nprocs=world)
    ranks = []
    for rank in range(world):
        counts, records = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert counts == [[2], [2]]  # 6 records each: 4 + 2
        ranks.append(records)
    # strided shards of key order, padded with the first record: 0, 2, ... / 1, 3, ..., 0
    assert ranks == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 0]]
