"""Decoding only a crop's window of a JPEG (libjpeg-turbo's partial decompression).

The window must hold exactly the pixels of OpenCV's whole-image decode (what Caffe
decodes with) at the same place, for every JPEG a user can hand us; where that cannot
be promised (gray, damaged, truncated, rotated by EXIF) the whole image is decoded.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blobpipe
from blobpipe._io import _image
from blobpipe._io._image import Undecodable, decode_image, decode_window
from blobpipe._io._kernels import Geometry
from blobpipe._io._wire import parse_datum
from blobpipe._proto import caffe_pb2
from tests._helpers import key, rows_written, write_lmdb

DATA = Path(__file__).parent / "data"

jpegwindow: Any = pytest.importorskip("blobpipe._io._jpegwindow")

SAMPLINGS = {
    "4:4:4": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444,
    "4:2:2": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422,
    "4:2:0": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420,
    "4:4:0": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_440,
    "4:1:1": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_411,
}


def jpeg(
    pixels: np.ndarray,
    quality: int = 90,
    sampling: str = "4:2:0",
    progressive: bool = False,
    restart: int = 0,
) -> bytes:
    params = [
        cv2.IMWRITE_JPEG_QUALITY, quality,
        cv2.IMWRITE_JPEG_SAMPLING_FACTOR, SAMPLINGS[sampling],
        cv2.IMWRITE_JPEG_PROGRESSIVE, int(progressive),
        cv2.IMWRITE_JPEG_RST_INTERVAL, restart,
    ]  # fmt: skip
    ok, buf = cv2.imencode(".jpg", pixels, params)
    assert ok
    return buf.tobytes()


def photo(seed: int, h: int, w: int) -> np.ndarray:
    """Smooth content with edges and noise: chroma that upsampling must get right."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([np.sin(x / (3 + c * 5) + y / (7 + c)) * 100 + 128 for c in range(3)], axis=-1)
    base[(x // 13 + y // 11) % 2 == 0] += 40
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def full(data: bytes, flag: int) -> np.ndarray:
    img = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
    assert img is not None
    return img


def window_of(data: bytes, flag: int, win: tuple[int, int, int, int]) -> tuple[bool, np.ndarray]:
    """(whether the window alone was decoded, the window's pixels)."""
    used: list[bool] = []
    real = jpegwindow.decode_window

    def spy(*args: Any) -> bool:
        used.append(real(*args))
        return used[-1]

    jpegwindow.decode_window = spy
    try:
        got = decode_window(data, flag, lambda h, w: win)
    finally:
        jpegwindow.decode_window = real
    assert isinstance(got, np.ndarray)
    top, left, height, width = win
    return bool(used and used[-1]), got[top : top + height, left : left + width]


def caffe_jpegs() -> list[bytes]:
    with blobpipe.LmdbReader(DATA / "caffe" / "lmdb" / "encoded_jpg") as reader:
        return [bytes(parse_datum(reader.get(k)).data or b"") for k in reader]


def test_this_installation_decodes_windows() -> None:
    assert blobpipe.jpeg_window_decoding()
    assert jpegwindow.LIBJPEG_TURBO_VERSION_NUMBER >= 1005000  # jpeg_crop_scanline


def test_caffe_reference_jpegs_every_window_position() -> None:
    """Caffe's own encoded LMDB: windows at the corners, the centre, and odd places."""
    for i, data in enumerate(caffe_jpegs()):
        want = full(data, 1)
        h, w = want.shape[:2]
        for size in {min(h, w) // 2, min(h, w) - 1, 7}:
            if not 0 < size < min(h, w):
                continue
            spots = [(0, 0), (h - size, w - size), ((h - size) // 2, (w - size) // 2)]
            spots.append(((i * 7) % (h - size + 1), (i * 13) % (w - size + 1)))
            for top, left in spots:
                for flag in (1, -1):
                    used, got = window_of(data, flag, (top, left, size, size))
                    assert used, (i, top, left, size)
                    ref = full(data, flag)[top : top + size, left : left + size]
                    assert np.array_equal(got, ref), (i, flag, top, left, size)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    h=st.integers(1, 160),
    w=st.integers(1, 160),
    quality=st.integers(5, 100),
    sampling=st.sampled_from(sorted(SAMPLINGS)),
    progressive=st.booleans(),
    restart=st.sampled_from([0, 0, 1, 3, 17]),
    frac=st.tuples(*[st.floats(0, 1)] * 4),
)
def test_fuzzed_jpegs_match_the_whole_decode(
    seed: int,
    h: int,
    w: int,
    quality: int,
    sampling: str,
    progressive: bool,
    restart: int,
    frac: tuple[float, float, float, float],
) -> None:
    data = jpeg(photo(seed, h, w), quality, sampling, progressive, restart)
    height = 1 + int(frac[0] * (h - 1))
    width = 1 + int(frac[1] * (w - 1))
    top = int(frac[2] * (h - height))
    left = int(frac[3] * (w - width))
    used, got = window_of(data, 1, (top, left, height, width))
    want = full(data, 1)[top : top + height, left : left + width]
    assert np.array_equal(got, want)
    assert used or height * width == h * w  # the whole image is decoded whole


def exif(orientation: int) -> bytes:
    """An APP1 Exif segment holding one orientation entry (big-endian TIFF)."""
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8) + struct.pack(">H", 1)
    tiff += struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    body = b"Exif\x00\x00" + tiff
    return b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body


def with_segment(data: bytes, segment: bytes) -> bytes:
    return data[:2] + segment + data[2:]


def test_what_cannot_be_promised_is_decoded_whole() -> None:
    """CMYK, gray, EXIF-rotated, truncated and damaged JPEGs, and other formats, go to the
    whole-image decode: the same result as decode_image, whatever it is."""
    pix = photo(1, 64, 80)
    base = jpeg(pix)
    gray = jpeg(cv2.cvtColor(pix, cv2.COLOR_BGR2GRAY))
    damaged = bytearray(base)
    damaged[len(base) // 2 : len(base) // 2 + 40] = b"\x00" * 40
    cases = {
        "cmyk": (DATA / "jpeg" / "cmyk.jpg").read_bytes(),
        "gray": gray,
        "exif rotated": with_segment(base, exif(6)),
        "truncated": base[: len(base) * 2 // 3],
        "damaged": bytes(damaged),
        "png": cv2.imencode(".png", pix)[1].tobytes(),
        "not an image": b"\xff\xd8\xff\xe0" + b"\x00" * 50,
    }
    win = (8, 8, 32, 32)
    for name, data in cases.items():
        out = np.zeros(64 * 80 * 3, np.uint8)
        if name in ("gray", "exif rotated", "truncated"):
            assert jpegwindow.decode_window(data, out, *win) is False, name
        if name == "cmyk":  # 7×9, 4 components: refused though size and window fit
            small = np.zeros(7 * 9 * 3, np.uint8)
            assert jpegwindow.decode_window(data, small, 1, 1, 4, 4) is False
        for flag in (1, -1, 0):
            got = decode_window(data, flag, lambda h, w: win)
            want = decode_image(data, flag)
            if isinstance(want, Undecodable):
                assert got == want, name
            else:  # the window is what is asked for
                assert isinstance(got, np.ndarray) and got.shape == want.shape, (name, flag)
                assert np.array_equal(got[8:40, 8:40], want[8:40, 8:40]), (name, flag)
    # an EXIF segment that says "upright" keeps the window decode
    used, got = window_of(with_segment(base, exif(1)), 1, win)
    assert used and np.array_equal(got, full(base, 1)[8:40, 8:40])


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    progressive=st.booleans(),
    restart=st.sampled_from([0, 2]),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=4),
    frac=st.tuples(*[st.floats(0, 1)] * 4),
)
def test_damaged_jpegs_give_what_the_whole_decode_gives(
    seed: int,
    progressive: bool,
    restart: int,
    flips: list[tuple[float, int]],
    frac: tuple[float, float, float, float],
) -> None:
    """Bytes overwritten anywhere (headers, entropy data, markers): the window holds
    the whole decode's pixels, or both say the image cannot be had."""
    data = bytearray(jpeg(photo(seed, 48, 56), 60, "4:2:0", progressive, restart))
    for where, value in flips:
        data[2 + int(where * (len(data) - 4))] = value
    height, width = 1 + int(frac[0] * 47), 1 + int(frac[1] * 55)
    top, left = int(frac[2] * (48 - height)), int(frac[3] * (56 - width))
    got = decode_window(bytes(data), 1, lambda h, w: (top, left, height, width))
    want = decode_image(bytes(data), 1)
    if isinstance(want, Undecodable) or isinstance(got, Undecodable):
        assert got == want
    else:
        assert got.shape == want.shape
        # (where a flip changed the image's size in its header, the same window of it)
        window = (slice(top, top + height), slice(left, left + width))
        assert np.array_equal(got[window], want[window])


def test_bad_arguments_never_write_out_of_bounds() -> None:
    data = jpeg(photo(2, 40, 50))
    out = np.zeros(40 * 50 * 3, np.uint8)
    for win in [(-1, 0, 8, 8), (0, 0, 41, 8), (35, 0, 8, 8), (0, 45, 8, 8), (0, 0, 0, 8)]:
        assert jpegwindow.decode_window(data, out, *win) is False, win
    assert jpegwindow.decode_window(data, np.zeros(40 * 50 * 3 - 3, np.uint8), 0, 0, 8, 8) is False
    assert not out.any()
    with pytest.raises(TypeError):
        jpegwindow.decode_window(data, b"read-only", 0, 0, 8, 8)


@pytest.mark.parametrize("phase", ["train", "test"])
def test_batches_are_the_same_with_and_without_window_decoding(
    tmp_path: Path, phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cropped batch over JPEG records of many sizes (some gray, one rotated by EXIF)
    is the same whether windows are decoded (in one call for the batch, or alone) or
    images whole; and windows are decoded."""
    records = []
    for i in range(24):
        pix = photo(i, 40 + (i * 7) % 30, 44 + (i * 5) % 30)
        data = jpeg(pix, 70 + i, sorted(SAMPLINGS)[i % 5], progressive=i % 3 == 0)
        if i == 5:
            data = with_segment(data, exif(8))
        if i == 9:
            data = jpeg(cv2.cvtColor(pix, cv2.COLOR_BGR2GRAY))
        records.append((key(i), blobpipe.encode_encoded_datum(data, i % 4)))
    db = tmp_path / "db"
    write_lmdb(db, records)
    transform = blobpipe.Transform(
        crop_size=32, mirror=phase == "train", scale=0.5, force_color=True
    )

    def epoch() -> list[np.ndarray]:
        out = []
        with blobpipe.Batches(db, 8, transform=transform, phase=phase, seed=7) as batches:
            while (plan := batches.next_plan()) is not None and len(out) < 3:
                data = np.empty(plan.data_shape, plan.dtype)
                batches.fill(plan, data, np.empty(8, np.float32))
                out.append(data)
        return out

    calls: list[bool] = []
    real = jpegwindow.decode_window
    monkeypatch.setattr(jpegwindow, "decode_window", lambda *a: calls.append(real(*a)) or calls[-1])
    written = rows_written(monkeypatch, jpegwindow)
    windowed = epoch()
    # every colour record but the rotated one and each batch's first, in one call
    assert sum(written) >= 19
    assert sum(calls) <= 1  # the rotated one's window: refused
    monkeypatch.setattr(_image, "_jpegwindow", None)
    whole = epoch()
    assert len(windowed) == 3
    for a, b in zip(windowed, whole, strict=True):
        assert np.array_equal(a, b)


def test_a_large_image_does_not_stay_in_the_threads_block() -> None:
    """The per-thread block keeps images up to 32 MiB; a larger one's block goes with it."""
    small = jpeg(photo(3, 40, 40))
    used, _ = window_of(small, 1, (4, 4, 16, 16))
    assert used
    kept = _image._scratch.block
    big = jpeg(np.full((3400, 3400, 3), 90, np.uint8))  # 34.7 MB decoded
    used, got = window_of(big, 1, (1000, 2000, 64, 64))
    assert used and (got == full(big, 1)[1000:1064, 2000:2064]).all()
    assert _image._scratch.block is kept


# -- a batch's JPEGs in one call: decode_rows ------------------------------------------------


def reference_row(
    img: np.ndarray,
    h_off: int,
    w_off: int,
    crop: int,
    flip: bool,
    mean: np.ndarray | None,
    scale: float,
    dtype: str,
    nhwc: bool,
) -> np.ndarray:
    """Caffe's transform of one decoded (H, W, 3) image, written out step by step."""
    h, w = img.shape[:2]
    ch, cw = (crop, crop) if crop else (h, w)
    chw = img.transpose(2, 0, 1)[:, h_off : h_off + ch, w_off : w_off + cw]
    if dtype == "uint8":
        row = chw.copy()
    else:
        x = chw.astype(np.float32)
        if mean is not None:
            m = mean if mean.ndim == 1 else mean[:, h_off : h_off + ch, w_off : w_off + cw]
            x = x - (m.reshape(3, 1, 1) if m.ndim == 1 else m)
        row = x * np.float32(scale) if scale != 1 else x
    if flip:
        row = row[:, :, ::-1]
    return np.ascontiguousarray(row.transpose(1, 2, 0) if nhwc else row)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    h=st.integers(1, 72),
    w=st.integers(1, 72),
    sampling=st.sampled_from(sorted(SAMPLINGS)),
    progressive=st.booleans(),
    restart=st.sampled_from([0, 0, 2]),
    crop_frac=st.floats(0, 1),
    mean=st.sampled_from(["none", "values", "file"]),
    scale=st.sampled_from([1.0, 0.00390625, 0.017]),
    dtype=st.sampled_from(["float32", "uint8"]),
    nhwc=st.booleans(),
    split=st.integers(0, 5),
    data=st.data(),
)
def test_decode_rows_equal_the_whole_decode_then_the_transform(
    seed: int,
    h: int,
    w: int,
    sampling: str,
    progressive: bool,
    restart: int,
    crop_frac: float,
    mean: str,
    scale: float,
    dtype: str,
    nhwc: bool,
    split: int,
    data: Any,
) -> None:
    """Every row written equals OpenCV's whole decode, cropped, flipped, minus the mean,
    scaled; rows left alone (None, another size) are not written; the outputs may be
    one array or consecutive parts."""
    n = 5
    crop = int(crop_frac * min(h, w))
    ch, cw = (crop, crop) if crop else (h, w)
    images: list[bytes | None] = [
        jpeg(photo(seed + i, h, w), 50 + 10 * i, sampling, progressive, restart) for i in range(n)
    ]
    images[1] = None  # left to the caller
    images[3] = jpeg(photo(seed, h + 1, w), 90, sampling)  # another size
    h_off = np.array([data.draw(st.integers(0, h - ch)) for _ in range(n)], np.intp)
    w_off = np.array([data.draw(st.integers(0, w - cw)) for _ in range(n)], np.intp)
    flips = np.array([data.draw(st.booleans()) for _ in range(n)], np.bool_)
    rng = np.random.default_rng(seed)
    means = {
        "none": None,
        "values": np.array([104.0, 117.0, 123.5], np.float32),
        "file": rng.uniform(0, 255, (3, h, w)).astype(np.float32),
    }
    m = means[mean] if dtype == "float32" else None
    row_shape = (ch, cw, 3) if nhwc else (3, ch, cw)
    out = np.full((n, *row_shape), 7, np.dtype(dtype))
    parts: Any = out if split in (0, n) else (out[:split], out[split:])
    status = jpegwindow.decode_rows(
        images, (3, h, w), h_off, w_off, flips, m, scale, parts, crop, int(nhwc)
    )
    assert list(status) == [1, 0, 1, 0, 1]
    for i in (0, 2, 4):
        want = reference_row(
            full(images[i], 1), int(h_off[i]), int(w_off[i]), crop, bool(flips[i]), m, scale,
            dtype, nhwc,
        )  # fmt: skip
        assert np.array_equal(out[i], want), i
    assert (out[1] == 7).all() and (out[3] == 7).all()


def test_decode_rows_leave_what_cannot_be_promised() -> None:
    """Gray, CMYK, EXIF-rotated and truncated JPEGs, PNGs and bytes that are no image
    are left to the caller (status 0, their rows untouched); damaged entropy data is
    left too, unless it decodes without a warning to OpenCV's pixels."""
    pix = photo(4, 24, 32)
    base = jpeg(pix)
    damaged = bytearray(base)
    damaged[len(base) // 2 : len(base) // 2 + 40] = b"\x00" * 40
    images = [
        base,
        jpeg(cv2.cvtColor(pix, cv2.COLOR_BGR2GRAY)),
        with_segment(base, exif(3)),
        base[: len(base) * 2 // 3],
        bytes(damaged),
        cv2.imencode(".png", pix)[1].tobytes(),
        b"\xff\xd8\xff\xe0" + b"\x00" * 50,
        b"",
        (DATA / "jpeg" / "cmyk.jpg").read_bytes(),
    ]
    n = len(images)
    zeros = np.zeros(n, np.intp)
    out = np.full((n, 3, 24, 32), -1, np.float32)
    status = jpegwindow.decode_rows(
        images, (3, 24, 32), zeros, zeros, np.zeros(n, np.bool_), None, 1.0, out, 0, 0
    )
    assert list(status[:4]) == [1, 0, 0, 0] and list(status[5:]) == [0] * (n - 5)
    assert np.array_equal(out[0], full(base, 1).transpose(2, 0, 1))
    if status[4]:  # damage libjpeg does not notice: the same pixels as OpenCV's decode
        assert np.array_equal(out[4], full(bytes(damaged), 1).transpose(2, 0, 1))
    assert (out[1:4] == -1).all() and (out[5:] == -1).all()


def test_decode_rows_check_their_arguments() -> None:
    data = jpeg(photo(5, 20, 24))
    ok = np.zeros(2, np.intp)
    flips = np.zeros(2, np.bool_)
    out = np.zeros((2, 3, 20, 24), np.float32)
    call = jpegwindow.decode_rows
    with pytest.raises(ValueError, match="one per image"):
        call([data, data], (3, 20, 24), np.zeros(3, np.intp), ok, flips, None, 1.0, out, 0, 0)
    with pytest.raises(ValueError, match=r"\(3, H, W\)"):
        call([data, data], (1, 20, 24), ok, ok, flips, None, 1.0, np.zeros((2, 1, 20, 24)), 0, 0)
    small = np.zeros((2, 3, 16, 16), np.float32)
    with pytest.raises(ValueError, match="crop does not fit"):
        call([data, data], (3, 20, 24), ok + 5, ok, flips, None, 1.0, small, 16, 0)
    with pytest.raises(ValueError, match="n rows"):
        call([data, data], (3, 20, 24), ok, ok, flips, None, 1.0, out[:1], 0, 0)
    with pytest.raises(ValueError, match="mean"):
        call([data, data], (3, 20, 24), ok, ok, flips, np.zeros(2, np.float32), 1.0, out, 0, 0)
    with pytest.raises(TypeError):
        call([data, data], (3, 20, 24), ok, ok, flips, None, 1.0, out.tobytes(), 0, 0)
    with pytest.raises(TypeError):
        call([data, 3], (3, 20, 24), ok, ok, flips, None, 1.0, out, 0, 0)
    assert not out.any()


@pytest.mark.parametrize(
    ("phase", "crop", "dtype", "layout"),
    [
        ("train", 32, "float32", "NCHW"),
        ("test", 0, "float32", "NHWC"),
        ("train", 0, "uint8", "NCHW"),
    ],
)
def test_batches_of_one_image_size_are_decoded_in_one_call_and_are_the_same(
    tmp_path: Path, phase: str, crop: int, dtype: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JPEGs of one size (with a gray one, an EXIF-rotated one, one of another size
    and a PNG among them): the batches, and the crops and flips they report, are
    those of OpenCV's whole decode, and the ordinary colour JPEGs go through
    decode_rows (the others row by row)."""
    records = []
    for i in range(24):
        pix = photo(i, 40, 48)
        data = jpeg(pix, 60 + i, sorted(SAMPLINGS)[i % 5], progressive=i % 4 == 1)
        if i == 5:
            data = with_segment(data, exif(3))  # turned half round: the same size
        if i == 9:
            data = jpeg(cv2.cvtColor(pix, cv2.COLOR_BGR2GRAY))
        if i == 14:
            data = jpeg(photo(i, 48, 40))  # another size: an error without a crop
        if i == 17:
            data = cv2.imencode(".png", pix)[1].tobytes()
        records.append((key(i), blobpipe.encode_encoded_datum(data, i % 4)))
    db = tmp_path / "db"
    write_lmdb(db, records)
    mean_file = tmp_path / "mean.binaryproto"
    mean = np.random.default_rng(0).uniform(0, 255, (3, 40, 48)).astype(np.float32)
    proto = caffe_pb2.BlobProto(num=1, channels=3, height=40, width=48)
    proto.data.extend(mean.reshape(-1).tolist())
    mean_file.write_bytes(proto.SerializeToString())
    transform = blobpipe.Transform(
        crop_size=crop, mirror=phase == "train", scale=0.25, force_color=True,
        mean_file=mean_file if dtype == "float32" else None, dtype=dtype, layout=layout,
    )  # fmt: skip

    def epoch() -> list[np.ndarray | str]:
        """Each batch's data and its crops and flips, or its error."""
        out: list[np.ndarray | str] = []
        with blobpipe.Batches(db, 8, transform=transform, phase=phase, seed=3) as batches:
            while (plan := batches.next_plan()) is not None and len(out) < 6:
                data = np.empty(plan.data_shape, plan.dtype)
                geometry = Geometry.zeros(8)
                try:
                    batches.fill(plan, data, np.empty(8, np.float32), geometry_out=geometry)
                except blobpipe.DataError as exc:
                    out.append(str(exc))
                else:
                    out += [data, np.stack(geometry.arrays())]
        return out

    written = rows_written(monkeypatch, jpegwindow)
    together = epoch()
    assert sum(written) >= 24 - 3 - 4 - 1  # all but batches' firsts and the odd ones
    monkeypatch.setattr(_image, "_jpegwindow", None)
    whole = epoch()
    assert len(together) >= 3
    for a, b in zip(together, whole, strict=True):
        if isinstance(a, str) or isinstance(b, str):
            assert a == b  # the same error, naming the record of another size
        else:
            assert np.array_equal(a, b)
    if crop == 0:
        assert any(isinstance(a, str) and "00000014" in a for a in together), together


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    progressive=st.booleans(),
    restart=st.sampled_from([0, 2]),
    crop=st.sampled_from([0, 20]),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_decode_rows_of_damaged_jpegs_are_opencvs_pixels_or_left(
    seed: int, progressive: bool, restart: int, crop: int, flips: list[tuple[float, int]]
) -> None:
    """Bytes overwritten anywhere, the whole image or a crop's window: a row written
    holds what OpenCV's decode then the transform gives; an image OpenCV cannot decode
    (or decodes to another size) is never written."""
    data = bytearray(jpeg(photo(seed, 32, 40), 60, "4:2:0", progressive, restart))
    for where, value in flips:
        data[2 + int(where * (len(data) - 4))] = value
    image = bytes(data)
    ch, cw = (crop, crop) if crop else (32, 40)
    out = np.full((1, 3, ch, cw), -1, np.float32)
    h_off = np.array([5 if crop else 0], np.intp)
    w_off = np.array([9 if crop else 0], np.intp)
    status = jpegwindow.decode_rows(
        [image], (3, 32, 40), h_off, w_off, np.zeros(1, np.bool_), None, 1.0, out, crop, 0
    )
    want = cv2.imdecode(np.frombuffer(image, np.uint8), cv2.IMREAD_COLOR)
    if status[0]:
        assert want is not None and want.shape == (32, 40, 3)
        ref = reference_row(want, int(h_off[0]), int(w_off[0]), crop, False, None, 1.0,
                            "float32", False)  # fmt: skip
        assert np.array_equal(out[0], ref)
    else:
        assert (out[0] == -1).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    h=st.integers(1, 300),
    w=st.integers(1, 300),
    sampling=st.sampled_from(sorted(SAMPLINGS)),
    progressive=st.booleans(),
    flag=st.sampled_from([1, -1]),
)
def test_decode_whole_is_decode_image(
    seed: int, h: int, w: int, sampling: str, progressive: bool, flag: int
) -> None:
    """The whole image through libjpeg-turbo: OpenCV's pixels, also for an image larger
    than this thread's block (which grows), and the same refusal past max_pixels."""
    _image._scratch.block = np.empty(2, np.uint8)  # too small for any image (3 bytes a pixel)
    data = jpeg(photo(seed, h, w), 80, sampling, progressive)
    statuses: list[int] = []
    real = jpegwindow.decode_whole

    def spy(*args: Any) -> tuple[int, int, int]:
        result: tuple[int, int, int] = real(*args)
        statuses.append(result[0])
        return result

    jpegwindow.decode_whole = spy
    try:
        got = _image.decode_whole(data, flag)
    finally:
        jpegwindow.decode_whole = real
    assert statuses == [2, 1]  # the block grown to the image's size, then decoded there
    assert isinstance(got, np.ndarray)
    assert np.array_equal(got, full(data, flag))
    assert _image.decode_whole(data, flag, max_pixels=h * w - 1) == decode_image(
        data, flag, max_pixels=h * w - 1
    )


def test_decode_whole_leaves_what_it_cannot_promise_to_opencv() -> None:
    pix = photo(6, 20, 24)
    gray = jpeg(cv2.cvtColor(pix, cv2.COLOR_BGR2GRAY))
    rotated = with_segment(jpeg(pix), exif(6))
    png = cv2.imencode(".png", pix)[1].tobytes()
    for data in (gray, rotated, png, jpeg(pix)[:-40]):
        for flag in (1, -1, 0):
            got, want = _image.decode_whole(data, flag), decode_image(data, flag)
            if isinstance(want, Undecodable):
                assert got == want
            else:
                assert isinstance(got, np.ndarray) and np.array_equal(got, want)
