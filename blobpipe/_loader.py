"""The async prefetching loader: Caffe's DataLayer, staged through the pool onto the device.

Pipeline (Caffe's free/full prefetch queues, FFCV's ring of slots)::

    fillers: min(workers, prefetch) loops,           consumer (async for / for)
    each in an anyio worker thread                   ──────────────────────────
    ─────────────────────────────
    slot = free.get()              ◄──── recycled ── previous batch's slot
    wait for the slot's last device event
    number + plan the next batch   (under a lock)
    fill it into the slot's host blobs (pinned on CUDA)
    push host→device on the slot's stream
    [device transform kernel on the same stream]
    post (number, slot)            ─────────────────► take batches by number,
                                                     await the slot's event,
                                                     hand out Batch (views of the slot)

Invariants:

* ``prefetch`` slots are allocated once, from the backend's pools; at most that
  much batch memory is alive, so a slow consumer slows reading (backpressure).
* A slot is refilled only after the consumer has moved past its batch *and*
  the device work reading its host buffers has completed (its event).
* A handed-out :class:`Batch` holds Blobs that share the slot's memory; when the
  consumer asks for the next batch they are retired, so a recycled batch raises
  instead of silently showing other data. :meth:`Batch.detach` keeps one.
* Errors raised while filling a batch reach the consumer in order, as the
  original exception (never an exception group), when that batch is due.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from ._backends import COMPLETED, Backend, Event, Stream, get_backend, wait_event
from ._blob import Blob
from ._errors import DataError, ShapeError, StateError
from ._io._batches import Batches, BatchPlan
from ._io._prototxt import read_data_layer
from ._io._transform import Phase, Transform
from ._pool import PoolStatistics, get_pool

__all__ = ["Batch", "Loader", "LoaderStatistics"]

_RECYCLED = (
    "this batch was recycled: its buffers went back to the loader when the next batch "
    "was requested; call batch.detach() to keep a batch beyond the next iteration"
)


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
    """

    batches: int
    records: int
    wait_time: float
    decode_time: float
    copy_time: float
    pool: PoolStatistics
    device_pool: PoolStatistics | None


class Batch:
    """One batch from a :class:`Loader`.

    ``data`` and ``label`` are Blobs whose head is on the loader's device
    (``SYNCED`` or ``HEAD_AT_GPU`` on CUDA, ``HEAD_AT_CPU`` on the host):
    ``batch.data.gpu_data()`` is a CuPy array, ``batch.data.cpu_data()`` a NumPy
    array, and ``torch.from_dlpack(batch.data)`` works without a copy.

    The buffers belong to the loader and are recycled when the next batch is
    requested; using the batch (its Blobs) after that raises StateError.
    Arrays already taken from it (``cpu_data()``, ``gpu_data()``, DLPack
    exports such as ``torch.from_dlpack(batch.data)``) are views of the same
    buffers and are *not* invalidated: copy them, or :meth:`detach` the batch,
    to keep data beyond the next iteration.

    Attributes:
        keys: the records' keys, row by row.
        indices: the records' global indices (position in key order).
        epoch: the epoch of the first row.
        valid: real rows; rows ``>= valid`` are padding (``last="pad"``).
        state: the resume state after this batch (``Loader(..., state=...)``).
    """

    __slots__ = (
        "_data",
        "_detached",
        "_label",
        "_loader",
        "epoch",
        "indices",
        "keys",
        "state",
        "valid",
    )

    def __init__(self, loader: Loader, data: Blob, label: Blob, plan: BatchPlan) -> None:
        self._loader: Loader | None = loader
        self._data = data
        self._label = label
        self._detached = False
        self.keys: tuple[bytes, ...] = plan.keys
        self.indices: tuple[int, ...] = plan.indices
        self.epoch: int = plan.epoch
        self.valid: int = plan.valid
        self.state: dict[str, Any] = plan.state

    @property
    def data(self) -> Blob:
        """The batch's data Blob (N×C×H×W, or NHWC)."""
        self._data._check_open()
        return self._data

    @property
    def label(self) -> Blob:
        """The labels, a float32 Blob of shape (N,)."""
        self._label._check_open()
        return self._label

    @property
    def recycled(self) -> bool:
        """True once the loader took the buffers back."""
        return self._data.closed

    def __len__(self) -> int:
        return len(self.keys)

    def detach(self) -> Batch:
        """Keep this batch: the loader gives its slot new buffers instead.

        Returns the batch itself; its Blobs are then the caller's to
        :meth:`~Blob.close` (a finalizer returns them to the pool otherwise).
        The loader allocates replacement buffers for the slot, so detaching
        costs one allocation from the pool.

        Raises:
            StateError: the batch was already recycled.
        """
        self.data  # noqa: B018 - raises when recycled
        if not self._detached:
            loader, self._loader = self._loader, None
            self._detached = True
            self._data._keep()
            self._label._keep()
            if loader is not None:
                loader._detach_current(self)
        return self

    def _recycle(self) -> None:
        if not self._detached:
            self._data._retire(_RECYCLED)
            self._label._retire(_RECYCLED)

    def close(self) -> None:
        """Release a detached batch's Blobs (recycled batches need nothing)."""
        if self._detached:
            self._data.close()
            self._label.close()

    def __repr__(self) -> str:
        state = "recycled" if self.recycled else ("detached" if self._detached else "live")
        return f"<Batch {self._data.shape_string()} epoch {self.epoch} {state}>"


class _Slot:
    """One ring slot: host staging blobs, device blobs, a stream, the last event."""

    def __init__(self, backend: Backend, stream: Stream | None) -> None:
        self.backend = backend
        self.stream = stream
        self.event: Event = COMPLETED  # completes after the slot's last device work
        self.started: Event | None = None  # timing event before that work
        self.host: Blob | None = None  # data as filled on the host (pinned)
        self.label: Blob | None = None  # labels (pushed to the device too)
        self.staged: Blob | None = None  # device copy of ``host`` (device transform)
        self.out: Blob | None = None  # device transform output (float32)
        self.params: npt.NDArray[np.int32] = np.zeros((0, 3), np.int32)

    @staticmethod
    def _fit(
        blob: Blob | None, shape: tuple[int, ...], dtype: np.dtype[Any], backend: Backend
    ) -> Blob:
        if blob is not None and blob.dtype == dtype:
            if blob.shape != shape:
                blob.reshape(shape)  # within capacity: no allocation
            return blob
        if blob is not None:
            blob.close()
        return Blob(shape, dtype, backend=backend)

    def prepare(self, plan: BatchPlan, out_shape: tuple[int, ...] | None) -> None:
        backend = self.backend
        self.host = self._fit(self.host, plan.data_shape, plan.dtype, backend)
        self.label = self._fit(self.label, (len(plan),), np.dtype(np.float32), backend)
        if out_shape is not None:
            self.staged = self._fit(self.staged, plan.data_shape, plan.dtype, backend)
            self.out = self._fit(self.out, out_shape, np.dtype(np.float32), backend)
        if self.params.shape[0] < len(plan):
            self.params = np.zeros((len(plan), 3), np.int32)

    def forget(self) -> None:
        """Drop the blobs (a detached batch now owns their memory)."""
        self.host = self.label = self.staged = self.out = None

    def close(self) -> None:
        self.event.synchronize()
        for blob in (self.host, self.label, self.staged, self.out):
            if blob is not None:
                blob.close()
        self.forget()


def _device_transform(
    xp: Any,
    u8: Any,
    params: Any,
    mean: Any,
    scale: np.float32,
    layout: str,
    out: Any,
) -> None:
    """Caffe's transform on the device, from a uint8 batch already cropped and mirrored.

    ``mean`` is the uncropped (C, H, W) mean, a (C, 1, 1) column, or None;
    ``params`` the per-row (h_off, w_off, mirror). Element for element the same
    float32 operations as the CPU path: ``(float32(x) - mean) * scale``.
    """
    x = u8.astype(xp.float32)
    if mean is not None:
        if mean.shape[1] == 1 and mean.shape[2] == 1:
            x -= mean[None]
        else:
            _, _, h, w = u8.shape
            h_off, w_off, mirror = params[:, 0], params[:, 1], params[:, 2]
            rows = h_off[:, None] + xp.arange(h)[None, :]
            ar = xp.arange(w)[None, :]
            cols = w_off[:, None] + xp.where(mirror[:, None] != 0, w - 1 - ar, ar)
            gathered = mean[:, rows[:, :, None], cols[:, None, :]]  # (C, N, h, w)
            x -= gathered.transpose(1, 0, 2, 3)
    if scale != 1:
        x *= scale
    if layout == "NHWC":
        x = x.transpose(0, 2, 3, 1)
    out[...] = x


class _End:
    """Marks the end of an epoch in the full queue."""


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_State = Literal["unopened", "open", "closed"]


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
        source: an LMDB path (or an open :class:`~blobpipe.LmdbReader`).
        batch_size: records per batch.
        device: "auto" (CUDA when CuPy sees a GPU, else the host), "cpu",
            "cuda", "cuda:N", or a Backend (e.g. the emulated device in tests).
        prefetch: batch slots in the ring (Caffe's PREFETCH_COUNT; default 4).
        transform: a :class:`~blobpipe.Transform` (default: none, float32 NCHW).
        phase: "train" (random crops) or "test" (centre crops).
        order: "key" (Caffe), "shuffle" or "buffer" (with ``buffer_size``).
        shuffle: shorthand for ``order="shuffle"`` when true.
        seed: seeds the order and the per-record randomness.
        shard: None, ``(rank, world_size)`` or "auto" (torchrun's RANK/WORLD_SIZE).
        shard_mode: "strided" or "contiguous".
        pad_shards: equal-length shards for distributed training, as torch's
            DistributedSampler (see :class:`~blobpipe.Batches`).
        mode: "wrap" (Caffe: endless, every batch full) or "epoch" (``async
            for`` ends at the end of each epoch; iterate again for the next).
        last: with ``mode="epoch"``: "keep", "drop" or "pad" the last batch.
        workers: the worker-thread limit (default: the CPU count). Batches are
            filled by ``min(workers, prefetch)`` threads at once, one batch each;
            raise ``prefetch`` to use more workers.
        device_transform: apply mean/scale/float conversion on the device from
            uint8 transfers (4× less host→device traffic). Default: on when the
            backend has a device and the transform outputs float32. Records
            holding float_data need it off.
        state: a resume state (``batch.state`` or :meth:`state_dict`).
        readahead: OS readahead for the LMDB (off suits random access).

    Raises:
        ValueError, TypeError: bad arguments (see :class:`~blobpipe.Batches`).
        BackendUnavailableError: ``device="cuda"`` without CuPy or a GPU.
        DatabaseNotFoundError: the LMDB does not exist.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | Any,
        batch_size: int = 64,
        *,
        device: str | Backend = "auto",
        prefetch: int = 4,
        transform: Transform | None = None,
        phase: Phase = "train",
        order: Literal["key", "shuffle", "buffer"] | None = None,
        shuffle: bool = False,
        buffer_size: int | None = None,
        seed: int = 0,
        shard: tuple[int, int] | Literal["auto"] | None = None,
        shard_mode: Literal["strided", "contiguous"] = "strided",
        pad_shards: bool = False,
        mode: Literal["wrap", "epoch"] = "wrap",
        last: Literal["keep", "drop", "pad"] = "keep",
        workers: int | None = None,
        device_transform: bool | None = None,
        state: dict[str, Any] | None = None,
        readahead: bool = False,
    ) -> None:
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
        self._transform = transform if transform is not None else Transform()
        if device_transform is None:
            device_transform = self._backend.has_device and self._transform.dtype == np.float32
        elif device_transform and not self._backend.has_device:
            raise ValueError(
                f"device_transform=True needs a device, but device={device!r} resolved to the "
                f"{self._backend.name!r} backend"
            )
        self._device_transform = bool(device_transform and self._transform.dtype == np.float32)
        staging = self._staging_transform() if self._device_transform else self._transform
        self._batches = Batches(
            source,
            batch_size,
            transform=staging,
            phase=phase,
            order=order,
            buffer_size=buffer_size,
            seed=seed,
            shard=shard,
            shard_mode=shard_mode,
            pad_shards=pad_shards,
            mode=mode,
            last=last,
            readahead=readahead,
            state=state,
        )
        # The producer plans ahead of the consumer: resume after the last
        # *delivered* batch, never from the producer's cursor.
        self._resume_state: dict[str, Any] = self._batches.state_dict()
        self._prefetch = int(prefetch)
        self._workers = int(workers)
        self._state: _State = "unopened"
        self._lock = threading.Lock()
        # statistics
        self._n_batches = 0
        self._n_records = 0
        self._wait_time = 0.0
        self._decode_time = 0.0
        self._copy_time = 0.0
        # pipeline objects, created on open
        self._slots: list[_Slot] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._current: tuple[_Slot, Batch] | None = None
        self._failure: BaseException | None = None
        self._broken = False  # a failure was planned: plan and deliver nothing more
        self._plan_lock = threading.Lock()
        self._planned = 0  # batches numbered by the planner
        self._delivered = 0  # the number of the next batch the consumer takes
        self._stopping = False
        # free slots (None: a filler's stop signal); posted batches by number, and
        # the consumer waiting for one: (number, event), both under _ready_lock
        self._free: queue.SimpleQueue[_Slot | None] = queue.SimpleQueue()
        self._fillers_running = 0
        self._fillers_done = threading.Event()  # set when the last filler returned
        self._in_context = False  # inside ``async with``: __aexit__ leaves the task group
        self._ready_lock = threading.Lock()
        self._ready: dict[int, tuple[_Slot, BatchPlan] | _End | _Failure] = {}
        self._waiter: tuple[int, Callable[[], object]] | None = None
        self._means: dict[tuple[int, ...], Any] = {}
        # the blocking (sync) form
        self._portal_cm: Any = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._host_future: Any = None
        self._close_requested: anyio.Event | None = None

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

    def _staging_transform(self) -> Transform:
        """The CPU half of a device transform: crop and mirror only, uint8 NCHW."""
        t = self._transform
        return Transform(
            mirror=t.mirror,
            crop_size=t.crop_size,
            force_color=t.force_color,
            force_gray=t.force_gray,
            layout="NCHW",
            dtype="uint8",
        )

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
        return self._device_transform

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
            f"prefetch={self._prefetch} workers={self._workers} {self._state}>"
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

    # -- async lifetime ------------------------------------------------------------
    async def __aenter__(self) -> Loader:
        await self.open()
        self._in_context = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._in_context = False
        await self.aclose()

    async def open(self) -> None:
        """Start the pipeline. Prefer ``async with``, which does this and :meth:`aclose`.

        The pipeline's task group is entered here, so a matching :meth:`aclose`
        must run in the same task and cancel scope (``async with`` guarantees it).

        Raises:
            StateError: the loader was opened before.
        """
        if self._state != "unopened":
            raise StateError(
                f"this Loader is {self._state}; a Loader can be opened once — create a new one"
            )
        self._state = "open"
        for _ in range(self._prefetch):
            stream = self._backend.create_stream() if self._backend.has_device else None
            slot = _Slot(self._backend, stream)
            self._slots.append(slot)
            self._free.put(slot)
        self._limiter = anyio.CapacityLimiter(self._workers)
        self._call_soon = _threadsafe_caller()
        self._fillers_running = self._n_fillers
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        for _ in range(self._n_fillers):
            self._tg.start_soon(self._run_filler)

    async def aclose(self) -> None:
        """Stop the pipeline: no thread left running, every block back in the pool.

        Idempotent. Inside ``async with`` it may be called from anywhere (a nested
        cancel scope, another task); the task group is left at the block's end.
        """
        if self._state != "closed":
            await self._shutdown()
        if self._tg is not None and not self._in_context:
            tg, self._tg = self._tg, None
            await tg.__aexit__(None, None, None)

    async def _shutdown(self) -> None:
        was_open = self._state == "open"
        self._state = "closed"
        if not was_open:
            self._batches.close()
            return
        with anyio.CancelScope(shield=True):
            # Fillers are loops in worker threads: each finishes its current
            # batch and returns; no thread is abandoned.
            self._stop_fillers()
            await anyio.to_thread.run_sync(self._fillers_done.wait)
            # device work still reading slot buffers finishes before they return
            for slot in self._slots:
                await wait_event(slot.event)
            self._release()

    def _release(self) -> None:
        if self._current is not None:
            self._current[1]._recycle()
            self._current = None
        for slot in self._slots:
            slot.close()
        self._slots.clear()
        with self._ready_lock:
            self._ready.clear()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter[1]()  # a consumer waiting in another task or thread sees the close
        self._batches.close()

    def _check_iterable(self) -> None:
        if self._state == "unopened":
            raise StateError(
                "iterate a Loader inside 'async with Loader(...) as loader:' "
                "(or 'with Loader(...) as loader:' without async)"
            )
        if self._state == "closed":
            raise StateError("this Loader is closed; create a new one to iterate again")

    # -- producer ------------------------------------------------------------------
    #
    # ``min(workers, prefetch)`` fillers, each a loop in its own worker thread
    # (anyio.to_thread under the workers limiter): take a free slot, wait for
    # the device work still reading it, plan the next batch (under a lock that
    # also numbers it), fill it, issue its host→device copy, post it by number.
    # The event loop does no per-batch work for the producer; the consumer
    # takes batches by number, so it sees the planned order (and errors at
    # their place) whatever finishes first.

    @property
    def _n_fillers(self) -> int:
        return min(self._workers, self._prefetch)

    async def _run_filler(self) -> None:
        try:
            await anyio.to_thread.run_sync(self._filler, limiter=self._limiter)
        finally:
            with self._lock:
                self._fillers_running -= 1
                if self._fillers_running == 0:
                    self._fillers_done.set()

    def _stop_fillers(self) -> None:
        self._stopping = True
        for _ in range(self._n_fillers):
            self._free.put(None)  # wakes a filler waiting for a slot

    def _filler(self) -> None:
        """One filler's loop (a worker thread); returns when stopped or broken.

        Whatever it raises is posted as a failure at the next batch number, so
        the consumer gets it in order, as itself, never as an exception group.
        """
        while not self._stopping:
            slot = self._free.get()
            if slot is None:
                return
            try:
                slot.event.synchronize()  # device work still reading the slot's buffers
                seq, item = self._plan_and_fill(slot)
            except Exception as exc:
                with self._plan_lock:
                    seq, item = self._planned, _Failure(exc)
                    self._planned += 1
                    self._broken = True
            if not isinstance(item, tuple):  # end of epoch, failure, or stopped
                self._free.put(slot)
            if seq is None or item is None:
                return
            self._post(seq, item)
            if isinstance(item, _Failure):
                return

    def _plan_and_fill(
        self, slot: _Slot
    ) -> tuple[int | None, tuple[_Slot, BatchPlan] | _End | _Failure | None]:
        """Number and plan the next batch, fill it, and start its device work."""
        with self._plan_lock:
            if self._broken or self._stopping:
                return None, None
            seq = self._planned
            self._planned += 1
            try:
                plan = self._batches.next_plan()
            except Exception as exc:  # delivered to the consumer, in order
                self._broken = True
                return seq, _Failure(exc)
        if plan is None:
            return seq, _End()
        t0 = time.perf_counter()
        try:
            data, label, params = self._prepare(slot, plan)
            self._batches.fill(plan, data, label, params_out=params)
        except Exception as exc:  # delivered to the consumer, in order
            self._broken = True
            return seq, _Failure(exc)
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self._decode_time += dt
        try:
            self._issue_device_work(slot, plan)
        except Exception as exc:
            self._broken = True
            return seq, _Failure(exc)
        return seq, (slot, plan)

    def _post(self, seq: int, item: tuple[_Slot, BatchPlan] | _End | _Failure) -> None:
        with self._ready_lock:
            self._ready[seq] = item
            waiter = self._waiter
            if waiter is None or waiter[0] != seq:
                return
            self._waiter = None
        # the consumer waits for exactly this batch: wake it (on the event loop
        # for the async form, without blocking this filler until it ran)
        try:
            waiter[1]()
        except RuntimeError:  # the event loop is gone (closing)
            pass

    def _prepare(
        self, slot: _Slot, plan: BatchPlan
    ) -> tuple[np.ndarray, np.ndarray, npt.NDArray[np.int32] | None]:
        out_shape: tuple[int, ...] | None = None
        if self._device_transform:
            n, c, h, w = plan.data_shape
            out_shape = (n, c, h, w) if self._transform.layout == "NCHW" else (n, h, w, c)
        slot.prepare(plan, out_shape)
        assert slot.host is not None and slot.label is not None
        params = slot.params[: len(plan)] if self._device_transform else None
        return slot.host.mutable_cpu_data(), slot.label.mutable_cpu_data(), params

    def _issue_device_work(self, slot: _Slot, plan: BatchPlan) -> None:
        backend = self._backend
        if not backend.has_device:
            slot.event = COMPLETED
            slot.started = None
            return
        assert slot.host is not None and slot.label is not None
        # Everything that can fail before work is queued happens first ...
        mean = self._device_mean(plan) if self._device_transform else None
        slot.started = backend.record_event(slot.stream, timing=True)
        try:
            slot.label.data.start_gpu_push(slot.stream)
            if self._device_transform:
                self._launch_transform(slot, plan, mean)
            else:
                slot.host.data.start_gpu_push(slot.stream)
        finally:
            # ... and once anything is queued, the slot's event covers it, so its
            # buffers are not reused (or released) while the device reads them.
            slot.event = backend.record_event(slot.stream, timing=True)

    def _launch_transform(self, slot: _Slot, plan: BatchPlan, mean: Any) -> None:
        backend = self._backend
        xp = backend.xp
        t = self._transform
        assert slot.host is not None and slot.staged is not None and slot.out is not None
        # The uint8 batch is copied into a device-only blob rather than pushed
        # through the host blob's SyncedMemory: a pending push would make the
        # device accessor below wait for the copy.
        # The kernel runs after the copy in this stream's order (launch()).
        u8 = slot.staged.mutable_gpu_data()
        backend.copy_to_device(u8, slot.host.cpu_data(), slot.stream)
        out = slot.out.mutable_gpu_data()
        params_host = slot.params[: len(plan)].copy()
        scale = t.scale
        layout = t.layout

        def kernel() -> None:
            params = xp.asarray(params_host)
            _device_transform(xp, u8, params, mean, scale, layout, out)

        backend.launch(kernel, slot.stream)

    def _device_mean(self, plan: BatchPlan) -> Any:
        """The transform's mean on the device for the plan's record shape (cached).

        Raises DataError (naming the batch's first record) when the mean does not
        fit the records, as the CPU path does.
        """
        key = plan.record_shape
        with self._lock:
            if key in self._means:
                return self._means[key]
        try:
            mean = self._transform.mean_array(key)
        except ShapeError as exc:
            raise DataError(str(exc), path=self._batches.path, key=plan.keys[0]) from exc
        device = None
        if mean is not None:
            device = self._backend.xp.asarray(mean)
            # uploaded on the current stream: finished before any slot stream reads it
            self._backend.synchronize()
        with self._lock:
            return self._means.setdefault(key, device)

    # -- consumer ------------------------------------------------------------------
    def _recycle_current(self) -> None:
        current, self._current = self._current, None
        if current is None:
            return
        slot, batch = current
        batch._recycle()
        self._free.put(slot)

    def _detach_current(self, batch: Batch) -> None:
        if self._current is not None and self._current[1] is batch:
            slot, _ = self._current
            slot.forget()

    def __aiter__(self) -> AsyncIterator[Batch]:
        self._check_iterable()
        return self

    async def __anext__(self) -> Batch:
        """The next batch (recycling the previous one's buffers).

        Raises:
            StopAsyncIteration: at the end of an epoch (``mode="epoch"``).
            BlobpipeError: the error a worker raised filling this batch (e.g. a
                DataError naming the record key and the database).
            StateError: the loader is closed or failed earlier.
        """
        # Every call is a checkpoint, so a consumer whose body never awaits can
        # still be cancelled (and time out): waiting for a batch is one; a batch
        # already there gets an explicit one before it leaves the ready set.
        t0 = self._begin_next()
        if self._delivered in self._ready:
            await anyio.lowlevel.checkpoint()
            t0 = time.perf_counter()
            self._check_iterable()
        item = self._pop_ready()
        if item is None:
            event = anyio.Event()
            call_soon = self._call_soon
            item = self._pop_ready(lambda: call_soon(event.set))
            if item is None:
                try:
                    await event.wait()
                finally:
                    self._forget_waiter()
                item = self._taken()
            else:
                # it arrived meanwhile and is taken: a cancellation now would lose
                # it, so this call's checkpoint is a shielded one
                await anyio.lowlevel.cancel_shielded_checkpoint()
        got = self._arrived(item, t0)
        if got is None:
            raise StopAsyncIteration
        done = got[0].event
        if not done.query():
            # Shielded: the batch has left the ready set, so a cancellation here
            # would lose it and its slot. The wait is bounded by the copy.
            with anyio.CancelScope(shield=True):
                await wait_event(done)
        return self._deliver(*got, t0)

    def _next_blocking(self) -> Batch:
        """:meth:`__anext__` for the blocking form: waits in the calling thread."""
        t0 = self._begin_next()
        item = self._pop_ready()
        if item is None:
            event = threading.Event()
            item = self._pop_ready(event.set)
            if item is None:
                try:
                    event.wait()
                finally:
                    self._forget_waiter()
                item = self._taken()
        got = self._arrived(item, t0)
        if got is None:
            raise StopIteration
        got[0].event.synchronize()
        return self._deliver(*got, t0)

    def _begin_next(self) -> float:
        self._check_iterable()
        if self._failure is not None:
            raise StateError(
                f"this Loader stopped after an error: {self._failure!r}"
            ) from self._failure
        self._recycle_current()
        return time.perf_counter()

    def _pop_ready(
        self, wake: Callable[[], object] | None = None
    ) -> tuple[_Slot, BatchPlan] | _End | _Failure | None:
        """The next batch if a filler posted it; else register ``wake`` (if given)."""
        with self._ready_lock:
            item = self._ready.pop(self._delivered, None)
            if item is None and wake is not None:
                self._waiter = (self._delivered, wake)
        if item is not None:
            self._delivered += 1
        return item

    def _forget_waiter(self) -> None:
        with self._ready_lock:
            self._waiter = None

    def _taken(self) -> tuple[_Slot, BatchPlan] | _End | _Failure:
        """After a wake-up: the batch that arrived (or StateError when closed)."""
        self._check_iterable()
        item = self._pop_ready()
        if item is None:  # pragma: no cover - woken without a batch means closed
            raise StateError("this Loader is closed; create a new one to iterate again")
        return item

    def _arrived(
        self, item: tuple[_Slot, BatchPlan] | _End | _Failure, t0: float
    ) -> tuple[_Slot, BatchPlan] | None:
        """A batch that arrived; None at the end of an epoch; raises failures."""
        if isinstance(item, _End):
            with self._lock:
                self._wait_time += time.perf_counter() - t0
            return None
        if isinstance(item, _Failure):
            self._failure = item.exc
            raise item.exc
        return item

    def _deliver(self, slot: _Slot, plan: BatchPlan, t0: float) -> Batch:
        """Account for the batch whose device work completed and hand it out."""
        copy = 0.0
        if slot.started is not None and slot.event.query():
            copy = self._backend.elapsed(slot.started, slot.event)
        with self._lock:
            self._copy_time += copy
            self._wait_time += time.perf_counter() - t0
            self._n_batches += 1
            self._n_records += plan.valid
        self._resume_state = plan.state
        batch = self._make_batch(slot, plan)
        self._current = (slot, batch)
        return batch

    def _make_batch(self, slot: _Slot, plan: BatchPlan) -> Batch:
        src = slot.out if self._device_transform else slot.host
        if src is None or slot.label is None:  # closed by another thread meanwhile
            raise StateError("this Loader is closed; create a new one to iterate again")
        # closed by _recycle (or kept by detach, which adds the finalizer)
        data = src._alias(finalize=False)
        label = slot.label._alias(finalize=False)
        return Batch(self, data, label, plan)

    # -- the blocking form ------------------------------------------------------------
    def __enter__(self) -> Loader:
        if self._state != "unopened":
            raise StateError(f"this Loader is {self._state}; create a new one")
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        try:
            self._host_future, _ = self._portal.start_task(self._host)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal = None
            raise
        return self

    async def _host(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        self._close_requested = anyio.Event()
        async with self:
            task_status.started()
            await self._close_requested.wait()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the pipeline of the blocking form (``with`` does this). Idempotent."""
        portal = self._portal
        if portal is None:
            if self._state == "unopened":
                self._state = "closed"
                self._batches.close()
            return
        self._portal = None
        try:
            if self._close_requested is not None:
                portal.call(self._close_requested.set)
            self._host_future.result()
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __iter__(self) -> Iterator[Batch]:
        if self._portal is None:
            if self._state == "unopened":
                raise StateError(
                    "iterate a Loader inside 'with Loader(...) as loader:' "
                    "(or 'async with' in async code)"
                )
            raise StateError("this Loader is closed; create a new one to iterate again")
        return self

    def __next__(self) -> Batch:
        portal = self._portal
        if portal is None:
            raise StateError("this Loader is closed; create a new one to iterate again")
        # The fillers run under the portal's event loop; batches are taken here,
        # in the calling thread, with no round trip through the loop.
        return self._next_blocking()


def _threadsafe_caller() -> Callable[[Callable[[], object]], object]:
    """A function that schedules a callback on the running event loop from any thread
    and returns at once (asyncio's ``call_soon_threadsafe``, trio's ``run_sync_soon``).

    anyio's ``from_thread.run_sync`` would block the calling thread until the
    loop ran the callback; it is the fallback for other backends.
    """
    token = anyio.lowlevel.current_token()
    native = token.native_token
    for name in ("call_soon_threadsafe", "run_sync_soon"):
        call = getattr(native, name, None)
        if callable(call):
            return call  # type: ignore[no-any-return]

    def blocking(fn: Callable[[], object]) -> object:
        return anyio.from_thread.run_sync(fn, token=token)

    return blocking
