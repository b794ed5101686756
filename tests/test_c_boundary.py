"""The compiled entry points at their boundary (``_rowkernel.c``'s ``transform_rows``,
``transform_image``, ``match_raw`` and ``draw``, the decoders' ``decode_rows``; the checks
they share in ``_kernel.h``), called directly as a careless or hostile caller would.

The property: a correct result, or a ValueError / TypeError / OverflowError /
MemoryError that names the argument, with nothing written; never a crash, a read or
write outside a buffer, an item of one type read as another, or a leak. Each buffer's
format (not only its item size), layout and count are checked, and every size is
checked for overflow before it is multiplied. The fuzzing is derandomized and bounded
(a few seconds in all).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._helpers import run_script

rowkernel: Any = pytest.importorskip("blobpipe._io._rowkernel")

_FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)


def _reference(
    src: np.ndarray, h0: int, w0: int, flip: bool, crop: int, mean: np.ndarray | None,
    scale: float, nhwc: bool,
) -> np.ndarray:  # fmt: skip
    """Caffe's transform of one (C, H, W) uint8 record, in float32, step by step."""
    _, H, W = src.shape
    ch, cw = (crop, crop) if crop else (H, W)
    x = src.astype(np.float32)
    if mean is not None:
        m = mean.reshape(-1, 1, 1) if mean.size == src.shape[0] else mean.reshape(src.shape)
        x = x - m.astype(np.float32)
    if scale != 1.0:
        x = x * np.float32(scale)
    x = x[:, h0 : h0 + ch, w0 : w0 + cw]
    if flip:
        x = x[:, :, ::-1]
    return np.ascontiguousarray(x.transpose(1, 2, 0) if nhwc else x, np.float32)


def _rows_args(n: int = 2, shape: tuple[int, int, int] = (3, 4, 5)) -> dict[str, Any]:
    """Good arguments of transform_rows: ``n`` rows of ``shape`` one after another."""
    size = int(np.prod(shape))
    return {
        "src": np.arange(n * size, dtype=np.uint8),
        "offsets": np.arange(n, dtype=np.int64) * size,
        "shape": shape,
        "h_off": np.zeros(n, np.intp),
        "w_off": np.zeros(n, np.intp),
        "mirror": np.zeros(n, np.bool_),
        "mean": None,
        "scale": 1.0,
        "out": np.zeros((n, *shape), np.float32),
        "crop": 0,
        "nhwc": 0,
    }


def _call_rows(a: dict[str, Any]) -> None:
    rowkernel.transform_rows(
        a["src"], a["offsets"], a["shape"], a["h_off"], a["w_off"], a["mirror"], a["mean"],
        a["scale"], a["out"], a["crop"], a["nhwc"],
    )  # fmt: skip


# -- formats, not only item sizes -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("out", np.zeros((2, 3, 4, 5), np.int32), "out must be float32 or uint8"),
        ("out", np.zeros((2, 3, 4, 5), np.int8), "out must be float32 or uint8"),
        ("out", np.zeros((2, 3, 4, 5), np.bool_), "out must be float32 or uint8"),
        ("out", np.zeros((2, 3, 4, 5), ">f4"), "out must be float32 or uint8"),
        ("mean", np.zeros(3, np.int32), "mean must be float32"),
        ("mean", np.zeros(3, np.uint32), "mean must be float32"),
        ("offsets", np.zeros(2, np.float64), "offsets must be int64"),
        ("offsets", np.zeros(2, np.uint64), "offsets must be int64"),
        ("offsets", np.zeros(2, ">i8"), "offsets must be int64"),
        ("h_off", np.zeros(2, np.float64), "h_off must be intp"),
        ("w_off", np.zeros(2, np.uint64), "w_off must be intp"),
        ("mirror", np.zeros(2, np.int8), "mirror must be bool or uint8"),
        ("src", np.zeros(120, np.int8), "src must be uint8"),
    ],
)
def test_a_buffer_of_another_format_and_the_same_item_size_is_refused(
    name: str, value: np.ndarray, match: str
) -> None:
    """An int32 array where float32 is expected was read as floats (only the item size
    was compared): every typed buffer's format is checked, nothing is written."""
    a = _rows_args()
    a[name] = value
    with pytest.raises(ValueError, match=match):
        _call_rows(a)
    assert not np.asarray(a["out"]).any()


def test_transform_image_checks_formats_too() -> None:
    src = np.zeros((3, 4, 5), np.uint8)
    with pytest.raises(ValueError, match="out must be float32 or uint8"):
        rowkernel.transform_image(
            src, 0, (3, 4, 5), 0, 0, False, None, 1.0, np.zeros((3, 4, 5), np.int32), 0, 0
        )
    with pytest.raises(ValueError, match="src must be uint8"):
        rowkernel.transform_image(
            src.view(np.int8), 0, (3, 4, 5), 0, 0, False, None, 1.0,
            np.zeros((3, 4, 5), np.float32), 0, 0,
        )  # fmt: skip


def _match_args() -> dict[str, Any]:
    """match_raw's arguments for two 5-byte records of a 10-byte buffer."""
    return {
        "buffer": np.zeros(10, np.uint8),
        "offsets": np.array([0, 5], np.int64),
        "lengths": np.array([5, 5], np.int64),
        "header": b"\x08\x01",
        "size": 1,
        "good": np.full(2, 7, np.uint8),
        "labels": np.full(2, 7, np.int32),
    }


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("offsets", np.array([0, 6], np.int64), "record 1 lies outside the buffer"),
        ("offsets", np.array([-1, 5], np.int64), "record 0 lies outside the buffer"),
        ("lengths", np.array([5, 2**62], np.int64), "record 1 lies outside the buffer"),
        ("lengths", np.array([-5, 5], np.int64), "record 0 lies outside the buffer"),
        ("offsets", np.array([0, 5], np.float64), "offsets must be int64"),
        ("buffer", np.zeros(10, np.int8), "buffer must be uint8"),
        ("labels", np.full(2, 7, np.uint32), "labels must be int32"),
        ("good", np.full(2, 7, np.int8), "good must be bool or uint8"),
        ("good", np.full(3, 7, np.uint8), "one per record"),
        ("lengths", np.zeros(1, np.int64), "one per record"),
        ("size", -1, "bad size"),
    ],
)
def test_match_raw_refuses_records_outside_its_buffer_and_other_formats(
    name: str, value: Any, match: str
) -> None:
    """The raw-layout matcher checks every record's range against the buffer and every
    buffer's format before it reads a byte, and writes nothing when it refuses."""
    a = _match_args()
    a[name] = value
    with pytest.raises(ValueError, match=match):
        rowkernel.match_raw(*a.values())
    assert (a["good"] == 7).all() and (a["labels"] == 7).all()
    assert rowkernel.match_raw(*_match_args().values()) == 0  # the arguments as made: no raw record


def _draw_args() -> dict[str, Any]:
    """draw's arguments for three words, sides of 9 cropped to 8, outputs filled with 7."""
    return {
        "words": np.array([1, 2**63 + 5, 2**64 - 1], np.uint64),
        "height": 9,
        "width": np.array([9, 10, 8], np.intp),
        "crop": 8,
        "h_off": np.full(3, 7, np.intp),
        "w_off": np.full(3, 7, np.intp),
        "flips": np.full(3, 7, np.uint8),
    }


@pytest.mark.parametrize(
    ("name", "value", "error", "match"),
    [
        ("words", np.zeros(3, np.int64), ValueError, "words must be uint64"),
        ("words", np.zeros(3, np.float64), ValueError, "words must be uint64"),
        ("words", [1, 2, 3], TypeError, "words must support the buffer protocol"),
        ("height", 7, ValueError, "row 0's 7x9 is smaller than the crop 8"),
        ("height", -1, ValueError, "smaller than the crop"),
        ("height", 2**70, OverflowError, "too large"),
        ("height", 9.0, TypeError, "height must support the buffer protocol"),
        ("width", np.array([9, 10, 7], np.intp), ValueError, "row 2's 9x7 is smaller"),
        ("width", np.array([9, 10], np.intp), ValueError, "width must be an int or one per word"),
        ("width", np.array([9, 10, 8], np.int32), ValueError, "width must be intp"),
        ("width", np.array([9, 9, 10, 10, 8, 8], np.intp)[::2], ValueError, "C-contiguous"),
        ("crop", -1, ValueError, "crop must be > 0 with h_off"),
        ("crop", 0, ValueError, "crop must be > 0 with h_off"),
        ("h_off", None, ValueError, "must both be given, or neither"),
        ("h_off", np.full(2, 7, np.intp), ValueError, "one per word"),
        ("h_off", np.full(3, 7, np.uint64), ValueError, "h_off must be intp"),
        ("w_off", np.full(3, 7, np.intp)[::-1], ValueError, "C-contiguous"),
        ("flips", np.full(3, 7, np.int8), ValueError, "flips must be bool or uint8"),
        ("flips", np.full(4, 7, np.uint8), ValueError, "flips must be one per word"),
        ("flips", b"\x07\x07\x07", TypeError, "flips must support the buffer protocol"),
    ],
)
def test_draw_refuses_what_it_cannot_draw_and_writes_nothing(
    name: str, value: Any, error: type[Exception], match: str
) -> None:
    """The crop-and-flip draw checks every buffer's format, count and layout and every
    row's side against the crop before it writes an item; what it refuses it names."""
    a, b = _draw_args(), _draw_args()
    a.update(b)  # the same outputs: checked for writes below
    a[name] = value
    with pytest.raises(error, match=match):
        rowkernel.draw(*a.values())
    assert all((b[k] == 7).all() for k in ("h_off", "w_off", "flips") if a[k] is b[k])
    b = _draw_args()
    assert rowkernel.draw(*b.values()) is None  # the arguments as made: drawn
    w = b["words"]
    assert b["h_off"].tolist() == (((w >> np.uint64(1)) & np.uint64(0x7FFFFFFF)) % 2).tolist()
    assert (
        b["w_off"].tolist() == ((w >> np.uint64(32)) % (b["width"] - 7).astype(np.uint64)).tolist()
    )
    assert b["flips"].tolist() == (w & np.uint64(1)).tolist()


def test_draw_into_an_output_that_overlaps_its_sides_does_not_trap() -> None:
    """An output that overlaps the sides rewrites them as it goes: row 0 writes 7 as row
    1's height, below the crop of 8 (its room H - crop + 1 is 0): wrong offsets, never a
    division by zero (run in a fresh interpreter: a trap shows as a signal)."""
    proc = run_script("""
        import numpy as np
        from blobpipe._io import _rowkernel
        base = np.full(4, 15, np.intp)
        words = np.full(3, 14, np.uint64)  # (14 >> 1) % (15 - 8 + 1) = 7
        _rowkernel.draw(words, base[:3], 15, 8, base[1:], np.zeros(3, np.intp), None)
        print(base.tolist())
    """)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[15,", "7,", "0,", "7]"]


@pytest.mark.parametrize("name", ["out", "offsets", "h_off", "mirror", "src"])
def test_a_buffer_with_gaps_is_refused_as_a_value(name: str) -> None:
    """Strides other than C-contiguous are a ValueError naming the argument (the type
    is right; its layout is not)."""
    a = _rows_args()
    a[name] = np.repeat(np.asarray(a[name]), 2, axis=0)[::2]
    with pytest.raises(ValueError, match=f"{name} must be C-contiguous"):
        _call_rows(a)


# -- sizes: checked before they are multiplied -------------------------------------------------

_OVERFLOW = """
    import numpy as np
    from blobpipe._io import _rowkernel

    z = np.zeros(1, np.intp)
    flip = np.ones(1, np.bool_)
    for shape in [(1, 2**32, 2**32), (2**21, 2**21, 2**21), (4, 2**31, 2**31), (1, 2**62, 4)]:
        for out in (np.zeros(0, np.float32), np.zeros(0, np.uint8)):
            try:
                _rowkernel.transform_rows(
                    bytes(64), np.zeros(1, np.int64), shape, z, z, flip, None, 1.0, out, 0, 0
                )
                print("accepted", shape)
            except ValueError as exc:
                print("refused", exc)
"""


def test_a_shape_whose_size_overflows_is_refused_not_wrapped() -> None:
    """(1, 2**32, 2**32): C*H*W wrapped to 0 and matched an empty output, then the
    mirrored row's lines were written far outside it (a crash)."""
    done = run_script(_OVERFLOW)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert len(lines) == 8 and all(line.startswith("refused") for line in lines), lines
    assert all("too large" in line for line in lines), lines


# -- decode_rows: the reference leak on its out-of-memory path ----------------------------------

_LEAK = """
    import resource, tracemalloc
    import numpy as np
    from blobpipe._io import _pngrows

    n, H = 100_000, 2**28
    z = np.zeros(n, np.intp)
    out = np.zeros((n, 3, 1, 1), np.float32)
    flips = np.zeros(n, np.bool_)
    args = ([None] * n, (3, H, 1), z, z, flips, None, 1.0, out, 1, 0)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:")) * 1024
    # room for the call's H*3-byte scratch, not for its H line pointers (8 bytes each)
    resource.setrlimit(resource.RLIMIT_AS, (vm + 6 * H, resource.RLIM_INFINITY))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    refused = 0
    for _ in range(20):
        try:
            _pngrows.decode_rows(*args)
        except MemoryError:
            refused += 1
    print(refused, tracemalloc.get_traced_memory()[0] - before)
"""


def test_decode_rows_out_of_memory_leaks_nothing() -> None:
    """Where the line pointers cannot be had, the call raises MemoryError and releases
    everything, its status bytes included (they were leaked: n bytes a call)."""
    pytest.importorskip("blobpipe._io._pngrows")
    done = run_script(_LEAK, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    refused, grown = map(int, done.stdout.split())
    assert refused == 20
    assert grown < 100_000, f"{grown} bytes left behind by 20 refused calls"


# -- no allocation per mirrored image -----------------------------------------------------------

_COUNTER = r"""
#include <stddef.h>
extern void *__libc_malloc(size_t);
static volatile size_t watched;
static volatile long hits;
void bp_watch(size_t size) { watched = size; hits = 0; }
long bp_hits(void) { return hits; }
void *malloc(size_t size) {
    if (size && size == watched) hits++;
    return __libc_malloc(size);
}
"""

_COUNT_MALLOCS = """
    import ctypes, sys
    import cv2
    import numpy as np
    from blobpipe._io import _pngrows, _rowkernel

    counter = ctypes.CDLL(sys.argv[1])
    H, W, n = 6, 777, 8  # a mirrored line's scratch: 3 * W float32, a size nothing else asks
    rng = np.random.default_rng(0)
    hwc = [rng.integers(0, 256, (H, W, 3), dtype=np.uint8) for _ in range(n)]
    pngs = [cv2.imencode(".png", x)[1].tobytes() for x in hwc]
    z = np.zeros(n, np.intp)
    out = np.zeros((n, 3, H, W), np.float32)
    counter.bp_watch(3 * W * 4)
    status = _pngrows.decode_rows(pngs, (3, H, W), z, z, np.ones(n, np.bool_), None, 1.0, out, 0, 0)
    assert bytes(status) == b"\\x01" * n, status
    rows = counter.bp_hits()
    counter.bp_watch(3 * W * 4)
    one = np.zeros((3, H, W), np.float32)
    for x in hwc:
        _rowkernel.transform_image(x, 1, (3, H, W), 0, 0, True, None, 1.0, one, 0, 0)
    want = np.ascontiguousarray(hwc[-1].transpose(2, 0, 1)[:, :, ::-1], np.float32)
    assert np.array_equal(one, want)
    print(rows, counter.bp_hits())
"""


@pytest.mark.skipif(
    shutil.which("cc") is None or not sys.platform.startswith("linux"),
    reason="needs a C compiler and glibc (a malloc counter is preloaded)",
)
def test_a_mirrored_image_costs_no_allocation(tmp_path: Path) -> None:
    """A mirrored (H, W, 3) image went through a scratch line malloc'd and freed per
    image: a batch's decode_rows now allocates it once, and transform_image (one image)
    not at all for lines up to 1024 pixels."""
    pytest.importorskip("blobpipe._io._pngrows")
    source = tmp_path / "counter.c"
    source.write_text(_COUNTER)
    library = tmp_path / "counter.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O1", "-o", str(library), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    env = {**os.environ, "LD_PRELOAD": str(library)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_COUNT_MALLOCS), str(library)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
        cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    batch, single = map(int, done.stdout.split())
    assert batch <= 1, f"decode_rows allocated a mirrored line {batch} times for 8 images"
    assert single == 0, f"transform_image allocated a mirrored line {single} times for 8 images"


# -- fuzzing the entry points -------------------------------------------------------------------

_NEAR = [0, 1, 2, 3, 2**31 - 1, 2**31, 2**31 + 1, 2**32, 2**62, 2**63 - 1, -1, -(2**31), -(2**63)]
_DTYPES = [np.uint8, np.int8, np.bool_, np.int32, np.uint32, np.float32, np.int64, np.uint64,
           np.float64, np.intp, np.dtype(">f4"), np.dtype(">i8")]  # fmt: skip


def _guarded(shape: tuple[int, ...], dtype: Any, fill: Any = 0) -> tuple[np.ndarray, np.ndarray]:
    """An array of ``shape`` inside a larger one whose margins hold a sentinel: a write
    outside the array shows in the margins."""
    count = int(np.prod(shape))
    itemsize = np.dtype(dtype).itemsize
    whole = np.full((count + 64) * itemsize, 0x5A, np.uint8)
    inner = whole[32 * itemsize : (32 + count) * itemsize].view(dtype).reshape(shape)
    inner[...] = fill
    return whole, inner


@st.composite
def _entry_args(draw: st.DrawFn) -> dict[str, Any]:
    """transform_rows arguments: mostly good, each one possibly replaced by a wrong
    dtype, a strided view, a wrong count or a size near 2**31 or 2**63."""
    n = draw(st.integers(0, 4))
    C = draw(st.integers(1, 4))
    H = draw(st.integers(1, 6))
    W = draw(st.integers(1, 6))
    crop = draw(st.sampled_from([0, 0, 1, min(H, W)]))
    args = _rows_args(n, (C, H, W))
    args["crop"] = crop
    ch, cw = (crop, crop) if crop else (H, W)
    args["h_off"] = np.array(draw(st.lists(st.integers(0, H - ch), min_size=n, max_size=n)),
                             np.intp)  # fmt: skip
    args["w_off"] = np.array(draw(st.lists(st.integers(0, W - cw), min_size=n, max_size=n)),
                             np.intp)  # fmt: skip
    args["mirror"] = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)
    args["nhwc"] = draw(st.sampled_from([0, 1]))
    args["scale"] = draw(st.sampled_from([1.0, 0.5, -3.0]))
    if draw(st.booleans()):
        args["mean"] = np.linspace(-5, 5, draw(st.sampled_from([C, C * H * W]))).astype(np.float32)
    out_dtype = draw(st.sampled_from([np.float32, np.uint8]))
    if out_dtype == np.uint8:
        args["mean"], args["scale"] = None, 1.0
    out_shape = (n, ch, cw, C) if args["nhwc"] else (n, C, ch, cw)
    args["whole"], args["out"] = _guarded(out_shape, out_dtype)
    args["itemsize"] = np.dtype(out_dtype).itemsize
    for _ in range(draw(st.integers(0, 2))):
        what = draw(st.sampled_from(
            ["dtype", "strided", "count", "shape", "offset", "corner", "crop", "tuple", "empty"]
        ))  # fmt: skip
        name = draw(st.sampled_from(["src", "offsets", "h_off", "w_off", "mirror", "mean", "out"]))
        value = args[name]
        if what == "dtype" and isinstance(value, np.ndarray):
            args[name] = value.astype(draw(st.sampled_from(_DTYPES)))
        elif what == "strided" and isinstance(value, np.ndarray) and value.ndim:
            args[name] = np.repeat(value, 2, axis=0)[::2]
        elif what == "count" and isinstance(value, np.ndarray) and value.ndim:
            args[name] = (
                value[: max(0, len(value) - 1)]
                if draw(st.booleans())
                else np.concatenate([value, value[:1]])
            )
        elif what == "shape":
            args["shape"] = tuple(
                draw(st.sampled_from([*_NEAR, x])) if draw(st.booleans()) else x
                for x in args["shape"]
            )
        elif what == "offset" and n:
            args["offsets"] = args["offsets"].copy()
            args["offsets"][draw(st.integers(0, n - 1))] = draw(st.sampled_from(_NEAR))
        elif what == "corner" and n:
            which = draw(st.sampled_from(["h_off", "w_off"]))
            args[which] = args[which].copy()
            args[which][draw(st.integers(0, n - 1))] = draw(st.sampled_from(_NEAR))
        elif what == "crop":
            args["crop"] = draw(st.sampled_from(_NEAR))
        elif what == "tuple" and name == "out":
            args["out"] = (value, value) if draw(st.booleans()) else ()
        elif what == "empty" and name in ("out", "src", "mean"):
            args[name] = np.zeros(0, value.dtype if isinstance(value, np.ndarray) else np.float32)
    return args


def _valid(a: dict[str, Any]) -> bool:
    """Whether transform_rows must accept ``a``, by its contract (the module's top
    comment), worked out apart from the C checks."""

    def of(x: Any, *dtypes: Any) -> bool:
        return isinstance(x, np.ndarray) and x.dtype in dtypes and x.flags.c_contiguous

    offsets, h_off, w_off, mirror = a["offsets"], a["h_off"], a["w_off"], a["mirror"]
    if not (
        of(a["src"], np.uint8) and of(offsets, np.int64) and of(h_off, np.intp)
        and of(w_off, np.intp) and of(mirror, np.bool_, np.uint8)
    ):  # fmt: skip
        return False
    n = offsets.size
    if not h_off.size == w_off.size == mirror.size == n:
        return False
    (C, H, W), crop = a["shape"], a["crop"]
    if min(C, H, W) < 1 or not 0 <= crop <= min(H, W) or C * H * W * 4 >= 2**63:
        return False
    outs = list(a["out"]) if isinstance(a["out"], tuple) else [a["out"]]
    if not outs or not all(of(o, outs[0].dtype) for o in outs) or outs[0].dtype not in (
        np.float32, np.uint8
    ):  # fmt: skip
        return False
    ch, cw = (crop, crop) if crop else (H, W)
    row = C * ch * cw * outs[0].itemsize
    if sum(o.nbytes for o in outs) != n * row or any(o.nbytes % row for o in outs):
        return False
    if a["mean"] is not None and not (
        of(a["mean"], np.float32) and a["mean"].size in (C, C * H * W)
    ):
        return False
    return bool(
        ((offsets >= 0) & (offsets <= a["src"].size - C * H * W)).all()
        and ((h_off >= 0) & (h_off <= H - ch)).all()
        and ((w_off >= 0) & (w_off <= W - cw)).all()
    )


@_FUZZ
@given(_entry_args())
def test_transform_rows_is_right_or_refuses_and_never_writes_outside(args: dict[str, Any]) -> None:
    whole, itemsize = args["whole"], args["itemsize"]
    valid = _valid(args)
    refused = ""
    try:
        _call_rows(args)
    except (ValueError, TypeError, OverflowError, MemoryError) as exc:
        refused = str(exc) or f"{type(exc).__name__} without a message"
    if refused:
        assert "without a message" not in refused and not valid, refused
        if isinstance(args["out"], np.ndarray):
            assert not args["out"].any(), "written, then refused"
    else:
        assert valid, "bad arguments accepted"
        C, H, W = args["shape"]
        outs = list(args["out"]) if isinstance(args["out"], tuple) else [args["out"]]
        got = np.concatenate([o.reshape(-1) for o in outs])
        want = [
            _reference(
                args["src"][at : at + C * H * W].reshape(C, H, W), int(h), int(w), bool(flip),
                args["crop"], args["mean"], args["scale"], bool(args["nhwc"]),
            ).astype(outs[0].dtype).reshape(-1)
            for at, h, w, flip in zip(
                args["offsets"], args["h_off"], args["w_off"], args["mirror"], strict=True
            )
        ]  # fmt: skip
        assert np.array_equal(got, np.concatenate([*want, np.zeros(0, outs[0].dtype)]))
    margins = np.concatenate([whole[: 32 * itemsize], whole[len(whole) - 32 * itemsize :]])
    assert (margins == 0x5A).all(), "written outside the output"


@_FUZZ
@given(
    shape=st.tuples(*[st.sampled_from([*_NEAR, 1, 2, 3, 5]) for _ in range(3)]),
    crop=st.sampled_from([0, 1, 2**31, 2**63 - 1, -1]),
    corner=st.tuples(st.sampled_from(_NEAR), st.sampled_from(_NEAR)),
    hwc=st.booleans(),
    flip=st.booleans(),
    n=st.integers(0, 3),
    out=st.sampled_from([(0, np.float32), (48, np.float32), (0, np.uint8), (192, np.uint8)]),
)
def test_sizes_near_2_31_and_2_63_are_refused_before_any_arithmetic(
    shape: tuple[int, int, int], crop: int, corner: tuple[int, int], hwc: bool, flip: bool,
    n: int, out: tuple[int, Any],
) -> None:  # fmt: skip
    """Shapes, crops and corners near the limits of 32- and 64-bit integers, with small
    real buffers (an empty output matches a size that wrapped to 0): refused (or, where
    they happen to fit the buffers, done) without a crash, in both entry points and the
    decoders' decode_rows."""
    src = np.zeros(64, np.uint8)
    whole, out = _guarded((out[0],), out[1])
    errors = (ValueError, TypeError, OverflowError, MemoryError)
    try:
        rowkernel.transform_image(src, hwc, shape, *corner, flip, None, 1.0, out, crop, 0)
    except errors:
        pass
    z = np.full(n, corner[0], np.intp)
    try:
        rowkernel.transform_rows(
            src, np.zeros(n, np.int64), shape, z, z, np.full(n, flip), None, 1.0, out, crop, 0
        )
    except errors:
        pass
    for module in ("_pngrows", "_jpegwindow"):
        try:
            decoder = __import__(f"blobpipe._io.{module}", fromlist=["decode_rows"])
        except ImportError:
            continue
        png = cv2.imencode(".png", np.zeros((2, 2, 3), np.uint8))[1].tobytes()
        try:
            decoder.decode_rows([png] * n, shape, z, z, np.full(n, flip), None, 1.0, out, crop, 0)
        except errors:
            pass
    margins = np.concatenate([whole[: 32 * out.itemsize], whole[len(whole) - 32 * out.itemsize :]])
    assert (margins == 0x5A).all(), "written outside the output"


_WINDOW_SIDES = [0, 1, 5, 20, 39, 40, 47, 48, 2**31 - 1, 2**31, 2**62, 2**63 - 1, -1, -(2**63)]


@_FUZZ
@given(
    top=st.sampled_from(_WINDOW_SIDES),
    left=st.sampled_from(_WINDOW_SIDES),
    height=st.sampled_from(_WINDOW_SIDES),
    width=st.sampled_from(_WINDOW_SIDES),
)
def test_a_jpeg_window_near_2_63_is_refused_and_an_inside_one_is_exact(
    top: int, left: int, height: int, width: int
) -> None:
    """decode_window's window is the caller's: ``left + width`` past 2**63 wrapped
    negative and passed the bounds check (a crash copying the window's lines)."""
    jpegwindow = pytest.importorskip("blobpipe._io._jpegwindow")
    image = np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    data = cv2.imencode(".jpg", image)[1].tobytes()
    whole, out = _guarded((40 * 48 * 3,), np.uint8)
    ok = jpegwindow.decode_window(data, out, top, left, height, width)
    assert (whole[:32] == 0x5A).all() and (whole[-32:] == 0x5A).all(), "written outside out"
    inside = top >= 0 and left >= 0 and 0 < height <= 40 - top and 0 < width <= 48 - left
    if not inside:
        assert not ok
    elif ok:
        want = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        got = out.reshape(40, 48, 3)[top : top + height, left : left + width]
        assert np.array_equal(got, want[top : top + height, left : left + width])
