"""A database's keys kept compactly: one buffer of their bytes joined and one array of
where each ends.

A tuple of a million ``bytes`` costs about 33 bytes of object header and 8 of pointer
per key on top of the key itself; :class:`PackedKeys` costs the key's bytes and 4 (or
8) bytes of offset. The buffer may be a read-only memory map (the persistent index's,
``_indexcache.py``): the keys then take no anonymous memory at all. Keys come in
strictly increasing byte order (LMDB's), so lookups are binary searches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt

__all__ = ["PackedKeys", "narrow_ends"]


class PackedKeys(Sequence[bytes]):
    """Keys in strictly increasing byte order: key ``i`` is
    ``buffer[ends[i - 1]:ends[i]]`` (``ends[-1]`` of nothing being 0).

    ``buffer``: ``bytes`` or a uint8 array (a memory map); ``ends``: non-decreasing
    offsets into it, one per key. Immutable; indexing returns ``bytes``.
    """

    __slots__ = ("_buffer", "_ends", "_view")

    def __init__(self, buffer: bytes | npt.NDArray[np.uint8], ends: npt.NDArray[Any]) -> None:
        self._buffer = buffer
        self._view = (buffer.data if isinstance(buffer, np.ndarray) else memoryview(buffer)).cast(
            "B"
        )
        self._ends = ends

    @classmethod
    def of(cls, keys: Sequence[bytes]) -> PackedKeys:
        """The keys ``keys`` (already in increasing byte order) packed."""
        if isinstance(keys, PackedKeys):
            return keys
        joined = b"".join(keys)
        lengths = np.fromiter(map(len, keys), np.int64, len(keys))
        return cls(joined, narrow_ends(np.cumsum(lengths)))

    @property
    def buffer(self) -> bytes | npt.NDArray[np.uint8]:
        """The joined key bytes."""
        return self._buffer

    @property
    def joined(self) -> memoryview:
        """The joined key bytes, as a byte view."""
        return self._view

    @property
    def ends(self) -> npt.NDArray[Any]:
        """Where each key ends in :attr:`buffer`."""
        return self._ends

    @property
    def nbytes(self) -> int:
        """Bytes held: the joined keys and the offsets."""
        return len(self._view) + int(self._ends.nbytes)

    def __len__(self) -> int:
        return len(self._ends)

    def _start(self, i: int) -> int:
        return int(self._ends[i - 1]) if i else 0

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self._ends)
        j = int(i)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"key index {i} out of range for {n} keys")
        return bytes(self._view[self._start(j) : int(self._ends[j])])

    def take(self, indices: npt.ArrayLike) -> tuple[bytes, ...]:
        """The keys at positions ``indices`` (each in range), in that order."""
        idx = np.asarray(indices, np.int64)
        ends = self._ends
        stops = ends[idx].tolist()
        starts = np.where(idx > 0, ends[idx - 1], 0).tolist()
        buf = self._buffer
        if isinstance(buf, bytes):
            return tuple([buf[a:b] for a, b in zip(starts, stops, strict=True)])
        view = self._view
        return tuple([bytes(view[a:b]) for a, b in zip(starts, stops, strict=True)])

    def __iter__(self) -> Iterator[bytes]:
        view = self._view
        start = 0
        for end in self._ends.tolist():
            yield bytes(view[start:end])
            start = end

    def _find(self, key: bytes) -> int:
        """The first position whose key is not less than ``key``."""
        lo, hi = 0, len(self._ends)
        while lo < hi:
            mid = (lo + hi) // 2
            if self[mid] < key:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes):
            return False
        i = self._find(key)
        return i < len(self) and self[i] == key

    def index(self, key: Any, start: int = 0, stop: int | None = None) -> int:
        """The position of ``key`` (a binary search).

        Raises:
            ValueError: ``key`` is not among the keys (in ``[start, stop)``).
        """
        i = self._find(key) if isinstance(key, bytes) else len(self)
        stop = len(self) if stop is None else stop
        if i < len(self) and start <= i < stop and self[i] == key:
            return i
        raise ValueError(f"{key!r} is not among the keys")

    def count(self, key: Any) -> int:
        return 1 if key in self else 0

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedKeys):
            return (
                len(self) == len(other)
                and bool(np.array_equal(self._ends, other._ends))
                and self._view == other._view
            )
        if isinstance(other, (tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<PackedKeys: {len(self)} keys, {self.nbytes} bytes>"


def narrow_ends(ends: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
    """``ends`` as uint32 when the buffer is below 4 GiB (it always is for LMDB keys
    of at most 511 bytes and fewer than 8 million records), else int64."""
    if not len(ends) or int(ends[-1]) < 1 << 32:
        return ends.astype(np.uint32)
    return ends
