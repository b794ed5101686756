"""The Loader: a facade over its :class:`~blobpipe._loader._pipeline.Pipeline`.

The Loader checks its arguments, builds the :class:`~blobpipe.Batches` and the
device work, and opens the pipeline on ``with``, ``async with`` or first use;
the pipeline (fillers, ring, hand-off, consumer's end) never refers back to the
Loader, so a Loader dropped while open is garbage collected and its finalizer
closes the pipeline.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from .._backends import Backend, get_backend
from .._errors import ArgumentError, StateError
from .._io._batches import Batches
from .._io._prototxt import read_data_layer
from .._io._transform import Phase, Transform
from ._batch import Batch, LoaderStatistics
from ._device import DeviceWork, wants_device_transform
from ._lifecycle import State
from ._options import BatchesOptions, check_options, signature_with_options
from ._pipeline import Pipeline

if sys.version_info >= (3, 11):
    from typing import Unpack
else:
    from typing_extensions import Unpack

__all__ = ["Loader"]


class Loader:
    """Batches from a Caffe LMDB, prefetched onto the device, for ``async for``.

    ::

        async with blobpipe.Loader("train_lmdb", batch_size=64, device="auto") as loader:
            async for batch in loader:      # batch.data, batch.label: Blobs on the device
                ...

        with blobpipe.Loader("train_lmdb", batch_size=64) as loader:   # no async
            for batch in loader:
                ...

    A Loader that was never entered opens on first use (``for``, ``async for``,
    ``next``, ``anext``) and runs until :meth:`close` / :meth:`aclose`, until it is
    garbage collected, or until the interpreter exits; ``with`` is the form that
    releases its threads and memory at a known point.

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
        ArgumentError, ArgumentTypeError: bad arguments (see
            :class:`~blobpipe.Batches`); also ValueError and TypeError.
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
            raise ArgumentError(f"Loader: prefetch must be a positive integer, got {prefetch!r}")
        if workers is None:
            workers = os.cpu_count() or 1
        if isinstance(workers, bool) or int(workers) != workers or workers < 1:
            raise ArgumentError(f"Loader: workers must be a positive integer, got {workers!r}")
        if order is None:
            order = "shuffle" if shuffle else "key"
        elif shuffle and order != "shuffle":
            raise ArgumentError(
                f"Loader: shuffle=True contradicts order={order!r} (give one of them)"
            )
        backend = get_backend(device)
        self._stream = None if stream is None else backend.as_stream(stream)

        # the split refers to no Loader (the Batches keep it): a dropped Loader is collectable
        decided: list[tuple[Transform, DeviceWork]] = []

        def split(transform: Transform, kind: str) -> Transform | None:
            """The device/host split, decided once the record kind is known."""
            if device_transform and kind != "datum":
                raise ArgumentError(
                    "Loader: device_transform=True needs Datum records; this database holds "
                    "BlobProtos (float values: there is no uint8 transfer to save)"
                )
            on_device = kind == "datum" and wants_device_transform(
                device_transform, backend, transform, device
            )
            work = DeviceWork(backend, transform, on_device)
            decided.append((transform, work))
            return work.host_transform() if on_device else None

        batches = Batches(source, batch_size, order=order, split_transform=split, **options)
        self._transform, work = decided[-1]
        self._batches = batches
        self._backend = backend
        self._device = work
        self._prefetch = int(prefetch)
        self._workers = int(workers)
        self._pipe = Pipeline(batches, backend, work, self._stream, self._prefetch, self._workers)
        # garbage collection (and the interpreter's exit) closes the pipeline
        self._finalizer = weakref.finalize(self, self._pipe.close)

    # -- construction helpers ---------------------------------------------------
    @classmethod
    def from_prototxt(
        cls, path: str | os.PathLike[str], phase: Phase | str = "train", **options: Any
    ) -> Loader:
        """A Loader configured from the ``Data`` layer of a Caffe net prototxt.

        Takes ``data_param`` (source, batch_size, prefetch; backend must be
        LMDB) and ``transform_param`` of the layer included in ``phase``
        ("train"/"test", or Caffe's "TRAIN"/"TEST"); paths are relative to the
        working directory, as in Caffe. ``options`` are other Loader keywords and
        override the prototxt (e.g. ``device="cpu"``). Like any Loader, it opens on
        first use or in ``with``.

        Raises:
            ProtoError: no Data layer for the phase, a LEVELDB backend, or a
                malformed prototxt.
            FileMissingError: the prototxt or its mean file does not exist.
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
            f"prefetch={self._prefetch} workers={self._workers} {self._pipe.lifecycle!r}>"
        )

    def statistics(self) -> LoaderStatistics:
        """Counters of the batches delivered so far (see :class:`LoaderStatistics`)."""
        return self._pipe.statistics()

    def state_dict(self) -> dict[str, Any]:
        """Resume state after the last delivered batch (before any iteration: the start).

        Batches prefetched but not delivered do not count, so a state saved at
        any time (also after :meth:`aclose`) resumes with the next batch the
        consumer would have seen. Plain JSON types: ``json.dumps`` takes it.
        """
        return dict(self._pipe.resume_state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict` or ``batch.state``): the same as
        ``Loader(..., state=state)``, for code that builds the loader before it loads
        its checkpoint. Only before the loader is opened: an open one has batches of
        the old position prefetched already.

        Raises:
            StateError: the loader was opened already.
            ArgumentError, DataError: as ``Batches.load_state_dict`` (another seed,
                order or shard; a database that changed).
        """
        lifecycle = self._pipe.lifecycle
        if lifecycle.state is not State.UNOPENED:
            raise StateError(
                f"load_state_dict needs a Loader that was not opened yet (this one is "
                f"{lifecycle!r}); create a new Loader with state=..."
            )
        self._batches.load_state_dict(state)
        self._pipe.resume_state = self._batches.state_dict()

    # -- async lifetime ------------------------------------------------------------
    async def __aenter__(self) -> Loader:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Start the pipeline. Prefer ``async with``, which does this and :meth:`aclose`.

        The fillers are plain threads: :meth:`aclose` (or :meth:`close`) may run
        in any task or thread.

        Raises:
            StateError: the loader was opened before.
        """
        await self._pipe.aopen()

    async def aclose(self) -> None:
        """Stop the pipeline: no thread left running, every block back in the pool.

        Idempotent; callable from any task, also inside ``async with``.
        """
        await self._pipe.aclose()

    def __aiter__(self) -> AsyncIterator[Batch]:
        self._pipe.lifecycle.check_closed()
        return self

    async def __anext__(self) -> Batch:
        """The next batch (recycling the previous one's buffers); the first call
        opens a Loader that was not entered.

        Raises:
            StopAsyncIteration: at the end of an epoch (``mode="epoch"``).
            BlobpipeError: the error a worker raised filling this batch (e.g. a
                DataError naming the record key and the database).
            StateError: the loader is closed or failed earlier, or was opened in
                the parent of this forked process.
        """
        pipe = self._pipe
        if pipe.lifecycle.state is State.UNOPENED:
            await pipe.aopen()
        return await pipe.next_async()

    # -- the blocking form ------------------------------------------------------------
    def __enter__(self) -> Loader:
        """Start the pipeline for ``for batch in loader``: the fillers are plain
        threads and the calling thread takes the batches, no event loop.

        Raises:
            StateError: the loader was opened before.
        """
        self._pipe.lifecycle.check_enter()
        self._pipe.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the pipeline (``with`` does this): no thread left running, every
        block back in the pool. Idempotent."""
        self._pipe.close()

    def __iter__(self) -> Iterator[Batch]:
        pipe = self._pipe
        pipe.lifecycle.check_closed()
        if pipe.lifecycle.state is State.UNOPENED:
            pipe.open()
        return self

    def __next__(self) -> Batch:
        pipe = self._pipe
        if pipe.lifecycle.state is State.UNOPENED:
            pipe.open()
        return pipe.next_blocking()


# help() and IDEs show Batches' options as Loader's keywords, with their defaults
Loader.__init__.__signature__ = signature_with_options(Loader.__init__)  # type: ignore[attr-defined]
