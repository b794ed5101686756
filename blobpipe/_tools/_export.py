"""``export``: an LMDB of Datums → blobs on disk, in bounded memory.

Formats (chosen by ``format`` or by OUT's suffix):

* ``npy`` (a directory): ``data.npy`` (N, C, H, W) and ``labels.npy`` (N,),
  float32 unless the transform says uint8. Written with ordinary writes,
  batch by batch: memory use is one batch, whatever N is.
* ``npz`` (``.npz``): the same two arrays in a zip (stored, not compressed),
  copied from those files in streaming fashion.
* ``binaryproto`` (``.binaryproto``/``.pb``): a ``caffe.BlobProtoVector`` of
  two ``BlobProto`` (data, then labels) with ``shape`` fields, streamed to the
  file in protobuf's wire format; protobuf cannot parse messages over 2 GiB,
  so larger exports are refused.

All are built in ``<OUT>.partial`` and renamed into place when complete. The
space an export needs is checked before its data is written; a disk that fills
anyway is a :class:`DiskFullError`. An export that stops for any reason (an
error, Ctrl-C) removes ``<OUT>.partial``; one left by a killed run is removed,
with a warning, by the next export to the same ``OUT`` (an export starts over).
"""

from __future__ import annotations

import contextlib
import logging
import os
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import numpy.typing as npt

from .._errors import DataError, DiskFullError, spell
from .._io._transform import Transform
from ._batchsource import open_batches
from ._output import (
    MARKER_NAME,
    check_output,
    check_space,
    disk_full,
    partial_path,
    promote,
    remove_partial,
    write_marker,
)
from ._progress import Progress

__all__ = ["ExportResult", "export"]

Format = Literal["npy", "npz", "binaryproto"]
_FORMATS = ("npy", "npz", "binaryproto")
_log = logging.getLogger("blobpipe")
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
    record shapes, or a binaryproto over protobuf's 2 GiB limit,
    :class:`DiskFullError` when the export does not fit on the disk (the partial
    output is removed), and :class:`ValueError` for bad options.
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
    staging = partial_path(out_path)
    with open_batches(db, batch_size=rows, transform=transform, shard=shard) as batches:
        total = (
            batches.records_per_epoch if limit is None else min(limit, batches.records_per_epoch)
        )
        if total == 0:
            raise DataError("nothing to export: limit 0 selects no records", path=db_path)
        if staging.exists():
            _log.warning(
                "removing %r: an unfinished export left by an interrupted run (an export "
                "starts over)",
                str(staging),
            )
        remove_partial(staging, _STAGING_FILES)
        staging.mkdir(parents=True)
        try:
            try:
                write_marker(staging, {"kind": "export", "complete": False})
                shape, dtype = _write_arrays(batches, staging, total, fmt, db_path, quiet)
            except OSError as exc:
                raise _removed_when_full(exc, staging) from exc
        except BaseException:
            _abandon(staging)
            raise
    try:
        try:
            _finish(staging, out_path, fmt, shape, batch_size, force)
        except OSError as exc:
            raise _removed_when_full(exc, staging) from exc
    except BaseException:
        _abandon(staging)
        raise
    return ExportResult(path=out_path, format=fmt, count=total, shape=shape, dtype=dtype)


def _abandon(staging: Path) -> None:
    """An export that stopped (an error, Ctrl-C) removes what it wrote: an export
    cannot be resumed. What cannot be removed is named in a warning."""
    with contextlib.suppress(OSError):
        remove_partial(staging, _STAGING_FILES)
    if staging.exists():
        _log.warning(
            "the unfinished export is left in %r; delete it, or run the export again "
            "(it starts over)",
            str(staging),
        )


def _removed_when_full(exc: OSError, staging: Path) -> OSError:
    """``exc``, or for a full disk a :class:`DiskFullError`, once ``staging`` is removed."""
    full = (
        exc
        if isinstance(exc, DiskFullError)
        else disk_full(
            exc, staging, "the partial export was removed; free some space or export elsewhere"
        )
    )
    if full is None:
        return exc
    with contextlib.suppress(OSError):
        remove_partial(staging, _STAGING_FILES)
    return full


def _npy_header(fh: BinaryIO, dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(fh, header)


def _write_arrays(
    batches: Any, staging: Path, total: int, fmt: Format, db_path: str, quiet: bool
) -> tuple[tuple[int, ...], str]:
    """Write ``data.npy`` and ``labels.npy`` into ``staging`` with ordinary writes (a
    full disk is then an ``ENOSPC`` error, not a SIGBUS in a memory map), batch by
    batch; the space they need is checked once the first batch gives the shape.
    Returns the data's shape and dtype."""
    shape: tuple[int, ...] = ()
    dtype = np.dtype(np.float32)
    first_key = b""
    filled = 0
    with (
        open(staging / "labels.npy", "wb") as labels,
        open(staging / "data.npy", "wb") as data,
        Progress(total, "export", quiet=quiet) as bar,
    ):
        _npy_header(labels, np.dtype("<f4"), (total,))
        for batch in batches:
            n = min(len(batch.keys), total - filled)
            if not shape:
                first_key = batch.keys[0]
                shape = (total, *(int(s) for s in batch.data.shape[1:]))
                dtype = np.dtype(batch.data.dtype).newbyteorder("<")
                _check_proto_size(fmt, shape, db_path)
                need = int(np.prod(shape)) * dtype.itemsize + 4 * total + 256
                copies = {"npy": 1, "npz": 2, "binaryproto": 1}[fmt]
                proto = 4 * int(np.prod(shape)) + 4 * total if fmt == "binaryproto" else 0
                check_space(staging, copies * need + proto, f"an export of shape {shape}")
                _npy_header(data, dtype, shape)
            elif batch.data.shape[1:] != shape[1:]:
                raise DataError(
                    f"record gives shape {batch.data.shape[1:]}, the first record "
                    f"{first_key!r} gave {shape[1:]}; an export needs records of one "
                    f"size: crop them ({spell('crop_size', 'N', placeholder=True)}), or "
                    "resize them when converting",
                    key=batch.keys[0],
                    path=db_path,
                )
            data.write(np.ascontiguousarray(batch.data[:n], dtype).tobytes())
            # BlobProto records have no labels: zeros
            label = batch.label[:n] if batch.label is not None else np.zeros(n)
            labels.write(np.ascontiguousarray(label, "<f4").tobytes())
            filled += n
            bar.advance(n)
            if filled == total:
                break
        if not shape or filled != total:
            raise DataError(f"expected {total} records, read {filled}", path=db_path)
        for fh in (data, labels):
            fh.flush()
            os.fsync(fh.fileno())
    return shape, str(dtype.newbyteorder("="))


def _finish(
    staging: Path, out_path: Path, fmt: Format, shape: tuple[int, ...], rows: int, force: bool
) -> None:
    """Turn the arrays in ``staging`` into ``out_path`` in format ``fmt``."""
    if fmt == "npy":
        (staging / MARKER_NAME).unlink()
        promote(staging, out_path, force=force)
        return
    final = staging / ("out.npz" if fmt == "npz" else "out.binaryproto")
    if fmt == "npz":
        with zipfile.ZipFile(final, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            zf.write(staging / "data.npy", "data.npy")
            zf.write(staging / "labels.npy", "labels.npy")
    else:
        with open(final, "wb") as fh:
            _write_blob(fh, np.load(staging / "data.npy", mmap_mode="r"), rows)
            _write_blob(fh, np.load(staging / "labels.npy", mmap_mode="r"), 1 << 20)
    with open(final, "rb+") as fh:
        os.fsync(fh.fileno())
    check_output(out_path, force=force)
    if out_path.is_dir() and not out_path.is_symlink():
        promote(final, out_path, force=force)
    else:
        os.replace(final, out_path)
    remove_partial(staging, _STAGING_FILES)
