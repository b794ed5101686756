"""Backend selection and the emulated device."""

from __future__ import annotations

import os

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
from tests._helpers import in_forked_child


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
