"""``bench``: how fast the loader delivers batches from the user's own database.

It times the batch source of :mod:`._batchsource` (today the synchronous
pass, later the async ``Loader``): a few warm-up batches are not counted, then
batches are drawn, epoch after epoch, until ``seconds`` have passed or
``batches`` were delivered.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._errors import DataError
from .._io._transform import Transform
from ._batchsource import iter_batches
from ._progress import Progress

__all__ = ["BenchResult", "bench"]


@dataclass(frozen=True)
class BenchResult:
    """Timed batches and records, seconds, and the rates they give (MB = 10**6 bytes of output)."""

    batches: int
    records: int
    seconds: float
    bytes: int
    first_batch_s: float

    @property
    def records_per_s(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with the counts and the rates."""
        return {
            "batches": self.batches,
            "records": self.records,
            "seconds": self.seconds,
            "bytes": self.bytes,
            "first_batch_s": self.first_batch_s,
            "records_per_s": self.records_per_s,
            "batches_per_s": self.batches_per_s,
            "mb_per_s": self.mb_per_s,
        }


def bench(
    db: str | os.PathLike[str],
    *,
    batch_size: int = 64,
    transform: Transform | None = None,
    seconds: float | None = 5.0,
    batches: int | None = None,
    warmup: int = 2,
    quiet: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> BenchResult:
    """Time the loader on ``db``: stop after ``batches`` timed batches or ``seconds``.

    Raises :class:`DatabaseNotFoundError`, :class:`DataError` (unreadable or
    mixed-shape records, an empty database) and :class:`ValueError` for bad options.
    """
    if seconds is None and batches is None:
        raise ValueError("give seconds or batches (or both) to bound the benchmark")
    if seconds is not None and seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if batches is not None and batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    start = clock()
    first_batch_s = -1.0
    timed_start = 0.0
    n_batches = n_records = n_bytes = 0
    seen = 0
    with Progress(batches, "bench", unit="batches", quiet=quiet) as bar:
        while True:
            got_any = False
            for batch in iter_batches(db, batch_size=batch_size, transform=transform):
                got_any = True
                now = clock()
                if first_batch_s < 0:
                    first_batch_s = now - start
                seen += 1
                if seen <= warmup:
                    timed_start = now
                    continue
                if n_batches == 0 and warmup == 0:
                    timed_start = start
                n_batches += 1
                n_records += int(batch.data.shape[0])
                n_bytes += int(batch.data.nbytes)
                bar.advance()
                if batches is not None and n_batches >= batches:
                    break
                if seconds is not None and now - timed_start >= seconds:
                    break
            else:
                if not got_any:
                    raise DataError("database is empty; nothing to benchmark", path=db)
                continue
            break
    return BenchResult(
        batches=n_batches,
        records=n_records,
        seconds=clock() - timed_start,
        bytes=n_bytes,
        first_batch_s=first_batch_s,
    )
