"""What the consumer gets: :class:`Batch` (views of a ring slot) and :class:`LoaderStatistics`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._blob import Blob
from .._io._batches import BatchPlan
from .._pool import PoolStatistics

__all__ = ["Batch", "LoaderStatistics"]

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

    With several sources (``Loader({"data": ..., "label": ...})``) each
    source's Blob is ``batch[name]``; ``batch.data`` is the source named "data"
    (else the first) and ``batch.label`` the source named "label" (else the
    data source's Datum labels). A database of BlobProto records has no
    labels: ``batch.label`` is then None.

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
        "_extra",
        "_has_label",
        "_label",
        "_name",
        "_on_detach",
        "epoch",
        "indices",
        "keys",
        "state",
        "valid",
    )

    def __init__(
        self,
        data: Blob,
        label: Blob,
        plan: BatchPlan,
        on_detach: Callable[[Batch], None] | None = None,
        extra: dict[str, Blob] | None = None,
    ) -> None:
        # on_detach: tells the loader to give the slot new buffers (called once)
        self._on_detach = on_detach
        self._data = data
        self._label = label
        self._extra = extra or {}
        self._name = plan.name
        self._has_label = plan.has_label
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
    def label(self) -> Blob | None:
        """The labels, a Blob of shape (N,): float32 (Caffe's), or int64 with
        ``label_dtype="int64"``; the source named "label" when there is one;
        None for BlobProto records without one."""
        blob = self._extra.get("label")
        if blob is None:
            if not self._has_label:
                self._data._check_open()
                return None
            blob = self._label
        blob._check_open()
        return blob

    def __getitem__(self, name: str) -> Blob:
        """The Blob of the source ``name`` (``"data"`` for a single database).

        Raises:
            KeyError: no source of that name.
            StateError: the batch was recycled.
        """
        blob = self._data if name == self._name else self._extra.get(name)
        if blob is None:
            raise KeyError(f"no source named {name!r}; this batch has {self.names}")
        blob._check_open()
        return blob

    @property
    def names(self) -> list[str]:
        """The sources' names, ``batch.data``'s first."""
        return [self._name, *self._extra]

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
            on_detach, self._on_detach = self._on_detach, None
            self._detached = True
            for blob in self._blobs():
                blob._keep()
                blob._export_readonly = False  # the caller's now
            if on_detach is not None:
                on_detach(self)
        return self

    def _recycle(self) -> None:
        if not self._detached:
            for blob in self._blobs():
                blob._retire(_RECYCLED)

    def _blobs(self) -> tuple[Blob, ...]:
        return (self._data, self._label, *self._extra.values())

    def close(self) -> None:
        """Release a detached batch's Blobs (recycled batches need nothing)."""
        if self._detached:
            for blob in self._blobs():
                blob.close()

    def __repr__(self) -> str:
        state = "recycled" if self.recycled else ("detached" if self._detached else "live")
        return f"<Batch {self._data.shape_string()} epoch {self.epoch} {state}>"
