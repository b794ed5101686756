"""A batch's PNGs decoded by libpng and transformed in one call (``_pngrows``).

Every row written must hold exactly what OpenCV's ``cv2.imdecode`` then Caffe's
transform gives; every PNG whose pixels OpenCV might give otherwise (not 8-bit RGB,
interlaced, a tRNS or eXIf chunk, damaged, cut short) is left to the caller.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import blobpipe
from blobpipe._io import _image
from tests._helpers import key, rows_written, write_lmdb

pngrows: Any = pytest.importorskip("blobpipe._io._pngrows")


def photo(seed: int, h: int, w: int, c: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([np.sin(x / (2 + k) + y / (5 + k)) * 90 + 128 for k in range(c)], axis=-1)
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


def png(pixels: np.ndarray, level: int = 3) -> bytes:
    ok, buf = cv2.imencode(".png", pixels, [cv2.IMWRITE_PNG_COMPRESSION, level])
    assert ok
    return buf.tobytes()


def chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def with_chunk(data: bytes, extra: bytes) -> bytes:
    """``extra`` inserted right after the IHDR chunk (8 + 25 bytes in)."""
    return data[:33] + extra + data[33:]


def decode(images: list[Any], h: int, w: int, crop: int = 0, **kw: Any) -> tuple[list[int], Any]:
    n = len(images)
    ch, cw = (crop, crop) if crop else (h, w)
    h_off = np.asarray(kw.get("h_off", np.zeros(n)), np.intp)
    w_off = np.asarray(kw.get("w_off", np.zeros(n)), np.intp)
    flips = np.asarray(kw.get("flips", np.zeros(n)), np.bool_)
    out = np.full((n, 3, ch, cw), -1, np.float32)
    status = pngrows.decode_rows(
        images, (3, h, w), h_off, w_off, flips, kw.get("mean"), kw.get("scale", 1.0), out, crop, 0
    )
    return list(status), out


def transformed(data: bytes, h_off: int, w_off: int, crop: int, flip: bool, scale: float) -> Any:
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    h, w = img.shape[:2]
    ch, cw = (crop, crop) if crop else (h, w)
    x = img.transpose(2, 0, 1)[:, h_off : h_off + ch, w_off : w_off + cw].astype(np.float32)
    x = x * np.float32(scale) if scale != 1 else x
    return x[:, :, ::-1] if flip else x


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    h=st.integers(1, 64),
    w=st.integers(1, 64),
    level=st.integers(0, 9),
    crop_frac=st.floats(0, 1),
    scale=st.sampled_from([1.0, 0.00390625]),
    data=st.data(),
)
def test_rgb_pngs_equal_opencvs_decode_then_the_transform(
    seed: int, h: int, w: int, level: int, crop_frac: float, scale: float, data: Any
) -> None:
    crop = int(crop_frac * min(h, w))
    ch, cw = (crop, crop) if crop else (h, w)
    images = [png(photo(seed + i, h, w), level) for i in range(3)]
    h_off = [data.draw(st.integers(0, h - ch)) for _ in range(3)]
    w_off = [data.draw(st.integers(0, w - cw)) for _ in range(3)]
    flips = [data.draw(st.booleans()) for _ in range(3)]
    status, out = decode(images, h, w, crop, h_off=h_off, w_off=w_off, flips=flips, scale=scale)
    assert status == [1, 1, 1]
    for i in range(3):
        want = transformed(images[i], h_off[i], w_off[i], crop, flips[i], scale)
        assert np.array_equal(out[i], want), i


def test_what_opencv_might_decode_otherwise_is_left() -> None:
    """Gray, RGBA and 16-bit PNGs, an interlaced one, tRNS and eXIf chunks, another
    size, a JPEG, a file cut short or with a CRC that does not match (libpng's errors
    and warnings alike): left (status 0, the row untouched); a text chunk changes
    nothing."""
    pix = photo(1, 12, 16)
    base = png(pix)
    ihdr = bytearray(base[:33])
    ihdr[28] = 1  # the interlace method byte
    ihdr[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr[12:29])))
    cases = {
        "rgb": base,
        "text chunk": with_chunk(base, chunk(b"tEXt", b"Comment\x00made here")),
        "gray": png(cv2.cvtColor(pix, cv2.COLOR_BGR2GRAY)),
        "rgba": png(cv2.cvtColor(pix, cv2.COLOR_BGR2BGRA)),
        "16-bit": png(pix.astype(np.uint16) * 257),
        "interlaced flag": bytes(ihdr) + base[33:],
        "tRNS": with_chunk(base, chunk(b"tRNS", b"\x00\x01\x00\x02\x00\x03")),
        "eXIf": with_chunk(base, chunk(b"eXIf", b"MM\x00\x2a\x00\x00\x00\x08\x00\x00")),
        "another size": png(photo(1, 16, 12)),
        "jpeg": cv2.imencode(".jpg", pix)[1].tobytes(),
        "cut short": base[: len(base) - 20],
        "no end chunk": base[:-12],
        "bad crc": base[:40] + bytes([base[40] ^ 0xFF]) + base[41:],
        # libpng warns and drops the chunk: any warning leaves the row to OpenCV
        "text chunk, bad crc": with_chunk(base, chunk(b"tEXt", b"Comment\x00x")[:-1] + b"\x00"),
        "empty": b"",
    }
    status, out = decode(list(cases.values()), 12, 16)
    got = dict(zip(cases, status, strict=True))
    assert got.pop("rgb") == 1 and got.pop("text chunk") == 1
    assert got == dict.fromkeys(got, 0)
    assert np.array_equal(out[0], pix.transpose(2, 0, 1).astype(np.float32))
    assert np.array_equal(out[1], out[0])
    assert (out[2:] == -1).all()


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_damaged_pngs_are_opencvs_pixels_or_left(seed: int, flips: list[tuple[float, int]]) -> None:
    """Bytes overwritten anywhere: a row written holds OpenCV's pixels of the same
    bytes; a PNG OpenCV cannot decode is never written."""
    data = bytearray(png(photo(seed, 10, 14), 1))
    for where, value in flips:
        data[int(where * (len(data) - 1))] = value
    status, out = decode([bytes(data)], 10, 14)
    want = cv2.imdecode(np.frombuffer(bytes(data), np.uint8), cv2.IMREAD_COLOR)
    if status[0]:
        assert want is not None and want.shape == (10, 14, 3)
        assert np.array_equal(out[0], want.transpose(2, 0, 1).astype(np.float32))
    else:
        assert (out[0] == -1).all()


def test_arguments_are_checked() -> None:
    data = png(photo(2, 8, 8))
    z = np.zeros(2, np.intp)
    out = np.zeros((2, 3, 8, 8), np.float32)
    flips = np.zeros(2, np.bool_)
    with pytest.raises(ValueError, match="one per image"):
        pngrows.decode_rows([data], (3, 8, 8), z, z, flips, None, 1.0, out, 0, 0)
    with pytest.raises(ValueError, match="n rows"):
        pngrows.decode_rows([data, data], (3, 8, 8), z, z, flips, None, 1.0, out[:1], 0, 0)
    with pytest.raises(TypeError):
        pngrows.decode_rows([data, 1.5], (3, 8, 8), z, z, flips, None, 1.0, out, 0, 0)
    assert not out.any()


@pytest.mark.parametrize("crop", [0, 8])
def test_batches_are_the_same_with_and_without_the_png_module(
    tmp_path: Path, crop: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PNG database (a gray one and an RGBA one among them): the batches, crops and
    flips are those of OpenCV's decode, and the RGB PNGs go through decode_rows."""
    records = []
    for i in range(20):
        pix = photo(i, 12, 14)
        data = png(pix, i % 10)
        if i == 6:
            data = png(cv2.cvtColor(pix, cv2.COLOR_BGR2GRAY))
        if i == 11:
            data = png(cv2.cvtColor(pix, cv2.COLOR_BGR2BGRA))
        records.append((key(i), blobpipe.encode_encoded_datum(data, i % 3)))
    db = write_lmdb(tmp_path / "db", records)
    t = blobpipe.Transform(crop_size=crop, mirror=bool(crop), scale=0.5, force_color=True)

    def epoch() -> list[np.ndarray]:
        with blobpipe.Batches(db, 5, transform=t, phase="train", seed=2, mode="epoch") as b:
            return [x.data.copy() for x in b]

    written = rows_written(monkeypatch, pngrows)
    together = epoch()
    assert sum(written) >= 20 - 4 - 2  # all but each batch's first and the two odd ones
    monkeypatch.setattr(_image, "_pngrows", None)
    apart = epoch()
    assert len(together) == 4
    for a, b in zip(together, apart, strict=True):
        assert np.array_equal(a, b)
