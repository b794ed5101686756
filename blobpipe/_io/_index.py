"""Where each record's pixels lie in a buffer, and what they are: the record index.

Every batch is filled from a :class:`RecordIndex` (``_fill.py``). Its buffer is
either the LMDB data file mapped read-only (``_lmdbfile.value_extents`` gives
each value's offset and length; the index lives as long as the Batches and
learns each record once), or, for a source with no data file, the joined
values of one batch range (an index of that range, used once).

:meth:`RecordIndex.locate` tells, per row, its kind and where its payload is:

* ``RAW``: uint8 pixels of shape ``(C, H, W)`` at ``offset`` (``C·H·W`` bytes);
* ``ENCODED``: an image file of ``length`` bytes at ``offset``; its decoded
  shape once a batch has decoded it (0 before);
* ``PARSED``: a record the fill reads through the Datum parser (float_data);
  ``offset``/``length`` are the whole value's;
* ``BAD`` (or ``BLOB``, a BlobProto): a record that is not a valid Datum with
  pixels; the fill's checked path reads it again to raise its error (key, path,
  reason).

Records are classified the first time a batch reads them, by
:func:`~._records.classify` (a whole range at once), one thread at a time: a
filler that finds records unknown takes the index's lock and classifies those
still unknown then, so fillers reading consecutive batches do not classify the
same range ahead twice (the second waits for the first, then finds its records
known). A record's fields are written before its kind, so a thread that sees a
kind without the lock sees its fields.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from ._kernels import row_kernel
from ._lmdbfile import picked_meta
from ._pid import pid
from ._records import BAD, RAW, UNKNOWN, classify

__all__ = ["Located", "RecordIndex"]

# Records read in key order (or planned, in any order) are classified ahead, this many
# at most per pass (the reach grows to it: RecordIndex._reach), and no more than this
# many bytes of values (whose headers and tails are read).
_AHEAD = 8192
_AHEAD_BYTES = 8 << 20
_RAW_KIND = np.int8(RAW)
_SAME_SIZES = 16  # row counts whose broadcasts an index keeps
# NumPy releases the GIL to gather more items than this (a hand-off to a waiting thread)
_GATHER_KEEPS_GIL = 500


def gather(src: np.ndarray, rows: npt.NDArray[np.intp]) -> np.ndarray:
    """``src[rows]`` for a 1-D array of 4- or 8-byte items, gathered without releasing
    the GIL: by the compiled row kernel for more rows than NumPy gathers holding it
    (a chunk's offsets and labels), where it is built."""
    kernel = row_kernel()
    if kernel is None or len(rows) <= _GATHER_KEEPS_GIL:
        return src[rows]
    out = np.empty(len(rows), src.dtype)
    kernel.take(src, np.ascontiguousarray(rows, np.intp), out)
    return out


class Located(NamedTuple):
    """Rows of one range: per row, kind, payload offset and length, shape, label."""

    buffer: npt.NDArray[np.uint8]
    kind: npt.NDArray[np.int8]
    offset: npt.NDArray[np.int64]
    length: npt.NDArray[np.int64]
    shape: npt.NDArray[np.int32]  # (n, 3): C, H, W; zeros where not known
    label: npt.NDArray[np.int32]
    #: the shape of every row when all of them are known raw records of one shape (then
    #: kind, length and shape are read-only broadcasts, nothing gathered); else None
    raw_shape: tuple[int, int, int] | None = None


_NO_FLAGS = np.zeros(0, np.int32)


class RecordIndex:
    """Kind, payload extent, shape and label per record of a buffer of Datum values.

    ``offsets``/``lengths``: each value's place in ``buffer``, by record number.
    """

    def __init__(
        self,
        buffer: npt.NDArray[np.uint8],
        offsets: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64] | npt.NDArray[np.uint32],
        txnid: int | None = None,
    ) -> None:
        n = len(offsets)
        self.buffer = buffer
        self.txnid = txnid  # an LMDB file's: the transaction the offsets were read from
        self._metas: tuple[memoryview, memoryview] | None = None
        if txnid is not None:  # each meta page's mm_txnid, as a view: cheap to re-read
            psize = int(buffer[40:44].view("<u4")[0])
            # (read as bytes: a NumPy scalar read took ~20 µs once a batch's rows had
            # evicted NumPy's code from the caches)
            self._metas = (
                buffer[144:152].data,
                buffer[psize + 144 : psize + 152].data,
            )
        self._value_offset = np.asarray(offsets, np.int64)
        self._value_length = np.asarray(lengths, np.int64)
        self._kind = np.zeros(n, np.int8)
        self._offset = np.zeros(n, np.int64)
        self._length = np.zeros(n, np.int64)
        self._shape = np.zeros((n, 3), np.int32)
        # the same memory a row of 12 bytes each: gathered by a 1-D index, which keeps
        # the GIL (NumPy releases it to gather rows of a 2-D array: a hand-off to a
        # waiting thread, once a batch)
        self._shape_rows = self._shape.view(np.dtype((np.void, 12))).reshape(n)
        self._label = np.zeros(n, np.int32)  # Caffe's int32 labels, exactly
        # records not classified yet, counted down by each pass (under _classifying):
        # at 0 the whole index is checked once for _raw_shape
        self._left = n
        # records whose shape is not known (encoded ones not decoded yet): counted once
        # every record is classified (None before), then down as shapes are noted
        self._shapeless: int | None = None
        # set once every record is known to be a raw one of this (C, H, W) (then never
        # unset: a record's kind and a raw one's fields do not change)
        self._raw_shape: tuple[int, int, int] | None = None
        # the shape of a raw record of the first pass, and per record 1 once it is known
        # to be a raw one of that shape (then never 0 again): a batch whose rows are all
        # such records is located as when every record is (a shard's reader sees only
        # its records; int32: gathered holding the GIL)
        self._common: tuple[int, int, int] | None = None
        self._of_common = _NO_FLAGS  # (made with _common: an index of others has none)
        self._ones = b""  # 1 as int32, repeated: what the flags of such rows read
        # then: kind, length and shape of n such rows, by n (read-only broadcasts)
        self._same: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # one classify at a time (module docstring); a fork's child gets its own lock
        # (another thread of the parent may have held it at the fork)
        self._classifying = threading.Lock()
        self._pid = pid()
        self._ahead = 0  # records the last pass took ahead at most (_reach)

    @classmethod
    def joined(cls, values: Sequence[bytes | memoryview | None]) -> RecordIndex:
        """An index of ``values`` joined into one buffer (a missing value is BAD)."""
        lengths = np.fromiter((0 if v is None else len(v) for v in values), np.int64, len(values))
        offsets = np.cumsum(lengths) - lengths
        joined = b"".join(b"" if v is None else v for v in values)
        index = cls(np.frombuffer(joined, np.uint8), offsets, lengths)
        index._kind[[i for i, v in enumerate(values) if v is None]] = BAD
        return index

    def __len__(self) -> int:
        return len(self._kind)

    def changed(self) -> tuple[int, int] | None:
        """For the index of an LMDB file: ``(then, now)`` when a writer committed a
        new transaction since the offsets were read (the file's meta pages moved
        on), else None. The check reads two 8-byte fields."""
        if self._metas is None or self.txnid is None:
            return None
        ids = int.from_bytes(self._metas[0], "little"), int.from_bytes(self._metas[1], "little")
        now = ids[picked_meta(*ids)]
        return None if now == self.txnid else (self.txnid, now)

    def value(self, i: int) -> memoryview:
        """Record ``i``'s whole stored value (a view of the buffer)."""
        start = int(self._value_offset[i])
        return self.buffer[start : start + int(self._value_length[i])].data

    @property
    def uniform_shape(self) -> tuple[int, int, int] | None:
        """The ``(C, H, W)`` of every record, once all are known to be raw records of
        one shape (then never None again); else None."""
        return self._raw_shape

    def shape_of(self, i: int) -> tuple[int, int, int] | None:
        """The ``(C, H, W)`` record ``i`` yields, if known."""
        if self._raw_shape is not None:  # every record's (no lookup: once a batch)
            return self._raw_shape
        if self._shape[i, 0]:
            c, h, w = self._shape[i].tolist()
            return (c, h, w)
        return None

    def note_shapes(self, rows: npt.NDArray[np.intp], shapes: npt.NDArray[np.int32]) -> None:
        """Record the decoded shapes of encoded records ``rows``."""
        with self._lock():
            if self._shapeless is not None:  # each record counted once
                fresh = rows[self._shape[rows, 0] == 0]
                self._shapeless -= len(set(fresh.tolist()))
            self._shape[rows] = shapes

    @property
    def shapes_known(self) -> bool:
        """Whether every record's shape is known: a raw record's from its header, an
        encoded one's once it was decoded (:meth:`note_shapes`). Then a fill need not
        look for rows whose shape to note (a W4 batch's look took 60-130 µs holding
        the GIL, right after its decode)."""
        return self._shapeless == 0

    def _lock(self) -> threading.Lock:
        """The lock of classifying passes and shapes noted (a forked child's own)."""
        if self._pid != pid():
            self._classifying, self._pid = threading.Lock(), pid()
        return self._classifying

    def locate(
        self, rows: npt.NDArray[np.intp], hint: tuple[int, int, int] | None = None
    ) -> Located:
        """What the records ``rows`` hold, classifying those not seen before.

        ``hint``: the shape raw records of this range probably have (the batch's
        first record's); records of that shape in convert_imageset's layout are
        recognised in one pass.

        Where every row is known to be a raw record of one shape (a convert_imageset
        database, its records of ``rows`` classified), only the offsets and labels of
        ``rows`` are gathered.
        """
        raw = self._raw_shape or self._all_common(rows)
        if raw is None and self._learn(rows, hint):
            raw = self._all_common(rows)  # (a first epoch's batches, new rows of a shard's)
        if raw is not None:
            n = len(rows)
            same = self._same.get(n)
            if same is None:  # (a few sizes: the batch's, a chunk's, the last batch's)
                size = raw[0] * raw[1] * raw[2]
                same = (
                    np.broadcast_to(_RAW_KIND, n),
                    np.broadcast_to(np.int64(size), n),
                    np.broadcast_to(np.array(raw, np.int32), (n, 3)),
                )
                if len(self._same) < _SAME_SIZES:
                    self._same[n] = same
            kind, length, shape = same
            return Located(
                self.buffer, kind, gather(self._offset, rows), length, shape,
                gather(self._label, rows), raw,
            )  # fmt: skip
        return Located(
            self.buffer,
            self._kind[rows],
            self._offset[rows],
            self._length[rows],
            self._shape_rows[rows].view(np.int32).reshape(len(rows), 3),
            self._label[rows],
        )

    def learn(
        self,
        rows: npt.NDArray[np.intp],
        ahead: npt.NDArray[np.int64] | None = None,
        before: Callable[[], object] | None = None,
    ) -> None:
        """Classify the records of ``rows`` not classified yet, in one pass (the rows of
        the batches a call plans: then their shapes are known without a read, and
        locating them finds them classified), with the common raw shape as the hint;
        nothing before that shape is known (a pass without a hint parses each record
        alone, ten times slower: the first batch's own calls find the shape).

        ``ahead``: the records read after ``rows``, in order (the rest of the epoch's);
        where ``rows`` need a pass, it takes as many of them as the index's reach
        (:meth:`_reach`: at most :data:`_AHEAD` records) within :data:`_AHEAD_BYTES` of
        values too, so that the next batches need none (a pass has a fixed cost: a
        shuffled epoch meets new records in every batch).

        ``before``: called before a pass reads the buffer (the file's shrink check; a
        system call, not made where no pass is needed)."""
        if self._common is None or self._raw_shape is not None or self._all_common(rows):
            return
        if ahead is not None and len(ahead):
            ahead = ahead[: self._reach(len(rows))].astype(np.intp, copy=False)
            count = int(np.searchsorted(np.cumsum(self._value_length[ahead]), _AHEAD_BYTES))
            rows = np.concatenate([rows, ahead[:count]])
        self._learn(rows, self._common, before)

    def _reach(self, rows: int) -> int:
        """How many records ahead a pass for ``rows`` records takes at most: as many as
        its own at the index's first such pass, twice the last one's at each after, up
        to :data:`_AHEAD`. The window grows as a file's read-ahead does: the first
        batch waits for its own records and as many again, not for 8 MiB of others
        (a pass faults in a page or two of each record it takes)."""
        reach = self._ahead = min(_AHEAD, max(2 * self._ahead, rows, 1))
        return reach

    def _learn(
        self,
        rows: npt.NDArray[np.intp],
        hint: tuple[int, int, int] | None,
        before: Callable[[], object] | None = None,
    ) -> bool:
        """Classify the unknown records of ``rows`` (``before`` called first, where there
        are any); whether there were any."""
        if not self._left:  # every record classified (a look took a W4 batch 60 µs)
            return False
        if not (self._kind[rows] == UNKNOWN).any():
            return False
        if before is not None:
            before()
        with self._lock():
            self._classify(rows, hint)
        return True

    def _all_common(self, rows: npt.NDArray[np.intp]) -> tuple[int, int, int] | None:
        """The common shape, where every record of ``rows`` is known to be a raw one of
        it (their flags all 1); else None."""
        common = self._common
        if common is None:
            return None
        flags = gather(self._of_common, rows).tobytes()
        if len(self._ones) < len(flags):
            self._ones = np.ones(max(len(rows), 1024), np.int32).tobytes()
        return common if flags == self._ones[: len(flags)] else None

    def _classify(self, rows: npt.NDArray[np.intp], hint: tuple[int, int, int] | None) -> None:
        """Classify the records of ``rows`` still unknown (and those ahead of them: see
        :meth:`_with_next`); under ``_classifying``."""
        unknown = rows[self._kind[rows] == UNKNOWN]
        if not len(unknown):  # another thread classified them while this one waited
            return
        if hint is not None:
            unknown = self._with_next(rows, unknown)
        # sorted, once each (np.unique imports numpy.ma); mostly they are already
        # (key order)
        if len(unknown) > 1 and not (unknown[1:] > unknown[:-1]).all():
            unknown = np.array(sorted(set(unknown.tolist())), np.intp)
        got = classify(self.buffer, self._value_offset[unknown], self._value_length[unknown], hint)
        self._offset[unknown] = got.offset
        self._length[unknown] = got.length
        self._shape[unknown] = got.shape
        self._label[unknown] = got.label
        self._kind[unknown] = got.kind  # a thread that sees a kind sees its fields
        if self._common is None:  # the first pass's middle raw record: not an odd first
            raws = np.flatnonzero(got.kind == RAW)
            if len(raws):
                c, h, w = got.shape[raws[len(raws) // 2]].tolist()
                self._of_common = np.zeros(len(self._kind), np.int32)
                self._common = (c, h, w)  # after the flags: who sees it sees them
        if self._common is not None:  # last: a thread that sees a flag sees the fields
            common = (got.kind == RAW) & (got.shape == self._common).all(axis=1)
            self._of_common[unknown] = common
        self._left -= len(unknown)  # each once (sorted, distinct), each unknown until now
        if self._left <= 0:
            self._settle()

    def _settle(self) -> None:
        """Every record was classified (under ``_classifying``): count again (exactly,
        once), and note the shape when all of them are raw records of one."""
        self._left = int(np.count_nonzero(self._kind == UNKNOWN))
        if self._left:
            return
        self._shapeless = int(np.count_nonzero(self._shape[:, 0] == 0))
        if not len(self._kind) or not (self._kind == RAW).all():
            return
        first = self._shape[0]
        if (self._shape == first).all():
            c, h, w = first.tolist()
            self._raw_shape = (c, h, w)

    def _with_next(
        self, rows: npt.NDArray[np.intp], unknown: npt.NDArray[np.intp]
    ) -> npt.NDArray[np.intp]:
        """``unknown`` (of ``rows``) and, when ``rows`` are consecutive records (read
        in key order; some of them may be known already, e.g. each batch's first,
        read to plan it), the unknown records that follow them, as many as the
        index's reach (:meth:`_reach`) within :data:`_AHEAD_BYTES` of values: the next
        batches' records are then recognised in this pass."""
        first, last = int(rows[0]), int(rows[-1])
        if last - first != len(rows) - 1:
            return unknown
        lengths = self._value_length[last + 1 : last + 1 + self._reach(len(rows))]
        count = int(np.searchsorted(np.cumsum(lengths), _AHEAD_BYTES))
        ahead = np.arange(last + 1, last + 1 + count, dtype=np.intp)
        return np.concatenate([unknown, ahead[self._kind[ahead] == UNKNOWN]])
