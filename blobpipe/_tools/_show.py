"""``blobpipe show``: the first records of an LMDB (or transformed batch rows) as a
PNG grid, each image over a caption with its key and label.

Invariants: a record's pixels are copied into its cell unchanged (uint8 rows) or
stretched to 0..255 per row (float rows, after a mean and scale), each pixel
repeated ``zoom`` times along both axes; 3-channel rows are BGR, as Caffe stores
them, and so is the PNG writer's input, so colours come out right; a 1-channel
row is shown gray. Captions lie below the image area, never over it, and hold
the whole key: a key wider than its column goes on as many lines as it needs
(every caption of the grid as tall as the tallest). Drawing and encoding are the
image module's (``_io/_image.py``).
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import ArgumentError, ShapeError
from .._io._batches import Batches
from .._io._image import encode_image, put_text, text_width
from .._io._prototxt import read_data_layer
from .._io._transform import Transform

__all__ = ["GridLayout", "show_grid"]

_LINE = 12  # pixels per caption line
_PAD = 2  # pixels between cells
_MIN_CELL = 96  # auto zoom: the smallest side of an image cell at least this
_MIN_COLUMN = 64  # a column is at least this wide, so a caption line holds a few characters


@dataclass(frozen=True)
class GridLayout:
    """Where each record lies in the grid written by :func:`show_grid`."""

    path: Path
    count: int
    columns: int
    zoom: int
    cell: tuple[int, int]  # (height, width) of an image area, zoomed
    keys: tuple[bytes, ...]
    labels: tuple[float, ...] | None
    captions: tuple[tuple[str, ...], ...] = ()  # each record's lines, as drawn
    caption_height: int = 2 * _LINE + 4  # pixels below each image area
    column_width: int = 0  # pixels between two columns' left edges, less the padding

    def origin(self, i: int) -> tuple[int, int]:
        """The (y, x) of record ``i``'s image area in the PNG."""
        h, w = self.cell
        row, col = divmod(i, self.columns)
        width = max(w, self.column_width)
        return _PAD + row * (h + self.caption_height + _PAD), _PAD + col * (width + _PAD)


def _displayable(rows: np.ndarray, layout: str) -> np.ndarray:
    """(N, H, W, 3) uint8 BGR from (N, C, H, W) (or NHWC) rows of 1 or 3 channels."""
    if layout == "NCHW":
        rows = rows.transpose(0, 2, 3, 1)
    if rows.shape[-1] not in (1, 3):
        raise ShapeError(
            f"show draws 1- or 3-channel images; these rows have {rows.shape[-1]} channels"
        )
    if rows.dtype != np.uint8:  # transformed: each row stretched to 0..255
        flat = rows.reshape(len(rows), -1).astype(np.float64)
        low = flat.min(axis=1)[:, None]
        span = np.maximum(flat.max(axis=1)[:, None] - low, 1e-12)
        rows = np.rint((flat - low) / span * 255).astype(np.uint8).reshape(rows.shape)
    if rows.shape[-1] == 1:
        rows = np.repeat(rows, 3, axis=-1)
    return np.ascontiguousarray(rows)


def show_grid(
    db: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    count: int = 16,
    transform: Transform | None = None,
    columns: int | None = None,
    zoom: int | None = None,
) -> GridLayout:
    """Write the first ``count`` records of ``db`` (through ``transform``, TEST
    phase, when given) to the PNG ``out``; returns where each one lies. ``db`` is a
    database (LMDB or LevelDB) or a net ``.prototxt`` whose data layer's source is
    drawn (a Data layer's database, an ImageData layer's images, an HDF5Data
    layer's first top, each row stretched to 0..255).

    Raises:
        ArgumentError: ``count``, ``columns`` or ``zoom`` below 1, or ``out`` not a
            ``.png``.
        DataError, DatabaseNotFoundError: as :class:`~blobpipe.Batches`.
        ShapeError: records that are not images of 1 or 3 channels.
    """
    for name, value in (("count", count), ("columns", columns), ("zoom", zoom)):
        if value is not None and (isinstance(value, bool) or int(value) < 1):
            raise ArgumentError(f"show: {name} must be a positive integer, got {value!r}")
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ArgumentError(f"show writes a PNG: name the output *.png, got {str(out)!r}")
    source: Any = db
    axes = "NCHW" if transform is None else transform.layout
    if transform is None:
        transform = Transform(dtype="uint8")
    if os.fspath(db).endswith(".prototxt"):  # the data layer of a net: its source
        config = read_data_layer(db, "test")
        source = config.batches_kwargs()["source"]
        if config.type == "HDF5Data":
            transform, axes = None, "NCHW"  # no transform in Caffe's HDF5Data
    with Batches(source, count, transform=transform, phase="test", mode="epoch") as batches:
        batch = next(iter(batches))
        rows = _displayable(batch.data, axes)
        keys = tuple(batch.keys)
        labels = None if batch.label is None else tuple(float(v) for v in batch.label)
    n, h, w, _ = rows.shape
    if zoom is None:
        zoom = max(1, math.ceil(_MIN_CELL / max(h, w, 1)))
    if columns is None:
        columns = math.ceil(math.sqrt(n))
    columns = min(columns, n)
    grid_rows = math.ceil(n / columns)
    ch, cw = h * zoom, w * zoom
    width = max(cw, _MIN_COLUMN)
    captions = tuple(
        (
            *_wrapped(_ascii(keys[i].decode("utf-8", "replace")), width),
            *(() if labels is None else (f"label {labels[i]:g}",)),
        )
        for i in range(n)
    )
    caption_height = _LINE * max(len(c) for c in captions) + 4
    image = np.full(
        (_PAD + grid_rows * (ch + caption_height + _PAD), _PAD + columns * (width + _PAD), 3),
        32,
        np.uint8,
    )
    layout = GridLayout(
        out, n, columns, zoom, (ch, cw), keys, labels, captions, caption_height, width
    )
    for i in range(n):
        y, x = layout.origin(i)
        image[y : y + ch, x : x + cw] = rows[i].repeat(zoom, axis=0).repeat(zoom, axis=1)
        for line, text in enumerate(captions[i]):
            put_text(image, text, (x, y + ch + 11 + _LINE * line))
    out.write_bytes(encode_image(image, "png"))
    return layout


def _ascii(text: str) -> str:
    """``text`` in the characters the caption font draws (printable ASCII; others ``?``)."""
    return "".join(c if " " <= c <= "~" else "?" for c in text)


def _wrapped(text: str, width: int) -> list[str]:
    """``text`` cut into lines of at most ``width`` pixels each (at least one character
    a line), in order: joined, they are ``text`` again."""
    lines: list[str] = []
    while text:
        # the longest prefix that fits (a prefix is never wider than a longer one)
        fit = bisect.bisect_right(
            range(1, len(text) + 1), width, key=lambda n: text_width(text[:n])
        )
        lines.append(text[: max(fit, 1)])
        text = text[max(fit, 1) :]
    return lines or [""]
