"""Transform: Caffe's DataTransformer, checked against real Caffe output and a port of its loop."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from blobpipe._errors import ArgumentError, ProtoError, ShapeError
from blobpipe._io._transform import RecordParams, Transform, load_mean_file
from blobpipe._proto import caffe_pb2
from tests._helpers import lmdb_items

CAFFE = Path(__file__).parent / "data" / "caffe"
MEAN_FILE = CAFFE / "raw_color_mean.binaryproto"


def _records(name: str) -> list[tuple[np.ndarray, int]]:
    """Decode an LMDB of the reference data independently of blobpipe's reader."""
    out = []
    for _, value in lmdb_items(CAFFE / "lmdb" / name):
        d = caffe_pb2.Datum()
        d.ParseFromString(value)
        if d.encoded:
            img = cv2.imdecode(np.frombuffer(d.data, np.uint8), cv2.IMREAD_ANYCOLOR)
            chw = img[None] if img.ndim == 2 else img.transpose(2, 0, 1)
        else:
            chw = np.frombuffer(d.data, np.uint8).reshape(d.channels, d.height, d.width)
        out.append((np.ascontiguousarray(chw), d.label))
    return out


CASES = {
    "raw_color_b8": ("raw_color", {}),
    "raw_color_b8_meanfile_scale": ("raw_color", {"scale": 0.017, "mean_file": MEAN_FILE}),
    "raw_color_b8_meanvalue_crop24": (
        "raw_color",
        {"crop_size": 24, "mean_value": (104, 117, 123)},
    ),
    "encoded_jpg_b8": ("encoded_jpg", {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_caffe_reference_batches(case: str) -> None:
    db, kwargs = CASES[case]
    records = _records(db)
    t = Transform(**kwargs)  # type: ignore[arg-type]
    ref_dir = CAFFE / "ref" / case
    n_batches = len(list(ref_dir.glob("data_b*.npy")))
    assert n_batches >= 2
    for b in range(n_batches):
        ref = np.load(ref_dir / f"data_b{b}.npy")
        batch = np.empty(ref.shape, np.float32)
        for i in range(ref.shape[0]):
            chw, _ = records[b * 8 + i]
            t.apply_into(chw, batch[i], phase="test", index=b * 8 + i)
        assert np.array_equal(batch, ref), f"batch {b}"


def _caffe_loop(
    x: np.ndarray,
    *,
    scale: float,
    mean: np.ndarray | None,
    mean_values: tuple[float, ...],
    crop: int,
    h_off: int,
    w_off: int,
    mirror: bool,
) -> np.ndarray:
    """A literal port of DataTransformer::Transform(const Datum&, Dtype*)."""
    c_n, h_n, w_n = x.shape
    height = crop or h_n
    width = crop or w_n
    flat = x.reshape(-1)
    mflat = None if mean is None else mean.reshape(-1)
    s = np.float32(scale)
    out = np.empty(c_n * height * width, np.float32)
    for c in range(c_n):
        for h in range(height):
            for w in range(width):
                data_index = (c * h_n + h_off + h) * w_n + w_off + w
                if mirror:
                    top_index = (c * height + h) * width + (width - 1 - w)
                else:
                    top_index = (c * height + h) * width + w
                e = np.float32(flat[data_index])
                if mflat is not None:
                    out[top_index] = (e - mflat[data_index]) * s
                elif mean_values:
                    out[top_index] = (e - np.float32(mean_values[c])) * s
                else:
                    out[top_index] = e * s
    return out.reshape(c_n, height, width)


def _mean_file(tmp_path: Path, mean: np.ndarray, *, legacy: bool = True) -> Path:
    proto = caffe_pb2.BlobProto()
    if legacy:
        proto.num, proto.channels, proto.height, proto.width = (1, *mean.shape)
    else:
        proto.shape.dim.extend(mean.shape)
    proto.data.extend(mean.reshape(-1).tolist())
    path = tmp_path / "mean.binaryproto"
    path.write_bytes(proto.SerializeToString())
    return path


@pytest.mark.parametrize("src_dtype", [np.uint8, np.float32])
@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("phase", ["train", "test"])
@pytest.mark.parametrize("mean_kind", ["none", "file", "values", "one_value"])
def test_bit_identical_to_caffe_loop(
    tmp_path: Path, src_dtype: type, mirror: bool, phase: str, mean_kind: str
) -> None:
    rng = np.random.default_rng(7)
    shape = (3, 9, 11)
    if src_dtype is np.uint8:
        x = rng.integers(0, 256, shape, dtype=np.uint8)
    else:
        x = rng.normal(100, 50, shape).astype(np.float32)
    mean = rng.uniform(0, 255, shape).astype(np.float32)
    kwargs: dict[str, object] = {"scale": 0.00390625 * 1.1, "mirror": mirror, "crop_size": 5}
    values: tuple[float, ...] = ()
    if mean_kind == "file":
        kwargs["mean_file"] = _mean_file(tmp_path, mean)
    elif mean_kind == "values":
        values = (104.5, 117.25, 123.0)
        kwargs["mean_value"] = values
    elif mean_kind == "one_value":
        kwargs["mean_value"] = (99.7,)
        values = (99.7, 99.7, 99.7)
    t = Transform(**kwargs)  # type: ignore[arg-type]
    for index in range(6):
        out = np.empty((3, 5, 5), np.float32)
        p = t.apply_into(x, out, phase=phase, seed=3, epoch=1, index=index)  # type: ignore[arg-type]
        ref = _caffe_loop(
            x,
            scale=0.00390625 * 1.1,
            mean=mean if mean_kind == "file" else None,
            mean_values=values,
            crop=5,
            h_off=p.h_off,
            w_off=p.w_off,
            mirror=p.mirror,
        )
        assert np.array_equal(out, ref)


def test_test_phase_centre_crop_and_train_phase_range() -> None:
    t = Transform(crop_size=4)
    assert t.record_params((3, 11, 8), phase="test") == RecordParams(3, 2, False)
    seen = set()
    for i in range(400):
        p = t.record_params((3, 11, 8), phase="train", word=Transform.draw(0, 0, i))
        assert 0 <= p.h_off <= 7
        assert 0 <= p.w_off <= 4
        assert not p.mirror
        seen.add((p.h_off, p.w_off))
    assert len(seen) == 8 * 5  # every offset is reachable


def test_train_randomness_reproducible_per_seed_and_varies_across_epochs() -> None:
    t = Transform(crop_size=4, mirror=True)
    x = np.arange(3 * 10 * 12, dtype=np.uint8).reshape(3, 10, 12)

    def run(seed: int, epoch: int) -> list[RecordParams]:
        return [
            t.apply_into(
                x, np.empty((3, 4, 4), np.float32), phase="train", seed=seed, epoch=epoch, index=i
            )
            for i in range(50)
        ]

    assert run(1, 0) == run(1, 0)
    assert run(1, 0) != run(1, 1)
    assert run(1, 0) != run(2, 0)
    mirrors = [p.mirror for p in run(1, 0)]
    assert any(mirrors)
    assert not all(mirrors)


def test_mirror_is_random_in_test_phase_too_and_flips() -> None:
    t = Transform(mirror=True)
    x = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    flips = []
    for i in range(40):
        out = t(x, phase="test", index=i)
        p = t.record_params(x.shape, phase="test", word=Transform.draw(0, 0, i))
        expected = x[:, :, ::-1] if p.mirror else x
        assert np.array_equal(out, expected.astype(np.float32))
        flips.append(p.mirror)
    assert any(flips)
    assert not all(flips)


def test_layouts_and_dtypes() -> None:
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (3, 8, 10), dtype=np.uint8)
    base = Transform(crop_size=6, mirror=True, mean_value=(1, 2, 3), scale=0.5)
    nhwc = Transform(crop_size=6, mirror=True, mean_value=(1, 2, 3), scale=0.5, layout="NHWC")
    raw = Transform(crop_size=6, mirror=True, mean_value=(1, 2, 3), scale=0.5, dtype="uint8")
    raw_nhwc = Transform(
        crop_size=6, mirror=True, mean_value=(1, 2, 3), layout="NHWC", dtype="uint8"
    )
    for i in range(8):
        a = base(x, phase="train", index=i)
        p = base.record_params(x.shape, phase="train", word=Transform.draw(0, 0, i))
        assert a.shape == (3, 6, 6)
        assert nhwc.output_shape(x.shape) == (6, 6, 3)
        assert np.array_equal(nhwc(x, phase="train", index=i), a.transpose(1, 2, 0))
        pix = x[:, p.h_off : p.h_off + 6, p.w_off : p.w_off + 6]
        if p.mirror:
            pix = pix[:, :, ::-1]
        r = raw(x, phase="train", index=i)
        assert r.dtype == np.uint8
        assert np.array_equal(r, pix)
        assert np.array_equal(raw_nhwc(x, phase="train", index=i), pix.transpose(1, 2, 0))


def test_float32_without_mean_or_scale_is_a_cast() -> None:
    x = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    assert np.array_equal(Transform()(x), x.astype(np.float32))
    f = np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4)
    assert np.array_equal(Transform()(f), f)


def test_apply_into_a_batch_slice() -> None:
    t = Transform(scale=2.0)
    batch = np.zeros((4, 1, 2, 2), np.float32)
    t.apply_into(np.full((1, 2, 2), 3, np.uint8), batch[2])
    assert batch[2].tolist() == [[[6.0, 6.0], [6.0, 6.0]]]
    assert not batch[[0, 1, 3]].any()


def test_errors() -> None:
    x = np.zeros((3, 8, 10), np.uint8)
    with pytest.raises(
        ShapeError, match=r"crop_size 12 is larger than the record \(height 8, width 10\)"
    ):
        Transform(crop_size=12)(x)
    with pytest.raises(ShapeError, match="mean_value has 2 values but the record has 3 channels"):
        Transform(mean_value=(1, 2))(x)
    with pytest.raises(ShapeError, match=r"output slot has shape \(3, 8, 9\)"):
        Transform().apply_into(x, np.empty((3, 8, 9), np.float32))
    with pytest.raises(ShapeError, match=r"dtype float64; this record needs"):
        Transform().apply_into(x, np.empty((3, 8, 10), np.float64))  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match="dtype='uint8' output needs uint8 records"):
        Transform(dtype="uint8")(np.zeros((3, 8, 10), np.float32))
    with pytest.raises(
        ShapeError, match=r"\(C, H, W\) uint8 or float32 array, got shape \(8, 10\)"
    ):
        Transform().apply_into(np.zeros((8, 10), np.uint8), np.empty((8, 10), np.float32))
    # an argument error for the caller, naming both arguments (a prototxt's is a ProtoError)
    with pytest.raises(
        ArgumentError, match=r"give mean_file or mean_value, not both .*mean_value=\(1\.0,\)"
    ):
        Transform(mean_file=MEAN_FILE, mean_value=(1,))
    param = caffe_pb2.TransformationParameter(mean_file=str(MEAN_FILE), mean_value=[1])
    with pytest.raises(ProtoError, match="cannot specify mean_file and mean_value"):
        Transform.from_proto(param)
    with pytest.raises(ValueError, match="layout must be"):
        Transform(layout="CHW")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype must be"):
        Transform(dtype="float16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="crop_size must be"):
        Transform(crop_size=-1)
    with pytest.raises(ValueError, match="force_color and force_gray cannot both be set"):
        Transform(force_color=True, force_gray=True)
    with pytest.raises(ValueError, match="phase must be 'train' or 'test', got 'val'"):
        Transform()(x, phase="val")  # type: ignore[arg-type]


def test_kernel_spec_is_the_one_constructor_and_takes_a_mean_in_other_memory() -> None:
    """``kernel_spec`` makes every KernelSpec: the transform's own (cached per shape), or
    with ``mean=`` the same crop, scale and layout around a mean the caller holds (a
    device's copy), not cached; the crop is checked either way."""
    t = Transform(scale=0.5, crop_size=4, mean_value=(1, 2, 3), layout="NHWC")
    own = t.kernel_spec((3, 6, 8))
    assert own is t.kernel_spec((3, 6, 8))
    assert (own.crop, own.scale, own.layout) == (4, np.float32(0.5), "NHWC")
    assert np.array_equal(own.mean, t.mean_array((3, 6, 8)))
    copy = own.mean.copy()
    given = t.kernel_spec((3, 6, 8), mean=copy)
    assert given.mean is copy and given is not t.kernel_spec((3, 6, 8), mean=copy)
    assert (given.crop, given.scale, given.layout) == (own.crop, own.scale, own.layout)
    assert t.kernel_spec((3, 6, 8), mean=None).mean is None
    assert t.kernel_spec((3, 6, 8)) is own  # the cache is the transform's own spec still
    with pytest.raises(ShapeError, match="crop_size 4 is larger"):
        t.kernel_spec((3, 3, 8), mean=copy)
    raw = Transform(crop_size=4, mean_value=(1,), dtype="uint8").kernel_spec((3, 6, 8))
    assert raw.mean is None and raw.scale == 1


def test_records_of_every_size_share_one_kernel_spec_without_a_mean_file() -> None:
    """Only a mean file depends on a record's height and width: without one, records of
    any size (JPEGs of a few thousand sizes) share one spec and one mean column per
    channel count, so neither cache grows with the sizes a database holds, and each
    size's crop is still checked. With a mean file, a spec per shape, and a record of
    another shape refused."""
    sizes = [(h, w) for h in range(240, 300) for w in range(240, 290)]  # 3,000 sizes
    for t in (
        Transform(crop_size=227, mirror=True, mean_value=(104, 117, 123)),
        Transform(crop_size=227, scale=0.5),
        Transform(crop_size=227, mean_value=(1, 2, 3), dtype="uint8"),
    ):
        first = t.kernel_spec((3, 240, 240))
        assert all(t.kernel_spec((3, h, w)) is first for h, w in sizes)
        mean = t.mean_array((3, 240, 240))
        assert all(t.mean_array((3, h, w)) is mean for h, w in sizes[::100])
        assert len(t._mean_cache) <= 2 and len(t._spec_cache) <= 2
        with pytest.raises(ShapeError, match=r"crop_size 227 is larger .*height 226"):
            t.kernel_spec((3, 226, 500))
    t = Transform(mean_file=MEAN_FILE, crop_size=4)
    shape = load_mean_file(MEAN_FILE).shape
    assert t.kernel_spec(shape) is t.kernel_spec(shape)
    with pytest.raises(ShapeError, match="mean file"):
        t.kernel_spec((shape[0], shape[1] + 1, shape[2]))


def test_shapes_of_one_output_class_make_one_row_shape_and_spec() -> None:
    """``output_class`` is the key a plan's output is cached by: shapes it calls alike
    make one row shape through one kernel spec, or are refused alike; a record the
    crop does not fit, or any shape where a mean file (or no crop) ties the output to
    it, is its own class."""
    sizes = [(h, w) for h in range(225, 300, 7) for w in range(224, 290, 9)]
    for t in (
        Transform(crop_size=227, mirror=True, mean_value=(104, 117, 123)),
        Transform(crop_size=227, layout="NHWC", dtype="uint8"),
        Transform(scale=0.5),
        Transform(mean_file=MEAN_FILE, crop_size=4),
    ):
        for c in (1, 3):
            classes: dict[tuple[int, ...], set[object]] = {}
            for h, w in sizes:
                made: object
                try:
                    made = (t.output_shape((c, h, w)), id(t.kernel_spec((c, h, w))))
                except ShapeError as exc:
                    made = str(exc)
                    if not t.crop_fits(h, w):
                        assert t.output_class((c, h, w)) == (c, h, w)
                classes.setdefault(t.output_class((c, h, w)), set()).add(made)
            assert all(len(made) == 1 for made in classes.values())
            fit = sum(t.crop_fits(h, w) for h, w in sizes)
            many = len(sizes) - fit + 1 if t.crops_any_size else len(sizes)
            assert len(classes) == many


def test_mean_file_shape_mismatch_names_both_shapes() -> None:
    t = Transform(mean_file=MEAN_FILE)
    with pytest.raises(
        ShapeError, match=r"has shape \(3, 32, 40\) but the record has shape \(3, 30, 40\)"
    ):
        t(np.zeros((3, 30, 40), np.uint8))


def test_mean_file_formats(tmp_path: Path) -> None:
    legacy = load_mean_file(MEAN_FILE)
    assert legacy.shape == (3, 32, 40)
    assert legacy.dtype == np.float32
    mean = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    assert np.array_equal(load_mean_file(_mean_file(tmp_path, mean, legacy=False)), mean)
    proto = caffe_pb2.BlobProto()
    proto.num, proto.channels, proto.height, proto.width = 2, 1, 1, 1
    proto.data.extend([1.0, 2.0])
    (tmp_path / "two.binaryproto").write_bytes(proto.SerializeToString())
    with pytest.raises(ProtoError, match=r"holds 2 images \(shape \(2, 1, 1, 1\)\)"):
        load_mean_file(tmp_path / "two.binaryproto")
    proto = caffe_pb2.BlobProto()
    proto.num, proto.channels, proto.height, proto.width = 1, 1, 2, 2
    proto.data.extend([1.0])
    (tmp_path / "short.binaryproto").write_bytes(proto.SerializeToString())
    with pytest.raises(ProtoError, match=r"shape \(1, 1, 2, 2\) with 1 values"):
        load_mean_file(tmp_path / "short.binaryproto")
    (tmp_path / "junk.binaryproto").write_bytes(b"\xff\xff\xff")
    with pytest.raises(ProtoError, match=r"is not a serialized caffe\.BlobProto"):
        load_mean_file(tmp_path / "junk.binaryproto")
    with pytest.raises(FileNotFoundError):
        Transform(mean_file=tmp_path / "missing.binaryproto")


def test_from_proto(tmp_path: Path) -> None:
    p = caffe_pb2.TransformationParameter(scale=0.5, mirror=True, crop_size=3)
    p.mean_value.extend([1.0, 2.0, 3.0])
    t = Transform.from_proto(p)
    assert (t.scale, t.mirror, t.crop_size, t.mean_value) == (
        np.float32(0.5),
        True,
        3,
        (1.0, 2.0, 3.0),
    )
    q = caffe_pb2.TransformationParameter(mean_file="raw_color_mean.binaryproto")
    t2 = Transform.from_proto(q, base_dir=CAFFE)
    assert t2.mean_array((3, 32, 40)) is not None
    assert "raw_color_mean" in repr(t2)
