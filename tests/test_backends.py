"""Backend selection and the emulated device."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

import blobpipe
from blobpipe import BackendUnavailableError
from blobpipe._backends import (
    COMPLETED,
    EmulatedBackend,
    HostBackend,
    get_backend,
    set_default_backend,
    wait_event,
)
from blobpipe.testing import current_device, emulated_cuda, touched_devices, use_device
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


# -- "cuda" and "auto" mean the calling thread's current device (issue 20, finding 4) -------------


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


# -- worker threads never switch to a device they do not use (finding 5) --------------------------


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


# -- fork (finding 7) -----------------------------------------------------------------------------


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
