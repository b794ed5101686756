"""Decoding encoded images: OpenCV's ``imdecode`` with Caffe's flags, and a size guard.

Every image blobpipe decodes must equal ``cv2.imdecode`` with Caffe's flag, however
it is reached: ``decode_image``, ``decode_datum``, or a batch.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

import blobpipe
from blobpipe._errors import DataError
from blobpipe._io._batches import Batches
from blobpipe._io._image import (
    Undecodable,
    decode_image,
    image_header,
    imread_flag,
    jpeg_frame,
)
from blobpipe._io._imagehead import image_size
from blobpipe._io._transform import Transform
from blobpipe._io._wire import parse_datum
from tests._helpers import epochs, image, key, run_script, write_lmdb
from tests._images import FORMATS, SHAPE, announcing, encoded

DATA = Path(__file__).parent / "data"
FLAGS = (1, 0, -1)  # IMREAD_COLOR, IMREAD_GRAYSCALE, IMREAD_UNCHANGED


def opencv(data: bytes, flag: int) -> Any:
    """OpenCV's answer: an array, or None when it cannot decode."""
    return cv2.imdecode(np.frombuffer(data, np.uint8), flag)


def hwc(img: np.ndarray) -> np.ndarray:
    return img[..., np.newaxis] if img.ndim == 2 else img


def caffe_jpegs() -> list[bytes]:
    """The JPEG bytes of Caffe's own encoded LMDB (convert_imageset --encoded)."""
    with blobpipe.LmdbReader(DATA / "caffe" / "lmdb" / "encoded_jpg") as reader:
        out = [bytes(parse_datum(reader.get(k)).data or b"") for k in reader]
    assert out and all(x.startswith(b"\xff\xd8") for x in out)
    return out


def generated_images() -> list[bytes]:
    """JPEGs of odd sizes, qualities, subsamplings, progressive and gray; PNGs of 1, 3
    and 4 channels and 16 bits."""
    out = []
    for i, (h, w) in enumerate([(1, 1), (8, 8), (16, 9), (33, 65), (5, 200)]):
        pix = np.ascontiguousarray(image(i, (3, h, w)).transpose(1, 2, 0))
        for params in (
            [cv2.IMWRITE_JPEG_QUALITY, 30],
            [cv2.IMWRITE_JPEG_QUALITY, 100, cv2.IMWRITE_JPEG_PROGRESSIVE, 1],
            [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444],
        ):
            out.append(cv2.imencode(".jpg", pix, params)[1].tobytes())
        out.append(cv2.imencode(".jpg", pix[..., 0])[1].tobytes())  # gray
        out.append(cv2.imencode(".png", pix)[1].tobytes())
        out.append(cv2.imencode(".png", pix[..., 0])[1].tobytes())
        bgra = np.concatenate([pix, pix[..., :1]], axis=2)
        out.append(cv2.imencode(".png", bgra)[1].tobytes())
        out.append(cv2.imencode(".png", pix.astype(np.uint16) * 257)[1].tobytes())
    return out


def with_exif_orientation(jpeg: bytes, orientation: int) -> bytes:
    """``jpeg`` with an APP1 EXIF block whose Orientation tag is ``orientation``."""
    ifd = struct.pack(">H", 1) + struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0)
    app1 = b"Exif\x00\x00" + b"MM\x00\x2a\x00\x00\x00\x08" + ifd + b"\x00\x00\x00\x00"
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + jpeg[2:]


def test_decode_image_is_opencvs_with_each_flag() -> None:
    cmyk = (DATA / "jpeg" / "cmyk.jpg").read_bytes()
    exif = with_exif_orientation(caffe_jpegs()[0], 6)
    for data in [*caffe_jpegs()[:10], *generated_images(), cmyk, exif]:
        for flag in FLAGS:
            want = opencv(data, flag)
            got = decode_image(data, flag)
            if want.dtype != np.uint8:  # 16-bit PNG, unchanged: not an 8-bit image
                assert isinstance(got, Undecodable) and not got.damaged
                assert "re-encode it as 8-bit" in got.reason
                continue
            assert isinstance(got, np.ndarray), (len(data), flag)
            assert got.dtype == np.uint8 and np.array_equal(got, hwc(want)), (len(data), flag)


def test_datums_decode_with_caffes_flags() -> None:
    eight_bit = [d for d in generated_images() if opencv(d, -1).dtype == np.uint8]
    for data in caffe_jpegs()[:10] + eight_bit:
        datum = blobpipe.encode_encoded_datum(data, 3)
        for flags, flag in (({"force_color": True}, 1), ({"force_gray": True}, 0), ({}, -1)):
            assert (
                imread_flag(flags.get("force_color", False), flags.get("force_gray", False)) == flag
            )
            chw, label = blobpipe.decode_datum(datum, **flags)
            want = hwc(opencv(data, flag)).transpose(2, 0, 1)
            assert label == 3 and np.array_equal(chw, want)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied_as_opencv_does(orientation: int) -> None:
    pix = np.ascontiguousarray(image(4, (3, 5, 200)).transpose(1, 2, 0))
    plain = cv2.imencode(".jpg", pix)[1].tobytes()
    data = with_exif_orientation(plain, orientation)
    assert not np.array_equal(opencv(data, 1), opencv(plain, 1))  # OpenCV rotates
    for flag in FLAGS:
        got = decode_image(data, flag)
        assert isinstance(got, np.ndarray) and np.array_equal(got, hwc(opencv(data, flag)))


def test_broken_and_refused_images_say_why() -> None:
    data = caffe_jpegs()[0]
    truncated = decode_image(data[:20], 1)
    assert isinstance(truncated, Undecodable) and truncated.damaged
    assert "cannot decode the encoded image (20 bytes" in truncated.reason
    assert "no frame header before the scan" in truncated.reason
    empty = decode_image(b"", 1)
    assert isinstance(empty, Undecodable) and "holds no image bytes" in empty.reason
    big = bytearray(cv2.imencode(".png", np.zeros((4, 4, 3), np.uint8))[1].tobytes())
    big[16:24] = struct.pack(">II", 1 << 20, 1 << 20)  # IHDR width, height
    refused = decode_image(bytes(big), 1)
    assert isinstance(refused, Undecodable) and not refused.damaged
    assert "announces 1048576×1048576 pixels" in refused.reason
    with pytest.raises(DataError, match=r"cannot decode.*record key b'k'"):
        blobpipe.decode_datum(blobpipe.encode_encoded_datum(data[:20], 0), key=b"k")


def test_image_header_reads_png_and_jpeg_sizes() -> None:
    pix = np.zeros((7, 11, 3), np.uint8)
    assert image_header(cv2.imencode(".png", pix)[1].tobytes())[:2] == (11, 7)  # type: ignore[index]
    jpg = cv2.imencode(".jpg", pix)[1].tobytes()
    header = image_header(memoryview(jpg))
    assert header is not None and header[:2] == (11, 7)
    frame = jpeg_frame(jpg)
    assert frame is not None and (frame.width, frame.height, frame.components) == (11, 7, 3)
    assert image_header(cv2.imencode(".bmp", pix)[1].tobytes())[:2] == (11, 7)  # type: ignore[index]


@pytest.mark.parametrize("flags", [{}, {"force_color": True}, {"force_gray": True}])
def test_batches_of_mixed_images_equal_opencv(tmp_path: Path, flags: dict[str, bool]) -> None:
    """A batch path decoding JPEGs, PNGs, EXIF-rotated and CMYK images gives OpenCV's
    pixels in every epoch (the first reads and the indexed ones)."""
    cmyk = (DATA / "jpeg" / "cmyk.jpg").read_bytes()  # 9×7
    pix = np.ascontiguousarray(image(5, (3, 7, 9)).transpose(1, 2, 0))
    jpeg = cv2.imencode(".jpg", pix)[1].tobytes()
    kinds = [jpeg, with_exif_orientation(jpeg, 1), cmyk, cv2.imencode(".png", pix)[1].tobytes()]
    datas = [kinds[i % 4] for i in range(16)]
    items = [(key(i), blobpipe.encode_encoded_datum(d, i)) for i, d in enumerate(datas)]
    path = write_lmdb(tmp_path / "db", items)
    flag = imread_flag(flags.get("force_color", False), flags.get("force_gray", False))
    assert len({hwc(opencv(d, flag)).shape for d in kinds}) == 1  # a batch holds one shape
    t = Transform(**flags)
    with Batches(path, 4, transform=t, mode="epoch", phase="test") as b:
        got = epochs(b, 3)
    want = np.stack([hwc(opencv(d, flag)).transpose(2, 0, 1) for d in datas]).astype(np.float32)
    for epoch in got:
        assert np.array_equal(np.concatenate([x.data for x in epoch]), want)


# -- the size guard, for every format, whoever imported OpenCV first ----------------------------


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_opencv_reads_has_its_size_read_from_its_header(fmt: str) -> None:
    data = encoded(fmt)
    decoded = opencv(data, -1)
    assert decoded is not None and decoded.shape[:2] == SHAPE
    size = image_size(data)
    assert not isinstance(size, str) and (size.height, size.width) == SHAPE
    assert image_size(announcing(fmt, 301, 203))[1:3] == (301, 203)
    refused = decode_image(announcing(fmt, 9001, 9002), -1, max_pixels=9001 * 9002 - 1)
    assert isinstance(refused, Undecodable) and "announces 9001×9002 pixels" in refused.reason


def test_jpeg_markers_are_read_as_libjpeg_reads_them() -> None:
    """Stuffed zeros, fill bytes and stray bytes before the frame header do not hide
    it; a scan or the end of the image before it means there is none."""
    jpg = announcing("jpeg", 30000, 30000)
    soi, rest = jpg[:2], jpg[2:]
    for prefix in (b"\xff\x00", b"\xff\x00\xff\x00", b"\xff\xff\xff", b"\x00\x13", b"\xff\x01"):
        frame = jpeg_frame(soi + prefix + rest)
        assert frame is not None and (frame.width, frame.height) == (30000, 30000), prefix
        refused = decode_image(soi + prefix + rest, 1)
        assert isinstance(refused, Undecodable) and "announces 30000×30000" in refused.reason
    at = jpg.index(b"\xff\xc0")
    sos = jpg[:at] + b"\xff\xda\x00\x02" + jpg[at:]  # a scan before any frame: libjpeg fails
    assert jpeg_frame(sos) is None
    got = decode_image(sos, 1)
    assert isinstance(got, Undecodable) and "no frame header before the scan" in got.reason
    assert opencv(sos, 1) is None  # as OpenCV says too


def test_bytes_of_no_format_opencv_reads_are_not_handed_to_it() -> None:
    got = decode_image(b"\x00\x01not an image at all", 1)
    assert isinstance(got, Undecodable) and "no signature of an image format" in got.reason


_HUGE_AFTER_OPENCV = """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a failure must not swap
    import cv2  # first: OpenCV has read OPENCV_IO_MAX_IMAGE_PIXELS (unset) already
    import struct
    import blobpipe
    from tests._images import FORMATS, announcing

    gif = b"GIF89a" + struct.pack("<HH", 12000, 12000) + b"\\x00\\x00\\x00"
    gif += b"\\x2c" + struct.pack("<HHHH", 0, 0, 12000, 12000)
    gif += b"\\x00\\x02\\x02\\x4c\\x01\\x00\\x3b"
    jpg = announcing("jpeg", 30000, 30000)
    cases = {"gif of 29 bytes": gif, "jpeg stuffed after SOI": jpg[:2] + b"\\xff\\x00" + jpg[2:]}
    for fmt in FORMATS:
        side = 16383 if fmt in ("webp", "webp-lossless") else 30000
        cases[fmt] = announcing(fmt, side, side)
    for name, data in cases.items():
        try:
            blobpipe.decode_datum(blobpipe.encode_encoded_datum(data, 0), key=b"k", path="p")
            print(name, "decoded")
        except blobpipe.DataError as exc:
            print(name, "refused" if "announces" in str(exc) else f"other: {exc}")
        except Exception as exc:
            print(name, f"raised {type(exc).__name__}: {exc}")
    # VmHWM is this process's own peak (ru_maxrss can carry the forking parent's)
    with open("/proc/self/status") as status:
        hwm = next(line for line in status if line.startswith("VmHWM:"))
    print("maxrss_mib", int(hwm.split()[1]) // 1024)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM (Linux)")
def test_huge_images_are_refused_when_opencv_was_imported_first() -> None:
    """OpenCV imported before blobpipe (so its own pixel limit is its default of 2^30):
    an image of any format announcing 30000×30000 (a 29-byte GIF announcing
    12000×12000, a JPEG whose frame header follows a stuffed FF 00) is refused from
    its header, and the process never grows by what it announces."""
    done = run_script(_HUGE_AFTER_OPENCV, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert [line for line in lines[:-1] if not line.endswith(" refused")] == []
    rss = int(lines[-1].split()[1])
    assert rss < 250, lines[-1]  # a decoded 12000×12000 GIF alone is 412 MiB
