"""BlobProto / caffemodel files, checked against files written by real Caffe."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blobpipe
from blobpipe._backends import Backend, HostBackend
from blobpipe._blob import Blob
from blobpipe._blobfile import read_blobproto, read_caffemodel, write_blobproto
from blobpipe._codec import blobproto_bytes, load_mean_file, transform_fields
from blobpipe._errors import ProtoError, UnsupportedOperationError
from blobpipe._pool import get_pool
from blobpipe._proto import caffe_pb2
from tests._helpers import lmdb_items
from tests.conftest import CAFFE

MEAN = CAFFE / "raw_color_mean.binaryproto"
MODEL = CAFFE / "model" / "tiny.caffemodel"


@pytest.fixture
def host() -> HostBackend:
    return HostBackend()


def test_mean_file_is_a_1x3x32x40_blob(any_backend: Backend) -> None:
    with read_blobproto(MEAN, backend=any_backend) as mean:
        assert mean.shape == (1, 3, 32, 40)
        assert mean.dtype == np.float32
        assert mean.count() == 3840
        raw = caffe_pb2.BlobProto.FromString(MEAN.read_bytes())
        np.testing.assert_array_equal(mean.cpu_data().ravel(), np.array(raw.data, np.float32))


def test_mean_file_equals_the_mean_of_the_lmdb(host: HostBackend) -> None:
    # compute_image_mean sums the uint8 pixels in float and divides by the count.
    total = np.zeros(3 * 32 * 40, np.float32)
    n = 0
    for _, value in lmdb_items(CAFFE / "lmdb" / "raw_color"):
        datum = caffe_pb2.Datum.FromString(value)
        total += np.frombuffer(datum.data, np.uint8)
        n += 1
    assert n == 50
    with read_blobproto(MEAN, backend=host) as mean:
        np.testing.assert_array_equal(mean.cpu_data().ravel(), total / np.float32(n))


def test_mean_file_as_float64(host: HostBackend) -> None:
    with read_blobproto(MEAN, dtype=np.float64, backend=host) as mean:
        assert mean.dtype == np.float64
        raw = caffe_pb2.BlobProto.FromString(MEAN.read_bytes())
        np.testing.assert_array_equal(
            mean.cpu_data().ravel(), np.array(raw.data, np.float32).astype(np.float64)
        )


def test_caffemodel_blobs_equal_their_npy(any_backend: Backend) -> None:
    params = read_caffemodel(MODEL, backend=any_backend)
    assert list(params) == ["conv1", "bn1", "ip1"]  # file order; "data" has no blobs
    assert [b.shape for b in params["conv1"]] == [(4, 3, 3, 3), (4,)]
    assert [b.shape for b in params["bn1"]] == [(4,), (4,), (1,)]
    assert [b.shape for b in params["ip1"]] == [(5, 192), (5,)]
    checked = 0
    for name, blobs in params.items():
        for i, blob in enumerate(blobs):
            expected = np.load(MODEL.parent / f"{name}_{i}.npy")
            assert blob.dtype == expected.dtype
            np.testing.assert_array_equal(blob.cpu_data(), expected)
            blob.close()
            checked += 1
    assert checked == len(list(MODEL.parent.glob("*_[0-9].npy")))


def test_caffemodel_reproduces_the_forward_pass(host: HostBackend) -> None:
    # The last layer: output_ip1 = flatten(bn1 output) @ W.T + b. Check the
    # InnerProduct parameters against Caffe's own output via the BatchNorm one.
    params = read_caffemodel(MODEL, backend=host)
    x = np.load(MODEL.parent / "input.npy").astype(np.float64)
    w, b = (blob.cpu_data().astype(np.float64) for blob in params["conv1"])
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    conv = np.zeros((2, 4, 6, 8))
    for i in range(3):
        for j in range(3):
            conv += np.einsum("nchw,oc->nohw", padded[:, :, i : i + 6, j : j + 8], w[:, :, i, j])
    conv += b[None, :, None, None]
    mean, var, scale = (blob.cpu_data().astype(np.float64) for blob in params["bn1"])
    factor = 0.0 if scale[0] == 0 else 1.0 / scale[0]
    bn = (conv - (mean * factor)[None, :, None, None]) / np.sqrt(var * factor + 1e-5)[
        None, :, None, None
    ]
    ip_w, ip_b = (blob.cpu_data().astype(np.float64) for blob in params["ip1"])
    out = bn.reshape(2, -1) @ ip_w.T + ip_b
    np.testing.assert_allclose(out, np.load(MODEL.parent / "output_ip1.npy"), rtol=1e-4, atol=1e-4)
    for blobs in params.values():
        for blob in blobs:
            blob.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("write_diff", [False, True])
def test_write_read_round_trip(
    tmp_path: Path, host: HostBackend, dtype: Any, write_diff: bool
) -> None:
    blob = Blob((2, 3, 4), dtype, backend=host)
    blob.mutable_cpu_data()[...] = np.random.default_rng(0).normal(size=(2, 3, 4))
    blob.mutable_cpu_diff()[...] = 3
    path = tmp_path / "blob.binaryproto"
    write_blobproto(blob, path, write_diff=write_diff)
    raw = caffe_pb2.BlobProto.FromString(path.read_bytes())
    double = np.dtype(dtype) == np.float64
    assert len(raw.double_data if double else raw.data) == 24
    assert len(raw.double_diff if double else raw.diff) == (24 if write_diff else 0)
    assert list(raw.shape.dim) == [2, 3, 4]
    with read_blobproto(path, dtype=dtype, backend=host) as back:
        assert back.shape == (2, 3, 4)
        np.testing.assert_array_equal(back.cpu_data(), blob.cpu_data())
        expected_diff = blob.cpu_diff() if write_diff else np.zeros((2, 3, 4))
        np.testing.assert_array_equal(back.cpu_diff(), expected_diff)


def test_rewriting_the_mean_keeps_its_values(tmp_path: Path, host: HostBackend) -> None:
    with read_blobproto(MEAN, backend=host) as mean:
        write_blobproto(mean, tmp_path / "mean.binaryproto")
        with read_blobproto(tmp_path / "mean.binaryproto", backend=host) as again:
            assert again.shape == mean.shape
            np.testing.assert_array_equal(again.cpu_data(), mean.cpu_data())


def test_write_blobproto_with_its_arguments_swapped_says_so(
    tmp_path: Path, host: HostBackend
) -> None:
    """``write_blobproto(path, blob)`` (numpy.save's order) is a TypeError that says
    to swap them, and writes nothing."""
    path = tmp_path / "mean.binaryproto"
    with read_blobproto(MEAN, backend=host) as mean:
        with pytest.raises(
            TypeError, match=r"takes the blob first: got a PosixPath .* then a Blob; swap"
        ):
            write_blobproto(path, mean)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"blob must be a Blob, got ndarray"):
            write_blobproto(mean.cpu_data(), path)  # type: ignore[arg-type]
    assert not path.exists()


def test_legacy_v1_caffemodel(tmp_path: Path, host: HostBackend) -> None:
    net = caffe_pb2.NetParameter()
    layer = net.layers.add()
    layer.name = "fc"
    blob = layer.blobs.add(num=1, channels=1, height=2, width=3)
    blob.data.extend(range(6))
    net.layers.add().name = "relu"  # no blobs: left out
    path = tmp_path / "old.caffemodel"
    path.write_bytes(net.SerializeToString())
    params = read_caffemodel(path, backend=host)
    assert list(params) == ["fc"]
    (fc,) = params["fc"]
    assert fc.shape == (1, 1, 2, 3)
    np.testing.assert_array_equal(fc.cpu_data().ravel(), np.arange(6))


def test_duplicate_layer_names_are_refused_and_nothing_leaks(
    tmp_path: Path, host: HostBackend
) -> None:
    net = caffe_pb2.NetParameter()
    for _ in range(2):
        layer = net.layer.add()
        layer.name = "conv"
        layer.blobs.add(shape=caffe_pb2.BlobShape(dim=[2]), data=[1, 2])
    path = tmp_path / "dup.caffemodel"
    path.write_bytes(net.SerializeToString())
    with pytest.raises(ProtoError, match="two layers named 'conv' hold blobs"):
        read_caffemodel(path, backend=host)
    assert get_pool(host, "host").statistics().used_bytes == 0


def test_bad_blob_in_caffemodel_names_layer_and_file(tmp_path: Path, host: HostBackend) -> None:
    net = caffe_pb2.NetParameter()
    good = net.layer.add(name="a")
    good.blobs.add(shape=caffe_pb2.BlobShape(dim=[2]), data=[1, 2])
    bad = net.layer.add(name="b")
    bad.blobs.add(shape=caffe_pb2.BlobShape(dim=[3]), data=[1, 2])
    path = tmp_path / "bad.caffemodel"
    path.write_bytes(net.SerializeToString())
    with pytest.raises(ProtoError, match=r"bad.caffemodel', layer 'b' blob 0: .*has 2 values"):
        read_caffemodel(path, backend=host)
    assert get_pool(host, "host").statistics().used_bytes == 0


def test_garbage_file(tmp_path: Path, host: HostBackend) -> None:
    path = tmp_path / "garbage.binaryproto"
    path.write_bytes(b"\xff\xff\xff\xff not a protobuf")
    with pytest.raises(ProtoError, match=r"garbage.binaryproto' is not a valid caffe.BlobProto"):
        read_blobproto(path, backend=host)
    with pytest.raises(ProtoError, match=r"is not a valid caffe.NetParameter"):
        read_caffemodel(path, backend=host)


def test_count_mismatch_in_file(tmp_path: Path, host: HostBackend) -> None:
    path = tmp_path / "short.binaryproto"
    proto = caffe_pb2.BlobProto(num=1, channels=3, height=2, width=2, data=range(5))
    path.write_bytes(proto.SerializeToString())
    with pytest.raises(ProtoError, match=r"short.binaryproto'.*1 3 2 2 \(12\) has 5 values"):
        read_blobproto(path, backend=host)
    assert get_pool(host, "host").statistics().allocations == 0


def test_missing_file(tmp_path: Path, host: HostBackend) -> None:
    with pytest.raises(FileNotFoundError):
        read_blobproto(tmp_path / "nope.binaryproto", backend=host)


def test_integer_dtype_is_refused(host: HostBackend, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedOperationError, match="float or double values"):
        read_blobproto(MEAN, dtype=np.int32, backend=host)
    with pytest.raises(UnsupportedOperationError, match="no integer fields"):
        write_blobproto(Blob((2,), np.int32, backend=host), tmp_path / "x.binaryproto")
    assert not (tmp_path / "x.binaryproto").exists()


# -- the array-level codec ------------------------------------------------------------------


def test_load_mean_file_is_the_mean_blob_as_chw(host: HostBackend, tmp_path: Path) -> None:
    mean = load_mean_file(MEAN)
    assert (mean.shape, mean.dtype) == ((3, 32, 40), np.float32)
    assert mean.flags.c_contiguous
    with read_blobproto(MEAN, backend=host) as blob:
        np.testing.assert_array_equal(mean, blob.cpu_data()[0])
    # A shape-field file, and double_data (read, then cast to float32).
    values = np.arange(6, dtype=np.float64).reshape(1, 2, 3) / 3
    (tmp_path / "d.binaryproto").write_bytes(blobproto_bytes(values))
    got = load_mean_file(tmp_path / "d.binaryproto")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, values.astype(np.float32))


def test_load_mean_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_mean_file(tmp_path / "missing.binaryproto")
    (tmp_path / "junk.binaryproto").write_bytes(b"\xff\xff\xff")
    with pytest.raises(
        ProtoError,
        match=r"mean file '.*junk.binaryproto' is not a serialized caffe\.BlobProto: .*; "
        r"expected a binary caffe\.BlobProto .*blobpipe compute-mean",
    ):
        load_mean_file(tmp_path / "junk.binaryproto")
    two = caffe_pb2.BlobProto(num=2, channels=1, height=1, width=1, data=[1, 2])
    (tmp_path / "two.binaryproto").write_bytes(two.SerializeToString())
    with pytest.raises(ProtoError, match=r"holds 2 images \(shape \(2, 1, 1, 1\)\)"):
        load_mean_file(tmp_path / "two.binaryproto")
    short = caffe_pb2.BlobProto(num=1, channels=1, height=2, width=2, data=[1])
    (tmp_path / "short.binaryproto").write_bytes(short.SerializeToString())
    with pytest.raises(ProtoError, match=r"shape \(1, 1, 2, 2\) with 1 values"):
        load_mean_file(tmp_path / "short.binaryproto")
    flat = caffe_pb2.BlobProto(shape=caffe_pb2.BlobShape(dim=[4]), data=[1, 2, 3, 4])
    (tmp_path / "flat.binaryproto").write_bytes(flat.SerializeToString())
    with pytest.raises(ProtoError, match=r"expected a \(1, C, H, W\) or \(C, H, W\) blob"):
        load_mean_file(tmp_path / "flat.binaryproto")


def test_legacy_blobproto_bytes_are_caffes_mean_file() -> None:
    # compute_image_mean writes num=1, channels, height, width and float data.
    assert blobproto_bytes(load_mean_file(MEAN)[np.newaxis], legacy=True) == MEAN.read_bytes()
    raw = caffe_pb2.BlobProto.FromString(blobproto_bytes(np.zeros((2, 3), np.float32)))
    assert list(raw.shape.dim) == [2, 3]
    assert not raw.HasField("num")
    legacy = caffe_pb2.BlobProto.FromString(
        blobproto_bytes(np.zeros((2, 3), np.float32), legacy=True)
    )
    assert (legacy.num, legacy.channels, legacy.height, legacy.width) == (1, 1, 2, 3)


def test_transform_fields() -> None:
    p = caffe_pb2.TransformationParameter(scale=0.5, mirror=True, crop_size=3, force_gray=True)
    p.mean_value.extend([1.0, 2.0])
    assert transform_fields(p) == {
        "scale": 0.5,
        "mirror": True,
        "crop_size": 3,
        "mean_file": None,
        "mean_value": (1.0, 2.0),
        "force_color": False,
        "force_gray": True,
    }
    q = caffe_pb2.TransformationParameter(mean_file="m.binaryproto")
    assert transform_fields(q)["mean_file"] == "m.binaryproto"
    assert transform_fields(q, "")["mean_file"] == "m.binaryproto"
    assert transform_fields(q, Path("nets"))["mean_file"] == str(Path("nets") / "m.binaryproto")
    assert transform_fields(caffe_pb2.TransformationParameter())["scale"] == 1.0


def test_codec_imports_only_the_errors_and_the_generated_module() -> None:
    # Blob uses the codec, so the codec must not import Blob (or anything above
    # the errors and the shape checks) at import time; its Blob conveniences
    # import Blob when called.
    import blobpipe._codec as codec

    tree = ast.parse(Path(codec.__file__).read_text())
    imported = {
        node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
    }
    assert imported == {"_errors", "_shape", "_proto.caffe_pb2"}


def test_only_the_codec_imports_the_generated_protobuf_module() -> None:
    """Protobuf stays behind one boundary: no other module of blobpipe imports
    ``caffe_pb2`` (at module level or inside a function)."""
    root = Path(blobpipe.__file__).parent
    importers = set()
    for path in root.rglob("*.py"):
        if path.parent.name == "_proto":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any("caffe_pb2" in n for n in names):
                importers.add(path.relative_to(root).as_posix())
    assert importers == {"_codec.py"}
