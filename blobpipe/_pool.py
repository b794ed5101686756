"""A capacity-recycling pool of host (pinned on CUDA) or device buffers.

Requests are rounded up to a size class and served from that class's free
list; a returned block goes back on its list instead of to the system.

Size classes: sizes up to 4 KiB round up to a multiple of 512 bytes; above,
each power-of-two range [2^(e-1), 2^e) is cut into 16 equal steps, so a block
wastes less than 1/16 of its range's top, i.e. under 12.5% of the request (CuPy's
pinned pool rounds to the next power of two, up to ~100% waste).

Invariants:

* a block freed with an event (the copy that reads or writes it) is not handed
  out again before that event has completed;
* on a backend with a device, a freed block is also not handed out again before
  the work queued so far on the releasing caller's stream (its current stream,
  or the one it names) has completed: the consumer's kernels may still read it,
  and another stream is not ordered after them;
* cached blocks (free or waiting) hold at most the cache limit: the free blocks
  beyond it, largest first, go back to the system when a block is freed;
* a buffer goes back to the system outside the pool's lock and under the
  backend's device (:meth:`Backend.release_buffers`): CUDA's free synchronises the
  device, and other threads allocate from the pool meanwhile.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ._backends import Backend, Event, Stream, all_of
from ._errors import PoolMemoryError, StateError

__all__ = ["DEFAULT_CACHE_LIMIT", "Block", "MemoryPool", "PoolStatistics", "get_pool", "size_class"]

#: bytes a pool keeps cached for reuse unless told otherwise (set_cache_limit)
DEFAULT_CACHE_LIMIT = 512 << 20

_SMALL = 4096
_SMALL_GRANULE = 512
_STEPS_LOG2 = 4  # 16 classes per power of two


def size_class(nbytes: int) -> int:
    """The capacity a request of ``nbytes`` is rounded up to (0 stays 0)."""
    if nbytes < 0:
        raise ValueError(f"a block size must be >= 0, got {nbytes}")
    if nbytes == 0:
        return 0
    if nbytes <= _SMALL:
        return -(-nbytes // _SMALL_GRANULE) * _SMALL_GRANULE
    granule = 1 << max((nbytes - 1).bit_length() - _STEPS_LOG2, 0)
    return -(-nbytes // granule) * granule


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


class Block:
    """A buffer handed out by a pool: ``buffer`` has ``capacity`` bytes, of which
    ``nbytes`` were requested. Give it back with :meth:`MemoryPool.free`."""

    __slots__ = ("__weakref__", "buffer", "capacity", "kind", "nbytes", "pool")

    def __init__(self, pool: MemoryPool, buffer: Any, nbytes: int, capacity: int) -> None:
        self.pool = pool
        self.buffer = buffer
        self.nbytes = nbytes
        self.capacity = capacity
        self.kind = pool.kind

    def view(self) -> Any:
        """The first ``nbytes`` bytes of the buffer (a 1-D uint8 array)."""
        return self.buffer[: self.nbytes]

    def __repr__(self) -> str:
        return f"<Block {self.kind} {self.nbytes}/{self.capacity} B>"


@dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of a pool (see :meth:`MemoryPool.statistics`).

    ``hits``: requests served from the cache; ``misses``: requests that needed
    a new allocation from the backend; ``used_bytes``: capacity of blocks
    handed out; ``requested_bytes``: bytes asked for by those blocks;
    ``cached_bytes``: capacity of blocks kept for reuse (free or waiting for
    their copy's event); ``free_blocks`` / ``pending_blocks`` count them;
    ``allocations``: buffers ever obtained from the backend; ``limit``: the
    byte limit (0: none); ``cache_limit``: the most bytes kept cached (0: none).
    """

    kind: str
    hits: int
    misses: int
    used_bytes: int
    requested_bytes: int
    cached_bytes: int
    free_blocks: int
    pending_blocks: int
    allocations: int
    limit: int
    cache_limit: int = DEFAULT_CACHE_LIMIT

    @property
    def total_bytes(self) -> int:
        """Bytes held from the backend: in use plus cached."""
        return self.used_bytes + self.cached_bytes

    @property
    def waste_ratio(self) -> float:
        """Rounding waste of the blocks in use, relative to the bytes requested."""
        if self.requested_bytes == 0:
            return 0.0
        return (self.used_bytes - self.requested_bytes) / self.requested_bytes


class MemoryPool:
    """A thread-safe pool of ``kind`` ("host" or "device") buffers of a backend.

    ``limit`` caps the bytes held (in use + cached); 0 means no limit.
    ``cache_limit`` caps the bytes kept cached for reuse (default 512 MiB; 0
    means no cap): beyond it, freed blocks go back to the system.
    :meth:`free_all_blocks` returns every cached block at once.

    A pool keeps its backend alive, except the shared pools of :func:`get_pool`,
    which live as long as their backend and so hold it weakly.
    """

    def __init__(
        self,
        backend: Backend,
        kind: str,
        limit: int = 0,
        cache_limit: int = DEFAULT_CACHE_LIMIT,
    ) -> None:
        if kind not in ("host", "device"):
            raise ValueError(f"pool kind must be 'host' or 'device', got {kind!r}")
        self._backend: Backend | None = backend  # None: held weakly alone
        self._backend_ref = weakref.ref(backend)
        self.kind = kind
        self._lock = threading.Lock()
        self._free: dict[int, list[Any]] = defaultdict(list)
        self._pending: list[tuple[Event, int, Any]] = []
        self._limit = 0
        self._hits = 0
        self._misses = 0
        self._used = 0
        self._requested = 0
        self._cached = 0
        self._free_count = 0
        self._allocations = 0
        self._empty: Any = None  # the one zero-byte buffer, shared by empty blocks
        self._cache_limit = 0
        self.set_limit(limit)
        self.set_cache_limit(cache_limit)

    def __repr__(self) -> str:
        return f"<MemoryPool {self.kind} of {self._backend_ref()!r}>"

    @property
    def backend(self) -> Backend:
        """The backend the buffers come from.

        Raises:
            StateError: a shared pool (:func:`get_pool`) whose backend is gone.
        """
        backend = self._backend_ref()
        if backend is None:
            raise StateError(
                f"the backend of this {self.kind} pool is gone: a shared pool (get_pool) "
                "lives as long as its backend; keep the backend while you use its pool"
            )
        return backend

    # -- configuration ---------------------------------------------------------
    def set_limit(self, limit: int) -> None:
        """Cap the bytes this pool holds (in use + cached); 0 removes the cap."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        with self._lock:
            self._limit = int(limit)

    def get_limit(self) -> int:
        """The byte cap (0: none)."""
        return self._limit

    def set_cache_limit(self, nbytes: int) -> None:
        """Keep at most ``nbytes`` cached for reuse (0: no cap); trims at once."""
        if nbytes < 0:
            raise ValueError(f"cache_limit must be >= 0, got {nbytes}")
        with self._lock:
            self._cache_limit = int(nbytes)
            dropped = self._trim_locked()
        self._drop(dropped)

    def get_cache_limit(self) -> int:
        """The most bytes kept cached (0: no cap)."""
        return self._cache_limit

    # -- allocation ------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        """A block of at least ``nbytes`` bytes.

        Raises PoolMemoryError when the limit or the backend cannot provide it
        even after the cached blocks were released.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes})")
        cap = size_class(nbytes)
        with self._lock:
            dropped = self._reap_locked()
            lst = self._free.get(cap)
            block = None
            if lst:
                self._free_count -= 1
                self._cached -= cap
                self._hits += 1
                self._used += cap
                self._requested += nbytes
                block = Block(self, lst.pop(), nbytes, cap)
            elif cap == 0:
                self._hits += 1
                if self._empty is None:
                    self._empty = self._backend_alloc(0, self.backend)
                block = Block(self, self._empty, 0, 0)
        self._drop(dropped)
        if block is not None:
            return block
        buf = self._allocate(cap, nbytes)
        with self._lock:
            self._misses += 1
            self._allocations += 1
            self._requested += nbytes  # _used was reserved by _allocate
        return Block(self, buf, nbytes, cap)

    def _backend_alloc(self, nbytes: int, backend: Backend) -> Any:
        if self.kind == "host":
            return backend.alloc_host(nbytes)
        return backend.alloc_device(nbytes)

    def _reserve(self, cap: int) -> bool:
        """Count ``cap`` bytes as in use if the limit allows (atomically)."""
        with self._lock:
            if self._limit and self._used + self._cached + cap > self._limit:
                return False
            self._used += cap
            return True

    def _allocate(self, cap: int, nbytes: int) -> Any:
        backend = self.backend  # a shared pool's may be gone: before anything is reserved
        for attempt in range(2):
            if not self._reserve(cap):
                if attempt == 0:
                    self.free_all_blocks(wait=True)
                    continue
                with self._lock:
                    used, cached, limit = self._used, self._cached, self._limit
                raise PoolMemoryError(
                    f"{self.kind} pool limit reached: a request of {_fmt(nbytes)} "
                    f"(block {_fmt(cap)}) would exceed the limit of {_fmt(limit)} "
                    f"({_fmt(used)} in use, {_fmt(cached)} cached). Raise the limit with "
                    "set_limit(), or close blobs and batches you no longer need."
                )
            try:
                return self._backend_alloc(cap, backend)
            except MemoryError as exc:
                with self._lock:
                    self._used -= cap  # give the reservation back
                    used = self._used
                if attempt == 0:
                    # one memory budget: blobpipe's cache and the array library's
                    self.free_all_blocks(wait=True)
                    backend.release_cached(self.kind)
                    continue
                raise PoolMemoryError(
                    f"out of {self.kind} memory on {backend!r}: cannot allocate "
                    f"{_fmt(cap)} for a request of {_fmt(nbytes)} even after freeing the "
                    f"pool's cache and the array library's ({_fmt(used)} still in use): {exc}"
                ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def free(
        self, block: Block, event: Event | None = None, *, stream: Stream | None = None
    ) -> None:
        """Give ``block`` back. With ``event``, it is reused only once it completed.

        On a backend with a device, it is also reused only after the work queued
        so far on ``stream`` (default: the caller's current stream) has completed,
        so device work the caller queued on the block runs first.

        Freeing a block twice, or a block of another pool, raises ValueError.
        """
        if block.pool is not self:
            raise ValueError(f"{block!r} belongs to {block.pool!r}, not {self!r}")
        buf = block.buffer
        if buf is None:
            raise ValueError(f"{block!r} was already freed")
        cap = block.capacity
        backend = self._backend_ref()
        if cap and backend is not None and backend.has_device:
            event = all_of([e for e in (event, self._release_event(stream)) if e is not None])
        block.buffer = None
        with self._lock:
            self._used -= cap
            self._requested -= block.nbytes
            if cap == 0:
                return
            self._cached += cap
            if event is not None and not event.query():
                self._pending.append((event, cap, buf))
            else:
                self._free[cap].append(buf)
                self._free_count += 1
            del buf
            dropped = self._trim_locked()
        self._drop(dropped)

    def _release_event(self, stream: Stream | None) -> Event | None:
        """An event after the work queued so far on ``stream`` (else the current one)."""
        backend = self.backend
        try:
            stream = stream or backend.current_stream()
            return None if stream.idle() else backend.record_event(stream)
        except RuntimeError:
            # at interpreter exit no stream can be made: nothing will reuse the block
            return None

    def _trim_locked(self) -> list[Any]:
        """Take free blocks out, largest first, while the cache is over its limit;
        returns their buffers, for :meth:`_drop` once the lock is released."""
        limit = self._cache_limit
        dropped: list[Any] = []
        if not limit or self._cached <= limit:
            return dropped
        for cap in sorted(self._free, reverse=True):
            lst = self._free[cap]
            while lst and self._cached > limit:
                dropped.append(lst.pop())
                self._cached -= cap
                self._free_count -= 1
            if self._cached <= limit:
                break
        return dropped

    def _reap_locked(self) -> list[Any]:
        """Move the pending blocks whose event completed to the free lists; returns
        the buffers :meth:`_trim_locked` took out."""
        if not self._pending:
            return []
        still = []
        for item in self._pending:
            event, cap, buf = item
            if event.query():
                self._free[cap].append(buf)
                self._free_count += 1
            else:
                still.append(item)
        self._pending = still
        return self._trim_locked()

    def _drop(self, buffers: list[Any]) -> None:
        """Give ``buffers`` (referenced nowhere else) back to the system: called
        without the pool's lock, under the backend's device."""
        if not buffers:
            return
        backend = self._backend_ref()
        if backend is None:
            buffers.clear()
        else:
            backend.release_buffers(buffers)

    def free_all_blocks(self, wait: bool = False) -> None:
        """Release every cached free block to the system.

        Blocks still waiting for their copy's event are kept, unless ``wait``
        is true: then those events are waited for and the blocks released too.
        """
        with self._lock:
            pending = [event for event, _, _ in self._pending] if wait else []
        for event in pending:
            event.synchronize()
        with self._lock:
            dropped = self._reap_locked()
            for cap, lst in self._free.items():
                self._cached -= cap * len(lst)
                self._free_count -= len(lst)
                dropped += lst
                lst.clear()
            self._free.clear()
        self._drop(dropped)

    # -- introspection ----------------------------------------------------------
    def used_bytes(self) -> int:
        """Capacity of the blocks handed out."""
        return self._used

    def total_bytes(self) -> int:
        """Bytes held from the backend (in use + cached)."""
        with self._lock:
            return self._used + self._cached

    def statistics(self) -> PoolStatistics:
        """A frozen snapshot of the counters."""
        with self._lock:
            dropped = self._reap_locked()
            stats = PoolStatistics(
                kind=self.kind,
                hits=self._hits,
                misses=self._misses,
                used_bytes=self._used,
                requested_bytes=self._requested,
                cached_bytes=self._cached,
                free_blocks=self._free_count,
                pending_blocks=len(self._pending),
                allocations=self._allocations,
                limit=self._limit,
                cache_limit=self._cache_limit,
            )
        self._drop(dropped)
        return stats


# each backend's shared pools by kind, for as long as the backend lives (they hold it
# weakly: a value holding its key would keep it alive for ever)
_registry: weakref.WeakKeyDictionary[Backend, dict[str, MemoryPool]] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def get_pool(backend: Backend, kind: str) -> MemoryPool:
    """The pool of ``kind`` ("host" or "device") shared by everything on ``backend``.

    The pools live as long as the backend (a registry keyed weakly by the backend),
    and do not keep it alive themselves.
    """
    if kind not in ("host", "device"):
        raise ValueError(f"pool kind must be 'host' or 'device', got {kind!r}")
    with _registry_lock:
        pools = _registry.get(backend)
        if pools is None:
            pools = _registry[backend] = {}
        pool = pools.get(kind)
        if pool is None:
            pool = pools[kind] = MemoryPool(backend, kind)
            pool._backend = None  # the registry keeps it as long as the backend lives
        return pool
