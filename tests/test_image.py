"""JPEG decoding through libjpeg-turbo (simplejpeg): OpenCV's pixels, or OpenCV itself.

Every image blobpipe decodes must equal ``cv2.imdecode`` with Caffe's flag; the
fast decoder is only a shortcut, taken where it is exact and checked in-process.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
import simplejpeg

import blobpipe
from blobpipe._errors import BlobpipeError, DataError
from blobpipe._io import _image
from blobpipe._io._batches import Batches
from blobpipe._io._datum import parse_datum
from blobpipe._io._image import JpegFrame, decode_jpeg, jpeg_channels, jpeg_frame
from blobpipe._io._transform import Transform
from tests._helpers import encoded_db, image, key, write_lmdb
from tests.test_index import assert_same, epochs

DATA = Path(__file__).parent / "data"
FLAGS = (1, 0, -1)  # IMREAD_COLOR, IMREAD_GRAYSCALE, IMREAD_UNCHANGED


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The fast decoder starts over (self-test, sample) in each test and after it."""
    monkeypatch.delenv("BLOBPIPE_JPEG_DECODER", raising=False)
    _image._reset()
    yield
    _image._reset()


class Counting:
    """simplejpeg.decode_jpeg, counted, optionally altering what it returns."""

    def __init__(self, alter: Callable[[bytes], bool] = lambda data: False) -> None:
        self.calls = 0
        self.alter = alter
        self.real = simplejpeg.decode_jpeg

    def __call__(self, data: bytes, **kwargs: Any) -> np.ndarray:
        self.calls += 1
        img = self.real(data, **kwargs)
        if self.alter(data):
            img[0, 0, 0] ^= 1
        return img


def opencv(data: bytes, flag: int) -> Any:
    """OpenCV's answer: an array, or None when it cannot decode."""
    return cv2.imdecode(np.frombuffer(data, np.uint8), flag)


def caffe_jpegs() -> list[bytes]:
    """The JPEG bytes of Caffe's own encoded LMDB (convert_imageset --encoded)."""
    with blobpipe.LmdbReader(DATA / "caffe" / "lmdb" / "encoded_jpg") as reader:
        out = [bytes(parse_datum(reader.get(k)).data or b"") for k in reader]
    assert out and all(x.startswith(b"\xff\xd8") for x in out)
    return out


def generated_jpegs() -> list[bytes]:
    out = [data for _, data in _image._test_images()]
    for i, (h, w) in enumerate([(1, 1), (8, 8), (16, 9), (33, 65), (64, 64), (5, 200)]):
        pix = image(i, (3, h, w)).transpose(1, 2, 0)
        for quality in (30, 90, 100):
            ok, buf = cv2.imencode(".jpg", pix, [cv2.IMWRITE_JPEG_QUALITY, quality])
            assert ok
            out.append(buf.tobytes())
    return out


def with_exif_orientation(jpeg: bytes, orientation: int) -> bytes:
    """``jpeg`` with an APP1 EXIF block whose Orientation tag is ``orientation``."""
    ifd = struct.pack(">H", 1) + struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0)
    app1 = b"Exif\x00\x00" + b"MM\x00\x2a\x00\x00\x00\x08" + ifd + b"\x00\x00\x00\x00"
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + jpeg[2:]


@pytest.mark.usefixtures("fresh")
def test_fast_decoding_equals_opencv() -> None:
    jpegs = caffe_jpegs() + generated_jpegs()
    for data in jpegs:
        for flag in FLAGS:
            want = opencv(data, flag)
            got = decode_jpeg(data, flag)
            assert got is not None, (len(data), flag)  # taken: every one is a plain JPEG
            assert got.dtype == np.uint8 and got.shape == want.shape
            assert np.array_equal(got, want)
    assert _image._fast.decode is not None  # nothing differed: still on


@pytest.mark.usefixtures("fresh")
def test_decoding_datums_equals_opencv_with_caffes_flags() -> None:
    for data in caffe_jpegs()[:10] + generated_jpegs()[:10]:
        datum = blobpipe.encode_encoded_datum(data, 3)
        for flags, flag in (({"force_color": True}, 1), ({"force_gray": True}, 0), ({}, -1)):
            chw, label = blobpipe.decode_datum(datum, **flags)
            want = opencv(data, flag)
            want = want[np.newaxis] if want.ndim == 2 else want.transpose(2, 0, 1)
            assert label == 3 and np.array_equal(chw, want)


@pytest.mark.usefixtures("fresh")
@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_left_to_opencv(orientation: int) -> None:
    plain = generated_jpegs()[-2]  # 200×5: a rotation shows in the shape
    data = with_exif_orientation(plain, orientation)
    assert opencv(data, 1).shape != opencv(plain, 1).shape or orientation == 3
    assert not np.array_equal(opencv(data, 1), opencv(plain, 1))  # OpenCV rotates
    for flag in (1, 0):
        assert decode_jpeg(data, flag) is None
    assert np.array_equal(decode_jpeg(data, -1), opencv(data, -1))  # UNCHANGED: no rotation
    chw, _ = blobpipe.decode_datum(blobpipe.encode_encoded_datum(data, 0), force_color=True)
    assert np.array_equal(chw, opencv(data, 1).transpose(2, 0, 1))


@pytest.mark.usefixtures("fresh")
def test_cmyk_and_other_frames_are_left_to_opencv() -> None:
    cmyk = (DATA / "jpeg" / "cmyk.jpg").read_bytes()
    frame = jpeg_frame(cmyk)
    assert frame is not None and frame.components == 4
    for flag in FLAGS:
        assert decode_jpeg(cmyk, flag) is None
    for flags, flag in (({"force_color": True}, 1), ({"force_gray": True}, 0), ({}, -1)):
        chw, _ = blobpipe.decode_datum(blobpipe.encode_encoded_datum(cmyk, 0), **flags)
        want = opencv(cmyk, flag)
        assert np.array_equal(chw, want[np.newaxis] if want.ndim == 2 else want.transpose(2, 0, 1))
    base = JpegFrame(0xC0, 8, 10, 10, 3)
    assert [jpeg_channels(f, base) for f in FLAGS] == [3, 1, 3]
    assert [jpeg_channels(f, base._replace(components=1)) for f in FLAGS] == [3, 1, 1]
    assert jpeg_channels(-1, base._replace(marker=0xC2)) == 3  # progressive
    for other in (
        base._replace(components=4),
        base._replace(components=2),
        base._replace(precision=12),
        base._replace(marker=0xC3),  # lossless
        base._replace(marker=0xC9),  # arithmetic
        base._replace(marker=0xC5),  # hierarchical
    ):
        assert [jpeg_channels(f, other) for f in FLAGS] == [0, 0, 0]


@pytest.mark.usefixtures("fresh")
def test_broken_jpegs_get_opencvs_answer() -> None:
    good = generated_jpegs()[-4]
    n = len(good)
    cases = {
        "truncated header": good[:40],
        "truncated data": good[: n // 2],
        "no EOI": good[:-2],
        "garbage in scan": good[: n // 2] + bytes(range(7, 40)) + good[n // 2 + 33 :],
        "trailing bytes": good + b"\x00" * 9,
        "SOI only": b"\xff\xd8",
    }
    for name, data in cases.items():
        for flags, flag in (({"force_color": True}, 1), ({}, -1)):
            want = opencv(data, flag)
            got = decode_jpeg(data, flag)
            if got is not None:  # taken only when it decodes exactly as OpenCV does
                assert want is not None and np.array_equal(got, want), name
            datum = blobpipe.encode_encoded_datum(data, 0)
            if want is None:
                with pytest.raises(DataError, match="cannot decode"):
                    blobpipe.decode_datum(datum, **flags)
            else:
                chw, _ = blobpipe.decode_datum(datum, **flags)
                assert np.array_equal(chw, want.transpose(2, 0, 1)), name


def test_a_decoder_that_differs_is_turned_off_by_the_self_test(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = Counting(alter=lambda data: True)
    monkeypatch.setattr(simplejpeg, "decode_jpeg", fake)
    data = caffe_jpegs()[0]
    with pytest.warns(RuntimeWarning, match="differs from this OpenCV"):
        assert decode_jpeg(data, 1) is None
    assert decode_jpeg(data, 1) is None  # off for the process, no second warning
    chw, _ = blobpipe.decode_datum(blobpipe.encode_encoded_datum(data, 0))
    assert np.array_equal(chw, opencv(data, -1).transpose(2, 0, 1))
    assert fake.calls == 1  # the first test image, then never again


def test_a_difference_in_the_sample_turns_it_off(
    tmp_path: Path, fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # right on the built-in test images, wrong on the dataset's: the first
    # images decoded are compared with OpenCV, and the batches stay OpenCV's
    known = {data for _, data in _image._test_images()}
    fake = Counting(alter=lambda data: data not in known)
    monkeypatch.setattr(simplejpeg, "decode_jpeg", fake)
    path = encoded_db(tmp_path / "db", 40, ".jpg")
    kwargs: dict[str, Any] = {"transform": Transform(dtype="uint8"), "mode": "epoch"}
    with pytest.warns(RuntimeWarning, match="decodes differently"), Batches(path, 8, **kwargs) as b:
        got = epochs(b, 2)
    monkeypatch.setenv("BLOBPIPE_JPEG_DECODER", "opencv")
    _image._reset()
    with Batches(path, 8, **kwargs) as b:
        want = epochs(b, 2)
    for e in range(2):
        assert_same(got[e], want[e])
    assert _image._fast.decode is None


@pytest.mark.parametrize("config", ["float32", "uint8", "mean_crop", "gray", "color"])
def test_batches_decode_with_it_and_equal_opencv(
    tmp_path: Path, fresh: None, monkeypatch: pytest.MonkeyPatch, config: str
) -> None:
    transforms = {
        "float32": Transform(scale=1 / 256),
        "uint8": Transform(dtype="uint8"),
        "mean_crop": Transform(mean_value=(104, 117, 123), crop_size=8),
        "gray": Transform(force_gray=True),
        "color": Transform(force_color=True),
    }

    def encode(i: int) -> bytes:  # gray and color images, 4:2:0 and 4:4:4
        pix = image(i, (3, 10, 12)).transpose(1, 2, 0)
        pix = pix[..., 0] if i % 3 == 0 else np.ascontiguousarray(pix)
        params = [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444]
        ok, buf = cv2.imencode(".jpg", pix, params if i % 2 else [])
        assert ok
        return blobpipe.encode_encoded_datum(buf.tobytes(), i)

    items = [(key(i), encode(i)) for i in range(48)]
    if config in ("gray", "color"):
        path = write_lmdb(tmp_path / "db", items)
    else:  # without a force flag a batch holds one shape: color images only
        path = write_lmdb(tmp_path / "db", [(k, v) for i, (k, v) in enumerate(items) if i % 3])
    kwargs: dict[str, Any] = {"transform": transforms[config], "mode": "epoch", "phase": "test"}
    fake = Counting()
    monkeypatch.setattr(simplejpeg, "decode_jpeg", fake)
    with Batches(path, 8, **kwargs) as b:
        first = epochs(b, 1)
        calls_first = fake.calls
        later = epochs(b, 2)
    # the first reads (checked) and the index both decode with simplejpeg
    assert calls_first > 0 and fake.calls > calls_first + 16
    monkeypatch.setenv("BLOBPIPE_JPEG_DECODER", "opencv")
    _image._reset()
    with Batches(path, 8, **kwargs) as b:
        want = epochs(b, 3)
    for got, exp in zip(first + later, want, strict=True):
        assert_same(got, exp)


def test_the_environment_chooses(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    data = caffe_jpegs()[0]
    fake = Counting()
    monkeypatch.setattr(simplejpeg, "decode_jpeg", fake)
    monkeypatch.setenv("BLOBPIPE_JPEG_DECODER", "opencv")
    assert decode_jpeg(data, 1) is None
    assert fake.calls == 0
    monkeypatch.setenv("BLOBPIPE_JPEG_DECODER", "turbo")
    _image._reset()
    with pytest.raises(BlobpipeError, match=r"BLOBPIPE_JPEG_DECODER='turbo'.*'opencv'"):
        decode_jpeg(data, 1)
    monkeypatch.setenv("BLOBPIPE_JPEG_DECODER", "auto")
    _image._reset()
    assert np.array_equal(decode_jpeg(data, 1), opencv(data, 1))


def test_without_simplejpeg_opencv_decodes(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "simplejpeg", None)  # import fails
    data = caffe_jpegs()[0]
    assert decode_jpeg(data, 1) is None
    chw, _ = blobpipe.decode_datum(blobpipe.encode_encoded_datum(data, 0))
    assert np.array_equal(chw, opencv(data, -1).transpose(2, 0, 1))


@pytest.mark.parametrize("flags", [{}, {"force_color": True}])
def test_only_exact_images_go_to_simplejpeg(
    tmp_path: Path, fresh: None, monkeypatch: pytest.MonkeyPatch, flags: dict[str, bool]
) -> None:
    cmyk = (DATA / "jpeg" / "cmyk.jpg").read_bytes()  # 9×7
    pix = np.ascontiguousarray(image(5, (3, 7, 9)).transpose(1, 2, 0))
    jpeg = cv2.imencode(".jpg", pix)[1].tobytes()
    kinds = {
        "jpeg": (jpeg, 3),
        "exif": (with_exif_orientation(jpeg, 1), 3 if not flags else 0),
        "cmyk": (cmyk, 0),
        "png": (cv2.imencode(".png", pix)[1].tobytes(), 0),
    }
    names = [name for name in kinds for _ in range(4)]
    items = [
        (key(i), blobpipe.encode_encoded_datum(kinds[name][0], i)) for i, name in enumerate(names)
    ]
    path = write_lmdb(tmp_path / "db", items)
    kwargs: dict[str, Any] = {"transform": Transform(**flags), "mode": "epoch", "phase": "test"}
    _image._fast.get()  # started (and self-tested) before counting
    _image._fast.sampled = _image.SAMPLE  # past the sample: one decoder per image
    seen: list[bytes] = []
    real = simplejpeg.decode_jpeg

    def spy(data: bytes, **kwargs: Any) -> np.ndarray:
        seen.append(bytes(data))
        return real(data, **kwargs)

    monkeypatch.setattr(_image._fast, "decode", spy)
    with Batches(path, 4, **kwargs) as b:
        got = epochs(b, 3)
    by_name = {kinds[name][0]: name for name in kinds}
    went = [by_name[data] for data in seen]
    for name, (_, channels) in kinds.items():  # three epochs: 4 records each, 3 times
        assert went.count(name) == (12 if channels else 0), name
    monkeypatch.setenv("BLOBPIPE_JPEG_DECODER", "opencv")
    _image._reset()
    with Batches(path, 4, **kwargs) as b:
        want = epochs(b, 3)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
