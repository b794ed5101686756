"""Test helpers for code that uses blobpipe: an emulated GPU for CPU-only CI.

``EmulatedBackend(delay=...)`` behaves like a CUDA device: device memory is
separate host memory, each stream is a worker thread that performs its copies
later (after ``delay`` seconds), and an event completes only once its copy has
landed. Code that forgets to wait for an event reads stale bytes, so the bug
shows up as wrong data without a GPU::

    from blobpipe.testing import EmulatedBackend

    device = EmulatedBackend(delay=0.01)
    async with blobpipe.Loader("train_lmdb", batch_size=64, device=device) as loader:
        async for batch in loader:
            batch.data.gpu_data()      # a NumPy array standing in for device memory

Its ``xp`` is NumPy (arrays it makes are :class:`EmulatedArray` s of the current
emulated device), so device-side code written against ``backend.xp`` runs
unchanged; ``statistics()`` counts host→device and device→host copies.
``run_later(fn, seconds)`` queues consumer-side work on the current stream to
run late, and ``EmulatedBackend(device_id=1)`` is a second device that refuses
memory of the first (see ``blobpipe._backends._emulated``).

``with emulated_cuda(devices=2):`` makes the CUDA device names resolve to
emulated devices: ``"cuda:N"`` is ``EmulatedBackend(device_id=N)`` and
``"cuda"``/``"auto"`` the calling thread's current emulated device
(:func:`use_device` sets it, as ``torch.cuda.set_device`` does);
:func:`touched_devices` tells which devices a thread switched to (on CUDA 12, the
devices it created a context on).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ._backends import Backend, CudaDevices, set_cuda_devices
from ._backends import EmulatedBackend as EmulatedBackend
from ._backends._emulated import EmulatedArray as EmulatedArray
from ._backends._emulated import EmulatedEvent as EmulatedEvent
from ._backends._emulated import EmulatedStream as EmulatedStream
from ._backends._emulated import current_device as current_device
from ._backends._emulated import touched_devices as touched_devices
from ._backends._emulated import use_device as use_device
from ._errors import BackendUnavailableError

__all__ = [
    "EmulatedArray",
    "EmulatedBackend",
    "EmulatedCuda",
    "EmulatedEvent",
    "EmulatedStream",
    "current_device",
    "emulated_cuda",
    "touched_devices",
    "use_device",
]


class EmulatedCuda(CudaDevices):
    """CUDA device names resolved to ``devices`` emulated devices (see module doc)."""

    def __init__(self, devices: int = 2, delay: float = 0.0) -> None:
        self.devices = int(devices)
        self.delay = float(delay)
        self.made: list[EmulatedBackend] = []
        self._lock = threading.Lock()

    def current(self) -> int:
        return current_device()

    def make(self, device_id: int) -> Backend:
        if not 0 <= device_id < self.devices:
            raise BackendUnavailableError(
                f"CUDA device {device_id} requested, but this machine has {self.devices} "
                f"(emulated; valid: cuda:0 .. cuda:{self.devices - 1})."
            )
        backend = EmulatedBackend(self.delay, device_id=device_id)
        with self._lock:
            self.made.append(backend)
        return backend

    def initialised(self) -> bool:
        with self._lock:
            return bool(self.made)


@contextlib.contextmanager
def emulated_cuda(devices: int = 2, delay: float = 0.0) -> Iterator[EmulatedCuda]:
    """Inside the block, ``"cuda"``, ``"cuda:N"`` and ``"auto"`` name emulated
    devices (``devices`` of them); the real CUDA names come back after it."""
    emulated = EmulatedCuda(devices, delay)
    previous = set_cuda_devices(emulated)
    try:
        yield emulated
    finally:
        set_cuda_devices(previous)
