"""The GIL budget: how much of a process's CPU time needs the GIL.

Threads share one GIL. Work that releases it (the compiled row kernel, the JPEG and
PNG decoders: ``_rowkernel.c``, ``_jpegwindow.c``, ``_pngrows.c``) runs on as many
cores as there are threads; everything else (planning, fill bookkeeping, the hand-off,
the consumer's iteration, NumPy calls, page faults taken while holding the GIL) runs
one thread at a time. With ``s`` the share of the CPU time that holds the GIL, N
workers can go at most ``1 / (s + (1 - s) / N)`` times as fast as one (Amdahl), and
never more than ``1 / s``.

:func:`measure` counts, around a block of code, the process's CPU time (every thread)
and the CPU time the compiled modules spent without the GIL (each GIL-free section
reads its thread's CPU clock when counting is on: ``free_cpu`` in ``_kernel.h``). The
difference is counted as holding the GIL: an upper bound, since GIL-free work outside
the compiled modules (NumPy's copies, OpenCV's decoder, the kernel's read-ahead
threads) is counted with it. Meant for benchmarks: it counts the whole process,
so the block should be the only work running. A compiled call still running when
the block ends is counted up to the end (its thread's clock read from here); one
already running when it starts is not counted at all, so start from an idle process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ._image import compiled_modules
from ._kernels import row_kernel

__all__ = ["Budget", "measure"]


@dataclass
class Budget:
    """What a block of code cost: ``wall`` seconds, ``cpu`` seconds of CPU time (every
    thread of the process), ``free`` of them without the GIL in the compiled modules."""

    wall: float = 0.0
    cpu: float = 0.0
    free: float = 0.0

    @property
    def held(self) -> float:
        """CPU seconds counted as holding the GIL (everything but ``free``)."""
        return max(self.cpu - self.free, 0.0)

    @property
    def serial(self) -> float:
        """The share of the CPU time that holds the GIL: Amdahl's serial fraction."""
        return self.held / self.cpu if self.cpu > 0 else 1.0

    @property
    def busy(self) -> float:
        """The share of the wall time the GIL was held (near 1: the GIL is the limit)."""
        return self.held / self.wall if self.wall > 0 else 0.0

    def bound(self, workers: float = float("inf")) -> float:
        """The speed-up over one thread that ``workers`` threads can reach at most."""
        s = self.serial
        return 1.0 / (s + (1.0 - s) / workers) if workers != float("inf") else 1.0 / max(s, 1e-9)


_lock = threading.Lock()
_counting = 0  # blocks being measured now (counting is on while any is)


def _modules() -> list[Any]:
    return [m for m in (row_kernel(), *compiled_modules()) if m is not None]


def _free_ns(on: bool) -> int:
    return sum(int(m.free_cpu(on)) for m in _modules())


@contextlib.contextmanager
def measure() -> Iterator[Budget]:
    """Measure the block's :class:`Budget` (filled in when the block ends)."""
    global _counting
    budget = Budget()
    with _lock:
        _counting += 1
        free0 = _free_ns(True)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    try:
        yield budget
    finally:
        # the GIL-free time first (the sections still running counted up to now), then
        # the clocks: what runs in between counts in the process's CPU time alone
        with _lock:
            _counting -= 1
            free1 = _free_ns(_counting > 0)
        budget.cpu = time.process_time() - cpu0
        budget.wall = time.perf_counter() - wall0
        budget.free = (free1 - free0) / 1e9
