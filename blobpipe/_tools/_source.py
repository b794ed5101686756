"""Reading records for the tools: an LMDB opened read-only and Datums as arrays.

Temporary: these wrap py-lmdb and ``caffe_pb2`` directly until the reader's
``LmdbReader`` / ``decode_datum`` land; the tools only use this interface.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import numpy.typing as npt

from .._errors import DatabaseNotFoundError, DataError
from .._proto import caffe_pb2
from ._output import partial_path

__all__ = ["Records", "datum_kind", "open_records", "parse_datum", "record_array"]


class Records:
    """Key-ordered records of an LMDB, read-only; a context manager."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not (self.path / "data.mdb").is_file():
            hint = ""
            partial = partial_path(self.path)
            if partial.is_dir():
                hint = (
                    f"; an unfinished conversion is in {str(partial)!r}: rerun the same "
                    "convert-imageset command to finish it"
                )
            raise DatabaseNotFoundError(f"not an LMDB database (no data.mdb){hint}", path=self.path)
        try:
            self._env = lmdb.open(
                str(self.path), readonly=True, lock=False, readahead=False, max_dbs=0
            )
        except lmdb.Error as exc:
            raise DataError(f"cannot open LMDB: {exc}", path=self.path) from exc

    def __enter__(self) -> Records:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return int(self._env.stat()["entries"])

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """``(key, value)`` in key order (Caffe's cursor order)."""
        with self._env.begin(buffers=False) as txn:
            yield from txn.cursor()

    def keys(self, limit: int | None = None) -> list[bytes]:
        """The first ``limit`` keys (all when ``None``)."""
        out: list[bytes] = []
        with self._env.begin() as txn:
            for key in txn.cursor().iternext(keys=True, values=False):
                if limit is not None and len(out) >= limit:
                    break
                out.append(bytes(key))
        return out

    def close(self) -> None:
        self._env.close()


def open_records(path: str | os.PathLike[str]) -> Records:
    """Open ``path`` for reading; raises :class:`DatabaseNotFoundError` if it is not an LMDB."""
    return Records(path)


def parse_datum(value: bytes, *, key: bytes, path: object) -> caffe_pb2.Datum:
    """Parse a serialized Datum; raises :class:`DataError` naming the key."""
    datum = caffe_pb2.Datum()
    try:
        datum.ParseFromString(value)
    except Exception as exc:  # protobuf's DecodeError
        raise DataError("record is not a serialized caffe.Datum", key=key, path=path) from exc
    return datum


def datum_kind(datum: caffe_pb2.Datum) -> str:
    """``"encoded"``, ``"float"`` (float_data) or ``"raw"`` (uint8 data)."""
    if datum.encoded:
        return "encoded"
    if len(datum.float_data) and not datum.data:
        return "float"
    return "raw"


def record_array(value: bytes, *, key: bytes, path: object) -> npt.NDArray[Any]:
    """A record as a ``(C, H, W)`` array: uint8 for raw/encoded, float32 for float_data.

    Encoded records are decoded natively (``IMREAD_UNCHANGED``), like Caffe's
    ``DecodeDatumNative``. Raises :class:`DataError` naming the key.
    """
    datum = parse_datum(value, key=key, path=path)
    if datum.encoded:
        import cv2

        img = cv2.imdecode(np.frombuffer(datum.data, np.uint8), cv2.IMREAD_UNCHANGED)
        if img is None:
            raise DataError("OpenCV cannot decode the encoded image", key=key, path=path)
        img = np.asarray(img)
        if img.dtype != np.uint8:
            raise DataError(f"decoded image is {img.dtype}, expected uint8", key=key, path=path)
        return img[None] if img.ndim == 2 else img.transpose(2, 0, 1)
    shape = (datum.channels, datum.height, datum.width)
    count = shape[0] * shape[1] * shape[2]
    if datum.data:
        flat: npt.NDArray[Any] = np.frombuffer(datum.data, np.uint8)
    else:
        flat = np.asarray(datum.float_data, dtype=np.float32)
    if flat.size != count or count == 0:
        raise DataError(f"Datum holds {flat.size} values for shape {shape}", key=key, path=path)
    return flat.reshape(shape)
