"""NCHW (Caffe's layout) vs NHWC: the worked offset and RGB→gray in both.

1. The element (n, c, h, w) = (2, 1, 3, 9) of a batch with C=3, H=8, W=16
   lives at ((n·C + c)·H + h)·W + w = 953 in NCHW (Blob.offset) and at
   ((n·H + h)·W + w)·C + c = 940 in NHWC.
2. Gray = 0.299 R + 0.587 G + 0.114 B of Caffe's mean image (its channels are
   B, G, R, as OpenCV stores them), computed on NCHW planes and on NHWC
   pixels: the two agree.

Usage: python examples/layout.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from blobpipe import read_blobproto
from blobpipe._blob import Blob
from blobpipe._layout import nchw_offset, nchw_to_nhwc, nhwc_offset

MEAN = Path(__file__).resolve().parent.parent / "tests/data/caffe/raw_color_mean.binaryproto"
BGR_LUMA = np.array([0.114, 0.587, 0.299], np.float32)  # weights of B, G, R


def worked_offset() -> bool:
    _, C, H, W = shape = (4, 3, 8, 16)
    n, c, h, w = 2, 1, 3, 9
    print(f"1. element (n, c, h, w) = {(n, c, h, w)} of an N×C×H×W = {shape} batch")
    with Blob(shape, backend="cpu") as blob:
        blob.mutable_cpu_data()[...] = np.arange(blob.count()).reshape(shape)
        nchw = blob.offset(n, c, h, w)
        print(f"   NCHW: ((n·C + c)·H + h)·W + w = (({n}·{C} + {c})·{H} + {h})·{W} + {w} = {nchw}")
        print(f"         Blob.offset(2, 1, 3, 9) = {nchw}, "
              f"data_at = {blob.data_at(n, c, h, w):.0f}")
        nhwc_array = nchw_to_nhwc(blob.cpu_data())
    nhwc = nhwc_offset(shape, n, c, h, w)
    print(f"   NHWC: ((n·H + h)·W + w)·C + c = (({n}·{H} + {h})·{W} + {w})·{C} + {c} = {nhwc}")
    print(f"         the NHWC array holds {nhwc_array.ravel()[nhwc]:.0f} there")
    return nchw == nchw_offset(shape, n, c, h, w) == 953 and nhwc_array.ravel()[nhwc] == 953


def gray() -> bool:
    print("\n2. RGB→gray of Caffe's mean image (BGR channel planes)")
    with read_blobproto(MEAN, backend="cpu") as mean:
        nchw = mean.cpu_data()  # 1×3×32×40, channels B, G, R
        print(f"   mean image: {mean.shape_string()}")
        # NCHW: a weighted sum of three contiguous H×W planes.
        gray_planes = sum(BGR_LUMA[c] * nchw[:, c] for c in range(3))
        # NHWC: every pixel's three channels are adjacent: one dot product each.
        nhwc = nchw_to_nhwc(nchw)
        gray_pixels = nhwc @ BGR_LUMA
        h, w = 16, 20
        b, g, r = nchw[0, :, h, w]
        print(f"   pixel (h={h}, w={w}): B={b:.2f} G={g:.2f} R={r:.2f}")
        print(f"   NCHW planes: gray = {gray_planes[0, h, w]:.4f}")
        print(f"   NHWC pixels: gray = {gray_pixels[0, h, w]:.4f}")
        diff = float(np.abs(gray_planes - gray_pixels).max())
        print(f"   largest difference over the image: {diff:.2e}")
        return diff < 1e-3


def main() -> int:
    ok = worked_offset() & gray()
    print("\nok" if ok else "\nMISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
