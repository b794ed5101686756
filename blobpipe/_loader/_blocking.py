"""The blocking driver: a Loader's form for a plain thread (``with``, ``for``,
``next``), no event loop. The fillers are plain threads either way; here the
calling thread waits for batches, and :meth:`Pipeline.close` waits for the
fillers and the device work.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from .._backends import COMPLETED
from ._batch import Batch
from ._lifecycle import State
from ._pipeline import Pipeline

__all__ = ["BlockingForm"]

_F = TypeVar("_F", bound="BlockingForm")


class BlockingForm:
    """The Loader's blocking methods, driving its pipeline ``_pipe`` from a thread."""

    _pipe: Pipeline  # the Loader's

    def __enter__(self: _F) -> _F:
        """Start the pipeline for ``for batch in loader``: the fillers are plain
        threads and the calling thread takes the batches, no event loop.

        Raises:
            StateError: the loader was opened before.
        """
        self._pipe.lifecycle.check_enter()
        self._open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the pipeline (``with`` does this): no thread left running, every
        block back in the pool. Idempotent."""
        self._pipe.close()

    def __iter__(self) -> Iterator[Batch]:
        self._pipe.lifecycle.check_closed()
        if self._pipe.lifecycle.state is State.UNOPENED:
            self._open()
        return self

    def __next__(self) -> Batch:
        """The next batch, waited for in the calling thread; the first call opens a
        Loader that was not entered.

        Raises:
            StopIteration: at the end of an epoch (``mode="epoch"``).
            BlobpipeError: the error a worker raised filling this batch.
            StateError: the loader is closed or failed earlier, or was opened in
                the parent of this forked process.
        """
        pipe = self._pipe
        if pipe.lifecycle.state is State.UNOPENED:
            self._open()
        t0 = pipe.begin_next()
        handoff = pipe.handoff
        item = handoff.take()
        if item is None and pipe.wait_started():  # the consumer's own chunk, started
            item = handoff.take()
        if item is None:
            handoff.wait()
            item = pipe.taken()
        made = pipe.arrived(item, t0)
        if made is None:
            raise StopIteration
        done = made[0].event
        if done is not COMPLETED:  # (no device: nothing to wait for)
            try:
                done.synchronize()
            except Exception as exc:  # its device work failed
                pipe.device_failed(exc)
                raise
        return pipe.deliver(*made, t0)

    def _open(self) -> None:
        """UNOPENED → OPEN, with the device warm-up in the calling thread."""
        self._pipe.open_here()
