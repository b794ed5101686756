"""Device backends behind one narrow interface (see ``_base``).

Which backend a name means is decided when it is asked for, never at import:
``"cuda"`` is the calling thread's current CUDA device (what
``torch.cuda.set_device`` or ``cupy.cuda.Device(n).use()`` set, as torch's
``"cuda"``), ``"auto"`` that device when CuPy sees a GPU, else the host.

A process forked after CUDA was initialised in its parent cannot use CUDA:
there every CUDA name, ``"auto"`` included, raises BackendUnavailableError
instead of making a backend (or falling back to the host unnoticed).
"""

from __future__ import annotations

import os
import sys
import threading

from .._errors import ArgumentError, ArgumentTypeError, BackendUnavailableError
from ._base import (
    COMPLETED,
    Backend,
    BackendStatistics,
    CompletedEvent,
    Event,
    EventGroup,
    Stream,
    all_of,
    cuda_initialised,
    finished,
    wait_event,
)
from ._emulated import EmulatedBackend
from ._host import HostBackend

__all__ = [
    "COMPLETED",
    "Backend",
    "BackendStatistics",
    "CompletedEvent",
    "CudaDevices",
    "EmulatedBackend",
    "Event",
    "EventGroup",
    "HostBackend",
    "Stream",
    "all_of",
    "finished",
    "get_backend",
    "get_default_backend",
    "set_cuda_devices",
    "set_default_backend",
    "wait_event",
]

_lock = threading.Lock()
_cache: dict[str, Backend] = {}
_default: Backend | None = None
_forked_after_cuda = False  # this process was forked after its parent used CUDA

_FORK_ERROR = (
    "this process was forked after CUDA was initialised in its parent, and CUDA cannot "
    "be used in such a child. Start workers with the 'spawn' or 'forkserver' method "
    "(multiprocessing.set_start_method('spawn'); torchrun and mp.spawn do), or fork "
    "before the parent uses CUDA; device='cpu' works in the child."
)


def _forget_in_child() -> None:
    """After fork, in the child: the emulated streams' threads do not survive a
    fork, so the backends (and the pools on them) are made anew on first use;
    CUDA does not work at all in a child forked after CUDA was initialised."""
    global _lock, _default, _forked_after_cuda
    _lock = threading.Lock()
    _cache.clear()
    _default = None
    if _cuda.initialised() or cuda_initialised():
        _forked_after_cuda = True


class CudaDevices:
    """What the CUDA device names mean: CuPy's devices (this class), or a test
    double (``blobpipe.testing.emulated_cuda``) with the same two methods."""

    def current(self) -> int:
        """The calling thread's current CUDA device.

        Raises BackendUnavailableError without CuPy or a usable driver.
        """
        from ._cupy import import_cupy

        cp = import_cupy()
        try:
            return int(cp.cuda.runtime.getDevice())
        except Exception as exc:  # no driver, no device
            raise BackendUnavailableError(
                f"CuPy is installed but CUDA is not usable here ({exc}). Use device='cpu'."
            ) from exc

    def make(self, device_id: int) -> Backend:
        """A backend for device ``device_id``."""
        from ._cupy import CupyBackend

        return CupyBackend(device_id)

    def initialised(self) -> bool:
        """Whether CUDA was initialised in this process (checked at fork)."""
        return cuda_initialised()


_cuda: CudaDevices = CudaDevices()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def set_cuda_devices(devices: CudaDevices) -> CudaDevices:
    """Make the CUDA names (``"cuda"``, ``"cuda:N"``, ``"auto"``) resolve through
    ``devices``; forget the backends resolved so far. Returns the previous one."""
    global _cuda, _default
    with _lock:
        previous, _cuda = _cuda, devices
        _cache.clear()
        _default = None
    return previous


def _in_bad_fork() -> bool:
    """Whether this process is a child forked after CUDA was initialised: by blobpipe
    (a CUDA backend existed at the fork), or by torch (which marks such children)."""
    if _forked_after_cuda:
        return True
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda._is_in_bad_fork())
    except Exception:  # another torch, or none usable: blobpipe's own flag decides
        return False


def _cuda_backend(device_id: int) -> Backend:
    if _in_bad_fork():
        raise BackendUnavailableError(_FORK_ERROR)
    return _cuda.make(device_id)


def _current_cuda() -> str:
    if _in_bad_fork():
        raise BackendUnavailableError(_FORK_ERROR)
    return f"cuda:{_cuda.current()}"


def get_backend(device: str | Backend | None = None) -> Backend:
    """The backend for a device name.

    ``device`` is ``"auto"`` (the current CUDA device when CuPy sees a GPU,
    else host), ``"cpu"`` (or ``"host"``), ``"cuda"`` (the calling thread's
    current CUDA device, as in torch), ``"cuda:N"``, a Backend instance
    (returned as is), or None for the default backend (see
    :func:`set_default_backend`; ``BLOBPIPE_DEVICE`` sets it from the
    environment, else ``"auto"``; resolved once, by the first caller).

    Raises BackendUnavailableError for ``"cuda"`` without CuPy or a GPU, and for
    any CUDA name (``"auto"`` too) in a child forked after CUDA was initialised;
    ArgumentError (a ValueError) for an unknown name.
    """
    global _default
    if isinstance(device, Backend):
        return device
    if device is None:
        with _lock:
            if _default is not None:
                return _default
        named = os.environ.get("BLOBPIPE_DEVICE", "auto")
        try:
            backend = get_backend(named)
        except ArgumentError as exc:
            raise ArgumentError(f"{exc} (the environment's BLOBPIPE_DEVICE={named!r})") from exc
        with _lock:
            if _default is None:
                _default = backend
            return _default
    if not isinstance(device, str):
        raise ArgumentTypeError(f"device must be a str or a Backend, got {type(device).__name__}")
    name = device.strip().lower()
    if name == "host":
        name = "cpu"
    if name == "cuda":
        name = _current_cuda()
    with _lock:
        cached = _cache.get(name)
    if cached is not None:
        return cached
    if name == "cpu":
        backend = HostBackend()
    elif name == "auto":
        if _in_bad_fork():
            raise BackendUnavailableError(_FORK_ERROR)
        try:
            return get_backend(_current_cuda())
        except BackendUnavailableError:
            return get_backend("cpu")
    elif name.startswith("cuda:"):
        try:
            idx = int(name[5:])
        except ValueError:
            raise ArgumentError(
                f"bad device {device!r}: expected 'cuda:N' with N an integer"
            ) from None
        if idx < 0:
            raise ArgumentError(f"bad device {device!r}: the device number must be >= 0")
        backend = _cuda_backend(idx)
    else:
        raise ArgumentError(
            f"unknown device {device!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'"
        )
    with _lock:
        return _cache.setdefault(name, backend)


def get_default_backend() -> Backend:
    """The backend used when none is given (resolved on first use)."""
    return get_backend(None)


def set_default_backend(device: str | Backend | None) -> Backend | None:
    """Set the default backend; returns the previous one (None when unresolved).

    ``None`` resets it so the next use resolves ``BLOBPIPE_DEVICE``/``"auto"`` again.
    """
    global _default
    new = get_backend(device) if device is not None else None
    with _lock:
        old, _default = _default, new
    return old
