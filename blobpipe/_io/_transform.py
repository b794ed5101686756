"""Caffe's DataTransformer: mean subtraction, scaling, cropping and mirroring.

The arithmetic is Caffe's, bit for bit: every element is computed in float32 as
``(x - mean) * scale`` (``x * scale`` without a mean), where ``x`` is the uint8
pixel or the float_data value, ``mean`` is the mean-file value at the pixel's
*uncropped* position or the channel's ``mean_value``, and ``scale`` is a float32.

Randomness (the TRAIN-phase crop offset and the mirror flip) is not drawn from a
shared generator as in Caffe, but derived from ``(seed, epoch, index)`` by a
counter-based hash (SplitMix64), so any thread can compute any record's choice
on its own and the output never depends on scheduling:

* ``word = Transform.draw(seed, epoch, index)`` is a 64-bit integer;
* ``mirror = mirror_enabled and bool(word & 1)``;
* ``h_off = ((word >> 1) & 0x7FFFFFFF) % (H - crop + 1)`` and
  ``w_off = (word >> 32) % (W - crop + 1)`` in the TRAIN phase, and the centre
  ``((H - crop) // 2, (W - crop) // 2)`` in the TEST phase.

The pixel work is the kernel's (``_kernels.py``): one block operation over an
array namespace, which a device runs with CuPy from the same pure parameters:
:meth:`Transform.kernel_spec` (crop, the float32 *uncropped* ``(C, H, W)`` mean
or a ``(C, 1, 1)`` mean_value column, scale, layout) and
:meth:`Transform.geometry` (per record ``h_off``, ``w_off``, ``mirror``). For an
output pixel ``(c, h, w)`` of a crop of width ``cw``, the source column is
``sw = cw - 1 - w`` when mirrored else ``w``, and::

    out[c, h, w] = (float32(x[c, h_off + h, w_off + sw])
                    - mean[c, h_off + h, w_off + sw]) * scale
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

from .._codec import TransformationParameter, load_mean_file, transform_fields
from .._errors import ArgumentError, ShapeError
from ._kernels import Geometry, KernelSpec, apply, draw_geometry, draw_word

__all__ = ["Phase", "RecordParams", "Transform", "check_phase", "load_mean_file"]

Phase = Literal["train", "test"]
Layout = Literal["NCHW", "NHWC"]
OutDtype = Literal["float32", "uint8"]

_SPEC_CACHE_SIZE = 16
# kernel_spec's default mean: the transform's own (mean_array)
_OWN_MEAN: Any = object()


@dataclass(frozen=True, slots=True)
class RecordParams:
    """The random choices for one record: crop offset and horizontal flip.

    ``h_off``/``w_off`` index the top-left corner of the crop in the uncropped
    record (both 0 without a crop); ``mirror`` flips the output horizontally.
    """

    h_off: int
    w_off: int
    mirror: bool


def check_phase(phase: str) -> Phase:
    """``phase`` as "train"/"test"; Caffe's spellings "TRAIN"/"TEST" are taken too."""
    if phase in ("TRAIN", "TEST"):
        phase = phase.lower()
    if phase not in ("train", "test"):
        raise ArgumentError(
            f"phase must be 'train' or 'test', got {phase!r} (Caffe's 'TRAIN'/'TEST' work too)"
        )
    return cast(Phase, phase)


class Transform:
    """Caffe's ``DataTransformer``: ``(x - mean) * scale``, crop and mirror.

    Args:
        scale: multiplies every element (after the mean is subtracted); a float32.
        mirror: flip each record horizontally at random (both phases, as Caffe).
        crop_size: crop a ``crop_size`` square (random offset in TRAIN, centred in
            TEST); 0 keeps the whole record.
        mean_file: path of a Caffe mean ``BlobProto``; its shape must equal the
            records' ``(C, H, W)``.
        mean_value: one value for every channel, or one per channel.
        force_color: decode encoded records as 3-channel BGR.
        force_gray: decode encoded records as 1-channel gray.
        layout: ``"NCHW"`` (Caffe) or ``"NHWC"`` for the output.
        dtype: ``"float32"`` (Caffe) or ``"uint8"``: raw cropped/mirrored pixels,
            without mean or scale, for a transform finished later on a device.

    Raises:
        ArgumentError: a bad layout, dtype, negative crop, both force flags, or
            both ``mean_file`` and ``mean_value``; also a ValueError.
        ProtoError: the mean file cannot be read as a BlobProto.
        FileNotFoundError: the mean file does not exist.

    Instances are immutable after construction except for an internal cache of
    mean arrays per record shape, which is thread-safe; one instance may serve
    many worker threads.
    """

    def __init__(
        self,
        scale: float = 1.0,
        mirror: bool = False,
        crop_size: int = 0,
        mean_file: str | os.PathLike[str] | None = None,
        mean_value: Sequence[float] = (),
        force_color: bool = False,
        force_gray: bool = False,
        *,
        layout: Layout = "NCHW",
        dtype: OutDtype = "float32",
    ) -> None:
        if layout not in ("NCHW", "NHWC"):
            raise ArgumentError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
        if dtype not in ("float32", "uint8"):
            raise ArgumentError(f"dtype must be 'float32' or 'uint8', got {dtype!r}")
        if int(crop_size) != crop_size or crop_size < 0:
            raise ArgumentError(f"crop_size must be a non-negative integer, got {crop_size!r}")
        if force_color and force_gray:
            raise ArgumentError("force_color and force_gray cannot both be set")
        values = tuple(float(v) for v in mean_value)
        if mean_file is not None and values:
            raise ArgumentError(
                "give mean_file or mean_value, not both (as Caffe's DataTransformer "
                f"requires): got mean_file={str(mean_file)!r} and mean_value={values}"
            )
        self._scale: np.float32 = np.float32(scale)
        self._mirror = bool(mirror)
        self._crop = int(crop_size)
        self._mean_file = None if mean_file is None else os.fspath(mean_file)
        self._mean_value = values
        self._force_color = bool(force_color)
        self._force_gray = bool(force_gray)
        self._layout: Layout = layout
        self._dtype: OutDtype = dtype
        self._mean_blob = None if mean_file is None else load_mean_file(mean_file)
        if self._mean_blob is not None:
            self._mean_blob.setflags(write=False)
        self._mean_cache: dict[tuple[int, int, int], npt.NDArray[np.float32]] = {}
        self._spec_cache: dict[tuple[int, int, int], KernelSpec] = {}
        self._fixed: dict[tuple[int, int, int], Geometry] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with its mean (the values read at construction, not the file
        again) and without its caches or lock (remade in the new process)."""
        state = self.__dict__.copy()
        for name in ("_lock", "_mean_cache", "_spec_cache", "_fixed"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._mean_cache = {}
        self._spec_cache = {}
        self._fixed = {}
        self._lock = threading.Lock()

    # -- construction from Caffe's parameters -------------------------------------------

    @classmethod
    def from_proto(
        cls,
        param: TransformationParameter,
        base_dir: str | os.PathLike[str] = ".",
        *,
        layout: Layout = "NCHW",
        dtype: OutDtype = "float32",
    ) -> Transform:
        """Build a Transform from a ``caffe.TransformationParameter``.

        A relative ``mean_file`` is resolved against ``base_dir`` (Caffe resolves
        it against the current directory, the default).

        Raises:
            ProtoError: ``param`` sets both ``mean_file`` and ``mean_value``, or the
                mean file cannot be read as a BlobProto.
            FileNotFoundError, ArgumentError: as :class:`Transform`.
        """
        return cls(**transform_fields(param, base_dir), layout=layout, dtype=dtype)

    # -- pure parameters ------------------------------------------------------------------

    @property
    def scale(self) -> np.float32:
        """The float32 scale factor."""
        return self._scale

    @property
    def mirror(self) -> bool:
        """Whether records are flipped horizontally at random."""
        return self._mirror

    @property
    def crop_size(self) -> int:
        """The square crop's side; 0 means no crop."""
        return self._crop

    @property
    def mean_file(self) -> str | None:
        """The mean file's path, as given."""
        return self._mean_file

    @property
    def mean_value(self) -> tuple[float, ...]:
        """The per-channel mean values (empty without)."""
        return self._mean_value

    @property
    def force_color(self) -> bool:
        """Decode encoded records as 3-channel BGR."""
        return self._force_color

    @property
    def force_gray(self) -> bool:
        """Decode encoded records as 1-channel gray."""
        return self._force_gray

    @property
    def layout(self) -> Layout:
        """The output layout, ``"NCHW"`` or ``"NHWC"``."""
        return self._layout

    @property
    def dtype(self) -> np.dtype[np.float32] | np.dtype[np.uint8]:
        """The output dtype (float32, or uint8 for raw pixels)."""
        return np.dtype(np.uint8) if self._dtype == "uint8" else np.dtype(np.float32)

    @property
    def needs_random(self) -> bool:
        """Whether some record choice may be random (mirror, or a TRAIN crop)."""
        return self._mirror or self._crop > 0

    @property
    def is_identity(self) -> bool:
        """Whether records come out as they are (no crop, mirror, mean or scale; NCHW)."""
        return (
            not self._crop
            and not self._mirror
            and self._mean_blob is None
            and not self._mean_value
            and self._scale == 1
            and self._layout == "NCHW"
        )

    def host_half(self) -> Transform:
        """The part of this transform done on the host when a device finishes it: crop
        and mirror only (the same crops and flips), into uint8 NCHW, so the pixels
        cross to the device at a quarter of float32's bytes; the device then applies
        the mean at each row's crop offset, the scale and the layout (``_kernels.apply``
        with ``cropped=True``)."""
        return Transform(
            mirror=self._mirror, crop_size=self._crop, force_color=self._force_color,
            force_gray=self._force_gray, layout="NCHW", dtype="uint8",
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"Transform(scale={float(self._scale)!r}, mirror={self._mirror}, "
            f"crop_size={self._crop}, mean_file={self._mean_file!r}, "
            f"mean_value={self._mean_value!r}, force_color={self._force_color}, "
            f"force_gray={self._force_gray}, layout={self._layout!r}, dtype={self._dtype!r})"
        )

    def mean_array(self, record_shape: Sequence[int]) -> npt.NDArray[np.float32] | None:
        """The float32 mean for records of shape ``(C, H, W)``, read-only and cached.

        Returns the mean file as ``(C, H, W)`` (uncropped), the mean values as a
        ``(C, 1, 1)`` column, or ``None`` when there is no mean.

        Raises:
            ShapeError: the mean file's shape differs from ``record_shape``, or the
                number of mean values is neither 1 nor C.
        """
        c, h, w = _chw(record_shape)
        if self._mean_blob is None and not self._mean_value:
            return None
        # mean values make the same column for records of any size: one per channel
        # count (a cache per size would grow with the sizes a database holds)
        key = (c, h, w) if self._mean_blob is not None else (c, 0, 0)
        cached = self._mean_cache.get(key)
        if cached is not None:
            return cached
        if self._mean_blob is not None:
            if self._mean_blob.shape != key:
                raise ShapeError(
                    f"mean file {self._mean_file!r} has shape {self._mean_blob.shape} but the "
                    f"record has shape {key}; the mean file must match the records' (C, H, W)"
                )
            mean = self._mean_blob
        else:
            n = len(self._mean_value)
            if n not in (1, c):
                raise ShapeError(
                    f"mean_value has {n} values but the record has {c} channels; "
                    "specify either 1 mean_value or one per channel"
                )
            vals = self._mean_value * c if n == 1 else self._mean_value
            mean = np.asarray(vals, dtype=np.float32).reshape(c, 1, 1)
            mean.setflags(write=False)
        with self._lock:
            self._mean_cache[key] = mean
        return mean

    def output_shape(self, record_shape: Sequence[int]) -> tuple[int, int, int]:
        """The shape one record of ``(C, H, W)`` takes in the output (no batch axis).

        ``(C, h, w)`` for NCHW or ``(h, w, C)`` for NHWC, with ``h = w = crop_size``
        when cropping.

        Raises:
            ShapeError: the crop is larger than the record.
        """
        c, h, w = _chw(record_shape)
        if self._crop:
            self._check_crop(h, w)
            h = w = self._crop
        return (c, h, w) if self._layout == "NCHW" else (h, w, c)

    @staticmethod
    def draw(seed: int, epoch: int, index: int) -> int:
        """The 64-bit random word of record ``index`` in ``epoch`` for ``seed``."""
        return draw_word(seed, epoch, index)

    def record_params(
        self, record_shape: Sequence[int], *, phase: Phase, word: int = 0
    ) -> RecordParams:
        """The crop offset and flip for a record of ``(C, H, W)`` and random ``word``.

        ``word`` comes from :meth:`draw`; it is ignored when nothing is random.

        Raises:
            ShapeError: the crop is larger than the record.
            ValueError: ``phase`` is not "train" or "test".
        """
        h, w, flip = self.geometry(record_shape, check_phase(phase), [word]).row(0)
        return RecordParams(h, w, flip)

    def geometry(self, record_shape: Sequence[int], phase: Phase, words: npt.ArrayLike) -> Geometry:
        """:meth:`record_params` for many records of one shape: per-row arrays of
        crop offsets and flips (the kernel's one place that draws them).

        Raises:
            ShapeError: the crop is larger than the record.
        """
        _, h, w = _chw(record_shape)
        self._check_crop(h, w)
        train = phase == "train"
        if self._mirror or (train and self._crop):
            return draw_geometry(h, w, self._crop, self._mirror, train, words)
        # nothing random: the same (read-only) geometry for every batch of this size
        n = len(words)  # type: ignore[arg-type]
        key = (h, w, n)
        fixed = self._fixed.get(key)
        if fixed is None:
            fixed = draw_geometry(h, w, self._crop, False, False, np.zeros(n, np.uint64))
            for part in fixed.arrays():
                part.setflags(write=False)
            with self._lock:
                if len(self._fixed) >= _SPEC_CACHE_SIZE:
                    self._fixed.pop(next(iter(self._fixed)))
                self._fixed[key] = fixed
        return fixed

    def geometry_of(
        self,
        heights: npt.NDArray[np.intp],
        widths: npt.NDArray[np.intp],
        phase: Phase,
        words: npt.ArrayLike,
        *,
        checked: bool = False,
    ) -> Geometry:
        """:meth:`geometry` for records each of its own height and width (one per word),
        drawn for them all at once: row ``i``'s crop and flip are those of
        :meth:`geometry` of a record of ``heights[i] × widths[i]`` with ``words[i]``.
        ``checked``: the caller has found that the crop fits every record (each check
        costs a W4 batch tens of µs holding the GIL).

        Raises:
            ShapeError: the crop is larger than one of the records (the first named).
        """
        heights = np.asarray(heights, np.intp)
        widths = np.asarray(widths, np.intp)
        if not checked:
            small = (heights < self._crop) | (widths < self._crop)
            if small.any():
                i = int(np.flatnonzero(small)[0])
                self._check_crop(int(heights[i]), int(widths[i]))
        return draw_geometry(heights, widths, self._crop, self._mirror, phase == "train", words)

    @property
    def crops_any_size(self) -> bool:
        """Whether records of one channel count and of any height and width the crop
        fits make rows of one shape through one :meth:`kernel_spec`: there is a crop,
        and no mean file (its shape is the records') unless the output is uint8 (which
        takes no mean)."""
        return bool(self._crop) and (self._mean_blob is None or self._dtype == "uint8")

    def output_class(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A key equal for record shapes that make one row shape through one
        :meth:`kernel_spec`: ``(C, -1, -1)`` for a ``(C, H, W)`` the crop fits where
        :attr:`crops_any_size`, else ``shape`` itself (what a plan's output is cached
        by: W4's JPEGs are of hundreds of sizes)."""
        if len(shape) == 3 and self.crops_any_size and self.crop_fits(shape[1], shape[2]):
            return (shape[0], -1, -1)
        return shape

    def crop_fits(self, h: int, w: int) -> bool:
        """Whether the crop fits a record ``h`` high and ``w`` wide (the one place
        this is decided; True without a crop)."""
        return self._crop <= h and self._crop <= w

    def _check_crop(self, h: int, w: int) -> None:
        """Refuse a record the crop does not fit (:meth:`crop_fits`).

        Raises:
            ShapeError: naming the crop and the record's height and width.
        """
        if not self.crop_fits(h, w):
            raise ShapeError(
                f"crop_size {self._crop} is larger than the record (height {h}, width {w})"
            )

    def kernel_spec(
        self, record_shape: Sequence[int], *, with_mean: bool = True, mean: Any = _OWN_MEAN
    ) -> KernelSpec:
        """What the transform kernel needs for records of ``(C, H, W)`` besides their
        geometry: crop, mean (None for uint8 output, or without ``with_mean``),
        scale and layout. Cached (thread-safe): per shape with a mean file, else per
        channel count, since only a mean file depends on the record's height and width
        (records of many sizes, as JPEGs are, share one spec; the crop is checked for
        each). The one place a :class:`KernelSpec` is made.

        ``mean``: the mean to use instead of :meth:`mean_array` of ``record_shape``:
        the same values in another array library's memory (a device's copy, for
        the device transform; None where :meth:`mean_array` is None). Not cached.

        Raises:
            ShapeError: the crop is larger than the record, or the mean does not fit.
        """
        own = mean is _OWN_MEAN
        plain = not with_mean or self._dtype == "uint8"  # no mean, no scale
        sized = self._mean_blob is not None and not plain  # its mean is the record's size
        if own and sized and type(record_shape) is tuple:
            spec = self._spec_cache.get(record_shape)  # (checked when it was made)
            if spec is not None:
                return spec
        chw = _chw(record_shape)
        self._check_crop(chw[1], chw[2])
        if not (own or plain):
            return KernelSpec(self._crop, mean, self._scale, self._layout)
        key = chw if sized else (chw[0], -1 if plain else 0, 0)
        spec = self._spec_cache.get(key)
        if spec is not None:
            return spec
        if plain:
            spec = KernelSpec(self._crop, None, np.float32(1), self._layout)
        else:
            spec = KernelSpec(self._crop, self.mean_array(chw), self._scale, self._layout)
        with self._lock:
            if len(self._spec_cache) >= _SPEC_CACHE_SIZE:
                self._spec_cache.pop(next(iter(self._spec_cache)))
            self._spec_cache[key] = spec
        return spec

    def check_record(self, chw: np.ndarray) -> None:
        """That a record's pixels can go through this transform.

        Raises:
            ShapeError: the record is not 3-D uint8/float32, or holds float32 values
                for a uint8 output.
        """
        if chw.ndim != 3 or chw.dtype not in (np.uint8, np.float32):
            raise ShapeError(
                f"a record must be a (C, H, W) uint8 or float32 array, got shape "
                f"{chw.shape} dtype {chw.dtype}"
            )
        if self._dtype == "uint8" and chw.dtype != np.uint8:
            raise ShapeError(
                "dtype='uint8' output needs uint8 records; this record holds float32 "
                "values (float_data); use dtype='float32'"
            )

    # -- one record ---------------------------------------------------------------------------

    def apply_into(
        self,
        chw: npt.NDArray[np.uint8] | npt.NDArray[np.float32],
        out: npt.NDArray[np.float32] | npt.NDArray[np.uint8],
        *,
        phase: Phase = "test",
        seed: int = 0,
        epoch: int = 0,
        index: int = 0,
        params: RecordParams | None = None,
    ) -> RecordParams:
        """Transform one ``(C, H, W)`` record into ``out`` (a row of a batch array).

        ``out`` must have :meth:`output_shape` and this transform's dtype; it may be
        any writable view (e.g. ``batch[i]``). The random choices come from
        ``(seed, epoch, index)`` unless ``params`` gives them. Returns the choices
        used. Nothing is allocated.

        Raises:
            ShapeError: the record is not 3-D uint8/float32, ``out`` has the wrong
                shape or dtype, a float32 record is sent to a uint8 output, the crop
                is larger than the record, or the mean does not fit.
        """
        self.check_record(chw)
        if params is None:
            phase = check_phase(phase)
            word = self.draw(seed, epoch, index) if self.needs_random else 0
            params = self.record_params(chw.shape, phase=phase, word=word)
        expected = self.output_shape(chw.shape)
        if out.shape != expected or out.dtype != self.dtype:
            raise ShapeError(
                f"output slot has shape {out.shape} dtype {out.dtype}; this record needs "
                f"shape {expected} dtype {self.dtype}"
            )
        geometry = Geometry(
            np.array([params.h_off], np.intp),
            np.array([params.w_off], np.intp),
            np.array([params.mirror], np.bool_),
        )
        apply(np, chw[np.newaxis], out[np.newaxis], geometry, self.kernel_spec(chw.shape))
        return params

    def __call__(
        self,
        chw: npt.NDArray[np.uint8] | npt.NDArray[np.float32],
        *,
        phase: Phase = "test",
        seed: int = 0,
        epoch: int = 0,
        index: int = 0,
    ) -> npt.NDArray[np.float32] | npt.NDArray[np.uint8]:
        """Transform one record into a new array (see :meth:`apply_into`).

        Raises:
            ShapeError: as :meth:`apply_into`.
        """
        if chw.ndim != 3:
            raise ShapeError(f"a record must be a (C, H, W) array, got shape {chw.shape}")
        out = np.empty(self.output_shape(chw.shape), dtype=self.dtype)
        self.apply_into(chw, out, phase=phase, seed=seed, epoch=epoch, index=index)
        return out


def _chw(shape: Sequence[int]) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise ShapeError(f"a record shape must be (C, H, W), got {tuple(shape)}")
    return (int(shape[0]), int(shape[1]), int(shape[2]))
