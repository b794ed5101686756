"""Batches of records from an LMDB, as Caffe's DataLayer builds them.

Two low-level pieces, on which the synchronous iterator and the async loader
are both built:

* :meth:`Batches.next_plan` (cheap, single consumer) decides the next batch:
  its records (key, global index, epoch, position in the epoch), the random word
  of each record, and the output shape. It advances the cursor.
* :meth:`Batches.fill` (thread-safe, no shared mutable state besides the reader)
  reads, decodes and transforms rows ``[start:stop]`` of a plan into caller-owned
  arrays. Several threads may fill disjoint row ranges of one plan at once.

The batch shape is that of the plan's first record: :meth:`next_plan` reads it
(an LMDB get and a header parse for raw Datums; a full image decode for encoded
ones, so run ``next_plan`` off the event loop when records are encoded) and keeps
the decoded record in the plan, so filling row 0 does not decode it again.

How a loader drives them (``data``/``label`` preallocated, e.g. pinned)::

    plan = batches.next_plan()        # one consumer; None = end of epoch ("epoch" mode)
    data = slot.data_for(plan.data_shape, plan.dtype)      # any writable array
    label = slot.label[: len(plan)]                         # float32
    chunks = [(0, 64), (64, 128), (128, 192), (192, 256)]
    futures = [pool.submit(batches.fill, plan, data, label, lo, hi) for lo, hi in chunks]
    ...                               # wait; rows >= plan.valid are padding
    checkpoint = plan.state           # resume here once this batch is consumed

Record order within an epoch
----------------------------
The database's keys are numbered ``0..n-1`` in key (byte) order: a record's
*global index*. Each epoch has a global order — key order (``order="key"``,
Caffe), a permutation seeded by ``(seed, epoch)`` (``order="shuffle"``), or a
shuffle buffer of ``buffer_size`` records run over key order with the same seed
(``order="buffer"``) — which is then sharded: ``shard_mode="strided"`` gives
rank ``r`` the positions ``r, r + world, ...`` (Caffe's multi-GPU solver,
PyTorch's DistributedSampler), ``"contiguous"`` splits it into ``world`` runs
whose lengths differ by at most one. Every rank computes the same global order,
so shards are disjoint and together cover every record.

Randomness of a record (crop offset, mirror) depends only on
``(seed, epoch, global index)`` — not on the order, the shard or the thread.

Which JPEG decoder
------------------
Both give OpenCV's pixels (``_image.py``); what differs is how they share the
GIL between worker threads. simplejpeg releases it twice per image (header,
then pixels), OpenCV once; after the short first release a thread must wait
for the other's Python before it can go on. Where images are decoded one after
another with little Python between them — known records (``_decode_indexed``)
and first reads of a batch led by an encoded record, checked first and then
decoded in one run (``_fill_encoded``, ``_fill_encoded_each``) — simplejpeg is
used, ~1.5× faster per image. Where each record's checks sit between two
decodes (the per-row path: single rows, rows that failed the batch forms)
OpenCV decodes:
there simplejpeg with two workers measured 0.69–1.44× a plain loop on first
epochs, OpenCV 1.37–1.47×.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, Literal, Protocol, cast

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import as_strided, sliding_window_view

from .._errors import BlobpipeError, DataError, ShapeError, StateError
from ._datum import (
    DEFAULT_MAX_PIXELS,
    ParsedDatum,
    _image_header,
    _imread_flag,
    _view,
    copy_raw,
    gather_raw,
    parse_datum,
    raw_block,
)
from ._image import (
    COLORSPACE,
    JpegFrame,
    _opencv,
    decode_jpeg,
    fast_decoder,
    jpeg_channels,
    jpeg_sampling,
)
from ._index import IndexedRows, RecordIndex
from ._lmdb import LmdbReader
from ._lmdbfile import value_extents
from ._transform import Phase, Transform, _check_phase

__all__ = ["ArrayBatch", "BatchPlan", "Batches", "RecordSource"]

Order = Literal["key", "shuffle", "buffer"]
Mode = Literal["wrap", "epoch"]
Last = Literal["keep", "drop", "pad"]
ShardMode = Literal["strided", "contiguous"]

_STATE_VERSION = 1
_U1 = np.dtype(np.uint8)


class RecordSource(Protocol):
    """What Batches needs from a reader (:class:`LmdbReader` provides it)."""

    def keys(self) -> Sequence[bytes]:
        """All keys, in key order."""
        ...

    def get(self, key: bytes) -> bytes:
        """The value stored under ``key``.

        A source may also offer ``transaction()``, a context manager whose ``get``
        returns views valid inside the block (as :class:`LmdbReader` does);
        :meth:`Batches.fill` then reads without copying.
        """
        ...


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """What one batch will hold; made by :meth:`Batches.next_plan`.

    Row ``i`` is record ``keys[i]`` (global index ``indices[i]``, from epoch
    ``epochs[i]`` at position ``positions[i]`` of that epoch's order for this
    shard), transformed with random word ``words[i]``. Rows ``>= valid`` are
    padding (``last="pad"``): repeats of the epoch's first records.

    Attributes:
        keys, indices, epochs, positions, words: one entry per row.
        valid: the number of real (non-padding) rows.
        record_shape: the first record's ``(C, H, W)`` before the transform.
        data_shape: the batch array's shape, ``(N, C, h, w)`` or ``(N, h, w, C)``.
        dtype: the batch array's dtype (float32, or uint8 for raw pixels).
        state: the resume state after this batch (see :meth:`Batches.state_dict`).
    """

    keys: tuple[bytes, ...]
    indices: tuple[int, ...]
    epochs: tuple[int, ...]
    positions: tuple[int, ...]
    words: tuple[int, ...]
    valid: int
    record_shape: tuple[int, int, int]
    data_shape: tuple[int, ...]
    dtype: np.dtype[Any]
    state: dict[str, Any]
    _first: tuple[np.ndarray, int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def epoch(self) -> int:
        """The epoch of the first row."""
        return self.epochs[0]


@dataclass(frozen=True, eq=False)
class ArrayBatch:
    """One batch of transformed records.

    Attributes:
        data: ``(N, C, h, w)`` (or NHWC) float32, or uint8 with ``dtype="uint8"``.
        label: ``(N,)`` float32 labels, as Caffe outputs them.
        keys: the records' keys, row by row.
        indices: the records' global indices (position in key order).
        epoch: the epoch of the first row (in ``mode="wrap"`` a batch may run into
            the next epoch; see ``plan.epochs``).
        valid: the number of real rows; rows ``>= valid`` are padding.
        state: the resume state after this batch.
        plan: the plan the batch was built from.
    """

    data: np.ndarray
    label: npt.NDArray[np.float32]
    keys: list[bytes]
    indices: tuple[int, ...]
    epoch: int
    valid: int
    state: dict[str, Any]
    plan: BatchPlan = field(repr=False)


def _shard_from(shard: tuple[int, int] | Literal["auto"] | None) -> tuple[int, int]:
    if shard is None:
        return (0, 1)
    if shard == "auto":
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        if rank is None or world is None:
            return (0, 1)
        try:
            shard = (int(rank), int(world))
        except ValueError:
            raise ValueError(
                f"shard='auto' needs integer RANK and WORLD_SIZE, got RANK={rank!r} "
                f"WORLD_SIZE={world!r}"
            ) from None
    if not (isinstance(shard, tuple) and len(shard) == 2):
        raise TypeError(f"shard must be None, 'auto' or (rank, world_size), got {shard!r}")
    rank_i, world_i = int(shard[0]), int(shard[1])
    if world_i < 1 or not 0 <= rank_i < world_i:
        raise ValueError(f"shard (rank, world_size) must have 0 <= rank < world_size, got {shard}")
    return (rank_i, world_i)


def _buffer_order(n: int, size: int, rng: np.random.Generator) -> npt.NDArray[np.int64]:
    """Key order passed through a shuffle buffer of ``size`` records."""
    picks = rng.integers(0, 1 << 62, size=n).tolist()
    buf = list(range(min(size, n)))
    nxt = len(buf)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        j = picks[i] % len(buf)
        out[i] = buf[j]
        if nxt < n:
            buf[j] = nxt
            nxt += 1
        else:
            buf[j] = buf[-1]
            buf.pop()
    return out


class Batches:
    """Batches of records from an LMDB of Caffe Datums, like Caffe's DataLayer.

    Args:
        source: an LMDB path (opened, and closed by :meth:`close`) or an open
            reader (left open).
        batch_size: records per batch.
        transform: the :class:`Transform` (default: none, float32 NCHW output).
        phase: "train" (random crops) or "test" (centre crops); mirror is random
            in both when enabled, as in Caffe.
        order: "key" (Caffe), "shuffle" (a global permutation per epoch, seeded
            by ``(seed, epoch)``) or "buffer" (a shuffle buffer of ``buffer_size``
            records over key order: reads stay near each other).
        buffer_size: the shuffle buffer's size; only with ``order="buffer"``.
        seed: seeds the shuffle and the per-record randomness.
        shard: ``None``, ``(rank, world_size)`` or "auto" (``RANK``/``WORLD_SIZE``
            environment variables as torchrun sets them; absent: no sharding).
        shard_mode: "strided" (record position ``i`` goes to rank ``i % world``)
            or "contiguous".
        pad_shards: give every rank ``ceil(n / world)`` records, repeating records
            from the start of the epoch's order, as torch's DistributedSampler
            does, so all ranks see the same number of batches (distributed
            training needs it: a rank with one batch fewer blocks the others at
            the last all-reduce). Off: shards are disjoint and cover every record
            once, and may differ in length by one.
        mode: "wrap" (Caffe: the cursor wraps to the start mid-batch, every batch
            is full, iteration is endless) or "epoch" (iteration stops at the end
            of each epoch; iterate again for the next epoch).
        last: with ``mode="epoch"``, the last partial batch is kept (smaller),
            dropped, or padded to ``batch_size`` with the epoch's first records
            (``batch.valid`` counts the real rows).
        readahead: passed to the LMDB reader (OS readahead; off suits random
            access).
        state: a :meth:`state_dict` to resume from.

    Raises:
        ValueError: a bad argument (batch size, order, mode, last, shard...).
        TypeError: ``shard`` of the wrong type.
        DatabaseNotFoundError: ``source`` does not exist.
        DataError: the database is empty, this shard holds no records, or the
            resume state does not match the database.

    Not thread-safe for planning: one consumer calls :meth:`next_plan`; any
    number of threads may call :meth:`fill`.

    Reading an LMDB, :meth:`fill` maps its data file read-only and learns where
    each record lies the first time a batch reads it (``_index.py``); later
    batches of known records are read from the map with no LMDB lookup and no
    parse. The database must not be written while it is open.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | RecordSource,
        batch_size: int,
        *,
        transform: Transform | None = None,
        phase: Phase = "train",
        order: Order = "key",
        buffer_size: int | None = None,
        seed: int = 0,
        shard: tuple[int, int] | Literal["auto"] | None = None,
        shard_mode: ShardMode = "strided",
        pad_shards: bool = False,
        mode: Mode = "wrap",
        last: Last = "keep",
        readahead: bool = False,
        state: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self._phase = _check_phase(phase)
        if order not in ("key", "shuffle", "buffer"):
            raise ValueError(f"order must be 'key', 'shuffle' or 'buffer', got {order!r}")
        if order == "buffer":
            if buffer_size is None or buffer_size < 1:
                raise ValueError(
                    f"order='buffer' needs buffer_size >= 1, got buffer_size={buffer_size!r}"
                )
        elif buffer_size is not None:
            raise ValueError(f"buffer_size is only used with order='buffer', not {order!r}")
        if mode not in ("wrap", "epoch"):
            raise ValueError(f"mode must be 'wrap' or 'epoch', got {mode!r}")
        if last not in ("keep", "drop", "pad"):
            raise ValueError(f"last must be 'keep', 'drop' or 'pad', got {last!r}")
        if shard_mode not in ("strided", "contiguous"):
            raise ValueError(f"shard_mode must be 'strided' or 'contiguous', got {shard_mode!r}")
        if int(seed) != seed or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        self._rank, self._world = _shard_from(shard)
        self._batch_size = int(batch_size)
        self._transform = transform if transform is not None else Transform()
        self._order: Order = order
        self._buffer_size = buffer_size
        self._seed = int(seed)
        self._shard_mode: ShardMode = shard_mode
        self._pad_shards = bool(pad_shards)
        self._mode: Mode = mode
        self._last: Last = last

        if isinstance(source, (str, os.PathLike)):
            self._reader: RecordSource = LmdbReader(source, readahead=readahead)
            self._owned = True
            self._path: object = os.fspath(source)
        else:
            self._reader = source
            self._owned = False
            self._path = getattr(source, "path", None)
        keys = self._reader.keys()
        if not isinstance(self._reader, LmdbReader):  # LmdbReader's keys are bytes already
            keys = tuple(bytes(k) for k in keys)
        self._keys = keys
        self._n = len(self._keys)
        self._closed = False
        self._index: RecordIndex | None = None
        self._index_tried = False
        self._blocks: dict[tuple[tuple[int, int, int], bool], _Block | None] = {}
        self._index_lock = threading.Lock()
        try:
            if self._n == 0:
                raise DataError("the database holds no records", path=self._path)
            self._shard_len = len(self._shard_positions(self._n))
            if self._shard_len == 0:
                raise DataError(
                    f"shard rank {self._rank} of {self._world} holds no records "
                    f"(the database has {self._n})",
                    path=self._path,
                )
            if mode == "epoch" and last == "drop" and self._shard_len < self._batch_size:
                raise ValueError(
                    f"with last='drop', a shard of {self._shard_len} records never fills a "
                    f"batch of {self._batch_size}: every epoch would be empty; use "
                    "last='keep' or last='pad', or a smaller batch_size"
                )
            self._orders: dict[int, npt.NDArray[np.int64]] = {}
            self._epoch = 0
            self._pos = 0
            self._end_pending = False
            if state is not None:
                self.load_state_dict(state)
        except BaseException:
            self.close()
            raise

    # -- properties ---------------------------------------------------------------------

    @property
    def path(self) -> object:
        """The database path (None for a source that has none)."""
        return self._path

    @property
    def transform(self) -> Transform:
        """The transform applied to every record."""
        return self._transform

    @property
    def batch_size(self) -> int:
        """Records per batch."""
        return self._batch_size

    @property
    def phase(self) -> Phase:
        """ "train" or "test"."""
        return self._phase

    @property
    def num_records(self) -> int:
        """Records in the database."""
        return self._n

    @property
    def shard(self) -> tuple[int, int]:
        """``(rank, world_size)``; ``(0, 1)`` without sharding."""
        return (self._rank, self._world)

    @property
    def records_per_epoch(self) -> int:
        """Records this shard visits per epoch."""
        return self._shard_len

    @property
    def epoch(self) -> int:
        """The epoch of the next record to plan."""
        return self._epoch

    def __len__(self) -> int:
        """Batches per epoch (``mode="epoch"`` only).

        Raises:
            TypeError: in ``mode="wrap"``, which is endless.
        """
        if self._mode != "epoch":
            raise TypeError("Batches in mode='wrap' are endless and have no length")
        if self._last == "drop":
            return self._shard_len // self._batch_size
        return math.ceil(self._shard_len / self._batch_size)

    # -- order -----------------------------------------------------------------------------

    def _shard_positions(self, n: int) -> npt.NDArray[np.int64]:
        """Positions of the epoch's global order that this shard visits, in order."""
        rank, world = self._rank, self._world
        if self._pad_shards:
            # torch's DistributedSampler: every rank gets ceil(n / world) positions,
            # the order wrapping around to its start to fill the last ones.
            per = -(-n // world)
            if self._shard_mode == "strided":
                return np.arange(rank, per * world, world, dtype=np.int64) % n
            return (rank * per + np.arange(per, dtype=np.int64)) % n
        if self._shard_mode == "strided":
            return np.arange(rank, n, world, dtype=np.int64)
        base, extra = divmod(n, world)
        start = rank * base + min(rank, extra)
        return np.arange(start, start + base + (1 if rank < extra else 0), dtype=np.int64)

    def epoch_order(self, epoch: int) -> npt.NDArray[np.int64]:
        """The global indices this shard visits in ``epoch``, in order (read-only)."""
        cached = self._orders.get(epoch)
        if cached is not None:
            return cached
        n = self._n
        if self._order == "key":
            glob = np.arange(n, dtype=np.int64)
        else:
            rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([self._seed, epoch])))
            if self._order == "shuffle":
                glob = rng.permutation(n).astype(np.int64)
            else:
                glob = _buffer_order(n, cast(int, self._buffer_size), rng)
        order = np.ascontiguousarray(glob[self._shard_positions(n)])
        order.setflags(write=False)
        if len(self._orders) >= 2:
            self._orders.pop(min(self._orders))
        self._orders[epoch] = order
        return order

    # -- resume ------------------------------------------------------------------------------

    def _state(self, epoch: int, pos: int) -> dict[str, Any]:
        key = self._keys[int(self.epoch_order(epoch)[pos])]
        return {
            "version": _STATE_VERSION,
            "epoch": epoch,
            "position": pos,
            "key": bytes(key),
            "seed": self._seed,
            "order": self._order,
            "buffer_size": self._buffer_size,
            "shard": (self._rank, self._world),
            "shard_mode": self._shard_mode,
            "pad_shards": self._pad_shards,
            "num_records": self._n,
        }

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: the next record to plan, and how the order is made.

        Keys: ``epoch``, ``position`` (in this shard's order of that epoch), ``key``
        (the record at that position, checked on restore), ``seed``, ``order``,
        ``buffer_size``, ``shard``, ``shard_mode``, ``num_records``, ``version``.
        Plain Python values (bytes for the key), picklable. After the last batch of
        an epoch it points at the start of the next epoch.
        """
        return self._state(self._epoch, self._pos)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict` or ``plan.state``).

        The cursor seeks directly to the saved position; nothing is replayed.

        Raises:
            ValueError: the state was saved with another seed, order, buffer size or
                shard, or is malformed.
            DataError: the database changed (other record count, or another key at
                the saved position).
        """
        try:
            version = state["version"]
            epoch, pos, key = int(state["epoch"]), int(state["position"]), state["key"]
            saved = {k: state[k] for k in ("seed", "order", "buffer_size", "shard_mode")}
            saved["pad_shards"] = bool(state.get("pad_shards", False))
            saved_shard = tuple(state["shard"])
            n = int(state["num_records"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed Batches state {state!r}: {exc!r}") from exc
        if version != _STATE_VERSION:
            raise ValueError(f"unsupported Batches state version {version!r}")
        mine = {
            "seed": self._seed,
            "order": self._order,
            "buffer_size": self._buffer_size,
            "shard_mode": self._shard_mode,
            "pad_shards": self._pad_shards,
        }
        for name, value in saved.items():
            if mine[name] != value:
                raise ValueError(
                    f"the state was saved with {name}={value!r} but these Batches have "
                    f"{name}={mine[name]!r}; use the same settings to resume"
                )
        if saved_shard != (self._rank, self._world):
            raise ValueError(
                f"the state was saved for shard {saved_shard} but these Batches are shard "
                f"{(self._rank, self._world)}"
            )
        if n != self._n:
            raise DataError(
                f"the dataset changed: the state was saved with {n} records, the database "
                f"now has {self._n}",
                path=self._path,
            )
        if epoch < 0 or not 0 <= pos < self._shard_len:
            raise ValueError(
                f"the state's epoch {epoch} / position {pos} is out of range "
                f"(this shard has {self._shard_len} records per epoch)"
            )
        actual = bytes(self._keys[int(self.epoch_order(epoch)[pos])])
        if actual != key:
            raise DataError(
                f"the dataset changed: position {pos} of epoch {epoch} holds key {actual!r}, "
                f"the state expected {key!r}",
                path=self._path,
            )
        self._epoch, self._pos, self._end_pending = epoch, pos, False

    # -- planning -----------------------------------------------------------------------------

    def next_plan(self) -> BatchPlan | None:
        """Plan the next batch and advance the cursor past it.

        Returns ``None`` once at the end of each epoch in ``mode="epoch"`` (the
        cursor is then at the start of the next epoch); never in ``mode="wrap"``.
        Reads the first record of the batch to learn its shape.

        Raises:
            StateError: after :meth:`close`.
            DataError: the first record cannot be read or decoded, or does not fit
                the transform (the cursor has moved past the batch anyway).
        """
        self._check_open()
        if self._end_pending:
            self._end_pending = False
            return None
        bs, size = self._batch_size, self._shard_len
        runs: list[tuple[int, int, int]] = []  # (epoch, first position, stop position)
        epoch, pos = self._epoch, self._pos
        valid: int
        if self._mode == "wrap":
            left = bs
            while left:
                take = min(left, size - pos)
                runs.append((epoch, pos, pos + take))
                left -= take
                pos += take
                if pos == size:
                    epoch, pos = epoch + 1, 0
            valid = bs
        else:
            count = min(bs, size - pos)
            if count < bs and self._last == "drop":
                self._epoch, self._pos = epoch + 1, 0
                return None
            runs.append((epoch, pos, pos + count))
            valid = count
            if count < bs and self._last == "pad":
                left = bs - count
                while left:  # the epoch's first records, again
                    take = min(left, size)
                    runs.append((epoch, 0, take))
                    left -= take
            pos += count
            if pos == size or (self._last == "drop" and size - pos < bs):
                # the epoch ends here (a tail shorter than a batch is dropped): the
                # resume state already points at the next epoch
                epoch, pos = epoch + 1, 0
                self._end_pending = True
        self._epoch, self._pos = epoch, pos
        state = self._state(epoch, pos)

        indices_list: list[int] = []
        epochs_list: list[int] = []
        positions_list: list[int] = []
        for e, a, b in runs:
            indices_list.extend(self.epoch_order(e)[a:b].tolist())
            epochs_list.extend([e] * (b - a))
            positions_list.extend(range(a, b))
        indices = tuple(indices_list)
        epochs = tuple(epochs_list)
        all_keys = self._keys
        keys = itemgetter(*indices)(all_keys) if len(indices) > 1 else (all_keys[indices[0]],)
        t = self._transform
        if t.needs_random:
            seed = self._seed
            words = tuple(Transform.draw(seed, e, i) for e, i in zip(epochs, indices, strict=True))
        else:
            words = (0,) * len(indices)
        index = self._index
        known = index.shape_of(indices[0]) if index is not None else None
        first: tuple[np.ndarray, int] | None = None
        if known is not None:
            record_shape = known  # read and checked before: fill() reads it from the index
        else:
            first = self._read(keys[0], learn=indices[0])
            record_shape = cast(tuple[int, int, int], tuple(first[0].shape))
        try:
            # validates the record against the transform and caches what fill needs
            out_shape = t._shape_info(record_shape, self._phase).out_shape
        except ShapeError as exc:
            raise DataError(str(exc), path=self._path, key=keys[0]) from exc
        return BatchPlan(
            keys=keys,
            indices=indices,
            epochs=epochs,
            positions=tuple(positions_list),
            words=words,
            valid=valid,
            record_shape=record_shape,
            data_shape=(len(indices), *out_shape),
            dtype=t.dtype,
            state=state,
            _first=first,
        )

    def _read(
        self,
        key: bytes,
        get: Callable[[bytes], bytes | memoryview] | None = None,
        learn: int | None = None,
    ) -> tuple[np.ndarray, int]:
        """Record ``key``'s ``(C, H, W)`` pixels and label, checked; an encoded one
        is noted in the record index as record ``learn``."""
        t = self._transform
        buf = (get or self._reader.get)(key)
        # OpenCV decodes on the checked paths ("Which JPEG decoder" above)
        flag = _imread_flag(t.force_color, t.force_gray)
        p = parse_datum(buf, key=key, path=self._path)
        chw, label = _view(p, flag, DEFAULT_MAX_PIXELS, key, self._path, fast_jpeg=False)
        index = self._record_index() if learn is not None else None
        if (
            index is not None
            and learn is not None
            and p.encoded
            and p.data is not None
            and chw.dtype == _U1
        ):
            # a copy (bytes) works too: the payload is found in the value's first
            # bytes and compared with the file's in full
            c, h, w = chw.shape
            index.learn_encoded(learn, memoryview(buf), p.data, int(label), (c, h, w))
        return chw, int(label)

    # -- filling -----------------------------------------------------------------------------

    def _record_index(self) -> RecordIndex | None:
        """The record index (see ``_index.py``), made on first use; None where the
        database file cannot be read directly (then every read goes through LMDB)."""
        if not self._index_tried:
            with self._index_lock:
                if not self._index_tried:
                    reader = self._reader
                    if isinstance(reader, LmdbReader):
                        file = reader._mapped_file()
                        extents = value_extents(file, self._keys) if file is not None else None
                        if file is not None and extents is not None:
                            self._index = RecordIndex(file, extents)
                    self._index_tried = True
        return self._index

    def fill(
        self,
        plan: BatchPlan,
        data_out: np.ndarray,
        label_out: npt.NDArray[np.float32],
        start: int = 0,
        stop: int | None = None,
        *,
        params_out: npt.NDArray[np.int32] | None = None,
    ) -> None:
        """Read, decode and transform rows ``[start:stop]`` of ``plan`` into the outputs.

        ``data_out`` has ``plan.data_shape`` and ``plan.dtype``; ``label_out`` is
        float32 with ``len(plan)`` rows. Only rows ``[start:stop]`` are written, so
        threads may fill disjoint ranges of the same arrays concurrently.
        ``params_out`` (``(len(plan), 3)`` int32), when given, receives each row's
        ``(h_off, w_off, mirror)`` — what a device transform needs to apply the
        mean at the uncropped position after a ``dtype="uint8"`` batch.

        Raises:
            ShapeError: an output array has the wrong shape or dtype.
            DataError: a record cannot be read or decoded, or its transformed shape
                differs from the first record's (the message names both keys and
                shapes), or it does not fit the transform; names path and key.
        """
        n = len(plan.keys)
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ValueError(f"rows [{start}:{stop}] are outside the plan's {n} rows")
        if data_out.shape != plan.data_shape or data_out.dtype != plan.dtype:
            raise ShapeError(
                f"data_out has shape {data_out.shape} dtype {data_out.dtype}; the plan needs "
                f"shape {plan.data_shape} dtype {plan.dtype}"
            )
        if label_out.shape != (n,) or label_out.dtype != np.float32:
            raise ShapeError(
                f"label_out has shape {label_out.shape} dtype {label_out.dtype}; the plan "
                f"needs shape ({n},) dtype float32"
            )
        if params_out is not None and params_out.shape != (n, 3):
            raise ShapeError(f"params_out has shape {params_out.shape}; expected ({n}, 3)")
        if start == stop:
            return
        if self._fill_indexed(plan, data_out, label_out, start, stop, params_out):
            return
        transaction = getattr(self._reader, "transaction", None)
        if transaction is None:
            get = self._reader.get
            self._fill_rows(plan, data_out, label_out, start, stop, params_out, get, get)
        else:
            # Zero-copy: each view is decoded straight into data_out inside the block.
            with transaction() as txn:
                fast_get = getattr(txn, "fast_get", None)
                raw = fast_get() if fast_get is not None else txn.get
                self._fill_rows(plan, data_out, label_out, start, stop, params_out, txn.get, raw)

    def _block(self, record_shape: tuple[int, int, int], rows: int) -> _Block | None:
        """How to transform ``rows`` records of ``record_shape`` as a block (cached)."""
        key = (record_shape, rows > 1)
        try:
            return self._blocks[key]
        except KeyError:
            t = self._transform
            info = t._shape_info(record_shape, self._phase)
            block = _block_plan(t, info, self._phase, record_shape, rows)
            if len(self._blocks) < 64:
                self._blocks[key] = block
            return block

    def _fill_indexed(
        self,
        plan: BatchPlan,
        data_out: np.ndarray,
        label_out: npt.NDArray[np.float32],
        start: int,
        stop: int,
        params_out: npt.NDArray[np.int32] | None,
    ) -> bool:
        """Fill rows ``[start:stop]`` from the record index; False (nothing written
        that the checked path would not overwrite) unless every row is indexed."""
        index = self._record_index()
        if index is None:
            return False
        indices = plan.indices[start:stop]
        rows = index.lookup(indices, plan.record_shape)
        block = self._block(plan.record_shape, stop - start)
        if block is None:  # random crops (TRAIN), or a single row: each row its own crop
            each = self._fill_indexed_each
            if rows is not None:
                rng = slice(start, stop)
                if not each(index, rows, plan.record_shape, rng, plan, data_out, params_out):
                    return False
                label_out[rng] = rows.labels
                return True
            groups = index.lookup_shapes(indices)
            if groups is None:
                return False
            for shape, positions, group in groups:  # images of several sizes: one pass each
                at = positions + start
                if not each(index, group, shape, at, plan, data_out, params_out):
                    return False
                label_out[at] = group.labels
            return True
        if rows is None:
            return False
        out = data_out[start:stop]
        if rows.encoded:
            stage = self._decode_indexed(
                index, rows, plan.record_shape, self._first_of(plan, start)
            )
            if stage is None:
                return False
            block.apply(stage.transpose(0, 3, 1, 2), out)
        else:
            _apply_raw_runs(index.file, rows, plan.record_shape, block, out)
        label_out[start:stop] = rows.labels
        self._finish_block(block, plan, data_out, start, stop, params_out)
        return True

    @staticmethod
    def _first_of(plan: BatchPlan, row: int) -> np.ndarray | None:
        """Row ``row``'s pixels if next_plan decoded them already (row 0), else None."""
        return plan._first[0] if row == 0 and plan._first is not None else None

    def _fill_indexed_each(
        self,
        index: RecordIndex,
        rows: IndexedRows,
        shape: tuple[int, int, int],
        at: slice | npt.NDArray[np.intp],
        plan: BatchPlan,
        data_out: np.ndarray,
        params_out: npt.NDArray[np.int32] | None,
    ) -> bool:
        """Indexed rows of ``shape`` with a crop and flip of their own (TRAIN with a
        crop, or a single row), from the file map into rows ``at`` (a slice, or
        positions in increasing order) of ``data_out`` (see :meth:`_crop_rows`)."""
        c, h, w = shape
        n = len(rows.offsets)
        first = at.start if isinstance(at, slice) else int(at[0])
        if rows.encoded:
            stage = self._decode_indexed(index, rows, shape, self._first_of(plan, first))
            if stage is None:
                return False
            images: np.ndarray = stage.transpose(0, 3, 1, 2)
            which: np.ndarray = np.arange(n)
        else:
            # every (C, H, W) image that starts at some byte of the file; rows.offsets
            # pick the records' (each image lies inside the file)
            file = index.file
            images = as_strided(
                file, (len(file) - c * h * w + 1, c, h, w), (1, h * w, w, 1), writeable=False
            )
            which = rows.offsets
        return self._crop_rows(images, which, shape, at, plan, data_out, params_out)

    def _crop_rows(
        self,
        images: np.ndarray,
        which: np.ndarray,
        shape: tuple[int, int, int],
        at: slice | npt.NDArray[np.intp],
        plan: BatchPlan,
        data_out: np.ndarray,
        params_out: npt.NDArray[np.int32] | None,
    ) -> bool:
        """``_apply_fast``'s operations, each row with its own crop and flip, for the
        uint8 ``(C, H, W)`` images ``images[which]`` into rows ``at`` of ``data_out``,
        all at once: the crops are gathered by one numpy call (a sliding-window view
        indexed by ``which``), so two workers do not wait on each other's GIL for
        every row's small copies. False (nothing written) if the rows' output shape
        is not the batch's: the per-row path names the problem."""
        t = self._transform
        phase = self._phase
        try:
            info = t._shape_info(shape, phase)
        except BlobpipeError:  # e.g. a crop larger than the image
            return False
        if info.out_shape != plan.data_shape[1:]:
            return False
        _, h, w = shape
        n = len(which)
        ch, cw = (t.crop_size, t.crop_size) if t.crop_size else (h, w)
        if isinstance(at, slice):
            words = np.fromiter(plan.words[at], np.uint64, n)
        else:  # rows of another size lie between these
            words = np.array([plan.words[i] for i in at.tolist()], np.uint64)
        h_off, w_off, mirror = t._record_params_block(shape, phase, words)
        block = sliding_window_view(images, (ch, cw), axis=(2, 3))[which, :, h_off, w_off]
        mean = info.mean
        if mean is not None:  # the mean at each crop's uncropped position
            mean = sliding_window_view(mean, (ch, cw), axis=(1, 2))[:, h_off, w_off]
            mean = mean.transpose(1, 0, 2, 3)
        if mirror.any():
            block[mirror] = block[mirror][..., ::-1]
            if mean is not None:
                mean[mirror] = mean[mirror][..., ::-1]
        if t.layout == "NHWC":
            block = block.transpose(0, 2, 3, 1)
            mean = None if mean is None else mean.transpose(0, 2, 3, 1)
        # rows of another size between these: transform aside, then scatter
        out = (
            data_out[at]
            if isinstance(at, slice)
            else np.empty((n, *data_out.shape[1:]), data_out.dtype)
        )
        scale = t.scale
        if out.dtype == _U1:
            np.copyto(out, block)
        elif mean is None and scale != 1:
            np.multiply(block, scale, out=out, dtype=np.float32)  # same bits as copy, scale
        else:
            np.copyto(out, block)
            if mean is not None:
                np.subtract(out, mean, out=out)
            if scale != 1:
                np.multiply(out, scale, out=out)
        if not isinstance(at, slice):
            data_out[at] = out
        if params_out is not None:
            params_out[at, 0] = h_off
            params_out[at, 1] = w_off
            params_out[at, 2] = mirror
        return True

    def _decode_indexed(
        self,
        index: RecordIndex,
        rows: IndexedRows,
        shape: tuple[int, int, int],
        first: np.ndarray | None,
    ) -> npt.NDArray[np.uint8] | None:
        """Indexed encoded rows of ``shape`` decoded straight from the file map into a
        per-thread ``(rows, H, W, C)`` staging block; None if one does not decode as
        noted. ``first``: the first row's ``(C, H, W)`` pixels, if decoded already."""
        cv2 = _opencv()
        t = self._transform
        flag = _imread_flag(t.force_color, t.force_gray)
        c, h, w = shape
        file = index.file
        imdecode = cv2.imdecode
        # Every image is decoded into a per-thread staging block (HWC, as the
        # decoders write), which the caller transforms at once. JPEGs the
        # index found simplejpeg may decode (noted per record on its first
        # indexed read) go to it straight, into their row of the block (no
        # allocation sized by the file's bytes); the rest, and any it refuses,
        # to OpenCV. Python per image is kept to a minimum and the block is
        # converted in one GIL-free call: with two workers, each release and
        # re-take of the GIL where the other worker holds it costs a thread
        # wake-up, more than a per-image wrapper or per-row conversion saves
        # (measured on the benchmark: a checked wrapper per image made two
        # workers slower than with OpenCV; the block conversion ranged from 3%
        # slower to 13% faster than row by row in four A/B runs).
        n = len(rows.offsets)
        stage = _staging(n, h * w * c).reshape(n, h, w, c)
        fast = index.fast_channels(rows, flag) if fast_decoder() is not None else [0] * n
        decode = fast_decoder()  # after the verdicts: sampling them may turn it off
        colorspace = COLORSPACE.get(c, "")
        for r, (off, length, channels) in enumerate(
            zip(rows.offsets.tolist(), rows.lengths.tolist(), fast, strict=True)
        ):
            if r == 0 and first is not None:
                stage[0] = first.transpose(1, 2, 0)  # decoded by next_plan already
                continue
            data = file[off : off + length]
            if channels and decode is not None:
                try:
                    if decode(data, colorspace=colorspace, buffer=stage[r]).shape == (h, w, c):
                        continue
                except Exception:  # OpenCV decides
                    pass
            img = imdecode(data, flag)
            # the same bytes decoded to this shape before; anything else: the checked path
            if img is None or img.dtype != _U1 or img.size != h * w * c or img.shape[:2] != (h, w):
                return None
            stage[r] = img.reshape(h, w, c)
        return stage

    def _fill_rows(
        self,
        plan: BatchPlan,
        data_out: np.ndarray,
        label_out: npt.NDArray[np.float32],
        start: int,
        stop: int,
        params_out: npt.NDArray[np.int32] | None,
        get: Callable[[bytes], bytes | memoryview],
        raw_get: Callable[[bytes], bytes | memoryview | None],
    ) -> None:
        # ``get`` raises a named error for a missing record; ``raw_get`` is the
        # unchecked lookup (None when missing) for the block path's loop.
        block = self._block(plan.record_shape, stop - start)
        if block is None:  # each row its own crop (TRAIN), or a single row
            if stop - start > 1 and _encoded(_try_get(raw_get, plan.keys[start])):
                values = [_try_get(raw_get, k) for k in plan.keys[start:stop]]
                self._fill_encoded_each(plan, values, data_out, label_out, start, params_out, get)
            else:
                self._fill_each(plan, data_out, label_out, range(start, stop), params_out, get)
            return
        # Block path: gather the raw uint8 payloads of rows that match the
        # batch's record shape into a staging block (one memcpy each, under the
        # GIL), then transform the whole block with a few large numpy calls
        # (which release the GIL, so worker threads run them in parallel).
        # Rows that do not qualify (encoded, float_data, malformed, another
        # shape) go through the per-row path afterwards, which also raises
        # their errors, in row order.
        c, h, w = plan.record_shape
        size = c * h * w
        keys = plan.keys[start:stop]
        path = self._path
        try:
            values = [raw_get(k) for k in keys]
        except Exception:  # the per-row path reads the failing record again and names it
            values = [_try_get(raw_get, k) for k in keys]
        encoded = _encoded(values[0])
        # uint8 output, no crop, NCHW: one copy per record, straight into the batch
        index = self._index
        if (
            block.direct
            and not encoded
            and copy_raw(values, plan.record_shape, data_out[start:stop], label_out[start:stop])
        ):
            self._finish_block(block, plan, data_out, start, stop, params_out)
            return
        if not encoded:
            # All records in convert_imageset's layout: transform straight from
            # one joined buffer, no staging copy.
            groups = raw_block(values, plan.record_shape, label_out[start:stop])
            if groups is not None:
                out = data_out[start:stop]
                if len(groups) == 1:
                    block.apply(groups[0][1], out)
                else:
                    for rows, pixels in groups:
                        block.load(pixels, out, rows)
                    block.finish(out)
                self._finish_block(block, plan, data_out, start, stop, params_out)
                return
        n = stop - start
        out = data_out[start:stop]
        if encoded:
            self._fill_encoded(plan, values, block, data_out, label_out, start, params_out, get)
            return
        # the output block itself can be the staging area only when contiguous
        direct = block.direct and out.flags.c_contiguous
        staging = out if direct else _staging(n, size)
        flat = staging.reshape(n, size)
        pixels = staging.reshape(n, c, h, w)
        slow: list[int] = []
        t = self._transform
        flag = _imread_flag(t.force_color, t.force_gray)
        # Records laid out as convert_imageset writes them are copied all at once;
        # the rest (an encoded record among raw ones, say) one by one.
        rest = gather_raw(values, plan.record_shape, flat, label_out[start:stop])
        for r in rest:
            i = start + r
            value = values[r]
            try:
                if value is None:
                    raise LookupError
                p = parse_datum(value, key=keys[r], path=path)
                if i == 0 and plan._first is not None:
                    chw, label = plan._first  # decoded by next_plan already
                elif p.encoded:
                    chw, label = _view(p, flag, DEFAULT_MAX_PIXELS, keys[r], path, fast_jpeg=False)
            except Exception:  # the per-row path reads it again and names the error
                slow.append(i)
                continue
            if p.encoded or (i == 0 and plan._first is not None):
                if chw.dtype != _U1 or chw.shape != plan.record_shape:
                    slow.append(i)
                    continue
                pixels[r] = chw
                label_out[i] = label
                if (
                    p.encoded
                    and index is not None
                    and isinstance(value, memoryview)
                    and p.data is not None
                ):
                    index.learn_encoded(plan.indices[i], value, p.data, label, plan.record_shape)
                continue
            data = p.data
            if (
                p.encoded
                or data is None
                or p.float_data is not None
                or len(data) != size
                or (p.channels, p.height, p.width) != plan.record_shape
            ):
                slow.append(i)
                continue
            flat[r] = np.frombuffer(data, _U1)
            label_out[i] = p.label
        if not direct:
            block.apply(pixels, out)
        self._finish_block(block, plan, data_out, start, stop, params_out)
        if slow:
            self._fill_each(plan, data_out, label_out, slow, params_out, get)

    def _check_encoded(
        self,
        plan: BatchPlan,
        values: Sequence[bytes | memoryview | None],
        label_out: npt.NDArray[np.float32],
        start: int,
        flag: int,
    ) -> tuple[
        list[_ToDecode],
        list[tuple[int, ParsedDatum]],
        list[int],
    ]:
        """First reads, step one, for rows ``start + r`` holding ``values[r]``: parse each
        Datum and read its image header (size guard). Returns the images to decode
        (row, bytes, the channels simplejpeg decodes them to or 0, JPEG frame), the
        parsed Datums, and the rows for the per-row path (malformed, raw, too
        large: it raises their errors). Row 0 of a plan decoded by next_plan is
        left out; its label is written, as are the others'."""
        keys = plan.keys[start : start + len(values)]
        path = self._path
        slow: list[int] = []
        todo: list[_ToDecode] = []
        parsed: list[tuple[int, ParsedDatum]] = []
        for r, value in enumerate(values):
            i = start + r
            if i == 0 and plan._first is not None:
                label_out[0] = plan._first[1]
                continue
            try:
                if value is None:
                    raise LookupError
                p = parse_datum(value, key=keys[r], path=path)
            except Exception:  # the per-row path reads it again and names the error
                slow.append(i)
                continue
            data = p.data
            if not p.encoded or data is None:
                slow.append(i)  # a raw record, or no image bytes
                continue
            header = _image_header(data)  # None: another format, OpenCV's own size limit
            if header is not None and header[0] * header[1] > DEFAULT_MAX_PIXELS:
                slow.append(i)  # too large: named there
                continue
            frame = None if header is None else header[2]
            channels = 0
            if frame is not None:
                channels = jpeg_channels(flag, frame)
                if channels and flag != -1 and bytes(data).find(b"Exif") >= 0:
                    channels = 0
            todo.append((r, data, channels, frame))
            parsed.append((r, p))
            label_out[i] = p.label
        return todo, parsed, slow

    def _learn_encoded(
        self,
        plan: BatchPlan,
        values: Sequence[bytes | memoryview | None],
        start: int,
        parsed: list[tuple[int, ParsedDatum]],
        shapes: dict[int, tuple[int, int, int]],
    ) -> None:
        """Note in the record index the rows decoded to ``shapes[r]``."""
        index = self._index
        if index is None:
            return
        for r, p in parsed:
            value = values[r]
            shape = shapes.get(r)
            if shape is not None and isinstance(value, memoryview) and p.data is not None:
                index.learn_encoded(plan.indices[start + r], value, p.data, p.label, shape)

    def _fill_encoded(
        self,
        plan: BatchPlan,
        values: Sequence[bytes | memoryview | None],
        block: _Block,
        data_out: np.ndarray,
        label_out: npt.NDArray[np.float32],
        start: int,
        params_out: npt.NDArray[np.int32] | None,
        get: Callable[[bytes], bytes | memoryview],
    ) -> None:
        """The block path for a batch led by an encoded record, first read: check
        every row (:meth:`_check_encoded`), then decode them one after another into
        a staging block, then transform it at once. Decoding in one run keeps the
        Python between two decodes short (see "Which JPEG decoder"), so simplejpeg
        can be used here too. Rows that fail any step, and raw rows, go through the
        per-row path, which raises their errors in row order."""
        c, h, w = plan.record_shape
        n = len(values)
        t = self._transform
        flag = _imread_flag(t.force_color, t.force_gray)
        stage = _staging(n, h * w * c).reshape(n, h, w, c)
        if start == 0 and plan._first is not None:
            stage[0] = plan._first[0].transpose(1, 2, 0)  # decoded by next_plan already
        todo, parsed, slow = self._check_encoded(plan, values, label_out, start, flag)
        decode = fast_decoder()
        sampling = jpeg_sampling()  # the process's first images: compared with OpenCV's
        for r, data, channels, frame in todo:
            img, in_place = _decode_one(data, flag, channels, frame, decode, sampling, stage[r])
            if img is None or img.shape != (h, w, c):
                slow.append(start + r)  # undecodable or another size: named there
            elif not in_place:
                stage[r] = img
        stop = start + n
        block.apply(stage.transpose(0, 3, 1, 2), data_out[start:stop])
        self._finish_block(block, plan, data_out, start, stop, params_out)
        failed = set(slow)
        shapes = {r: (c, h, w) for r, _ in parsed if start + r not in failed}
        self._learn_encoded(plan, values, start, parsed, shapes)
        if slow:  # rewritten row by row, with their own flips and params
            self._fill_each(plan, data_out, label_out, sorted(slow), params_out, get)

    def _fill_encoded_each(
        self,
        plan: BatchPlan,
        values: Sequence[bytes | memoryview | None],
        data_out: np.ndarray,
        label_out: npt.NDArray[np.float32],
        start: int,
        params_out: npt.NDArray[np.int32] | None,
        get: Callable[[bytes], bytes | memoryview],
    ) -> None:
        """First reads of a batch led by an encoded record whose rows each get their
        own crop (TRAIN): every row checked, the images decoded one after another
        (any size), then cropped per size by :meth:`_crop_rows`. Rows that fail,
        and raw rows, go through the per-row path."""
        t = self._transform
        flag = _imread_flag(t.force_color, t.force_gray)
        todo, parsed, slow = self._check_encoded(plan, values, label_out, start, flag)
        decode = fast_decoder()
        sampling = jpeg_sampling()
        by_shape: dict[tuple[int, int, int], list[tuple[int, np.ndarray]]] = {}
        if start == 0 and plan._first is not None:
            chw0 = plan._first[0]
            c0, h0, w0 = chw0.shape
            by_shape.setdefault((c0, h0, w0), []).append((0, chw0))
        shapes: dict[int, tuple[int, int, int]] = {}
        for r, data, channels, frame in todo:
            # any size: the size guard read the header, simplejpeg allocates what it says
            img, _ = _decode_one(data, flag, channels, frame, decode, sampling, None)
            if img is None:
                slow.append(start + r)
                continue
            chw = img.transpose(2, 0, 1)
            c, h, w = chw.shape
            shapes[r] = (c, h, w)
            by_shape.setdefault((c, h, w), []).append((r, chw))
        for shape, members in by_shape.items():  # images of several sizes: one pass each
            images = np.stack([chw for _, chw in members])
            at = np.array([start + r for r, _ in members], np.intp)
            which = np.arange(len(members))
            if not self._crop_rows(images, which, shape, at, plan, data_out, params_out):
                slow.extend(at.tolist())  # the per-row path raises the shape error
                for r, _ in members:
                    shapes.pop(r, None)
        self._learn_encoded(plan, values, start, parsed, shapes)
        if slow:
            self._fill_each(plan, data_out, label_out, sorted(slow), params_out, get)

    @staticmethod
    def _finish_block(
        block: _Block,
        plan: BatchPlan,
        data_out: np.ndarray,
        start: int,
        stop: int,
        params_out: npt.NDArray[np.int32] | None,
    ) -> None:
        """Flip the mirrored rows of a block-transformed range; record the params."""
        if block.mirror:
            words = plan.words
            for i in range(start, stop):
                if words[i] & 1:
                    row = data_out[i]
                    row[...] = np.flip(row, axis=block.width_axis)
        if params_out is not None:
            params_out[start:stop, 0] = block.h_off
            params_out[start:stop, 1] = block.w_off
            params_out[start:stop, 2] = (
                [word & 1 for word in plan.words[start:stop]] if block.mirror else 0
            )

    def _fill_each(
        self,
        plan: BatchPlan,
        data_out: np.ndarray,
        label_out: npt.NDArray[np.float32],
        rows: Sequence[int],
        params_out: npt.NDArray[np.int32] | None,
        get: Callable[[bytes], bytes | memoryview],
    ) -> None:
        t = self._transform
        phase = self._phase
        expected = plan.data_shape[1:]
        for row in rows:
            key = plan.keys[row]
            if row == 0 and plan._first is not None:
                chw, label = plan._first
            else:
                chw, label = self._read(key, get, plan.indices[row])
            try:
                info = t._shape_info(chw.shape, phase)
                if info.out_shape != expected:
                    raise DataError(
                        f"record {key!r} has shape {tuple(chw.shape)} (output "
                        f"{info.out_shape}) but the batch's first record {plan.keys[0]!r} has "
                        f"shape {plan.record_shape} (output {expected}); records in one batch "
                        "must share a shape: use batch_size=1 or a crop_size",
                        path=self._path,
                        key=key,
                    )
                params = info.fixed
                if params is None:
                    params = t.record_params(chw.shape, phase=phase, word=plan.words[row])
                t._apply_fast(chw, data_out[row], params, info.mean)
            except DataError:
                raise
            except BlobpipeError as exc:
                raise DataError(str(exc), path=self._path, key=key) from exc
            label_out[row] = label
            if params_out is not None:
                params_out[row] = (params.h_off, params.w_off, params.mirror)

    def make_batch(self, plan: BatchPlan) -> ArrayBatch:
        """Allocate arrays for ``plan`` and fill them (single thread).

        Raises:
            DataError: as :meth:`fill`.
        """
        data = np.empty(plan.data_shape, dtype=plan.dtype)
        label = np.empty(len(plan.keys), dtype=np.float32)
        self.fill(plan, data, label)
        return ArrayBatch(
            data=data,
            label=label,
            keys=list(plan.keys),
            indices=plan.indices,
            epoch=plan.epoch,
            valid=plan.valid,
            state=plan.state,
            plan=plan,
        )

    def __iter__(self) -> Iterator[ArrayBatch]:
        """Yield batches: endlessly (``mode="wrap"``) or to the end of the epoch.

        Raises:
            DataError: when a batch holding a bad record is built; the batches
                before it have been yielded intact.
            StateError: after :meth:`close`.
        """
        while True:
            plan = self.next_plan()
            if plan is None:
                return
            yield self.make_batch(plan)

    # -- lifetime -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("these Batches are closed")

    def close(self) -> None:
        """Close the reader if these Batches opened it. Idempotent."""
        if not self._closed:
            self._closed = True
            with self._index_lock:  # the index's map of the file goes with it
                self._index, self._index_tried = None, True
            if self._owned:
                close = getattr(self._reader, "close", None)
                if close is not None:
                    close()

    def __enter__(self) -> Batches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _encoded(value: bytes | memoryview | None) -> bool:
    """True when ``value`` parses as a Datum that says ``encoded: true``."""
    if value is None:
        return False
    try:
        return parse_datum(value).encoded
    except BlobpipeError:
        return False


def _try_get(
    get: Callable[[bytes], bytes | memoryview | None], key: bytes
) -> bytes | memoryview | None:
    try:
        return get(key)
    except Exception:
        return None


def _decode_one(
    data: memoryview,
    flag: int,
    channels: int,
    frame: JpegFrame | None,
    decode: Callable[..., np.ndarray] | None,
    sampling: bool,
    buffer: np.ndarray | None,
) -> tuple[np.ndarray | None, bool]:
    """One image of a first read as an ``(H, W, C)`` uint8 array, and whether it was
    decoded into ``buffer``: simplejpeg where ``channels`` says (straight into
    ``buffer`` when given; the checked :func:`decode_jpeg` while the process is
    sampling), else, or when it refuses, OpenCV. None when neither decodes it.
    (``_decode_indexed`` inlines the same steps: there the Python per image is
    what two workers wait on each other for.)"""
    if channels and decode is not None:
        if sampling:
            img = decode_jpeg(data, flag, frame)
            if img is not None:
                return (img[..., np.newaxis] if img.ndim == 2 else img), False
        else:
            try:
                img = decode(data, colorspace=COLORSPACE[channels], buffer=buffer)
                return img, buffer is not None
            except Exception:  # OpenCV decides
                pass
    try:
        img = _opencv().imdecode(np.frombuffer(data, _U1), flag)
    except Exception:  # cv2.error: the per-row path names it
        return None, False
    if img is None or img.dtype != _U1 or img.ndim not in (2, 3):
        return None, False
    return (img[..., np.newaxis] if img.ndim == 2 else img), False


# an image to decode: (row, its bytes, the channels simplejpeg decodes it to, or 0
# for OpenCV, its JPEG frame header)
_ToDecode = tuple[int, memoryview, int, JpegFrame | None]

_tls = threading.local()


def _staging(rows: int, size: int) -> npt.NDArray[np.uint8]:
    """A per-thread uint8 scratch block of ``rows × size`` (reused across calls)."""
    buf: npt.NDArray[np.uint8] | None = getattr(_tls, "staging", None)
    need = rows * size
    if buf is None or buf.size < need:
        buf = np.empty(need, _U1)
        _tls.staging = buf
    return buf[:need].reshape(rows, size)


@dataclass(frozen=True)
class _Block:
    """How to transform a whole block of same-shape uint8 records at once.

    Valid when every row shares the crop offset (no crop, or the TEST-phase
    centre crop); a random mirror is applied afterwards, row by row, by flipping
    the output (the transform is elementwise, so flipping commutes with it).
    """

    transform: Transform
    mean: npt.NDArray[np.float32] | None
    h_off: int
    w_off: int
    crop: int
    mirror: bool  # rows whose word has bit 0 set are flipped
    nhwc: bool
    direct: bool  # the output block is itself the staging area (uint8, no crop, NCHW)

    @property
    def width_axis(self) -> int:
        return 1 if self.nhwc else 2

    def apply(self, src: npt.NDArray[np.uint8], out: np.ndarray) -> None:
        """Transform the uncropped uint8 NCHW block ``src`` into ``out``."""
        scale = self.transform.scale
        if self.mean is None and scale != 1 and out.dtype != _U1:
            # One pass, one GIL release: float32(x) * scale, the same bits as the
            # copy-then-scale of load() + finish().
            if self.crop:
                src = src[:, :, self._hs, self._ws]
            if self.nhwc:
                src = src.transpose(0, 2, 3, 1)
            np.multiply(src, scale, out=out, dtype=np.float32)
            return
        self.load(src, out)
        self.finish(out)

    def load(
        self, src: npt.NDArray[np.uint8], out: np.ndarray, rows: npt.NDArray[np.intp] | None = None
    ) -> None:
        """Crop, lay out and convert ``src`` into ``out`` (or into ``out[rows]``)."""
        if self.crop:
            src = src[:, :, self._hs, self._ws]
        if self.nhwc:
            src = src.transpose(0, 2, 3, 1)
        if rows is None:
            np.copyto(out, src)
        else:
            out[rows] = src

    def finish(self, out: np.ndarray) -> None:
        """Subtract the mean and scale ``out`` in place (nothing for uint8 output)."""
        # Same operations, element for element, as Transform._apply_fast: the
        # uint8 to float32 conversion in load() is exact.
        if out.dtype == _U1:
            return
        mean = self.mean
        if mean is not None:
            if self.crop:
                mean = mean[:, self._hs, self._ws]
            if self.nhwc:
                mean = mean.transpose(1, 2, 0)
            np.subtract(out, mean, out=out)
        scale = self.transform.scale
        if scale != 1:
            np.multiply(out, scale, out=out)

    @property
    def _hs(self) -> slice:
        return slice(self.h_off, self.h_off + self.crop)

    @property
    def _ws(self) -> slice:
        return slice(self.w_off, self.w_off + self.crop)


def _apply_raw_runs(
    file: npt.NDArray[np.uint8],
    rows: IndexedRows,
    shape: tuple[int, int, int],
    block: _Block,
    out: np.ndarray,
) -> None:
    """Transform indexed raw rows from the file map into ``out``.

    A run of rows whose offsets step by one stride is one strided view of the
    file: one numpy call (GIL released) per run. Rows scattered over the file
    (shuffled reads) are first gathered into a staging block, one copy each.
    """
    c, h, w = shape
    size = c * h * w
    runs = rows.runs()
    n = len(rows.offsets)
    if len(runs) * 4 <= n:
        for a, b, stride in runs:
            src: npt.NDArray[np.uint8] = np.ndarray(
                (b - a, c, h, w),
                _U1,
                buffer=file,
                offset=int(rows.offsets[a]),
                strides=(stride, h * w, w, 1),
            )
            block.apply(src, out[a:b])
        return
    offsets = rows.offsets.tolist()
    if block.direct and out.flags.c_contiguous:
        flat = out.reshape(n, size)
        for r, off in enumerate(offsets):
            flat[r] = file[off : off + size]
        return
    staging = _staging(n, size)
    for r, off in enumerate(offsets):
        staging[r] = file[off : off + size]
    block.apply(staging.reshape(n, c, h, w), out)


def _block_plan(
    t: Transform, info: Any, phase: Phase, record_shape: tuple[int, int, int], rows: int
) -> _Block | None:
    if rows < 2:
        return None
    if t.crop_size and phase == "train":
        return None  # random crop offsets differ per row
    params = t.record_params(record_shape, phase=phase, word=0)
    nhwc = t.layout == "NHWC"
    direct = t.dtype == _U1 and not t.crop_size and not nhwc
    return _Block(
        transform=t,
        mean=info.mean,
        h_off=params.h_off,
        w_off=params.w_off,
        crop=t.crop_size,
        mirror=t.mirror,
        nhwc=nhwc,
        direct=direct,
    )
