"""The buffer pool: size classes, reuse, waste bound, limits, events."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from blobpipe import PoolMemoryError
from blobpipe._backends import Backend, EmulatedBackend, HostBackend
from blobpipe._blob import Blob
from blobpipe._pool import DEFAULT_CACHE_LIMIT, MemoryPool, get_pool, size_class
from tests._helpers import GatedBackend


def test_size_classes() -> None:
    assert size_class(0) == 0
    assert size_class(1) == 512
    assert size_class(512) == 512
    assert size_class(513) == 1024
    assert size_class(4096) == 4096
    assert size_class(4097) == 4608
    assert size_class(1 << 20) == 1 << 20
    assert size_class((1 << 20) + 1) == (1 << 20) + (1 << 17)
    with pytest.raises(ValueError, match=">= 0"):
        size_class(-1)


def test_rounding_waste_under_one_eighth() -> None:
    rng = random.Random(0)
    sizes = [rng.randrange(4097, 1 << 28) for _ in range(20000)]
    assert max((size_class(n) - n) / n for n in sizes) < 0.125
    # small requests waste at most one 512-byte granule
    assert all(size_class(n) - n < 512 for n in range(1, 4097))


def test_measured_waste_of_a_realistic_workload() -> None:
    """Batches of assorted image shapes: bytes held vs bytes requested."""
    pool = MemoryPool(HostBackend(), "host")
    rng = random.Random(1)
    blocks = []
    for _ in range(300):
        n, c, h, w = rng.choice([32, 64, 128]), 3, rng.randrange(24, 300), rng.randrange(24, 300)
        blocks.append(pool.malloc(n * c * h * w * 4))
    stats = pool.statistics()
    assert stats.waste_ratio < 0.125
    # CuPy's pinned pool rounds to the next power of two: far more waste here
    pow2 = sum(1 << (b.nbytes - 1).bit_length() for b in blocks)
    assert pow2 / stats.requested_bytes - 1 > 2 * stats.waste_ratio
    for b in blocks:
        pool.free(b)


def test_reuse_hits_and_misses() -> None:
    backend = HostBackend()
    pool = MemoryPool(backend, "host")
    a = pool.malloc(1000)
    assert a.capacity == 1024 and a.view().shape == (1000,)
    buf = a.buffer
    pool.free(a)
    b = pool.malloc(900)  # same class
    assert b.buffer is buf
    stats = pool.statistics()
    assert (stats.hits, stats.misses, stats.allocations) == (1, 1, 1)
    assert stats.used_bytes == 1024 and stats.requested_bytes == 900
    pool.free(b)
    stats = pool.statistics()
    assert (stats.used_bytes, stats.cached_bytes, stats.free_blocks) == (0, 1024, 1)
    pool.free_all_blocks()
    assert pool.statistics().cached_bytes == 0
    assert backend.statistics().host_allocations == 1


def test_double_free_and_foreign_block() -> None:
    p1, p2 = MemoryPool(HostBackend(), "host"), MemoryPool(HostBackend(), "host")
    block = p1.malloc(10)
    with pytest.raises(ValueError, match="belongs to"):
        p2.free(block)
    p1.free(block)
    with pytest.raises(ValueError, match="already freed"):
        p1.free(block)


def test_limit_frees_cache_then_raises_with_sizes() -> None:
    pool = MemoryPool(HostBackend(), "host", limit=8192)
    a = pool.malloc(4096)
    pool.free(a)  # cached: 4096
    b = pool.malloc(8192)  # needs the cache freed first, then fits
    assert pool.statistics().cached_bytes == 0
    with pytest.raises(PoolMemoryError, match=r"request of 100 B .*limit of 8\.0 KiB") as info:
        pool.malloc(100)
    assert isinstance(info.value, MemoryError)
    pool.free(b)
    pool.set_limit(0)
    pool.malloc(1 << 20)


def test_backend_out_of_memory_retries_after_freeing_cache() -> None:
    class Tight(HostBackend):
        budget = 4096

        def _alloc_host(self, nbytes: int):  # type: ignore[no-untyped-def]
            if nbytes > self.budget:
                raise MemoryError("no room")
            self.budget -= nbytes
            return np.empty(nbytes, np.uint8)

    backend = Tight()
    pool = MemoryPool(backend, "host")
    pool.free(pool.malloc(4096))

    def release_on_free_all() -> None:
        backend.budget += 4096

    orig = pool.free_all_blocks

    def free_all(wait: bool = False) -> None:
        if pool.statistics().cached_bytes:
            release_on_free_all()
        orig(wait)

    pool.free_all_blocks = free_all  # type: ignore[method-assign]
    block = pool.malloc(2048)  # not a hit (other class); succeeds after freeing the cache
    assert block.capacity == 2048
    with pytest.raises(PoolMemoryError, match="out of host memory"):
        pool.malloc(1 << 20)


@pytest.mark.parametrize("kind", ["host", "device"])
def test_out_of_memory_frees_the_array_librarys_cache_too(kind: str) -> None:
    """One memory budget: the device transform's temporaries sit in CuPy's pool; a
    blobpipe pool out of memory has it give its blocks back before the last try."""

    class Shared(EmulatedBackend):
        def __init__(self) -> None:
            super().__init__()
            self.library_cache = 1 << 20  # bytes the array library holds, free but cached
            self.free = 4096
            self.released: list[str] = []

        def _take(self, nbytes: int) -> np.ndarray:
            if nbytes > self.free:
                raise MemoryError("no room")
            self.free -= nbytes
            return np.empty(nbytes, np.uint8)

        def _alloc_host(self, nbytes: int):  # type: ignore[no-untyped-def]
            return self._take(nbytes)

        def _alloc_device(self, nbytes: int):  # type: ignore[no-untyped-def]
            return self._take(nbytes)

        def release_cached(self, kind: str) -> None:
            self.released.append(kind)
            self.free += self.library_cache
            self.library_cache = 0

    backend = Shared()
    pool = MemoryPool(backend, kind)
    block = pool.malloc(1 << 19)  # fits only once the library's cache is released
    assert block.capacity == 1 << 19
    assert backend.released == [kind]


def test_pending_block_not_reused_until_event() -> None:
    backend = GatedBackend()  # the copy stays in flight until the gate opens
    pool = MemoryPool(backend, "host")
    block = pool.malloc(1024)
    dev = backend.alloc_device(1024)
    event = backend.copy_to_device(dev, block.view())
    buf = block.buffer
    pool.free(block, event)
    other = pool.malloc(1024)
    assert other.buffer is not buf
    backend.gate.set()
    event.synchronize()
    third = pool.malloc(1024)
    assert third.buffer is buf


def test_free_all_blocks_wait_releases_pending() -> None:
    backend = GatedBackend()  # the copy stays in flight until the gate opens
    pool = MemoryPool(backend, "host")
    block = pool.malloc(1024)
    event = backend.copy_to_device(backend.alloc_device(1024), block.view())
    pool.free(block, event)
    pool.free_all_blocks()  # keeps the block its copy still reads
    assert pool.statistics().pending_blocks == 1
    backend.open_after(0.05)  # lands while free_all_blocks waits for it
    pool.free_all_blocks(wait=True)
    stats = pool.statistics()
    assert stats.pending_blocks == 0 and stats.cached_bytes == 0


def test_thread_safety() -> None:
    pool = MemoryPool(HostBackend(), "host")

    def work() -> None:
        rng = random.Random(threading.get_ident())
        for _ in range(500):
            blocks = [pool.malloc(rng.choice([100, 2000, 9000])) for _ in range(3)]
            for b in blocks:
                pool.free(b)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = pool.statistics()
    assert stats.used_bytes == 0 and stats.requested_bytes == 0
    assert stats.hits + stats.misses == 4 * 500 * 3
    assert stats.misses <= 4 * 3 * 3  # bounded by concurrency, not by iterations


def test_device_pool(device_backend: Backend) -> None:
    pool = get_pool(device_backend, "device")
    assert pool is get_pool(device_backend, "device")
    a = pool.malloc(5000)
    pool.free(a)
    b = pool.malloc(5000)
    assert pool.statistics().hits >= 1
    pool.free(b)


def test_bad_kind() -> None:
    with pytest.raises(ValueError, match="'host' or 'device'"):
        MemoryPool(HostBackend(), "gpu")
    with pytest.raises(ValueError, match="limit must be >= 0"):
        MemoryPool(HostBackend(), "host", limit=-1)


def test_limit_holds_under_concurrent_misses() -> None:
    pool = MemoryPool(HostBackend(), "host", limit=1 << 20)
    barrier = threading.Barrier(4)
    held: list[object] = []
    errors: list[BaseException] = []

    def grab() -> None:
        barrier.wait()
        for _ in range(10):
            try:
                held.append(pool.malloc(100_000))
            except PoolMemoryError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=grab) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors  # 40 requests of ~100 kB cannot all fit in 1 MiB
    assert pool.statistics().total_bytes <= 1 << 20


def test_empty_blocks_share_one_buffer() -> None:
    backend = HostBackend()
    pool = MemoryPool(backend, "host")
    blocks = [pool.malloc(0) for _ in range(5)]
    assert backend.statistics().host_allocations == 1
    for b in blocks:
        pool.free(b)


def test_pools_do_not_keep_their_backend_alive() -> None:
    import gc
    import weakref

    backend = HostBackend()
    get_pool(backend, "host").free(get_pool(backend, "host").malloc(4096))
    ref = weakref.ref(backend)
    del backend
    gc.collect()
    assert ref() is None


def test_shared_pools_live_as_long_as_their_backend() -> None:
    """The registry keeps a backend's pools, by kind, while the backend lives (their
    cache with them), holds no attribute on the backend, and keeps each backend apart."""
    import gc

    backend, other = HostBackend(), EmulatedBackend()
    pool = get_pool(backend, "host")
    pool.free(pool.malloc(4096))
    pool_id = id(pool)
    del pool
    gc.collect()
    again = get_pool(backend, "host")
    assert id(again) == pool_id and again.statistics().free_blocks == 1
    assert again.backend is backend
    assert get_pool(other, "host") is not again
    assert get_pool(other, "device") is not get_pool(other, "host")
    assert not any("pool" in name for name in vars(backend))


def test_a_pool_made_directly_keeps_its_backend_a_shared_one_does_not() -> None:
    import gc
    import weakref

    from blobpipe._errors import StateError

    backend = HostBackend()
    own = MemoryPool(backend, "host")
    shared = get_pool(backend, "host")
    block = shared.malloc(4096)
    ref = weakref.ref(backend)
    del backend
    gc.collect()
    assert ref() is not None  # the pool made directly holds it
    assert own.backend is ref()
    del own
    gc.collect()
    assert ref() is None
    with pytest.raises(StateError, match="backend of this host pool is gone"):
        shared.malloc(4096)
    shared.free(block)  # a block outliving its backend is dropped
    assert shared.statistics().used_bytes == 0
    assert "MemoryPool host of None" in repr(shared)


@pytest.mark.parametrize("nbytes", [1, 63, 64, 100, 4097, 1 << 20, (1 << 20) + 3])
def test_host_buffers_are_64_byte_aligned(nbytes: int) -> None:
    """JAX imports 64-byte aligned DLPack buffers without a copy and copies the others:
    every pooled host buffer starts aligned, so a batch's behaviour does not depend on
    where the allocator put it."""
    for backend in (HostBackend(), EmulatedBackend()):
        pool = get_pool(backend, "host")
        block = pool.malloc(nbytes)
        assert block.buffer.ctypes.data % 64 == 0
        assert block.buffer.nbytes >= nbytes
        pool.free(block)
        blob = Blob((3, nbytes), np.uint8, backend=backend)
        assert blob.mutable_cpu_data().ctypes.data % 64 == 0
        blob.close()


# -- the cache is bounded and releasable ---------------------------------------------------------


def test_cached_bytes_stay_under_the_cache_limit() -> None:
    """200 blocks in use at once, then freed: the pool keeps at most its cache limit
    of them (largest first released), and free_all_blocks() returns the rest."""
    pool = MemoryPool(HostBackend(), "host", cache_limit=1 << 20)
    blocks = [pool.malloc(64 << 10) for _ in range(200)]  # 12.5 MiB in use
    for block in blocks:
        pool.free(block)
    stats = pool.statistics()
    assert stats.cached_bytes <= 1 << 20
    assert stats.cached_bytes >= (1 << 20) - (64 << 10)  # the cache is still used
    assert stats.cache_limit == 1 << 20
    pool.free_all_blocks()
    assert pool.statistics().cached_bytes == 0


def test_lowering_the_cache_limit_trims_at_once() -> None:
    pool = MemoryPool(HostBackend(), "host", cache_limit=0)  # no cap
    for block in [pool.malloc(4096) for _ in range(64)]:
        pool.free(block)
    assert pool.statistics().cached_bytes == 64 * 4096
    pool.set_cache_limit(8 * 4096)
    assert pool.statistics().cached_bytes == 8 * 4096
    with pytest.raises(ValueError, match="cache_limit must be >= 0"):
        pool.set_cache_limit(-1)


def test_the_default_pools_are_bounded() -> None:
    pool = get_pool(HostBackend(), "host")
    assert pool.get_cache_limit() == DEFAULT_CACHE_LIMIT > 0


def test_a_device_block_waits_for_the_freeing_callers_stream() -> None:
    """On a device backend a freed block is reused only after the work queued so
    far on the freeing caller's current stream."""
    backend = EmulatedBackend()
    pool = MemoryPool(backend, "device")
    block = pool.malloc(4096)
    buf = block.buffer
    gate = threading.Event()
    backend.run_later(lambda: gate.wait(5.0), 0.0)  # the caller's kernel still reads it
    pool.free(block)
    again = pool.malloc(4096)
    assert again.buffer is not buf and pool.statistics().pending_blocks == 1
    gate.set()
    backend.current_stream().synchronize()
    pool.free(again)
    assert pool.statistics().pending_blocks == 0
