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
from blobpipe._io._wire import parse_datum
from tests._helpers import key, write_lmdb

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
    """A cropped batch over JPEG records (some gray, one rotated by EXIF) is the same
    whether windows are decoded alone or images whole; and windows are decoded."""
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
    windowed = epoch()
    assert sum(calls) >= 19  # every colour record but the rotated one and each batch's first
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
