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
"""

from __future__ import annotations

from ._backends import EmulatedBackend as EmulatedBackend
from ._backends._emulated import EmulatedArray as EmulatedArray
from ._backends._emulated import EmulatedEvent as EmulatedEvent
from ._backends._emulated import EmulatedStream as EmulatedStream

__all__ = ["EmulatedArray", "EmulatedBackend", "EmulatedEvent", "EmulatedStream"]
