"""What the consumer gets: :class:`Batch`, views of a ring slot."""

from __future__ import annotations

import warnings
from typing import Any

from .._blob import Blob
from .._io._batches import BatchPlan
from ._ring import Lease

__all__ = ["Batch"]

_CLOSED = (
    "this batch was closed (batch.close()); keep the batch, or arrays taken from it, "
    "instead of closing it, to use its data later"
)
_DETACH = (
    "batch.detach() is no longer needed: a batch you keep (or any array or export taken "
    "from it) is never overwritten, the loader refills its memory only once nothing "
    "references it; keep the batch itself"
)
_RECYCLED_PROPERTY = "batch.recycled is deprecated: a batch is never recycled; use batch.closed"


class Batch:
    """One batch from a :class:`Loader`.

    ``data`` and ``label`` are Blobs whose head is on the loader's device
    (``SYNCED`` or ``HEAD_AT_GPU`` on CUDA, ``HEAD_AT_CPU`` on the host):
    ``batch.data.gpu_data()`` is a CuPy array, ``batch.data.cpu_data()`` a NumPy
    array, and ``torch.from_dlpack(batch.data)`` works without a copy.

    The batch's memory is a slot of the loader's ring, shared without a copy
    with everything taken from it: the Blobs, ``cpu_data()`` / ``gpu_data()``
    arrays and DLPack exports (NumPy, torch, CuPy, JAX). The loader refills the
    slot only once none of them is referenced any more, so nothing you keep is
    ever overwritten, and a loop that keeps nothing reuses the same memory
    batch after batch. Batches you keep hold their memory until you drop them
    (``loader.statistics().held_batches``); :meth:`close` lets one go early.

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
        "_extra",
        "_has_label",
        "_label",
        "_lease",
        "_name",
        "_plan",
        "valid",
    )

    def __init__(
        self,
        data: Blob,
        label: Blob,
        plan: BatchPlan,
        lease: Lease,
        extra: dict[str, Blob] | None = None,
    ) -> None:
        """The batch ``plan`` describes, over a ring slot's Blobs: ``data``,
        ``label`` and the other sources' ``extra`` (by name); the loader makes it.

        The batch holds views of those Blobs (:meth:`Blob.view`: no allocation),
        with read-only host exports, each keeping ``lease`` (the slot's
        :class:`~blobpipe._loader._ring.Lease`) referenced, as does every array
        made from them. The views borrow the slot Blobs' memories (no references
        of their own, nothing to release): the lease holds the slot, so the
        memories live while anything made from the batch does.

        Raises:
            StateError: one of the slot's Blobs is closed.
        """
        data_view = data.view(readonly_export=True, owner=lease, borrow=True)
        label_view = label.view(readonly_export=True, owner=lease, borrow=True)
        self._extra = (
            {
                name: blob.view(readonly_export=True, owner=lease, borrow=True)
                for name, blob in extra.items()
            }
            if extra
            else {}
        )
        self._data, self._label = data_view, label_view
        self._lease: Lease | None = lease
        self._name = plan.name
        self._has_label = plan.has_label
        self._plan = plan
        self.valid: int = plan.valid

    @property
    def epoch(self) -> int:
        """The epoch of the first row."""
        return self._plan.epoch

    @property
    def state(self) -> dict[str, Any]:
        """The resume state after this batch (``Loader(..., state=...)``)."""
        return self._plan.state

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
            StateError: the batch was closed.
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
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._data.closed

    @property
    def recycled(self) -> bool:
        """Deprecated: a batch is never recycled; :attr:`closed`."""
        warnings.warn(_RECYCLED_PROPERTY, DeprecationWarning, stacklevel=2)
        return self.closed

    def __len__(self) -> int:
        return len(self._plan)

    def detach(self) -> Batch:
        """Deprecated, and no longer needed: keeping the batch keeps it. Returns the
        batch itself.

        Raises:
            StateError: the batch was closed.
        """
        warnings.warn(_DETACH, DeprecationWarning, stacklevel=2)
        self.data  # noqa: B018 - raises when closed
        return self

    def _blobs(self) -> tuple[Blob, ...]:
        return (self._data, self._label, *self._extra.values())

    def close(self) -> None:
        """Let the batch go now, rather than when it is no longer referenced: its Blobs
        raise StateError from then on. Arrays and exports already taken from it
        keep its memory (and their values) while they live; the loader refills
        the slot once they are gone too. Idempotent."""
        for blob in self._blobs():
            blob.close(_CLOSED)
        self._lease = None

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<Batch {self._data.shape_string()} epoch {self.epoch}{state}>"
