"""``inspect``: what an LMDB or LevelDB of Datums (or BlobProtos) holds, without changing it."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from .._codec import blobproto_array
from .._errors import DataError, ProtoError
from .._io._datum import decode_datum
from .._io._hdf5 import Hdf5Data
from .._io._imagelist import ImageList
from .._io._leveldb import LevelDbReader
from .._io._prototxt import read_data_layer
from .._io._records import BLOBPROTO, record_kind
from .._io._wire import ParsedDatum, parse_datum
from ._output import open_database, read_marker
from ._progress import Progress

__all__ = ["DatabaseInfo", "describe_layer", "inspect_db"]


@dataclass(frozen=True)
class DatabaseInfo:
    """A summary of a database.

    ``scanned`` records (all unless ``limit`` was given) were parsed for
    ``kinds`` (raw/encoded/float/blobproto counts), ``shapes`` (``(C, H, W)``, or
    a BlobProto's own shape → count; encoded records are decoded for it) and
    ``labels`` (label → count; BlobProtos have none).
    ``complete`` is false for an unfinished ``.partial`` conversion, with
    ``progress`` = ``(next line index, lines in the list file)``.
    """

    path: Path
    records: int
    scanned: int
    first_keys: tuple[bytes, ...]
    kinds: dict[str, int]
    shapes: dict[tuple[int, ...], int]
    labels: dict[int, int]
    size_bytes: int
    complete: bool
    progress: tuple[int, int] | None = None
    errors: dict[bytes, str] = field(default_factory=dict)
    kind: str = "lmdb"  # the database's kind: "lmdb" or "leveldb"

    def label_summary(self, top: int = 5) -> dict[str, Any]:
        """Distinct labels, min, max and the ``top`` most common ``[label, count]`` pairs."""
        if not self.labels:
            return {"distinct": 0, "min": None, "max": None, "most_common": []}
        common = sorted(self.labels.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
        return {
            "distinct": len(self.labels),
            "min": min(self.labels),
            "max": max(self.labels),
            "most_common": [[label, n] for label, n in common],
        }

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (keys decoded as UTF-8 with replacement characters)."""
        return {
            "path": str(self.path),
            "kind": self.kind,
            "records": self.records,
            "scanned": self.scanned,
            "complete": self.complete,
            "progress": list(self.progress) if self.progress else None,
            "first_keys": [k.decode(errors="replace") for k in self.first_keys],
            "kinds": dict(self.kinds),
            "shapes": [
                {"shape": list(s), "count": n}
                for s, n in sorted(self.shapes.items(), key=lambda kv: (-kv[1], kv[0]))
            ],
            "labels": self.label_summary(),
            "size_bytes": self.size_bytes,
            "errors": {k.decode(errors="replace"): v for k, v in self.errors.items()},
        }


def _kind(datum: ParsedDatum) -> str:
    """``"encoded"``, ``"float"`` (float_data) or ``"raw"`` (uint8 data)."""
    if datum.encoded:
        return "encoded"
    if datum.float_data is not None and not datum.data:
        return "float"
    return "raw"


def _size(path: Path, reader: object) -> int:
    if isinstance(reader, LevelDbReader):
        return reader.nbytes  # its live tables and logs
    if not path.is_dir():  # an LMDB data file opened directly
        return path.stat().st_size
    # LMDB's own files, by name: a directory that can be entered but not listed is
    # read as the reader reads it
    files = (path / name for name in ("data.mdb", "lock.mdb"))
    return sum(f.stat().st_size for f in files if f.exists())


def inspect_db(
    db: str | os.PathLike[str],
    *,
    limit: int | None = None,
    first: int = 5,
    quiet: bool = True,
) -> DatabaseInfo:
    """Summarise the LMDB or LevelDB ``db`` (the first ``limit`` records, all by default).

    Unreadable records are counted under ``errors`` instead of stopping the scan.
    Raises :class:`DatabaseNotFoundError` when ``db`` is neither.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")

    kinds: Counter[str] = Counter()
    shapes: Counter[tuple[int, ...]] = Counter()
    labels: Counter[int] = Counter()
    errors: dict[bytes, str] = {}
    with open_database(db) as reader:
        path = Path(reader.path)
        n = len(reader)
        todo = n if limit is None else min(limit, n)
        scanned = 0
        with Progress(todo, "inspect", quiet=quiet) as bar:
            for key, value in islice(reader.items(), todo):
                scanned += 1
                bar.advance()
                try:
                    if record_kind(value) == BLOBPROTO:
                        try:
                            blob = blobproto_array(value, f"record {key!r}")
                        except ProtoError as exc:
                            raise DataError(str(exc), path=path, key=key) from None
                        kinds["blobproto"] += 1
                        shapes[tuple(int(d) for d in blob.shape)] += 1
                        continue
                    datum = parse_datum(value, key=key, path=path)
                    kinds[_kind(datum)] += 1
                    labels[int(datum.label)] += 1
                    arr = decode_datum(value, key=key, path=path)[0]
                    shapes[(int(arr.shape[0]), int(arr.shape[1]), int(arr.shape[2]))] += 1
                except DataError as exc:
                    errors[key] = str(exc)
        first_keys = tuple(key for key, _ in islice(reader.items(), first))
        size = _size(path, reader)
        kind = "leveldb" if isinstance(reader, LevelDbReader) else "lmdb"
    marker = read_marker(path)
    complete = marker is None or bool(marker.get("complete"))
    progress = None
    if marker is not None and not complete:
        progress = (int(marker.get("next_index", 0)), int(marker.get("lines", 0)))
    return DatabaseInfo(
        path=path,
        records=n,
        scanned=scanned,
        first_keys=first_keys,
        kinds=dict(kinds),
        shapes=dict(shapes),
        labels=dict(labels),
        size_bytes=size,
        complete=complete,
        progress=progress,
        errors=errors,
        kind=kind,
    )


def describe_layer(prototxt: str | os.PathLike[str], phase: str = "test") -> dict[str, Any]:
    """What the data layer of a net prototxt reads, as a JSON-ready dict: its type and
    source; a Data layer's database (as :func:`inspect_db`), an ImageData layer's
    lines (count, first keys, labels, the first image's shape as decoded), an
    HDF5Data layer's files, rows and each top's row shape.

    Raises:
        ProtoError, FileMissingError, DataError: as ``Loader.from_prototxt``.
    """
    config = read_data_layer(prototxt, phase)
    out: dict[str, Any] = {"layer": config.name, "type": config.type, "source": config.source,
                           "batch_size": config.batch_size, "tops": list(config.tops)}  # fmt: skip
    if config.type == "Data":
        out["database"] = inspect_db(config.source).to_json()
        return out
    source = config.batches_kwargs()["source"]
    if isinstance(source, ImageList):
        keys = source.keys()
        labels = Counter(label for _, label in source.lines)
        first = parse_datum(source.get(keys[0]))
        if first.encoded:
            shape = decode_datum(source.get(keys[0]), force_color=source.is_color,
                                 force_gray=not source.is_color)[0].shape  # fmt: skip
        else:
            shape = (first.channels, first.height, first.width)
        common = sorted(labels.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
        out |= {
            "records": len(keys),
            "first_keys": [k.decode(errors="replace") for k in keys[:5]],
            "first_shape": list(shape),
            "labels": {
                "distinct": len(labels),
                "min": min(labels),
                "max": max(labels),
                "most_common": [list(x) for x in common],
            },
        }
        return out
    assert isinstance(source, Hdf5Data)
    out |= {
        "records": source.rows,
        "files": list(source.files),
        "row_shapes": {t: list(source[t].row(0).shape) for t in source},
    }
    return out
