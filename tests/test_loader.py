"""Loader: content equal to Batches and to Caffe, lifetimes, cancellation, errors, memory.

Every async test runs under asyncio and trio (the ``anyio_backend`` fixture).
Device tests run on the emulated device, whose copies land later on worker
threads, so a missing event wait shows up as wrong data without a GPU; the
same tests run on CUDA under the ``gpu`` marker.
"""

from __future__ import annotations

import gc
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest

import blobpipe
from blobpipe import Batches, DataError, Loader, StateError, Transform, get_pool
from blobpipe._backends import Backend, EmulatedBackend, HostBackend
from blobpipe._backends._emulated import EmulatedEvent
from blobpipe._io._batches import ArrayBatch
from blobpipe._loader._chunk import CHUNK_BATCHES, CHUNK_BYTES, chunk_batches, planned_together
from tests._helpers import (
    GatedBackend,
    encoded_db,
    float_db,
    key,
    raw_db,
    stays,
    wait_until,
    write_lmdb,
)
from tests.conftest import CAFFE, make_backend, to_numpy

RAW_COLOR = CAFFE / "lmdb" / "raw_color"
MEAN_FILE = CAFFE / "raw_color_mean.binaryproto"


# -- helpers ---------------------------------------------------------------------------------


DEVICES = [
    # (backend, device_transform)
    pytest.param("host", None, id="host"),
    pytest.param("emulated", None, id="emulated"),
    pytest.param("emulated", False, id="emulated-no-dt"),
    pytest.param("cupy", None, id="cupy", marks=pytest.mark.gpu),
    pytest.param("cupy", False, id="cupy-no-dt", marks=pytest.mark.gpu),
]


@dataclass
class Got:
    """What a consumer saw of one batch, copied to the host."""

    data: np.ndarray
    device: np.ndarray | None  # gpu_data(), when the backend has a device
    label: np.ndarray
    keys: tuple[bytes, ...]
    indices: tuple[int, ...]
    epoch: int
    valid: int
    state: dict[str, Any]

    @classmethod
    def of(cls, batch: blobpipe.Batch) -> Got:
        blob = batch.data
        device = None
        if blob.backend.has_device:
            device = np.array(to_numpy(blob.gpu_data()))
        return cls(
            data=np.array(blob.cpu_data()),
            device=device,
            label=np.array(batch.label.cpu_data()),
            keys=batch.keys,
            indices=batch.indices,
            epoch=batch.epoch,
            valid=batch.valid,
            state=batch.state,
        )


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_matches(got: list[Got], want: list[ArrayBatch]) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys == tuple(w.keys), k
        assert g.indices == w.indices, k
        assert (g.epoch, g.valid) == (w.epoch, w.valid), k
        assert g.state == w.state, k
        assert same_bits(g.data, w.data), k
        if g.device is not None:
            assert same_bits(g.device, w.data), k
        assert same_bits(g.label, w.label), k


def expected(source: Any, n: int | None, **options: Any) -> list[ArrayBatch]:
    """The first ``n`` batches (or one epoch) of the synchronous iterator."""
    with Batches(source, **options) as batches:
        out = []
        for batch in batches:
            out.append(batch)
            if len(out) == n:
                break
        return out


async def collect(loader: Loader, n: int | None = None) -> list[Got]:
    got: list[Got] = []
    async for batch in loader:
        got.append(Got.of(batch))
        if len(got) == n:
            break
    return got


async def collect_into(loader: Loader, got: list[Got]) -> None:
    async for batch in loader:
        got.append(Got.of(batch))


def fillers_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small batches are planned and filled by the fillers, a chunk at a time, as where
    the row kernel is not built (no pool for the consumer to plan for)."""
    monkeypatch.setattr(blobpipe._loader._pipeline, "row_pool", lambda threads: None)


def chunk_bytes(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """Chunks of at most ``nbytes`` of output, the fillers' and the consumer's (0: none)."""
    monkeypatch.setattr(blobpipe._loader._chunk, "CHUNK_BYTES", nbytes)
    monkeypatch.setattr(blobpipe._loader._chunk, "HERE_CHUNK_BYTES", nbytes)


class FillProbe:
    """Wraps ``Batches.fill`` and ``Batches.fill_parts``: counts calls, the batches
    filled, the calls in flight.

    A fill of small batches may be a chunk of several (a merged plan of ``batch_size``
    rows each): :attr:`plans` holds each batch's first row, ``(epoch, position)``.
    """

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, sleep: float = 0.0, batch_size: int = 4
    ) -> None:
        self.sleep = sleep
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.plans: set[tuple[int, int]] = set()
        self.in_flight_at_wait = 0
        self.started = threading.Event()
        self.gate = threading.Event()  # fills wait here while a test keeps it shut
        self.gate.set()
        self._lock = threading.Lock()
        probe = self

        def wrapped(original: Any) -> Any:
            def fill(self: Batches, plan: Any, *args: Any, **kwargs: Any) -> None:
                with probe._lock:
                    probe.calls += 1
                    probe.in_flight += 1
                    probe.max_in_flight = max(probe.max_in_flight, probe.in_flight)
                    for row in range(0, len(plan), batch_size):  # one per batch
                        probe.plans.add((int(plan.epochs[row]), int(plan.positions[row])))
                probe.started.set()
                try:
                    probe.gate.wait(30)
                    if probe.sleep:
                        time.sleep(probe.sleep)
                    original(self, plan, *args, **kwargs)
                finally:
                    with probe._lock:
                        probe.in_flight -= 1

            return fill

        monkeypatch.setattr(Batches, "fill", wrapped(Batches.fill))
        monkeypatch.setattr(Batches, "fill_parts", wrapped(Batches.fill_parts))
        start_parts = Batches.start_parts

        def started(self: Batches, plan: Any, *args: Any) -> Any:
            # the consumer's chunks (their rows written by the pool): counted, never
            # gated or slowed (that would stop the consumer's own thread)
            with probe._lock:
                probe.calls += 1
                for row in range(0, len(plan), batch_size):
                    probe.plans.add((int(plan.epochs[row]), int(plan.positions[row])))
            return start_parts(self, plan, *args)

        monkeypatch.setattr(Batches, "start_parts", started)

    async def wait_filling(self) -> None:
        """Return once a fill is in flight (it sleeps ``sleep`` seconds in its thread)."""

        def wait() -> bool:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                with self._lock:
                    if self.in_flight:
                        self.in_flight_at_wait = self.in_flight
                        return True
                self.started.wait(0.002)
                self.started.clear()
            return False

        assert await anyio.to_thread.run_sync(wait)


class PoolWatch:
    """The used bytes of a backend's pools, to check every block came back."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.before = self.used()

    def used(self) -> tuple[int, int]:
        host = get_pool(self.backend, "host").statistics().used_bytes
        device = (
            get_pool(self.backend, "device").statistics().used_bytes
            if self.backend.has_device
            else 0
        )
        return host, device

    def assert_returned(self) -> None:
        assert self.used() == self.before


# -- content: equal to the synchronous iterator ----------------------------------------------

CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (database, Transform kwargs, Loader/Batches kwargs)
    "raw": ("raw", {}, {"phase": "test"}),
    "jpg": ("jpg", {}, {"phase": "test"}),
    "png": ("png", {"scale": 0.5}, {"phase": "test"}),
    "float_data": ("float", {"scale": 0.5, "mean_value": (1.5, -2.0, 0.25)}, {}),
    "crop_mirror_train": (
        "caffe",
        {"crop_size": 24, "mirror": True},
        {"phase": "train", "order": "shuffle", "seed": 7},
    ),
    "mean_file_scale": (
        "caffe",
        {"mean_file": MEAN_FILE, "scale": 0.017, "crop_size": 24, "mirror": True},
        {"phase": "train", "seed": 3},
    ),
    "nhwc": (
        "raw",
        {"layout": "NHWC", "mean_value": (10, 20, 30), "scale": 0.25, "crop_size": 8},
        {"phase": "train", "seed": 1},
    ),
    "uint8": ("raw", {"dtype": "uint8", "crop_size": 8, "mirror": True}, {"phase": "train"}),
}


def case_db(kind: str, tmp_path: Path) -> Path:
    if kind == "raw":
        return raw_db(tmp_path / "raw", 30)
    if kind in ("jpg", "png"):
        return encoded_db(tmp_path / kind, 30, f".{kind}")
    if kind == "float":
        return float_db(tmp_path / "float", 30)
    return RAW_COLOR


@pytest.mark.anyio
@pytest.mark.parametrize("small", [True, False], ids=["chunks", "one-by-one"])
@pytest.mark.parametrize(("device", "device_transform"), DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
async def test_matches_batches(
    case: str,
    device: str,
    device_transform: bool | None,
    tmp_path: Path,
    small: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # every fill counts as small (chunks) or as large (a batch per slot), whatever the load
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 60.0 if small else 0.0)
    kind, transform_kwargs, options = CASES[case]
    db = case_db(kind, tmp_path)
    backend = make_backend(device)
    if kind == "float" and backend.has_device:
        device_transform = False  # float_data records cannot be staged as uint8
    n = 40  # wraps past the end of the database, through every ring slot (and chunk) again
    async with Loader(
        db,
        8,
        device=backend,
        prefetch=3,
        transform=Transform(**transform_kwargs),
        device_transform=device_transform,
        workers=3,
        **options,
    ) as loader:
        assert loader.device_transform == (
            backend.has_device
            and device_transform is not False
            and loader.transform.dtype == np.float32
        )
        got = await collect(loader, n)
    assert_matches(
        got, expected(db, n, batch_size=8, transform=Transform(**transform_kwargs), **options)
    )
    if kind == "raw" and transform_kwargs.get("dtype") == "uint8":
        assert got[0].data.dtype == np.uint8


@pytest.mark.anyio
async def test_float_data_needs_device_transform_off(tmp_path: Path) -> None:
    db = float_db(tmp_path / "float", 4)
    async with Loader(db, 2, device=EmulatedBackend()) as loader:
        assert loader.device_transform
        with pytest.raises(DataError, match=r"dtype='uint8' output needs uint8 records"):
            await anext(loader)


# -- content: equal to Caffe ------------------------------------------------------------------

REF_CASES: dict[str, tuple[Path, dict[str, Any]]] = {
    "raw_color_b8": (RAW_COLOR, {}),
    "raw_color_b8_meanfile_scale": (RAW_COLOR, {"scale": 0.017, "mean_file": MEAN_FILE}),
    "raw_color_b8_meanvalue_crop24": (RAW_COLOR, {"crop_size": 24, "mean_value": (104, 117, 123)}),
    "encoded_jpg_b8": (CAFFE / "lmdb" / "encoded_jpg", {}),
}


def caffe_reference(case: str) -> list[tuple[np.ndarray, np.ndarray]]:
    ref = CAFFE / "ref" / case
    n = len(list(ref.glob("data_b*.npy")))
    return [(np.load(ref / f"data_b{k}.npy"), np.load(ref / f"label_b{k}.npy")) for k in range(n)]


@pytest.mark.anyio
@pytest.mark.parametrize("via", ["params", "prototxt"])
@pytest.mark.parametrize(("device", "device_transform"), DEVICES)
@pytest.mark.parametrize("case", sorted(REF_CASES))
async def test_matches_caffe(
    case: str,
    device: str,
    device_transform: bool | None,
    via: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ref = caffe_reference(case)
    backend = make_backend(device)
    options: dict[str, Any] = {"device": backend, "device_transform": device_transform}
    if via == "params":
        db, kwargs = REF_CASES[case]
        loader = Loader(db, 8, transform=Transform(**kwargs), phase="test", **options)
    else:
        monkeypatch.chdir(CAFFE)
        loader = Loader.from_prototxt(f"ref/{case}/net.prototxt", "test", **options)
        assert loader.batch_size == 8
    async with loader:
        got = await collect(loader, len(ref))
    for k, (g, (data, label)) in enumerate(zip(got, ref, strict=True)):
        assert same_bits(g.data, data), k
        if g.device is not None:
            assert same_bits(g.device, data), k
        assert same_bits(g.label, label), k


def test_from_prototxt_options_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    loader = Loader.from_prototxt(
        "ref/raw_color_b8/net.prototxt", "test", device="cpu", batch_size=5, prefetch=2
    )
    with loader:
        batch = next(iter(loader))
        assert batch.data.shape == (5, 3, 32, 40)
        assert loader.prefetch == 2
        assert np.array_equal(batch.data.cpu_data(), caffe_reference("raw_color_b8")[0][0][:5])


def test_from_prototxt_says_rand_skip_is_not_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer's rand_skip is not silently dropped: a warning names it and the way out."""
    monkeypatch.chdir(CAFFE)
    net = (CAFFE / "ref/raw_color_b8/net.prototxt").read_text()
    assert "rand_skip" not in net
    skipping = tmp_path / "net.prototxt"
    skipping.write_text(net.replace("batch_size:", "rand_skip: 100\n    batch_size:", 1))
    with pytest.warns(UserWarning, match=r"rand_skip: 100 is not applied.*shuffle=True"):
        loader = Loader.from_prototxt(skipping, "test", device="cpu")
    loader.close()


# -- forms: async (asyncio, trio) and blocking; epochs ----------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("order", ["key", "shuffle"])
@pytest.mark.parametrize("device", ["host", "emulated"])
async def test_epoch_mode_ends_each_epoch(db30: Path, device: str, order: str) -> None:
    t = Transform(crop_size=8, mirror=True)
    options: dict[str, Any] = {"order": order, "mode": "epoch", "seed": 5, "transform": t}
    async with Loader(db30, 8, device=make_backend(device), prefetch=2, **options) as loader:
        assert len(loader) == 4
        epoch0 = await collect(loader)
        epoch1 = await collect(loader)
        epoch2 = await collect(loader)
    with Batches(db30, 8, **options) as batches:
        want0, want1, want2 = list(batches), list(batches), list(batches)
    assert [g.epoch for g in epoch0] == [0] * 4
    assert [g.epoch for g in epoch1] == [1] * 4
    assert [g.valid for g in epoch1] == [8, 8, 8, 6]
    assert_matches(epoch0, want0)
    assert_matches(epoch1, want1)
    assert_matches(epoch2, want2)
    if order == "shuffle":
        assert [g.keys for g in epoch0] != [g.keys for g in epoch1]


@pytest.mark.parametrize(("device", "device_transform"), DEVICES)
def test_blocking_form(db30: Path, device: str, device_transform: bool | None) -> None:
    t = Transform(mean_value=(1, 2, 3), scale=0.5, crop_size=8, mirror=True)
    options: dict[str, Any] = {"mode": "epoch", "last": "pad", "transform": t}
    backend = make_backend(device)
    with Loader(
        db30, 8, device=backend, prefetch=2, device_transform=device_transform, **options
    ) as loader:
        epoch0 = [Got.of(batch) for batch in loader]
        epoch1 = [Got.of(batch) for batch in loader]
    with Batches(db30, 8, **options) as batches:
        assert_matches(epoch0, list(batches))
        assert_matches(epoch1, list(batches))
    assert epoch1[-1].valid == 6 and len(epoch1[-1].keys) == 8


def test_blocking_form_wrap_and_break(db30: Path) -> None:
    with Loader(db30, 7, device="cpu") as loader:
        got = []
        for batch in loader:
            got.append(Got.of(batch))
            if len(got) == 6:
                break
    assert_matches(got, expected(db30, 6, batch_size=7))


# -- DLPack ------------------------------------------------------------------------------------


def address(array: Any) -> int:
    if isinstance(array, np.ndarray):
        return int(array.__array_interface__["data"][0])
    return int(array.data.ptr)


@pytest.mark.anyio
@pytest.mark.parametrize(("device", "device_transform"), DEVICES)
async def test_dlpack_shares_memory(db30: Path, device: str, device_transform: bool | None) -> None:
    backend = make_backend(device)
    t = Transform(scale=0.5)
    async with Loader(
        db30, 4, device=backend, transform=t, device_transform=device_transform
    ) as loader:
        want = expected(db30, 3, batch_size=4, transform=t)
        k = 0
        async for batch in loader:
            if backend.has_device:
                exported = backend.xp.from_dlpack(batch.data)
                native = batch.data.gpu_data()
            else:
                exported = np.from_dlpack(batch.data)
                native = batch.data.cpu_data()
                assert np.shares_memory(exported, native)
            assert address(exported) == address(native)
            assert exported.shape == native.shape == want[k].data.shape
            assert np.array_equal(to_numpy(exported), want[k].data)
            k += 1
            if k == 3:
                break


# -- kept batches (tests/test_batch_contract.py has the whole contract) ---------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(("device", "device_transform"), DEVICES)
async def test_a_kept_batch_keeps_its_values(
    db30: Path, device: str, device_transform: bool | None
) -> None:
    backend = make_backend(device)
    pools = PoolWatch(backend)
    t = Transform(mean_value=(3, 2, 1), scale=2)
    want = expected(db30, 12, batch_size=4, transform=t)
    async with Loader(
        db30, 4, device=backend, prefetch=2, transform=t, device_transform=device_transform
    ) as loader:
        await anext(loader)
        kept = await anext(loader)
        rest = [Got.of(await anext(loader)) for _ in range(10)]  # every slot refilled many times
        assert not kept.closed
        assert_matches([Got.of(kept)], want[1:2])
        assert_matches(rest, want[2:])
    # the loader is closed; the kept batch is still the caller's
    assert_matches([Got.of(kept)], want[1:2])
    del kept
    pools.assert_returned()


# -- the device transform ------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("device", ["emulated", pytest.param("cupy", marks=pytest.mark.gpu)])
async def test_device_transform_equals_cpu_transform(device: str) -> None:
    t = Transform(mean_file=MEAN_FILE, scale=0.017, crop_size=24, mirror=True)
    options: dict[str, Any] = {"phase": "train", "order": "shuffle", "seed": 11, "transform": t}
    results = {}
    for dt in (True, False):
        async with Loader(
            RAW_COLOR, 8, device=make_backend(device), device_transform=dt, **options
        ) as loader:
            assert loader.device_transform is dt
            results[dt] = await collect(loader, 8)  # 64 records: past one epoch
    async with Loader(RAW_COLOR, 8, device=HostBackend(), **options) as loader:
        host = await collect(loader, 8)
    mirrored = 0
    for on, off, cpu in zip(results[True], results[False], host, strict=True):
        assert on.device is not None
        assert same_bits(on.device, off.data) and same_bits(on.device, cpu.data)
        assert same_bits(on.data, cpu.data)
        assert on.keys == cpu.keys
        mirrored += sum(Transform.draw(11, cpu.epoch, i) & 1 for i in cpu.indices)
    assert 0 < mirrored < 64  # both branches of the mirror were exercised


# -- event waits on the emulated device ----------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("device_transform", [True, False])
async def test_slow_copies_still_give_right_data(db30: Path, device_transform: bool) -> None:
    backend = EmulatedBackend(delay=0.05)
    t = Transform(mean_value=(5, 6, 7), scale=0.5, crop_size=8, mirror=True)
    async with Loader(
        db30, 8, device=backend, prefetch=2, transform=t, device_transform=device_transform
    ) as loader:
        got = await collect(loader, 5)
    assert_matches(got, expected(db30, 5, batch_size=8, transform=t))
    assert loader.statistics().copy_time >= 5 * 0.05


@pytest.mark.anyio
@pytest.mark.parametrize("device_transform", [True, False])
async def test_copies_do_not_block_the_event_loop(db30: Path, device_transform: bool) -> None:
    """While copies are in flight the loop keeps running other tasks (the consumer's)."""
    # The copies land only once the loop has run 20 heartbeats while one waits:
    # a loop blocked on a copy never gets there (the gate's timeout opens it).
    backend = GatedBackend(timeout=10)
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.001)
            if backend.waiting and not backend.gate.is_set():
                ticks += 1
                if ticks == 20:
                    backend.gate.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        async with Loader(
            db30,
            4,
            device=backend,
            prefetch=2,
            device_transform=device_transform,
        ) as loader:
            # keep the batches without reading them: a host read of device data
            # is a blocking accessor by design
            kept = [await anext(loader) for _ in range(3)]
        tg.cancel_scope.cancel()
    assert ticks >= 20 and not backend.timed_out
    assert_matches([Got.of(batch) for batch in kept], expected(db30, 3, batch_size=4))


async def _noop_wait(event: object) -> None:
    return None


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("removed", "device_transform"),
    [
        (None, True),
        (None, False),
        ("loader wait", True),  # the loader's await of the slot's event
        ("event", False),  # every event reports completion at once
    ],
)
async def test_without_the_wait_data_is_wrong(
    db30: Path, removed: str | None, device_transform: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The emulated device lands copies late, so the waits above are really tested."""
    backend = GatedBackend()  # copies land only once the gate opens
    if removed == "loader wait":
        monkeypatch.setattr(blobpipe._loader._async, "wait_event", _noop_wait)
    elif removed == "event":
        monkeypatch.setattr(EmulatedEvent, "query", lambda self: True)
        monkeypatch.setattr(EmulatedEvent, "synchronize", lambda self: None)
    t = Transform(scale=0.5)
    async with Loader(
        db30, 4, device=backend, prefetch=1, transform=t, device_transform=device_transform
    ) as loader:
        if removed is None:
            backend.open_after(0.05)  # the loader waits for the copy, however late
        batch = await anext(loader)
        # what the device holds when the batch is handed out (the host side may
        # hold the right bytes: the staging buffer, or a later device->host copy)
        device = np.array(to_numpy(batch.data.gpu_data()))
        backend.gate.set()  # before a host read, which waits for the device
        got = Got.of(batch)
        monkeypatch.undo()  # wait properly for the copies before the buffers go back
    assert got.device is not None
    want = expected(db30, 1, batch_size=4, transform=t)[0].data
    assert same_bits(device, want) == (removed is None)


# -- cancellation and cleanup --------------------------------------------------------------------


async def _consume(loader: Loader, count: int, sleep: float = 0.0) -> None:
    async for _ in loader:
        count -= 1
        await anyio.sleep(sleep)
        if count == 0:
            break


@pytest.mark.anyio
@pytest.mark.parametrize(
    "where",
    [
        "break",
        "consumer error",
        "cancel while filling",
        "cancel outside async with",
        "cancel in body",
        "close before iterating",
    ],
)
@pytest.mark.parametrize("device", ["host", "emulated"])
async def test_cleanup(
    db30: Path, device: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = make_backend(device)
    pools = PoolWatch(backend)
    probe = FillProbe(monkeypatch, sleep=0.03)
    loader = Loader(db30, 4, device=backend, prefetch=3, workers=2)
    if where == "break":
        async with loader:
            await _consume(loader, 2)
    elif where == "consumer error":

        async def fail() -> None:
            async with loader:
                async for batch in loader:
                    if batch.indices[0] > 0:
                        raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom") as info:
            await fail()
        assert type(info.value) is RuntimeError  # not wrapped in an exception group
        del info  # its traceback's frame holds the batch
    elif where == "cancel while filling":
        # the scope around the consumer is cancelled while a worker is mid-fill
        with anyio.CancelScope() as scope:
            async with loader:
                await anext(loader)
                await anext(loader)  # the first batch was dropped: its slot is refilled now
                await probe.wait_filling()
                scope.cancel()
                # a ready batch may come without a checkpoint (within YIELD_EVERY): the
                # cancellation is seen at the first one
                while True:
                    await anext(loader)
        assert scope.cancelled_caught
        assert probe.in_flight_at_wait > 0
    elif where == "cancel outside async with":
        with anyio.move_on_after(0.1) as scope:
            async with loader:
                await _consume(loader, 1000, sleep=1)
        assert scope.cancelled_caught
    elif where == "cancel in body":
        async with loader:
            with anyio.move_on_after(0.1) as scope:
                await _consume(loader, 1000)
            assert scope.cancelled_caught
            # the fills under way when the scope was cancelled may all have ended by
            # now (the ring full): free a slot, and hold its fill at the gate until it
            # is seen in flight, so the loader closes while a fill runs
            probe.gate.clear()
            await anext(loader)  # still usable; the batch is dropped, its slot refilled
            try:
                await probe.wait_filling()
            finally:
                probe.gate.set()
    else:
        async with loader:
            pass
    assert probe.calls > 0 or where == "close before iterating"
    # nothing is filling, nothing starts filling later, every block went back
    assert probe.in_flight == 0
    calls = probe.calls
    await stays(lambda: probe.calls == calls, "no fill after the close", window=0.1)
    pools.assert_returned()
    with pytest.raises(StateError, match="this Loader is closed; create a new one"):
        await anext(loader)


@pytest.mark.anyio
@pytest.mark.parametrize("device", ["host", "emulated"])
async def test_cancel_while_waiting_loses_no_batch(
    db30: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout around ``anext`` leaves the loader usable and the order intact."""
    backend = EmulatedBackend(delay=0.1) if device == "emulated" else HostBackend()
    probe = FillProbe(monkeypatch, sleep=0.1 if device == "host" else 0.0)
    pools = PoolWatch(backend)
    async with Loader(db30, 4, device=backend, prefetch=2, workers=1) as loader:
        got = []
        await wait_until(lambda: probe.calls > 0, "the first fill")
        with anyio.move_on_after(0.05):
            # cancelled waiting for the producer (host) or for the copy (emulated);
            # a batch already taken from the queue is still returned
            got.append(Got.of(await anext(loader)))
        assert probe.calls > 0
        while len(got) < 5:  # the ring used around twice
            got.append(Got.of(await anext(loader)))
    assert_matches(got, expected(db30, 5, batch_size=4))
    pools.assert_returned()


@pytest.mark.parametrize("device", ["cpu", "emulated"])
def test_open_without_await_in_plain_code_opens_the_loader(db30: Path, device: str) -> None:
    """``loader.open()`` outside an event loop opens the loader there and then (as
    ``with`` does); what it returns may be dropped (no coroutine left unawaited)."""
    backend = "cpu" if device == "cpu" else EmulatedBackend()
    loader = Loader(db30, 4, device=backend, transform=Transform(scale=0.5))
    loader.open()
    assert repr(loader).endswith(" open>")
    got = [Got.of(next(loader)) for _ in range(3)]
    with pytest.raises(StateError, match="this Loader is open; a Loader can be opened once"):
        loader.open()
    loader.close()
    assert_matches(got, expected(db30, 3, batch_size=4, transform=Transform(scale=0.5)))


@pytest.mark.anyio
async def test_close_is_idempotent_and_final(db30: Path) -> None:
    loader = Loader(db30, 4, device="cpu")
    await loader.open()
    with pytest.raises(StateError, match="this Loader is open; a Loader can be opened once"):
        await loader.open()
    await anext(loader)
    await loader.aclose()
    await loader.aclose()
    loader.close()
    with pytest.raises(StateError, match="this Loader is closed; create a new one"):
        async for _ in loader:
            pass
    with pytest.raises(StateError, match="this Loader is closed; a Loader can be opened once"):
        async with loader:
            pass
    # never opened: closing releases the database
    unopened = Loader(db30, 4, device="cpu")
    await unopened.aclose()
    await unopened.aclose()
    with pytest.raises(StateError, match="this Loader is closed"):
        await anext(unopened)


def test_blocking_close_is_idempotent_and_final(db30: Path) -> None:
    loader = Loader(db30, 4, device="cpu")
    with loader:
        next(iter(loader))
    loader.close()
    loader.close()
    with pytest.raises(StateError, match="this Loader is closed; create a new one"):
        iter(loader)
    with pytest.raises(StateError, match="this Loader is closed; create a new one"):
        next(loader)
    with pytest.raises(StateError, match="this Loader is closed; create a new one"), loader:
        pass
    unopened = Loader(db30, 4, device="cpu")
    unopened.close()
    unopened.close()
    with pytest.raises(StateError, match="this Loader is closed"):
        iter(unopened)


def test_blocking_form_consumer_error_cleans_up(
    db30: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = EmulatedBackend(delay=0.01)
    pools = PoolWatch(backend)
    probe = FillProbe(monkeypatch, sleep=0.02)

    def fail() -> None:
        with Loader(db30, 4, device=backend) as loader:
            for batch in loader:
                if batch.indices[0] >= 8:
                    raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        fail()
    assert probe.in_flight == 0
    pools.assert_returned()


# -- worker errors --------------------------------------------------------------------------------


@pytest.fixture(params=[0, 2], ids=["first-row", "middle-row"])
def corrupt_db(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, int]:
    """40 raw records in batches of 4; record 12 + row is garbage (batch 3)."""
    bad = 12 + int(request.param)
    items = [
        (key(i), blobpipe.encode_raw_datum(np.full((3, 4, 5), i, np.uint8), i)) for i in range(40)
    ]
    items[bad] = (key(bad), b"\x08\x03\x10garbage bytes, not a Datum")
    return write_lmdb(tmp_path / "corrupt", items), bad


def _check_intact(got: list[Got]) -> None:
    assert len(got) == 3
    for k, g in enumerate(got):
        rows = range(4 * k, 4 * k + 4)
        assert g.label.tolist() == list(rows)
        assert g.data.tolist() == [np.full((3, 4, 5), i, np.float32).tolist() for i in rows]


@pytest.mark.anyio
@pytest.mark.parametrize("device", ["host", "emulated"])
async def test_worker_error_reaches_consumer_in_order(
    corrupt_db: tuple[Path, int], device: str
) -> None:
    db, bad = corrupt_db
    got = []
    async with Loader(db, 4, device=make_backend(device), prefetch=4, workers=4) as loader:
        with pytest.raises(DataError) as info:
            await collect_into(loader, got)
        assert type(info.value) is DataError  # the original error, not an exception group
        assert info.value.key == key(bad)
        assert f"record key {key(bad)!r}" in str(info.value)
        assert str(db) in str(info.value)
        _check_intact(got)
        with pytest.raises(StateError, match="this Loader stopped after an error: DataError"):
            await anext(loader)
        with pytest.raises(StateError, match="stopped after an error"):
            async for _ in loader:
                pass


def test_worker_error_blocking_form(corrupt_db: tuple[Path, int]) -> None:
    db, bad = corrupt_db
    got = []
    with Loader(db, 4, device=EmulatedBackend(), workers=4) as loader:
        it = iter(loader)
        with pytest.raises(DataError) as info:
            got.extend(Got.of(batch) for batch in it)
        assert type(info.value) is DataError
        assert info.value.key == key(bad) and info.value.path == str(db)
        _check_intact(got)
        with pytest.raises(
            StateError,
            match=rf"stopped after an error: DataError\(.*record key {re.escape(repr(key(bad)))}",
        ):
            next(it)


@pytest.mark.parametrize("row", [0, 2], ids=["planned-ahead", "filled"])
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("bad_batch", [0, 1, 6, 15, 18, 37])
@pytest.mark.parametrize("planner", ["consumer", "fillers"])
def test_a_bad_record_in_a_chunk_fails_its_own_batch(
    tmp_path: Path,
    bad_batch: int,
    workers: int,
    row: int,
    planner: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small batches are planned ahead and filled a chunk at a time: by the consumer's
    thread, the rows written by the pool's threads, or (where the row kernel is not
    built) by every filler, each its own chunk; a record that fails fails its own
    batch, whether its planning reads it (a batch's first record) or only its fill
    does: every batch before it arrives intact and in order, then its error, naming
    its key."""
    chunks = 0
    pipeline = blobpipe._loader._pipeline.Pipeline
    name = "_start_chunk" if planner == "consumer" else "_fill_chunk"
    original = getattr(pipeline, name)

    def fill(self: Any, *args: Any) -> Any:
        nonlocal chunks
        chunks += 1
        return original(self, *args)

    monkeypatch.setattr(pipeline, name, fill)
    if planner == "fillers":
        fillers_plan(monkeypatch)
    # every fill counts as small, however loaded the machine: chunks from batch 1 on
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 60.0)
    bad = 4 * bad_batch + row
    items = [
        (key(i), blobpipe.encode_raw_datum(np.full((3, 4, 5), i, np.uint8), i)) for i in range(160)
    ]
    items[bad] = (key(bad), b"\x08\x03\x10garbage bytes, not a Datum")
    db = write_lmdb(tmp_path / "bad", items)
    got: list[Got] = []
    with (
        Loader(db, 4, device="cpu", workers=workers, mode="epoch") as loader,
        pytest.raises(DataError) as info,
    ):
        got.extend(Got.of(batch) for batch in loader)
    assert info.value.key == key(bad)
    assert len(got) == bad_batch
    for k, g in enumerate(got):
        assert g.label.tolist() == list(range(4 * k, 4 * k + 4))
    # the path under test (the first batches are planned and filled alone, one per
    # filler: a batch failing there is not in a chunk)
    assert chunks > 0 or bad_batch <= 1


# -- memory: no steady-state allocations, backpressure -------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("small", [True, False], ids=["chunks", "one-by-one"])
@pytest.mark.parametrize(("device", "device_transform"), DEVICES)
async def test_no_allocations_in_steady_state(
    db30: Path,
    device: str,
    device_transform: bool | None,
    small: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # every fill counts as small (chunks, the ring grown at the first) or as large (one
    # batch per slot), whatever the machine's load
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 60.0 if small else 0.0)
    backend = make_backend(device)
    prefetch = 3
    t = Transform(mean_value=(1, 2, 3), crop_size=8)

    def counters() -> tuple[Any, ...]:
        stats = loader.statistics()
        device_pool = stats.device_pool
        return (
            stats.pool.allocations,
            stats.pool.misses,
            device_pool and device_pool.allocations,
            device_pool and device_pool.misses,
            backend.statistics().host_allocations,
            backend.statistics().device_allocations,
        )

    async with Loader(
        db30, 8, device=backend, prefetch=prefetch, transform=t, device_transform=device_transform
    ) as loader:
        # warm-up: until every slot has been filled once. Delivering prefetch + 1
        # batches does not ensure it: a filler preempted between taking a slot and
        # planning its batch (a loaded machine) leaves that slot unfilled while the
        # other fillers cycle the rest, and its first fill allocates later.
        slots: set[int] = set()
        warm_up = 0
        while len(slots) < loader.statistics().slots:
            batch = await anext(loader)
            slots.add(id(batch.data.data))  # the slot's memory: one per slot
            Got.of(batch)  # read on the host too, as the measured batches are
            warm_up += 1
            assert warm_up < 1000, "a slot was never filled"
        del batch  # a loop that keeps nothing
        await collect(loader, 1)  # the slot handed out first comes round again
        warm_up += 1
        warm = counters()
        got = await collect(loader, 40)
        assert counters() == warm
    assert_matches(got, expected(db30, warm_up + 40, batch_size=8, transform=t)[warm_up:])


@pytest.mark.anyio
@pytest.mark.parametrize("device", ["host", "emulated"])
async def test_backpressure(db30: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches that take a while to fill are filled one per free slot: the producer
    stops when the ring is full; a batch the caller still holds when it takes the
    next gets one new slot; a slot is filled again once the caller dropped its batch."""
    probe = FillProbe(monkeypatch, sleep=0.002)  # >= SMALL_FILL: no chunks
    plans = 0
    original = Batches.next_plans

    def next_plans(self: Batches, count: int) -> Any:
        nonlocal plans
        plans += count
        return original(self, count)

    monkeypatch.setattr(Batches, "next_plans", next_plans)
    backend = make_backend(device)

    async def filled(n: int) -> None:
        """Wait for ``n`` batches filled, then check that the producer stops there."""
        await wait_until(lambda: len(probe.plans) >= n and probe.in_flight == 0, f"{n} fills")
        # time for the producer to run ahead if it could
        await stays(lambda: len(probe.plans) == n, f"exactly {n} batches filled")

    async with Loader(db30, 4, device=backend, prefetch=3, workers=1) as loader:
        await filled(4)  # one per slot (prefetch + 1); then the producer waits
        assert plans <= 5  # (one plan made ahead, waiting for a free slot)
        used = sum(PoolWatch(backend).used())
        first = await anext(loader)
        # the consumer holds the batch: its slot is not free
        await stays(lambda: len(probe.plans) == 4, "4 batches filled")
        # the first still held, as a loop variable holds the previous batch: the
        # ring's extra slot covers it, nothing is made
        second = await anext(loader)
        await stays(lambda: len(probe.plans) == 4, "4 batches filled")
        third = await anext(loader)  # a third batch held: one slot more
        await filled(5)
        assert plans <= 6
        one_batch = sum(PoolWatch(backend).used()) - used  # host and device
        assert one_batch > 0
        stats = loader.statistics()
        assert (stats.slots, stats.held_batches) == (5, 3)
        assert 0 < stats.held_bytes <= 3 * one_batch  # (the pool rounds blocks up)
        del first  # the ring shrinks back: that slot's memory goes to the pool
        await stays(lambda: len(probe.plans) == 5, "5 batches filled")
        assert sum(PoolWatch(backend).used()) == used
        del second  # its slot is filled again
        await filled(6)
        assert plans <= 7
        assert sum(PoolWatch(backend).used()) == used
        stats = loader.statistics()
        assert (stats.slots, stats.held_batches) == (4, 1)
        del third


@pytest.mark.anyio
@pytest.mark.parametrize("device", ["host", "emulated"])
async def test_small_batches_fill_at_most_one_chunk_ahead(
    db30: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small batches are filled a chunk at a time by the fillers (where the consumer
    does not plan them), straight into slots the chunk holds: the producer fills at
    most the ring ahead of the consumer, stops there (the next chunk planned,
    waiting for its slots), and what arrives is what Batches makes."""
    fillers_plan(monkeypatch)
    probe = FillProbe(monkeypatch)
    backend = make_backend(device)
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 60.0)  # all small

    got: list[Got] = []
    async with Loader(db30, 4, device=backend, prefetch=3, workers=1, mode="wrap") as loader:
        # batch 0 alone, then chunks of CHUNK_BATCHES (the ring grown to hold two, the
        # consumer's batch and the previous one): two chunks in slots, the third
        # waiting for slots
        full = 1 + 2 * CHUNK_BATCHES
        await wait_until(lambda: len(probe.plans) >= full and probe.in_flight == 0, "fills")
        await stays(lambda: len(probe.plans) == full, f"{full} batches filled")
        slots = loader.statistics().slots
        assert slots == 2 * CHUNK_BATCHES + 2
        used = 0
        for i in range(3 * slots):
            got.append(Got.of(await anext(loader)))
            assert len(probe.plans) <= len(got) + slots
            if i == slots + CHUNK_BATCHES:  # every slot filled by now: the steady state
                used = get_pool(backend, "host").statistics().used_bytes
        assert probe.calls < len(probe.plans)  # chunks: fewer fills than batches
        assert get_pool(backend, "host").statistics().used_bytes == used
    assert_matches(got, expected(db30, len(got), batch_size=4))


def test_fillers_fill_chunks_at_once_and_hand_them_out_in_order(
    db30: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every filler fills a chunk of small batches at once; whichever finishes first,
    chunks take their slots in number order (a later chunk holding the slots an
    earlier one waits for would deadlock), so batches arrive in order, the same as
    Batches makes them: here the first chunks wait until the next one was filled."""
    fillers_plan(monkeypatch)
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 60.0)  # all small
    pipeline = blobpipe._loader._pipeline.Pipeline
    original = pipeline._fill_chunk
    cond = threading.Condition()
    in_flight = [0, 0]  # now, most at once
    finished: list[int] = []  # each chunk's first batch number, as its fill finished
    waited_in_vain = 0

    def fill(self: Any, numbered: Any, slots: Any) -> Any:
        nonlocal waited_in_vain
        first = numbered[0][0]
        with cond:
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
            waits = len(finished) < 4 and (first // len(numbered)) % 2 == 0
            # until a later chunk (the other filler's) was filled
            if waits and not cond.wait_for(lambda: any(f > first for f in finished), 5):
                waited_in_vain += 1
        try:
            return original(self, numbered, slots)
        finally:
            with cond:
                in_flight[0] -= 1
                finished.append(first)
                cond.notify_all()

    monkeypatch.setattr(pipeline, "_fill_chunk", fill)
    n = 1 + 6 * CHUNK_BATCHES  # past the first fills, in chunks, wrapping past the end
    with Loader(db30, 4, device="cpu", workers=2, mode="wrap") as loader:
        got = [Got.of(batch) for batch in islice(loader, n)]
    assert_matches(got, expected(db30, n, batch_size=4))
    assert waited_in_vain == 0 and in_flight[1] == 2  # two chunks filled at once
    assert finished != sorted(finished)  # a later chunk was ready first, and waited


@pytest.mark.parametrize("seed", range(4))
def test_chunks_filled_in_any_order_arrive_in_order(
    db30: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small batches, several fillers, each chunk's fill taking a random time (some
    chunks of few batches: a small ring), closed mid-stream: the batches arrive in
    order, as Batches makes them, and the close returns."""
    rng = random.Random(seed)
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 60.0)  # all small
    monkeypatch.setattr(blobpipe._loader._chunk, "CHUNK_BATCHES", rng.choice([2, 3, 16]))
    pipeline = blobpipe._loader._pipeline.Pipeline
    original = pipeline._fill_chunk
    delays = [rng.choice([0.0, 0.0, 0.001, 0.005]) for _ in range(1000)]

    def fill(self: Any, numbered: Any, slots: Any) -> Any:
        time.sleep(delays[numbered[0][0] % len(delays)])
        return original(self, numbered, slots)

    monkeypatch.setattr(pipeline, "_fill_chunk", fill)
    n = rng.randrange(20, 80)
    workers, prefetch = rng.choice([(2, 2), (2, 4), (3, 3), (3, 6)])
    with Loader(db30, 4, device="cpu", workers=workers, prefetch=prefetch, mode="wrap") as loader:
        got = [Got.of(batch) for batch in islice(loader, n)]
    assert_matches(got, expected(db30, n, batch_size=4))


@pytest.mark.parametrize("workers", [2, 3])
def test_batches_turning_small_and_large_again_arrive_in_order(
    db30: Path, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every other epoch fills slowly (large batches: every filler fills one at a
    time), the others quickly (small: every filler fills chunks): the pipeline
    narrows and widens again and again (widening only once every chunk planned has
    its slots), and the batches arrive in order, as Batches makes them."""
    fillers_plan(monkeypatch)
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 0.01)

    def slowed(original: Any) -> Any:
        def fill(self: Batches, plan: Any, *args: Any, **kwargs: Any) -> None:
            slow = sum(int(plan.epochs[row]) % 2 for row in range(0, len(plan), 4))
            time.sleep(0.05 * slow)  # a batch of an odd epoch: a chunk of them is large too
            original(self, plan, *args, **kwargs)

        return fill

    monkeypatch.setattr(Batches, "fill", slowed(Batches.fill))
    monkeypatch.setattr(Batches, "fill_parts", slowed(Batches.fill_parts))
    widened = 0
    widen = blobpipe._loader._pipeline.Pipeline._widen_once_slotted

    def counted(self: Any) -> bool:
        nonlocal widened
        widened += 1
        return widen(self)

    monkeypatch.setattr(blobpipe._loader._pipeline.Pipeline, "_widen_once_slotted", counted)
    n = 6 * 8  # 6 epochs of 30 records in batches of 4 (wrapping)
    with Loader(db30, 4, device="cpu", workers=workers, prefetch=3, mode="wrap") as loader:
        got = [Got.of(batch) for batch in islice(loader, n)]
        grown = loader.statistics().slots
    assert_matches(got, expected(db30, n, batch_size=4))
    assert grown > 3 and widened >= 2  # chunks took slots, then every filler ran


def test_a_chunk_takes_as_many_batches_as_its_bytes_hold(
    db30: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fillers' chunk holds as many batches as CHUNK_BYTES does (at most
    CHUNK_BATCHES), a batch of more than half of it alone; the consumer's in the first
    epoch as well, later as many as HERE_CHUNK_BYTES does, a batch of more than
    HERE_ALONE_BYTES alone."""
    with Batches(db30, 4) as batches:
        plan = batches.next_plan()
    assert plan is not None
    chunk = blobpipe._loader._chunk
    nbytes = int(np.prod(plan.data_shape)) * plan.dtype.itemsize
    assert chunk_batches(plan) == min(CHUNK_BATCHES, CHUNK_BYTES // nbytes)
    assert chunk_batches(plan, True, later=True) == CHUNK_BATCHES
    monkeypatch.setattr(chunk, "CHUNK_BYTES", 3 * nbytes - 1)
    monkeypatch.setattr(chunk, "HERE_CHUNK_BYTES", 4 * nbytes)
    assert chunk_batches(plan) == 2 and chunk_batches(plan, True, later=True) == 4
    assert chunk_batches(plan, True) == 2 and chunk_batches(plan, False, later=True) == 2
    monkeypatch.setattr(chunk, "CHUNK_BYTES", 2 * nbytes - 1)
    assert chunk_batches(plan) == 1 and chunk_batches(plan, True, later=True) == 4
    monkeypatch.setattr(chunk, "HERE_ALONE_BYTES", nbytes)  # not more than it: chunked
    assert chunk_batches(plan, True, later=True) == 4
    monkeypatch.setattr(chunk, "HERE_ALONE_BYTES", nbytes - 1)
    assert chunk_batches(plan, True, later=True) == 1


@pytest.mark.parametrize("chunk", [1, 2, 3, CHUNK_BATCHES])
@pytest.mark.parametrize("workers", [1, 2])
def test_small_batches_are_planned_whole_chunks_at_a_time(
    db30: Path, chunk: int, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While chunks hold ``chunk`` batches, one planning call plans whole chunks, at
    least CHUNK_BATCHES batches (a chunk's first plan and the rest were two calls);
    a batch alone in its chunk is planned alone (nothing large planned ahead);
    the batches arrive as Batches makes them, across epochs (``mode="wrap"``)."""
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 60.0)  # all small
    with Batches(db30, 4) as batches:
        plan = batches.next_plan()
    assert plan is not None
    nbytes = int(np.prod(plan.data_shape)) * plan.dtype.itemsize
    chunk_bytes(monkeypatch, chunk * nbytes)
    counts: list[int] = []
    original = Batches.next_plans

    def counted(self: Batches, count: int) -> list[Any]:
        counts.append(count)
        return original(self, count)

    monkeypatch.setattr(Batches, "next_plans", counted)
    n = 1 + 6 * CHUNK_BATCHES
    with Loader(db30, 4, device="cpu", workers=workers, mode="wrap") as loader:
        got = [Got.of(batch) for batch in islice(loader, n)]
        slots = loader.statistics().slots
    monkeypatch.setattr(Batches, "next_plans", original)
    assert_matches(got, expected(db30, n, batch_size=4))
    together = planned_together(chunk)
    assert together == (1 if chunk == 1 else chunk * -(-CHUNK_BATCHES // chunk))
    # the first batches are planned alone (filled one at a time until they prove
    # small), then every call plans ``together``
    first = counts.index(together) if together > 1 else 0
    assert first <= workers + 1
    assert set(counts[:first]) <= {1} and set(counts[first:]) == {together}
    # ahead of the consumer: the ring's slots, a chunk planned by each filler waiting
    # for its slots, and what the last call planned beyond them
    assert sum(counts) <= n + slots + (workers + 1) * max(together, CHUNK_BATCHES)


@pytest.mark.anyio
@pytest.mark.parametrize("limit", ["CHUNK_BYTES", "CHUNK_ROWS"])
async def test_quick_batches_too_large_for_a_chunk_keep_every_filler_busy(
    db30: Path, limit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that fills quickly but is too large to share a chunk (more than half
    the chunk's bytes, or rows) goes straight into its slot: every filler keeps
    filling such batches at once, a batch each."""
    probe = FillProbe(monkeypatch)
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 60.0)  # all quick
    if limit == "CHUNK_BYTES":  # one batch a chunk
        chunk_bytes(monkeypatch, 1)
    else:
        monkeypatch.setattr(blobpipe._loader._chunk, limit, 1)
    async with Loader(db30, 4, device="cpu", prefetch=4, workers=2, mode="wrap") as loader:
        got = await collect(loader, 12)  # past the first fills, where a pipeline narrows
        # the ring full again (3 slots ahead of the consumer's), no fill under way
        await wait_until(lambda: len(probe.plans) >= 15 and probe.in_flight == 0, "fills")
        probe.gate.clear()  # fills started from now on wait at the gate
        got += await collect(loader, 2)  # two slots freed: one for each filler
        try:
            await wait_until(lambda: probe.in_flight >= 2, "two fills at once", within=10)
        finally:
            probe.gate.set()
        assert loader.statistics().slots == 5  # prefetch + 1: no chunks, the ring never grew
    assert_matches(got, expected(db30, len(got), batch_size=4))


# -- statistics ------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("device", ["host", "emulated"])
async def test_statistics(db30: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = FillProbe(monkeypatch, sleep=0.02)
    probe.gate.clear()  # no fill before the consumer waits for the first batch
    backend = make_backend(device)

    async def open_once_the_consumer_waits() -> None:
        await anyio.wait_all_tasks_blocked()
        probe.gate.set()

    async with Loader(
        db30, 8, device=backend, mode="epoch", last="pad", prefetch=2, workers=1
    ) as loader:
        s0 = loader.statistics()
        assert (s0.batches, s0.records, s0.wait_time, s0.copy_time) == (0, 0, 0.0, 0.0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(open_once_the_consumer_waits)
            got = await collect(loader) + await collect(loader)
        s = loader.statistics()
    assert len(got) == 8
    assert s.batches == 8
    assert s.records == 60  # the padding rows of each epoch's last batch do not count
    assert s.wait_time > 0.02  # the consumer waited for the slow producer
    assert s.decode_time >= 8 * 0.02
    assert isinstance(s.pool, blobpipe.PoolStatistics) and s.pool.kind == "host"
    if backend.has_device:
        assert s.copy_time > 0
        assert s.device_pool is not None and s.device_pool.kind == "device"
    else:
        assert s.copy_time == 0
        assert s.device_pool is None


# -- arguments -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"prefetch": 0}, ValueError, "prefetch must be a positive integer, got 0"),
        ({"prefetch": True}, ValueError, "prefetch must be a positive integer, got True"),
        ({"prefetch": 1.5}, ValueError, "prefetch must be a positive integer, got 1.5"),
        ({"workers": 0}, ValueError, "workers must be a positive integer, got 0"),
        ({"workers": -2}, ValueError, "workers must be a positive integer, got -2"),
        (
            {"device": "cpu", "device_transform": True},
            ValueError,
            "device_transform=True needs a device, but device='cpu' resolved to the 'host' backend",
        ),
        ({"shuffle": True, "order": "key"}, ValueError, "shuffle=True contradicts order='key'"),
        ({"batch_size": 0}, ValueError, "batch_size must be a positive integer, got 0"),
        ({"device": "tpu"}, ValueError, "unknown device 'tpu'"),
        ({"phase": "val"}, ValueError, "phase must be 'train' or 'test'"),
        ({"mode": "loop"}, ValueError, "mode must be 'wrap' or 'epoch'"),
    ],
)
def test_bad_arguments(db30: Path, kwargs: dict[str, Any], error: type, message: str) -> None:
    args: dict[str, Any] = {"batch_size": 4, "device": "cpu", **kwargs}
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        Loader(db30, **args)


def test_missing_database(tmp_path: Path) -> None:
    with pytest.raises(blobpipe.DatabaseNotFoundError):
        Loader(tmp_path / "nope", 4, device="cpu")


def test_len_needs_epoch_mode(db30: Path) -> None:
    loader = Loader(db30, 4, device="cpu")
    with pytest.raises(TypeError, match="endless"):
        len(loader)
    loader.close()
    assert len(Loader(db30, 4, device="cpu", mode="epoch", last="drop")) == 7


def test_public_names() -> None:
    for name in ("Batch", "Loader", "LoaderStatistics"):
        assert getattr(blobpipe, name) is getattr(blobpipe._loader, name)


# -- resume ----------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["wrap", "epoch"])
async def test_state_dict_follows_the_consumer_not_the_producer(
    db30: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer runs ``prefetch`` batches ahead; the resume state must not."""
    probe = FillProbe(monkeypatch)
    options: dict[str, Any] = {"mode": mode, "order": "shuffle", "seed": 2}
    with Batches(db30, 4, **options) as batches:
        start = batches.state_dict()
    async with Loader(db30, 4, device="cpu", prefetch=3, **options) as loader:
        await wait_until(lambda: len(probe.plans) >= 1, "the producer to fill a batch")
        assert loader.state_dict() == start
        got = await collect(loader, 3)
        # ahead of the consumer: the ring, or (small batches planned by the consumer)
        # the chunks it started
        await wait_until(lambda: len(probe.plans) >= 6, "the producer to run ahead")
        assert loader.state_dict() == got[-1].state
        if mode == "epoch":
            got += await collect(loader)  # to the end of the epoch
            await wait_until(
                lambda: any(epoch == 1 for epoch, _ in probe.plans),
                "the producer to fill a batch of the next epoch",
            )
            assert loader.state_dict() == got[-1].state
            assert (got[-1].state["epoch"], got[-1].state["position"]) == (1, 0)
    assert loader.state_dict() == got[-1].state  # saved after the loop, e.g. at shutdown
    async with Loader(db30, 4, device="cpu", state=loader.state_dict(), **options) as resumed:
        after = await collect(resumed, 3)
    n = len(got) + 3
    want = expected(db30, None if mode == "epoch" else n, batch_size=4, **options)
    if mode == "epoch":
        with Batches(db30, 4, **options) as batches:
            want = list(batches) + list(batches)
    assert_matches(got + after, want[:n])


@pytest.mark.anyio
async def test_cancel_reaches_a_consumer_that_never_awaits(db30: Path) -> None:
    """Ready batches are handed out without waiting, but still at a checkpoint."""
    seen = 0
    async with Loader(db30, 4, device="cpu", prefetch=4, mode="epoch", last="keep") as loader:
        with anyio.move_on_after(0.05) as scope:
            async for _ in loader:
                seen += 1
                deadline = time.monotonic() + 0.02
                while time.monotonic() < deadline:  # CPU work, no await
                    pass
        assert scope.cancelled_caught
    assert seen < 8  # the epoch has 8 batches; cancellation stopped it early


@pytest.mark.anyio
@pytest.mark.parametrize("budget", [0.0, 0.05])
async def test_waiting_for_a_batch_keeps_other_tasks_waiting_at_most_yield_every(
    db30: Path, budget: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer whose next batch is slow to come waits in the loop's thread at most
    YIELD_EVERY (0: not at all), then through the event loop, where other tasks run:
    here the batch comes only once another task has run 20 times while it waits."""
    monkeypatch.setattr(blobpipe._loader._async, "YIELD_EVERY", budget)
    chunk_bytes(monkeypatch, 0)  # a fill a batch
    probe = FillProbe(monkeypatch)
    opened_by: list[str] = []

    def open_gate(by: str) -> None:
        if not probe.gate.is_set():
            opened_by.append(by)
            probe.gate.set()

    # a loop kept from other tasks until the batch comes would wait for this
    fallback = threading.Timer(20, open_gate, ["timer"])
    fallback.start()
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await anyio.lowlevel.checkpoint()
            if not probe.gate.is_set() and probe.in_flight:
                ticks += 1
                if ticks == 20:
                    open_gate("heartbeat")

    try:
        async with (
            anyio.create_task_group() as tg,
            Loader(db30, 4, device="cpu", prefetch=1, workers=1) as loader,
        ):
            got = [Got.of(await anext(loader))]  # the wait since the last turn: none
            # batches 1 and 2 fill the ring's two slots (prefetch + 1)
            await wait_until(lambda: len(probe.plans) >= 3 and probe.in_flight == 0, "fills")
            probe.gate.clear()  # fills started from now on wait at the gate
            got.append(Got.of(await anext(loader)))  # batch 1, let go: batch 3's fill
            got.append(Got.of(await anext(loader)))  # batch 2, there already
            tg.start_soon(heartbeat)
            got.append(Got.of(await anext(loader)))  # batch 3, held at the gate
            tg.cancel_scope.cancel()
    finally:
        fallback.cancel()
    assert opened_by == ["heartbeat"]
    assert_matches(got, expected(db30, 4, batch_size=4))


def count_wakes(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The callbacks ``async for`` has an event loop call from another thread (each a
    wake-up through the loop), recorded as they are scheduled."""
    wakes: list[object] = []
    real = blobpipe._loader._async.threadsafe_caller

    def counted() -> Any:
        call = real()
        return lambda fn: (wakes.append(fn), call(fn))[1]

    monkeypatch.setattr(blobpipe._loader._async, "threadsafe_caller", counted)
    return wakes


@pytest.mark.anyio
async def test_the_first_batch_after_open_is_waited_for_in_the_loops_thread(
    db30: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening is a turn of the event loop, so the first batch (here 50 ms late) is
    waited for in the loop's thread while YIELD_EVERY lasts, as a later one is: no
    wake-up through the event loop (in a fresh process the first one costs
    milliseconds)."""
    monkeypatch.setattr(blobpipe._loader._async, "YIELD_EVERY", 2.0)
    chunk_bytes(monkeypatch, 0)  # a fill a batch
    probe = FillProbe(monkeypatch, sleep=0.05)
    wakes = count_wakes(monkeypatch)
    async with Loader(db30, 4, device="cpu", prefetch=1, workers=1) as loader:
        got = [Got.of(await anext(loader))]
    assert probe.calls >= 1 and wakes == []
    assert_matches(got, expected(db30, 4, batch_size=4)[:1])


@pytest.mark.anyio
async def test_a_batch_late_past_yield_every_is_waited_for_in_the_loops_thread_after_a_turn(
    db30: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch not there when YIELD_EVERY is spent: one turn of the event loop (other
    tasks run), then a YIELD_EVERY more in the loop's thread, where it comes: no wake-up
    through the event loop (a first epoch's batches, a few ms apart, each paid one)."""
    monkeypatch.setattr(blobpipe._loader._async, "YIELD_EVERY", 0.5)
    chunk_bytes(monkeypatch, 0)  # a fill a batch
    probe = FillProbe(monkeypatch)
    probe.gate.clear()  # the first fill waits until 0.75 s from now
    opener = threading.Timer(0.75, probe.gate.set)
    wakes = count_wakes(monkeypatch)
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            ticks += 1  # a step of this task
            await anyio.lowlevel.checkpoint()

    opener.start()
    try:
        async with (
            anyio.create_task_group() as tg,
            Loader(db30, 4, device="cpu", prefetch=1, workers=1) as loader,
        ):
            tg.start_soon(heartbeat)  # (its first step at the next turn of the loop)
            t0 = time.perf_counter()
            got = [Got.of(await anext(loader))]
            waited = time.perf_counter() - t0
            # (trio runs a turn's tasks in random order: this one's step may come first)
            await anyio.lowlevel.checkpoint()
            seen = ticks
            tg.cancel_scope.cancel()
    finally:
        opener.cancel()
        probe.gate.set()
    assert probe.calls >= 1 and wakes == []
    # past YIELD_EVERY, one turn of the loop, not a wait through it (where the other
    # task would have stepped all the time)
    assert waited > 0.5 and 1 <= seen <= 3
    assert_matches(got, expected(db30, 4, batch_size=4)[:1])


@pytest.mark.anyio
@pytest.mark.parametrize("device", ["host", "emulated"])
async def test_open_is_a_checkpoint_and_starts_nothing_when_cancelled(
    db30: Path, device: str
) -> None:
    """With or without a device warm-up, entering a loader in a cancelled scope is
    cancelled before any filler starts; the loader can still be closed."""
    loader = Loader(db30, 4, device=make_backend(device))
    with anyio.CancelScope() as scope:
        scope.cancel()
        async with loader:
            pytest.fail("the loader was entered in a cancelled scope")
    assert scope.cancelled_caught
    assert not [t for t in threading.enumerate() if t.name.startswith("blobpipe-filler")]
    await loader.aclose()


@pytest.mark.anyio
async def test_aclose_from_a_nested_scope_inside_async_with(db30: Path) -> None:
    backend = make_backend("host")
    pools = PoolWatch(backend)
    async with Loader(db30, 4, device=backend) as loader:
        await anext(loader)
        with anyio.move_on_after(5):
            await loader.aclose()  # not the scope the task group was entered in
        with pytest.raises(StateError, match="this Loader is closed"):
            await anext(loader)
    pools.assert_returned()


@pytest.mark.anyio
async def test_an_error_outside_the_fill_reaches_the_consumer_as_itself(
    db30: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Loader, *args: Any) -> Any:
        raise RuntimeError("the device fell off the bus")

    monkeypatch.setattr(blobpipe._loader._pipeline.Pipeline, "_issue", broken)
    async with Loader(db30, 4, device="cpu") as loader:
        with pytest.raises(RuntimeError, match="fell off the bus") as info:
            await anext(loader)
        assert type(info.value) is RuntimeError  # not an exception group
        with pytest.raises(StateError, match="stopped after an error"):
            await anext(loader)


@pytest.mark.anyio
@pytest.mark.parametrize("device", ["host", "emulated"])
async def test_mean_file_mismatch_is_a_data_error_on_every_path(db30: Path, device: str) -> None:
    t = Transform(mean_file=MEAN_FILE)  # 3x32x40; the records are 3x10x12
    async with Loader(db30, 4, device=make_backend(device), transform=t) as loader:
        with pytest.raises(DataError, match="mean file") as info:
            await anext(loader)
    assert info.value.key is not None and info.value.path is not None


@pytest.mark.anyio
async def test_torch_from_dlpack_shares_memory(db30: Path) -> None:
    torch = pytest.importorskip("torch")
    t = Transform(scale=0.5)
    want = expected(db30, 1, batch_size=4, transform=t)[0].data
    async with Loader(db30, 4, device="cpu", transform=t) as loader:
        batch = await anext(loader)
        tensor = torch.from_dlpack(batch.data)
        native = batch.data.cpu_data()
        assert tensor.data_ptr() == native.ctypes.data  # no copy
        assert np.array_equal(tensor.numpy(), want)


@pytest.mark.parametrize("form", ["async", "blocking"])
def test_a_waiting_consumer_fills_small_batches_itself(
    db30: Path, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing ready and batches that fill in under a millisecond, the
    consumer's own thread fills the next batch instead of sleeping until a
    filler posts it; the batches are the same, in the same order."""
    threads: list[int] = []
    real_fill = Batches.fill

    def fill(self: Batches, *args: Any, **kwargs: Any) -> None:
        threads.append(threading.get_ident())
        real_fill(self, *args, **kwargs)

    monkeypatch.setattr(Batches, "fill", fill)
    options: dict[str, Any] = {"mode": "epoch", "order": "shuffle", "seed": 4}
    with Batches(db30, 4, **options) as batches:
        want = list(batches) + list(batches)
    consumer: list[int] = []
    got: list[Got] = []

    async def consume_async() -> None:
        consumer.append(threading.get_ident())
        async with Loader(db30, 4, device="cpu", workers=1, **options) as loader:
            for _ in range(2):
                got.extend([Got.of(b) async for b in loader])

    if form == "async":
        anyio.run(consume_async)
    else:
        consumer.append(threading.get_ident())
        with Loader(db30, 4, device="cpu", workers=1, **options) as loader:
            for _ in range(2):
                got.extend(Got.of(b) for b in loader)
    assert_matches(got, want)
    assert consumer[0] in threads  # the consumer filled some batches itself
    assert set(threads) - set(consumer)  # and the filler the others


@pytest.mark.timeout(180)
def test_an_open_blocking_loader_is_closed_at_exit(tmp_path: Path) -> None:
    """Leaving the interpreter with a blocking-form Loader still open: an atexit hook
    closes it, so no filler thread is left inside native code while the interpreter
    finalizes (which could abort the process)."""
    from tests._helpers import encoded_db

    db = encoded_db(tmp_path / "db", 64, ".jpg", shape=(3, 120, 160))
    code = (
        "import atexit, sys, threading, blobpipe\n"
        "def check():  # registered first, so it runs after blobpipe's hook\n"
        "    alive = [t.name for t in threading.enumerate() if t.name.startswith('blobpipe')]\n"
        "    print('alive:', alive)\n"
        "atexit.register(check)\n"
        "loader = blobpipe.Loader(sys.argv[1], 8, device='cpu', workers=2, mode='wrap')\n"
        "loader.__enter__()\n"
        "next(iter(loader))\n"
        "sys.exit(0)  # no close()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(db)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "alive: []" in proc.stdout
    # 60 exits (without the hook most of them abort): children forked from one
    # process that imported blobpipe, each leaving with its Loader open
    many = (
        "import os, sys, blobpipe\n"
        "statuses = []\n"
        "for i in range(60):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        loader = blobpipe.Loader(sys.argv[1], 8, device='cpu', workers=2)\n"
        "        loader.__enter__()\n"
        "        next(iter(loader))\n"
        "        sys.exit(0)  # no close(): the interpreter finalizes with fillers running\n"
        "    statuses.append(os.waitpid(pid, 0)[1])\n"
        "bad = [(i, s) for i, s in enumerate(statuses) if s]\n"
        "print('exits', len(statuses), 'bad', bad)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", many, str(db)], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr
    assert "exits 60 bad []" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_load_state_dict_before_open_resumes_there(db30: Path) -> None:
    options: dict[str, Any] = {"mode": "epoch", "order": "shuffle", "seed": 2}
    with Loader(db30, 4, device="cpu", **options) as loader:
        first = [b.keys for b in islice(loader, 3)]
        state = loader.state_dict()
    with Loader(db30, 4, device="cpu", **options) as loader:
        want = [b.keys for b in loader]
    assert want[:3] == first
    later = Loader(db30, 4, device="cpu", **options)
    later.load_state_dict(state)
    assert later.state_dict() == state
    with later:
        assert [b.keys for b in later] == want[3:]
        with pytest.raises(StateError, match="load_state_dict needs a Loader that was not opened"):
            later.load_state_dict(state)
    other = Loader(db30, 4, device="cpu", mode="epoch", order="shuffle", seed=3)
    with pytest.raises(ValueError, match="saved with seed=2"):
        other.load_state_dict(state)
    other.close()


def test_breaking_out_of_an_epoch_and_iterating_again_continues_it(db30: Path) -> None:
    with Batches(db30, 4, mode="epoch") as batches:
        want = [tuple(b.keys) for b in batches]
    with Loader(db30, 4, device="cpu", mode="epoch") as loader:
        head = []
        for batch in loader:
            head.append(batch.keys)
            if len(head) == 2:
                break
        rest = [b.keys for b in loader]
        again = [b.keys for b in loader]  # the next epoch, from its start
    assert head + rest == want
    assert again == want


def test_int64_labels_through_the_loader(db30: Path) -> None:
    with Loader(db30, 4, device="cpu", mode="epoch", label_dtype="int64") as loader:
        labels = [b.label.cpu_data().copy() for b in loader]
    assert all(x.dtype == np.int64 for x in labels)
    with Batches(db30, 4, mode="epoch") as batches:
        assert [x.tolist() for x in labels] == [b.label.astype(np.int64).tolist() for b in batches]


def test_host_exports_are_read_only(db30: Path) -> None:
    """A batch is a slot of the loader's ring: NumPy (DLPack 1.0) gets a read-only
    view, the head stays where it was."""
    with Loader(db30, 4, device="cpu", mode="epoch") as loader:
        batch = next(iter(loader))
        view = np.from_dlpack(batch.data)
        assert not view.flags.writeable
        assert np.shares_memory(view, batch.data.cpu_data())
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1
        assert not np.from_dlpack(batch.label).flags.writeable


def test_batch_host_arrays_stay_read_only_and_fresh(db30: Path) -> None:
    """A batch's ``cpu_data()`` cannot be made writable (its memory is a ring slot), each
    call is a fresh view (what a caller does to its own is not the next caller's), and
    the blob's mutable accessor still writes through to later reads."""
    with Loader(db30, 4, device="cpu", mode="epoch") as loader:
        batch = next(iter(loader))
        data = batch.data.cpu_data()
        with pytest.raises(ValueError, match="WRITEABLE"):
            data.flags.writeable = True
        shape = data.shape
        data.shape = (-1,)
        again = batch.data.cpu_data()
        assert again.shape == shape and again is not data
        assert not again.flags.writeable
        for other in (batch.label.cpu_data(), batch.data.cpu_diff()):
            with pytest.raises(ValueError, match="WRITEABLE"):
                other.flags.writeable = True
        assert batch.data.mutable_cpu_diff().flags.writeable  # (its own held array)
        batch.data.mutable_cpu_data()[0] = 7
        assert (batch.data.cpu_data()[0] == 7).all()
        assert (again[0] == 7).all()  # (the same memory)


def test_torch_takes_read_only_exports(db30: Path) -> None:
    torch = pytest.importorskip("torch")
    with Loader(db30, 4, device="cpu", mode="epoch") as loader:
        batch = next(iter(loader))
        tensor = torch.from_dlpack(batch.data)
        assert tensor.data_ptr() == batch.data.cpu_data().ctypes.data
        assert np.array_equal(tensor.numpy(), batch.data.cpu_data())


def test_an_export_outlives_its_batch_and_loader(db30: Path) -> None:
    """A host array exported from a batch keeps its memory: after the batch is dropped,
    or the loader closed, the pool does not give those bytes to later batches."""

    with Loader(db30, 4, device="cpu", mode="wrap") as loader:
        it = iter(loader)
        kept = next(it)
        view = np.from_dlpack(kept.data)
        want = view.copy()
        del kept
        gc.collect()
        for _ in range(20):  # later batches, and the slot's replacement buffers
            next(it)
        np.testing.assert_array_equal(view, want)
        last = np.from_dlpack(next(it).data)
        last_want = last.copy()
    gc.collect()
    with Loader(db30, 4, device="cpu", mode="wrap", order="shuffle", seed=9) as other:
        for batch in islice(other, 20):
            batch.data.cpu_data()
    np.testing.assert_array_equal(view, want)
    np.testing.assert_array_equal(last, last_want)


@pytest.mark.anyio
@pytest.mark.parametrize("budget", [0.0, 3600.0])
async def test_a_ready_batch_is_a_checkpoint_once_yield_every_passed(
    db30: Path, budget: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer that never awaits sees a cancellation at the first ``__anext__``
    after YIELD_EVERY of its own time (0: at once); before that, batches that are
    ready are handed out with no checkpoint at all (the async protocol needs none)."""
    monkeypatch.setattr(blobpipe._loader._async, "YIELD_EVERY", budget)
    seen = 0
    async with Loader(db30, 4, device="cpu", prefetch=8, mode="epoch", last="keep") as loader:
        # the first four (fillers post in any order: four posted need not be these; the
        # consumer's own chunks are posted by its next call, pump, which runs here)
        pipe = loader._pipe
        items = pipe.handoff._items

        def ready() -> bool:
            pipe.pump()
            return all(k in items for k in range(4))

        await wait_until(ready, "batches 0-3 ready")
        with anyio.CancelScope() as scope:
            async for _ in loader:
                seen += 1
                if seen == 2:
                    scope.cancel()  # no await in the body
    if budget == 0.0:
        assert scope.cancelled_caught
        assert seen == 2
    else:
        assert seen >= 4  # the ready batches, each without a checkpoint


@pytest.mark.anyio
@pytest.mark.parametrize("held", [False, True])
async def test_aclose_waits_for_the_fillers_in_the_loop_thread_only_briefly(
    db30: Path, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``aclose`` waits for fillers that return at once in the loop's thread (no worker
    thread started); a filler still busy after YIELD_EVERY is waited for in a worker
    thread, other tasks running meanwhile."""
    chunk_bytes(monkeypatch, 0)  # a fill a batch
    probe = FillProbe(monkeypatch)
    threads: list[object] = []
    run_sync = anyio.to_thread.run_sync

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        threads.append(fn)
        return await run_sync(fn, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.001)
            ticks += 1

    loader = Loader(db30, 4, device="cpu", prefetch=2, workers=1, mode="wrap")
    async with anyio.create_task_group() as tg:
        async with loader:
            await anext(loader)
            await wait_until(lambda: probe.in_flight == 0 and probe.calls >= 2, "fills")
            if held:
                probe.gate.clear()
                await anext(loader)  # a slot freed: its refill waits at the gate
                await wait_until(lambda: probe.in_flight == 1, "a fill held")
                tg.start_soon(heartbeat)
                threading.Timer(0.2, probe.gate.set).start()
        tg.cancel_scope.cancel()
    assert len(threads) == (1 if held else 0)
    if held:
        assert ticks >= 20  # the loop ran other tasks while the fill finished
