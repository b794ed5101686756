"""What each record holds and where its pixels sit in the database file.

:class:`~blobpipe.Batches` reading an LMDB maps its data file read-only with
numpy and learns every value's offset and length from the B-tree pages
(``_lmdbfile.value_extents``, checked key by key against LMDB's own listing).
A :class:`RecordIndex` adds, per record, what it holds, established the first
time a batch reads it:

* raw records in ``convert_imageset``'s layout are recognised for a whole batch
  at once, by comparing the header and tail bytes of every row with a few numpy
  calls (the layout check of :func:`~blobpipe._io._datum.gather_raw`), which
  also yields the labels;
* encoded records are noted after the checked path decoded them (payload
  offset, label, decoded shape); on its first indexed read, whether simplejpeg
  may decode the bytes (:func:`~blobpipe._io._image.fast_channels`).

From then on a batch of known records costs no LMDB lookup and no parse: raw
records lying one after another at a constant stride (``convert_imageset``'s
order, read in key order) are transformed straight from one strided view of the
mapping, in one numpy call that releases the GIL; encoded images go straight
from the mapping to the decoder (simplejpeg or OpenCV). Rows not known (another
layout, float data, a record that failed) take the checked path, which raises
the usual errors. The arrays hold 31 bytes per record (40 MB for ImageNet's
1.28M records). The
database must not change while it is open (the same condition as for LMDB's
own map opened with ``lock=False``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ._datum import _match_layout, _raw_header
from ._image import check_sample, fast_channels
from ._lmdbfile import Extents

__all__ = ["IndexedRows", "RecordIndex"]

_OTHER = -32768  # below every -shape_id (at most 32767 shapes)
_FAST_UNKNOWN = 255


class IndexedRows:
    """What the index knows about a range of rows that are all of one kind and shape."""

    __slots__ = ("encoded", "fast", "indices", "labels", "lengths", "offsets")

    def __init__(
        self,
        encoded: bool,
        offsets: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.uint32],
        labels: npt.NDArray[np.float32],
        fast: npt.NDArray[np.uint8],
        indices: npt.NDArray[np.intp],
    ) -> None:
        self.encoded = encoded
        self.indices = indices  # the rows' records
        self.offsets = offsets  # file offset of each row's payload (raw pixels / image bytes)
        self.lengths = lengths  # payload bytes (encoded rows)
        self.labels = labels
        # encoded rows: channels simplejpeg decodes them to, 0: OpenCV, 255: not known yet
        self.fast = fast

    def runs(self) -> list[tuple[int, int, int]]:
        """Maximal ``(first, stop, stride)`` row runs whose offsets step by one stride."""
        offs = self.offsets
        n = len(offs)
        if n > 1:
            d = np.diff(offs)
            if (d == d[0]).all():  # the usual case: one run
                return [(0, n, int(d[0]))]
        values = offs.tolist()
        runs: list[tuple[int, int, int]] = []
        a = 0
        while a < n:
            if a + 1 == n:
                runs.append((a, n, 0))
                break
            stride = values[a + 1] - values[a]
            b = a + 2
            while b < n and values[b] - values[b - 1] == stride:
                b += 1
            runs.append((a, b, stride))
            a = b
        return runs


class RecordIndex:
    """Per record of a database (by its index in key order): kind, label, payload extent.

    ``kind`` is 0 for a record not known yet, ``k > 0`` for a raw record of shape
    ``shapes[k - 1]``, ``-k < 0`` for an encoded record that decodes to shape
    ``shapes[k - 1]``, and ``_OTHER`` for one that is not a raw record of the
    shape it was checked for (encoded, float data, another layout or shape:
    not checked again; an encoded one is still noted when decoded). A record's
    fields are written before its kind, so a reader that sees a kind sees its
    fields (threads that learn the same row write the same values).
    """

    def __init__(self, file: npt.NDArray[np.uint8], extents: Extents) -> None:
        self.file = file
        n = len(extents.offsets)
        self._value_offset = extents.offsets
        self._value_length = extents.lengths
        self._kind = np.zeros(n, np.int16)
        self._offset = np.zeros(n, np.int64)
        self._length = np.zeros(n, np.uint32)
        self._label = np.zeros(n, np.float32)
        self._fast = np.full(n, _FAST_UNKNOWN, np.uint8)
        self._shapes: list[tuple[int, int, int]] = []
        self._shape_ids: dict[tuple[int, int, int], int] = {}
        self._lock = threading.Lock()

    def _shape_id(self, shape: tuple[int, int, int]) -> int:
        sid = self._shape_ids.get(shape)
        if sid is None:
            with self._lock:
                sid = self._shape_ids.get(shape)
                if sid is None:
                    if len(self._shapes) >= 32767:
                        return 0  # int16 kinds: stop learning new shapes
                    self._shapes.append(shape)
                    sid = self._shape_ids[shape] = len(self._shapes)
        return sid

    def shape_of(self, index: int) -> tuple[int, int, int] | None:
        """The (C, H, W) the record at ``index`` yields, if known."""
        kind = int(self._kind[index])
        return self._shapes[abs(kind) - 1] if kind and kind != _OTHER else None

    def lookup(self, indices: Sequence[int], shape: tuple[int, int, int]) -> IndexedRows | None:
        """The rows ``indices`` if all are (or can now be) known, of one kind and of
        ``shape``; else None."""
        idx = np.fromiter(indices, np.intp, len(indices))
        sid = self._shape_id(shape)
        if not sid:
            return None
        kinds = self._kind[idx]
        unknown = kinds == 0
        if unknown.any():
            self._classify_raw(idx[unknown], shape, sid)
            kinds = self._kind[idx]
        if (kinds == sid).all():
            encoded = False
        elif (kinds == -sid).all():
            encoded = True
        else:
            return None
        return IndexedRows(
            encoded, self._offset[idx], self._length[idx], self._label[idx], self._fast[idx], idx
        )

    def lookup_shapes(
        self, indices: Sequence[int]
    ) -> list[tuple[tuple[int, int, int], npt.NDArray[np.intp], IndexedRows]] | None:
        """The rows ``indices`` grouped by shape: ``(shape, positions in indices,
        rows)`` per shape, if every row is known and all are encoded or all raw;
        else None. (Images of several sizes cropped to one size: TRAIN crops.)"""
        idx = np.fromiter(indices, np.intp, len(indices))
        kinds = self._kind[idx]
        if ((kinds == 0) | (kinds == _OTHER)).any():
            return None
        encoded = kinds < 0
        if encoded.any() and not encoded.all():
            return None
        groups = []
        for kind in np.unique(kinds).tolist():
            positions = np.flatnonzero(kinds == kind)
            sub = idx[positions]
            rows = IndexedRows(
                kind < 0,
                self._offset[sub],
                self._length[sub],
                self._label[sub],
                self._fast[sub],
                sub,
            )
            groups.append((self._shapes[abs(kind) - 1], positions, rows))
        return groups

    def fast_channels(self, rows: IndexedRows, flag: int) -> list[int]:
        """Per encoded row, the channels simplejpeg decodes it to with imdecode
        ``flag`` (the same for every record of this index), 0 where OpenCV does
        (:func:`~._image.fast_channels`); worked out once per record, on its first
        indexed read rather than on the checked path's, where Python time per
        image is what two workers wait on each other for."""
        fast = rows.fast
        unknown = np.flatnonzero(fast == _FAST_UNKNOWN)
        if len(unknown):
            fast = fast.copy()
            file = self.file
            for r in unknown.tolist():
                off = int(rows.offsets[r])
                data = file[off : off + int(rows.lengths[r])].tobytes()
                fast[r] = verdict = fast_channels(data, flag)
                check_sample(data, flag, verdict)  # the process's first images
            self._fast[rows.indices[unknown]] = fast[unknown]
        channels: list[int] = fast.tolist()
        return channels

    def _classify_raw(
        self, idx: npt.NDArray[np.intp], shape: tuple[int, int, int], sid: int
    ) -> None:
        """Recognise the rows ``idx`` that are raw records of ``shape`` in
        ``convert_imageset``'s layout, from their header and tail bytes."""
        c, h, w = shape
        size = c * h * w
        header = _raw_header(shape)
        hl = len(header)
        offs = self._value_offset[idx]
        lens = self._value_length[idx].astype(np.int64)
        file = self.file
        for length in np.unique(lens).tolist():
            sel = lens == length
            rows = idx[sel]
            if length < hl + size + 2 or length > hl + size + 14:
                self._kind[rows] = _OTHER
                continue
            cols = np.concatenate([np.arange(hl), np.arange(hl + size, length)])
            block = file[offs[sel][:, np.newaxis] + cols]
            good, labels = _match_layout(block, header, 0)
            self._kind[rows[~good]] = _OTHER
            rows = rows[good]
            self._offset[rows] = offs[sel][good] + hl
            self._label[rows] = labels[good]
            self._kind[rows] = sid

    def learn_encoded(
        self,
        index: int,
        value: memoryview,
        payload: memoryview,
        label: int,
        shape: tuple[int, int, int],
    ) -> None:
        """Note an encoded record: ``value`` is its LMDB view, ``payload`` (a slice of
        it) the image bytes, which decoded to ``shape``.

        The payload's place in the file is the value's (from the B-tree) plus its
        place in the value; the file's bytes there are compared with the payload,
        so nothing wrong is ever recorded.
        """
        sid = self._shape_id(shape)
        n = len(payload)
        if not sid or not n or len(value) != self._value_length[index]:
            return
        image = payload.tobytes()
        # The payload's place in the value: found among the value's first bytes
        # (a Datum's data field comes first or after a few small fields), else
        # from the two views' addresses; either way checked in full below.
        rel = bytes(value[:64]).find(image[:16])
        if rel < 0:
            rel = int(np.frombuffer(payload, np.uint8).ctypes.data) - int(
                np.frombuffer(value, np.uint8).ctypes.data
            )
        if rel < 0 or rel + n > len(value):
            return
        off = int(self._value_offset[index]) + rel
        if self.file[off : off + n].tobytes() != image:
            return
        self._offset[index] = off
        self._length[index] = n
        self._label[index] = label
        self._kind[index] = -sid
