"""The stream discipline (docs/design.md, "Streams and events").

Every blobpipe operation on device memory is ordered after the caller's current
stream; a ring slot handed to the consumer is refilled only once the work the
consumer queued before releasing it has completed; ``copy_time`` measures the
copy alone.

The consumer's device work is queued *late* (:func:`tests._helpers.queue_late`):
on the emulated device it runs on its stream's thread ``LATE`` seconds later, on
CUDA (``-m gpu``) behind a kernel spinning that long. A missing wait therefore
shows up as wrong data, not as a rare race.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blobpipe
from blobpipe import BackendUnavailableError, Batches, Blob, Loader, Transform
from blobpipe._backends import Backend, EmulatedBackend
from blobpipe._loader._device import DeviceWork
from blobpipe.testing import EmulatedArray
from tests._helpers import queue_late, unowned
from tests.conftest import CAFFE, cupy_backend_or_skip, make_backend, to_numpy

LATE = 0.2  # seconds the consumer's queued work runs late
# the side-stream reads: batches (past the ring's ~50 slots of small batches) and lateness
SIDE_BATCHES, SIDE_LATE = 64, 0.02
RAW_COLOR = CAFFE / "lmdb" / "raw_color"
MEAN_FILE = CAFFE / "raw_color_mean.binaryproto"


DEVICES = [
    pytest.param("emulated", None, id="emulated"),
    pytest.param("emulated", False, id="emulated-no-dt"),
    pytest.param("cupy", None, id="cupy", marks=pytest.mark.gpu),
    pytest.param("cupy", False, id="cupy-no-dt", marks=pytest.mark.gpu),
]


# -- Blob operations after the caller's stream -------------------------


def _blob(backend: Backend, value: float) -> Blob:
    blob = Blob((256,), np.float32, backend=backend)
    blob.mutable_cpu_data()[:] = value
    blob.mutable_cpu_diff()[:] = 0
    blob.mutable_gpu_data()
    blob.mutable_gpu_diff()
    return blob


def _fill_late(backend: Backend, array: Any, value: float) -> None:
    queue_late(backend, lambda: array.fill(value), LATE)


def test_update_after_the_callers_diff(device_backend: Backend) -> None:
    """train_digits' step: ``mutable_gpu_diff()[...] = g`` on the current stream, then update()."""
    blob = _blob(device_backend, 3)
    _fill_late(device_backend, blob.mutable_gpu_diff(), 1)
    blob.update()
    assert to_numpy(blob.cpu_data()).tolist() == [2] * 256


def test_scale_after_the_callers_write(device_backend: Backend) -> None:
    blob = _blob(device_backend, 3)
    _fill_late(device_backend, blob.mutable_gpu_data(), 5)
    blob.scale_data(2)
    assert to_numpy(blob.cpu_data()).tolist() == [10] * 256


@pytest.mark.parametrize("which", ["asum", "sumsq"])
def test_reductions_after_the_callers_write(device_backend: Backend, which: str) -> None:
    blob = _blob(device_backend, 3)
    _fill_late(device_backend, blob.mutable_gpu_data(), -2)
    got = blob.asum_data() if which == "asum" else blob.sumsq_data()
    assert got == (2 * 256 if which == "asum" else 4 * 256)


def test_copy_from_after_the_callers_write(device_backend: Backend) -> None:
    src = _blob(device_backend, 3)
    dst = _blob(device_backend, 0)
    _fill_late(device_backend, src.mutable_gpu_data(), 7)
    dst.copy_from(src)
    assert to_numpy(dst.cpu_data()).tolist() == [7] * 256


def test_callers_later_work_sees_the_update(device_backend: Backend) -> None:
    """update() runs after the caller's queued work (it reads the diff that work
    writes) and the caller's work queued after it reads the new data."""
    blob = _blob(device_backend, 3)
    blob.mutable_cpu_diff()[:] = 7
    diff = blob.mutable_gpu_diff()
    data = blob.mutable_gpu_data()
    _fill_late(device_backend, diff, 1)  # the caller's backward pass, still queued
    blob.update()
    seen = device_backend.xp.zeros(256, np.float32)
    queue_late(device_backend, lambda: device_backend.xp.copyto(seen, data), LATE)
    device_backend.synchronize()
    device_backend.current_stream().synchronize()
    assert to_numpy(seen).tolist() == [2] * 256


def test_host_read_after_the_callers_write(device_backend: Backend) -> None:
    """cpu_data() copies device→host after the caller's queued kernels."""
    blob = _blob(device_backend, 3)
    _fill_late(device_backend, blob.mutable_gpu_data(), 4)
    assert to_numpy(blob.cpu_data()).tolist() == [4] * 256


# -- ring slots reused after the consumer's stream --------------------------------


def _expected(db: Path, n: int, **options: Any) -> list[np.ndarray]:
    with Batches(db, **options) as batches:
        return [np.array(b.data) for _, b in zip(range(n), batches, strict=False)]


@pytest.mark.anyio
@pytest.mark.parametrize("known", ["current", "named"])
@pytest.mark.parametrize(("device", "device_transform"), DEVICES)
async def test_consumer_on_a_side_stream_reads_its_batch_whole(
    db30: Path, device: str, device_transform: bool | None, known: str
) -> None:
    """A consumer on its own stream queues a read of each batch, late, and moves on:
    the loader refills the slot only after that read ran. The loader knows the
    stream as the consumer's current one when it asks for the next batch
    ("current"), or from ``Loader(stream=...)`` ("named"). Enough batches that every
    slot is refilled (small batches: a ring of about 50); the late reads hold no
    reference (as a queued kernel), so a batch's lease ends at the next step."""
    backend = make_backend(device)
    side = backend.create_stream()
    xp = backend.xp
    t = Transform(scale=0.5)
    seen: list[Any] = []
    named: dict[str, Any] = {"stream": side} if known == "named" else {}
    async with Loader(
        db30,
        4,
        device=backend,
        prefetch=2,
        transform=t,
        device_transform=device_transform,
        **named,
    ) as loader:
        for _ in range(SIDE_BATCHES):
            if known == "current":
                with backend.using(side):
                    batch = await anext(loader)
            else:
                batch = await anext(loader)
            src = unowned(backend, batch.data.gpu_data())
            dst = xp.empty_like(src)
            with backend.using(side):
                queue_late(backend, lambda dst=dst, src=src: xp.copyto(dst, src), SIDE_LATE)
            seen.append(dst)
    side.synchronize()
    want = _expected(db30, SIDE_BATCHES, batch_size=4, transform=t)
    for k, (got, w) in enumerate(zip(seen, want, strict=True)):
        assert np.array_equal(to_numpy(got), w), f"batch {k} was overwritten under the read"


@pytest.mark.parametrize(("device", "device_transform"), DEVICES)
def test_blocking_consumer_on_a_side_stream(
    db30: Path, device: str, device_transform: bool | None
) -> None:
    """The same for the blocking form (``for batch in loader``)."""
    backend = make_backend(device)
    side = backend.create_stream()
    xp = backend.xp
    seen: list[Any] = []
    with (
        Loader(db30, 4, device=backend, prefetch=2, device_transform=device_transform) as loader,
        backend.using(side),
    ):
        for _, batch in zip(range(SIDE_BATCHES), loader, strict=False):
            src = unowned(backend, batch.data.gpu_data())
            dst = xp.empty_like(src)
            queue_late(backend, lambda dst=dst, src=src: xp.copyto(dst, src), SIDE_LATE)
            seen.append(dst)
    side.synchronize()
    want = _expected(db30, SIDE_BATCHES, batch_size=4)
    for k, (got, w) in enumerate(zip(seen, want, strict=True)):
        assert np.array_equal(to_numpy(got), w), f"batch {k} was overwritten under the read"


# -- copy_time is the copy alone --------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("planner", ["consumer", "fillers"])
@pytest.mark.parametrize(("device", "device_transform"), DEVICES)
async def test_copy_time_excludes_the_consumers_work(
    db30: Path,
    device: str,
    device_transform: bool | None,
    planner: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The consumer's own work on each batch (queued late on its current stream) is
    not counted as copy time: a refilled slot's timing event completes after that
    work, whichever thread issued the slot's device work (the consumer planning small
    batches, or a filler).

    On the emulated device this is held event by event, by when each completed, over
    enough batches that every slot is refilled while the consumer's work on it is
    still queued; a stall of the issuing thread (a loaded machine) cannot blur it. On
    CUDA, where the events carry no completion times, by the total."""
    if planner == "fillers":  # as where the row kernel is not built
        monkeypatch.setattr(blobpipe._loader._pipeline, "row_pool", lambda threads: None)
    backend = make_backend(device)
    emulated = isinstance(backend, EmulatedBackend)
    refills: list[tuple[list[Any], Any]] = []  # (consumer work still queued, timing event)
    issue = DeviceWork.issue

    def recording(self: DeviceWork, slot: Any, plan: Any, path: object) -> None:
        released = slot.released
        queued = [e for e in getattr(released, "events", (released,)) if not e.query()]
        issue(self, slot, plan, path)
        refills.append((queued, slot.started))

    monkeypatch.setattr(DeviceWork, "issue", recording)
    n, late = (120, 0.005) if emulated else (5, LATE)
    async with Loader(
        db30, 4, device=backend, prefetch=2, device_transform=device_transform
    ) as loader:
        delivered = 0
        while delivered < n:
            async for batch in loader:
                # as a queued kernel, the late work keeps no reference: the lease ends
                # at the next step, with that work still queued
                src = unowned(backend, batch.data.gpu_data())
                queue_late(backend, lambda src=src: src.sum(), late)
                delivered += 1
                if delivered == n:
                    break
        backend.current_stream().synchronize()
        stats = loader.statistics()
    assert stats.batches == n
    if not emulated:  # pragma: no cover - GPU machines
        assert stats.copy_time < LATE, stats.copy_time
        return
    waited = [(queued, started) for queued, started in refills if queued]
    # (about 110 of some 150 refills wait here: the rule below is held many times over)
    assert len(waited) >= 10, (
        f"{len(waited)} slots were refilled while the consumer's work on them was queued"
    )
    for queued, started in waited:
        assert started.completed_at >= max(e.completed_at for e in queued)


# -- refills overwrite without copying the stale batch back ---------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("device", ["emulated", pytest.param("cupy", marks=pytest.mark.gpu)])
async def test_dlpack_export_costs_no_copy_back(db30: Path, device: str) -> None:
    """A DLPack export moves the head to the device; refilling the slot overwrites
    the host bytes without copying the stale batch back first."""
    backend = make_backend(device)
    before = backend.statistics()  # the fillers start copying as the loader opens
    async with Loader(db30, 3, device=backend, prefetch=2, device_transform=False) as loader:
        for _ in range(20):
            batch = await anext(loader)
            backend.xp.from_dlpack(batch.data)
        after = backend.statistics()
    assert after.d2h_copies == before.d2h_copies
    assert after.h2d_copies - before.h2d_copies >= 2 * 20  # data and labels pushed


# -- naming the consumer's stream -------------------------------------------------------------


def test_a_stream_needs_a_device(db30: Path) -> None:
    with pytest.raises(BackendUnavailableError, match="as_stream needs a GPU"):
        Loader(db30, 4, device="cpu", stream=object())


def test_a_foreign_stream_is_a_type_error(db30: Path) -> None:
    with pytest.raises(TypeError, match="the emulated device takes its own streams"):
        Loader(db30, 4, device=EmulatedBackend(), stream=3)


# -- a second device -----------------------------------------------------------------


def second_device(name: str) -> Backend:
    """Device 1: the emulated one, or CUDA's second GPU; with one GPU, ``cuda:0``
    named by its explicit index (the ``cuda:N`` path, not the cross-device one)."""
    if name == "emulated":
        return EmulatedBackend(delay=0.001, device_id=1)
    first = cupy_backend_or_skip()  # pragma: no cover - GPU machines
    count = first.xp.cuda.runtime.getDeviceCount()  # pragma: no cover
    return blobpipe.get_backend(f"cuda:{min(1, count - 1)}")  # pragma: no cover


SECOND = ["emulated", pytest.param("cupy", marks=pytest.mark.gpu)]


@pytest.mark.anyio
@pytest.mark.parametrize("device", SECOND)
async def test_loader_on_the_second_device(device: str) -> None:
    """Every filler thread's device work (the mean upload, the copies, the transform)
    runs under the loader's device, not the thread's default device 0."""
    backend = second_device(device)
    t = Transform(mean_file=MEAN_FILE, scale=0.017, crop_size=24, mirror=True)
    options: dict[str, Any] = {"phase": "train", "order": "shuffle", "seed": 3, "transform": t}
    got = []
    async with Loader(
        RAW_COLOR, 8, device=backend, prefetch=2, workers=2, device_transform=True, **options
    ) as loader:
        for _ in range(4):
            got.append(np.array(to_numpy((await anext(loader)).data.gpu_data())))
    want = _expected(RAW_COLOR, 4, batch_size=8, **options)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), k


@pytest.mark.parametrize("device", SECOND)
def test_blob_math_on_the_second_device(device: str) -> None:
    """From a thread whose current device is 0."""
    backend = second_device(device)
    blob = _blob(backend, 3)
    blob.mutable_cpu_diff()[:] = 1
    blob.update()
    blob.scale_data(2)
    assert blob.asum_data() == 4 * 256
    other = _blob(backend, 0)
    other.copy_from(blob)
    assert to_numpy(other.cpu_data()).tolist() == [4] * 256


def test_the_emulated_devices_refuse_each_others_memory() -> None:
    zero, one = EmulatedBackend(), EmulatedBackend(device_id=1)
    theirs = zero.alloc_device(16)
    with pytest.raises(ValueError, match="memory of emulated device 0 given to emulated device 1"):
        one.copy_to_device(theirs, np.zeros(16, np.uint8))
    with pytest.raises(ValueError, match="memory of emulated device 0 given to emulated device 1"):
        one.copy_to_host(np.zeros(16, np.uint8), theirs)
    mine = one.alloc_device(16)
    with pytest.raises(ValueError, match="array device = 1 while current = 0"):
        np.add(mine, 1)  # this thread's current device is 0
    with one.using(one.create_stream()):
        assert np.add(mine, 1).device_id == 1  # inside using(), device 1 is current
    event = one.launch(lambda: np.add(theirs, 1))  # device work on the wrong device
    with pytest.raises(ValueError, match="array device = 0 while current = 1"):
        event.synchronize()


# -- kernels compiled at open ---------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("blocking", [False, True])
@pytest.mark.parametrize("device_transform", [True, False])
async def test_the_transform_kernels_run_once_at_open(
    db30: Path, monkeypatch: pytest.MonkeyPatch, device_transform: bool, blocking: bool
) -> None:
    """With the device transform, open() runs its kernels (CuPy compiles them there,
    once) before any batch is planned; without it, nothing runs at open."""
    import blobpipe._loader._device as device_module

    seen: list[int] = []  # batches planned when the kernel ran
    loader: Loader | None = None
    real = device_module.apply

    def spy(*args: Any, **kwargs: Any) -> None:
        seen.append(loader._pipe._planned if loader is not None else -1)
        real(*args, **kwargs)

    monkeypatch.setattr(device_module, "apply", spy)
    t = Transform(mean_value=(1, 2, 3), scale=0.5, crop_size=8, mirror=True)
    loader = Loader(
        db30,
        4,
        device=EmulatedBackend(),
        prefetch=2,
        transform=t,
        device_transform=device_transform,
    )
    if blocking:
        with loader:
            at_open = list(seen)
            for _ in range(3):
                next(loader)
    else:
        async with loader:
            at_open = list(seen)
            for _ in range(3):
                await anext(loader)
    if device_transform:
        # the first run is open's, before any batch was planned (the filler threads
        # start right after it, so batches may have run theirs by now too)
        assert at_open[:1] == [0]
        assert len(seen) >= 1 + 3  # then each batch's own (3 delivered, from 2 slots)
    else:
        assert seen == []


@pytest.mark.parametrize("batch_size", [2, 16])
def test_the_device_transform_is_a_few_launches_a_batch(batch_size: int) -> None:
    """A mean file, random crops and mirrors (W3's recipe): the device finishes a
    batch in the same few kernels whatever its size (the mean's crops gathered in
    one), not one or two per row; and its output equals the host's transform."""
    backend = EmulatedBackend()
    t = Transform(mean_file=MEAN_FILE, scale=0.017, crop_size=24, mirror=True)
    options: dict[str, Any] = {"phase": "train", "order": "shuffle", "seed": 5, "transform": t}
    counts: list[int] = []
    import blobpipe._loader._device as device_module

    real = device_module.apply

    ufunc = EmulatedArray.__array_ufunc__
    active: dict[int, list[int]] = {}  # slots' kernels may run at once: one count each

    def count(self: Any, *a: Any, **k: Any) -> Any:
        calls = active.get(threading.get_ident())
        if calls is not None:
            calls[0] += 1
        return ufunc(self, *a, **k)

    def counted(xp: Any, *args: Any, **kwargs: Any) -> None:
        calls = active[threading.get_ident()] = [0]
        try:
            real(xp, *args, **kwargs)
        finally:
            del active[threading.get_ident()]
        counts.append(calls[0])

    got = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_module, "apply", counted)
        mp.setattr(EmulatedArray, "__array_ufunc__", count)
        with Loader(
            RAW_COLOR, batch_size, device=backend, prefetch=1, workers=1, **options
        ) as loader:
            for _, batch in zip(range(3), loader, strict=False):
                got.append(np.array(to_numpy(batch.data.gpu_data())))
    assert counts and max(counts) <= 2, counts  # subtract, multiply
    want = _expected(RAW_COLOR, 3, batch_size=batch_size, **options)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), k


def test_the_device_kernel_reads_the_slots_geometry_as_the_host_drew_it() -> None:
    """The host fill records each row's crop and flip in the slot's Geometry (intp
    offsets, bool flips); the device kernel gets that very Geometry, no copy or
    conversion, holding what the transform draws for each row's random word."""
    import blobpipe._loader._device as device_module

    t = Transform(mean_file=MEAN_FILE, scale=0.017, crop_size=24, mirror=True)
    filled: list[tuple[Any, Any, list[tuple[int, int, bool]]]] = []  # (geometry, plan, rows)
    kernels: list[Any] = []
    launch = device_module.DeviceWork._launch_transform
    finish = device_module.apply

    def spy_launch(self: Any, slot: Any, plan: Any, mean: Any, *arrays: Any) -> None:
        g = slot.geometry
        filled.append((g, plan, [g.row(r) for r in range(len(g))]))
        launch(self, slot, plan, mean, *arrays)

    def spy_finish(xp: Any, u8: Any, out: Any, geometry: Any, spec: Any, **kwargs: Any) -> None:
        kernels.append(geometry)
        finish(xp, u8, out, geometry, spec, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_module.DeviceWork, "_launch_transform", spy_launch)
        mp.setattr(device_module, "apply", spy_finish)
        with Loader(
            RAW_COLOR, 3, device=EmulatedBackend(), prefetch=2, transform=t, phase="train",
            order="shuffle", seed=4,
        ) as loader:  # fmt: skip
            for _, _batch in zip(range(4), loader, strict=False):
                pass
    assert len(filled) >= 4 and len(kernels) == 1 + len(filled)  # open's warm-up first
    flips = set()
    for geometry, plan, rows in filled:
        assert geometry.h_off.dtype == np.intp and geometry.mirror.dtype == np.bool_
        assert any(k is geometry for k in kernels[1:])
        for r, row in enumerate(rows):
            p = t.record_params(plan.record_shape, phase="train", word=int(plan.words[r]))
            assert row == (p.h_off, p.w_off, p.mirror)
            flips.add(row[2])
    assert flips == {False, True}


# -- a torch consumer on its own stream (the GPU check's target) ----------------------------------


@pytest.mark.gpu
def test_torch_consumer_on_a_side_stream_sees_no_torn_batch(
    db30: Path,
) -> None:  # pragma: no cover - GPU machines
    """1,000 batches summed late on a torch side stream equal the host's sums."""
    backend = cupy_backend_or_skip()
    torch = pytest.importorskip("torch")
    side = torch.cuda.Stream(device=backend.device_id)
    t = Transform(scale=0.5)
    n = 1000
    sums = []
    with (
        Loader(db30, 4, device=backend, prefetch=2, transform=t, stream=side) as loader,
        torch.cuda.stream(side),
    ):
        for _, batch in zip(range(n), loader, strict=False):
            x = torch.from_dlpack(batch.data)
            torch.cuda._sleep(200_000)  # the consumer's step, on its stream
            sums.append(x.double().sum())
    side.synchronize()
    want = [
        float(np.asarray(d, np.float64).sum())
        for d in _expected(db30, n, batch_size=4, transform=t)
    ]
    torn = [
        k
        for k, (s, w) in enumerate(zip(sums, want, strict=True))
        if not np.isclose(float(s), w, rtol=1e-9)
    ]
    assert not torn, f"{len(torn)} of {n} batches torn, the first: {torn[:5]}"


# -- memory reuse ordered by the consumer's stream --------------------------------------------


def _read_late_on(backend: Backend, stream: Any, src: Any) -> Any:
    """Queue, on ``stream``, a late copy of device array ``src``; return its target."""
    xp = backend.xp
    dst = xp.zeros(src.shape, src.dtype)
    with backend.using(stream):
        queue_late(backend, lambda: xp.copyto(dst, src), LATE)
    return dst


@pytest.mark.parametrize("device", ["emulated", pytest.param("cupy", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("how", ["current", "named"])
def test_a_closed_blobs_device_block_waits_for_the_consumers_stream(device: str, how: str) -> None:
    """A blob closed while the consumer's kernels on a side stream still read it:
    the pool hands its device block to no one before that work ran. The side stream
    is the closer's current one ("current") or named (``release_after(stream=)``)."""
    backend = make_backend(device)
    side = backend.create_stream()
    blob = Blob((4096,), np.float32, backend=backend)
    blob.mutable_cpu_data()[:] = 1
    seen = _read_late_on(backend, side, blob.gpu_data())
    if how == "current":
        with backend.using(side):
            blob.close()
    else:
        blob.release_after(stream=side)
        blob.close()
    others = []
    for _ in range(4):  # each would take the closed blob's block and overwrite it
        other = Blob((4096,), np.float32, backend=backend)
        other.mutable_cpu_data()[:] = 2
        other.gpu_data()
        others.append(other)
    side.synchronize()
    assert to_numpy(seen).tolist() == [1] * 4096
    for other in others:
        other.close()


@pytest.mark.parametrize("device", ["emulated", pytest.param("cupy", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_batch_let_go_off_its_named_stream_is_not_reused_early(
    db30: Path, device: str, how: str
) -> None:
    """``Loader(stream=side)``: the consumer queues a late read of a batch on
    ``side`` (a raw alias: the read holds no reference, as a CUDA kernel holds
    none) and closes or drops the batch from outside ``side``; the slot's refill
    waits for the read."""
    backend = make_backend(device)
    side = backend.create_stream()
    with Loader(db30, 4, device=backend, prefetch=2, stream=side, device_transform=False) as loader:
        batch = next(loader)
        seen = _read_late_on(backend, side, unowned(backend, batch.data.gpu_data()))
        if how == "close":
            batch.close()
        del batch
        for _ in range(4):  # the slot is refilled meanwhile
            next(loader)
        side.synchronize()
    want = _expected(db30, 1, batch_size=4)[0]
    assert np.array_equal(to_numpy(seen), want)


class _Plan:
    """The part of a BatchPlan that ``Slot.prepare`` reads."""

    def __init__(self, n: int, shape: tuple[int, ...]) -> None:
        self.data_shape = (n, *shape)
        self.dtype = np.dtype(np.uint8)
        self.label_dtype = np.dtype(np.float32)
        self.extra: tuple[Any, ...] = ()
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_a_growing_slot_lets_its_old_buffers_go_after_the_release() -> None:
    """A slot refitted to a larger batch releases its old device buffers ordered
    after the consumer's release event: no other blob reuses them while the
    consumer's work on the slot's last batch may still read them."""
    from blobpipe._loader._ring import Slot

    backend = EmulatedBackend()
    side = backend.create_stream()
    slot = Slot(backend, backend.create_stream())
    data, _, _, _ = slot.prepare(_Plan(4, (8, 8)), None)  # type: ignore[arg-type]
    data[...] = 7
    assert slot.host is not None
    src = slot.host.gpu_data()
    seen = _read_late_on(backend, side, src)
    slot.released = backend.record_event(side)  # the consumer let the batch go
    slot.prepare(_Plan(64, (8, 8)), None)  # type: ignore[arg-type]
    others = []
    for _ in range(4):
        other = Blob((4, 8, 8), np.uint8, backend=backend)
        other.mutable_cpu_data()[...] = 9
        other.gpu_data()
        others.append(other)
    side.synchronize()
    assert to_numpy(seen).tolist() == np.full((4, 8, 8), 7, np.uint8).tolist()
    slot.close()
    for other in others:
        other.close()


@pytest.mark.parametrize("which", ["host", "label"])
def test_a_refilled_slot_hands_out_its_current_buffers_with_the_head_on_the_cpu(
    which: str,
) -> None:
    """A slot refilled with a batch like its last hands out arrays over its blobs'
    current buffers, with each memory's head moved to the CPU (the fill's bytes are
    pushed again, not the last batch's): also after its batch went to the device,
    after a buffer was replaced, and after a batch of another shape."""
    from blobpipe._loader._ring import Slot
    from blobpipe._syncedmem import Head

    backend = EmulatedBackend(delay=0.001)
    slot = Slot(backend, backend.create_stream())
    plan = _Plan(4, (8, 8))
    for value, (n, shape) in enumerate(
        [(4, (8, 8)), (4, (8, 8)), (4, (8, 8)), (2, (8, 8)), (2, (8, 8))]
    ):
        if n != plan.n:
            plan = _Plan(n, shape)
        if value == 2:  # someone replaced the buffer (a borrowed one)
            blob = getattr(slot, which)
            blob.data.set_cpu_data(np.zeros(blob.data.size, np.uint8))
        data, label, _, _ = slot.prepare(plan, None)  # type: ignore[arg-type]
        array = data if which == "host" else label
        blob = getattr(slot, which)
        assert blob.data.head is Head.HEAD_AT_CPU
        assert array.shape == blob.shape and np.shares_memory(array, blob.cpu_data())
        array[...] = value + 1
        assert to_numpy(blob.gpu_data()).tolist() == np.full(blob.shape, value + 1).tolist()
    slot.close()


# -- device exports hold their memory -------------------------------------------------------


@pytest.mark.parametrize("device_transform", [None, False])
def test_numpy_from_dlpack_of_a_device_batch_keeps_its_values(
    db30: Path, device_transform: bool | None
) -> None:
    """``numpy.from_dlpack`` of an emulated-device batch keeps its values after the
    batch is closed and four more batches are kept."""
    backend = EmulatedBackend(delay=0.001)
    t = Transform(scale=0.5)
    with Loader(
        db30, 4, device=backend, prefetch=2, transform=t, device_transform=device_transform
    ) as loader:
        batch = next(loader)
        assert batch.data.__dlpack_device__() == (1, 0)  # NumPy memory stands in for it
        exported = np.from_dlpack(batch.data)
        batch.close()
        later = [next(loader) for _ in range(4)]
        backend.synchronize()
        want = _expected(db30, 1, batch_size=4, transform=t)[0]
        assert np.array_equal(exported, want)
        del later
    assert np.array_equal(exported, want)  # and after the loader closed


def test_a_device_export_holds_the_memory_until_it_goes() -> None:
    backend = EmulatedBackend()
    pool = blobpipe.get_pool(backend, "device")
    blob = Blob((1024,), np.float32, backend=backend)
    blob.mutable_gpu_data()
    exported = np.from_dlpack(blob)
    used = pool.statistics().used_bytes
    blob.close()
    assert pool.statistics().used_bytes == used  # the export holds the block
    del exported
    assert pool.statistics().used_bytes == used - 4096


# -- the stream a DLPack consumer names ---------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(("device", "device_transform"), DEVICES)
async def test_a_dlpack_consumers_stream_orders_the_slots_reuse(
    db30: Path, device: str, device_transform: bool | None
) -> None:
    """A consumer that takes each batch with ``from_dlpack`` on its side stream
    (CuPy and torch pass their current stream to ``__dlpack__``) and reads it late
    there, without ``Loader(stream=)`` and asking for the next batch off that
    stream: the slot is refilled only after that read. (The emulated ``xp`` passes
    its stream object; CUDA's integer handles, 1 and 2 included, are mapped by
    ``CupyBackend.dlpack_stream``, checked on the CuPy stand-in and under ``-m gpu``.)
    Every slot refilled, the late reads holding no reference, as in the tests above."""
    backend = make_backend(device)
    side = backend.create_stream()
    xp = backend.xp
    t = Transform(scale=0.5)
    seen: list[Any] = []
    async with Loader(
        db30, 4, device=backend, prefetch=2, transform=t, device_transform=device_transform
    ) as loader:
        for _ in range(SIDE_BATCHES):
            batch = await anext(loader)
            with backend.using(side):
                x = xp.from_dlpack(batch.data)
                src = unowned(backend, x)
                dst = xp.empty_like(x)
                queue_late(backend, lambda dst=dst, src=src: xp.copyto(dst, src), SIDE_LATE)
            del x  # off the side stream: the lease ends at the next step, off it too
            seen.append(dst)
        side.synchronize()
    want = _expected(db30, SIDE_BATCHES, batch_size=4, transform=t)
    for k, (got, w) in enumerate(zip(seen, want, strict=True)):
        assert np.array_equal(to_numpy(got), w), f"batch {k} was overwritten under the read"


# -- the same rules on real CUDA (the GPU check's first probes) -----------------------------------


@pytest.mark.gpu
def test_cupy_from_dlpack_of_a_batch_keeps_its_values(
    db30: Path,
) -> None:  # pragma: no cover - GPU machines
    """On CUDA: ``cupy.from_dlpack`` of a batch keeps its values after the batch is
    closed and four more batches are kept."""
    backend = cupy_backend_or_skip()
    t = Transform(scale=0.5)
    with Loader(db30, 4, device=backend, prefetch=2, transform=t) as loader:
        batch = next(loader)
        exported = backend.xp.from_dlpack(batch.data)
        batch.close()
        later = [next(loader) for _ in range(4)]
        backend.synchronize()
        got = to_numpy(exported)
        del later
    assert np.array_equal(got, _expected(db30, 1, batch_size=4, transform=t)[0])


@pytest.mark.gpu
def test_a_raw_stream_handle_warns_nothing(db30: Path) -> None:  # pragma: no cover - GPU
    """On CUDA: ``Loader(stream=<cudaStream_t int>)`` under warnings-as-errors."""
    import warnings

    backend = cupy_backend_or_skip()
    side = backend.xp.cuda.Stream(non_blocking=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Loader(db30, 4, device=backend, prefetch=2, stream=int(side.ptr)) as loader:
            for _, _batch in zip(range(3), loader, strict=False):
                pass


@pytest.mark.gpu
def test_cuda_is_the_threads_current_device() -> None:  # pragma: no cover - GPU machines
    """On CUDA: ``"cuda"`` after ``cupy.cuda.Device(n).use()`` in a thread
    (n: the last device; 0 on a one-GPU machine)."""
    import threading

    cp = cupy_backend_or_skip().xp
    last = cp.cuda.runtime.getDeviceCount() - 1
    got: list[int | None] = []

    def rank() -> None:
        cp.cuda.Device(last).use()
        got.append(blobpipe.get_backend("cuda").device_id)

    thread = threading.Thread(target=rank)
    thread.start()
    thread.join()
    assert got == [last]


@pytest.mark.gpu
def test_filler_threads_stay_on_the_loaders_device(db30: Path) -> None:  # pragma: no cover
    """On CUDA: every filler thread's current device is the loader's
    after its work (the last device; on one GPU this cannot show a switch to 0)."""
    import threading

    import blobpipe._loader._ring as ring

    cp = cupy_backend_or_skip().xp
    last = cp.cuda.runtime.getDeviceCount() - 1
    backend = blobpipe.get_backend(f"cuda:{last}")
    seen: dict[str, int] = {}
    real = ring.Slot.prepare

    def prepare(self: Any, *args: Any) -> Any:
        out = real(self, *args)
        seen[threading.current_thread().name] = int(cp.cuda.runtime.getDevice())
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ring.Slot, "prepare", prepare)
        with Loader(db30, 4, device=backend, prefetch=4, workers=2) as loader:
            for _, _batch in zip(range(8), loader, strict=False):
                pass
    fillers = {k: v for k, v in seen.items() if k.startswith("blobpipe-filler-")}
    assert fillers and set(fillers.values()) == {last}, seen


def test_the_emulated_dlpack_stream_values() -> None:
    backend = EmulatedBackend()
    side = backend.create_stream()
    assert backend.dlpack_stream(-1) is None
    assert backend.dlpack_stream(None) is backend.null_stream()
    assert backend.dlpack_stream(1) is backend.null_stream()
    assert backend.dlpack_stream(side) is side
    with pytest.raises(TypeError, match="the emulated device takes its own streams"):
        backend.dlpack_stream("side")


# -- one transform for host and device -----------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 1, 7), (3, 7, 1), (1, 1, 1), (3, 5, 6)])
@pytest.mark.parametrize("crop_size", [0, 1])
@pytest.mark.parametrize("mean", ["file", "value"])
def test_host_and_device_transforms_agree_on_records_one_pixel_high_or_wide(
    tmp_path: Path, shape: tuple[int, int, int], crop_size: int, mean: str
) -> None:
    """The device finishes a uint8 batch with the host kernel's arithmetic: a mean
    file taken at each row's crop offset and flipped with its row, whatever the
    record's height or width (one pixel included), equal to the host's bits."""
    from blobpipe._proto import caffe_pb2
    from tests._helpers import raw_db

    db = raw_db(tmp_path / "db", 12, shape)
    means: dict[str, Any] = {"value": (10.0, 20.0, 30.0)[: shape[0]]}
    if mean == "file":
        values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * 1.5
        proto = caffe_pb2.BlobProto()
        proto.shape.dim.extend(shape)
        proto.data.extend(values.reshape(-1).tolist())
        (tmp_path / "mean.binaryproto").write_bytes(proto.SerializeToString())
        transform = Transform(
            mean_file=tmp_path / "mean.binaryproto", scale=0.5, crop_size=crop_size, mirror=True
        )
    else:
        transform = Transform(
            mean_value=means["value"], scale=0.5, crop_size=crop_size, mirror=True
        )
    options: dict[str, Any] = {
        "transform": transform, "phase": "train", "order": "shuffle", "seed": 7,
    }  # fmt: skip
    got = []
    with Loader(
        db, 4, device=EmulatedBackend(), prefetch=1, workers=1, device_transform=True, **options
    ) as loader:
        assert loader.device_transform
        for _, batch in zip(range(3), loader, strict=False):
            got.append(np.array(to_numpy(batch.data.gpu_data())))
    want = _expected(db, 3, batch_size=4, **options)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), k
