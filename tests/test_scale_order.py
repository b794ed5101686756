"""The orders for large databases (``_io/_order.py``): the quasi-random order, node
sharding, and the read-ahead of the next batches' values (``_io/_readahead.py``).

Exact: every epoch of every mode is a permutation (or a padded cover) of the
records, seeded and resumable; node parts are disjoint, cover the database and stay
the same from epoch to epoch; every rank of every node has the same number of
batches. The last test runs two torchrun "nodes" on loopback (skipped without torch).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from blobpipe import Batches, LmdbReader
from blobpipe._io._order import QUASI_RUNS, node_parts, node_shard, quasi_order
from blobpipe._io._readahead import ReadAhead
from tests._helpers import image, raw_db


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(seed))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 5000), st.integers(0, 2**32))
def test_quasi_order_is_a_permutation_read_window_by_window(n: int, window: int, seed: int) -> None:
    order = quasi_order(n, window, rng(seed))
    assert sorted(order.tolist()) == list(range(n))
    run = max(1, window // QUASI_RUNS)
    runs = order // run
    # the records of one window come from QUASI_RUNS runs: any stretch of a window's
    # length touches at most two windows' runs
    span = QUASI_RUNS * run
    for start in range(0, n, max(1, span // 2)):
        assert len(set(runs[start : start + span].tolist())) <= 2 * QUASI_RUNS
    assert np.array_equal(order, quasi_order(n, window, rng(seed)))


def test_quasi_order_mixes_within_its_window() -> None:
    order = quasi_order(10_000, 1024, rng(1))
    assert not np.array_equal(order, np.sort(order))
    assert not np.array_equal(order, quasi_order(10_000, 1024, rng(2)))
    # consecutive records mostly stay within a run's window: distances are bounded
    # by the window's span in far more cases than a global shuffle would give
    near = np.abs(np.diff(order)) < 10_000 // 4
    assert near.mean() < 1.0


@pytest.mark.parametrize("world", [1, 3])
def test_batches_quasi_sharded_and_resumed(tmp_path: Path, world: int) -> None:
    db = raw_db(tmp_path / "db", 101, shape=(1, 2, 2))
    seen: list[int] = []
    for rank in range(world):
        options: dict[str, Any] = dict(
            order="quasi", buffer_size=40, seed=5, shard=(rank, world), pad_shards=False,
            mode="epoch",
        )  # fmt: skip
        with Batches(db, 4, **options) as b:
            first = [i for batch in b for i in batch.indices[: batch.valid]]
            mid = b.epoch_order(1)
            it = iter(b)
            head = [next(it) for _ in range(3)]
            state = head[-1].state
            rest = [i for batch in it for i in batch.indices[: batch.valid]]
        with Batches(db, 4, state=state, **options) as again:
            resumed = [i for batch in again for i in batch.indices[: batch.valid]]
        assert resumed == rest
        assert [i for h in head for i in h.indices] + rest == mid.tolist()
        seen += first
    assert sorted(seen) == list(range(101))


def test_quasi_needs_a_window(tmp_path: Path) -> None:
    db = raw_db(tmp_path / "db", 5, shape=(1, 2, 2))
    with pytest.raises(ValueError, match=r"order='quasi' needs buffer_size >= 1"):
        Batches(db, 2, order="quasi")


NODE_CASES = [
    (103, 2, 2), (103, 3, 2), (10, 2, 3), (1000, 4, 1), (7, 2, 2), (64 * 5 + 3, 2, 4),
    (3, 4, 2), (2, 5, 1), (5, 3, 3), (1, 3, 2),  # fewer records than nodes or ranks
]  # fmt: skip


def node_records(parts: list[np.ndarray], node: int) -> set[int]:
    """What node ``node`` may read: its part, or where that is empty (more nodes than
    records) the part it wraps around to, as strided shards wrap."""
    part = parts[node] if len(parts[node]) else parts[node % sum(map(len, parts))]
    return set(part.tolist())


@pytest.mark.parametrize(("n", "nodes", "per_node"), NODE_CASES)
@pytest.mark.parametrize("pad", [True, False, "drop"])
@pytest.mark.parametrize("order", ["shuffle", "key", "quasi"])
def test_node_shards_are_fixed_disjoint_and_even(
    n: int, nodes: int, per_node: int, pad: Any, order: Any
) -> None:
    world = nodes * per_node
    buffer = 16 if order == "quasi" else None
    parts = node_parts(n, nodes, seed=9)
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    lengths = set()
    orders: dict[int, list[np.ndarray]] = {}
    for epoch in (0, 1):
        every: list[int] = []
        for rank in range(world):
            mine = node_shard(n, order, buffer, 9, epoch, rank, world, per_node, pad)
            orders.setdefault(rank, []).append(mine)
            lengths.add(len(mine))
            node = rank // per_node
            assert set(mine.tolist()) <= node_records(parts, node)  # only its node's part
            every += mine.tolist()
        counts = Counter(every)
        if pad is False:
            assert sorted(every) == list(range(n))  # a partition: each record once
        elif pad is True:
            assert all(len(orders[r][epoch]) == -(-n // world) for r in range(world))
            assert set(counts) == set(range(n)) and len(every) == world * -(-n // world)
        else:
            assert len(every) == world * (n // world) and max(counts.values(), default=1) == 1
    if pad is not False:
        assert len(lengths) == 1  # every rank of every node reads as many records
    if order == "shuffle" and n > 50:
        assert any(not np.array_equal(a, b) for a, b in orders.values())  # reshuffled


def test_node_shards_of_fewer_records_than_nodes_give_every_rank_its_batch(
    tmp_path: Path,
) -> None:
    """3 records, 4 nodes of 2 ranks: the nodes past the records wrap around to the
    others' parts (as strided shards wrap), so every rank has its batch; ranks 6 and
    7 raised DataError "holds no records" and in DDP the others waited for them at
    their all-reduce."""
    db = raw_db(tmp_path / "db", 3, shape=(1, 2, 2))
    counts, seen = [], []
    for rank in range(8):
        with Batches(
            db, 2, shard=(rank, 8), shard_mode="node", ranks_per_node=2, pad_shards=True,
            order="shuffle", mode="epoch",
        ) as b:  # fmt: skip
            counts.append(len(b))
            seen += [i for batch in b for i in batch.indices[: batch.valid]]
    assert counts == [1] * 8
    assert len(seen) == 8 and set(seen) == {0, 1, 2}  # every record, some twice


def test_batches_node_mode_needs_ranks_per_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = raw_db(tmp_path / "db", 20, shape=(1, 2, 2))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="needs the ranks per node"):
        Batches(db, 2, shard=(0, 4), shard_mode="node")
    with pytest.raises(ValueError, match="must divide the world size 4"):
        Batches(db, 2, shard=(0, 4), shard_mode="node", ranks_per_node=3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with Batches(db, 2, shard=(3, 4), shard_mode="node", order="shuffle", mode="epoch") as b:
        expected = node_shard(20, "shuffle", None, 0, 0, 3, 4, 2, True)
        assert b.epoch_order(0).tolist() == expected.tolist()
        it = iter(b)
        next(it)
        state = next(it).state
        rest = [i for batch in it for i in batch.indices[: batch.valid]]
    with Batches(
        db, 2, shard=(3, 4), shard_mode="node", order="shuffle", mode="epoch", state=state
    ) as again:
        assert [i for batch in again for i in batch.indices[: batch.valid]] == rest


class FakeSource:
    """Records each will_need call; every record is 10 bytes."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def will_need(
        self, indices: np.ndarray, max_bytes: int, *, now: int = 0, advisor: object = None
    ) -> tuple[int, int]:
        count = max(1, min(len(indices), max_bytes // 10))
        self.calls.append(indices[:count].tolist())
        return count, 10 * count

    def advisor(self) -> None:
        return None


def test_read_ahead_requests_each_record_once_within_its_budget() -> None:
    order = np.arange(1000, 1050, dtype=np.int64)
    src = FakeSource()
    ahead = ReadAhead(src, window=100)  # ten records ahead
    for stop in range(4, 50, 4):  # batches of 4
        ahead.planned(order, 0, stop - 4, stop)
    requested = [i for call in src.calls for i in call]
    assert requested == list(range(1000, 1050))  # in order, once each, the first batch too
    # never more than the budget (ten records) requested beyond the batches planned
    ahead = ReadAhead(src, window=100)
    src.calls.clear()
    for stop in range(4, 50, 4):
        ahead.planned(order, 0, stop - 4, stop)
        done = sum(map(len, src.calls))
        assert done - stop <= 10 and (done - stop >= 6 or done == 50)
    ahead.planned(order, 1, 0, 4)  # a new epoch starts over
    assert src.calls[-1][0] == 1000


def test_will_need_and_evict_keep_reads_exact(tmp_path: Path) -> None:
    db = raw_db(tmp_path / "db", 30, shape=(3, 40, 40))  # overflow pages
    with LmdbReader(db) as r:
        size = len(r.get(r.keys()[0]))
        count, nbytes = r.will_need(np.array([5, 1, 9, 2]), 2 * size + 1)
        assert (count, nbytes) == (2, 2 * size)
        assert r.will_need(np.array([3]), 0) == (1, size)  # at least one
        r.evict()
        with Batches(r, 5, order="shuffle") as b:
            batch = next(iter(b))
        for row, i in enumerate(batch.indices):
            assert np.array_equal(batch.data[row], image(i, (3, 40, 40)).astype(np.float32))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_two_nodes(
    root: Path, db: Path, out: Path, env: dict[str, str], port: int
) -> list[tuple[int, str, str]]:
    """torchrun as node 0 and node 1 (two ranks each) on loopback, each rank writing
    its result into ``out``; (status, stdout, stderr)."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=2",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(root / "tests" / "_node_rank.py"),
                str(db),
                str(out),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=100)
        done.append((p.returncode, out, err))
    return done


@pytest.mark.timeout(240)
def test_two_torchrun_nodes_keep_their_parts(tmp_path: Path) -> None:
    """Two torchrun "nodes" (``--nnodes=2``, ``--node_rank``), two ranks each, a
    rendezvous on 127.0.0.1: node parts disjoint, covering, fixed across epochs;
    equal batch counts on every rank."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    n = 103
    db = raw_db(tmp_path / "db", n, shape=(1, 2, 2))
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    for attempt in range(3):  # a port taken between choosing it and binding it: again
        out = tmp_path / f"results{attempt}"
        out.mkdir()
        outs = launch_two_nodes(root, db, out, env, free_port())
        if not any("address already in use" in err.lower() for _, _, err in outs):
            break
    for code, stdout, err in outs:
        assert code == 0, stdout + err
    results = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    per_node: dict[int, list[set[int]]] = {0: [set(), set()], 1: [set(), set()]}
    for r in results:
        assert r["node"] == r["rank"] // 2
        for epoch in (0, 1):
            per_node[r["node"]][epoch] |= set(r["epochs"][epoch])
        assert r["all_batches"] == [r["batches"][0]] * 4  # equal on every rank
        assert r["batches"] == [r["batches"][0]] * 2
        assert len(r["epochs"][0]) == -(-n // 4)
    for node in (0, 1):
        assert per_node[node][0] == per_node[node][1]  # fixed across epochs
    assert not per_node[0][0] & per_node[1][0]  # disjoint
    assert per_node[0][0] | per_node[1][0] == set(range(n))  # covering
    parts = node_parts(n, 2, seed=3)
    assert [sorted(per_node[k][0]) for k in (0, 1)] == [p.tolist() for p in parts]
