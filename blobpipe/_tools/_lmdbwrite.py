"""Writing LMDB databases the way Caffe does, without a fixed giant map.

Caffe's ``LMDBTransaction::Commit`` doubles the map size on ``MDB_MAP_FULL``
and retries; :class:`LmdbWriter` does the same: the map starts small and a
chunk that does not fit is aborted, the map doubled, and the whole chunk put
again. Each :meth:`LmdbWriter.put_many` is one LMDB transaction, so a kill
leaves the database at the last committed chunk, never half-written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import lmdb

from .._errors import DataError, DiskFullError
from ._output import free_space

__all__ = ["DEFAULT_MAP_SIZE", "LmdbWriter"]

DEFAULT_MAP_SIZE = 64 << 20
"""Initial map size; it doubles whenever a transaction does not fit."""

_MAX_MAP_SIZE = 1 << 44  # 16 TiB: past this, growth is a bug, not a dataset.


class LmdbWriter:
    """An LMDB environment (directory with ``data.mdb``/``lock.mdb``) opened for writing.

    Raises :class:`DataError` when the environment cannot be created or opened.
    """

    def __init__(self, path: str | os.PathLike[str], *, map_size: int = DEFAULT_MAP_SIZE) -> None:
        self.path = Path(path)
        if map_size <= 0:
            raise ValueError(f"map_size must be positive, got {map_size}")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._env = lmdb.open(
                str(self.path), map_size=map_size, subdir=True, max_dbs=0, readahead=False
            )
        except (OSError, lmdb.Error) as exc:
            raise DataError(f"cannot open LMDB for writing: {exc}", path=self.path) from exc
        self.map_size = int(self._env.info()["map_size"])
        self.grow_count = 0

    def __enter__(self) -> LmdbWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def entries(self) -> int:
        """Number of records committed so far."""
        return int(self._env.stat()["entries"])

    def put_many(self, items: Sequence[tuple[bytes, bytes]], *, unique: bool = False) -> None:
        """Put every ``(key, value)`` in one transaction, doubling the map until it fits.

        Putting a key that exists replaces its value (so replaying a chunk is
        harmless); with ``unique``, it is a DataError instead (nothing of the chunk
        is written).
        """
        if not items:
            return
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in items:
                        if not txn.put(key, value, overwrite=not unique):
                            raise DataError(
                                f"two records have the key {key!r}; keys must be unique",
                                path=self.path,
                            )
                return
            except lmdb.MapFullError:
                self._grow()
            except lmdb.Error as exc:
                size = sum(len(k) + len(v) for k, v in items)
                full = self._disk_full(exc, size)
                if full is not None:
                    raise full from exc
                raise DataError(f"LMDB write failed: {exc}", path=self.path) from exc

    def _disk_full(self, exc: lmdb.Error, size: int) -> DiskFullError | None:
        """The error to raise when a commit of ``size`` bytes failed for want of space:
        LMDB says ENOSPC, or, when a write came up short, EIO ("Input/output error")
        while the disk has less than twice the chunk free."""
        text = str(exc)
        free = free_space(self.path)
        short = "Input/output error" in text and free is not None and free < 2 * size + (1 << 20)
        if not (short or "No space left on device" in text or "Disk quota exceeded" in text):
            return None
        return DiskFullError(
            f"no space left on device: a commit of {size} bytes to the LMDB in "
            f"{str(self.path)!r} failed ({text}; {free} bytes free on its disk); what was "
            "committed before is kept",
            path=self.path,
        )

    def _grow(self) -> None:
        new_size = self.map_size * 2
        if new_size > _MAX_MAP_SIZE:
            raise DataError(
                f"LMDB map would exceed {_MAX_MAP_SIZE} bytes; a single chunk is too large",
                path=self.path,
            )
        self._env.set_mapsize(new_size)
        self.map_size = int(self._env.info()["map_size"])
        self.grow_count += 1

    def sync(self) -> None:
        """Flush committed data to disk."""
        self._env.sync(True)

    def close(self) -> None:
        """Close the environment; idempotent."""
        self._env.close()
