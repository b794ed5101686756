"""SyncedMemory: every head transition, Caffe's nine-step sequence, async copies."""

from __future__ import annotations

import gc
import threading
import time

import anyio
import numpy as np
import pytest

from blobpipe import BackendUnavailableError, ShapeError, StateError, UnsupportedOperationError
from blobpipe._backends import Backend, EmulatedBackend, HostBackend
from blobpipe._pool import get_pool
from blobpipe._syncedmem import Head, SyncedMemory

from ._helpers import GatedBackend
from .conftest import to_numpy


def copies(backend: Backend) -> tuple[int, int]:
    s = backend.statistics()
    return s.h2d_copies, s.d2h_copies


def test_lazy_allocation_and_zero_fill(any_backend: Backend) -> None:
    pool = get_pool(any_backend, "host")
    before = pool.statistics()
    mem = SyncedMemory(10, any_backend)
    assert mem.head is Head.UNINITIALIZED
    assert mem.size == 10
    assert pool.statistics().used_bytes == before.used_bytes  # nothing allocated yet
    data = mem.cpu_data()
    assert data.dtype == np.uint8 and data.shape == (10,)
    assert not data.any()
    assert mem.head is Head.HEAD_AT_CPU
    mem.close()


def test_gpu_first_touch_zero_filled(device_backend: Backend) -> None:
    mem = SyncedMemory(10, device_backend)
    gpu = mem.gpu_data()
    assert mem.head is Head.HEAD_AT_GPU
    assert not to_numpy(gpu).any()
    mem.close()


def test_read_only_views(any_backend: Backend) -> None:
    mem = SyncedMemory(4, any_backend)
    ro = mem.cpu_data()
    assert not ro.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        ro[0] = 1
    rw = mem.mutable_cpu_data()
    assert rw.flags.writeable
    rw[:] = 5
    assert mem.cpu_data().tolist() == [5, 5, 5, 5]
    mem.close()


def test_readonly_gpu_view_on_emulated() -> None:
    mem = SyncedMemory(4, EmulatedBackend())
    view = mem.gpu_data()
    assert not view.flags.writeable
    mem.close()


@pytest.mark.parametrize(
    ("steps", "expected_head"),
    [
        (["cpu_data"], Head.HEAD_AT_CPU),
        (["mutable_cpu_data"], Head.HEAD_AT_CPU),
        (["gpu_data"], Head.HEAD_AT_GPU),
        (["mutable_gpu_data"], Head.HEAD_AT_GPU),
        (["mutable_cpu_data", "gpu_data"], Head.SYNCED),
        (["mutable_gpu_data", "cpu_data"], Head.SYNCED),
        (["mutable_cpu_data", "gpu_data", "mutable_cpu_data"], Head.HEAD_AT_CPU),
        (["mutable_cpu_data", "gpu_data", "mutable_gpu_data"], Head.HEAD_AT_GPU),
        (["mutable_gpu_data", "cpu_data", "cpu_data"], Head.SYNCED),
        (["mutable_gpu_data", "mutable_cpu_data"], Head.HEAD_AT_CPU),
        (["mutable_cpu_data", "mutable_gpu_data"], Head.HEAD_AT_GPU),
    ],
)
def test_every_head_transition(
    device_backend: Backend, steps: list[str], expected_head: Head
) -> None:
    mem = SyncedMemory(8, device_backend)
    for step in steps:
        getattr(mem, step)()
    assert mem.head is expected_head
    mem.close()


def test_caffe_nine_step_sequence_counts_real_copies(device_backend: Backend) -> None:
    """The sequence from Caffe's "Blobs, Layers, and Nets" docs, data written on the CPU."""
    mem = SyncedMemory(64, device_backend)
    mem.mutable_cpu_data()[:] = np.arange(64, dtype=np.uint8)
    assert mem.head is Head.HEAD_AT_CPU
    base = copies(device_backend)

    def step(name: str, h2d: int, d2h: int, head: Head) -> None:
        nonlocal base
        getattr(mem, name)()
        now = copies(device_backend)
        assert (now[0] - base[0], now[1] - base[1]) == (h2d, d2h), name
        assert mem.head is head, name
        base = now

    step("gpu_data", 1, 0, Head.SYNCED)  # 1: copies CPU→GPU
    step("cpu_data", 0, 0, Head.SYNCED)  # 2: no copy
    step("mutable_gpu_data", 0, 0, Head.HEAD_AT_GPU)  # 3: no copy
    step("mutable_gpu_data", 0, 0, Head.HEAD_AT_GPU)  # 4: no copy
    step("cpu_data", 0, 1, Head.SYNCED)  # 5: copies GPU→CPU
    step("mutable_cpu_data", 0, 0, Head.HEAD_AT_CPU)  # 6: no copy
    step("cpu_data", 0, 0, Head.HEAD_AT_CPU)  # 7: no copy
    step("mutable_gpu_data", 1, 0, Head.HEAD_AT_GPU)  # 8: copies CPU→GPU
    step("mutable_cpu_data", 0, 1, Head.HEAD_AT_CPU)  # 9: copies GPU→CPU
    assert mem.cpu_data().tolist() == list(range(64))
    mem.close()


def test_data_survives_round_trips(device_backend: Backend) -> None:
    mem = SyncedMemory(16, device_backend)
    mem.mutable_cpu_data()[:] = 3
    gpu = mem.mutable_gpu_data()
    gpu[:8] = 9  # kernel-side write
    assert mem.cpu_data().tolist() == [9] * 8 + [3] * 8
    mem.close()


def test_host_backend_gpu_accessors_raise() -> None:
    mem = SyncedMemory(4, HostBackend())
    for name in ("gpu_data", "mutable_gpu_data"):
        with pytest.raises(BackendUnavailableError, match="no device memory"):
            getattr(mem, name)()
    with pytest.raises(BackendUnavailableError, match=r"blobpipe\[cuda12\]"):
        mem.gpu_data()
    assert mem.head is Head.UNINITIALIZED
    mem.close()


def test_set_cpu_data_is_borrowed(any_backend: Backend) -> None:
    pool = get_pool(any_backend, "host")
    buf = np.arange(8, dtype=np.uint8)
    mem = SyncedMemory(8, any_backend)
    mem.mutable_cpu_data()  # owns a pooled block
    used = pool.statistics().used_bytes
    mem.set_cpu_data(buf)
    assert pool.statistics().used_bytes == used - 512  # the owned block went back
    assert mem.head is Head.HEAD_AT_CPU
    assert mem.cpu_data().tolist() == list(range(8))
    mem.mutable_cpu_data()[0] = 42
    assert buf[0] == 42  # writes go to the borrowed memory
    free_before = pool.statistics().free_blocks
    mem.close()
    assert buf[0] == 42  # not zeroed or touched by close
    assert pool.statistics().free_blocks == free_before  # the borrowed buffer is not pooled


def test_set_cpu_data_too_small() -> None:
    mem = SyncedMemory(16, HostBackend())
    with pytest.raises(ShapeError, match="holds 8 bytes, this SyncedMemory needs 16"):
        mem.set_cpu_data(np.zeros(8, np.uint8))
    with pytest.raises(TypeError, match="expects an array or a buffer"):
        mem.set_cpu_data(3.5)


def test_set_gpu_data(device_backend: Backend) -> None:
    dev = device_backend.alloc_device(8)
    device_backend.copy_to_device(dev, np.full(8, 4, np.uint8)).synchronize()
    mem = SyncedMemory(8, device_backend)
    mem.set_gpu_data(dev)
    assert mem.head is Head.HEAD_AT_GPU
    assert mem.cpu_data().tolist() == [4] * 8
    mem.close()


def test_negative_size_and_type() -> None:
    with pytest.raises(ShapeError, match=">= 0"):
        SyncedMemory(-1, HostBackend())
    with pytest.raises(TypeError, match="size must be an int"):
        SyncedMemory(1.5, HostBackend())  # type: ignore[arg-type]


def test_zero_size(any_backend: Backend) -> None:
    with SyncedMemory(0, any_backend) as mem:
        assert mem.cpu_data().size == 0
        if any_backend.has_device:
            assert mem.gpu_data().size == 0


def test_close_returns_blocks_and_is_idempotent(any_backend: Backend) -> None:
    pool = get_pool(any_backend, "host")
    base = pool.statistics().used_bytes
    mem = SyncedMemory(1000, any_backend)
    mem.mutable_cpu_data()
    assert pool.statistics().used_bytes == base + 1024
    mem.close()
    mem.close()
    assert pool.statistics().used_bytes == base
    with pytest.raises(StateError, match="was closed"):
        mem.cpu_data()


def test_finalizer_is_a_safety_net() -> None:
    backend = HostBackend()
    pool = get_pool(backend, "host")
    mem = SyncedMemory(100, backend)
    mem.mutable_cpu_data()
    assert pool.statistics().used_bytes == 512
    del mem
    gc.collect()
    assert pool.statistics().used_bytes == 0


# -- asynchronous copies ---------------------------------------------------------


@pytest.mark.anyio
async def test_async_gpu_push(device_backend: Backend) -> None:
    mem = SyncedMemory(32, device_backend)
    mem.mutable_cpu_data()[:] = 7
    await mem.async_gpu_push()
    assert mem.head is Head.SYNCED
    assert to_numpy(mem.gpu_data()).tolist() == [7] * 32
    mem.close()


@pytest.mark.anyio
async def test_async_cpu_pull(device_backend: Backend) -> None:
    mem = SyncedMemory(32, device_backend)
    mem.mutable_gpu_data()[:] = 5
    await mem.async_cpu_pull()
    assert mem.head is Head.SYNCED
    assert mem.cpu_data().tolist() == [5] * 32
    mem.close()


@pytest.mark.anyio
async def test_async_push_needs_head_at_cpu(device_backend: Backend) -> None:
    mem = SyncedMemory(8, device_backend)
    with pytest.raises(StateError, match="needs the head at the CPU, but it is UNINITIALIZED"):
        await mem.async_gpu_push()
    mem.mutable_gpu_data()
    with pytest.raises(StateError, match="HEAD_AT_GPU"):
        await mem.async_gpu_push()
    mem.mutable_cpu_data()
    with pytest.raises(StateError, match="needs the head at the GPU, but it is HEAD_AT_CPU"):
        await mem.async_cpu_pull()
    mem.close()


def test_pending_push_is_invisible_until_its_event_completed() -> None:
    """Caffe marks the head SYNCED when it issues the copy; here accessors wait for it.

    The emulated copy lands only once the test lets it, while the read waits:
    reading the device bytes right after issuing it must still see the pushed
    values, never the stale ones.
    """
    backend = GatedBackend()
    mem = SyncedMemory(16, backend)
    backend.gate.set()
    mem.mutable_gpu_data()[:] = 1  # stale device bytes
    mem.mutable_cpu_data()[:] = 2
    backend.gate.clear()
    event = mem.start_gpu_push()
    assert not event.query()  # the copy really is still in flight
    assert mem.copy_pending
    backend.open_after(0.05)  # lands while gpu_data() waits (if it does)
    assert mem.gpu_data().tolist() == [2] * 16  # waited for the event
    assert mem.head is Head.SYNCED


def test_host_read_waits_for_a_pending_push() -> None:
    """A host read while a push is in flight (the head at the CPU) settles it first, as
    every accessor does: the head is SYNCED and no copy is pending once it returned."""
    backend = GatedBackend()
    mem = SyncedMemory(16, backend)
    backend.gate.set()
    mem.mutable_cpu_data()[:] = 2
    backend.gate.clear()
    mem.start_gpu_push()
    assert mem.copy_pending
    backend.open_after(0.05)
    assert mem.host_bytes().tolist() == [2] * 16
    assert not mem.copy_pending  # (read without settling: the property does not wait)
    assert mem.cpu_data().tolist() == [2] * 16
    mem.close()


def test_emulated_copy_really_is_late() -> None:
    """Without waiting, the device bytes are stale: the emulation catches missing waits."""
    backend = EmulatedBackend(delay=0.2)
    dev = backend.alloc_device(4)
    dev[:] = 1
    issued = time.perf_counter()
    event = backend.copy_to_device(dev, np.full(4, 2, np.uint8))
    early = dev.tolist()
    read = time.perf_counter()
    event.synchronize()
    assert dev.tolist() == [2, 2, 2, 2]
    assert event.completed_at - issued >= 0.2  # landed no sooner than the delay
    if read < issued + 0.2:  # read before the copy could land (unless this thread stalled)
        assert early == [1, 1, 1, 1]


def test_mutable_cpu_waits_before_overwriting_host_bytes_being_read() -> None:
    backend = EmulatedBackend(delay=0.2)
    mem = SyncedMemory(8, backend)
    mem.mutable_cpu_data()[:] = 3
    event = mem.start_gpu_push()
    host = mem.mutable_cpu_data()
    assert event.query()  # the copy had landed before the bytes were handed out to write
    host[:] = 4  # so this cannot race the in-flight copy
    assert mem.gpu_data().tolist() == [4] * 8  # re-pushed after the write
    mem.close()


@pytest.mark.anyio
async def test_awaiting_a_copy_does_not_block_the_event_loop() -> None:
    # the copy lands only once the loop has ticked 10 times while it waits:
    # a loop blocked on the copy never gets there (the gate's timeout opens it)
    backend = GatedBackend(timeout=10)
    mem = SyncedMemory(8, backend)
    mem.mutable_cpu_data()[:] = 1
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            if backend.waiting and not backend.gate.is_set():
                ticks += 1
                if ticks == 10:
                    backend.gate.set()
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await mem.async_gpu_push()
        tg.cancel_scope.cancel()
    assert ticks >= 10 and not backend.timed_out  # the loop kept running during the copy
    mem.close()


def test_close_with_copy_in_flight_defers_block_reuse() -> None:
    backend = GatedBackend()  # the copy stays in flight until the gate opens
    host_pool = get_pool(backend, "host")
    mem = SyncedMemory(600, backend)
    mem.mutable_cpu_data()[:] = 1
    event = mem.start_gpu_push()
    # the caller's stream has run all its work: only the copy's own event holds the block
    backend.current_stream().synchronize()
    mem.close()
    stats = host_pool.statistics()
    assert stats.pending_blocks == 1 and stats.free_blocks == 0
    pending_buffer = host_pool._pending[0][2]
    again = host_pool.malloc(600)  # must not get the block the copy still reads
    assert again.buffer is not pending_buffer
    assert host_pool.statistics().misses == 2
    backend.gate.set()
    event.synchronize()
    assert host_pool.statistics().free_blocks == 1
    host_pool.free(again)


def test_steady_state_allocates_nothing(any_backend: Backend) -> None:
    host = get_pool(any_backend, "host")

    def cycle() -> None:
        for size in (1000, 5000, 70000):
            with SyncedMemory(size, any_backend) as mem:
                mem.mutable_cpu_data()[:] = 1
                if any_backend.has_device:
                    mem.gpu_data()

    cycle()
    before = any_backend.statistics()
    misses = host.statistics().misses
    for _ in range(20):
        cycle()
    after = any_backend.statistics()
    assert host.statistics().misses == misses
    assert after.host_allocations == before.host_allocations
    assert after.device_allocations == before.device_allocations


def test_finalizer_waits_for_a_copy_in_flight() -> None:
    """A SyncedMemory dropped without close() must not hand its block out mid-copy."""
    backend = EmulatedBackend(delay=0.2)
    pool = get_pool(backend, "host")
    mem = SyncedMemory(600, backend)
    mem.mutable_cpu_data()[:] = 1
    event = mem.start_gpu_push()
    dev = mem._gpu
    del mem
    gc.collect()
    block = pool.malloc(600)  # must not be the block the copy still reads
    block.view()[:] = 9
    event.synchronize()
    assert dev.tolist() == [1] * 600
    pool.free(block)


def test_overwrite_cpu_data_skips_the_zero_fill_and_the_copy_back(device_backend: Backend) -> None:
    """A loader refilling a slot overwrites every byte: the head moves to the CPU
    with no zero fill on first use and no device→host copy of the old bytes."""
    mem = SyncedMemory(16, device_backend)
    mem.mutable_cpu_data()[:] = 5
    mem.close()  # the block goes back to the pool, holding 5s
    mem = SyncedMemory(16, device_backend)
    assert mem.overwrite_cpu_data().tolist() == [5] * 16  # the pool's block, not zeroed
    assert mem.head is Head.HEAD_AT_CPU
    mem.overwrite_cpu_data()[:] = 7
    mem.mutable_gpu_data()  # head at the device, the device bytes newer
    before = copies(device_backend)
    host = mem.overwrite_cpu_data()
    assert copies(device_backend) == before  # nothing copied back
    host[:] = 9
    assert to_numpy(mem.gpu_data()).tolist() == [9] * 16  # pushed again when read
    mem.close()


def test_overwrite_cpu_data_waits_for_a_push_reading_the_bytes() -> None:
    backend = GatedBackend()
    mem = SyncedMemory(8, backend)
    mem.mutable_cpu_data()[:] = 3
    event = mem.start_gpu_push()
    assert not event.query()  # the copy is held at the gate
    backend.open_after(0.05)  # lands while overwrite_cpu_data waits (if it does)
    mem.overwrite_cpu_data()[:] = 4  # only once the push in flight has read the 3s
    assert not backend.timed_out and event.query()
    assert to_numpy(mem._gpu).tolist() == [3] * 8  # the push carried the old bytes
    assert to_numpy(mem.gpu_data()).tolist() == [4] * 8
    mem.close()


# -- device errors, zero fill and device checks ----------------------------------------------------


def test_first_device_touch_does_not_wait_for_the_callers_queued_work() -> None:
    """The zero fill of a fresh device block waits for the fill alone: work the
    caller queued before on its current stream (here held back until the test
    opens a gate) does not block ``mutable_gpu_data()``."""
    backend = EmulatedBackend()
    gate = threading.Event()
    ran: list[bool] = []
    backend.run_later(lambda: ran.append(gate.wait(3.0)), 0.0)  # the caller's queued step
    mem = SyncedMemory(64, backend)
    dev = mem.mutable_gpu_data()
    returned_while_held = not ran
    gate.set()
    backend.current_stream().synchronize()
    assert returned_while_held, "mutable_gpu_data() waited for the caller's queued work"
    assert not dev.get().any()
    mem.close()


def test_set_gpu_data_refuses_memory_of_another_device() -> None:
    one = EmulatedBackend(device_id=1)
    zero = EmulatedBackend(device_id=0)
    mem = SyncedMemory(16, one)
    with pytest.raises(UnsupportedOperationError, match="emulated device 0, this blob lives on"):
        mem.set_gpu_data(zero.alloc_device(16))
    with pytest.raises(UnsupportedOperationError, match="got host memory"):
        mem.set_gpu_data(np.zeros(16, np.uint8))
    mem.set_gpu_data(one.alloc_device(16))  # its own device's memory is fine
    mem.close()
