"""``export``: an LMDB of Datums → blobs on disk, in bounded memory.

Formats (chosen by ``format`` or by OUT's suffix):

* ``npy`` (a directory): ``data.npy`` (N, C, H, W) and ``labels.npy`` (N,),
  float32 unless the transform says uint8. Written through ``numpy``
  memory maps, batch by batch: memory use is one batch, whatever N is.
* ``npz`` (``.npz``): the same two arrays in a zip (stored, not compressed),
  copied from the memory-mapped files in streaming fashion.
* ``binaryproto`` (``.binaryproto``/``.pb``): a ``caffe.BlobProtoVector`` of
  two ``BlobProto`` (data, then labels) with ``shape`` fields, streamed to the
  file in protobuf's wire format; protobuf cannot parse messages over 2 GiB,
  so larger exports are refused.

All are built in ``<OUT>.partial`` and renamed into place when complete.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import numpy.typing as npt

from .._errors import DataError
from .._io._transform import Transform
from ._batchsource import open_batches
from ._output import check_output, partial_path, promote, remove_partial, write_marker
from ._progress import Progress

__all__ = ["ExportResult", "export"]

Format = Literal["npy", "npz", "binaryproto"]
_FORMATS = ("npy", "npz", "binaryproto")
_STAGING_FILES = frozenset({"data.npy", "labels.npy", "out.npz", "out.binaryproto"})
_PROTO_LIMIT = 2**31 - 1


@dataclass(frozen=True)
class ExportResult:
    """Where the export went, in which format, how many records and the data shape."""

    path: Path
    format: str
    count: int
    shape: tuple[int, ...]
    dtype: str


def _infer_format(out: Path) -> Format:
    suffix = out.suffix.lower()
    if suffix == ".npz":
        return "npz"
    if suffix in (".binaryproto", ".pb"):
        return "binaryproto"
    return "npy"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _shape_message(shape: tuple[int, ...]) -> bytes:
    dims = b"".join(_varint(d) for d in shape)
    return b"\x0a" + _varint(len(dims)) + dims  # BlobShape.dim = 1, packed


def _blob_header(shape: tuple[int, ...], count: int) -> tuple[bytes, bytes]:
    """The bytes before and after a BlobProto's float payload (data = 5, shape = 7)."""
    payload = 4 * count
    shape_msg = _shape_message(shape)
    head = b"\x2a" + _varint(payload)
    tail = b"\x3a" + _varint(len(shape_msg)) + shape_msg
    body_len = len(head) + payload + len(tail)
    return b"\x0a" + _varint(body_len) + head, tail  # BlobProtoVector.blobs = 1


def _chunks(arr: npt.NDArray[Any], rows: int) -> Iterator[npt.NDArray[np.float32]]:
    for start in range(0, arr.shape[0], rows):
        yield np.ascontiguousarray(arr[start : start + rows], dtype="<f4")


def _write_blob(fh: BinaryIO, arr: npt.NDArray[Any], rows: int) -> None:
    head, tail = _blob_header(tuple(int(s) for s in arr.shape), int(arr.size))
    fh.write(head)
    for chunk in _chunks(arr, rows):
        fh.write(chunk.tobytes())
    fh.write(tail)


def _check_proto_size(fmt: Format, shape: tuple[int, ...], db_path: str) -> None:
    if fmt != "binaryproto":
        return
    size = 4 * int(np.prod(shape)) + 4 * shape[0] + 64
    if size > _PROTO_LIMIT:
        raise DataError(
            f"a binaryproto of shape {shape} would be {size} bytes, over "
            "protobuf's 2 GiB limit; export to .npy or .npz instead",
            path=db_path,
        )


def export(
    db: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    format: Format | None = None,
    transform: Transform | None = None,
    batch_size: int = 256,
    limit: int | None = None,
    shard: tuple[int, int] | None = None,
    force: bool = False,
    quiet: bool = True,
) -> ExportResult:
    """Export the records of ``db`` (transformed, TEST phase, key order) to ``out``.

    ``shard=(i, n)`` keeps every n-th record starting at i; ``limit`` keeps the
    first ``limit`` of those. Reading the export back gives exactly the
    concatenated batches of the loader with the same transform.

    Raises :class:`OutputExistsError` when ``out`` exists and ``force`` is
    false, :class:`DatabaseNotFoundError` for a missing database,
    :class:`DataError` for an empty selection, an unreadable record or mixed
    record shapes, or a binaryproto over protobuf's 2 GiB limit, and
    :class:`ValueError` for bad options.
    """
    out_path = Path(out)
    fmt: Format = format if format is not None else _infer_format(out_path)
    if fmt not in _FORMATS:
        raise ValueError(f"format must be one of {', '.join(_FORMATS)}; got {fmt!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    check_output(out_path, force=force)
    db_path = os.fspath(db)
    # A limit below the batch size reads no more records than it keeps.
    rows = batch_size if not limit else min(batch_size, limit)
    with open_batches(db, batch_size=rows, transform=transform, shard=shard) as batches:
        total = (
            batches.records_per_epoch if limit is None else min(limit, batches.records_per_epoch)
        )
        if total == 0:
            raise DataError("nothing to export: limit 0 selects no records", path=db_path)
        staging = partial_path(out_path)
        remove_partial(staging, _STAGING_FILES)
        staging.mkdir(parents=True)
        write_marker(staging, {"kind": "export", "complete": False})

        data: np.memmap[Any, Any] | None = None
        labels = np.lib.format.open_memmap(
            staging / "labels.npy", mode="w+", dtype=np.float32, shape=(total,)
        )
        first_key = b""
        filled = 0
        with Progress(total, "export", quiet=quiet) as bar:
            for batch in batches:
                n = min(len(batch.keys), total - filled)
                if data is None:
                    first_key = batch.keys[0]
                    shape = (total, *batch.data.shape[1:])
                    _check_proto_size(fmt, shape, db_path)
                    data = np.lib.format.open_memmap(
                        staging / "data.npy", mode="w+", dtype=batch.data.dtype, shape=shape
                    )
                elif batch.data.shape[1:] != data.shape[1:]:
                    raise DataError(
                        f"record gives shape {batch.data.shape[1:]}, the first record "
                        f"{first_key!r} gave {data.shape[1:]}; an export needs records of one "
                        "size (crop with --crop-size, or convert with "
                        "--resize-height/--resize-width)",
                        key=batch.keys[0],
                        path=db_path,
                    )
                data[filled : filled + n] = batch.data[:n]
                if batch.label is not None:  # BlobProto records have none: zeros
                    labels[filled : filled + n] = batch.label[:n]
                filled += n
                bar.advance(n)
                if filled == total:
                    break
    if data is None or filled != total:
        raise DataError(f"expected {total} records, read {filled}", path=db_path)
    data.flush()
    labels.flush()
    result_shape = tuple(int(s) for s in data.shape)
    dtype = str(data.dtype)

    if fmt == "npy":
        del data, labels
        (staging / "blobpipe-partial.json").unlink()
        promote(staging, out_path, force=force)
    else:
        final = staging / ("out.npz" if fmt == "npz" else "out.binaryproto")
        if fmt == "npz":
            del data, labels
            with zipfile.ZipFile(final, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                zf.write(staging / "data.npy", "data.npy")
                zf.write(staging / "labels.npy", "labels.npy")
        else:
            with open(final, "wb") as fh:
                _write_blob(fh, data, batch_size)
                _write_blob(fh, labels, 1 << 20)
            del data, labels
        with open(final, "rb+") as fh:
            os.fsync(fh.fileno())
        check_output(out_path, force=force)
        if out_path.is_dir() and not out_path.is_symlink():
            promote(final, out_path, force=force)
        else:
            os.replace(final, out_path)
        remove_partial(staging, _STAGING_FILES)
    return ExportResult(path=out_path, format=fmt, count=total, shape=result_shape, dtype=dtype)
