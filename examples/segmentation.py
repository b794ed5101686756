"""Segmentation-style data: images (Datums) and label maps (BlobProtos) read in lockstep.

Caffe users with dense targets train with two Data layers reading two LMDBs with
the same keys. blobpipe reads them as one dataset: one order, one shuffle, and
the same random crop and flip for an image and its label map.

    python examples/segmentation.py [--records 200] [--device auto]

It writes two small LMDBs (synthetic images of discs, and their per-pixel class
maps), reads them with random crops and mirrors shared between the two, and
checks every pixel: the class map must still say "disc" exactly where the image
shows one.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import blobpipe

HEIGHT, WIDTH, CROP = 64, 80, 48
MEAN = (40.0, 40.0, 40.0)


def make_record(i: int) -> tuple[np.ndarray, np.ndarray]:
    """Image ``i`` (uint8, BGR planes) with a few discs, and its class map (1, H, W)."""
    rng = np.random.default_rng(i)
    yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH]
    classes = np.zeros((HEIGHT, WIDTH), np.uint8)
    for _ in range(rng.integers(1, 4)):
        cy, cx, r = rng.integers(0, HEIGHT), rng.integers(0, WIDTH), rng.integers(6, 16)
        classes[(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = 1
    noise = rng.integers(0, 40, (3, HEIGHT, WIDTH))
    image = np.where(classes == 1, 180, 20) + noise  # discs bright, background dark
    return image.astype(np.uint8), classes[np.newaxis]


def write_dataset(root: Path, n: int) -> dict[str, Path]:
    records = [make_record(i) for i in range(n)]
    images, labels = root / "images_lmdb", root / "labels_lmdb"
    blobpipe.write_lmdb(images, ((img, 0) for img, _ in records))  # raw Datums
    blobpipe.write_lmdb(labels, (cls for _, cls in records), record="blobproto")
    return {"data": images, "label": labels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--no-share", action="store_true", help="crop and flip the two sources independently"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        sources = write_dataset(Path(tmp), args.records)
        transform = {
            "data": blobpipe.Transform(crop_size=CROP, mirror=True, mean_value=MEAN),
            "label": blobpipe.Transform(crop_size=CROP, mirror=True),  # no mean on classes
        }
        with blobpipe.Loader(
            sources, args.batch_size, device=args.device, transform=transform,
            share_random=not args.no_share, shuffle=True, mode="epoch", phase="train",
        ) as loader:  # fmt: skip
            for epoch in range(args.epochs):
                rows = pixels = 0
                shapes = ""
                for batch in loader:
                    data = batch.data.cpu_data()  # (N, 3, 48, 48), mean subtracted
                    label = batch.label  # the "label" source, cropped alike: (N, 1, 48, 48)
                    assert label is not None
                    classes = label.cpu_data()[:, 0]
                    disc = data[:, 0] + MEAN[0] >= 180  # bright pixels are discs
                    if not np.array_equal(disc, classes == 1):
                        print(f"epoch {epoch}: label map and image disagree in {batch.keys[0]!r}")
                        return 1
                    rows += len(batch)
                    pixels += classes.size
                    shapes = f"data {tuple(data.shape[1:])}, label {tuple(label.shape[1:])}"
                print(
                    f"epoch {epoch}: {rows} rows ({shapes}) on {loader.backend.name}; "
                    f"{pixels} label pixels checked against the image: all agree"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
