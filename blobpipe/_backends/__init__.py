"""Device backends behind one narrow interface (see ``_base``).

Which backend a name means is decided when it is first asked for, never at
import: ``"auto"`` tries CUDA through CuPy and falls back to the host.
"""

from __future__ import annotations

import os
import threading

from .._errors import ArgumentError, ArgumentTypeError, BackendUnavailableError
from ._base import COMPLETED, Backend, BackendStatistics, CompletedEvent, Event, Stream, wait_event
from ._emulated import EmulatedBackend
from ._host import HostBackend

__all__ = [
    "COMPLETED",
    "Backend",
    "BackendStatistics",
    "CompletedEvent",
    "EmulatedBackend",
    "Event",
    "HostBackend",
    "Stream",
    "get_backend",
    "get_default_backend",
    "set_default_backend",
    "wait_event",
]

_lock = threading.Lock()
_cache: dict[str, Backend] = {}
_default: Backend | None = None


def _forget_in_child() -> None:
    """After fork, in the child: a CUDA context and the emulated streams' threads
    do not survive a fork, so the backends (and the pools on them) are made anew
    on first use."""
    global _lock, _default
    _lock = threading.Lock()
    _cache.clear()
    _default = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _cuda_backend(device_id: int) -> Backend:
    from ._cupy import CupyBackend

    return CupyBackend(device_id)


def get_backend(device: str | Backend | None = None) -> Backend:
    """The backend for a device name.

    ``device`` is ``"auto"`` (CUDA when CuPy sees a GPU, else host), ``"cpu"``
    (or ``"host"``), ``"cuda"``, ``"cuda:N"``, a Backend instance (returned as
    is), or None for the default backend (see :func:`set_default_backend`;
    ``BLOBPIPE_DEVICE`` sets it from the environment, else ``"auto"``).

    Raises BackendUnavailableError for ``"cuda"`` without CuPy or a GPU, and
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
            raise ArgumentError(f"the environment's BLOBPIPE_DEVICE={named!r}: {exc}") from exc
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
        name = "cuda:0"
    with _lock:
        cached = _cache.get(name)
    if cached is not None:
        return cached
    if name == "cpu":
        backend = HostBackend()
    elif name == "auto":
        try:
            backend = get_backend("cuda:0")
        except BackendUnavailableError:
            backend = get_backend("cpu")
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
