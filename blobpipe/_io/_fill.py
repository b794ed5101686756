"""Filling batch rows: the one path from stored records to transformed rows.

For rows ``[start:stop]`` of a plan, :meth:`Filler.fill`

1. locates the records in the record index (``_index.py``): the LMDB data file
   mapped read-only when it can be, else the joined values of these rows;
2. takes each row's pixels where they lie: raw uint8 pixels as views of the
   buffer (rows at one stride as one strided view), encoded images decoded one
   after another (``_image.decode_many``), float records through the parser;
3. draws each row's crop offset and flip, and runs the transform kernel
   (``_kernels.apply``) from those pixels into the caller's output.

A row that cannot be had this way (not a valid Datum, an image that does not
decode, a shape that does not fit the batch or the transform) goes through the
checked per-record path, :meth:`Filler._checked_row`, which reads it again and
raises the error that names it (key, database path, reason).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import as_strided

from .._errors import BlobpipeError, DataError
from ._datum import DEFAULT_MAX_PIXELS, parse_datum, view_record
from ._image import Undecodable, decode_many, imread_flag
from ._index import BAD, ENCODED, PARSED, RAW, Located, RecordIndex
from ._kernels import Geometry, apply, prefers_block
from ._lmdb import LmdbReader
from ._lmdbfile import value_extents
from ._plan import BatchPlan
from ._transform import Phase, Transform

__all__ = ["Filler", "RecordSource"]

_U1 = np.dtype(np.uint8)


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


class Filler:
    """Reads, decodes and transforms batch rows; thread-safe (one per Batches)."""

    def __init__(
        self, reader: RecordSource, keys: Sequence[bytes], transform: Transform, phase: Phase,
        path: object,
    ) -> None:  # fmt: skip
        self._reader = reader
        self._keys = keys
        self._transform = transform
        self._phase: Phase = phase
        self._path = path
        self._flag = imread_flag(transform.force_color, transform.force_gray)
        self._index: RecordIndex | None = None
        self._index_tried = False
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:  # the index's map of the file goes with the reader
            self._index, self._index_tried = None, True

    def index(self) -> RecordIndex | None:
        """The database's record index, made on first use; None where its data
        file cannot be read directly (each range then indexes its own values)."""
        if not self._index_tried:
            with self._lock:
                if not self._index_tried:
                    reader = self._reader
                    if isinstance(reader, LmdbReader):
                        file = reader._mapped_file()
                        extents = value_extents(file, self._keys) if file is not None else None
                        if file is not None and extents is not None:
                            self._index = RecordIndex(file, extents.offsets, extents.lengths)
                    self._index_tried = True
        return self._index

    # -- planning -----------------------------------------------------------------------------

    def first(self, index: int) -> tuple[tuple[int, int, int], tuple[np.ndarray, int] | None]:
        """The ``(C, H, W)`` record ``index`` yields (the batch's shape), and its pixels
        and label when they had to be decoded (or read from a source with no file)
        to learn it.

        Raises:
            DataError: the record cannot be read or decoded; names key and path.
        """
        idx = self.index()
        key = self._keys[index]
        if idx is not None:
            shape = idx.shape_of(index)
            if shape is not None:
                return shape, None
            loc = idx.locate(np.array([index], np.intp))
            kind = int(loc.kind[0])
            if kind in (RAW, PARSED):
                c, h, w = loc.shape[0].tolist()
                return (c, h, w), None
            if kind == ENCODED:
                off, length = int(loc.offset[0]), int(loc.length[0])
                hwc = decode_many([idx.buffer[off : off + length].data], self._flag)[0]
                if not isinstance(hwc, Undecodable):
                    h, w, c = hwc.shape
                    idx.note_shapes(np.array([index], np.intp), np.array([(c, h, w)], np.int32))
                    return (c, h, w), (hwc.transpose(2, 0, 1), int(loc.label[0]))
        chw, label = self._read(key, self._reader.get)  # raises the record's error
        c, h, w = chw.shape
        return (c, h, w), (chw, label)

    def _read(self, key: bytes, get: Callable[[bytes], Any]) -> tuple[np.ndarray, int]:
        """Record ``key``'s ``(C, H, W)`` pixels and label, checked (errors name it)."""
        buf = get(key)
        p = parse_datum(buf, key=key, path=self._path)
        chw, label = view_record(p, self._flag, DEFAULT_MAX_PIXELS, key, self._path)
        if not p.encoded:
            chw = chw.copy()  # a view of a transaction's memory: keep a copy
        return chw, label

    # -- filling ------------------------------------------------------------------------------

    def fill(
        self,
        plan: BatchPlan,
        data_out: np.ndarray,
        label_out: npt.NDArray[np.float32],
        start: int,
        stop: int,
        params_out: npt.NDArray[np.int32] | None,
    ) -> None:
        """Rows ``[start:stop]`` of ``plan`` into the outputs (checked by the caller)."""
        n = stop - start
        index = self.index()
        if index is not None:
            rows = np.fromiter(plan.indices[start:stop], np.intp, n)
            loc = index.locate(rows, plan.record_shape)
        else:
            index = RecordIndex.joined(self._values(plan.keys[start:stop]))
            rows = np.arange(n, dtype=np.intp)
            loc = index.locate(rows, plan.record_shape)
            index = None  # nothing to remember
        label_out[start:stop] = loc.label
        pixels, shapes, failed = self._pixels(plan, loc, start, index, rows)
        t = self._transform
        expected = plan.data_shape[1:]
        record_shape = plan.record_shape
        same = bool((shapes == record_shape).all())
        groups: list[tuple[tuple[int, int, int], npt.NDArray[np.intp]]]
        if same:
            groups = [(record_shape, np.arange(n, dtype=np.intp))]
        else:
            # group rows by shape (rows that failed: shape 0)
            uniq, inverse = np.unique(shapes, axis=0, return_inverse=True)
            keyed = inverse.reshape(-1)
            groups = []
            for g, shape_row in enumerate(uniq.tolist()):
                members = np.flatnonzero(keyed == g)
                if not shape_row[0]:
                    continue  # rows whose pixels could not be had: in failed already
                c, h, w = shape_row
                try:
                    fits = t.output_shape((c, h, w)) == expected
                    t.kernel_spec((c, h, w))  # the mean must fit too
                except BlobpipeError:
                    fits = False
                if fits:
                    groups.append(((c, h, w), members))
                else:
                    failed.extend(members.tolist())
        if t.dtype == _U1:  # float records cannot make uint8 rows
            if isinstance(pixels, np.ndarray):
                if pixels.dtype != _U1:
                    failed.extend(range(n))
            else:
                failed.extend(r for r, p in enumerate(pixels) if p is not None and p.dtype != _U1)
        if failed:
            bad = sorted(set(failed))
            for r in bad:
                self._checked_row(plan, data_out, label_out, start + r, params_out)
            keep = np.setdiff1d(np.arange(n), np.asarray(bad, np.intp))
            groups = [(s, np.intersect1d(m, keep)) for s, m in groups]
            groups = [(s, m) for s, m in groups if len(m)]
            if not groups:
                return
        words = np.fromiter(plan.words[start:stop], np.uint64, n)
        h_off = np.zeros(n, np.intp)
        w_off = np.zeros(n, np.intp)
        mirror = np.zeros(n, np.bool_)
        for shape, members in groups:
            part = t.geometry(shape, self._phase, words[members])
            h_off[members], w_off[members], mirror[members] = part
        geometry = Geometry(h_off, w_off, mirror)
        out = data_out[start:stop]
        spec = t.kernel_spec(record_shape)  # validated by next_plan; other shapes share it
        if failed:  # the remaining rows, one by one
            assert pixels is not None
            for _, members in groups:
                for r in members.tolist():
                    src = pixels[r]
                    apply(np, [src], out[r : r + 1], geometry.take([r]), spec)
        else:
            assert pixels is not None
            apply(np, pixels, out, geometry, spec)
        if params_out is not None:
            params_out[start:stop, 0] = h_off
            params_out[start:stop, 1] = w_off
            params_out[start:stop, 2] = mirror

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

    def _pixels(
        self,
        plan: BatchPlan,
        loc: Located,
        start: int,
        index: RecordIndex | None,
        rows: npt.NDArray[np.intp],
    ) -> tuple[Any, npt.NDArray[np.int32], list[int]]:
        """Each row's uncropped ``(C, H, W)`` pixels: one ``(N, C, H, W)`` array when
        every row is a raw record of the plan's shape, else a list (None where the
        row failed); each row's shape (zeros where it failed); the failed rows."""
        kind = loc.kind
        n = len(kind)
        buffer = loc.buffer
        shapes = loc.shape.copy()
        record_shape = plan.record_shape
        c, h, w = record_shape
        size = c * h * w
        block = prefers_block(int(np.prod(plan.data_shape[1:])) * self._transform.dtype.itemsize)
        if (kind == RAW).all() and (shapes == record_shape).all():
            offsets = loc.offset
            stride = int(offsets[1] - offsets[0]) if n > 1 else size
            if stride >= 0 and (n < 3 or (np.diff(offsets) == stride).all()):
                view = np.ndarray(
                    (n, c, h, w), _U1, buffer=buffer, offset=int(offsets[0]),
                    strides=(stride, h * w, w, 1),
                )  # fmt: skip
                return view, shapes, []
            if block:
                windows = as_strided(buffer, (len(buffer) - size + 1, size), (1, 1))
                return windows[offsets].reshape(n, c, h, w), shapes, []
            views = [buffer[o : o + size].reshape(c, h, w) for o in offsets.tolist()]
            return views, shapes, []
        pixels: list[np.ndarray | None] = [None] * n
        failed: list[int] = []
        offsets_l = loc.offset.tolist()
        lengths_l = loc.length.tolist()
        kinds = kind.tolist()
        encoded: list[int] = []
        for r, k in enumerate(kinds):
            if k == RAW:
                cc, hh, ww = shapes[r].tolist()
                o = offsets_l[r]
                pixels[r] = buffer[o : o + cc * hh * ww].reshape(cc, hh, ww)
            elif k == ENCODED:
                if start + r == 0 and plan._first is not None:
                    pixels[r] = plan._first[0]
                    shapes[r] = plan._first[0].shape
                else:
                    encoded.append(r)
            elif k == PARSED:
                o = offsets_l[r]
                try:
                    chw, _ = view_record(
                        buffer[o : o + lengths_l[r]].data, self._flag,
                        DEFAULT_MAX_PIXELS, None, None,
                    )  # fmt: skip
                except BlobpipeError:
                    failed.append(r)
                    shapes[r] = 0
                    continue
                pixels[r] = chw
            else:
                assert k == BAD
                failed.append(r)
                shapes[r] = 0
        if encoded:
            images = [
                buffer[offsets_l[r] : offsets_l[r] + lengths_l[r]].data for r in encoded
            ]
            learned: list[int] = []
            for r, hwc in zip(encoded, decode_many(images, self._flag), strict=True):
                if isinstance(hwc, Undecodable):
                    failed.append(r)
                    shapes[r] = 0
                    continue
                chw = hwc.transpose(2, 0, 1)
                pixels[r] = chw
                shapes[r] = chw.shape
                learned.append(r)
            if index is not None and learned:
                at = np.asarray(learned, np.intp)
                index.note_shapes(rows[at], shapes[at])
        if not failed and block:
            first = pixels[0]
            assert first is not None
            if all(p is not None and p.shape == first.shape and p.dtype == first.dtype
                   for p in pixels):  # fmt: skip
                return np.stack(pixels), shapes, failed  # type: ignore[arg-type]
        return pixels, shapes, failed

    def _checked_row(
        self,
        plan: BatchPlan,
        data_out: np.ndarray,
        label_out: npt.NDArray[np.float32],
        row: int,
        params_out: npt.NDArray[np.int32] | None,
    ) -> None:
        """Row ``row`` read, checked and transformed record by record: raises the
        error that names it (the only reason a row comes here)."""
        t = self._transform
        key = plan.keys[row]
        if row == 0 and plan._first is not None:
            chw, label = plan._first
        else:
            chw, label = self._read(key, self._reader.get)
        expected = plan.data_shape[1:]
        try:
            out_shape = t.output_shape(chw.shape)
            if out_shape != expected:
                raise DataError(
                    f"record {key!r} has shape {tuple(chw.shape)} (output {out_shape}) but the "
                    f"batch's first record {plan.keys[0]!r} has shape {plan.record_shape} "
                    f"(output {expected}); records in one batch must share a shape: use "
                    "batch_size=1 or a crop_size",
                    path=self._path,
                    key=key,
                )
            word = plan.words[row]
            params = t.record_params(chw.shape, phase=self._phase, word=word)
            t.apply_into(chw, data_out[row], params=params)
        except DataError:
            raise
        except BlobpipeError as exc:
            raise DataError(str(exc), path=self._path, key=key) from exc
        label_out[row] = label
        if params_out is not None:
            params_out[row] = (params.h_off, params.w_off, params.mirror)


def _try(get: Callable[[bytes], Any], key: bytes) -> Any:
    try:
        return get(key)
    except Exception:  # the checked path reads it again and names the error
        return None


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)
