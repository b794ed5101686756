"""The batch contract: nothing a caller keeps is ever overwritten, and the ring stays
zero-copy.

A delivered batch's slot is refilled only once nothing made from the batch is
referenced (the Batch, its Blobs, their arrays, DLPack exports); a loop that keeps
nothing reuses the ring's memory without allocating; memory kept by the caller is
reported and returns when dropped; on a device, the refill is ordered after the
consumer's streams whichever thread lets the batch go; a closed Loader holds no
file.
"""

from __future__ import annotations

import gc
import os
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import blobpipe
from blobpipe import Batches, Blob, Loader, PoolMemoryError, StateError, get_pool
from blobpipe._backends import Backend, EmulatedBackend
from tests._helpers import queue_late, raw_db, unowned
from tests.conftest import make_backend, to_numpy

DEVICES = ["host", "emulated"]
LATE = 0.2  # seconds the consumer's queued work runs late


@pytest.fixture(scope="module")
def db800(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """800 small records: in batches of 8, 100 batches, several times the ring's slots."""
    return raw_db(tmp_path_factory.mktemp("contract") / "db800", 800)


def epoch(db: Path, batch_size: int = 4, **options: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """One epoch of the synchronous iterator: (data, label) per batch."""
    with Batches(db, batch_size, mode="epoch", **options) as batches:
        return [(np.array(b.data), np.array(b.label)) for b in batches]


def used(backend: Backend) -> int:
    """Bytes the backend's pools have handed out (host and device)."""
    total = get_pool(backend, "host").statistics().used_bytes
    if backend.has_device:
        total += get_pool(backend, "device").statistics().used_bytes
    return total


def host(array: Any) -> np.ndarray:
    return np.array(to_numpy(array))


# -- what a caller keeps keeps its values ----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_kept_cpu_data_views_keep_their_values(db800: Path, device: str) -> None:
    """``[b.data.cpu_data() for b in loader]``: every kept array shows its own batch."""
    backend = make_backend(device)
    with Loader(db800, 8, device=backend, mode="epoch", prefetch=2) as loader:
        xs = [(b.data.cpu_data(), b.label.cpu_data()) for b in loader]
    want = epoch(db800, 8)
    assert len(xs) == len(want) == 100
    for (x, y), (wx, wy) in zip(xs, want, strict=True):
        np.testing.assert_array_equal(x, wx)
        np.testing.assert_array_equal(y, wy)
    del xs, x, y
    assert used(backend) == 0  # the last reference went: the memory with it


def test_kept_gpu_data_keeps_its_values(db800: Path) -> None:
    """``gpu_data()`` arrays kept across steps on the emulated device, with late copies."""
    backend = EmulatedBackend(delay=0.005)
    with Loader(db800, 8, device=backend, mode="epoch", prefetch=2) as loader:
        xs = [b.data.gpu_data() for b in loader]
    backend.synchronize()
    for x, (want, _) in zip(xs, epoch(db800, 8), strict=True):
        np.testing.assert_array_equal(host(x), want)


@pytest.mark.parametrize("device", DEVICES)
def test_kept_numpy_dlpack_exports_keep_their_values(db800: Path, device: str) -> None:
    backend = make_backend(device)
    with Loader(db800, 8, device=backend, mode="epoch", prefetch=2) as loader:
        xs = [np.from_dlpack(b.data) for b in loader]
    for x, (want, _) in zip(xs, epoch(db800, 8), strict=True):
        np.testing.assert_array_equal(x, want)


def test_kept_torch_tensors_keep_their_values(db800: Path) -> None:
    torch = pytest.importorskip("torch")
    with Loader(db800, 8, device="cpu", mode="epoch", prefetch=2) as loader:
        xs = [torch.from_dlpack(b.data) for b in loader]
    for x, (want, _) in zip(xs, epoch(db800, 8), strict=True):
        np.testing.assert_array_equal(x.numpy(), want)


def test_kept_jax_arrays_keep_their_values(db800: Path) -> None:
    """JAX promises its arrays are immutable: a zero-copy import must stay so."""
    jnp = pytest.importorskip("jax.numpy")
    with Loader(db800, 8, device="cpu", mode="epoch", prefetch=2) as loader:
        xs = [jnp.from_dlpack(b.data) for b in loader]
    for x, (want, _) in zip(xs, epoch(db800, 8), strict=True):
        np.testing.assert_array_equal(np.asarray(x), want)


@pytest.mark.parametrize("device", DEVICES)
def test_list_of_a_loader(db800: Path, device: str) -> None:
    with Loader(db800, 8, device=make_backend(device), mode="epoch") as loader:
        batches = list(loader)
    with Batches(db800, 8, mode="epoch") as reference:
        assert [list(b.keys) for b in batches] == [list(b.keys) for b in reference]
    for batch, (want, label) in zip(batches, epoch(db800, 8), strict=True):
        np.testing.assert_array_equal(batch.data.cpu_data(), want)
        np.testing.assert_array_equal(batch.label.cpu_data(), label)


@pytest.mark.parametrize("device", DEVICES)
def test_the_last_batch_after_the_loop(db30: Path, device: str) -> None:
    with Loader(db30, 4, device=make_backend(device), mode="epoch") as loader:
        for batch in loader:  # noqa: B007 - the loop's last batch is used after it
            pass
        np.testing.assert_array_equal(batch.data.cpu_data(), epoch(db30)[-1][0])
    # and after the loader closed
    np.testing.assert_array_equal(batch.data.cpu_data(), epoch(db30)[-1][0])


@pytest.mark.anyio
@pytest.mark.parametrize("device", DEVICES)
async def test_async_for_keeps_what_it_keeps(db800: Path, device: str) -> None:
    backend = make_backend(device)
    async with Loader(db800, 8, device=backend, mode="epoch", prefetch=2) as loader:
        kept = [batch async for batch in loader]
        views = [b.data.cpu_data() for b in kept[::2]]
        del kept[::2]
    want = epoch(db800, 8)
    for batch, (w, _) in zip(kept, want[1::2], strict=True):
        np.testing.assert_array_equal(batch.data.cpu_data(), w)
    for view, (w, _) in zip(views, want[::2], strict=True):
        np.testing.assert_array_equal(view, w)


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_kept_from_one_epoch_while_the_next_runs(db800: Path, device: str) -> None:
    with Loader(db800, 8, device=make_backend(device), mode="epoch", prefetch=2) as loader:
        first = [b for _, b in zip(range(3), loader, strict=False)][1]
        for _ in loader:  # the rest of epoch 0
            pass
        for _ in loader:  # all of epoch 1: every slot refilled several times
            pass
        np.testing.assert_array_equal(first.data.cpu_data(), epoch(db800, 8)[1][0])
        assert first.epoch == 0


@pytest.mark.parametrize("device", DEVICES)
def test_views_and_shared_blobs_keep_the_batch(db800: Path, device: str) -> None:
    """A view of a batch's Blob, and a Blob sharing its data, keep the batch's memory."""
    backend = make_backend(device)
    with Loader(db800, 8, device=backend, mode="wrap", prefetch=2) as loader:
        it = iter(loader)
        batch = next(it)
        view = batch.data.view()
        sharing = Blob(batch.data.shape, batch.data.dtype, backend=backend)
        sharing.share_data(batch.data)
        del batch
        for _ in range(120):
            next(it)
        want = epoch(db800, 8)[0][0]
        np.testing.assert_array_equal(view.cpu_data(), want)
        np.testing.assert_array_equal(sharing.cpu_data(), want)
        sharing.close()
        view.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_blob_reshaped_or_closed_releases_nothing_of_the_slot(
    db800: Path, device: str
) -> None:
    """A batch's Blobs borrow the slot's memories: reshaping one beyond its capacity
    (new memories for it alone), sharing another Blob's data or diff, or closing it
    lets go of nothing the slot owns, so
    the next batches in that slot, and a view taken before, hold the right values;
    the memory returns to the pool once the loader and everything made from the
    batch are gone."""
    backend = make_backend(device)
    want = epoch(db800, 8)
    with Loader(db800, 8, device=backend, mode="wrap", prefetch=2) as loader:
        it = iter(loader)
        batch = next(it)
        view = batch.data.view()  # references of its own
        batch.data.reshape((16, *batch.data.shape[1:]))  # beyond capacity: new memories
        batch.label.close()
        other = next(it)
        other.data.share_data(Blob(other.data.shape, other.data.dtype, backend=backend))
        other.label.share_diff(Blob(other.label.shape, other.label.dtype, backend=backend))
        del batch, other
        for k in range(2, 120):
            got = next(it)
            np.testing.assert_array_equal(host(got.data.cpu_data()), want[k % 100][0])
        del got
    np.testing.assert_array_equal(view.cpu_data(), want[0][0])  # after the loader's close
    assert used(backend) > 0
    view.close()
    gc.collect()
    assert used(backend) == 0


# -- the device's order, the consumer's included ---------------------------------------------


@pytest.mark.parametrize("ordered", [True, False])
def test_late_consumer_work_on_a_dropped_batch_is_not_overwritten(
    db30: Path, ordered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Delayed copies and delayed consumer work: the consumer queues a late read of
    each batch on its current stream (a raw alias, as a kernel holds no reference)
    and drops the batch at once; the slot's refill waits for that read. Without the
    release event (``ordered=False``) the refill overwrites the batch under the read:
    the emulated device catches a missing order."""
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 0.0)  # 3 slots, no chunks
    if not ordered:
        monkeypatch.setattr(
            blobpipe._loader._device.DeviceWork,
            "release",
            lambda self, stream, slot=None: blobpipe._backends.COMPLETED,
        )
    backend = EmulatedBackend(delay=0.002)
    xp = backend.xp
    seen = []
    with Loader(db30, 4, device=backend, mode="wrap", prefetch=2) as loader:
        it = iter(loader)
        for _ in range(6):
            batch = next(it)
            src = unowned(backend, batch.data.gpu_data())
            dst = xp.zeros(src.shape, src.dtype)
            queue_late(backend, lambda dst=dst, src=src: xp.copyto(dst, src), LATE / 4)
            seen.append(dst)
            del batch  # the read was queued while the batch was held
        backend.current_stream().synchronize()
    want = [w for w, _ in epoch(db30)][:6]
    right = [np.array_equal(host(s), w) for s, w in zip(seen, want, strict=True)]
    if ordered:
        assert all(right)
    else:
        assert not all(right)


@pytest.mark.parametrize("captured", [True, False])
def test_an_export_dropped_on_another_thread_orders_the_refill(
    db30: Path, captured: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch delivered while the consumer's stream ``side`` is current, read late on
    ``side``, and exported; the export's last reference goes on another thread (a
    DLPack deleter there), whose current stream is another: the refill still waits
    for ``side``. Without the stream captured at delivery (``captured=False``) the
    release orders nothing, and the read sees the next batch."""
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 0.0)  # 3 slots, no chunks
    if not captured:
        original = blobpipe._loader._ring.Ring.lease
        monkeypatch.setattr(
            blobpipe._loader._ring.Ring,
            "lease",
            lambda self, slot, stream: original(self, slot, None),
        )
    backend = EmulatedBackend(delay=0.002)
    xp = backend.xp
    side = backend.create_stream()
    with Loader(db30, 4, device=backend, mode="wrap", prefetch=2) as loader:
        it = iter(loader)
        with backend.using(side):
            batch = next(it)
            src = unowned(backend, batch.data.gpu_data())
            seen = xp.zeros(src.shape, src.dtype)
            queue_late(backend, lambda: xp.copyto(seen, src), LATE)
        exported = [np.from_dlpack(batch.data)]
        del batch
        dropper = threading.Thread(target=exported.clear)
        dropper.start()
        dropper.join()
        for _ in range(6):  # the slot is refilled meanwhile
            next(it)
        side.synchronize()
    right = np.array_equal(host(seen), epoch(db30)[0][0])
    assert right is captured


# -- the common loop costs nothing --------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["for", "async for"])
@pytest.mark.parametrize("small", [True, False], ids=["chunks", "one-by-one"])
def test_a_loop_that_keeps_nothing_allocates_and_copies_nothing(
    db30: Path, device: str, form: str, small: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After warm-up, a loop whose variable holds the previous batch while the next
    is asked for allocates nothing and copies nothing back: the ring's slots
    (``prefetch + 1``, or two chunks' and two more) serve it."""
    # every fill counts as small (chunks) or as large (one batch per slot)
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 60.0 if small else 0.0)
    backend = make_backend(device)
    prefetch = 3

    def counters(loader: Loader) -> tuple[Any, ...]:
        s = loader.statistics()
        dp = s.device_pool
        return (
            s.pool.allocations,
            s.pool.misses,
            dp and dp.allocations,
            dp and dp.misses,
            backend.statistics().host_allocations,
            backend.statistics().device_allocations,
            backend.statistics().d2h_copies,
        )

    def touch(batch: blobpipe.Batch) -> None:  # the data where it is: no copy
        data = batch.data.gpu_data() if backend.has_device else batch.data.cpu_data()
        assert data.shape == (8, 3, 10, 12)

    loader = Loader(db30, 8, device=backend, prefetch=prefetch, workers=1, mode="wrap")
    if form == "for":
        with loader:
            for step, batch in enumerate(loader):
                touch(batch)
                if step == 100:
                    warm = counters(loader)
                if step == 300:
                    break
            end = counters(loader)
            stats = loader.statistics()
    else:

        async def run() -> tuple[Any, Any, Any]:
            async with loader:
                async for step, batch in _enumerate(loader):
                    touch(batch)
                    if step == 100:
                        warm = counters(loader)
                    if step == 300:
                        break
                return warm, counters(loader), loader.statistics()

        warm, end, stats = anyio.run(run)
    assert end == warm
    assert stats.slots == (2 * 16 + 2 if small else prefetch + 1)
    assert stats.held_batches == 1  # the loop variable's


async def _enumerate(loader: Loader) -> Any:
    step = 0
    async for batch in loader:
        yield step, batch
        step += 1


# -- kept memory: visible, bounded, returned -----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_kept_memory_is_reported_and_returns_when_dropped(
    db30: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 0.0)  # 3 slots, no chunks
    backend = make_backend(device)
    with Loader(db30, 4, device=backend, prefetch=2, mode="wrap", workers=1) as loader:
        it = iter(loader)
        for _ in range(5):  # every slot filled once
            next(it)
        base = used(backend)
        kept = [next(it) for _ in range(10)]
        stats = loader.statistics()
        assert stats.held_batches == 10
        assert stats.held_bytes >= 10 * kept[0].data.nbytes
        assert stats.slots >= 10
        del kept
        next(it)
        stats = loader.statistics()
        assert (stats.held_batches, stats.slots) == (0, 3)
        assert used(backend) == base  # what the caller kept went back to the pool
    assert used(backend) == 0


def test_a_full_pool_names_the_kept_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the pool's limit, the error says what holds the memory and what to do."""
    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 0.0)  # 3 slots, no chunks
    db = raw_db(tmp_path / "db", 64, shape=(3, 32, 32))
    backend = make_backend("host")
    get_pool(backend, "host").set_limit(2 << 20)  # the ring's 3 slots, and 17 batches more
    kept = []
    with Loader(db, 8, device=backend, prefetch=2, mode="wrap", workers=1) as loader:
        it = iter(loader)

        def keep_every_batch() -> None:
            while True:
                kept.append(next(it))

        with pytest.raises(PoolMemoryError) as info:
            keep_every_batch()
    assert len(kept) > 10
    assert re.match(
        r"\d+ batches kept by the caller hold [\d.]+ MiB; drop them or copy what you need "
        r"\(host pool limit reached",
        str(info.value),
    ), info.value


def test_detach_and_recycled_are_deprecated(db30: Path) -> None:
    with Loader(db30, 4, device="cpu") as loader:
        batch = next(loader)
        with pytest.warns(DeprecationWarning, match=r"detach\(\) is no longer needed"):
            assert batch.detach() is batch
        with pytest.warns(DeprecationWarning, match="use batch.closed"):
            assert batch.recycled is False


@pytest.mark.parametrize("device", DEVICES)
def test_close_lets_a_batch_go_early(db30: Path, device: str) -> None:
    """``batch.close()``: its Blobs raise StateError; an array taken before keeps its
    values; the slot is refilled once that array goes too."""
    backend = make_backend(device)
    with Loader(db30, 4, device=backend, prefetch=2, mode="wrap", workers=1) as loader:
        it = iter(loader)
        batch = next(it)
        data = batch.data
        taken = batch.data.cpu_data()
        batch.close()
        assert batch.closed and "closed" in repr(batch)
        for access in (lambda: batch.data, lambda: batch.label, data.cpu_data):
            with pytest.raises(StateError, match=r"this batch was closed \(batch\.close\(\)\)"):
                access()
        assert loader.statistics().held_batches == 1  # the array holds it
        for _ in range(8):
            next(it)
        np.testing.assert_array_equal(taken, epoch(db30)[0][0])
        del taken
        assert loader.statistics().held_batches == 0


# -- close() releases everything it opened ------------------------------------------------------


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _maps(where: Path) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if str(where) in line)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.parametrize("form", ["for", "async for"])
def test_fifty_closed_loaders_hold_no_file(
    tmp_path: Path, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loaders kept after ``close()`` hold no descriptor and no map (the database's,
    its persistent index's), also after reading whole epochs through the index."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("BLOBPIPE_CACHE_DIR", str(cache))
    dbs = [raw_db(tmp_path / f"db{i}", 20) for i in range(5)]
    for db in dbs:  # the persistent indexes are written; later opens map them
        with Batches(db, 4, mode="epoch") as b:
            list(b)
    gc.collect()
    fds, maps = _descriptors(), _maps(tmp_path)
    closed = []
    for i in range(50):
        loader = Loader(dbs[i % 5], 4, device="cpu", mode="epoch", prefetch=2)
        if form == "for":
            with loader:
                for batch in loader:  # noqa: B007 - dropped after the loop
                    pass
            # a batch kept reads its keys from the index on demand: it holds the map
            del batch
        else:

            async def run(loader: Loader = loader) -> None:
                async with loader:
                    async for _ in loader:
                        pass

            anyio.run(run)
        closed.append(loader)
    assert (_descriptors() - fds, _maps(tmp_path) - maps) == (0, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_batch_dropped_in_a_forked_child_leaves_the_ring_alone(db30: Path) -> None:
    """A batch kept across a fork and dropped in the child gives nothing back there:
    the ring's lock may be held by a thread of the parent (held here while forking),
    and the child's memory is its own copy."""
    import signal

    from tests._helpers import in_forked_child

    with Loader(db30, 4, device="cpu", prefetch=2) as loader:
        kept = [next(loader)]
        ring = loader._pipe._ring
        holding, done = threading.Event(), threading.Event()

        def hold() -> None:
            with ring._cond:
                holding.set()
                done.wait()

        holder = threading.Thread(target=hold)
        holder.start()
        holding.wait()

        def child() -> bool:
            signal.alarm(10)  # a give-back waiting for the parent's lock never returns
            kept.clear()  # the batch's last reference: its lease ends here, at once
            return True

        t0 = time.monotonic()
        try:
            with warnings.catch_warnings():  # JAX, when imported, warns at every fork
                warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
                code = in_forked_child(child)
        finally:
            done.set()
            holder.join()
        assert code == 0
        assert time.monotonic() - t0 < 5  # (not released by the alarm)
        np.testing.assert_array_equal(kept[0].data.cpu_data(), epoch(db30)[0][0])


def test_a_release_that_cannot_be_ordered_never_reuses_the_slot(
    db30: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the event after the consumer's work cannot be recorded (a device error),
    the batch's slot is not refilled: the ring makes another, the error is reported
    where the last reference went, and the slot's memory goes back only at close,
    once the device is idle."""
    import sys

    monkeypatch.setattr(blobpipe._loader._pipeline, "SMALL_FILL", 0.0)  # 3 slots, no chunks
    backend = EmulatedBackend(delay=0.001)
    unraisable: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))
    original = blobpipe._loader._device.DeviceWork.release
    failures = [RuntimeError("emulated: cannot record an event")]

    def release(self: Any, stream: Any, slot: Any = None) -> Any:
        if failures:
            raise failures.pop()
        return original(self, stream, slot)

    monkeypatch.setattr(blobpipe._loader._device.DeviceWork, "release", release)
    with Loader(db30, 4, device=backend, prefetch=2, mode="wrap", workers=1) as loader:
        it = iter(loader)
        next(it)  # dropped at once: its release fails
        assert [str(e) for e in unraisable] == ["emulated: cannot record an event"]
        seen = [np.array(b.data.cpu_data()) for _, b in zip(range(12), it, strict=False)]
        assert loader.statistics().slots == 3  # another slot took its place
    with Batches(db30, 4, mode="wrap") as reference:
        want = [np.array(b.data) for _, b in zip(range(13), reference, strict=False)]
    for got, expect in zip(seen, want[1:], strict=True):
        np.testing.assert_array_equal(got, expect)
    assert used(backend) == 0
