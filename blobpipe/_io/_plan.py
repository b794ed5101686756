"""What one batch will hold: the plan that :meth:`Batches.next_plan` makes and
:meth:`Batches.fill` (any number of threads, disjoint row ranges) carries out."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from ._kernels import shared_zeros

__all__ = [
    "ArrayBatch",
    "BatchPlan",
    "Run",
    "Step",
    "advance",
    "column",
    "joined",
    "key_source",
    "merged",
    "read_only",
    "row_arrays",
    "span",
    "spanned_as",
]

Run = tuple[int, int, int]  # (epoch, first position, stop position) in an epoch's order

_A = TypeVar("_A", bound="np.ndarray[Any, Any]")
_T = TypeVar("_T", bound=np.generic)


def read_only(array: _A) -> _A:
    """``array``, made read-only (``flags.writeable = False``) in place."""
    array.setflags(write=False)
    return array


#: 0, 1, 2... : :func:`span` adds its start to a slice of it (NumPy keeps the GIL in an
#: addition of up to 500 elements)
_SPAN = np.arange(500, dtype=np.int64)
_SPAN.setflags(write=False)


#: spans up to this long are made in additions of 500 (a chunk's positions); longer
#: ones by ``np.arange`` (one release of the GIL costs less than their additions)
_SPAN_BLOCKS = 8 * len(_SPAN)


def span(a: int, b: int) -> npt.NDArray[np.int64]:
    """``np.arange(a, b)`` as int64, made without releasing the GIL for spans of up to
    :data:`_SPAN_BLOCKS` (NumPy's ``arange`` releases it to fill any array, its
    additions beyond 500 elements: a GIL hand-off to a waiting thread, once a batch)."""
    n = b - a
    step = len(_SPAN)
    if 0 <= n <= step:
        return _SPAN[:n] + a
    if step < n <= _SPAN_BLOCKS:
        out = np.empty(n, np.int64)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            np.add(_SPAN[: hi - lo], a + lo, out=out[lo:hi])
        return out
    return np.arange(a, b, dtype=np.int64)


#: the last arrays :func:`column` made, by ``(n, value)`` (read-only, so shared): a
#: chunk's epochs are the same array chunk after chunk within an epoch
_COLUMNS: dict[tuple[int, int], npt.NDArray[np.int64]] = {}
_COLUMNS_KEPT = 8


def column(n: int, value: int) -> npt.NDArray[np.int64]:
    """``n`` times ``value`` as a read-only int64 array: filled up to 500 (NumPy keeps the
    GIL), else a broadcast of one item (a fill releases it; a broadcast costs a few µs);
    the last few made are kept and handed out again, as views that cannot be made
    writable (their base is read-only)."""
    key = (n, value)
    made = _COLUMNS.get(key)
    if made is None:
        if n <= len(_SPAN):
            made = read_only(np.full(n, value, np.int64))
        else:
            made = np.broadcast_to(read_only(np.array([value], np.int64)), (n,))
        if len(_COLUMNS) >= _COLUMNS_KEPT:  # (any thread may clear it: a cache)
            _COLUMNS.clear()
        _COLUMNS[key] = made
    view: npt.NDArray[np.int64] = made.view()
    return view


def joined(parts: list[npt.NDArray[_T]]) -> npt.NDArray[_T]:
    """``parts`` end to end as one read-only array (the one part itself when alone)."""
    return read_only(parts[0] if len(parts) == 1 else np.concatenate(parts))


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """What one batch will hold; made by :meth:`Batches.next_plan`.

    Row ``i`` is record ``keys[i]`` (global index ``indices[i]``, from epoch
    ``epochs[i]`` at position ``positions[i]`` of that epoch's order for this
    shard), transformed with random word ``words[i]``. Rows ``>= valid`` are
    padding (``last="pad"``): repeats of the epoch's first records.

    Attributes:
        keys: one key (bytes) per row, a tuple, made on first use from
            ``key_source`` (a batch's keys cost about half a microsecond each,
            which a fill from a database's file map never needs).
        key_source: makes :attr:`keys` (called once, on first use).
        indices, epochs, positions: one entry per row, read-only int64 arrays.
        words: one random word per row, a read-only uint64 array (all 0 when
            nothing is random).
        valid: the number of real (non-padding) rows.
        record_shape: the first record's ``(C, H, W)`` before the transform (a
            BlobProto record's own shape).
        data_shape: the batch array's shape, ``(N, C, h, w)`` or ``(N, h, w, C)``
            (``(N, *shape)`` for BlobProto records).
        dtype: the batch array's dtype (float32, or uint8 for raw pixels; float64
            for BlobProto records on request).
        label_dtype: the labels' dtype (float32, as Caffe, or int64).
        state: the resume state after this batch (see :meth:`Batches.state_dict`),
            made on first use from ``state_source`` (a state costs a dict and a
            key's lookup, which a batch nobody checkpoints at never needs).
        state_source: makes :attr:`state` (called once, on first use).
        name: the source's name (``"data"`` for a single database).
        has_label: whether the records carry labels (Datums do, BlobProtos not).
        extra: the other sources read in lockstep, as ``(name, plan)``: the same
            rows (keys, indices, epochs, positions), with their own shapes,
            element types and random words.
        first_decoded: row 0's pixels (``(C, H, W)``; a BlobProto's values) and
            label when :meth:`Batches.next_plan` had to decode them to learn the
            batch's shape (filling row 0 then uses them), else None.
    """

    key_source: Callable[[], tuple[bytes, ...]]
    indices: npt.NDArray[np.int64]
    epochs: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    words: npt.NDArray[np.uint64]
    valid: int
    record_shape: tuple[int, ...]
    data_shape: tuple[int, ...]
    dtype: np.dtype[Any]
    state_source: Callable[[], dict[str, Any]]
    label_dtype: np.dtype[Any] = field(default=np.dtype(np.float32))
    name: str = "data"
    has_label: bool = True
    extra: tuple[tuple[str, BatchPlan], ...] = ()
    first_decoded: tuple[np.ndarray, int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def keys(self) -> tuple[bytes, ...]:
        """One key (bytes) per row (made once, on first use; threads that race here
        make equal tuples)."""
        keys: tuple[bytes, ...] | None = self.__dict__.get("_keys")
        if keys is None:
            keys = self.key_source()
            object.__setattr__(self, "_keys", keys)  # a cache of a frozen field's value
        return keys

    @property
    def state(self) -> dict[str, Any]:
        """The resume state after this batch (made once, on first use; threads that
        race here make equal states)."""
        state: dict[str, Any] | None = self.__dict__.get("_state")
        if state is None:
            state = self.state_source()
            object.__setattr__(self, "_state", state)  # a cache of a frozen field's value
        return state

    def take(self, rows: npt.ArrayLike, indices: npt.ArrayLike) -> BatchPlan:
        """The plan of rows ``rows`` alone, with global indices ``indices`` instead (a
        database's own, for the databases of one source); keeps row 0's decoded
        pixels when it is among them, first."""
        at = np.asarray(rows, np.intp)
        return dataclasses.replace(
            self,
            key_source=_keys_at(self.keys, at.tolist()),
            indices=read_only(np.array(indices, np.int64)),
            epochs=read_only(self.epochs[at]),
            positions=read_only(self.positions[at]),
            words=read_only(self.words[at]),
            valid=len(at),
            data_shape=(len(at), *self.data_shape[1:]),
            extra=(),
            first_decoded=self.first_decoded if at[0] == 0 else None,
        )

    @property
    def epoch(self) -> int:
        """The epoch of the first row."""
        return int(self.epochs[0])

    def with_rows(
        self,
        key_source: Callable[[], tuple[bytes, ...]],
        indices: npt.NDArray[np.int64],
        epochs: npt.NDArray[np.int64],
        positions: npt.NDArray[np.int64],
        words: npt.NDArray[np.uint64],
        valid: int,
        state_source: Callable[[], dict[str, Any]],
    ) -> BatchPlan:
        """The plan of another batch of as many rows, whose first record has this
        plan's shape, of the same single source: these per-row fields, ``valid`` and
        ``state_source`` replaced, everything else (shapes, dtypes, source) this
        plan's, and no decoded first record.

        Made without the dataclass's ``__init__`` (a frozen one's costs about 2 µs,
        once a batch, in the planner's thread); ``dataclasses.replace`` makes the
        same plan.
        """
        if len(indices) != len(self.indices) or self.extra:  # pragma: no cover - guarded
            raise ValueError("with_rows: a plan of one source and as many rows")
        return self._replaced(
            key_source=key_source, indices=indices, epochs=epochs, positions=positions,
            words=words, valid=valid, state_source=state_source, first_decoded=None,
        )  # fmt: skip

    def rows_like(self) -> Callable[..., BatchPlan]:
        """:meth:`with_rows` for many batches: a function of its seven arguments, in its
        order (and ``spanned=``, the :data:`_SPANNED` entry to note, or None) that makes each
        plan from one copy of this plan's other fields, taken now. The caller
        guarantees the plan is of one source and each batch has as many rows."""
        template = self.__dict__.copy()
        for cache in ("_keys", "_state", _SPANNED):
            template.pop(cache, None)
        template["first_decoded"] = None
        new = object.__new__
        set_dict = object.__setattr__

        def make(*rows: Any, spanned: tuple[RowSpan, int, int] | None = None) -> BatchPlan:
            fields = template.copy()
            (  # with_rows' arguments, in its order
                fields["key_source"], fields["indices"], fields["epochs"], fields["positions"],
                fields["words"], fields["valid"], fields["state_source"],
            ) = rows  # fmt: skip
            if spanned is not None:
                fields[_SPANNED] = spanned
            plan: BatchPlan = new(BatchPlan)
            set_dict(plan, "__dict__", fields)
            return plan

        return make

    def _replaced(self, **changes: Any) -> BatchPlan:
        """``dataclasses.replace(self, **changes)`` without ``__init__`` (no checks):
        the caches of keys and state, and the rows' span, are not carried over."""
        fields = self.__dict__.copy()
        fields.pop("_keys", None)
        fields.pop("_state", None)
        fields.pop(_SPANNED, None)
        fields.update(changes)
        plan = object.__new__(BatchPlan)
        object.__setattr__(plan, "__dict__", fields)
        return plan


@dataclass(frozen=True, eq=False)
class ArrayBatch:
    """One batch of transformed records.

    Attributes:
        data: ``(N, C, h, w)`` (or NHWC) float32, or uint8 with ``dtype="uint8"``
            (``(N, *shape)`` for BlobProto records); with several sources, the
            one named "data" (else the first).
        label: ``(N,)`` labels: float32, as Caffe outputs them, or int64
            (``label_dtype``); the source named "label" when there is one; None
            for BlobProto records without a label source.
        keys: the records' keys, row by row.
        indices: the records' global indices (position in key order).
        epoch: the epoch of the first row (in ``mode="wrap"`` a batch may run into
            the next epoch; see ``plan.epochs``).
        valid: the number of real rows; rows ``>= valid`` are padding.
        state: the resume state after this batch.
        plan: the plan the batch was built from.
        arrays: every source's array by name (``batch["name"]``).
    """

    data: np.ndarray
    label: np.ndarray | None
    keys: list[bytes]
    indices: tuple[int, ...]
    epoch: int
    valid: int
    state: dict[str, Any]
    plan: BatchPlan = field(repr=False)
    arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def __getitem__(self, name: str) -> np.ndarray:
        """The array of the source ``name`` (``"data"`` for a single database).

        Raises:
            KeyError: no source of that name.
        """
        try:
            return self.arrays[name]
        except KeyError:
            raise KeyError(
                f"no source named {name!r}; this batch has {sorted(self.arrays)}"
            ) from None


def _keys_at(keys: tuple[bytes, ...], rows: list[int]) -> Callable[[], tuple[bytes, ...]]:
    """A ``key_source`` of ``keys`` at ``rows``."""
    picked = tuple(keys[r] for r in rows)
    return lambda: picked


def key_source(keys: Any, indices: npt.NDArray[np.int64]) -> Callable[[], tuple[bytes, ...]]:
    """A ``key_source`` of the keys at ``indices`` of ``keys`` (a :class:`PackedKeys`,
    through its ``take``, or any sequence of bytes)."""
    take = getattr(keys, "take", None)
    if take is not None:
        return lambda: take(indices)
    return lambda: tuple(keys[i] for i in indices.tolist())


def merged(plans: list[BatchPlan]) -> BatchPlan | None:
    """Consecutive plans as one plan whose rows are theirs end to end, for one
    :meth:`Batches.fill` of them all (its rows ``[a:b]`` are then what filling
    ``plans[i]`` alone writes); None when they cannot be one fill: other sources
    read in lockstep, or first records of different shapes (each batch takes its
    own first record's).

    The merged plan's ``state`` and ``valid`` are the last plan's and the total;
    only ``plans[0]``'s decoded first record is kept (the others' are decoded
    again). A fill of it names ``plans[0]``'s first record where a record does
    not fit: to learn which batch a failure belongs to, fill the plans one by one.
    """
    head = plans[0]
    if len(plans) > 1:
        spanned = _spanned(plans)
        if spanned is not None:  # planned together: their rows are one array's already
            whole, a, b = spanned
            return head._replaced(
                key_source=_keys_of(plans),
                indices=read_only(whole.indices[a:b]),
                epochs=read_only(whole.epochs[a:b]),
                positions=read_only(whole.positions[a:b]),
                words=read_only(whole.words[a:b]),
                valid=sum(p.valid for p in plans),
                data_shape=(b - a, *head.data_shape[1:]),
                state_source=plans[-1].state_source,
            )
    for plan in plans[1:]:
        if (
            plan.extra
            or plan.record_shape != head.record_shape
            or plan.data_shape[1:] != head.data_shape[1:]
            or plan.dtype != head.dtype
            or plan.label_dtype != head.label_dtype
            or plan.name != head.name
        ):
            return None
    if head.extra:
        return None
    if len(plans) == 1:
        return head
    indices = joined([p.indices for p in plans])
    return dataclasses.replace(
        head,
        key_source=_keys_of(plans),
        indices=indices,
        epochs=joined([p.epochs for p in plans]),
        positions=joined([p.positions for p in plans]),
        words=joined([p.words for p in plans]),
        valid=sum(p.valid for p in plans),
        data_shape=(len(indices), *head.data_shape[1:]),
        state_source=plans[-1].state_source,
    )


def _keys_of(plans: list[BatchPlan]) -> Callable[[], tuple[bytes, ...]]:
    """A ``key_source`` of ``plans``' keys end to end."""
    sources = [p.key_source for p in plans]
    return lambda: tuple(k for source in sources for k in source())


class RowSpan(NamedTuple):
    """The per-row fields of consecutive batches planned together (:func:`row_arrays`),
    one array of each, which each batch's fields are views of."""

    indices: npt.NDArray[np.int64]
    epochs: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    words: npt.NDArray[np.uint64]


#: A plan's entry (in its ``__dict__``, beside the fields) for the :class:`RowSpan` its
#: rows are ``[a:b]`` of, as ``(span, a, b)``: set by :meth:`Batches.next_plans` on
#: plans of one shape (the first and those made from it by ``with_rows``), only there.
_SPANNED = "_spanned"


def spanned_as(plan: BatchPlan, rows: RowSpan, a: int, b: int) -> BatchPlan:
    """``plan``, noted as rows ``[a:b]`` of ``rows`` (:data:`_SPANNED`)."""
    plan.__dict__[_SPANNED] = (rows, a, b)
    return plan


def _spanned(plans: list[BatchPlan]) -> tuple[RowSpan, int, int] | None:
    """The span and rows ``[a:b]`` of it that ``plans`` are end to end, when they
    are consecutive rows of one span (planned together, of one shape); else None."""
    first = plans[0].__dict__.get(_SPANNED)
    if first is None:
        return None
    whole, a, b = first
    for plan in plans[1:]:
        at = plan.__dict__.get(_SPANNED)
        if at is None or at[0] is not whole or at[1] != b:
            return None
        b = at[2]
    return whole, a, b


class Step(NamedTuple):
    """One batch's place in the epochs' orders (:func:`advance`): its ``runs``
    (empty: a tail shorter than a batch, dropped), its real rows, and the cursor
    after it (``end``: the epoch ended with it; the cursor is at the next one)."""

    runs: list[Run]
    valid: int
    epoch: int
    pos: int
    end: bool


def advance(epoch: int, pos: int, batch_size: int, size: int, mode: str, last: str) -> Step:
    """The batch at position ``pos`` of ``epoch`` (an epoch of ``size`` records):
    ``mode="wrap"`` runs on into the next epoch; ``mode="epoch"`` ends the epoch
    with a short batch (``last="keep"``), one padded with the epoch's first records
    (``"pad"``), or without it (``"drop"``)."""
    bs = batch_size
    runs: list[Run] = []
    if mode == "wrap":
        left = bs
        while left:
            take = min(left, size - pos)
            runs.append((epoch, pos, pos + take))
            left -= take
            pos += take
            if pos == size:
                epoch, pos = epoch + 1, 0
        return Step(runs, bs, epoch, pos, False)
    count = min(bs, size - pos)
    if count < bs and last == "drop":
        return Step([], 0, epoch + 1, 0, False)
    runs.append((epoch, pos, pos + count))
    if count < bs and last == "pad":
        left = bs - count
        while left:  # the epoch's first records, again
            take = min(left, size)
            runs.append((epoch, 0, take))
            left -= take
    pos += count
    if pos == size or (last == "drop" and size - pos < bs):
        # the epoch ends here (a tail shorter than a batch is dropped): the resume
        # state already points at the next epoch
        return Step(runs, count, epoch + 1, 0, True)
    return Step(runs, count, epoch, pos, False)


def inner_count(pos: int, batch_size: int, size: int, mode: str, last: str, count: int) -> int:
    """How many of the next ``count`` batches from position ``pos`` (of an epoch of
    ``size`` records) lie inside the epoch and end before its last batch: each is what
    :func:`advance` gives as one run of ``batch_size`` rows, the cursor after it ``batch_size``
    on, in the same epoch; the others need :func:`advance`."""
    # a batch ends the epoch where it reaches its end, or (dropping the tail) where less
    # than a batch is left after it
    room = size - pos - (batch_size if mode == "epoch" and last == "drop" else 1)
    return min(count, max(0, room // batch_size))


class EpochOrders(Protocol):
    """Each epoch's order of record indices and random words (``_order.py``)."""

    def order(self, epoch: int) -> npt.NDArray[np.int64]: ...

    def words(self, epoch: int) -> npt.NDArray[np.uint64]: ...


def row_arrays(
    orders: EpochOrders, random: bool, batches: list[list[Run]]
) -> tuple[list[tuple[np.ndarray, ...]], RowSpan | None]:
    """Each batch's read-only ``(indices, epochs, positions, words)`` from its runs:
    views of one array of each where the batches are consecutive runs of one epoch
    (a batch within one epoch holds views of that epoch's order and words), else
    joined per batch. ``random``: words from ``orders``, else zeros. Also the arrays
    the views are of, where they are (``[0:b - a]`` of them are all the batches'
    rows), else None."""
    firsts = [runs[0] for runs in batches]
    consecutive = all(len(runs) == 1 for runs in batches) and all(
        x[0] == y[0] and x[2] == y[1] for x, y in itertools.pairwise(firsts)
    )
    if len(batches) > 1 and consecutive:
        e, a, b = firsts[0][0], firsts[0][1], firsts[-1][2]
        epochs = column(b - a, e)
        positions = read_only(span(a, b))
        order = orders.order(e)
        words = orders.words(e)[a:b] if random else shared_zeros(b - a, np.uint64)
        spans = [(lo - a, hi - a) for _, lo, hi in firsts]
        views: list[tuple[np.ndarray, ...]] = [
            (order[a + i : a + j], epochs[i:j], positions[i:j], words[i:j]) for i, j in spans
        ]
        return views, RowSpan(order[a:b], epochs, positions, words)
    out: list[tuple[np.ndarray, ...]] = []
    for runs in batches:
        if len(runs) == 1:  # one run of one epoch (most batches): views, no joins
            e, a, b = runs[0]
            out.append(
                (
                    read_only(orders.order(e)[a:b]),
                    column(b - a, e),
                    read_only(span(a, b)),
                    read_only(orders.words(e)[a:b]) if random else shared_zeros(b - a, np.uint64),
                )
            )
            continue
        indices = joined([orders.order(e)[a:b] for e, a, b in runs])
        out.append(
            (
                indices,
                joined([column(b - a, e) for e, a, b in runs]),
                joined([span(a, b) for _, a, b in runs]),
                joined([orders.words(e)[a:b] for e, a, b in runs])
                if random
                else shared_zeros(len(indices), np.uint64),
            )
        )
    return out, None
