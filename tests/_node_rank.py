"""One rank of the two-"node" torchrun test (``test_scale_order.py``): reads two epochs
of ``argv[1]`` with ``shard_mode="node"`` and writes what it read as JSON to
``argv[2]/rank<N>.json`` (a file per rank: the ranks of a node share torchrun's
stdout, where their lines can interleave)."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

import blobpipe


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    epochs = []
    with blobpipe.Loader(
        sys.argv[1], 7, device="cpu", workers=1, prefetch=2, shuffle=True, seed=3,
        shard="auto", shard_mode="node", mode="epoch",
    ) as loader:  # fmt: skip
        for _ in range(2):
            batches = [list(b.indices[: b.valid]) for b in loader]
            epochs.append(batches)
    counts: list[int] = [0] * world
    dist.all_gather_object(counts, len(epochs[0]))
    line = {
        "rank": rank,
        "node": int(os.environ["GROUP_RANK"]),
        "epochs": [[i for b in e for i in b] for e in epochs],
        "batches": [len(e) for e in epochs],
        "all_batches": counts,
    }
    with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(line, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
