"""``bench``: how fast the loader delivers batches from the user's own database.

:func:`time_batches` times any iterable of batches: a few warm-up batches are
not counted, then batches are drawn until ``seconds`` have passed,
``batches`` were delivered or the iterable ends. :func:`bench` feeds it the
batches of :func:`_endless_batches`, the one place that says what is timed
(the :class:`~blobpipe.Loader`, in its blocking form).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .._errors import DataError
from .._io._transform import Transform
from ._progress import Progress

__all__ = ["BenchResult", "bench", "time_batches"]


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


@contextmanager
def _endless_batches(
    db: str | os.PathLike[str],
    *,
    batch_size: int,
    transform: Transform | None,
    device: str = "auto",
    workers: int | None = None,
) -> Iterator[Iterable[Any]]:
    """The batches ``bench`` times: the :class:`~blobpipe.Loader` in the TEST phase,
    key order, Caffe's wrap-around mode (endless), on ``device``."""
    from .._loader import Loader  # the CLI layer sits above the loader

    with Loader(
        db,
        batch_size=batch_size,
        transform=transform,
        phase="test",
        device=device,
        workers=workers,
    ) as loader:
        yield loader


def _check_bounds(seconds: float | None, batches: int | None, warmup: int) -> None:
    if seconds is None and batches is None:
        raise ValueError("give seconds or batches (or both) to bound the benchmark")
    if seconds is not None and seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if batches is not None and batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")


def time_batches(
    source: Iterable[Any],
    *,
    seconds: float | None = 5.0,
    batches: int | None = None,
    warmup: int = 2,
    quiet: bool = True,
    clock: Callable[[], float] = time.perf_counter,
    start: float | None = None,
) -> BenchResult:
    """Time the batches of ``source``: stop after ``batches`` timed ones, ``seconds``, or its end.

    A batch is anything whose ``data`` has ``shape`` and ``nbytes`` (a numpy
    array or a :class:`~blobpipe.Blob`); a batch counts as delivered when
    ``source`` yields it. ``start`` (a ``clock()`` reading, default now) is when
    the source began to be made: ``first_batch_s`` is measured from it.

    Raises :class:`ValueError` for bad options and :class:`DataError` when
    ``source`` yields no batch.
    """
    _check_bounds(seconds, batches, warmup)
    if start is None:
        start = clock()
    first_batch_s = -1.0
    timed_start = start
    n_batches = n_records = n_bytes = 0
    seen = 0
    with Progress(batches, "bench", unit="batches", quiet=quiet) as bar:
        for batch in source:
            now = clock()
            if first_batch_s < 0:
                first_batch_s = now - start
            seen += 1
            if seen <= warmup:
                timed_start = now
                continue
            n_batches += 1
            n_records += int(batch.data.shape[0])
            n_bytes += int(batch.data.nbytes)
            bar.advance()
            if batches is not None and n_batches >= batches:
                break
            if seconds is not None and now - timed_start >= seconds:
                break
    if not seen:
        raise DataError("the source gave no batches; nothing to benchmark")
    return BenchResult(
        batches=n_batches,
        records=n_records,
        seconds=clock() - timed_start,
        bytes=n_bytes,
        first_batch_s=first_batch_s,
    )


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
    device: str = "auto",
    workers: int | None = None,
) -> BenchResult:
    """Time the loader on ``db``: stop after ``batches`` timed batches or ``seconds``.

    Raises :class:`DatabaseNotFoundError`, :class:`DataError` (unreadable or
    mixed-shape records, an empty database) and :class:`ValueError` for bad options.
    """
    _check_bounds(seconds, batches, warmup)
    start = clock()
    with _endless_batches(
        db, batch_size=batch_size, transform=transform, device=device, workers=workers
    ) as source:
        return time_batches(
            source,
            seconds=seconds,
            batches=batches,
            warmup=warmup,
            quiet=quiet,
            clock=clock,
            start=start,
        )
