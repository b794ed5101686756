"""The Loader: a facade that builds the Batches, the device work and the pipeline, and
reports on them; its two forms (its bases ``AsyncForm`` and ``BlockingForm``) drive the
pipeline. Nothing the pipeline holds refers back to the Loader, so a Loader dropped
while open is garbage collected and its finalizer closes the pipeline.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Literal

from .._backends import Backend, get_backend
from .._errors import ArgumentError
from .._io._batches import Batches
from .._io._options import PassThroughKeywords, Unpack, signature_with_options, with_options_doc
from .._io._prototxt import read_data_layer
from .._io._transform import Phase, Transform
from ._async import AsyncForm
from ._blocking import BlockingForm
from ._device import DeviceWork
from ._options import LOADER_DECIDES, check_loader_args, split_on_device
from ._pipeline import Pipeline
from ._stats import LoaderStatistics

__all__ = ["Loader"]


class Loader(AsyncForm, BlockingForm):
    """Batches from a Caffe LMDB, prefetched onto the device, for ``async for`` or ``for``.

    ::

        async with blobpipe.Loader("train_lmdb", batch_size=64, device="auto") as loader:
            async for batch in loader:      # batch.data, batch.label: Blobs on the device
                ...

        with blobpipe.Loader("train_lmdb", batch_size=64) as loader:   # no async
            for batch in loader:
                ...

    A Loader never entered opens on first use (``for``, ``async for``, ``next``,
    ``anext``) and runs until :meth:`close` / :meth:`aclose`, garbage collection or
    the interpreter's exit; ``with`` releases its threads and memory at a known point.
    ``async for`` waits for a batch that is not there yet in the event loop's thread
    for up to 5 ms at a time with a turn of the loop (a checkpoint: cancellable)
    between, then through the loop; it hands out a batch that is there without a
    checkpoint for up to 5 ms of the caller's time, then with one: a body that never
    awaits is still cancelled within 5 ms.

    Args:
        source: an LMDB or LevelDB path (or an open :class:`~blobpipe.LmdbReader`,
            :class:`~blobpipe.LevelDbReader`, :class:`~blobpipe.ImageList`); a list of
            them, read as one dataset; or named sources read in lockstep,
            ``{"data": images, "label": label_maps}`` (see :class:`~blobpipe.Batches`).
        batch_size: records per batch.
        device: "auto" (the current CUDA device when CuPy sees a GPU, else the host),
            "cpu", "cuda" (the calling thread's current CUDA device, as torch's),
            "cuda:N", or a Backend (e.g. the emulated device in tests).
        prefetch: batch slots in the ring (Caffe's PREFETCH_COUNT). Small batches
            are filled a chunk of up to 16 at a time straight into their slots and
            handed over together: of raw records (from the second epoch on, batches
            of up to 4 MiB, a chunk up to 16 MiB), the consumer's thread plans each
            chunk when it asks for a batch (no filler's Python competes with it for
            the GIL) and native threads write the rows meanwhile, up to two chunks
            ahead; the ring then grows to ``3 * chunk + 1`` slots (up to 48 MiB and
            a batch). Where the fillers fill the chunks (other records, or no
            compiled row kernel: a few batches together under 4 MiB), to ``2 * chunk
            + 1`` (``statistics().slots``).
        order: "key" (Caffe), "shuffle", "buffer" (with ``buffer_size``) or "quasi".
        shuffle: shorthand for ``order="shuffle"``.
        workers: the worker-thread limit (default: the CPU count): ``min(workers,
            prefetch)`` threads fill batches, one each (raise ``prefetch`` for more);
            of small raw batches, ``min(workers, 2)`` native threads, at most one
            fewer than the CPUs, write chunks, and the consumer's thread with them
            while it waits for one.
        device_transform: mean/scale/float conversion on the device, from uint8
            transfers (4× less traffic). Default: on with a device and a float32
            transform; records holding float_data need it off.
        stream: the stream of the consumer's device work on batches (CuPy's, torch's,
            a ``cudaStream_t`` handle or a backend's; default: the consumer's current one
            when it asks for the next batch): a batch's buffers are refilled only after
            the work queued there before the consumer let it go ("Streams", README).
        **options: :class:`~blobpipe.Batches`' keyword options, with its defaults and
            checks, but ``order`` (above) and ``split_transform`` (``device_transform``).

    Keyword options (passed to :class:`~blobpipe.Batches`):
        {options}

    Raises:
        ArgumentError, ArgumentTypeError: bad arguments (see :class:`~blobpipe.Batches`);
            also ValueError and TypeError.
        BackendUnavailableError: ``device="cuda"`` without CuPy or a GPU, or a
            ``stream`` on a backend without a device.
        DatabaseNotFoundError: the database does not exist, or the directory is
            neither an LMDB nor a LevelDB.
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
        **options: Unpack[PassThroughKeywords],
    ) -> None:
        prefetch, workers, order = check_loader_args(options, prefetch, workers, order, shuffle)
        self._backend = backend = get_backend(device)
        own_stream = None if stream is None else backend.as_stream(stream)
        split = split_on_device(device_transform, backend, device)
        self._batches = Batches(source, batch_size, order=order, split_transform=split, **options)
        whole = self._batches.split_from  # a device finishes the host half's rows
        if device_transform and whole is None and self._batches.record_kind() != "datum":
            self._batches.close()
            raise ArgumentError(
                "Loader: device_transform=True needs Datum records; this database holds "
                "BlobProtos (float values: there is no uint8 transfer to save)"
            )
        self._transform = self._batches.transform if whole is None else whole
        self._device = DeviceWork(backend, self._transform, whole is not None)
        self._prefetch, self._workers = prefetch, workers
        self._pipe = Pipeline(self._batches, backend, self._device, own_stream, prefetch, workers)
        super().__init__()  # the async form's state
        # garbage collection (and the interpreter's exit) closes the pipeline
        self._finalizer = weakref.finalize(self, self._pipe.close)

    @classmethod
    def from_prototxt(
        cls, path: str | os.PathLike[str], phase: Phase | str = "train", **options: Any
    ) -> Loader:
        """A Loader from the data layer of a Caffe net prototxt for ``phase``
        ("train"/"test", or Caffe's "TRAIN"/"TEST"): a ``Data`` layer's ``data_param``
        (source, an LMDB or a LevelDB as ``backend`` says, batch_size, prefetch), an
        ``ImageData`` layer's ``image_data_param`` (a list file and its images), an
        ``HDF5Data`` layer's ``hdf5_data_param`` (a list of ``.h5`` files; each top a
        dataset, ``batch["name"]``), with ``transform_param``. Paths are relative to
        the working directory, as in Caffe; ``options`` (Loader keywords) override it.

        Raises:
            ProtoError: no data layer for the phase, a backend that is not what the
                source holds, a bad prototxt.
            FileMissingError: the prototxt, its mean file or its list file does not
                exist.
            DataError: an ImageData or HDF5Data layer's list, or an ``.h5`` file,
                cannot be used.
            MissingDependencyError: an HDF5Data layer without h5py.

        Warns:
            UserWarning: the layer sets ``rand_skip``, which blobpipe does not apply.
        """
        config = read_data_layer(path, phase)
        if config.rand_skip:
            warnings.warn(
                f"{os.fspath(path)}: rand_skip: {config.rand_skip} is not applied (Caffe "
                "starts at a random line to spread asynchronous solvers); every epoch starts "
                "at the first record: pass shuffle=True, or shard='auto' for several ranks",
                UserWarning,
                stacklevel=2,
            )
        kwargs = config.batches_kwargs()
        source = kwargs.pop("source")
        kwargs.pop("mode")
        if kwargs.pop("order") == "shuffle" and "order" not in options:
            options.setdefault("shuffle", True)
        kwargs |= {"prefetch": config.prefetch, **options}
        return cls(kwargs.pop("source", source), **kwargs)

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
        return self._pipe.statistics(self._backend)

    def state_dict(self) -> dict[str, Any]:
        """Resume state after the last delivered batch (before any: the start), saved
        at any time (also after :meth:`aclose`): batches prefetched but not delivered
        do not count. Plain JSON types: ``json.dumps`` takes it."""
        return dict(self._pipe.resume_state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (:meth:`state_dict`, ``batch.state``) as
        ``Loader(..., state=state)`` does; only before the loader is opened.

        Raises:
            StateError: the loader was opened already.
            ArgumentError, DataError: as ``Batches.load_state_dict`` (another seed,
                order or shard; a database that changed).
        """
        self._pipe.load_state(state)


Loader.__doc__ = with_options_doc(Loader.__doc__, LOADER_DECIDES)
# help() and IDEs show Batches' options as Loader's keywords, with their defaults
Loader.__init__.__signature__ = signature_with_options(  # type: ignore[attr-defined]
    Loader.__init__, LOADER_DECIDES
)
