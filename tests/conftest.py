"""Shared fixtures: backends parametrised over the emulated device and CUDA.

Tests that take the ``device_backend`` fixture run against the emulated device
(always) and against CuPy (marked ``gpu``; skipped without a GPU unless
``BLOBPIPE_REQUIRE_GPU=1``, which turns the skip into a failure).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from blobpipe._backends import Backend, EmulatedBackend, HostBackend

DATA = Path(__file__).parent / "data"
CAFFE = DATA / "caffe"


def require_gpu() -> bool:
    return os.environ.get("BLOBPIPE_REQUIRE_GPU", "") not in ("", "0")


def cupy_backend_or_skip() -> Backend:
    try:
        from blobpipe._backends._cupy import CupyBackend

        return CupyBackend(0)
    except Exception as exc:  # BackendUnavailableError and anything CuPy raises
        if require_gpu():
            pytest.fail(f"BLOBPIPE_REQUIRE_GPU=1 but CUDA is unavailable: {exc}")
        pytest.skip(f"no CUDA: {exc}")


@pytest.fixture(
    params=["emulated", pytest.param("cupy", marks=pytest.mark.gpu)],
)
def device_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """A backend with device memory: the emulated device, or real CUDA."""
    if request.param == "emulated":
        backend: Backend = EmulatedBackend(delay=0.002)
    else:
        backend = cupy_backend_or_skip()
    yield backend
    backend.synchronize()


@pytest.fixture(
    params=["host", "emulated", pytest.param("cupy", marks=pytest.mark.gpu)],
)
def any_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Every backend: host (no device), emulated device, real CUDA."""
    if request.param == "host":
        backend: Backend = HostBackend()
    elif request.param == "emulated":
        backend = EmulatedBackend(delay=0.002)
    else:
        backend = cupy_backend_or_skip()
    yield backend
    backend.synchronize()


def make_backend(name: str) -> Backend:
    """A fresh backend (fresh pools, so their counters belong to the test)."""
    if name == "host":
        return HostBackend()
    if name == "emulated":
        return EmulatedBackend(delay=0.001)
    return cupy_backend_or_skip()


# -- LMDBs shared by test modules -----------------------------------------------------------------

# Caffe's reference batches (tests/data/caffe/ref): case name → (database, Transform kwargs).
REF_CASES = {
    "raw_color_b8": ("raw_color", {}),
    "raw_color_b8_meanfile_scale": (
        "raw_color",
        {"scale": 0.017, "mean_file": CAFFE / "raw_color_mean.binaryproto"},
    ),
    "raw_color_b8_meanvalue_crop24": (
        "raw_color",
        {"crop_size": 24, "mean_value": (104, 117, 123)},
    ),
    "encoded_jpg_b8": ("encoded_jpg", {}),
}


@pytest.fixture(params=["compiled", "numpy"])
def row_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Raw rows through the compiled row kernel (skipped where it was not built) and
    through NumPy's path (the kernel taken away)."""
    from blobpipe._io import _kernels

    if request.param == "numpy":
        monkeypatch.setattr(_kernels, "_rowkernel", None)
    elif _kernels.row_kernel() is None:
        pytest.skip("the compiled row kernel was not built (no C compiler at install)")
    return str(request.param)


@pytest.fixture
def db30(tmp_path: Path) -> Path:
    """30 raw 3x10x12 records; record i has label i."""
    from tests._helpers import raw_db

    return raw_db(tmp_path / "db30", 30)


def to_numpy(array: object) -> object:
    """A host copy of a numpy or cupy array."""
    get = getattr(array, "get", None)
    return get() if callable(get) else array


_CREATED_CACHE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """Persistent LMDB indexes go to a temporary cache, not the user's, for the whole
    session: set before any test module is imported, so subprocesses started with a
    copy of the environment inherit it too."""
    folder = tempfile.mkdtemp(prefix="blobpipe-index-cache-")
    _CREATED_CACHE.append(folder)
    os.environ["BLOBPIPE_CACHE_DIR"] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _CREATED_CACHE:
        if os.environ.get("BLOBPIPE_CACHE_DIR") == folder:
            del os.environ["BLOBPIPE_CACHE_DIR"]
        shutil.rmtree(folder, ignore_errors=True)
    _CREATED_CACHE.clear()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run ``@pytest.mark.anyio`` tests under both asyncio and trio."""
    return str(request.param)


# -- the skips, summarised -----------------------------------------------------------------------


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per skip reason, with its count (``-ra`` would list every skip).

    ``addopts`` reports failures and errors one by one (``-rfE``); pytest's own
    closing line (``N passed, N skipped``) follows this section.
    """
    reasons = Counter(_skip_reason(r) for r in terminalreporter.stats.get("skipped", []))
    if not reasons:
        return
    terminalreporter.section("skips by reason", sep="-")
    for reason, count in reasons.most_common():
        terminalreporter.line(f"{count} skipped: {reason}")
