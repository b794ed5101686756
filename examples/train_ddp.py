"""Distributed data-parallel training (PyTorch DDP) fed by a :class:`blobpipe.Loader`.

Run it with torchrun, one process per rank::

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py

1. Without ``--db``, rank 0 writes a small Caffe LMDB with :func:`blobpipe.write_lmdb`
   (``--records`` raw 3×8×8 Datums of ``--classes`` classes; 103 by default, which
   neither 2 nor 3 ranks divide, nor the batch size of 17); its path is broadcast to
   the other ranks. A linear model is sized from the database (its records' shape,
   its largest label + 1).
2. Every rank opens the same LMDB with the Loader's default sharding options:
   ``shard="auto"`` (the initialised process group's rank and size),
   ``pad_shards=True`` (every rank reads ``ceil(records / ranks)`` records, the
   epoch's first records repeated to fill the last shard, as torch's
   ``DistributedSampler``), ``last="keep"``. So every rank runs the same number of
   batches, and no rank is left waiting in DDP's gradient all-reduce.
3. Labels come as int64 (``label_dtype="int64"``), the class indices
   ``CrossEntropyLoss`` takes. Batches reach torch through DLPack without a copy;
   a tensor kept longer keeps its batch (see the README's batch lifetime).

The process group is gloo on CPU and NCCL when torch sees CUDA GPUs (one per rank,
``LOCAL_RANK``); run without torchrun, it trains as one rank. Each rank prints its
batch count and mean loss per epoch, and a line when it has finished.

Usage: torchrun --standalone --nproc_per_node=N examples/train_ddp.py
       [--db LMDB] [--records 103] [--classes 5] [--batch-size 17] [--epochs 2]
       [--lr 0.5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import blobpipe

try:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
except ImportError:  # --help works without torch; main() says what to install
    torch = None  # type: ignore[assignment]

SHAPE = (3, 8, 8)


def write_dataset(path: Path, records: int, classes: int, seed: int = 0) -> Path:
    """``records`` raw Datums: class ``k`` is noise plus a bright row ``k`` in channel
    ``k % 3``, so a linear model can learn it."""
    rng = np.random.default_rng(seed)
    items = []
    for i in range(records):
        label = i % classes
        image = rng.integers(0, 96, size=SHAPE, dtype=np.uint8)
        image[label % 3, label % SHAPE[1], :] = 255
        items.append((image, label))
    blobpipe.write_lmdb(path, items)
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, help="a Caffe LMDB (default: write a small one)")
    parser.add_argument("--records", type=int, default=103, help="records to write (no --db)")
    parser.add_argument("--classes", type=int, default=5, help="classes to write (no --db)")
    parser.add_argument("--batch-size", type=int, default=17, help="records per batch per rank")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data")
    parser.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    parser.add_argument("--workdir", type=Path, help="where rank 0 writes the LMDB (no --db)")
    return parser.parse_args(argv)


def init_process_group(tmp: str) -> torch.device:
    """Join torchrun's process group (or make a one-rank group); the device this
    rank computes on."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "WORLD_SIZE" in os.environ:  # torchrun: MASTER_ADDR, RANK, WORLD_SIZE, LOCAL_RANK
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    if not cuda:
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def database(args: argparse.Namespace, tmp: str) -> Path:
    """``--db``, or the LMDB rank 0 wrote, its path broadcast to every rank."""
    if args.db is not None:
        return Path(args.db)
    path = [None]
    if dist.get_rank() == 0:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        path = [str(write_dataset(workdir / "ddp_lmdb", args.records, args.classes))]
    dist.broadcast_object_list(path, src=0)
    return Path(str(path[0]))


def model_size(db: Path) -> tuple[int, int]:
    """Inputs and classes of a linear model for ``db``: its records' one shape, and
    its largest label + 1."""
    info = blobpipe.inspect_db(db)
    if len(info.shapes) != 1 or not info.labels or min(info.labels) < 0:
        raise SystemExit(
            f"{db}: this example's linear model needs records of one shape and labels "
            f"0..K-1; found shapes {sorted(info.shapes)} and labels {info.label_summary()}"
        )
    (shape,) = info.shapes
    return int(np.prod(shape)), max(info.labels) + 1


def train(args: argparse.Namespace, db: Path, device: torch.device) -> list[int]:
    """Train for ``args.epochs``; the batch count of each epoch."""
    world = dist.get_world_size()
    inputs, classes = model_size(db)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = torch.nn.Linear(inputs, classes).to(device)
    ids = None if device.index is None else [device.index]
    ddp = DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader_device = f"cuda:{device.index}" if device.type == "cuda" else "cpu"
    try:
        blobpipe.get_backend(loader_device)
    except blobpipe.BackendUnavailableError:  # no CuPy: batches on the host, then .to(device)
        loader_device = "cpu"
    counts = []
    with blobpipe.Loader(
        db,
        args.batch_size,
        device=loader_device,
        transform=blobpipe.Transform(scale=1 / 255),
        shuffle=True,
        mode="epoch",
        shard="auto",
        label_dtype="int64",
        workers=1,
    ) as loader:
        for epoch in range(1, args.epochs + 1):
            batches, total, rows = 0, 0.0, 0
            for batch in loader:  # one epoch: len(loader) batches on every rank
                x = torch.from_dlpack(batch.data).to(device).flatten(1)
                y = torch.from_dlpack(batch.label).to(device)
                optimizer.zero_grad()
                loss = loss_fn(ddp(x), y)
                loss.backward()  # DDP all-reduces the gradients here
                optimizer.step()
                batches += 1
                total += loss.item() * len(batch)
                rows += len(batch)
            counts.append(batches)
            say(f"epoch {epoch}: {batches} batches, {rows} records, loss {total / rows:.4f}")
    everyone: list[list[int] | None] = [None] * world
    dist.all_gather_object(everyone, counts)
    say(f"finished {args.epochs} epochs; batches per epoch on ranks 0..{world - 1}: {everyone}")
    return counts


def say(text: str) -> None:
    """One whole line, prefixed with the rank (torchrun interleaves the ranks' output)."""
    sys.stdout.write(f"rank {dist.get_rank()}/{dist.get_world_size()}: {text}\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if torch is None:
        print("train_ddp.py needs PyTorch: pip install torch", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="ddp-") as tmp:
        device = init_process_group(tmp)
        try:
            train(args, database(args, tmp), device)
            dist.barrier()  # rank 0's temporary LMDB stays until every rank has closed it
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
