"""``compute_mean``: Caffe's ``compute_image_mean``, bit for bit.

Caffe sums every record into a ``BlobProto`` of floats (float32 additions, in
key order), divides by the record count in float32, and writes the blob with
the legacy ``num=1, channels, height, width`` fields and no ``shape``. Encoded
records are decoded natively (``imdecode(..., IMREAD_UNCHANGED)``). The
per-channel means it logs are float32 running sums of the mean image divided
by ``height * width``; both are reproduced here with sequential float32 sums.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._codec import blobproto_bytes
from .._errors import DataError
from .._io._datum import decode_datum
from ._output import check_output, open_database
from ._progress import Progress

__all__ = ["MeanResult", "compute_mean"]


@dataclass(frozen=True)
class MeanResult:
    """The mean image ``(C, H, W)`` float32, the per-channel means and the record count."""

    mean: npt.NDArray[np.float32]
    channel_means: tuple[float, ...]
    count: int
    path: Path | None


def _channel_means(mean: npt.NDArray[np.float32]) -> tuple[float, ...]:
    c, h, w = mean.shape
    dim = np.float32(h * w)
    out = []
    for plane in mean.reshape(c, h * w):
        # Caffe: float mean_values[c] += data(i), in order; then / dim.
        total = np.add.accumulate(plane, dtype=np.float32)[-1]
        out.append(float(np.float32(total) / dim))
    return tuple(out)


def compute_mean(
    db: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    quiet: bool = True,
) -> MeanResult:
    """The per-pixel mean of the LMDB ``db``, written to ``out`` (a ``.binaryproto``) if given.

    The file equals Caffe's ``compute_image_mean DB OUT`` byte for byte.

    Raises :class:`DatabaseNotFoundError` when ``db`` is not an LMDB,
    :class:`DataError` when it is empty, a record cannot be parsed or decoded,
    or records differ in size (naming the key), and :class:`OutputExistsError`
    when ``out`` exists and ``force`` is false.
    """
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        check_output(out_path, force=force)
    total: npt.NDArray[np.float32] | None = None
    count = 0
    with open_database(db) as reader, Progress(len(reader), "mean", quiet=quiet) as bar:
        for key, value in reader.items():
            arr: npt.NDArray[Any] = decode_datum(value, key=key, path=reader.path)[0]
            if total is None:
                total = np.zeros(arr.shape, dtype=np.float32)
            elif arr.shape != total.shape:
                raise DataError(
                    f"record has shape {arr.shape}, the first record had {total.shape}; "
                    "a mean needs records of one size (convert with --resize-height and "
                    "--resize-width)",
                    key=key,
                    path=reader.path,
                )
            np.add(total, arr, out=total, dtype=np.float32, casting="unsafe")
            count += 1
            bar.advance()
        if total is None:
            raise DataError("database is empty; there is no mean to compute", path=reader.path)
    mean = (total / np.float32(count)).astype(np.float32)
    if out_path is not None:
        tmp = out_path.with_name(out_path.name + ".partial")
        with open(tmp, "wb") as fh:
            fh.write(blobproto_bytes(mean[np.newaxis], legacy=True))
            fh.flush()
            os.fsync(fh.fileno())
        check_output(out_path, force=force)
        os.replace(tmp, out_path)
    return MeanResult(mean=mean, channel_means=_channel_means(mean), count=count, path=out_path)
