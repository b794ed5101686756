"""``write_lmdb``: a Caffe LMDB of Datums (or BlobProtos) from NumPy arrays or image
files, from Python.

The records are what Caffe's tools write (``_datum``'s writers): a uint8
``(C, H, W)`` array as ``convert_imageset`` writes a raw image, a float32 array as
pycaffe's ``array_to_datum``, the bytes of an image file as ``convert_imageset
--encoded``; with ``record="blobproto"``, each array as a ``caffe.BlobProto``
of its shape (what ``Blob.to_proto`` writes). The database is built in
``<path>.partial`` in transactions of ``commit_every`` records, the map doubling
whenever one does not fit (Caffe's rule), and renamed into place once complete:
a kill leaves no half-written database under ``path``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

from .._codec import blobproto_bytes
from .._errors import ShapeError
from .._io._encode import encode_encoded_datum, encode_float_datum, encode_raw_datum
from ._lmdbwrite import DEFAULT_MAP_SIZE, LmdbWriter
from ._output import check_output, partial_path, promote, remove_partial

__all__ = ["write_lmdb"]

Record = tuple[npt.ArrayLike | bytes | bytearray | memoryview, int]


def _datum(value: npt.ArrayLike | bytes | bytearray | memoryview, label: int) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return encode_encoded_datum(value, label)
    arr = np.asarray(value)
    if arr.dtype == np.float32:
        return encode_float_datum(arr, label)
    return encode_raw_datum(arr, label)


def _blobproto(value: Any) -> bytes:
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise ShapeError(f"a BlobProto record holds numbers; got an array of {arr.dtype}")
    if arr.dtype != np.float64:  # BlobProto holds float (data) or double (double_data)
        arr = arr.astype(np.float32)
    return blobproto_bytes(arr)


def write_lmdb(
    path: str | os.PathLike[str],
    records: Iterable[Record] | Iterable[npt.ArrayLike],
    *,
    record: Literal["datum", "blobproto"] = "datum",
    keys: Iterable[bytes] | None = None,
    commit_every: int = 1000,
    map_size: int = DEFAULT_MAP_SIZE,
    force: bool = False,
) -> int:
    """Write ``records`` — ``(value, label)`` pairs — to a new LMDB at ``path`` as
    Caffe Datums; returns how many were written.

    A value is a uint8 ``(C, H, W)`` array (a raw image, BGR as Caffe's tools write
    it), a float32 ``(C, H, W)`` array (``float_data``), or the bytes of an image file
    (an encoded Datum, decoded when read). Keys are ``%08d`` of the record's number
    (Caffe's key order is byte order, so records are read in the order given) unless
    ``keys`` gives them. ``map_size`` is the map's first size; it doubles as needed.

    With ``record="blobproto"`` each record is one array (no label), of any shape,
    written as a ``caffe.BlobProto`` of that shape: float64 values as
    ``double_data``, any other numbers as float32 ``data`` (label maps, features,
    regression targets; read back as batches of ``(N, *shape)``).

    Raises:
        OutputExistsError: ``path`` exists and ``force`` is false.
        ShapeError: an array is not 3-D uint8 or float32.
        ProtoError: a label does not fit Datum's int32.
        DataError: the database cannot be written, or two records have one key.
        ValueError: fewer keys than records.
    """
    out = Path(path)
    check_output(out, force=force)
    if commit_every < 1:
        raise ValueError(f"commit_every must be >= 1, got {commit_every}")
    if record not in ("datum", "blobproto"):
        raise ValueError(f"record must be 'datum' or 'blobproto', got {record!r}")
    partial = partial_path(out)
    remove_partial(partial, frozenset({"data.mdb", "lock.mdb"}))
    key_iter = iter(keys) if keys is not None else None
    count = 0
    try:
        with LmdbWriter(partial, map_size=map_size) as writer:
            chunk: list[tuple[bytes, bytes]] = []
            for item in records:
                if record == "blobproto":
                    value = _blobproto(item)
                else:
                    datum, label = cast(Record, item)
                    value = _datum(datum, label)
                if key_iter is None:
                    key = b"%08d" % count
                else:
                    given = next(key_iter, None)
                    if given is None:
                        raise ValueError(f"keys ran out after {count}: one key per record")
                    key = bytes(given)
                chunk.append((key, value))
                count += 1
                if len(chunk) >= commit_every:
                    writer.put_many(chunk, unique=True)
                    chunk = []
            writer.put_many(chunk, unique=True)
            writer.sync()
    except BaseException:
        remove_partial(partial, frozenset({"data.mdb", "lock.mdb"}))  # nothing half-written
        raise
    promote(partial, out, force=force)
    return count
