"""Train a softmax classifier on scikit-learn's digits, fed by ``async for batch in loader``.

1. scikit-learn's bundled digits (1797 8×8 gray images, 10 classes, values
   0..16) are scaled to 0..255 and written as raw Caffe Datums (1×8×8 uint8)
   into two LMDBs, train and test (a seeded 80/20 split).
2. A :class:`blobpipe.Loader` reads the train LMDB with ``scale=1/255``,
   shuffled, one epoch per ``async for``, prefetching onto the device
   (``--device auto``: CUDA when CuPy sees a GPU, else the host).
3. The weights and bias are Blobs on the loader's backend.
   The gradient is computed where the batch is (NumPy on the host, CuPy on
   CUDA through ``batch.data.gpu_data()``), written scaled by the learning
   rate into the blobs' diffs, and applied with ``blob.update()``
   (``data -= diff``, Caffe's ``Update``).
4. Accuracy is measured on the test LMDB with a ``mode="epoch"`` loader.

Usage: python examples/train_digits.py [--epochs 15] [--batch-size 64]
       [--device auto|cpu|cuda] [--lr 0.5] [--workers N] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import lmdb
import numpy as np
from sklearn.datasets import load_digits

import blobpipe

CLASSES = 10
FEATURES = 8 * 8


@dataclass(frozen=True)
class Result:
    """What a run measured."""

    losses: list[float]  # mean training loss per epoch
    accuracy: float  # on the test LMDB
    records_per_second: float  # training records through the loader and the step
    device: str  # the backend's name


def write_lmdbs(workdir: Path, seed: int = 0) -> tuple[Path, Path]:
    """The digits as raw Datums: ``workdir/digits_train`` and ``workdir/digits_test``."""
    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)  # (1797, 8, 8), 0..255
    order = np.random.default_rng(seed).permutation(len(pixels))
    n_train = len(pixels) * 4 // 5
    paths = []
    for name, rows in (("train", order[:n_train]), ("test", order[n_train:])):
        path = workdir / f"digits_{name}"
        env = lmdb.open(str(path), map_size=1 << 26)
        with env.begin(write=True) as txn:
            for i, row in enumerate(rows):
                datum = blobpipe.encode_raw_datum(pixels[row][None], int(digits.target[row]))
                txn.put(f"{i:08d}".encode(), datum)
        env.close()
        paths.append(path)
    return paths[0], paths[1]


def on_device(blob: blobpipe.Blob) -> Any:
    """The blob's data where the backend computes: CuPy on CUDA, NumPy on the host."""
    return blob.gpu_data() if blob.backend.has_device else blob.cpu_data()


def write_diff(blob: blobpipe.Blob, value: Any) -> None:
    """Set the blob's diff to ``value`` on the side of the computation."""
    if blob.backend.has_device:
        blob.mutable_gpu_diff()[...] = value
    else:
        blob.mutable_cpu_diff()[...] = value


def softmax(xp: Any, logits: Any) -> Any:
    z = logits - logits.max(axis=1, keepdims=True)
    e = xp.exp(z)
    return e / e.sum(axis=1, keepdims=True)


async def train(args: argparse.Namespace, train_db: Path, test_db: Path) -> Result:
    transform = blobpipe.Transform(scale=1 / 255)
    options: dict[str, Any] = {
        "device": args.device,
        "transform": transform,
        "mode": "epoch",
        "workers": args.workers,
    }
    losses: list[float] = []
    async with blobpipe.Loader(
        train_db, args.batch_size, shuffle=True, seed=args.seed, **options
    ) as loader:
        backend = loader.backend
        xp = backend.xp if backend.has_device else np
        weight = blobpipe.Blob((CLASSES, FEATURES), backend=backend)
        bias = blobpipe.Blob((CLASSES,), backend=backend)
        weight.mutable_cpu_data()[...] = 0  # a convex problem: zeros are a fine start
        bias.mutable_cpu_data()[...] = 0
        eye = xp.eye(CLASSES, dtype=xp.float32)
        start = time.perf_counter()
        for epoch in range(args.epochs):
            total, rows = 0.0, 0
            async for batch in loader:
                x = on_device(batch.data).reshape(len(batch), FEATURES)
                y = on_device(batch.label).astype(xp.int64)
                p = softmax(xp, x @ on_device(weight).T + on_device(bias))
                n = len(batch)
                total += float(-xp.log(p[xp.arange(n), y] + 1e-12).sum())
                rows += n
                dlogits = (p - eye[y]) / n  # d(mean cross-entropy)/d(logits)
                write_diff(weight, args.lr * (dlogits.T @ x))
                write_diff(bias, args.lr * dlogits.sum(axis=0))
                weight.update()  # data -= diff
                bias.update()
            losses.append(total / rows)
            print(f"epoch {epoch + 1:3d}: loss {losses[-1]:.4f}")
        seconds = time.perf_counter() - start
        stats = loader.statistics()

        correct = seen = 0
        async with blobpipe.Loader(test_db, args.batch_size, phase="test", **options) as test:
            async for batch in test:
                x = on_device(batch.data).reshape(len(batch), FEATURES)
                predicted = (x @ on_device(weight).T + on_device(bias)).argmax(axis=1)
                correct += int((predicted == on_device(batch.label).astype(xp.int64)).sum())
                seen += len(batch)
        weight.close()
        bias.close()
    accuracy = correct / seen
    throughput = stats.records / seconds
    print(f"test accuracy: {accuracy:.4f} ({correct}/{seen})")
    print(
        f"throughput: {throughput:,.0f} records/s on {backend.name} "
        f"({stats.batches} batches in {seconds:.2f} s; waited {stats.wait_time:.2f} s "
        "for the loader)"
    )
    return Result(losses, accuracy, throughput, backend.name)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15, help="passes over the train set")
    parser.add_argument("--batch-size", type=int, default=64, help="records per batch")
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument("--lr", type=float, default=0.5, help="learning rate (default 0.5)")
    parser.add_argument(
        "--workers", type=int, help="loader threads (default: the CPU count; 1 suits 8x8 images)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the split and the shuffle")
    parser.add_argument(
        "--workdir", type=Path, help="where to write the LMDBs (default: a temporary dir)"
    )
    return parser.parse_args(argv)


def run(argv: Sequence[str] | None = None) -> Result:
    """Parse ``argv``, write the LMDBs, train and evaluate."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="digits-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        train_db, test_db = write_lmdbs(workdir, args.seed)
        return anyio.run(train, args, train_db, test_db)


def main(argv: Sequence[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
