"""Caffe's ImageData layer as a source: a list file and a folder of images, no database.

``ImageDataLayer`` (``layers/image_data_layer.cpp``, ``util/io.cpp``), kept exactly:

* the list is read line by line (``std::getline``); each line splits at its LAST
  space into a path and a label read as C's ``atoi`` reads it; a line without a
  space is both path and label (as ``find_last_of`` gives ``npos``);
* an image is ``cv::imread(root_folder + path, is_color ? IMREAD_COLOR :
  IMREAD_GRAYSCALE)``: ``root_folder`` joined as a string, no separator added; gray
  happens at decode time (a colour PNG through libpng's own weights, a JPEG as
  libjpeg's luminance), not by ``cvtColor``; then ``cv::resize`` (bilinear) only when
  both ``new_height`` and ``new_width`` are > 0;
* a batch takes its shape from its first image; the cursor wraps to line 0 in the
  middle of a batch (blobpipe's ``mode="wrap"``).

Each record is made when a batch asks for it: without a resize, an encoded Datum
holding the file's bytes, which the batch path decodes with the ``is_color`` flag
(the source's filler decodes as ``force_color``/``force_gray`` say, so a batch's
JPEGs and PNGs of one size decode straight into it in one call); with a resize,
the image decoded and resized here, as a raw Datum. A Loader's workers read and
decode their batches' images in parallel (the decoders release the GIL). Keys are
Caffe's ``%08d_<path>`` (the line index), so every error names the line and the
path. Where Caffe aborts (an image that is missing or does not decode), blobpipe
raises a DataError naming the list line or key, the file and the fix.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .._errors import ArgumentError, DataError, FileMissingError
from ._encode import encode_encoded_datum, encode_raw_datum
from ._fill import Filler
from ._image import DEFAULT_MAX_PIXELS, Undecodable, decode_image, imread_flag, resize_image
from ._imagehead import image_size
from ._records import DATUM, RecordKind
from ._transform import Phase, Transform

__all__ = ["ImageList"]

# C's atoi: leading white space, a sign, decimal digits; the rest is ignored (no
# digits: 0)
_ATOI: Final = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")
_INT32: Final = (-(2**31), 2**31 - 1)


class ImageList:
    """The images a Caffe list file names, as a source of :class:`~blobpipe.Batches`
    and :class:`~blobpipe.Loader` (Caffe's ImageData layer; see the module docstring)::

        src = blobpipe.ImageList("train.txt", "images/", new_height=256, new_width=256)
        with blobpipe.Loader(src, 64, transform=blobpipe.Transform(crop_size=227)) as loader:
            ...

    Args:
        source: the list file (``path label`` per line).
        root_folder: prefixed to each path as a string, as Caffe does (end it with
            ``/``).
        new_height, new_width: resize every image to this size (both, or neither).
        is_color: decode as 3-channel BGR (True, Caffe's default) or 1-channel gray.

    Raises:
        FileMissingError: the list file does not exist.
        ArgumentError: only one of ``new_height`` and ``new_width``, or a negative one.
        DataError: an empty list, or a label that does not fit Caffe's int32.
    """

    record_kind: RecordKind = DATUM

    def __init__(
        self,
        source: str | os.PathLike[str],
        root_folder: str | os.PathLike[str] = "",
        *,
        new_height: int = 0,
        new_width: int = 0,
        is_color: bool = True,
    ) -> None:
        if new_height < 0 or new_width < 0 or (new_height == 0) != (new_width == 0):
            raise ArgumentError(
                f"new_height and new_width are both > 0 (resize) or both 0, got "
                f"new_height={new_height} new_width={new_width} (as Caffe's ImageData requires)"
            )
        self._path = os.fsdecode(os.fspath(source))
        self._root = os.fsencode(root_folder)
        self._size = (int(new_height), int(new_width))
        self._flag = imread_flag(bool(is_color), not is_color)
        self.is_color = bool(is_color)
        try:
            with open(self._path, "rb") as f:
                raw = f.read()
        except FileNotFoundError as exc:
            raise FileMissingError("the image list file does not exist", path=self._path) from exc
        lines = raw.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()  # getline gives no line after the final newline
        if not lines:
            raise DataError(f"the image list {self._path!r} is empty (Caffe: 'File is empty')")
        self._lines: list[tuple[bytes, int]] = []
        for number, line in enumerate(lines, start=1):
            pos = line.rfind(b" ")
            path = line[:pos] if pos >= 0 else line
            digits = _ATOI.match(line, pos + 1)
            label = int(digits.group(1)) if digits is not None else 0
            if not _INT32[0] <= label <= _INT32[1]:
                raise DataError(
                    f"{self._path!r} line {number}: label {label} does not fit Caffe's int32"
                )
            self._lines.append((path, label))
        self._keys = tuple(b"%08d_" % i + p for i, (p, _) in enumerate(self._lines))

    @property
    def path(self) -> str:
        """The list file."""
        return self._path

    def __len__(self) -> int:
        return len(self._lines)

    def __repr__(self) -> str:
        return f"<ImageList {self._path!r}: {len(self)} images>"

    def keys(self) -> Sequence[bytes]:
        """One key per list line, ``%08d_<path>`` (the line index), in list order."""
        return self._keys

    @property
    def lines(self) -> list[tuple[bytes, int]]:
        """Each list line's ``(path, label)``, in list order."""
        return list(self._lines)

    def file(self, index: int) -> str:
        """The file list line ``index`` (0-based) names: the root and the path joined."""
        return os.fsdecode(self._root + self._lines[index][0])

    def get(self, key: bytes) -> bytes:
        """The image of the line ``key`` names, read, decoded (and resized) as Caffe's
        ImageData layer does, as a raw Datum with the line's label.

        Raises:
            KeyError: ``key`` is not one of :meth:`keys`.
            DataError: the image is missing, cannot be read or does not decode (names
                the list line, the file and the fix).
        """
        index = self._index(key)
        path, label = self._lines[index]
        name = os.fsdecode(self._root + path)
        where = f"line {index + 1} of the image list {self._path!r} names {os.fsdecode(path)!r}"
        try:
            with open(self._root + path, "rb") as f:
                data = f.read()
        except OSError as exc:
            why = "no such file" if isinstance(exc, FileNotFoundError) else exc.strerror
            raise DataError(
                f"{where}, but {name!r} cannot be read ({why}); Caffe's ImageData layer "
                f"aborts here: fix the line, or root_folder ({os.fsdecode(self._root)!r}, "
                "joined to each path as written, no separator added)"
            ) from None
        height, width = self._size
        if not height:
            size = image_size(data)
            if not isinstance(size, str):
                return encode_encoded_datum(data, label)  # decoded by the batch path
            hwc: npt.NDArray[np.uint8] | Undecodable = Undecodable(
                f"OpenCV cannot decode it: {size}", True
            )
        else:
            hwc = decode_image(data, self._flag, DEFAULT_MAX_PIXELS)
        if isinstance(hwc, Undecodable):
            raise DataError(
                f"{where}, but {name!r} cannot be decoded: {hwc.reason}; Caffe's ImageData "
                "layer aborts here: replace the file or remove the line"
            )
        return encode_raw_datum(resize_image(hwc, height, width).transpose(2, 0, 1), label)

    def row_filler(
        self, transform: Transform, phase: Phase, path: object, blob_dtype: np.dtype[Any]
    ) -> Filler:
        """The batch path's filler of these records: ``transform`` decoding as
        ``is_color`` says (``cv::imread``'s flag), whatever its own force flags."""
        t = transform
        decoding = Transform(
            float(t.scale), t.mirror, t.crop_size, t.mean_file, t.mean_value,
            force_color=self.is_color, force_gray=not self.is_color, layout=t.layout,
            dtype="uint8" if t.dtype == np.uint8 else "float32",
        )  # fmt: skip
        return Filler(self, self._keys, decoding, phase, path, DATUM, blob_dtype)

    def _index(self, key: bytes) -> int:
        head, _, _ = key.partition(b"_")
        if head.isdigit():
            index = int(head)
            if index < len(self._keys) and self._keys[index] == key:
                return index
        raise KeyError(f"{key!r} is not a line of the image list {self._path!r}")

    def close(self) -> None:
        """Nothing to release (the images are read as they are needed)."""
