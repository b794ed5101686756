"""CUDA's rules that the device path meets, on the emulated device where it models
them (docs/design.md, "Device backends and the emulated device").

The emulated device models, besides its late copies: a current device per thread,
each device's current stream in that thread, per-thread default streams (handle
2, whichever thread uses it) that the legacy default stream waits for, frees that
synchronise the device, and streams of another device that CUDA refuses. Each test
here fails without the rule it names. What the emulated device cannot model has a
``gpu`` test, with the reason in its docstring.
"""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from blobpipe import ArgumentError, Batches, Blob, Loader, Transform
from blobpipe._backends import Backend, EmulatedBackend, Stream
from blobpipe._backends._emulated import _Capsule, current_device
from blobpipe._io import _lmdbenv
from blobpipe._pool import Block, MemoryPool
from tests._helpers import queue_late, raw_db, unowned
from tests.conftest import cupy_backend_or_skip, make_backend, to_numpy

LATE = 0.2  # seconds the consumer's queued work runs late


def _expected(db: Path, n: int, **options: object) -> list[np.ndarray]:
    with Batches(db, **options) as batches:  # type: ignore[arg-type]
        return [np.array(b.data) for _, b in zip(range(n), batches, strict=False)]


# -- the refill after a consumer's host write -----------------------------------------------------


def test_a_refill_after_the_consumers_host_write_waits_for_its_device_read(db30: Path) -> None:
    """The consumer reads a batch late on its stream, then writes the batch on the
    host (``mutable_cpu_data``: the head moves to the host) and lets it go. The
    slot's refill copies those host bytes back to the device (the output blob's
    ``mutable_gpu_data``) only after the consumer's read: its wait for the
    release comes before any write of the slot's device memory."""
    backend = EmulatedBackend(delay=0.001)
    side = backend.create_stream()
    t = Transform(scale=0.5)
    with Loader(
        db30,
        4,
        device=backend,
        prefetch=2,
        transform=t,
        stream=side,
        device_transform=True,
        mode="wrap",
    ) as loader:
        batch = next(loader)
        src = unowned(backend, batch.data.gpu_data())
        seen = backend.xp.zeros(src.shape, src.dtype)
        with backend.using(side):
            queue_late(backend, lambda: backend.xp.copyto(seen, src), LATE)
        batch.data.mutable_cpu_data()[...] = -1
        del batch
        for _ in range(2 * loader.statistics().slots):  # every slot is refilled meanwhile
            next(loader)
        side.synchronize()
    want = _expected(db30, 1, batch_size=4, transform=t)[0]
    assert np.array_equal(to_numpy(seen), want)


# -- the device transform of records one pixel high -----------------------------------------------


@pytest.mark.parametrize("crop", [0, 1])
def test_the_device_transform_of_records_one_pixel_high(tmp_path: Path, crop: int) -> None:
    """Records of height 1 with a (C, 1, W) mean file, mirrored (and cropped to one
    pixel): the device transform gives the host's batches."""
    from tests.test_transform import _mean_file

    db = raw_db(tmp_path / "db", 16, shape=(3, 1, 12))
    mean = np.random.default_rng(3).uniform(0, 50, (3, 1, 12)).astype(np.float32)
    t = Transform(mirror=True, crop_size=crop, mean_file=_mean_file(tmp_path, mean), scale=0.5)
    want = _expected(db, 4, batch_size=4, transform=t, phase="train")
    backend = EmulatedBackend()
    with Loader(db, 4, device=backend, transform=t, phase="train", device_transform=True) as loader:
        got = [np.array(b.data.cpu_data()) for _, b in zip(range(4), loader, strict=False)]
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"batch {k}"


# -- frees that synchronise -----------------------------------------------------------------------


def test_a_free_that_waits_for_the_device_holds_no_pool_lock() -> None:
    """A device block given back to the system (the cache over its limit) waits, as
    cudaFree does, for all work queued on the device: meanwhile another thread's
    allocation from the same pool goes on (the free runs outside the pool's lock)."""
    backend = EmulatedBackend()
    pool = MemoryPool(backend, "device", cache_limit=8192)
    a, b = pool.malloc(8192), pool.malloc(4096)
    pool.free(a)  # cached, at the limit
    gate = threading.Event()
    busy = backend.create_stream()
    backend.run_later(gate.wait, 0, stream=busy)  # a consumer's long kernel
    # over the cache limit: the larger block, a's, goes back to the system
    freeing = threading.Thread(target=pool.free, args=(b,))
    freeing.start()
    time.sleep(0.2)  # the free is waiting for the device now
    took: list[Block] = []
    other = threading.Thread(target=lambda: took.append(pool.malloc(4096)))
    other.start()
    other.join(timeout=5)
    done = not other.is_alive()
    gate.set()
    freeing.join(timeout=10)
    other.join(timeout=10)
    assert done, "an allocation waited for another thread's free to synchronise the device"
    assert not freeing.is_alive() and len(took) == 1


def test_a_pool_frees_under_its_device() -> None:
    """A device-1 pool trimmed from a thread on device 0 frees with device 1 current
    (CuPy's ``Memory.__dealloc__`` frees in the current device's context)."""
    backend = EmulatedBackend(device_id=1)
    pool = MemoryPool(backend, "device", cache_limit=4096)
    blocks = [pool.malloc(4096) for _ in range(3)]
    for block in blocks:
        pool.free(block)
    pool.free_all_blocks()
    assert current_device() == 0
    assert backend.frees_off_device == 0


# -- the DLPack hand-shake under the blob's device -------------------------------------------------


def test_a_device_export_orders_the_consumer_after_the_blobs_device() -> None:
    """torch.from_dlpack of a blob on device 1 from a thread whose current device is
    0 passes device 1's stream and switches nothing: the consumer's stream waits for
    the caller's current stream *of device 1*, where the kernel writing the blob is
    still queued (CuPy's own hand-shake would take device 0's)."""
    EmulatedBackend(device_id=0)  # the thread's current device exists
    one = EmulatedBackend(device_id=1)
    blob = Blob((4096,), np.float32, backend=one)
    blob.mutable_cpu_data()[:] = 1
    data = blob.mutable_gpu_data()
    one.run_later(lambda: data.fill(5), LATE)  # on device 1's current stream here
    side = one.create_stream()
    assert current_device() == 0
    blob.__dlpack__(stream=side)
    with one.using(side):
        seen = one.xp.zeros(4096, np.float32)
        one.run_later(lambda: one.xp.copyto(seen, data), 0)  # the consumer's kernel
    side.synchronize()
    assert to_numpy(seen).tolist() == [5] * 4096


@pytest.mark.parametrize("stream", [0, 1, None])
def test_a_device_export_passes_cupy_no_stream_0(stream: int | None) -> None:
    """torch has passed 0 for its default stream; CuPy warns on 0 (an error under
    ``-W error``). blobpipe orders the consumer itself and hands its array -1."""
    backend = EmulatedBackend()
    blob = Blob((16,), np.float32, backend=backend)
    blob.mutable_gpu_data()
    assert np.from_dlpack(_Capsule(blob.__dlpack__(stream=stream))).shape == (16,)


@pytest.mark.gpu
def test_a_cuda_export_to_a_stream_0_consumer_warns_nothing() -> None:  # pragma: no cover - GPU
    """On CUDA: ``__dlpack__(stream=0)`` (torch's old default stream) under
    ``-W error``: CuPy warns on 0; blobpipe hands it -1 after its own hand-shake."""
    backend = cupy_backend_or_skip()
    blob = Blob((16,), np.float32, backend=backend)
    blob.mutable_gpu_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = backend.xp.from_dlpack(_Handshake(blob, 0))
    assert x.shape == (16,)


class _Handshake:
    """A DLPack producer that passes ``stream`` to ``blob`` whatever it is asked."""

    def __init__(self, blob: Blob, stream: int) -> None:
        self._blob, self._stream = blob, stream

    def __dlpack__(self, **kwargs: object) -> object:
        kwargs["stream"] = self._stream
        return self._blob.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._blob.__dlpack_device__()  # type: ignore[no-any-return]


# -- per-thread default streams -------------------------------------------------------------------


def _per_thread(backend: Backend) -> Stream:
    """The per-thread default stream's handle as a Stream of ``backend`` (CUDA's 2)."""
    if isinstance(backend, EmulatedBackend):
        return backend.as_stream(backend.per_thread)
    return backend.as_stream(backend.xp.cuda.Stream.ptds)  # pragma: no cover - GPU


def _drop_in_another_thread(backend: Backend, held: list[object]) -> None:
    """Let go of the last references in ``held`` from another thread (a DLPack
    deleter, a collection in a filler) whose current stream is its own per-thread
    default stream (a program built for per-thread default streams)."""

    def drop() -> None:
        with backend.using(_per_thread(backend)):
            held.clear()

    thread = threading.Thread(target=drop)
    thread.start()
    thread.join()


@pytest.mark.parametrize("device", ["emulated", pytest.param("cupy", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("how", ["dlpack", "current"])
def test_a_per_thread_default_stream_named_here_is_waited_for_when_let_go_elsewhere(
    db30: Path, device: str, how: str
) -> None:
    """The consumer works on its per-thread default stream: it names it (handle 2)
    to ``__dlpack__`` ("dlpack": the Loader's named stream is another) or has it
    current when it takes the batch ("current"), reads the batch late there, and
    the batch's last reference goes in another thread. The release recorded there
    must not land on *that* thread's per-thread default stream: the slot is refilled
    only after the consumer's read."""
    backend = make_backend(device)
    ptds = _per_thread(backend)
    named = backend.create_stream() if how == "dlpack" else None
    t = Transform(scale=0.5)
    with Loader(
        db30,
        4,
        device=backend,
        prefetch=2,
        transform=t,
        device_transform=False,
        mode="wrap",
        stream=named,
    ) as loader:
        if how == "dlpack":
            batch = next(loader)
            batch.data.__dlpack__(stream=2)  # the capsule goes at once; the stream is named
        else:
            with backend.using(ptds):
                batch = next(loader)
        src = unowned(backend, batch.data.gpu_data())
        seen = backend.xp.zeros(src.shape, src.dtype)
        with backend.using(ptds):
            queue_late(backend, lambda: backend.xp.copyto(seen, src), LATE)
        held: list[object] = [batch]
        del batch
        _drop_in_another_thread(backend, held)
        for _ in range(2 * loader.statistics().slots):  # every slot is refilled meanwhile
            next(loader)
        ptds.synchronize()
    want = _expected(db30, 1, batch_size=4, transform=t)[0]
    assert np.array_equal(to_numpy(seen), want)


def test_the_legacy_stream_waits_for_every_per_thread_default_stream() -> None:
    """The emulated model: an event on the null stream completes after the work
    queued before it on another thread's per-thread default stream."""
    backend = EmulatedBackend()
    done: list[int] = []

    def consumer() -> None:
        backend.run_later(lambda: done.append(1), LATE, stream=backend.per_thread)

    thread = threading.Thread(target=consumer)
    thread.start()
    thread.join()
    backend.record_event(backend.null_stream()).synchronize()
    assert done == [1]


# -- streams of another device ------------------------------------------------------------------


def test_cuda_refuses_an_event_on_a_stream_of_another_device() -> None:
    """The emulated model: as ``cudaEventRecord`` with an event of device 1 on a
    stream of device 0, and a copy queued there, fail (invalid resource handle)."""
    zero, one = EmulatedBackend(device_id=0), EmulatedBackend(device_id=1)
    foreign = zero.create_stream()
    with pytest.raises(RuntimeError, match="cudaErrorInvalidResourceHandle"):
        one.record_event(foreign)
    with pytest.raises(RuntimeError, match="cudaErrorInvalidResourceHandle"):
        one.copy_to_device(one.alloc_device(8), np.zeros(8, np.uint8), foreign)


def test_a_stream_of_another_device_is_refused_when_named(db30: Path) -> None:
    """``Loader(stream=)`` and a DLPack consumer's stream of another device fail at
    once, naming both devices, not at the first release (where CUDA's error would
    come from a collection, or be taken for the interpreter's exit)."""
    zero, one = EmulatedBackend(device_id=0), EmulatedBackend(device_id=1)
    foreign = zero.create_stream()
    with pytest.raises(ArgumentError, match="emulated device 0, this backend is emulated device 1"):
        Loader(db30, 4, device=one, stream=foreign)
    blob = Blob((16,), np.float32, backend=one)
    blob.mutable_gpu_data()
    with pytest.raises(ArgumentError, match="emulated device 0"):
        blob.__dlpack__(stream=foreign)
    assert one.as_stream(one.create_stream()) is not None


@pytest.mark.anyio
@pytest.mark.parametrize("form", ["blocking", "async"])
async def test_a_failing_device_kernel_reaches_the_consumer(
    db30: Path, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device transform that fails on the emulated stream is raised where the batch is
    waited for, in both forms: never a batch of whatever the output held (the error is
    sticky on its stream, as CUDA's, so the slot's later event reports it too)."""
    import blobpipe._loader._device as device_module

    real = device_module.apply

    def failing(*args: object, **kwargs: object) -> None:
        if threading.current_thread().name != "blobpipe-emulated-stream":
            real(*args, **kwargs)  # the loader's warm-up, in the opening thread
            return
        raise RuntimeError("emulated kernel fault")

    monkeypatch.setattr(device_module, "apply", failing)
    backend = EmulatedBackend(delay=0.001)

    async def first_batch() -> None:
        if form == "blocking":
            with Loader(db30, 4, device=backend, device_transform=True) as loader:
                next(loader)
        else:
            async with Loader(db30, 4, device=backend, device_transform=True) as loader:
                await anext(loader)

    with pytest.raises(RuntimeError, match="emulated kernel fault"):
        await first_batch()
    assert _lmdbenv.REGISTRY.envs == {}  # the loader closed whole, its database with it
