"""Reading records for the tools: an LMDB opened read-only and Datums as arrays.

Records are decoded by the io layer's Datum codec (``_io._datum``). The LMDB
side is a thin read-only wrapper until the reader's ``LmdbReader`` lands; it
already has the ``keys()``/``get()`` pair ``Batches`` reads through.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy.typing as npt

from .._errors import DatabaseNotFoundError, DataError
from .._io._datum import ParsedDatum, decode_datum, parse_datum
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
            what = "not an LMDB database (no data.mdb)" if self.path.exists() else "does not exist"
            raise DatabaseNotFoundError(f"{what}{hint}", path=self.path)
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

    def keys(self) -> list[bytes]:
        """All keys, in key order."""
        return self.first_keys(None)

    def first_keys(self, limit: int | None) -> list[bytes]:
        """The first ``limit`` keys (all when ``None``)."""
        out: list[bytes] = []
        with self._env.begin() as txn:
            for key in txn.cursor().iternext(keys=True, values=False):
                if limit is not None and len(out) >= limit:
                    break
                out.append(bytes(key))
        return out

    def get(self, key: bytes) -> bytes:
        """The value under ``key``; raises :class:`DataError` when it is absent."""
        with self._env.begin() as txn:
            value = txn.get(key)
        if value is None:
            raise DataError("no such record", key=key, path=self.path)
        return bytes(value)

    def close(self) -> None:
        self._env.close()


def open_records(path: str | os.PathLike[str]) -> Records:
    """Open ``path`` for reading; raises :class:`DatabaseNotFoundError` if it is not an LMDB."""
    return Records(path)


def datum_kind(datum: ParsedDatum) -> str:
    """``"encoded"``, ``"float"`` (float_data) or ``"raw"`` (uint8 data)."""
    if datum.encoded:
        return "encoded"
    if datum.float_data is not None and not datum.data:
        return "float"
    return "raw"


def record_array(value: bytes, *, key: bytes, path: object) -> npt.NDArray[Any]:
    """A record as a ``(C, H, W)`` array: uint8 for raw/encoded, float32 for float_data.

    Encoded records are decoded natively (``IMREAD_UNCHANGED``), like Caffe's
    ``DecodeDatumNative``. Raises :class:`DataError` naming the key.
    """
    chw, _ = decode_datum(value, key=key, path=path)
    return chw
