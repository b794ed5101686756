"""Backend selection and the emulated device."""

from __future__ import annotations

import gc
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blobpipe
from blobpipe import ArgumentError, BackendUnavailableError, UnsupportedOperationError
from blobpipe._backends import (
    COMPLETED,
    CudaDevices,
    EmulatedBackend,
    HostBackend,
    _base,
    get_backend,
    set_cuda_devices,
    set_default_backend,
    wait_event,
)
from blobpipe.testing import current_device, emulated_cuda, touched_devices, use_device
from tests import _fake_cupy
from tests._helpers import in_forked_child, raw_db


def test_names() -> None:
    assert isinstance(get_backend("cpu"), HostBackend)
    assert get_backend("host") is get_backend("cpu")
    backend = EmulatedBackend()
    assert get_backend(backend) is backend
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        get_backend("tpu")
    with pytest.raises(ValueError, match="cuda:N"):
        get_backend("cuda:x")
    with pytest.raises(TypeError, match="str or a Backend"):
        get_backend(3)  # type: ignore[arg-type]


def test_auto_falls_back_to_host_without_cuda() -> None:
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert isinstance(get_backend("auto"), HostBackend)
        with pytest.raises(BackendUnavailableError, match=r"pip install 'blobpipe\[cuda12\]'"):
            get_backend("cuda")
    else:  # pragma: no cover - GPU machines
        pytest.skip("CuPy is installed")


def test_default_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    old = set_default_backend(None)
    try:
        monkeypatch.setenv("BLOBPIPE_DEVICE", "cpu")
        assert isinstance(get_backend(None), HostBackend)
        emu = EmulatedBackend()
        set_default_backend(emu)
        assert get_backend(None) is emu
    finally:
        set_default_backend(old)


def test_import_does_not_import_cupy() -> None:
    import subprocess
    import sys

    code = "import sys, blobpipe; assert 'cupy' not in sys.modules, 'cupy imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert blobpipe.__version__


def test_host_backend_has_no_device() -> None:
    host = HostBackend()
    with pytest.raises(BackendUnavailableError, match="no device memory"):
        host.alloc_device(4)
    with pytest.raises(BackendUnavailableError):
        host.create_stream()
    assert host.alloc_host(4).dtype == np.uint8


def test_emulated_streams_are_ordered() -> None:
    backend = EmulatedBackend(delay=0.01)
    stream = backend.create_stream()
    dev = backend.alloc_device(4)
    for value in range(1, 6):
        backend.copy_to_device(dev, np.full(4, value, np.uint8), stream)
    back = np.zeros(4, np.uint8)
    backend.copy_to_host(back, dev, stream).synchronize()
    assert back.tolist() == [5] * 4
    stats = backend.statistics()
    assert (stats.h2d_copies, stats.d2h_copies, stats.h2d_bytes) == (5, 1, 20)


def test_copy_size_mismatch() -> None:
    backend = EmulatedBackend()
    with pytest.raises(ValueError, match="copy size mismatch"):
        backend.copy_to_device(backend.alloc_device(4), np.zeros(8, np.uint8))


@pytest.mark.anyio
async def test_wait_event() -> None:
    await wait_event(COMPLETED)
    backend = EmulatedBackend(delay=0.05)
    event = backend.copy_to_device(backend.alloc_device(4), np.ones(4, np.uint8))
    await wait_event(event)
    assert event.query()


def test_launch_runs_in_stream_order() -> None:
    backend = EmulatedBackend(delay=0.05)
    stream = backend.create_stream()
    dev = backend.alloc_device(4)
    backend.copy_to_device(dev, np.full(4, 3, np.uint8), stream)
    seen: list[list[int]] = []
    event = backend.launch(lambda: seen.append(dev.tolist()), stream)
    event.synchronize()
    assert seen == [[3, 3, 3, 3]]  # ran after the copy it depends on


def test_import_loads_neither_cupy_nor_an_image_decoder() -> None:
    import subprocess
    import sys

    code = (
        "import sys, blobpipe; "
        "assert 'cupy' not in sys.modules, 'cupy imported'; "
        "assert 'cv2' not in sys.modules, 'cv2 imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_testing_module_exports_the_emulated_device() -> None:
    import blobpipe.testing

    assert blobpipe.testing.EmulatedBackend is EmulatedBackend
    backend = blobpipe.testing.EmulatedBackend(delay=0.0)
    assert backend.has_device and backend.xp.float32 is np.float32
    made = backend.xp.zeros(3, np.float32)
    assert isinstance(made, blobpipe.testing.EmulatedArray) and made.device_id == 0
    assert type(made.get()) is np.ndarray


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_makes_its_backends_anew() -> None:
    """CUDA contexts and the emulated streams' threads do not survive fork: the child
    resolves names (and the default) to new backends, with new pools."""
    host = get_backend("cpu")
    emu = EmulatedBackend()
    old = set_default_backend(emu)
    try:

        def child() -> bool:
            fresh = get_backend("cpu")
            default = get_backend(None)
            return fresh is not host and default is not emu and get_backend("cpu") is fresh

        assert in_forked_child(child) == 0
        assert get_backend("cpu") is host and get_backend(None) is emu  # the parent's stay
    finally:
        set_default_backend(old)


# -- "cuda" and "auto" mean the calling thread's current device ----------------------------


def test_cuda_and_auto_resolve_to_the_threads_current_device() -> None:
    """As torch's ``"cuda"``: the device ``torch.cuda.set_device`` (here the emulated
    ``use_device``) made current in the calling thread, resolved when asked."""
    got: dict[str, tuple[int, int]] = {}

    def rank(k: int) -> None:  # a DDP rank's thread: set_device(k), then Loader(device="cuda")
        use_device(k)
        cuda, auto = get_backend("cuda"), get_backend("auto")
        assert isinstance(cuda, EmulatedBackend) and isinstance(auto, EmulatedBackend)
        got[f"rank {k}"] = (cuda.emulated_device, auto.emulated_device)

    with emulated_cuda(devices=2):
        threads = [threading.Thread(target=rank, args=(k,)) for k in (1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert get_backend("cuda:1") is get_backend("cuda:1")
    assert got == {"rank 0": (0, 0), "rank 1": (1, 1)}


def test_cuda_on_a_missing_device_is_unavailable() -> None:
    with emulated_cuda(devices=1):
        with pytest.raises(BackendUnavailableError, match=r"cuda:0 \.\. cuda:0"):
            get_backend("cuda:1")
        result: list[object] = []

        def other() -> None:
            use_device(3)
            result.append(get_backend("auto"))  # no such device: auto falls back

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert isinstance(result[0], HostBackend)


# -- worker threads never switch to a device they do not use ------------------------------------


def test_filler_threads_touch_only_the_loaders_device(tmp_path: Path) -> None:
    """A loader on device 1: every filler thread's device scopes (pinned and device
    allocations, the copies, the transform) find device 1 current. Without
    ``bind_thread`` CuPy's ``with Device(1)`` sets device 0 again on exit, which on
    CUDA 12 creates a context on device 0 in every thread. Modelled on the emulated
    device by recording each switch; the context's own cost is not."""
    db = raw_db(tmp_path / "db", 24)
    backend = EmulatedBackend(device_id=1)
    seen: dict[str, set[int]] = {}
    t = blobpipe.Transform(scale=0.5, mean_value=(1, 2, 3))
    with blobpipe.Loader(db, 4, device=backend, prefetch=4, workers=2, transform=t) as loader:
        for _, _batch in zip(range(8), loader, strict=False):
            for thread in threading.enumerate():
                if thread.name.startswith("blobpipe-filler-"):
                    seen[thread.name] = seen.get(thread.name, set()) | touched_devices(thread)
    assert seen and all(devices == {1} for devices in seen.values()), seen


def test_bind_thread_makes_the_device_current_for_good() -> None:
    backend = EmulatedBackend(device_id=1)

    def worker() -> None:
        backend.bind_thread()
        with backend.using(backend.create_stream()):
            pass
        out.append((current_device(), touched_devices()))

    out: list[tuple[int, set[int]]] = []
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert out == [(1, {1})]


# -- fork after CUDA -----------------------------------------------------------------------------


def test_a_child_forked_after_cuda_refuses_cuda_and_auto() -> None:
    """CUDA cannot be used in a child forked after CUDA was initialised: every CUDA
    name, ``"auto"`` too, raises a clear error there instead of making a backend (or
    falling back to the host unnoticed); the host backend still works."""
    with emulated_cuda(devices=1):
        get_backend("cuda")  # CUDA initialised in the parent

        def child() -> bool:
            for name in ("cuda", "cuda:0", "auto"):
                try:
                    get_backend(name)
                except BackendUnavailableError as exc:
                    if "forked after CUDA was initialised" not in str(exc):
                        return False
                else:
                    return False
            return isinstance(get_backend("cpu"), HostBackend)

        assert in_forked_child(child) == 0


def test_a_child_forked_before_cuda_may_use_it() -> None:
    with emulated_cuda(devices=1):

        def child() -> bool:
            return isinstance(get_backend("auto"), EmulatedBackend)

        assert in_forked_child(child) == 0


# -- the CuPy backend's logic, on a NumPy stand-in for CuPy --------------------------------------


@pytest.fixture(params=[14, 13], ids=["cupy14", "cupy13"])
def fake_cupy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``import cupy`` gives the stand-in (tests/_fake_cupy.py); no GPU involved."""
    cp = _fake_cupy.make(devices=2, version=request.param)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    previous = set_cuda_devices(CudaDevices())
    try:
        yield cp
    finally:
        set_cuda_devices(previous)
        _base._cuda_initialised.clear()  # no real CUDA was initialised


def test_cupy_wraps_foreign_streams_without_the_deprecated_class(fake_cupy: Any) -> None:
    """CuPy 14's ``ExternalStream`` warns at every construction (an error under
    ``-W error``): a torch stream or a raw handle goes through
    ``Stream.from_external``; CuPy 13 has only ``ExternalStream``."""
    from blobpipe._backends._cupy import CupyBackend

    backend = CupyBackend(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raw = backend.as_stream(0x5000)
        torch_like = backend.as_stream(types.SimpleNamespace(cuda_stream=0x6000))
    assert raw.raw.ptr == 0x5000 and torch_like.raw.ptr == 0x6000  # type: ignore[attr-defined]
    own = backend.create_stream()
    assert backend.as_stream(own) is own


def test_cupy_host_waits_use_blocking_sync_events(fake_cupy: Any) -> None:
    """Every event blobpipe records is ``Event(block=True)`` (the waiting thread
    sleeps); a stream's synchronize waits on such an event, not on
    ``cudaStreamSynchronize``, which spins."""
    from blobpipe._backends._cupy import CupyBackend

    backend = CupyBackend(0)
    stream = backend.create_stream()
    fake_cupy.log.clear()
    backend.record_event(stream).synchronize()
    backend.record_event(stream, timing=True)
    stream.synchronize()
    events = [e for e in fake_cupy.log if e[0] == "Event"]
    assert events == [("Event", True, True), ("Event", True, False), ("Event", True, True)]
    assert ("eventSynchronize", True) in fake_cupy.log
    assert not [e for e in fake_cupy.log if e[0] == "streamSynchronize"]


def test_cupy_only_out_of_memory_is_a_memory_error(fake_cupy: Any) -> None:
    from blobpipe._backends._cupy import CupyBackend

    backend = CupyBackend(0)
    runtime_error = fake_cupy.cuda.runtime.CUDARuntimeError
    for oom in (runtime_error(2), fake_cupy.cuda.memory.OutOfMemoryError("out of memory")):
        fake_cupy.state["fail"] = oom
        with pytest.raises(MemoryError, match="cannot allocate 64 bytes on cuda:0"):
            backend.alloc_device(64)
    fake_cupy.state["fail"] = runtime_error(700)  # cudaErrorIllegalAddress: not memory
    with pytest.raises(runtime_error) as info:
        backend.alloc_device(64)
    assert not isinstance(info.value, MemoryError)


def test_cupy_worker_thread_never_switches_to_device_0(fake_cupy: Any) -> None:
    """A filler thread of a ``cuda:1`` loader: ``bind_thread`` sets device 1 once;
    the device scopes after it (streams, events, allocations) set no other
    device. Without it CuPy's ``with Device(1)`` sets 0 again on exit: on CUDA 12
    a context on device 0 in every such thread."""
    from blobpipe._backends._cupy import CupyBackend

    backend = CupyBackend(1)

    def filler() -> None:
        backend.bind_thread()
        stream = backend.create_stream()
        backend.record_event(stream)
        backend.alloc_device(16)
        with backend.using(stream):
            pass

    t = threading.Thread(target=filler, name="filler")
    t.start()
    t.join()
    devices = {e[2] for e in fake_cupy.log if e[0] == "setDevice" and e[1] == "filler"}
    assert devices == {1}


def test_cupy_device_export_holds_its_owner(fake_cupy: Any) -> None:
    """``hold_device`` exports an array over ``UnownedMemory`` whose owner is
    blobpipe's reference: CuPy's DLPack capsule keeps the array, hence the owner."""
    from blobpipe._backends._cupy import CupyBackend

    backend = CupyBackend(1)
    view = backend.alloc_device(64)
    owner = object()
    held = backend.hold_device(view, owner)
    assert held.data.mem._owner is owner
    assert held.data.ptr == view.data.ptr and held.data.mem.device_id == 1
    assert held.shape == view.shape and held.nbytes == 64


def test_cupy_dlpack_stream_values(fake_cupy: Any) -> None:
    """DLPack's ``stream``: None and 1 the legacy default stream, 2 the per-thread
    one, -1 no ordering, 0 (torch's old default) as 1, others a handle."""
    from blobpipe._backends._cupy import CupyBackend

    backend = CupyBackend(0)
    assert backend.dlpack_stream(-1) is None
    for value, ptr in ((None, 1), (0, 1), (1, 1), (2, 2), (0x7000, 0x7000)):
        stream = backend.dlpack_stream(value)
        assert stream is not None and stream.raw.ptr == ptr  # type: ignore[attr-defined]


def test_cupy_records_another_threads_per_thread_default_stream_on_the_legacy_one(
    fake_cupy: Any,
) -> None:
    """Handle 2 (a DLPack consumer's, ``Stream.ptds``, a current per-thread default
    stream) names the calling thread's stream: recorded from another thread (a batch
    let go in a collection or a DLPack deleter) it would name that thread's. There
    blobpipe records on the legacy default stream (1), which waits for every
    per-thread one; in the naming thread on 2 itself."""
    from blobpipe._backends._cupy import CupyBackend

    backend = CupyBackend(0)
    for ptds in (backend.dlpack_stream(2), backend.as_stream(0x2)):
        assert ptds is not None
        fake_cupy.log.clear()
        elsewhere = threading.Thread(target=lambda s=ptds: backend.record_event(s))
        elsewhere.start()
        elsewhere.join()
        backend.record_event(ptds)
        assert [e for e in fake_cupy.log if e[0] == "eventRecord"] == [
            ("eventRecord", 1),
            ("eventRecord", 2),
        ]
        assert not ptds.same(backend.current_stream())


class _TorchStream:
    """What blobpipe reads of a ``torch.cuda.Stream``: its handle and its device."""

    def __init__(self, handle: int, device: int) -> None:
        self.cuda_stream = handle
        self.device = types.SimpleNamespace(type="cuda", index=device)


def test_cupy_refuses_a_stream_of_another_device(fake_cupy: Any) -> None:
    """A cuda:0 stream given to a cuda:1 backend (``Loader(stream=)``, a DLPack
    consumer's) fails at once, not at its first event (invalid resource handle)."""
    from blobpipe._backends._cupy import CupyBackend

    backend = CupyBackend(1)
    with fake_cupy.cuda.Device(0):
        zero = fake_cupy.cuda.Stream(non_blocking=True)
    with fake_cupy.cuda.Device(1):
        one = fake_cupy.cuda.Stream(non_blocking=True)
    foreign = [zero, int(zero.ptr), _TorchStream(0x6000, 0), CupyBackend(0).create_stream()]
    for stream in foreign:
        with pytest.raises(ArgumentError, match=r"this backend is cuda:1|than cuda:1's"):
            backend.as_stream(stream)
    for stream in (one, int(one.ptr), _TorchStream(0x6001, 1), 1, 2):
        assert backend.as_stream(stream) is not None


def test_cupy_keeps_a_foreign_stream_object_alive(fake_cupy: Any) -> None:
    """A torch stream given as ``Loader(stream=)`` stays alive while blobpipe's
    Stream over its handle does (blobpipe records events on it later)."""
    from blobpipe._backends._cupy import CupyBackend

    backend = CupyBackend(0)
    torch_stream = _TorchStream(0x6000, 0)
    alive = weakref.ref(torch_stream)
    stream = backend.as_stream(torch_stream)
    del torch_stream
    gc.collect()
    assert alive() is not None
    del stream
    gc.collect()
    assert alive() is None


def test_cupy_set_gpu_data_checks_the_device(fake_cupy: Any) -> None:
    from blobpipe._backends._cupy import CupyBackend

    one, zero = CupyBackend(1), CupyBackend(0)
    one.check_device_array(one.alloc_device(8), "set_gpu_data")
    with pytest.raises(UnsupportedOperationError, match="on cuda:0, this blob lives on cuda:1"):
        one.check_device_array(zero.alloc_device(8), "set_gpu_data")
    with pytest.raises(UnsupportedOperationError, match="got ndarray"):
        one.check_device_array(np.zeros(8, np.uint8), "set_gpu_data")


def test_cuda_means_cupys_current_device(fake_cupy: Any) -> None:
    """``"cuda"`` and ``"auto"``: CuPy's current device of the calling thread."""
    got: list[tuple[int | None, int | None]] = []

    def rank() -> None:
        fake_cupy.cuda.runtime.setDevice(1)  # torch.cuda.set_device(1)
        got.append((get_backend("cuda").device_id, get_backend("auto").device_id))

    t = threading.Thread(target=rank)
    t.start()
    t.join()
    assert got == [(1, 1)]
    assert get_backend("cuda").device_id == 0  # this thread's current device


def test_a_child_torch_marks_as_forked_after_cuda_refuses_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA initialised by torch alone before the fork: torch marks the child (its
    ``_is_in_bad_fork``), and ``"auto"`` there is the same clear error."""
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(_is_in_bad_fork=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    with pytest.raises(BackendUnavailableError, match="forked after CUDA was initialised"):
        get_backend("auto")
    assert isinstance(get_backend("cpu"), HostBackend)
