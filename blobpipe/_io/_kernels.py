"""Caffe's DataTransformer as one block operation over an array namespace.

Everything Caffe's transform does to pixels lives here, once:

* :func:`draw_words` and :func:`draw_geometry` — the per-record random choices
  (crop offset, mirror), derived from ``(seed, epoch, index)`` by SplitMix64, so
  any thread computes any record's choice on its own (a TRAIN draw in one call of the
  compiled row kernel where it is built, NumPy's same arithmetic elsewhere);
* :func:`apply` — crop, mirror, mean (the mean file at the crop's *uncropped*
  position, or one value per channel), scale and layout, for a block of rows,
  over ``xp`` (NumPy on the host, CuPy on a device). A single row is a block of
  one. A device finishing a batch the host cropped and flipped into uint8 (a
  Loader's device transform) runs it with ``cropped=True``: the mean then follows
  each row's geometry, gathered for all rows in one indexing, and the arithmetic
  is the host's own (:func:`_arithmetic`).

Raw uint8 rows of one buffer (records read from the database's file map) go to
:func:`apply_raw` first: the compiled row kernel (``_rowkernel.c``, built where a C
compiler is present at install) does the same arithmetic for every row in one call
without the GIL, each row with its own crop and flip; where it is absent,
:func:`apply` does it with NumPy.

The arithmetic is Caffe's, bit for bit: ``float32(x) - mean`` rounded to float32,
then ``* scale`` rounded to float32 (``float32(x) * scale`` without a mean).

How :func:`apply` runs: crop and mirror are views (slices, a negative stride),
never gathers; conversion and mean subtraction are one ufunc call with
``dtype=float32`` writing the output once, and the scale a second call over the
same row while it is still in cache. Rows that share their crop offset are done
as one block: one call for all of them when the output is written in one pass;
where it takes two (a mean then a scale, or the mirrored rows of a block
flipped afterwards in place) in chunks of rows whose output fits in a core's
L2 cache (:func:`block_rows`), so the second pass reads what the first just
wrote. Rows with crop offsets of their own (TRAIN crops, sequences of rows)
are done one row at a time.
"""

from __future__ import annotations

import functools
import operator
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from .._errors import ArgumentError, ArgumentTypeError, ShapeError

__all__ = [
    "Deferral",
    "Geometry",
    "KernelSpec",
    "apply",
    "apply_one",
    "apply_raw",
    "block_rows",
    "check_geometry_out",
    "compiled_row_kernel",
    "draw_geometry",
    "draw_word",
    "draw_words",
    "mix_words",
    "prefers_block",
    "row_pool",
    "shared_zeros",
]

Layout = Literal["NCHW", "NHWC"]

_M64 = 0xFFFFFFFFFFFFFFFF
_U64 = np.uint64
_F4 = np.dtype(np.float32)
_U1 = np.dtype(np.uint8)
# Rows whose output is at least this large are gathered by the filler as views,
# one per row, rather than copied into one block (prefers_block).
_ROW_BYTES = 32 << 10
# A block transformed in two passes goes in chunks of at most this much output
# (a core's L2 cache holds it), so the second pass reads it from cache.
_CHUNK_BYTES = 1 << 20


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _splitmix64_np(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    # uint64 array arithmetic wraps modulo 2**64, as the scalar form's masks do
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    out: npt.NDArray[np.uint64] = x ^ (x >> _U64(31))
    return out


def mix_words(words: npt.NDArray[np.uint64], salt: int) -> npt.NDArray[np.uint64]:
    """Other random words derived from ``words`` and ``salt`` (a second source's own
    draws for the same records)."""
    return _splitmix64_np(words ^ _U64(salt))


def draw_word(seed: int, epoch: int, index: int) -> int:
    """The 64-bit random word of record ``index`` in ``epoch`` for ``seed``."""
    x = _splitmix64(seed & _M64)
    x = _splitmix64(x ^ (epoch & _M64))
    return _splitmix64(x ^ (index & _M64))


def draw_words(seed: int, epochs: npt.ArrayLike, indices: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """:func:`draw_word` for many records at once (equal word for word)."""
    e = np.asarray(epochs, dtype=np.int64).astype(_U64)
    i = np.asarray(indices, dtype=np.int64).astype(_U64)
    s = np.full(np.broadcast(e, i).shape, seed & _M64, dtype=_U64)
    words: npt.NDArray[np.uint64] = _splitmix64_np(_splitmix64_np(_splitmix64_np(s) ^ e) ^ i)
    return words


def prefers_block(row_bytes: int) -> bool:
    """Whether rows whose output takes ``row_bytes`` and that do not lie at one
    stride are best copied into one block (one gather) rather than taken as a
    view per row."""
    return row_bytes < _ROW_BYTES


def block_rows(n: int, row_bytes: int, two_passes: bool) -> int:
    """How many rows of a block of ``n`` (one crop offset) one kernel call takes:
    all of them when the output is written in one pass, else as many as fit
    in :data:`_CHUNK_BYTES` (at least one)."""
    if not two_passes:
        return n
    return max(1, min(n, _CHUNK_BYTES // max(row_bytes, 1)))


@dataclass(frozen=True, slots=True)
class Geometry:
    """Each row's crop and flip: the crop's top-left corner ``(h_off, w_off)`` in the
    uncropped record, and ``mirror``, one element per row (:class:`RecordParams`
    for many rows).

    ``h_off`` and ``w_off`` are ``intp`` arrays, ``mirror`` a ``bool`` array, all
    of one length. :meth:`Batches.fill` writes a batch's into ``geometry_out``,
    made with :meth:`zeros` (what a device transform needs to apply the mean at
    the uncropped position after a ``dtype="uint8"`` batch)::

        geometry = blobpipe.Geometry.zeros(len(plan))
        batches.fill(plan, data, label, geometry_out=geometry)
        h_off, w_off, flip = geometry.row(0)
    """

    h_off: npt.NDArray[np.intp]
    w_off: npt.NDArray[np.intp]
    mirror: npt.NDArray[np.bool_]

    @classmethod
    def zeros(cls, n: int) -> Geometry:
        """``n`` rows of no crop offset and no flip, in new writable arrays (an
        output for :meth:`Batches.fill`'s ``geometry_out``)."""
        return cls(np.zeros(n, np.intp), np.zeros(n, np.intp), np.zeros(n, np.bool_))

    def __len__(self) -> int:
        return len(self.h_off)

    def arrays(self) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp], npt.NDArray[np.bool_]]:
        """``(h_off, w_off, mirror)``."""
        return self.h_off, self.w_off, self.mirror

    def row(self, i: int) -> tuple[int, int, bool]:
        """Row ``i``'s ``(h_off, w_off, mirror)`` as Python values."""
        return int(self.h_off[i]), int(self.w_off[i]), bool(self.mirror[i])

    def take(self, rows: Any) -> Geometry:
        """The rows ``rows`` selects (an index array: copies; a slice: views that
        write through)."""
        return Geometry(self.h_off[rows], self.w_off[rows], self.mirror[rows])


def check_geometry_out(geometry: object, n: int) -> None:
    """Refuse a ``geometry_out`` that is not a :class:`Geometry` of ``n`` rows of
    writable arrays of its dtypes (intp offsets, bool flips).

    Raises:
        ArgumentTypeError: not a Geometry, or a field that is not a NumPy array.
        ShapeError: a field of another length or dtype.
        ArgumentError: a read-only field.
    """
    if not isinstance(geometry, Geometry):
        raise ArgumentTypeError(
            "geometry_out must be a Geometry (e.g. blobpipe.Geometry.zeros(len(plan))), "
            f"got {type(geometry).__name__}"
        )
    for name, want in (("h_off", np.intp), ("w_off", np.intp), ("mirror", np.bool_)):
        a = getattr(geometry, name)
        if not isinstance(a, np.ndarray):
            raise ArgumentTypeError(
                f"geometry_out.{name} must be a NumPy array, got {type(a).__name__}"
            )
        if a.shape != (n,) or a.dtype != want:
            raise ShapeError(
                f"geometry_out.{name} has shape {a.shape} dtype {a.dtype}; the plan needs "
                f"shape ({n},) dtype {np.dtype(want)}"
            )
        if not a.flags.writeable:
            raise ArgumentError(f"geometry_out.{name} is read-only; fill writes into it")


_ZEROS: dict[np.dtype[Any], np.ndarray] = {}


def shared_zeros(n: int, dtype: npt.DTypeLike) -> np.ndarray:
    """``n`` zeros of ``dtype``, read-only and contiguous: a slice of one array per
    dtype, kept for the largest ``n`` asked (a fresh zeroed array of a chunk's rows
    comes from ``calloc`` with the GIL released: a hand-off to a waiting thread, once
    a chunk). For arrays that are only read: a plan's words, no crop's offsets."""
    kind = np.dtype(dtype)
    zeros = _ZEROS.get(kind)
    if zeros is None or n > len(zeros):
        zeros = np.zeros(max(n, 2 * (0 if zeros is None else len(zeros))), kind)
        zeros.setflags(write=False)
        _ZEROS[kind] = zeros
    return zeros[:n]


def draw_geometry(
    height: int | npt.NDArray[np.intp],
    width: int | npt.NDArray[np.intp],
    crop: int,
    mirror: bool,
    train: bool,
    words: npt.ArrayLike,
) -> Geometry:
    """The crop offsets and flips of records of ``height × width`` with random ``words``;
    ``height`` and ``width`` may be arrays, one per word (each row its own size: row
    ``i``'s draw is then the one a record of its size alone gets).

    TRAIN: ``h_off = ((word >> 1) & 0x7FFFFFFF) % (H - crop + 1)``,
    ``w_off = (word >> 32) % (W - crop + 1)``; TEST: the centre
    ``((H - crop) // 2, (W - crop) // 2)``; no crop: 0. ``mirror``: bit 0 of the
    word, when mirroring is on. The caller has checked that the crop fits.
    """
    w64 = np.asarray(words, dtype=_U64).reshape(-1)
    n = len(w64)
    kernel = row_kernel()
    if train and (crop or mirror) and kernel is not None:
        # the same arithmetic in one compiled call: a dozen NumPy calls take 11 µs a
        # batch of 64 warm, and ~80 holding the GIL once a large batch's rows have
        # evicted them from the caches (docs/performance.md, "The GIL budget")
        offsets = (np.empty(n, np.intp), np.empty(n, np.intp)) if crop else (None, None)
        flips = np.empty(n, np.bool_) if mirror else None
        kernel.draw(w64, _side(height), _side(width), crop, *offsets, flips)
        hs, ws = (shared_zeros(n, np.intp),) * 2 if offsets[0] is None else offsets
        return Geometry(hs, ws, shared_zeros(n, np.bool_) if flips is None else flips)
    if crop and train:
        h_off = ((w64 >> _U64(1)) & _U64(0x7FFFFFFF)) % _u64(height, 1 - crop)
        w_off = (w64 >> _U64(32)) % _u64(width, 1 - crop)
        hs, ws = h_off.astype(np.intp), w_off.astype(np.intp)
    elif crop and isinstance(height, int) and isinstance(width, int):
        hs = np.full(n, (height - crop) // 2, np.intp)
        ws = np.full(n, (width - crop) // 2, np.intp)
    elif crop:
        hs = np.broadcast_to((np.asarray(height, np.intp) - crop) // 2, n).astype(np.intp)
        ws = np.broadcast_to((np.asarray(width, np.intp) - crop) // 2, n).astype(np.intp)
    else:
        hs = ws = shared_zeros(n, np.intp)
    flips = (w64 & _U64(1)).astype(np.bool_) if mirror else shared_zeros(n, np.bool_)
    return Geometry(hs, ws, flips)


def _side(side: int | npt.NDArray[np.intp]) -> int | npt.NDArray[np.intp]:
    """A side as the compiled draw takes it: an int, or one contiguous intp per row."""
    if isinstance(side, int):
        return side
    if isinstance(side, np.ndarray) and side.ndim:
        return np.ascontiguousarray(side, np.intp)
    return operator.index(side)


def _u64(side: int | npt.NDArray[np.intp], plus: int) -> Any:
    """``side + plus`` as uint64 (a side the crop fits: positive): a scalar, or an array."""
    if isinstance(side, int):
        return _U64(side + plus)
    return (np.asarray(side, np.intp) + plus).astype(_U64)


@dataclass(frozen=True)
class KernelSpec:
    """What :func:`apply` does besides the geometry.

    ``crop``: the output side (0: the record's own height and width); ``mean``:
    None, the uncropped ``(C, H, W)`` float32 mean, or a ``(C, 1, 1)`` column,
    in ``xp``'s memory; ``scale``: float32; ``layout``: of the output;
    ``out`` dtype decides the arithmetic: uint8 output is a copy of the pixels.
    """

    crop: int
    mean: Any
    scale: np.float32
    layout: Layout


def apply(
    xp: Any,
    src: Any,
    out: Any,
    geometry: Geometry,
    spec: KernelSpec,
    *,
    cropped: bool = False,
) -> None:
    """Transform the rows of ``src`` into ``out`` with Caffe's arithmetic.

    ``src`` is an ``(N, C, H, W)`` uint8 or float32 array, or a sequence of N
    ``(C, H, W)`` arrays (shapes may differ between rows when they crop to one
    size); ``out`` is ``(N, C, h, w)`` or ``(N, h, w, C)``, float32 or uint8.
    ``geometry`` gives each row's crop offset and flip. ``cropped``: ``src`` is
    an ``(N, C, h, w)`` array of pixels already cropped and flipped (a device
    finishing a uint8 batch): only the mean follows the geometry, and every row
    is done in a constant number of calls (:func:`_apply_cropped`).

    The caller has checked shapes and that every crop fits.
    """
    n = len(geometry)
    if n == 0:
        return
    if cropped:
        _apply_cropped(xp, src, out, geometry, spec)
        return
    if not isinstance(src, (list, tuple)) and _apply_block(xp, src, out, geometry, spec):
        return
    compiled = xp is np and row_kernel() is not None
    for i in range(n):
        h, w, flip = geometry.row(i)
        if compiled and _apply_image(src[i], out[i], h, w, flip, spec):
            continue
        _apply_one(xp, src[i], out[i], h, w, flip, spec, batched=False)


def apply_one(
    chw: np.ndarray, out: np.ndarray, h: int, w: int, flip: bool, spec: KernelSpec
) -> None:
    """One host row: ``chw`` (a ``(C, H, W)`` uint8 or float32 array, e.g. a decoded
    image's transposed view) into ``out`` (its output row), cropped at ``(h, w)``,
    flipped when ``flip``: :func:`apply` of one row without its per-call checks, by
    the compiled row kernel where it takes the row, else NumPy (the same bits).

    The caller has checked the shapes and that the crop fits.
    """
    if row_kernel() is not None and _apply_image(chw, out, h, w, flip, spec):
        return
    _apply_one(np, chw, out, h, w, flip, spec, batched=False)


_UNLOADED: Any = object()
_rowkernel: Any = _UNLOADED


def row_kernel() -> Any:
    """The compiled row kernel module, or None where it was not built."""
    global _rowkernel
    if _rowkernel is _UNLOADED:
        try:
            from . import _rowkernel as module  # type: ignore[attr-defined]
        except ImportError:
            module = None
        _rowkernel = module
    return _rowkernel


def compiled_row_kernel() -> bool:
    """Whether this installation transforms raw records and decoded images with the
    compiled row kernel (built at install where a C compiler is present: a batch's
    rows in one call without the GIL); where False, NumPy does the same arithmetic,
    to the same bits, slower."""
    return row_kernel() is not None


def row_pool(threads: int) -> Any:
    """A pool of ``threads`` native threads that run row-kernel calls without ever
    taking the GIL (``_rowkernel.Pool``; started with its first call), or None where
    the kernel was not built. Close it with ``close()`` (it joins the threads). Its
    ``stream`` (False when made) says whether the calls started from then on write
    their float32 lines around the caches (see :func:`last_level_cache`)."""
    kernel = row_kernel()
    return None if kernel is None else kernel.Pool(threads)


@functools.cache
def last_level_cache(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Bytes of the largest data cache of CPU 0 (Linux's ``cache/index*/size``: the
    last level, shared), 0 where it cannot be read (then nothing is streamed); read
    once."""
    largest = 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    for name in names:
        if not name.startswith("index"):
            continue
        try:
            with open(os.path.join(root, name, "type"), encoding="ascii") as f:
                kind = f.read().strip()
            with open(os.path.join(root, name, "size"), encoding="ascii") as f:
                size = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if kind == "Instruction" or not size:
            continue
        unit = units.get(size[-1].upper(), 1)
        digits = size[:-1] if size[-1].upper() in units else size
        if digits.isdigit():
            largest = max(largest, int(digits) * unit)
    return largest


class Deferral:
    """A fill's compiled row calls started on a :func:`row_pool` instead of run in the
    calling thread, and the checks that must follow them (the database's snapshot
    check reads the state after the rows were read).

    The outputs, labels aside, are written only once :meth:`finish` returned (or
    :meth:`query` said True); until then every buffer a call reads or writes stays
    held by its job. Not thread-safe: one thread starts, queries and finishes it.
    """

    __slots__ = ("after", "jobs", "pool")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.jobs: list[Any] = []  # the pool's jobs, in start order
        self.after: list[Callable[[], None]] = []  # run by finish, in order

    def query(self) -> bool:
        """Whether every call ran (without waiting)."""
        jobs = self.jobs
        if len(jobs) == 1:  # (a chunk's rows: asked once a batch while it runs)
            return bool(jobs[0].query())
        return all(job.query() for job in jobs)

    def wait(self, seconds: float | None = None) -> bool:
        """Block until every call ran, or at most ``seconds`` (None: no limit), the GIL
        released while waiting; whether every call ran."""
        if seconds is None:
            for job in self.jobs:
                job.synchronize()
            return True
        deadline = time.perf_counter() + seconds
        return all(job.wait(max(0.0, deadline - time.perf_counter())) for job in self.jobs)

    def finish(self) -> None:
        """:meth:`wait`, then the checks, in order.

        Raises:
            DataError: a check failed (the database changed while it was read).
        """
        self.wait()
        after, self.after = self.after, []
        for check in after:
            check()


def apply_raw(
    buffer: Any,
    offsets: npt.NDArray[np.int64],
    shape: tuple[int, int, int],
    out: np.ndarray | Sequence[np.ndarray],
    geometry: Geometry,
    spec: KernelSpec,
    defer: Deferral | None = None,
) -> bool:
    """:func:`apply` for raw rows of one host ``buffer``: row ``i``'s ``shape`` pixels
    are the C-contiguous bytes at ``offsets[i]``. ``out``: one array of the rows, or
    several (consecutive batches) that take them in order. Done by the compiled row
    kernel in one call (the GIL released once), or started on ``defer``'s pool (every
    argument checked now; the rows written once it ran); False, nothing written,
    where it is not built or an output is not a C-contiguous float32 or uint8 array
    (all of one dtype; the caller then uses :func:`apply`).

    Raises:
        ValueError: an offset or a crop outside the buffer or the record (the
            caller has checked them; this is the kernel's own guard).
    """
    kernel = row_kernel()
    args = kernel_args(out, geometry, spec) if kernel is not None else None
    if args is None:
        return False
    offsets = np.ascontiguousarray(offsets, np.int64)
    if defer is not None:
        defer.jobs.append(defer.pool.start(buffer, offsets, shape, *args))
    else:
        kernel.transform_rows(buffer, offsets, shape, *args)
    return True


def kernel_args(
    out: np.ndarray | Sequence[np.ndarray], geometry: Geometry, spec: KernelSpec
) -> tuple[Any, ...] | None:
    """The arguments every compiled row transform takes after its sources and shape
    (``_kernel.h``; ``_rowkernel.transform_rows``, the decoders' ``decode_rows``): the
    rows' crop corners and flips, the mean, the scale, the output(s), the crop and
    the layout. None where an output is not a C-contiguous float32 or uint8 array
    (all of one dtype), or there is none: the rows then go another way."""
    outs = [out] if isinstance(out, np.ndarray) else list(out)
    if not outs:
        return None
    dtype = outs[0].dtype
    if dtype not in (_F4, _U1) or any(o.dtype != dtype or not o.flags.c_contiguous for o in outs):
        return None
    h_off, w_off, mirror = geometry.arrays()
    return (
        np.ascontiguousarray(h_off, np.intp),
        np.ascontiguousarray(w_off, np.intp),
        np.ascontiguousarray(mirror, np.bool_),
        _kernel_mean(spec, outs[0]),
        float(spec.scale),
        outs[0] if len(outs) == 1 else tuple(outs),
        spec.crop,
        spec.layout == "NHWC",
    )


def _kernel_mean(spec: KernelSpec, out: np.ndarray) -> np.ndarray | None:
    """The mean as the row kernel reads it (C-contiguous float32), or None: no mean,
    or a uint8 output (pixels only)."""
    if spec.mean is None or out.dtype != _F4:
        return None
    return np.ascontiguousarray(spec.mean, np.float32)


def _apply_image(chw: Any, out: Any, h: int, w: int, flip: bool, spec: KernelSpec) -> bool:
    """One host row by the compiled row kernel: ``chw`` uint8 ``(C, H, W)``, its
    pixels C-contiguous as ``(C, H, W)`` or as ``(H, W, C)`` (a decoded image's
    transposed view); False, nothing written, for any other row or output."""
    if (
        not isinstance(chw, np.ndarray)
        or chw.dtype != _U1
        or chw.ndim != 3
        or not isinstance(out, np.ndarray)
        or out.dtype not in (_F4, _U1)
        or not out.flags.c_contiguous
    ):
        return False
    if chw.flags.c_contiguous:
        pixels, hwc = chw, False
    else:
        pixels, hwc = chw.transpose(1, 2, 0), True
        if not pixels.flags.c_contiguous:
            return False
    mean = _kernel_mean(spec, out)
    _rowkernel.transform_image(
        pixels, hwc, chw.shape, h, w, flip, mean, float(spec.scale), out, spec.crop,
        spec.layout == "NHWC",
    )  # fmt: skip
    return True


def _apply_block(xp: Any, src: Any, out: Any, geometry: Geometry, spec: KernelSpec) -> bool:
    """The rows of ``src`` as one block (in chunks, :func:`block_rows`) when they
    share their crop offset; False (nothing done) when they are better done one
    row at a time."""
    n = len(geometry)
    h0, w0 = int(geometry.h_off[0]), int(geometry.w_off[0])
    if not ((geometry.h_off == h0).all() and (geometry.w_off == w0).all()):
        return False
    flips = geometry.mirror
    any_flip = bool(flips.any())
    all_flip = any_flip and bool(flips.all())
    mean = spec.mean
    mixed = any_flip and not all_flip
    two_passes = mixed or (mean is not None and spec.scale != 1 and out.dtype != np.uint8)
    # a device runs the block as one call; the host in cache-sized chunks
    step = block_rows(n, out[0].size * out.dtype.itemsize, two_passes and xp is np)
    if step == 1 and n > 1:
        return False  # a row per call: each its own flip, no second pass
    axis = 3 if spec.layout == "NCHW" else 2
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        chunk = out[lo:hi]
        _apply_one(xp, src[lo:hi], chunk, h0, w0, all_flip, spec, batched=True)
        if mixed:
            # the transform is elementwise: flipping the output equals
            # transforming the flipped input (pixels and mean alike)
            rows = np.flatnonzero(flips[lo:hi])
            if len(rows):
                at = xp.asarray(rows)
                chunk[at] = xp.flip(chunk[at], axis=axis)
    return True


def _apply_one(
    xp: Any,
    src: Any,
    out: Any,
    h: int,
    w: int,
    flip: bool,
    spec: KernelSpec,
    batched: bool,
) -> None:
    """One row (``batched``: a block of rows) with one crop offset and flip."""
    crop = spec.crop
    mean = spec.mean
    per_pixel = _per_pixel(mean)
    if crop:
        src = src[..., h : h + crop, w : w + crop]
        if per_pixel:
            mean = mean[:, h : h + crop, w : w + crop]
    flip_out = False
    if flip:
        # Pixels and mean read flipped (negative stride), or the output written
        # flipped: the same elements either way. NumPy's casting loops run
        # fastest on forward inputs, so rows whose pixels are contiguous along
        # the width (raw records) are written flipped; pixels that are strided
        # already (decoded HWC images) are read flipped.
        if abs(src.strides[-1]) == src.itemsize:
            flip_out = True
        else:
            src = src[..., ::-1]
            if per_pixel:
                mean = mean[..., ::-1]
    if spec.layout == "NHWC":
        src = src.transpose(0, 2, 3, 1) if batched else src.transpose(1, 2, 0)
        if mean is not None:
            mean = mean.transpose(1, 2, 0)
    forward = out
    if flip_out:
        out = out[..., ::-1, :] if spec.layout == "NHWC" else out[..., ::-1]
    _arithmetic(xp, src, mean, out, spec.scale, forward)


def _apply_cropped(xp: Any, src: Any, out: Any, geometry: Geometry, spec: KernelSpec) -> None:
    """:func:`apply` of pixels already cropped and flipped (``src``: ``(N, C, h, w)``):
    a per-pixel mean is cut at each row's crop offset and flipped with its row, all
    rows in one gather, then every row goes through :func:`_arithmetic` in one call."""
    h, w = src.shape[2], src.shape[3]
    dst = out if spec.layout == "NCHW" else out.transpose(0, 3, 1, 2)
    mean = spec.mean
    if _per_pixel(mean):
        across = np.arange(w, dtype=np.intp)
        rows = geometry.h_off[:, None] + np.arange(h, dtype=np.intp)
        cols = geometry.w_off[:, None] + np.where(geometry.mirror[:, None], across[::-1], across)
        r, c = xp.asarray(rows), xp.asarray(cols)
        mean = mean[:, r[:, :, None], c[:, None, :]].transpose(1, 0, 2, 3)  # (N, C, h, w)
    _arithmetic(xp, src, mean, dst, spec.scale, dst)


def _per_pixel(mean: Any) -> bool:
    """Whether ``mean`` (None, a ``(C, 1, 1)`` column or a ``(C, H, W)`` mean file)
    varies over the pixels, so that a crop cuts it and a flip turns it. A mean file
    of 1×1 records is a column: the same values either way."""
    return mean is not None and tuple(mean.shape[1:]) != (1, 1)


def _arithmetic(xp: Any, src: Any, mean: Any, out: Any, scale: Any, forward: Any) -> None:
    """Caffe's arithmetic, elementwise, into ``out``: ``float32(x) - mean`` rounded to
    float32, then ``* scale`` (``float32(x) * scale`` without a mean); a uint8
    ``out`` takes the pixels. ``mean`` broadcasts against ``src``; ``forward`` holds
    the elements of ``out`` with forward strides (``out`` itself, or the row ``out``
    views flipped), for the in-place scale."""
    if out.dtype == np.uint8:
        out[...] = src
    elif mean is not None:
        xp.subtract(src, mean, out=out, dtype=out.dtype)
        if scale != 1:
            xp.multiply(forward, scale, out=forward)
    elif scale != 1:
        xp.multiply(src, scale, out=out, dtype=out.dtype)
    else:
        out[...] = src
