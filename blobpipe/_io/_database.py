"""Which kind of database a path holds, and a reader for it.

Caffe writes two: an LMDB (a directory holding ``data.mdb``, or that file itself)
and a LevelDB (a directory holding ``CURRENT``, a MANIFEST, tables and logs). The
kind is told from what the path holds, never from a setting, so every place that
takes a database path (``Batches``, ``Loader``, the tools) reads both.
"""

from __future__ import annotations

import os
from typing import Literal

from .._errors import DatabaseNotFoundError
from ._indexcache import IndexPlace
from ._leveldb import LevelDbReader, is_leveldb
from ._lmdb import LmdbReader

__all__ = ["DatabaseKind", "Reader", "database_kind", "open_reader"]

DatabaseKind = Literal["lmdb", "leveldb"]
Reader = LmdbReader | LevelDbReader
_SHOWN = 6  # entries a "neither" error lists


def database_kind(path: str | os.PathLike[str]) -> DatabaseKind:
    """``"lmdb"`` or ``"leveldb"``: what ``path`` holds.

    Raises:
        DatabaseNotFoundError: ``path`` does not exist, or is a directory holding
            neither kind (the message lists what it holds).
    """
    where = os.fsdecode(os.fspath(path))
    if not os.path.isdir(where):
        return "lmdb"  # a data file, or nothing: LmdbReader names what is wrong
    if is_leveldb(where):
        return "leveldb"
    if os.path.exists(os.path.join(where, "data.mdb")):
        return "lmdb"
    try:
        found = sorted(os.listdir(where))
    except OSError:
        return "lmdb"  # a directory that cannot be listed: read as LMDB reads it
    if not found:
        held = "it is empty"
    else:
        shown = ", ".join(repr(f) for f in found[:_SHOWN])
        more = f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
        held = f"it holds {shown}{more}"
    hint = ""
    if found and all(os.path.isdir(os.path.join(where, f)) for f in found[:_SHOWN]):
        hint = " (if a database is one of these folders, give that folder)"
    raise DatabaseNotFoundError(
        f"not a database: the directory holds neither data.mdb (an LMDB) nor CURRENT (a "
        f"LevelDB); {held}; give the directory convert_imageset created{hint}",
        path=where,
    )


def open_reader(
    path: str | os.PathLike[str], *, readahead: bool = False, index: IndexPlace = "cache"
) -> Reader:
    """A reader of the database at ``path``, of the kind it holds (see the module
    docstring); ``readahead`` and ``index`` apply to an LMDB.

    Raises:
        DatabaseNotFoundError: no database at ``path``.
        DataError: the database cannot be read (names the file and what to do).
    """
    if database_kind(path) == "leveldb":
        return LevelDbReader(path)
    return LmdbReader(path, readahead=readahead, index=index)
