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

Record order within an epoch, shards and resume: ``_order.py``.

Randomness of a record (crop offset, mirror) depends only on
``(seed, epoch, global index)`` — not on the order, the shard or the thread.

Filling
-------
:meth:`Batches.fill` runs the one batch path of ``_fill.py``: records located
in the record index, pixels taken where they lie (or decoded), and Caffe's
transform applied by one kernel (``_kernels.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .._errors import (
    ArgumentError,
    DataError,
    StateError,
    UnsupportedOperationError,
)
from ._fill import RecordSource, part_of
from ._kernels import Deferral, Geometry, check_geometry_out
from ._lmdb import LmdbReader
from ._options import (
    BatchesKeywords,
    BatchesOptions,
    Last,
    Mode,
    Unpack,
    check_keywords,
    signature_with_options,
    with_options_doc,
)
from ._order import EpochOrder
from ._outputs import check_outputs, checked_extra, checked_parts
from ._plan import (
    ArrayBatch,
    BatchPlan,
    RowSpan,
    Run,
    advance,
    inner_count,
    key_source,
    row_arrays,
    spanned_as,
)
from ._readahead import ReadAhead
from ._records import DATUM, RecordKind
from ._resume import check_state, make_state, state_sources
from ._sources import Source, Sources, check_shared, open_sources
from ._transform import Phase, Transform

__all__ = ["ArrayBatch", "BatchPlan", "Batches", "RecordSource"]


class Batches:
    """Batches of records from an LMDB of Caffe Datums, like Caffe's DataLayer.

    Args:
        source: an LMDB or LevelDB path (opened, and closed by :meth:`close`) or an
            open reader (left open: an :class:`~blobpipe.LmdbReader`,
            :class:`~blobpipe.LevelDbReader`, :class:`~blobpipe.ImageList`,
            :class:`~blobpipe.Hdf5Data`); a list of them, read as one dataset
            (record ``i`` of the whole is in the first database holding it, in list
            order: order, shuffle, shards and resume run over all); or several
            sources by name (each a database or a list),
            ``{"data": images, "label": label_maps}``, read in lockstep as one
            dataset: the same keys (checked at open), one order, shuffle, shards
            and resume for all, each source Datum or BlobProto records, a batch
            holding each source's array (``batch["label"]``).
        batch_size: records per batch.

    Keyword options (each checked as the Batches are made):
        {options}

    Raises:
        ArgumentError: a bad argument (batch size, order, mode, last, shard...);
            also a ValueError.
        ArgumentTypeError: an unknown keyword, ``shard`` of the wrong type, or a rank,
            world size or ``ranks_per_node`` that is not an integer; also a TypeError.
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
        source: Sources | Mapping[str, Sources],
        batch_size: int,
        **options: Unpack[BatchesKeywords],
    ) -> None:
        check_keywords(options, "Batches.__init__", ())
        opts = BatchesOptions(batch_size=batch_size, **options)
        self._batch_size = int(opts.batch_size)
        self._max_batch_bytes = int(opts.max_batch_bytes)
        self._phase: Phase = opts.phase
        self._label_dtype = np.dtype(opts.label_dtype)
        self._rank, self._world = opts.rank_world
        self._seed = int(opts.seed)
        self._pad_shards: bool | Literal["drop"] = opts.pad_shards
        self._mode: Mode = opts.mode
        self._last: Last = opts.last
        # what a pickled copy reopens with: the source and the options (its shard and
        # node size as resolved here), at the state it was pickled at
        self._source = source
        self._options = dataclasses.replace(opts, state=None)

        self._closed = False
        self._sources: list[Source] = []
        try:
            self._sharing = open_sources(
                self._sources, source, opts.transform, opts.record, np.dtype(opts.blob_dtype),
                opts.share_random, opts.readahead, self._phase, opts.split_transform,
            )  # fmt: skip
            # whether any source draws crops or flips (a Loader's host transform keeps them)
            self._random = any(src.filler.transform.needs_random for src in self._sources)
            primary = self._sources[0]
            self._reader = primary.parts[0].reader  # the first database's
            self._path = primary.path
            self._filler = primary.filler
            self._transform = primary.filler.transform
            self._split_from: Transform | None = primary.split_from
            self._keys = primary.keys
            self._n = len(self._keys)
            if self._n == 0:
                raise DataError("the database holds no records", path=self._path)
            self._epochs = EpochOrder(
                self._n, opts.order, opts.buffer_size, self._seed, (self._rank, self._world),
                opts.shard_mode, self._pad_shards, opts.per_node,
            )  # fmt: skip
            # the values of the next records requested ahead of the batches planned
            self._ahead = [
                ReadAhead(src.parts[0].reader)
                for src in self._sources
                if len(src.parts) == 1 and isinstance(src.parts[0].reader, LmdbReader)
            ]
            self._shard_len = self._epochs.records_per_epoch
            self._settings = {
                **self._epochs.settings(),
                "shard": (self._rank, self._world),
                "num_records": self._n,
            }
            # (source, output class) -> row shape, element type and bytes a row
            self._out_shapes: dict[
                tuple[int, tuple[int, ...]], tuple[tuple[int, ...], Any, int]
            ] = {}
            if self._shard_len == 0:
                raise DataError(
                    f"shard rank {self._rank} of {self._world} holds no records "
                    f"(the database has {self._n})",
                    path=self._path,
                )
            drop = self._mode == "epoch" and self._last == "drop"
            if drop and self._shard_len < self._batch_size:
                raise ArgumentError(
                    f"with last='drop', a shard of {self._shard_len} records never fills a "
                    f"batch of {self._batch_size}: every epoch would be empty; use "
                    "last='keep' or last='pad', or a smaller batch_size"
                )
            self._epoch = 0
            self._pos = 0
            self._end_pending = False
            self._deferred: Exception | None = None  # next_plans: the next call raises it
            if opts.state is not None:
                self.load_state_dict(opts.state)
        except BaseException:
            self.close()
            raise

    # -- sources -------------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """The sources' names, the primary (``batch.data``) first."""
        return tuple(s.name for s in self._sources)

    def record_kind(self, name: str | None = None) -> RecordKind:
        """ "datum" or "blobproto": the records of source ``name`` (default: the primary)."""
        for src in self._sources:
            if name is None or src.name == name:
                kind: RecordKind = src.filler.kind
                return kind
        raise KeyError(f"no source named {name!r}; the sources are {list(self.names)}")

    # -- properties ---------------------------------------------------------------------

    @property
    def path(self) -> object:
        """The database path (None for a source that has none)."""
        return self._path

    @property
    def transform(self) -> Transform:
        """The transform the primary source's rows are filled with (its host half
        under ``split_transform``)."""
        t: Transform = self._transform
        return t

    @property
    def split_from(self) -> Transform | None:
        """The primary source's whole transform when its rows are filled with its host
        half (``split_transform``: a device finishes them), else None."""
        return self._split_from

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
            raise UnsupportedOperationError(
                "mode='wrap' is endless and has no length: len() needs mode='epoch'"
            )
        if self._last == "drop":
            return self._shard_len // self._batch_size
        return math.ceil(self._shard_len / self._batch_size)

    # -- order -----------------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> npt.NDArray[np.int64]:
        """The global indices this shard visits in ``epoch``, in order (read-only)."""
        return self._epochs.order(epoch)

    # -- resume ------------------------------------------------------------------------------

    def _state(self, epoch: int, pos: int) -> dict[str, Any]:
        key = self._keys[int(self.epoch_order(epoch)[pos])]
        return make_state(epoch, pos, key, self._settings, (self._rank, self._world))

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: the next record to plan, and how the order is made.

        Keys: ``epoch``, ``position`` (in this shard's order of that epoch), ``key``
        (the record at that position, checked on restore), ``seed``, ``order``,
        ``buffer_size``, ``shard``, ``shard_mode``, ``pad_shards``,
        ``ranks_per_node`` (``shard_mode="node"``), ``num_records``, ``version``;
        every key but the first three must match when the state is loaded.
        Plain JSON types (the key a str: bytes that are not UTF-8 as
        ``surrogateescape`` surrogates), so ``json.dumps``/``json.loads``
        round-trip it; states holding the key as bytes are accepted too. After
        the last batch of an epoch it points at the start of the next epoch.
        """
        return self._state(self._epoch, self._pos)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict` or ``plan.state``).

        The cursor seeks directly to the saved position; nothing is replayed.

        Raises:
            ValueError: the state was saved with another seed, order, buffer size,
                shard, shard mode, padding or ranks per node, or is malformed (a
                field missing, an epoch or position that is not an integer).
            TypeError: ``state`` is not a mapping.
            DataError: the database changed (other record count, or another key at
                the saved position).
        """
        epoch, pos, key = check_state(
            state,
            settings=self._settings,
            shard=(self._rank, self._world),
            shard_len=self._shard_len,
            path=self._path,
        )
        actual = bytes(self._keys[int(self.epoch_order(epoch)[pos])])
        if actual != key:
            raise DataError(
                f"the dataset changed: position {pos} of epoch {epoch} holds key {actual!r}, "
                f"the state expected {key!r}",
                path=self._path,
            )
        self._epoch, self._pos, self._end_pending = epoch, pos, False
        self._deferred = None

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
        return self.next_plans(1)[0]

    def next_plans(self, count: int) -> list[BatchPlan | None]:
        """The next ``count`` plans, each as :meth:`next_plan` makes it, made together
        (consecutive batches of one epoch hold views of one array of each per-row
        field): cheaper per batch for small batches.

        Stops after the end of an epoch (``None``, the list's last item). Where
        planning a batch after the first raises, returns the plans before it with the
        cursor past the failing batch, and the next call raises that error.

        Raises:
            ArgumentError: ``count`` is not a positive integer.
            StateError: after :meth:`close`.
            DataError: as :meth:`next_plan`, for the first batch (or the batch the
                previous call stopped at).
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ArgumentError(f"next_plans: count must be a positive integer, got {count!r}")
        self._check_open()
        if self._deferred is not None:
            exc, self._deferred = self._deferred, None
            raise exc
        steps: list[tuple[list[Run], int, tuple[int, int, bool]]] = []
        if count > 1 and not self._end_pending:  # batches inside the epoch, by arithmetic
            e, p, bs = self._epoch, self._pos, self._batch_size
            n = inner_count(*self._cursor()[1:], count)
            steps = [([(e, a, a + bs)], bs, (e, a + bs, False)) for a in range(p, p + n * bs, bs)]
            self._pos += n * bs
        while len(steps) < count:
            step = self._advance()
            if step is None:
                break
            steps.append((*step, (self._epoch, self._pos, self._end_pending)))
        self._request_ahead([runs for runs, _, _ in steps])
        plans: list[BatchPlan | None] = []
        rows, whole = row_arrays(self._epochs, self._random, [runs for runs, _, _ in steps])
        at = 0  # where the plan's rows start in ``whole``
        states = state_sources(  # (each batch's, from the cursor after it)
            self._keys, self._settings, (self._rank, self._world), self.epoch_order,
            [(e, p) for _, _, (e, p, _) in steps],
        )  # fmt: skip
        head = self._sources[0]
        if rows and head.filler.uniform_shape() is None:
            self._learn(rows, steps[-1][0][-1])
        same: tuple[int, ...] | None = None  # (asked once the first plan is made)
        shape: tuple[int, ...] = ()
        rows_like = 0
        like: BatchPlan | None = None
        spanning: RowSpan | None = None  # the rows ``like`` and the plans made from it span
        make: Callable[..., BatchPlan] | None = None  # plans made from ``like``
        for k, ((_, valid, after), arrays) in enumerate(zip(steps, rows, strict=True)):
            if make is not None and same == shape and len(arrays[0]) == rows_like:
                indices, epochs, positions, words = arrays
                keys = key_source(self._keys, indices)
                if self._random:
                    words = head.words(words)
                n = len(indices)
                # (noted as rows of the span: merged without a join)
                spanned = (
                    None if spanning is None or words is not arrays[3] else (spanning, at, at + n)
                )
                plans.append(
                    make(keys, indices, epochs, positions, words, valid, states[k], spanned=spanned)
                )
                at += n
                continue
            try:
                plan = self._plan(valid, states[k], arrays, like)
            except Exception as exc:
                self._epoch, self._pos, self._end_pending = after  # past the failing batch
                if k == 0:
                    raise
                self._deferred = exc
                return plans
            plans.append(plan)
            if like is None and len(steps) > 1:
                like = plan
                make, shape, rows_like = like.rows_like(), like.record_shape, len(like)
                # every record's shape, known without a read (raw records of one shape,
                # once the index has seen them all): the later plans read no record
                same = head.filler.uniform_shape() if len(self._sources) == 1 else None
                # the plans made from it are of its shape, so their rows merge as views
                # of ``whole``'s, from here on while they are consecutive
                spanning = whole if k == 0 and not plan.extra else None
                if spanning is not None and plan.words is arrays[3]:
                    spanned_as(plan, spanning, 0, len(arrays[0]))
            at += len(arrays[0])
        if len(steps) < count:
            plans.append(None)
        return plans

    def _learn(self, rows: list[tuple[np.ndarray, ...]], last: Run) -> None:
        """Every source learns the records of the batches planned together (one pass of
        its index, not one for each batch's first record and one for its fill), and
        those its epoch reads after them (from the end of the ``last`` run). What goes
        wrong here goes wrong again where a batch reads them (its first record, its
        fill), and is raised there, for that batch: not here."""
        indices = rows[0][0] if len(rows) == 1 else np.concatenate([r[0] for r in rows])
        epoch, _, end = last
        ahead = self._epochs.order(epoch)[end:]
        for src in self._sources:
            try:
                src.filler.learn(indices, ahead)
            except Exception:  # (raised again where a batch reads them)
                pass

    def _cursor(self) -> tuple[int, int, int, int, str, str]:
        """Where the cursor is and how it moves: :func:`advance`'s arguments."""
        return self._epoch, self._pos, self._batch_size, self._shard_len, self._mode, self._last

    def _advance(self) -> tuple[list[Run], int] | None:
        """Move the cursor past the next batch: its runs and its number of real rows
        (:func:`advance`); None at the end of an epoch."""
        if self._end_pending:
            self._end_pending = False
            return None
        step = advance(*self._cursor())
        self._epoch, self._pos, self._end_pending = step.epoch, step.pos, step.end
        if not step.runs:  # a tail shorter than a batch, dropped
            return None
        return step.runs, step.valid

    def _request_ahead(self, batches: list[list[Run]]) -> None:
        """Tell the read-ahead that ``batches`` (their runs, in plan order) were planned:
        once for each stretch of consecutive positions of one epoch (a chunk of
        batches is one request, not one a batch)."""
        if not self._ahead or not batches:
            return
        stretches: list[list[int]] = []
        for runs in batches:
            for e, a, b in runs:
                last = stretches[-1] if stretches else None
                if last is not None and last[0] == e and last[2] == a:
                    last[2] = b
                else:
                    stretches.append([e, a, b])
        for e, a, b in stretches:
            order = self._epochs.order(e)
            for ahead in self._ahead:
                ahead.planned(order, e, a, b)

    def _plan(
        self,
        valid: int,
        state: Callable[[], dict[str, Any]],
        rows: tuple[np.ndarray, ...],
        like: BatchPlan | None = None,
    ) -> BatchPlan:
        """The plan of one batch: its ``rows`` (indices, epochs, positions and words,
        as :func:`row_arrays` makes them), ``valid`` real ones, and what makes the
        resume state after it (:func:`state_sources`); reads its first record to learn
        its shape.

        ``like``: the plan of an earlier batch of the same call; a batch of one source
        whose first record has that plan's shape, with as many rows, is made from it
        (:meth:`BatchPlan.with_rows`: its shapes and checks hold for this one)."""
        indices, epochs, positions, words = rows
        keys = key_source(self._keys, indices)
        first = int(indices[0])
        random = self._random
        sources = self._sources
        head = sources[0]
        record_shape, decoded = head.filler.first(first)
        if (
            like is not None
            and decoded is None
            and len(sources) == 1
            and record_shape == like.record_shape
            and len(indices) == len(like)
        ):
            return like.with_rows(
                keys, indices, epochs, positions, head.words(words) if random else words,
                valid, state,
            )  # fmt: skip
        plans = []
        for k, src in enumerate(sources):
            filler = src.filler
            if k:
                record_shape, decoded = filler.first(first)
            cache_key = (k, filler.transform.output_class(record_shape))
            out = self._out_shapes.get(cache_key)
            if out is None:  # checks it against the transform
                out_shape, dtype = filler.output(record_shape, self._keys[first])
                out = (out_shape, dtype, math.prod(out_shape) * np.dtype(dtype).itemsize)
                if len(self._out_shapes) < 64:
                    self._out_shapes[cache_key] = out
            out_shape, dtype, row_bytes = out
            if len(indices) * row_bytes > self._max_batch_bytes:
                self._check_batch_bytes(len(indices), out_shape, dtype, first, record_shape, src)
            plans.append(
                BatchPlan(
                    key_source=keys,
                    indices=indices,
                    epochs=epochs,
                    positions=positions,
                    words=src.words(words) if random else words,
                    valid=valid,
                    record_shape=record_shape,
                    data_shape=(len(indices), *out_shape),
                    dtype=dtype,
                    state_source=state,
                    label_dtype=self._label_dtype,
                    name=src.name,
                    has_label=filler.kind == DATUM,
                    first_decoded=decoded,
                )
            )
        if len(plans) == 1:
            return plans[0]
        check_shared(plans, self._sharing)
        return dataclasses.replace(plans[0], extra=tuple((p.name, p) for p in plans[1:]))

    def _check_batch_bytes(
        self, rows: int, out_shape: tuple[int, ...], dtype: Any, first: int,
        record_shape: tuple[int, ...], src: Any,
    ) -> None:  # fmt: skip
        """Refuse a batch larger than ``max_batch_bytes`` before it is allocated: each
        record is bounded (pixels, values), but a batch of them multiplies the bound.

        Raises:
            DataError: names the record whose shape the batch takes, and the path.
        """
        need = rows * math.prod(out_shape) * np.dtype(dtype).itemsize
        if need > self._max_batch_bytes:
            raise DataError(
                f"a batch of {rows} rows of shape {out_shape} ({np.dtype(dtype)}) needs "
                f"{need / 2**30:.1f} GiB, more than max_batch_bytes={self._max_batch_bytes}: "
                f"this record is {record_shape}; if that is meant, pass a larger "
                "max_batch_bytes to Batches or Loader (or crop, or a smaller batch_size)",
                path=src.path,
                key=self._keys[first],
            )

    def fill(
        self,
        plan: BatchPlan,
        data_out: np.ndarray,
        label_out: np.ndarray,
        start: int = 0,
        stop: int | None = None,
        *,
        geometry_out: Geometry | None = None,
        extra_out: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Read, decode and transform rows ``[start:stop]`` of ``plan`` into the outputs.

        ``data_out`` has ``plan.data_shape`` and ``plan.dtype``; ``label_out`` has
        ``plan.label_dtype`` and ``len(plan)`` rows. Only rows ``[start:stop]`` are written, so
        threads may fill disjoint ranges of the same arrays concurrently.
        ``geometry_out`` (a :class:`Geometry` of ``len(plan)`` rows, e.g.
        ``Geometry.zeros(len(plan))``), when given, receives at rows ``[start:stop]``
        each row's crop offset (``h_off``, ``w_off``) and flip (``mirror``) — what a
        device transform needs to apply the mean at the uncropped position after a
        ``dtype="uint8"`` batch.
        ``extra_out``: with several sources, each other source's array by name
        (shapes and dtypes from ``plan.extra``). Records without labels
        (BlobProtos) leave zeros in ``label_out``.

        Raises:
            ArgumentTypeError: ``geometry_out`` is not a :class:`Geometry` of arrays.
            ShapeError: an output array has the wrong shape or dtype.
            ArgumentError: ``geometry_out`` is read-only.
            DataError: a record cannot be read or decoded, or its transformed shape
                differs from the first record's (the message names both keys and
                shapes), or it does not fit the transform; names path and key.
        """
        n = len(plan)
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ArgumentError(f"rows [{start}:{stop}] are outside the plan's {n} rows")
        check_outputs(plan, n, data_out, label_out, "data_out", "label_out")
        if geometry_out is not None:
            check_geometry_out(geometry_out, n)
        extra = checked_extra(plan, extra_out)
        if start == stop:
            return
        self._check_open()
        self._filler.fill(plan, start, [part_of(data_out, label_out, start, stop, geometry_out)])
        if not plan.has_label:
            label_out[start:stop] = 0
        if extra:
            scratch = np.empty(n, plan.label_dtype)  # other sources' labels: not delivered
            for src, (part, out) in zip(self._sources[1:], extra, strict=True):
                src.filler.fill(part, start, [part_of(out, scratch, start, stop, None)])

    def fill_parts(
        self, plan: BatchPlan, parts: Sequence[tuple[np.ndarray, np.ndarray, Geometry | None]]
    ) -> None:
        """Read, decode and transform every row of ``plan`` into several outputs, in
        order: ``parts[k] = (data, label, geometry)`` takes the next ``len(label)``
        rows (``data`` of shape ``(len(label), *plan.data_shape[1:])``, ``geometry``
        a :class:`Geometry` of as many rows, or None), written as :meth:`fill` writes
        them. A plan merged from consecutive batches' (``_plan.merged``) is filled
        straight into each batch's own arrays, its per-call costs paid once.

        Raises:
            ArgumentError: the parts do not hold the plan's rows, or the plan has
                other sources read in lockstep (fill those with :meth:`fill`).
            ArgumentTypeError, ShapeError: an output array as in :meth:`fill`.
            DataError: as :meth:`fill`.
        """
        self._parts(plan, parts, None)

    def start_parts(
        self,
        plan: BatchPlan,
        parts: Sequence[tuple[np.ndarray, np.ndarray, Geometry | None]],
        pool: Any,
    ) -> Deferral:
        """:meth:`fill_parts`, with the rows' compiled kernel call started on ``pool``
        (``_kernels.row_pool``) rather than run here, where the rows are raw records
        of one database: the labels are written, the data once the returned
        :class:`Deferral` finished (which raises what the fill would raise after
        the read: the database changed). Rows that cannot be deferred are filled in
        this call (the deferral then holds no job). For the Loader, which plans and
        fills small batches on its consumer's thread.

        Raises:
            As :meth:`fill_parts`.
        """
        defer = Deferral(pool)
        try:
            self._parts(plan, parts, defer)
        except BaseException:
            defer.wait()  # a job started before the error writes nothing after this
            raise
        return defer

    def _parts(
        self,
        plan: BatchPlan,
        parts: Sequence[tuple[np.ndarray, np.ndarray, Geometry | None]],
        defer: Deferral | None,
    ) -> None:
        checked = checked_parts(plan, parts)
        if len(plan) == 0:
            return
        self._check_open()
        self._filler.fill(plan, 0, checked, defer)
        if not plan.has_label:
            for part in checked:
                part.label[:] = 0

    def make_batch(self, plan: BatchPlan) -> ArrayBatch:
        """Allocate arrays for ``plan`` and fill them (single thread).

        Raises:
            DataError: as :meth:`fill`.
        """
        data = np.empty(plan.data_shape, dtype=plan.dtype)
        label = np.empty(len(plan), dtype=plan.label_dtype)
        extra = {name: np.empty(p.data_shape, dtype=p.dtype) for name, p in plan.extra}
        self.fill(plan, data, label, extra_out=extra)
        arrays = {plan.name: data, **extra}
        return ArrayBatch(
            data=data,
            label=arrays.get("label", label if plan.has_label else None),
            keys=list(plan.keys),
            indices=tuple(plan.indices.tolist()),
            epoch=plan.epoch,
            valid=plan.valid,
            state=plan.state,
            plan=plan,
            arrays=arrays,
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

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (for a spawned worker process, say) as how to open them again: the
        same sources and options, resumed at this position (:meth:`state_dict`).
        The copy opens its own readers in the process that unpickles it.

        Raises:
            StateError: these Batches are closed.
        """
        if self._closed:
            raise StateError(
                "these Batches are closed; pickle Batches that are open (the copy reopens "
                "the databases)"
            )
        return (_reopened, (self._source, self._options, self.state_dict()))

    def close(self) -> None:
        """Close the reader if these Batches opened it. Idempotent."""
        if not self._closed:
            self._closed = True
            for src in getattr(self, "_sources", ()):
                src.close()
            # The keys and the read-ahead are views of the database's maps (and of its
            # index's): dropped here, so the maps and their descriptors go with close,
            # not when this object is collected.
            self._keys = ()
            self._ahead = []

    def __enter__(self) -> Batches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reopened(
    source: Sources | Mapping[str, Sources], options: BatchesOptions, state: dict[str, Any]
) -> Batches:
    """Batches opened again from pickled options, at ``state``."""
    keywords = dataclasses.replace(options, state=state).keywords()
    return Batches(source, **keywords)


Batches.__doc__ = with_options_doc(Batches.__doc__)
# help() and IDEs show the options as Batches' keywords, with their defaults
Batches.__init__.__signature__ = signature_with_options(Batches.__init__)  # type: ignore[attr-defined]
