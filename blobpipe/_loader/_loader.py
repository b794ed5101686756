"""The Loader: construction, lifecycle, the fillers and the consumer's end.

``min(workers, prefetch)`` fillers, each a loop in its own worker thread
(anyio.to_thread under the workers limiter): take a free slot from the ring,
wait for the device work still reading it, number and plan the next batch
(under one lock, so numbers follow plan order), fill it, issue its device work,
post it to the hand-off by number. The event loop does no per-batch work for
the producer; the consumer takes batches by number.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread

from .._backends import Backend, get_backend, wait_event
from .._errors import StateError
from .._io._batches import Batches, BatchPlan
from .._io._prototxt import read_data_layer
from .._io._transform import Phase, Transform
from .._pool import get_pool
from ._batch import Batch, LoaderStatistics
from ._device import DeviceWork, wants_device_transform
from ._handoff import End, Failure, Handoff, threadsafe_caller
from ._lifecycle import CLOSED_ERROR, Lifecycle, State
from ._options import BatchesOptions, check_options, signature_with_options
from ._ring import Ring, Slot

if sys.version_info >= (3, 11):
    from typing import Unpack
else:
    from typing_extensions import Unpack

__all__ = ["Loader"]

_Made = tuple[Slot, BatchPlan]  # a batch filled into its slot
_YIELD_EVERY = 0.001  # seconds: the longest the consumer keeps the event loop from others
_Item = _Made | End | Failure  # what the hand-off carries


class Loader:
    """Batches from a Caffe LMDB, prefetched onto the device, for ``async for``.

    ::

        async with blobpipe.Loader("train_lmdb", batch_size=64, device="auto") as loader:
            async for batch in loader:      # batch.data, batch.label: Blobs on the device
                ...

        with blobpipe.Loader("train_lmdb", batch_size=64) as loader:   # no async
            for batch in loader:
                ...

    Args:
        source: an LMDB path (or an open :class:`~blobpipe.LmdbReader`); a list
            of them, read as one dataset; or named sources read in lockstep,
            ``{"data": images, "label": label_maps}`` (see
            :class:`~blobpipe.Batches`).
        batch_size: records per batch.
        device: "auto" (the current CUDA device when CuPy sees a GPU, else the
            host), "cpu", "cuda" (the calling thread's current CUDA device, as
            torch's), "cuda:N", or a Backend (e.g. the emulated device in tests).
        prefetch: batch slots in the ring (Caffe's PREFETCH_COUNT; default 4).
        order: "key" (Caffe), "shuffle" or "buffer" (with ``buffer_size``).
        shuffle: shorthand for ``order="shuffle"`` when true.
        workers: the worker-thread limit (default: the CPU count). Batches are
            filled by ``min(workers, prefetch)`` threads at once, one batch each;
            raise ``prefetch`` to use more workers.
        device_transform: apply mean/scale/float conversion on the device from
            uint8 transfers (4× less host→device traffic). Default: on when the
            backend has a device and the transform outputs float32. Records
            holding float_data need it off.
        stream: the stream the consumer's device work on batches runs on (a
            CuPy stream, a ``torch.cuda.Stream``, a ``cudaStream_t`` handle, or
            a stream of the backend). A batch's buffers are refilled only after
            the work queued there before the consumer let the batch go. Default:
            the consumer's current stream when it asks for the next batch
            (CuPy's current stream; see "Streams" in the README).
        **options: :class:`~blobpipe.Batches`' options, with Batches' defaults
            (see Batches for each in full):

            - transform: a :class:`~blobpipe.Transform` (default: none, float32 NCHW).
            - phase: "train" (random crops) or "test" (centre crops).
            - buffer_size: the shuffle buffer's size (``order="buffer"``).
            - seed: seeds the order and the per-record randomness.
            - shard: None, ``(rank, world_size)`` or "auto" (an initialised
              torch.distributed process group, else torchrun's RANK/WORLD_SIZE).
            - shard_mode: "strided" or "contiguous".
            - pad_shards: True (default): equal shards, padded as torch's
              DistributedSampler; "drop": equal, the tail dropped; False:
              disjoint shards that may differ by one record.
            - mode: "wrap" (Caffe: endless, every batch full) or "epoch"
              (``async for`` ends at the end of each epoch; iterate again for
              the next).
            - last: with ``mode="epoch"``: "keep", "drop" or "pad" the last batch.
            - state: a resume state (``batch.state`` or :meth:`state_dict`).
            - readahead: OS readahead for the LMDB (off suits random access).
            - label_dtype: "float32" (Caffe's) or "int64" (class indices).

    Raises:
        ValueError, TypeError: bad arguments (see :class:`~blobpipe.Batches`).
        BackendUnavailableError: ``device="cuda"`` without CuPy or a GPU, or a
            ``stream`` on a backend without a device.
        DatabaseNotFoundError: the LMDB does not exist.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Any,
        batch_size: int = 64,
        *,
        device: str | Backend = "auto",
        prefetch: int = 4,
        order: Literal["key", "shuffle", "buffer", "quasi"] | None = None,
        shuffle: bool = False,
        workers: int | None = None,
        device_transform: bool | None = None,
        stream: object | None = None,
        **options: Unpack[BatchesOptions],
    ) -> None:
        check_options(options, "Loader.__init__")
        if isinstance(prefetch, bool) or int(prefetch) != prefetch or prefetch < 1:
            raise ValueError(f"prefetch must be a positive integer, got {prefetch!r}")
        if workers is None:
            workers = os.cpu_count() or 1
        if isinstance(workers, bool) or int(workers) != workers or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        if order is None:
            order = "shuffle" if shuffle else "key"
        elif shuffle and order != "shuffle":
            raise ValueError(f"shuffle=True contradicts order={order!r}")
        self._backend = get_backend(device)
        self._stream = None if stream is None else self._backend.as_stream(stream)

        def split(transform: Transform, kind: str) -> Transform | None:
            """The device/host split, decided once the record kind is known."""
            if device_transform and kind != "datum":
                raise ValueError(
                    "device_transform=True needs Datum records; this database holds "
                    "BlobProtos (float values: there is no uint8 transfer to save)"
                )
            on_device = kind == "datum" and wants_device_transform(
                device_transform, self._backend, transform, device
            )
            self._transform = transform
            self._device = DeviceWork(self._backend, transform, on_device)
            return self._device.host_transform() if on_device else None

        self._batches = Batches(source, batch_size, order=order, split_transform=split, **options)
        # The producer plans ahead of the consumer: resume after the last
        # *delivered* batch, never from the producer's cursor.
        self._resume_state: dict[str, Any] = self._batches.state_dict()
        self._prefetch = int(prefetch)
        self._workers = int(workers)
        self._lifecycle = Lifecycle()
        self._lock = threading.Lock()  # the statistics and the filler count
        self._n_batches = 0
        self._n_records = 0
        self._wait_time = 0.0
        self._decode_time = 0.0
        self._copy_time = 0.0
        # the pipeline
        self._ring = Ring(self._backend, self._prefetch)
        self._handoff: Handoff[_Made] = Handoff()
        self._plan_lock = threading.Lock()  # numbers and plans batches, in order
        self._planned = 0  # the number of the next batch planned
        self._current: tuple[Slot, Batch] | None = None  # the batch handed out last
        self._yielded = 0.0  # when __anext__ last let the event loop run other tasks
        self._last_fill = float("inf")  # seconds the last batch took to fill
        # set while batches take _YIELD_EVERY or more to fill: every filler runs;
        # clear (small batches): filler 0 and the consumer alone (see _filler)
        self._wide = threading.Event()
        self._wide.set()
        self._fillers_running = 0
        self._fillers_done = threading.Event()  # set when the last filler returned
        # the task group the fillers run in: open()'s, left by aclose(); or the
        # one of ``async with``, left at the block's end (aclose() inside the
        # block may run in another task or cancel scope)
        self._tg: anyio.abc.TaskGroup | None = None
        self._block_tg: anyio.abc.TaskGroup | None = None
        self._threads: list[threading.Thread] | None = None  # the blocking form's fillers

    # -- construction helpers ---------------------------------------------------
    @classmethod
    def from_prototxt(
        cls, path: str | os.PathLike[str], phase: Phase = "train", **options: Any
    ) -> Loader:
        """A Loader configured from the ``Data`` layer of a Caffe net prototxt.

        Takes ``data_param`` (source, batch_size, prefetch; backend must be
        LMDB) and ``transform_param`` of the layer included in ``phase``; paths
        are relative to the working directory, as in Caffe. ``options`` are
        other Loader keywords and override the prototxt (e.g. ``device="cpu"``).

        Raises:
            ProtoError: no Data layer for the phase, a LEVELDB backend, or a
                malformed prototxt.
        """
        config = read_data_layer(path, phase)
        kwargs: dict[str, Any] = {
            "batch_size": config.batch_size,
            "transform": config.transform,
            "phase": config.phase,
            "prefetch": config.prefetch,
        }
        kwargs.update(options)
        source = kwargs.pop("source", config.source)
        return cls(source, **kwargs)

    # -- properties ---------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """The device backend batches are delivered on."""
        return self._backend

    @property
    def batch_size(self) -> int:
        """Records per batch."""
        return self._batches.batch_size

    @property
    def transform(self) -> Transform:
        """The transform applied to every record."""
        return self._transform

    @property
    def device_transform(self) -> bool:
        """True when mean/scale/float conversion run on the device."""
        return self._device.on_device

    @property
    def workers(self) -> int:
        """Worker threads that fill records."""
        return self._workers

    @property
    def prefetch(self) -> int:
        """Batch slots in the ring."""
        return self._prefetch

    def __len__(self) -> int:
        """Batches per epoch (``mode="epoch"`` only; TypeError otherwise)."""
        return len(self._batches)

    def __repr__(self) -> str:
        return (
            f"<Loader batch_size={self.batch_size} device={self._backend!r} "
            f"prefetch={self._prefetch} workers={self._workers} {self._lifecycle!r}>"
        )

    def statistics(self) -> LoaderStatistics:
        """Counters of the batches delivered so far (see :class:`LoaderStatistics`)."""
        with self._lock:
            return LoaderStatistics(
                batches=self._n_batches,
                records=self._n_records,
                wait_time=self._wait_time,
                decode_time=self._decode_time,
                copy_time=self._copy_time,
                pool=get_pool(self._backend, "host").statistics(),
                device_pool=(
                    get_pool(self._backend, "device").statistics()
                    if self._backend.has_device
                    else None
                ),
            )

    def state_dict(self) -> dict[str, Any]:
        """Resume state after the last delivered batch (before any iteration: the start).

        Batches prefetched but not delivered do not count, so a state saved at
        any time (also after :meth:`aclose`) resumes with the next batch the
        consumer would have seen.
        """
        return dict(self._resume_state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict` or ``batch.state``): the same as
        ``Loader(..., state=state)``, for code that builds the loader before it loads
        its checkpoint. Only before the loader is opened: an open one has batches of
        the old position prefetched already.

        Raises:
            StateError: the loader was opened already.
            ValueError, DataError: as ``Batches.load_state_dict`` (another seed,
                order or shard; a database that changed).
        """
        if self._lifecycle.state is not State.UNOPENED:
            raise StateError(
                f"load_state_dict needs a Loader that was not opened yet (this one is "
                f"{self._lifecycle!r}); create a new Loader with state=..."
            )
        self._batches.load_state_dict(state)
        self._resume_state = self._batches.state_dict()

    # -- async lifetime ------------------------------------------------------------
    async def __aenter__(self) -> Loader:
        self._block_tg = await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        tg, self._block_tg = self._block_tg, None
        await self.aclose()
        if tg is not None:
            await tg.__aexit__(None, None, None)

    async def open(self) -> None:
        """Start the pipeline. Prefer ``async with``, which does this and :meth:`aclose`.

        The pipeline's task group is entered here, so a matching :meth:`aclose`
        must run in the same task and cancel scope (``async with`` guarantees it).

        Raises:
            StateError: the loader was opened before.
        """
        self._tg = await self._start()

    async def _start(self) -> anyio.abc.TaskGroup:
        """UNOPENED → OPEN: allocate the ring, start the fillers in a new task group."""
        await anyio.to_thread.run_sync(self._device.warm_up)
        self._lifecycle.open()
        self._ring.open()
        self._limiter = anyio.CapacityLimiter(self._workers)
        self._call_soon = threadsafe_caller()
        self._fillers_running = self._n_fillers
        tg = anyio.create_task_group()
        await tg.__aenter__()
        for k in range(self._n_fillers):
            tg.start_soon(self._run_filler, k)
        return tg

    async def aclose(self) -> None:
        """Stop the pipeline: no thread left running, every block back in the pool.

        Idempotent. Inside ``async with`` it may be called from anywhere (a nested
        cancel scope, another task); the task group is left at the block's end.
        """
        left = self._lifecycle.move(State.CLOSED)
        if left is State.UNOPENED:
            self._batches.close()
        elif left is not None:
            await self._shutdown()
        tg, self._tg = self._tg, None
        if tg is not None:
            await tg.__aexit__(None, None, None)

    async def _shutdown(self) -> None:
        """Stop the fillers (now CLOSED) and release the ring."""
        with anyio.CancelScope(shield=True):
            self._recycle_current()  # the consumer lets its batch go
            # Fillers are loops in worker threads: each finishes its current
            # batch and returns; no thread is abandoned.
            self._wide.set()  # parked fillers see the loader is closed
            self._ring.stop(self._n_fillers)
            await anyio.to_thread.run_sync(self._fillers_done.wait)
            await self._ring.settle()
            self._release()

    def _release(self) -> None:
        self._recycle_current()
        self._ring.close()
        self._handoff.close()  # a consumer waiting in another task or thread sees the close
        self._batches.close()

    # -- producer ------------------------------------------------------------------
    @property
    def _n_fillers(self) -> int:
        return min(self._workers, self._prefetch)

    async def _run_filler(self, k: int) -> None:
        try:
            await anyio.to_thread.run_sync(self._filler, k, limiter=self._limiter)
        finally:
            self._filler_returned()

    def _thread_filler(self, k: int) -> None:
        """A filler of the blocking form: a plain thread, no event loop."""
        try:
            self._filler(k)
        finally:
            self._filler_returned()

    def _filler_returned(self) -> None:
        with self._lock:
            self._fillers_running -= 1
            if self._fillers_running == 0:
                self._fillers_done.set()

    def _filler(self, k: int) -> None:
        """Filler ``k``'s loop (a worker thread); returns once the loader is not OPEN.

        Whatever it raises is posted as a failure at the next batch number, so
        the consumer gets it in order, as itself, never as an exception group.
        While batches are small (``_wide`` clear), only filler 0 fills, with the
        consumer's help: more threads would spend the time on the GIL.
        """
        self._backend.bind_thread()  # works for this device only: no switch, no other context
        while self._lifecycle.state is State.OPEN:
            if k and not self._wide.is_set():
                self._wide.wait()  # set again by a large batch, or by close
                continue
            slot = self._ring.take()
            if slot is None or not self._fill_slot(slot):
                return

    def _fill_slot(self, slot: Slot) -> bool:
        """Plan the next batch, fill it into ``slot`` and post it (or the end of the
        epoch, or the failure, in its place); False when the loader stopped or
        this batch failed."""
        try:
            slot.event.synchronize()  # device work still reading the slot's buffers
            number, item = self._plan_and_fill(slot)
        except Exception as exc:
            with self._plan_lock:
                number, item = self._failed(self._planned, exc)
                self._planned += 1
        if not isinstance(item, tuple):  # end of epoch, failure, or stopped
            self._ring.put(slot)
        if number is None or item is None:
            return False
        self._handoff.post(number, item)
        return not isinstance(item, Failure)

    def _plan_and_fill(self, slot: Slot) -> tuple[int | None, _Item | None]:
        """Number and plan the next batch, fill it, and start its device work.

        Returns its number and what to post: the filled batch, the end of an
        epoch, or the failure; (None, None) once the loader is not OPEN.
        """
        with self._plan_lock:
            if self._lifecycle.state is not State.OPEN:
                return None, None
            number = self._planned
            self._planned += 1
            try:
                plan = self._batches.next_plan()
            except Exception as exc:  # delivered to the consumer, in order
                return self._failed(number, exc)
        if plan is None:
            return number, End()
        t0 = time.perf_counter()
        try:
            data, label, params, extra = slot.prepare(plan, self._device.out_shape(plan))
            self._batches.fill(plan, data, label, params_out=params, extra_out=extra)
        except Exception as exc:  # delivered to the consumer, in order
            return self._failed(number, exc)
        finally:
            dt = time.perf_counter() - t0
            self._last_fill = dt
            if (dt >= _YIELD_EVERY) != self._wide.is_set():
                (self._wide.set if dt >= _YIELD_EVERY else self._wide.clear)()
            with self._lock:
                self._decode_time += dt
        try:
            self._device.issue(slot, plan, self._batches.path)
        except Exception as exc:
            return self._failed(number, exc)
        return number, (slot, plan)

    def _failed(self, number: int, exc: Exception) -> tuple[int, Failure]:
        """Batch ``number`` failed: OPEN → FAILING, nothing after it is planned."""
        self._lifecycle.move(State.FAILING)
        return number, Failure(exc)

    # -- consumer ------------------------------------------------------------------
    def _recycle_current(self) -> None:
        current, self._current = self._current, None
        if current is None:
            return
        slot, batch = current
        batch._recycle()
        slot.released = self._device.release(self._stream, slot)
        self._ring.put(slot)

    def _detach_current(self, batch: Batch) -> None:
        if self._current is not None and self._current[1] is batch:
            slot, _ = self._current
            slot.forget(self._stream)

    def __aiter__(self) -> AsyncIterator[Batch]:
        self._lifecycle.check_iterable()
        return self

    async def __anext__(self) -> Batch:
        """The next batch (recycling the previous one's buffers).

        Raises:
            StopAsyncIteration: at the end of an epoch (``mode="epoch"``).
            BlobpipeError: the error a worker raised filling this batch (e.g. a
                DataError naming the record key and the database).
            StateError: the loader is closed or failed earlier.
        """
        # Every call is a cancellation point, so a consumer whose body never
        # awaits can still be cancelled (and time out): waiting for a batch is a
        # checkpoint; a batch already there gets one when the loop last ran
        # other tasks at least _YIELD_EVERY ago, else a cancellation check only
        # (a turn of the event loop per batch costs more than a small batch).
        t0 = self._begin_next()
        handoff = self._handoff
        # nothing ready, and batches fill in less time than the event loop may be
        # kept from other tasks: fill them here meanwhile (see _help)
        self._help(t0)
        if handoff.ready():
            if t0 - self._yielded >= _YIELD_EVERY:
                await anyio.lowlevel.checkpoint()
                t0 = self._yielded = time.perf_counter()
                self._lifecycle.check_iterable()
            else:  # batches arriving faster than this: cancellation is still seen
                await anyio.lowlevel.checkpoint_if_cancelled()
        item = handoff.take()
        if item is None:
            event = anyio.Event()
            call_soon = self._call_soon
            item = handoff.take(lambda: call_soon(event.set))
            if item is None:
                try:
                    await event.wait()
                finally:
                    handoff.forget_waiter()
                item = self._taken()
            else:
                # it arrived meanwhile and is taken: a cancellation now would lose
                # it, so this call's checkpoint is a shielded one
                await anyio.lowlevel.cancel_shielded_checkpoint()
        made = self._arrived(item, t0)
        if made is None:
            raise StopAsyncIteration
        done = made[0].event
        if not done.query():
            # Shielded: the batch has left the hand-off, so a cancellation here
            # would lose it and its slot. The wait is bounded by the copy.
            with anyio.CancelScope(shield=True):
                await wait_event(done)
        return self._deliver(*made, t0)

    def _next_blocking(self) -> Batch:
        """:meth:`__anext__` for the blocking form: waits in the calling thread."""
        t0 = self._begin_next()
        handoff = self._handoff
        self._help(t0)
        item = handoff.take()
        if item is None:
            event = threading.Event()
            item = handoff.take(event.set)
            if item is None:
                try:
                    event.wait()
                finally:
                    handoff.forget_waiter()
                item = self._taken()
        made = self._arrived(item, t0)
        if made is None:
            raise StopIteration
        made[0].event.synchronize()
        return self._deliver(*made, t0)

    def _help(self, t0: float) -> None:
        """While the next batch is not ready and batches are small, fill batches
        into free slots in the consumer's thread (for at most about _YIELD_EVERY)
        rather than sleep until a filler posts one: for small records a thread
        hand-off per batch costs more than the batch. (Large batches keep the
        fillers busy on every core already.)"""
        handoff = self._handoff
        while (
            not handoff.ready()
            and self._last_fill < _YIELD_EVERY
            and time.perf_counter() - t0 < _YIELD_EVERY
        ):
            slot = self._ring.take_nowait()
            if slot is None or not self._fill_slot(slot):
                return

    def _begin_next(self) -> float:
        self._lifecycle.check_next()
        self._recycle_current()
        return time.perf_counter()

    def _taken(self) -> _Item:
        """After a wake-up: the batch that arrived (or StateError when closed)."""
        self._lifecycle.check_iterable()
        item = self._handoff.take()
        if item is None:  # pragma: no cover - woken without a batch means closed
            raise StateError(CLOSED_ERROR)
        return item

    def _arrived(self, item: _Item, t0: float) -> _Made | None:
        """A batch that arrived; None at the end of an epoch; raises failures."""
        if isinstance(item, End):
            with self._lock:
                self._wait_time += time.perf_counter() - t0
            return None
        if isinstance(item, Failure):
            self._lifecycle.fail(item.exc)
            raise item.exc
        return item

    def _deliver(self, slot: Slot, plan: BatchPlan, t0: float) -> Batch:
        """Account for the batch whose device work completed and hand it out."""
        copy = self._device.elapsed(slot)
        with self._lock:
            self._copy_time += copy
            self._wait_time += time.perf_counter() - t0
            self._n_batches += 1
            self._n_records += plan.valid
        self._resume_state = plan.state
        batch = self._make_batch(slot, plan)
        self._current = (slot, batch)
        return batch

    def _make_batch(self, slot: Slot, plan: BatchPlan) -> Batch:
        src = slot.out if self._device.on_device else slot.host
        if src is None or slot.label is None:  # closed by another thread meanwhile
            raise StateError(CLOSED_ERROR)
        # closed by _recycle (or kept by detach, which adds the finalizer)
        data = src._alias(finalize=False, readonly_export=True)
        label = slot.label._alias(finalize=False, readonly_export=True)
        extra = {
            name: slot.extra[name]._alias(finalize=False, readonly_export=True)
            for name, _ in plan.extra
        }
        return Batch(data, label, plan, on_detach=self._detach_current, extra=extra)

    # -- the blocking form ------------------------------------------------------------
    def __enter__(self) -> Loader:
        """Start the pipeline for ``for batch in loader``: the fillers are plain
        threads and the calling thread takes the batches, no event loop.

        Raises:
            StateError: the loader was opened before.
        """
        self._lifecycle.check_enter()
        self._device.warm_up()
        self._lifecycle.open()
        self._ring.open()
        self._fillers_running = self._n_fillers
        self._threads = [
            threading.Thread(
                target=self._thread_filler, args=(k,), name=f"blobpipe-filler-{k}", daemon=True
            )
            for k in range(self._n_fillers)
        ]
        for thread in self._threads:
            thread.start()
        _close_at_exit(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the pipeline of the blocking form (``with`` does this): no thread left
        running, every block back in the pool. Idempotent."""
        threads, self._threads = self._threads, None
        _open_blocking.discard(self)
        left = self._lifecycle.move(State.CLOSED)
        if left is State.UNOPENED:
            self._batches.close()
        elif left is not None and threads is not None:
            # each filler finishes its current batch and returns
            self._wide.set()  # parked fillers see the loader is closed
            self._ring.stop(self._n_fillers)
            for thread in threads:
                thread.join()
            for slot in self._ring.slots:  # device work still reading a slot
                slot.event.synchronize()
            self._release()

    def __iter__(self) -> Iterator[Batch]:
        if self._threads is None:
            self._lifecycle.check_iterable(blocking=True)
            raise StateError(CLOSED_ERROR)
        return self

    def __next__(self) -> Batch:
        if self._threads is None:
            self._lifecycle.check_iterable(blocking=True)
            raise StateError(CLOSED_ERROR)
        return self._next_blocking()


# Blocking-form loaders still open: closed by an atexit hook, so that no filler thread
# is inside native code (OpenCV, NumPy) while the interpreter finalizes.
_open_blocking: weakref.WeakSet[Loader] = weakref.WeakSet()
_exit_hook = threading.Lock()
_exit_hooked = False


def _close_at_exit(loader: Loader) -> None:
    global _exit_hooked
    _open_blocking.add(loader)
    with _exit_hook:
        if not _exit_hooked:
            atexit.register(_close_open_loaders)
            _exit_hooked = True


def _close_open_loaders() -> None:
    for loader in list(_open_blocking):
        with contextlib.suppress(Exception):  # exiting: close what can be closed
            loader.close()


# help() and IDEs show Batches' options as Loader's keywords, with their defaults
Loader.__init__.__signature__ = signature_with_options(Loader.__init__)  # type: ignore[attr-defined]
