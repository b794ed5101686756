"""What the consumer gets: :class:`Batch`, views of a ring slot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._blob import Blob
from .._io._batches import BatchPlan

__all__ = ["Batch"]

_RECYCLED = (
    "this batch was recycled: its buffers went back to the loader when the next batch "
    "was requested; call batch.detach() to keep a batch beyond the next iteration"
)


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
        "_plan",
        "epoch",
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
        """The batch ``plan`` describes, over a ring slot's Blobs: ``data``,
        ``label`` and the other sources' ``extra`` (by name); the loader makes it.

        The batch holds views of those Blobs (:meth:`Blob.view`: no allocation),
        with read-only host exports and no finalizer: :meth:`recycle` closes
        them, or :meth:`detach` makes them the caller's (a finalizer, writable
        exports). ``on_detach`` tells the loader to give the slot new buffers
        (called once, by :meth:`detach`).

        Raises:
            StateError: one of the slot's Blobs is closed.
        """
        self._on_detach = on_detach
        views: list[Blob] = []  # without a finalizer: closed here if a later one fails
        try:
            for blob in (data, label, *(extra or {}).values()):
                views.append(blob.view(readonly_export=True, finalizer=False))
        except BaseException:
            for view in views:
                view.close()
            raise
        self._data, self._label = views[0], views[1]
        self._extra = dict(zip((extra or {}), views[2:], strict=True))
        self._name = plan.name
        self._has_label = plan.has_label
        self._detached = False
        self._plan = plan
        self.epoch: int = plan.epoch
        self.valid: int = plan.valid
        self.state: dict[str, Any] = plan.state

    @property
    def keys(self) -> tuple[bytes, ...]:
        """The records' keys, row by row."""
        return self._plan.keys

    @property
    def indices(self) -> tuple[int, ...]:
        """The records' global indices (position in key order), row by row."""
        return tuple(self._plan.indices.tolist())

    @property
    def data(self) -> Blob:
        """The batch's data Blob (N×C×H×W, or NHWC)."""
        self._data.check_open()
        return self._data

    @property
    def label(self) -> Blob | None:
        """The labels, a Blob of shape (N,): float32 (Caffe's), or int64 with
        ``label_dtype="int64"``; the source named "label" when there is one;
        None for BlobProto records without one."""
        blob = self._extra.get("label")
        if blob is None:
            if not self._has_label:
                self._data.check_open()
                return None
            blob = self._label
        blob.check_open()
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
        blob.check_open()
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
        return len(self._plan)

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
                blob.add_finalizer()
                blob.readonly_export = False  # the caller's now
            if on_detach is not None:
                on_detach(self)
        return self

    def recycle(self) -> None:
        """Close the batch's Blobs unless the batch was detached: every later use of
        them raises StateError saying the batch was recycled.

        The loader calls it when the next batch is requested, before it refills
        the slot. Idempotent; arrays already taken from the Blobs stay valid
        views of the loader's buffers.
        """
        if not self._detached:
            for blob in self._blobs():
                blob.close(_RECYCLED)

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
