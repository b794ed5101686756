"""The generated caffe_pb2 module is in sync with proto/caffe.proto and Caffe's wire format."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from blobpipe._proto import caffe_pb2

from ._helpers import lmdb_items
from .conftest import CAFFE

ROOT = Path(__file__).resolve().parent.parent


def test_generated_module_matches_proto_file(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(tmp_path)], check=True
    )
    for name in ("caffe_pb2.py", "caffe_pb2.pyi"):
        fresh = (tmp_path / name).read_text()
        checked_in = (ROOT / "blobpipe" / "_proto" / name).read_text()
        assert fresh == checked_in, (
            f"blobpipe/_proto/{name} is out of date: run python scripts/gen_proto.py"
        )


def test_runtime_admits_the_generated_code() -> None:
    """pyproject's protobuf range starts at the generated code's version."""
    text = (ROOT / "blobpipe" / "_proto" / "caffe_pb2.py").read_text()
    line = next(x for x in text.splitlines() if x.startswith("# Protobuf Python Version:"))
    gencode = line.split(":", 1)[1].strip()
    pyproject = (ROOT / "pyproject.toml").read_text()
    major = int(gencode.split(".")[0])
    assert f'"protobuf>={gencode},<{major + 1}"' in pyproject


def test_field_numbers_are_caffes() -> None:
    def numbers(msg: type) -> dict[str, int]:
        return {f.name: f.number for f in msg.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert numbers(caffe_pb2.Datum) == {
        "channels": 1,
        "height": 2,
        "width": 3,
        "data": 4,
        "label": 5,
        "float_data": 6,
        "encoded": 7,
    }
    blob = numbers(caffe_pb2.BlobProto)
    assert blob == {
        "shape": 7,
        "data": 5,
        "diff": 6,
        "double_data": 8,
        "double_diff": 9,
        "num": 1,
        "channels": 2,
        "height": 3,
        "width": 4,
    }
    packed = {f.name for f in caffe_pb2.BlobProto.DESCRIPTOR.fields if f.is_packed}
    assert packed == {"data", "diff", "double_data", "double_diff"}
    assert not caffe_pb2.Datum.DESCRIPTOR.fields_by_name["float_data"].is_packed
    assert numbers(caffe_pb2.BlobShape) == {"dim": 1}
    assert caffe_pb2.BlobShape.DESCRIPTOR.fields_by_name["dim"].is_packed
    layer = numbers(caffe_pb2.LayerParameter)
    assert (layer["transform_param"], layer["data_param"], layer["blobs"]) == (100, 107, 7)
    assert numbers(caffe_pb2.NetParameter)["layer"] == 100


def test_caffe_written_records_round_trip_byte_for_byte() -> None:
    for _, value in lmdb_items(CAFFE / "lmdb" / "raw_color"):
        datum = caffe_pb2.Datum.FromString(value)
        assert datum.HasField("encoded") and not datum.encoded
        assert datum.SerializeToString() == value


def test_generated_module_imports_without_grpc_tools() -> None:
    spec = importlib.util.find_spec("blobpipe._proto.caffe_pb2")
    assert spec is not None and spec.origin is not None
    assert "grpc" not in Path(spec.origin).read_text()
