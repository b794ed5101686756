"""A Loader's statistics: :class:`LoaderStatistics` and the counters behind it.

The fillers add fill times from their threads and the consumer adds each
delivered batch; :meth:`Counters.snapshot` reads all of them under the one lock,
so a snapshot is consistent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .._backends import Backend
from .._pool import PoolStatistics, get_pool

__all__ = ["Counters", "LoaderStatistics"]


@dataclass(frozen=True)
class LoaderStatistics:
    """A snapshot of a :class:`Loader` (see :meth:`Loader.statistics`).

    Attributes:
        batches: batches delivered to the consumer.
        records: records in those batches (padding rows excluded).
        wait_time: seconds the consumer spent waiting for a batch (starvation).
        decode_time: seconds worker threads spent reading, decoding and
            transforming records (summed over threads).
        copy_time: seconds host→device copies (and device transforms) were in
            flight, from issue to completion, summed over batches.
        pool: the host pool's statistics (pinned memory on CUDA).
        device_pool: the device pool's statistics (None without a device).
        slots: batch slots in the ring for the fillers and the caller's batch:
            ``prefetch``, or more while batches are small (handed over a chunk at a
            time: at most ``3 * 16 + 1`` slots, see the Loader's ``prefetch``). The
            ring has one slot more for the previous batch while the next is asked
            for, and one more for each further batch the caller keeps.
        held_batches: batches the caller still references (the batch, its Blobs,
            an array or export taken from them); their memory is not reused.
        held_bytes: bytes of host and device memory those batches hold.
    """

    batches: int
    records: int
    wait_time: float
    decode_time: float
    copy_time: float
    pool: PoolStatistics
    device_pool: PoolStatistics | None
    slots: int = 0
    held_batches: int = 0
    held_bytes: int = 0


class Counters:
    """The running totals of one pipeline; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches = 0
        self._records = 0
        self._wait_time = 0.0
        self._decode_time = 0.0
        self._copy_time = 0.0

    def filled(self, seconds: float) -> None:
        """Batches were filled (or failed filling) in ``seconds``."""
        with self._lock:
            self._decode_time += seconds

    def waited(self, seconds: float) -> None:
        """The consumer waited ``seconds`` for what it got instead of a batch."""
        with self._lock:
            self._wait_time += seconds

    def delivered(self, records: int, wait: float, copy: float) -> None:
        """A batch of ``records`` real rows was handed out after the consumer waited
        ``wait`` seconds for it and its device work ran ``copy`` seconds."""
        with self._lock:
            self._copy_time += copy
            self._wait_time += wait
            self._batches += 1
            self._records += records

    def snapshot(
        self, backend: Backend, slots: int, held_batches: int = 0, held_bytes: int = 0
    ) -> LoaderStatistics:
        """The totals so far, with ``backend``'s pools' statistics, the ring's
        ``slots`` and the batches the caller holds."""
        with self._lock:
            return LoaderStatistics(
                batches=self._batches,
                records=self._records,
                wait_time=self._wait_time,
                decode_time=self._decode_time,
                copy_time=self._copy_time,
                pool=get_pool(backend, "host").statistics(),
                device_pool=(
                    get_pool(backend, "device").statistics() if backend.has_device else None
                ),
                slots=slots,
                held_batches=held_batches,
                held_bytes=held_bytes,
            )
