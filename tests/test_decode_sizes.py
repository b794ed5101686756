"""A batch's JPEGs and PNGs of many sizes, decoded and transformed in one call.

Each image goes into its row at its own size, read from its header by the compiled
``image_sizes`` (which must read what ``_imagehead`` reads), with the crop and flip its
record alone would get (``Transform.geometry_of``, drawn for every row at once). Every
row written must equal OpenCV's decode then Caffe's transform; a Batches epoch must be
the same epoch through the row-by-row path (and without the compiled decoders), crops,
flips and errors included; every size is checked before the GIL is released.
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
from blobpipe._io import _fill, _image
from blobpipe._io._imagehead import jpeg_frame
from blobpipe._io._kernels import Geometry, draw_words, kernel_args
from blobpipe._proto import caffe_pb2
from tests._helpers import key, rows_written, write_lmdb
from tests.test_jpegwindow import SAMPLINGS, exif, full, jpeg, photo, reference_row, with_segment
from tests.test_transform import _mean_file

jpegwindow: Any = pytest.importorskip("blobpipe._io._jpegwindow")
pngrows: Any = pytest.importorskip("blobpipe._io._pngrows")

DATA = Path(__file__).parent / "data"


def png(pixels: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".png", pixels)
    assert ok
    return buf.tobytes()


def heads(images: list[Any]) -> list[list[int]]:
    return np.frombuffer(jpegwindow.image_sizes(images), np.intp).reshape(-1, 3).tolist()


def extents_of(images: list[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
    """The images joined into one buffer (a byte between them) and their extents."""
    buffer, extents, at = b"", np.full((len(images), 2), -1, np.int64), 0
    for i, data in enumerate(images):
        if data is not None:
            extents[i] = at + 1, len(data)
            buffer += b"\x00" + data
            at += 1 + len(data)
    return np.frombuffer(buffer + b"\x00", np.uint8), extents


# -- the sizes headers announce -----------------------------------------------------------------

segments = st.one_of(
    st.binary(max_size=6),  # stray bytes, fill bytes
    st.builds(
        lambda marker, length, body: b"\xff" + bytes([marker]) + struct.pack(">H", length) + body,
        st.sampled_from([0x00, 0x01, 0xD0, 0xD8, 0xD9, 0xDA, 0xC4, 0xC8, 0xCC, 0xE0, 0xE1, 0xFE])
        | st.integers(0xC0, 0xCF),
        st.integers(0, 12),
        st.binary(max_size=12),
    ),
)


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(segments, max_size=8), cut=st.integers(0, 200))
def test_image_sizes_read_the_frame_header_imagehead_reads(parts: list[bytes], cut: int) -> None:
    """Any bytes after a JPEG's SOI: the C reader finds the frame header libjpeg's marker
    rules find (``_imagehead.jpeg_frame``), or none; a PNG's IHDR likewise."""
    data = (b"\xff\xd8" + b"".join(parts))[: 2 + cut]
    frame = jpeg_frame(data)
    want = [1, frame.height, frame.width] if frame is not None else [1, 0, 0]
    png_data = b"\x89PNG\r\n\x1a\n" + data[:20]
    ihdr = len(png_data) >= 24 and png_data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png_data[16:24]) if ihdr else (0, 0)
    if max(width, height) > 2**31 - 1:  # more than PNG allows: not read
        width = height = 0
    buffer, extents = extents_of([data, png_data])
    got = np.frombuffer(jpegwindow.image_sizes(buffer, extents), np.intp).reshape(-1, 3)
    assert got.tolist() == heads([data, png_data]) == [want, [2, height, width]]


def test_image_sizes_of_real_images_and_of_what_is_no_image() -> None:
    pix = photo(1, 33, 47)
    big = bytearray(jpeg(pix))
    sof = big.index(b"\xff\xc0")
    big[sof + 5 : sof + 9] = struct.pack(">HH", 65500, 65500)  # huge, as the header says
    zero = bytearray(big)
    zero[sof + 5 : sof + 9] = struct.pack(">HH", 0, 47)
    images = [
        jpeg(pix),
        jpeg(pix, progressive=True),
        with_segment(jpeg(pix), exif(6)),  # the header's size: the decoder refuses it
        png(pix),
        png(cv2.cvtColor(pix, cv2.COLOR_BGR2GRAY)),
        bytes(big),
        bytes(zero),
        jpeg(pix)[:3],
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR\xff\xff\xff\xff\x00\x00\x00\x01",
        None,
        b"",
        b"GIF89a\x01\x00\x01\x00",
        (DATA / "jpeg" / "cmyk.jpg").read_bytes(),
    ]
    assert heads(images) == [
        [1, 33, 47], [1, 33, 47], [1, 33, 47], [2, 33, 47], [2, 33, 47], [1, 65500, 65500],
        [1, 0, 47], [1, 0, 0], [2, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [1, 7, 9],
    ]  # fmt: skip
    with pytest.raises(ValueError, match="outside"):
        jpegwindow.image_sizes(np.zeros(10, np.uint8), np.array([[4, 7]], np.int64))
    with pytest.raises(ValueError, match="int64"):
        jpegwindow.image_sizes(np.zeros(10, np.uint8), np.array([[0, 7]], np.int32))
    with pytest.raises(TypeError):
        jpegwindow.image_sizes([b"", 1.5])


# -- one call, each image of its own size ---------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    crop=st.integers(1, 24),
    sizes=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=6, max_size=6),
    formats=st.lists(st.sampled_from(["jpeg", "progressive", "png"]), min_size=6, max_size=6),
    mean=st.booleans(),
    scale=st.sampled_from([1.0, 0.017]),
    dtype=st.sampled_from(["float32", "uint8"]),
    nhwc=st.booleans(),
    split=st.integers(0, 6),
    as_extents=st.booleans(),
    data=st.data(),
)
def test_decode_rows_of_many_sizes_equal_the_whole_decode_then_the_transform(
    seed: int,
    crop: int,
    sizes: list[tuple[int, int]],
    formats: list[str],
    mean: bool,
    scale: float,
    dtype: str,
    nhwc: bool,
    split: int,
    as_extents: bool,
    data: Any,
) -> None:
    """Rows of JPEGs and PNGs each of its own size, each crop inside its own image: every
    row written equals OpenCV's decode then the transform; a row left alone (None) or
    whose image is not the size given (another size) is not written."""
    n = len(sizes)
    hw = [(crop + dh, crop + dw) for dh, dw in sizes]
    images: list[bytes | None] = []
    for i, ((h, w), kind) in enumerate(zip(hw, formats, strict=True)):
        pix = photo(seed + i, h, w)
        images.append(png(pix) if kind == "png" else jpeg(pix, 80, "4:2:0", kind == "progressive"))
    images[1] = None
    hw[4] = (hw[4][0] + 1, hw[4][1])  # not the image's size: left alone
    given_sizes = np.array(hw, np.intp)
    h_off = np.array([data.draw(st.integers(0, h - crop)) for h, _ in hw], np.intp)
    w_off = np.array([data.draw(st.integers(0, w - crop)) for _, w in hw], np.intp)
    flips = np.array([data.draw(st.booleans()) for _ in range(n)], np.bool_)
    m = np.array([104.0, 117.0, 123.5], np.float32) if mean and dtype == "float32" else None
    spec = blobpipe.Transform(crop_size=crop, scale=scale, layout="NHWC" if nhwc else "NCHW",
                              dtype=dtype).kernel_spec((3, crop, crop))  # fmt: skip
    if m is not None:
        spec = type(spec)(spec.crop, m.reshape(3, 1, 1), spec.scale, spec.layout)
    row_shape = (crop, crop, 3) if nhwc else (3, crop, crop)
    out = np.full((n, *row_shape), 7, np.dtype(dtype))
    parts = [out] if split in (0, n) else [out[:split], out[split:]]
    args = kernel_args(parts, Geometry(h_off, w_off, flips), spec)
    assert args is not None
    if as_extents:
        buffer, extents = extents_of(images)
        done = _image.decode_rows(buffer, (3, crop, crop), 1, args, given_sizes, None, extents)
    else:
        done = _image.decode_rows(images, (3, crop, crop), 1, args, given_sizes)
    assert done is not None
    assert np.frombuffer(done, np.bool_).tolist() == [True, False, True, True, False, True]
    for i in (0, 2, 3, 5):
        want = reference_row(
            full(images[i] or b"", 1), int(h_off[i]), int(w_off[i]), crop, bool(flips[i]),
            None if m is None else m, scale, dtype, nhwc,
        )  # fmt: skip
        assert np.array_equal(out[i], want), i
    assert (out[1] == 7).all() and (out[4] == 7).all()


def test_decode_rows_check_every_size_before_decoding() -> None:
    """Sizes that are not one (height, width) per row, not positive, too large to
    count in bytes, too small for the crop or its offsets, or of another size where
    the row needs the batch's (no crop, a mean file); extents outside the buffer:
    a ValueError, nothing written."""
    data = jpeg(photo(5, 20, 24))
    z = np.zeros(2, np.intp)
    flips = np.zeros(2, np.bool_)
    out = np.zeros((2, 3, 8, 8), np.float32)
    whole = np.zeros((2, 3, 20, 24), np.float32)
    sizes = np.array([[20, 24], [20, 24]], np.intp)
    for call in (jpegwindow.decode_rows, pngrows.decode_rows):

        def rows(
            sz: Any, crop: int = 8, o: Any = out, h: Any = z, mean: Any = None, call: Any = call
        ) -> Any:
            return call([data, data], (3, 20, 24), h, z, flips, mean, 1.0, o, crop, 0, sz)

        with pytest.raises(ValueError, match="per image"):
            rows(np.array([20, 24, 20], np.intp))
        with pytest.raises(ValueError, match="intp"):
            rows(sizes.astype(np.int32))
        with pytest.raises(ValueError, match="positive"):
            rows(np.array([[20, 24], [0, 24]], np.intp))
        with pytest.raises(ValueError, match="positive"):
            rows(np.array([[20, 24], [-3, 24]], np.intp))
        with pytest.raises(ValueError, match="fit a Py_ssize_t"):
            rows(np.array([[20, 24], [1 << 40, 1 << 40]], np.intp))
        with pytest.raises(ValueError, match="does not make a row"):
            rows(np.array([[20, 24], [7, 24]], np.intp))
        with pytest.raises(ValueError, match="crop does not fit"):
            rows(np.array([[20, 24], [9, 24]], np.intp), h=np.array([0, 2], np.intp))
        with pytest.raises(ValueError, match="does not make a row"):
            rows(np.array([[20, 24], [21, 24]], np.intp), crop=0, o=whole)
        mean = np.zeros(3 * 20 * 24, np.float32)
        with pytest.raises(ValueError, match="does not make a row"):
            rows(np.array([[20, 24], [21, 24]], np.intp), mean=mean)
        with pytest.raises(ValueError, match="outside"):
            call(np.zeros(10, np.uint8), (3, 20, 24), z, z, flips, None, 1.0, out, 8, 0, sizes,
                 np.array([[0, 4], [8, 4]], np.int64))  # fmt: skip
        with pytest.raises(ValueError, match="offset, length"):
            call(np.zeros(10, np.uint8), (3, 20, 24), z, z, flips, None, 1.0, out, 8, 0, sizes,
                 np.zeros(3, np.int64))  # fmt: skip
        assert not out.any() and not whole.any()
    # a mean file fits rows of the batch's size, and None sizes are the batch's
    status = jpegwindow.decode_rows(
        [data, data], (3, 20, 24), z, z, flips, np.zeros(3 * 20 * 24, np.float32), 1.0, out, 8,
        0, sizes,
    )  # fmt: skip
    assert list(status) == [1, 1]


# -- the crops and flips of rows of many sizes ----------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    crop=st.integers(0, 30),
    sizes=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=20),
    mirror=st.booleans(),
    phase=st.sampled_from(["train", "test"]),
    seed=st.integers(0, 2**32),
)
def test_geometry_of_draws_what_each_record_alone_gets(
    crop: int, sizes: list[tuple[int, int]], mirror: bool, phase: Any, seed: int
) -> None:
    t = blobpipe.Transform(crop_size=crop, mirror=mirror)
    words = draw_words(seed, 3, np.arange(len(sizes)))
    heights = np.array([crop + h for h, _ in sizes], np.intp)
    widths = np.array([crop + w for _, w in sizes], np.intp)
    got = t.geometry_of(heights, widths, phase, words)
    for i, (h, w) in enumerate(zip(heights.tolist(), widths.tolist(), strict=True)):
        assert got.row(i) == t.geometry((3, h, w), phase, words[i : i + 1]).row(0)
    if crop:
        with pytest.raises(blobpipe.ShapeError, match=f"height {crop - 1}"):
            t.geometry_of(np.append(heights, crop - 1), np.append(widths, crop), phase,
                          np.append(words, words[:1]))  # fmt: skip


# -- Batches: the same batches as row by row ------------------------------------------------------


def sizes_db(path: Path, n: int = 40, seed: int = 0) -> Path:
    """JPEGs and PNGs of sizes 7..48 drawn per record (every 8th 7×9: the first of a
    batch of 8, the size of the batch), with the odd ones among them: a raw Datum, a
    gray JPEG, a CMYK JPEG (7×9), an EXIF-rotated JPEG, a progressive one, an RGBA PNG."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        h, w = (int(v) for v in rng.integers(7, 49, 2)) if i % 8 else (7, 9)
        pix = photo(seed + i, h, w)
        value: bytes | None = None
        if i % 5 == 3:
            data = png(pix)
        elif i == 6:
            value = blobpipe.encode_raw_datum(pix.transpose(2, 0, 1), i % 4)
        elif i == 9:
            data = jpeg(cv2.cvtColor(pix, cv2.COLOR_BGR2GRAY))
        elif i == 11:
            data = (DATA / "jpeg" / "cmyk.jpg").read_bytes()
        elif i == 14:
            data = with_segment(jpeg(pix), exif(6))
        elif i == 17:
            data = jpeg(pix, progressive=True)
        elif i == 22:
            data = png(cv2.cvtColor(pix, cv2.COLOR_BGR2BGRA))
        else:
            data = jpeg(pix, 60 + i, sorted(SAMPLINGS)[i % 5])
        if value is None:
            value = blobpipe.encode_encoded_datum(data, i % 4)
        records.append((key(i), value))
    return write_lmdb(path, records)


def row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every encoded row through the row-by-row path (its image's window decoded alone)."""
    monkeypatch.setattr(_fill, "image_sizes", lambda *args: None)


def epoch(
    db: Path, transform: blobpipe.Transform, phase: str, batch: int = 8, seed: int = 3
) -> list[Any]:
    """Each batch's data, labels, crops and flips, or its error: filled whole, in two
    ranges, and in two parts (fill_parts); the three agree."""
    out: list[Any] = []
    with blobpipe.Batches(
        db, batch, transform=transform, phase=phase, seed=seed, mode="epoch"
    ) as batches:
        while (plan := batches.next_plan()) is not None:
            n = len(plan)
            results = []
            for how in ("whole", "ranges", "parts"):
                data = np.full(plan.data_shape, 9, plan.dtype)
                label = np.zeros(n, np.float32)
                geometry = Geometry.zeros(n)
                try:
                    if how == "whole":
                        batches.fill(plan, data, label, geometry_out=geometry)
                    elif how == "ranges":
                        batches.fill(plan, data, label, 0, 3, geometry_out=geometry)
                        batches.fill(plan, data, label, 3, n, geometry_out=geometry)
                    else:
                        batches.fill_parts(
                            plan,
                            [
                                (data[:5], label[:5], geometry.take(slice(0, 5))),
                                (data[5:], label[5:], geometry.take(slice(5, n))),
                            ],
                        )
                except blobpipe.DataError as exc:
                    results.append(str(exc))
                else:
                    results.append((data, label, np.stack(geometry.arrays())))
            first = results[0]
            for other in results[1:]:
                same(first, other)
            out.append(first)
    return out


def same(a: Any, b: Any) -> None:
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
    else:
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.parametrize(
    ("phase", "layout", "dtype", "mean"),
    [
        ("train", "NCHW", "float32", "values"),
        ("test", "NHWC", "float32", "none"),
        ("train", "NCHW", "uint8", "file"),  # uint8 takes no mean: any size
        ("train", "NCHW", "float32", "file"),  # a mean file fits one size: errors
    ],
)
def test_batches_of_many_sizes_are_decoded_in_one_call_and_are_the_same(
    tmp_path: Path, phase: str, layout: Any, dtype: Any, mean: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """JPEGs and PNGs of many sizes (a raw record and images the decoders refuse among
    them): the batches, their labels, crops and flips and errors are those of the row-by-row
    path and of OpenCV's decode alone; the colour JPEGs and RGB PNGs go through decode_rows
    (each batch's first and the odd ones row by row)."""
    db = sizes_db(tmp_path / "db")
    values = np.random.default_rng(1).uniform(0, 255, (3, 7, 9)).astype(np.float32)
    mean_file = _mean_file(tmp_path, values)
    transform = blobpipe.Transform(
        crop_size=7, mirror=phase == "train", scale=0.5, force_color=True,
        mean_value=(104, 117, 123) if mean == "values" else (),
        mean_file=mean_file if mean == "file" else None, layout=layout, dtype=dtype,
    )  # fmt: skip
    jpeg_rows = rows_written(monkeypatch, jpegwindow)
    png_rows = rows_written(monkeypatch, pngrows)
    together = epoch(db, transform, phase)
    if mean != "file" or dtype == "uint8":
        # 40 rows: 5 batches' firsts, the raw record, the gray, CMYK, rotated and RGBA ones
        assert sum(jpeg_rows) + sum(png_rows) >= 40 - 5 - 5
        assert sum(png_rows) >= 8 - 2
    else:
        assert any(isinstance(b, str) and "mean file" in b for b in together)
    monkeypatch.undo()
    row_by_row(monkeypatch)
    apart = epoch(db, transform, phase)
    monkeypatch.setattr(_image, "_jpegwindow", None)
    monkeypatch.setattr(_image, "_pngrows", None)
    opencv = epoch(db, transform, phase)
    assert len(together) == len(apart) == len(opencv) == 5
    for a, b, c in zip(together, apart, opencv, strict=True):
        same(a, b)
        same(a, c)


def test_a_second_epoch_takes_the_shapes_noted_in_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows decoded in one call note their shapes in the record index: the next
    epoch plans its batches without decoding their first records again."""
    db = sizes_db(tmp_path / "db", 24)
    t = blobpipe.Transform(crop_size=7, mirror=True, force_color=True)
    with blobpipe.Batches(db, 8, transform=t, phase="train", mode="epoch") as b:
        first = [x.data.copy() for x in b]
        decoded: list[int] = []
        real = _fill.decode_image
        monkeypatch.setattr(
            _fill, "decode_image", lambda *a, **k: decoded.append(1) or real(*a, **k)
        )
        second = [x.data.copy() for x in b]
    assert len(first) == len(second) == 3
    assert not decoded  # every batch's first record's shape was known


def test_hostile_headers_give_the_row_by_row_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JPEG whose header announces a huge image, one of height 0, one cut short, an
    empty image, bytes that are no image: among images of many sizes, each batch is
    what the row-by-row path makes of it (the same error naming the record, or the
    same pixels), and nothing crashes."""
    pix = photo(2, 30, 40)
    base = jpeg(pix)
    sof = base.index(b"\xff\xc0")
    huge, zero = bytearray(base), bytearray(base)
    huge[sof + 5 : sof + 9] = struct.pack(">HH", 65500, 65500)
    zero[sof + 5 : sof + 9] = struct.pack(">HH", 0, 40)
    odd = [bytes(huge), bytes(zero), base[: len(base) // 2], b"", b"\xff\xd8\xff", b"no image"]
    for k, bad in enumerate(odd):
        records = [
            (key(i), blobpipe.encode_encoded_datum(jpeg(photo(i, 20 + i, 30 - i)), i))
            for i in range(8)
        ]
        datum = caffe_pb2.Datum(data=bad, label=5, encoded=True)
        records[5] = (key(5), datum.SerializeToString())
        db = write_lmdb(tmp_path / f"db{k}", records)
        t = blobpipe.Transform(crop_size=12, mirror=True, force_color=True)
        together = epoch(db, t, "train", batch=8)
        with monkeypatch.context() as m:
            row_by_row(m)
            apart = epoch(db, t, "train", batch=8)
        assert len(together) == len(apart) == 1
        same(together[0], apart[0])
        if k in (0, 1, 3, 4, 5):
            assert isinstance(together[0], str) and "00000005" in together[0], together[0]
        if k == 0:
            assert "announces 65500×65500" in together[0]
