"""Filling batch rows: the one path from stored records to transformed rows.

For consecutive rows of a plan, from ``start`` on, written into one or several
:class:`Part` s (each its own arrays: a merged plan's batches straight into their
slots), :meth:`Filler.fill`

1. locates the records in the record index (``_index.py``): the LMDB data file
   mapped read-only when it can be, else the joined values of these rows;
2. takes each row's pixels where they lie: raw uint8 pixels as views of the
   buffer (rows at one stride as one strided view); JPEGs and PNGs decoded and
   transformed in one call where that is exact (``_image.decode_rows``), each at its
   own size as its header says (``_image.image_sizes``) with its own crop and flip
   (drawn for every row at once, ``Transform.geometry_of``) where the transform
   makes one row shape of any size (a crop, no mean file), else those of the batch's
   record shape; other encoded images one after another (``_image.decode_image``;
   with a crop, ``_image.decode_window`` decodes only the crop's window where that
   is exact); float records through the parser;
3. draws each row's crop offset and flip, and runs the transform kernel
   (``_kernels.apply``) from those pixels into the caller's output.

A database of ``caffe.BlobProto`` records (``kind="blobproto"``) fills its rows
from each record's values (parsed by the codec, ``blobproto_array``), through
the same kernel where Caffe's ``DataTransformer::Transform(Blob*)`` applies
(records of 3 axes, ``(C, H, W)``, or 4, ``(N, C, H, W)``, whose items share one
crop and flip, as there); ``_records.py`` tells the kinds apart.

A row that cannot be had this way (not a valid Datum, an image that does not
decode, a shape that does not fit the batch or the transform) goes through the
checked per-record path, :meth:`Filler._checked_row`, which reads it again and
raises the error that names it (key, database path, reason).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from .._errors import BlobpipeError, DataError, ShapeError, spell
from ._datum import DEFAULT_MAX_PIXELS, checked_view, view_record
from ._image import (
    Decoded,
    Undecodable,
    decode_image,
    decode_rows,
    decode_whole,
    decode_window,
    image_sizes,
    imread_flag,
    rows_decodable,
)
from ._index import Located, RecordIndex
from ._kernels import Deferral, Geometry, apply, apply_one, apply_raw, kernel_args, prefers_block
from ._lmdb import LmdbReader
from ._plan import BatchPlan, span
from ._records import (
    BLOBPROTO,
    DATUM,
    ENCODED,
    PARSED,
    RAW,
    RecordKind,
    blob_record,
    byte_windows,
)
from ._transform import Phase, RecordParams, Transform

__all__ = ["Filler", "Part", "RecordSource", "RowFiller", "part_of", "shape_fix", "store_geometry"]

_U1 = np.dtype(np.uint8)
# Rows at one stride are taken as one strided view per run while a batch has at
# most one run per this many rows (a kernel call per run); more runs than that:
# a gather or a view per row.
_ROWS_PER_RUN = 16
#: the most record shapes whose fit ``Filler._fits`` keeps (a database of images of
#: every size asks about each; past these, each is checked again)
_FITS_KEPT = 256


def _stride_runs(offsets: list[int], most: int) -> list[tuple[int, int, int]] | None:
    """``offsets`` split, from the first, into runs ``(lo, hi, stride)`` of rows
    ``lo..hi`` each at ``stride`` bytes from the one before (a run's last row
    ends it; a run of one row has stride 0); None when it takes more than
    ``most`` runs."""
    runs: list[tuple[int, int, int]] = []
    n = len(offsets)
    lo = 0
    while lo < n:
        if len(runs) == most:
            return None
        hi = lo + 1
        stride = 0
        if hi < n and offsets[hi] >= offsets[lo]:
            stride = offsets[hi] - offsets[lo]
            while hi < n and offsets[hi] - offsets[hi - 1] == stride:
                hi += 1
        runs.append((lo, hi, stride))
        lo = hi
    return runs


class RecordSource(Protocol):
    """What Batches needs from a reader (:class:`LmdbReader` provides it)."""

    def keys(self) -> Sequence[bytes]:
        """All keys, in key order."""
        ...

    def get(self, key: bytes) -> bytes:
        """The value stored under ``key``.

        A source may also offer ``transaction()``, a context manager whose ``get``
        returns views valid inside the block (as :class:`LmdbReader` does).
        """
        ...


def shape_fix(a: tuple[int, ...], b: tuple[int, ...], datum: bool) -> str:
    """What to do when records of shapes ``a`` and ``b`` (``(C, H, W)`` for Datums)
    must make rows of one batch."""
    if not datum:
        return "BlobProto records of one batch must share a shape: use batch_size=1"
    if a[0] != b[0]:
        return (
            f"their channels differ ({a[0]} and {b[0]}): build the databases alike "
            "(convert_imageset --gray for 1 channel, without it for 3), or, for encoded "
            f"records, decode them alike with {spell('force_color')} or "
            f"{spell('force_gray')}"
        )
    return (
        f"their sizes differ ({a[1]}×{a[2]} and {b[1]}×{b[2]}): resize when building the "
        "databases (convert_imageset --resize_height/--resize_width; an ImageList or "
        "ImageData layer: new_height/new_width), or crop them to one "
        "size (crop_size no larger than the smallest), or use batch_size=1"
    )


class Part(NamedTuple):
    """Consecutive rows of a fill, written to arrays of their own: ``data`` and
    ``label`` hold ``len(label)`` rows, ``geometry`` (or None) their crops and flips."""

    data: np.ndarray
    label: np.ndarray
    geometry: Geometry | None


def part_of(
    data_out: np.ndarray, label_out: np.ndarray, start: int, stop: int, geometry: Geometry | None
) -> Part:
    """Rows ``[start:stop]`` of whole-plan outputs, as one part (views)."""
    rows = slice(start, stop)
    return Part(data_out[rows], label_out[rows], None if geometry is None else geometry.take(rows))


def store_geometry(out: Geometry, rows: slice | npt.NDArray[np.intp], geometry: Geometry) -> None:
    """``geometry``'s rows written into rows ``rows`` of ``out`` (a slice or an index
    array of ``len(geometry)`` rows)."""
    out.h_off[rows] = geometry.h_off
    out.w_off[rows] = geometry.w_off
    out.mirror[rows] = geometry.mirror


class RowFiller(Protocol):
    """What Batches needs of a source's filler: one database's (:class:`Filler`) or
    several read as one (``_concat.ConcatFiller``)."""

    kind: RecordKind
    blob_dtype: np.dtype[Any]  # a BlobProto database's element type

    @property
    def transform(self) -> Transform:
        """The transform every row goes through."""
        ...

    def output(self, record_shape: tuple[int, ...], key: bytes) -> tuple[tuple[int, ...], Any]:
        """The row shape and element type of records of ``record_shape``."""
        ...

    def uniform_shape(self) -> tuple[int, ...] | None:
        """The shape :meth:`first` gives every record with nothing decoded, where that
        is known without a read; else None."""
        ...

    def learn(self, indices: npt.NDArray[np.int64], ahead: npt.NDArray[np.int64]) -> None:
        """Learn what the records ``indices`` (a call's planned rows) are, together,
        where that makes :meth:`first` and :meth:`fill` of them cheaper; ``ahead``: the
        records planned after them, in order."""
        ...

    def first(self, index: int) -> tuple[tuple[int, ...], tuple[np.ndarray, int] | None]:
        """The shape of record ``index``, and its pixels and label if decoded."""
        ...

    def fill(
        self, plan: BatchPlan, start: int, parts: Sequence[Part], defer: Deferral | None = None
    ) -> None:
        """Rows of ``plan`` from ``start`` on into ``parts``, in order: each part
        takes as many rows as it holds (its ``geometry``: their crop offsets and
        flips). ``defer``: where the rows' compiled kernel call may be started
        instead of run (its jobs and the checks after them collected there); a
        filler that cannot defer fills them in this call."""
        ...

    def close(self) -> None:
        """Let go of the record index (the reader stays open)."""
        ...


class Filler:
    """Reads, decodes and transforms batch rows; thread-safe (one per Batches)."""

    def __init__(
        self, reader: RecordSource, keys: Sequence[bytes], transform: Transform, phase: Phase,
        path: object, kind: RecordKind = DATUM, blob_dtype: np.dtype[Any] | None = None,
    ) -> None:  # fmt: skip
        self.kind: RecordKind = kind
        # a BlobProto database's batch element type (float32, or float64 on request)
        self.blob_dtype: np.dtype[Any] = np.dtype(np.float32) if blob_dtype is None else blob_dtype
        self._reader = reader
        self._keys = keys
        self._transform = transform
        self._phase: Phase = phase
        self._path = path
        self._flag = imread_flag(transform.force_color, transform.force_gray)
        self._index: RecordIndex | None = None
        self._index_tried = False
        self._lock = threading.Lock()
        # _fits' answers: (shape, dtype, expected row shape) -> whether it fits
        self._fit: dict[tuple[tuple[int, ...], np.dtype[Any], tuple[int, ...]], bool] = {}

    def close(self) -> None:
        with self._lock:  # the index's map of the file goes with the reader
            self._index, self._index_tried = None, True
            self._keys = ()

    def index(self) -> RecordIndex | None:
        """The database's record index, made on first use; None where its data
        file cannot be read directly (each range then indexes its own values).
        Every call first checks that the file did not shrink under its map.

        Raises:
            DataError: the data file shrank since it was opened (it would SIGBUS).
        """
        if isinstance(self._reader, LmdbReader):
            self._reader.check_file()
        if not self._index_tried:
            with self._lock:
                if not self._index_tried:
                    reader = self._reader
                    found = None
                    if isinstance(reader, LmdbReader):
                        found = reader.mapped_extents(self._keys)
                    if found is not None:
                        file, extents = found
                        self._index = RecordIndex(
                            file, extents.offsets, extents.lengths, extents.txnid
                        )
                    self._index_tried = True
        return self._index

    # -- planning -----------------------------------------------------------------------------

    @property
    def transform(self) -> Transform:
        return self._transform

    def output(self, record_shape: tuple[int, ...], key: bytes) -> tuple[tuple[int, ...], Any]:
        """The row shape and element type records of ``record_shape`` make, checked
        against the transform (crop, mean; for BlobProto records, the axes Caffe's
        transform works on).

        Raises:
            DataError: the record does not fit the transform; names key and path.
        """
        t = self._transform
        try:
            if self.kind == DATUM:
                out = t.output_shape(record_shape)
                t.kernel_spec(record_shape)  # the mean must fit the record
                return out, t.dtype
            if t.dtype == _U1:
                raise ShapeError(
                    "dtype='uint8' output is for Datum pixels; a BlobProto database holds "
                    "float values: use dtype='float32'"
                )
            if t.is_identity:
                return record_shape, self.blob_dtype
            if len(record_shape) not in (3, 4):
                raise ShapeError(
                    f"the record is a BlobProto of shape {record_shape}; a transform (crop, "
                    "mirror, mean, scale, layout) applies, as in Caffe's "
                    "DataTransformer::Transform(Blob*), to (C, H, W) or (N, C, H, W) records "
                    "only: read these records without a transform"
                )
            chw = record_shape[-3:]
            t.kernel_spec(chw)
            return (*record_shape[:-3], *t.output_shape(chw)), self.blob_dtype
        except ShapeError as exc:
            raise DataError(str(exc), path=self._path, key=key) from exc

    def _made(self) -> RecordIndex | None:
        """A Datum database's record index if it was made already; else None. Never
        makes one (no read, no check of the file)."""
        return self._index if self._index_tried and self.kind != BLOBPROTO else None

    def uniform_shape(self) -> tuple[int, ...] | None:
        """The shape :meth:`first` gives every record, where the index knows it without
        a read (raw records of one shape, all seen); else None."""
        known = self._made()
        return None if known is None else known.uniform_shape

    def learn(self, indices: npt.NDArray[np.int64], ahead: npt.NDArray[np.int64]) -> None:
        """Classify the records ``indices`` not seen yet in one pass of the index, with
        some of ``ahead`` (:meth:`RecordIndex.learn`): not one pass for each batch's
        first record and one for its fill (a shuffled epoch, a shard's reader, meets
        new records in every batch)."""
        index = self._made()
        if index is not None:  # (none made yet: no shape known to learn with either)
            index.learn(indices.astype(np.intp, copy=False), ahead, before=self.index)

    def first(self, index: int) -> tuple[tuple[int, ...], tuple[np.ndarray, int] | None]:
        """The shape of record ``index`` (the batch's shape: ``(C, H, W)`` for a
        Datum, the blob's shape for a BlobProto), and its pixels (values) and label
        when they had to be decoded (or read from a source with no file) to learn it.

        Raises:
            DataError: the record cannot be read or decoded; names key and path.
        """
        if self.kind == BLOBPROTO:
            values = self._blob(index)
            return values.shape, (values, 0)
        known = self._made()
        if known is not None:  # what the index learned: no read of the file
            shape = known.shape_of(index)
            if shape is not None:
                return shape, None
        idx = self.index()  # checks the file before its pages are read
        key = self._keys[index]
        if idx is not None:
            loc = idx.locate(np.array([index], np.intp))
            kind = int(loc.kind[0])
            if kind in (RAW, PARSED):
                c, h, w = loc.shape[0].tolist()
                return (c, h, w), None
            if kind == ENCODED:
                off, length = int(loc.offset[0]), int(loc.length[0])
                hwc = decode_image(idx.buffer[off : off + length].data, self._flag)
                if not isinstance(hwc, Undecodable):
                    h, w, c = hwc.shape
                    idx.note_shapes(np.array([index], np.intp), np.array([(c, h, w)], np.int32))
                    return (c, h, w), (hwc.transpose(2, 0, 1), int(loc.label[0]))
        chw, label = self._read(key, self._reader.get)  # raises the record's error
        c, h, w = chw.shape
        return (c, h, w), (chw, label)

    def _blob(self, index: int) -> np.ndarray:
        """Record ``index``'s BlobProto values, shaped (errors name key and path)."""
        key = self._keys[index]
        idx = self.index()
        value = idx.value(index) if idx is not None else self._reader.get(key)
        return blob_record(value, key, self._path)

    def _read(self, key: bytes, get: Callable[[bytes], Any]) -> tuple[np.ndarray, int]:
        """Record ``key``'s ``(C, H, W)`` pixels and label, checked (errors name it)."""
        p, chw, label = checked_view(get(key), self._flag, DEFAULT_MAX_PIXELS, key, self._path)
        if not p.encoded:
            chw = chw.copy()  # a view of a transaction's memory: keep a copy
        return chw, label

    # -- filling ------------------------------------------------------------------------------

    def fill(
        self, plan: BatchPlan, start: int, parts: Sequence[Part], defer: Deferral | None = None
    ) -> None:
        """Rows of ``plan`` from ``start`` on into ``parts`` (checked by the caller):
        the records located, the crops drawn and the checks made once for them all.
        ``defer``: raw rows' kernel call is started there (the snapshot check then
        follows it there); other rows are filled in this call."""
        if self.kind == BLOBPROTO:
            for a, part in _spans(start, parts):
                self._fill_blobs(plan, part, a)
            return
        stop = start + sum(len(part.label) for part in parts)
        n = stop - start
        index = self.index()
        persistent = index is not None
        if index is not None:
            rows = plan.indices[start:stop].astype(np.intp, copy=False)
        else:
            values_at = getattr(self._reader, "values_at", None)  # by position (LevelDB)
            index = RecordIndex.joined(
                values_at(plan.indices[start:stop])
                if values_at is not None
                else self._values(plan.keys[start:stop])
            )
            rows = span(0, n).astype(np.intp, copy=False)
        c, h, w = plan.record_shape  # a Datum's
        shape = (c, h, w)
        loc = index.locate(rows, shape)
        spans = [(a - start, part) for a, part in _spans(start, parts)]
        for a, part in spans:
            part.label[:] = loc.label[a : a + len(part.label)]
        t = self._transform
        words = plan.words[start:stop]
        started = False  # the rows' kernel call was started on defer's pool
        if loc.raw_shape == shape or ((loc.kind == RAW).all() and (loc.shape == shape).all()):
            spec = t.kernel_spec(shape)  # validated by next_plan
            geometry = t.geometry(shape, self._phase, words)
            outs = [part.data for _, part in spans]
            kernel = apply_raw(loc.buffer, loc.offset, shape, outs, geometry, spec, defer)
            started = kernel and defer is not None
            for a, part in spans:  # one kernel call for every part, or each part here
                if kernel and part.geometry is None:
                    continue  # written, and no crops to keep (a slice costs a microsecond)
                m = len(part.label)
                g = geometry if m == n else geometry.take(slice(a, a + m))
                if not kernel:
                    offsets = loc.offset[a : a + m]
                    for lo, hi, src in _raw_blocks(loc.buffer, offsets, shape, part.data):
                        apply(np, src, part.data[lo:hi], g.take(slice(lo, hi)), spec)
                if part.geometry is not None:
                    store_geometry(part.geometry, slice(None), g)
        else:  # encoded rows in one call; the rest row by row, each image transformed in cache
            # the JPEGs and PNGs, each of its own size, in one call where it can be done
            batch = self._decode_rows(plan, loc, start, words, [part.data for _, part in spans])
            every = batch is not None and batch.every
            # each row's crop and flip (those of the rows written there, the others set
            # below, or their checked path raises), then stored in the parts' geometry
            drawn = batch.geometry if batch is not None and every else Geometry.zeros(n)
            if batch is not None and not every:
                written = np.flatnonzero(batch.done)
                store_geometry(drawn, written, batch.geometry.take(written))
            learned = [] if every else self._fill_rows(plan, loc, start, spans, drawn, batch)
            for a, part in spans:
                if part.geometry is not None:
                    store_geometry(
                        part.geometry, slice(None), drawn.take(slice(a, a + len(part.label)))
                    )
            if persistent and batch is not None and not index.shapes_known:
                # the shapes of the rows written, once
                new = batch.done & (loc.shape[:, 0] == 0)
                if new.any():
                    at = np.flatnonzero(new)
                    shapes = np.empty((len(at), 3), np.int32)
                    shapes[:, 0] = shape[0]
                    shapes[:, 1:] = batch.sizes[at]
                    index.note_shapes(rows[at], shapes)
            if persistent and learned:
                noted = np.fromiter((r for r, _ in learned), np.intp, len(learned))
                index.note_shapes(rows[noted], np.array([s for _, s in learned], np.int32))
        if persistent:
            if started:  # after the rows are read
                assert defer is not None
                defer.after.append(functools.partial(self._check_snapshot, index))
            else:
                self._check_snapshot(index)

    def _fill_blobs(self, plan: BatchPlan, part: Part, start: int) -> None:
        """BlobProto rows from ``start`` on into ``part``: each record's values,
        through the kernel unless the transform is the identity."""
        rows = []
        shape = plan.record_shape
        n = len(part.label)
        for r in range(start, start + n):
            first = plan.first_decoded if r == 0 else None
            values = first[0] if first is not None else self._blob(int(plan.indices[r]))
            if values.shape != shape:
                raise DataError(
                    f"record {plan.keys[r]!r} is a blob of shape {values.shape} but the batch's "
                    f"first record {plan.keys[0]!r} has shape {shape}; records in one batch "
                    "must share a shape: use batch_size=1",
                    path=self._path,
                    key=plan.keys[r],
                )
            rows.append(values)
        out = part.data
        t = self._transform
        if t.is_identity:
            for r, values in enumerate(rows):
                out[r] = values
            geometry = Geometry.zeros(n)
        else:
            chw = shape[-3:]
            words = plan.words[start : start + n]
            geometry = t.geometry(chw, self._phase, words)
            spec = t.kernel_spec(chw)
            if len(shape) == 3:
                apply(np, rows, out, geometry, spec)
            else:  # a 4-D blob's items share one crop and flip, as in Caffe
                items = shape[0]
                for r, values in enumerate(rows):
                    apply(np, values, out[r], geometry.take([r] * items), spec)
        if part.geometry is not None:
            store_geometry(part.geometry, slice(None), geometry)
        index = self.index()
        if index is not None:
            self._check_snapshot(index)

    def _check_snapshot(self, index: RecordIndex) -> None:
        """After a range was read from the file map: refuse it if a writer committed
        since the index was made (its rows may mix two versions of the database).

        Raises:
            DataError: the database changed; names it.
        """
        changed = index.changed()
        if changed is not None:
            then, now = changed
            raise DataError(
                f"the database changed while it was being read (transaction {then}, now "
                f"{now}): blobpipe reads one snapshot of it, as Caffe's DataLayer does; "
                "do not write to a database while a Loader or Batches reads it, or open a "
                "new one to read the new data",
                path=self._path,
            )

    def _fill_rows(
        self, plan: BatchPlan, loc: Located, start: int, spans: list[tuple[int, Part]],
        drawn: Geometry, batch: Decoded | None,
    ) -> list[tuple[int, tuple[int, ...]]]:  # fmt: skip
        """The rows of the range from ``start`` that ``batch`` (:meth:`_decode_rows`) did
        not write, one at a time into their parts (``spans``), their crops and flips into
        ``drawn``; returns the encoded rows decoded, with their shapes."""
        t = self._transform
        shape = plan.record_shape
        spec = t.kernel_spec(shape)  # validated by next_plan; rows of other shapes share it
        words = plan.words[start : start + len(drawn)]
        h_off, w_off, mirror = drawn.arrays()
        # row r's part and its row there
        where = [(part, r) for _, part in spans for r in range(len(part.label))]
        expected = plan.data_shape[1:]
        learned: list[tuple[int, tuple[int, ...]]] = []
        # rows of the batch's record shape (all, mostly) take their crops and flips from
        # one draw for the whole range (the windows decoded too)
        shared = t.geometry(shape, self._phase, words)
        kinds = loc.kind.tolist()
        done = None if batch is None else batch.done
        for r, chw in self._rows(plan, loc, start, shared, done):
            part, at = where[r]
            if chw is None or not self._fits(chw.shape, chw.dtype, expected):
                # the checked path raises; a row it fills after all is done
                p, part.label[at] = self._checked_row(plan, start + r, part.data[at])
                h_off[r], w_off[r], mirror[r] = p.h_off, p.w_off, p.mirror
                continue
            if chw.shape == shape:
                hh, ww, flip = shared.row(r)
            else:
                hh, ww, flip = t.geometry(chw.shape, self._phase, words[r : r + 1]).row(0)
            h_off[r], w_off[r], mirror[r] = hh, ww, flip
            apply_one(chw, part.data[at], hh, ww, flip, spec)
            if kinds[r] == ENCODED:
                learned.append((r, chw.shape))
        return learned

    def _decode_rows(
        self, plan: BatchPlan, loc: Located, start: int, words: npt.NDArray[np.uint64],
        outs: list[np.ndarray],
    ) -> Decoded | None:  # fmt: skip
        """The rows (of the range from ``start``, into ``outs``) whose JPEG or PNG is
        decoded and transformed in one call where that is exact (``decode_rows``), each
        image of its own size as its header says (``image_sizes``; the decoder checks
        it), with the crop and flip its record alone would get (``geometry_of``, drawn
        for every row at once); of the batch's record shape alone where another size
        would make another row or take another mean (``crops_any_size``). Returns
        which rows were written, the rows' crops and flips and ``(H, W)`` sizes
        (those of the rows written are theirs); or None where none could be (no
        compiled decoder, a record shape that does not make this batch's rows: the
        checked path names why)."""
        shape = plan.record_shape
        expected = plan.data_shape[1:]
        if not rows_decodable(shape, self._flag):
            return None
        if not self._fits(shape, _U1, expected):
            return None
        encoded = loc.kind == ENCODED
        if start == 0 and plan.first_decoded is not None:
            encoded[0] = False  # row 0: next_plan decoded it
        if not encoded.any():
            return None
        # each row's image as its extent of the buffer (-1: none)
        extents = np.empty((len(encoded), 2), np.int64)
        extents[:, 0] = np.where(encoded, loc.offset, -1)
        extents[:, 1] = loc.length
        heads = image_sizes(loc.buffer, extents)
        if heads is None:
            return None
        t = self._transform
        h, w = heads[:, 1], heads[:, 2]
        if t.crops_any_size:  # the batch's pixel limit bounds every image decoded here
            crop = t.crop_size
            ok = (h >= crop) & (w >= crop) & (h * w <= DEFAULT_MAX_PIXELS)
        else:
            ok = (h == shape[1]) & (w == shape[2])
        sizes = heads[:, 1:]
        if not ok.all():  # left to the row-by-row path, which names what is wrong
            if not ok.any():
                return None
            extents[~ok, 0] = -1
            sizes = np.where(ok[:, None], sizes, np.array(shape[1:], np.intp))
        sizes = np.ascontiguousarray(sizes, np.intp)
        # every size fits the crop: a row's own where ok, else the batch's record shape
        # (next_plan checked it)
        geometry = t.geometry_of(sizes[:, 0], sizes[:, 1], self._phase, words, checked=True)
        args = kernel_args(outs, geometry, t.kernel_spec(shape))
        if args is None:
            return None
        done = decode_rows(loc.buffer, shape, self._flag, args, sizes, heads[:, 0], extents)
        return None if done is None else Decoded(done, geometry, sizes)

    def _rows(
        self,
        plan: BatchPlan,
        loc: Located,
        start: int,
        shared: Geometry,
        done: npt.NDArray[np.bool_] | None = None,
    ) -> Iterator[tuple[int, Any]]:
        """Each row's uncropped ``(C, H, W)`` pixels (None where they cannot be had),
        encoded images decoded one at a time, as the caller asks for the next; under
        a crop, an image of the batch's record shape decodes the window of its row
        of ``shared`` (the range's draw for that shape). Rows ``done`` (written
        already) are left out."""
        buffer = loc.buffer
        offsets = loc.offset.tolist()
        lengths = loc.length.tolist()
        kinds = loc.kind.tolist()
        first = plan.first_decoded if start == 0 else None
        t = self._transform
        crop = t.crop_size
        words = plan.words[start:]

        def window(r: int) -> Callable[[int, int], tuple[int, int, int, int] | None]:
            """The crop row ``r`` will take of an image of a given size (what the
            kernel's geometry draws for it), for decoding that window alone."""

            def of(h: int, w: int) -> tuple[int, int, int, int] | None:
                if not t.crop_fits(h, w):
                    return None  # the checked path names the error
                if (h, w) == plan.record_shape[1:]:  # a crop depends on (h, w) alone
                    h_off, w_off, _ = shared.row(r)
                else:
                    h_off, w_off, _ = t.geometry((3, h, w), self._phase, words[r : r + 1]).row(0)
                return h_off, w_off, crop, crop

            return of

        skip = [] if done is None else done.tolist()
        for r, k in enumerate(kinds):
            if skip and skip[r]:
                continue
            if k == RAW:
                c, h, w = loc.shape[r].tolist()
                yield r, buffer[offsets[r] : offsets[r] + c * h * w].reshape(c, h, w)
            elif k == ENCODED:
                if r == 0 and first is not None:
                    yield r, first[0]  # decoded by next_plan
                    continue
                image = buffer[offsets[r] : offsets[r] + lengths[r]].data
                if crop:  # each image decoded while the one before is transformed
                    hwc = decode_window(image, self._flag, window(r))
                else:  # a shape noted in this snapshot: the bytes decoded before
                    hwc = decode_whole(image, self._flag, decoded_before=bool(loc.shape[r, 0]))
                yield r, None if isinstance(hwc, Undecodable) else hwc.transpose(2, 0, 1)
            elif k == PARSED:
                try:
                    chw, _ = view_record(
                        buffer[offsets[r] : offsets[r] + lengths[r]].data, self._flag,
                        DEFAULT_MAX_PIXELS, None, None,
                    )  # fmt: skip
                except BlobpipeError:
                    chw = None
                yield r, chw
            else:
                yield r, None

    def _fits(
        self, shape: tuple[int, ...], dtype: np.dtype[Any], expected: tuple[int, ...]
    ) -> bool:
        """Whether a record's pixels of ``shape`` and ``dtype`` make a row of shape
        ``expected`` (else the checked path names why). Decided once for each (shapes
        of one :meth:`Transform.output_class` alike): the answer depends on them and
        the transform alone, and a batch asks each time (the checks took ~100 µs of a
        W4 batch's GIL time, run with cold caches)."""
        key = (self._transform.output_class(shape), dtype, expected)
        fits = self._fit.get(key)
        if fits is None:
            t = self._transform
            try:
                t.check_record(np.broadcast_to(np.zeros((), dtype), shape))
                fits = t.output_shape(shape) == expected
                if fits:
                    t.kernel_spec(shape)  # a mean file must fit the record
            except BlobpipeError:
                fits = False
            if len(self._fit) < _FITS_KEPT:
                self._fit[key] = fits
        return fits

    def _values(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys`` (None where one cannot be read: the checked path
        reads it again and names the error)."""
        reader = self._reader
        transaction = getattr(reader, "transaction", None)
        if transaction is None:
            return [_try(reader.get, k) for k in keys]
        with transaction() as txn:
            fast_get = getattr(txn, "fast_get", None)
            get = fast_get() if fast_get is not None else txn.get
            return [_bytes(_try(get, k)) for k in keys]

    def _checked_row(self, plan: BatchPlan, row: int, out: np.ndarray) -> tuple[RecordParams, int]:
        """Row ``row`` read, checked and transformed into ``out`` record by record:
        raises the error that names it (the only reason a row comes here); returns
        the crop and flip it used and its label if the record turns out fine after
        all."""
        t = self._transform
        key = plan.keys[row]
        first = plan.first_decoded if row == 0 else None
        if first is not None:
            chw, label = first
        else:
            chw, label = self._read(key, self._reader.get)
        expected = plan.data_shape[1:]
        try:
            out_shape = t.output_shape(chw.shape)
            if out_shape != expected:
                raise DataError(
                    f"record {key!r} has shape {tuple(chw.shape)} (output {out_shape}) but the "
                    f"batch's first record {plan.keys[0]!r} has shape {plan.record_shape} "
                    f"(output {expected}); records in one batch must share a shape: "
                    + shape_fix(plan.record_shape, chw.shape, True),
                    path=self._path,
                    key=key,
                )
            word = int(plan.words[row])
            params = t.record_params(chw.shape, phase=self._phase, word=word)
            t.apply_into(chw, out, params=params)
        except DataError:
            raise
        except BlobpipeError as exc:
            raise DataError(str(exc), path=self._path, key=key) from exc
        return params, label


def _raw_blocks(
    buffer: Any, offsets: npt.NDArray[np.int64], shape: tuple[int, int, int], out: np.ndarray
) -> list[tuple[int, int, Any]]:
    """Raw rows of one shape at ``offsets`` of ``buffer`` as the kernel's sources,
    ``(lo, hi, rows lo..hi)``: one strided view of the buffer per run of rows that
    lie at one stride (all of them, mostly: records in key order sit one after
    another), when the runs are few; else one gather (small rows) or a view per row
    (large rows)."""
    n = len(offsets)
    c, h, w = shape
    size = c * h * w

    def view(lo: int, hi: int, stride: int) -> Any:
        return np.ndarray(
            (hi - lo, c, h, w), _U1, buffer=buffer, offset=int(offsets[lo]),
            strides=(stride, h * w, w, 1),
        )  # fmt: skip

    stride = int(offsets[1] - offsets[0]) if n > 1 else size
    if stride >= 0 and (n < 3 or (np.diff(offsets) == stride).all()):
        return [(0, n, view(0, n, stride))]
    runs = _stride_runs(offsets.tolist(), max(1, n // _ROWS_PER_RUN))
    if runs is not None:
        return [(lo, hi, view(lo, hi, step)) for lo, hi, step in runs]
    if prefers_block(out[0].nbytes):  # one gather: every size-byte window of the buffer
        return [(0, n, byte_windows(buffer, size)[offsets].reshape(n, c, h, w))]
    return [(0, n, [buffer[o : o + size].reshape(c, h, w) for o in offsets.tolist()])]


def _spans(start: int, parts: Sequence[Part]) -> Iterator[tuple[int, Part]]:
    """Each part with the plan row it starts at (parts hold consecutive rows)."""
    for part in parts:
        yield start, part
        start += len(part.label)


def _try(get: Callable[[bytes], Any], key: bytes) -> Any:
    try:
        return get(key)
    except Exception:  # the checked path reads it again and names the error
        return None


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)
