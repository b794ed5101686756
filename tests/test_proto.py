"""Caffe's messages: in sync with proto/caffe.proto, in a private pool, Caffe's wire format."""

from __future__ import annotations

import ast
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from google.protobuf import descriptor_pool

from blobpipe._proto import _build, caffe_pb2
from blobpipe._proto._descriptor import SERIALIZED_FILE

from ._helpers import lmdb_items
from .conftest import CAFFE

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "blobpipe" / "_proto"


def test_shipped_files_match_a_regeneration(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="regenerating needs grpcio-tools (dev extra)")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(tmp_path)], check=True
    )
    for name in ("_descriptor.py", "caffe_pb2.pyi"):
        fresh = (tmp_path / name).read_bytes()
        shipped = (PROTO_DIR / name).read_bytes()
        assert fresh == shipped, (
            f"blobpipe/_proto/{name} is out of date: run python scripts/gen_proto.py"
        )


def test_no_protoc_generated_code_ships() -> None:
    """Generated ``*_pb2.py`` checks the runtime's version (gencode 7.35.1 refuses
    protobuf 5 and 6); the shipped modules build the classes from bytes instead."""
    for path in PROTO_DIR.glob("*.py"):
        text = path.read_text()
        for marker in ("runtime_version", "_builder", "protoc_insertion_point", "grpc"):
            assert marker not in text, f"{path.name} mentions {marker}"


def test_pyproject_floor_is_the_oldest_protobuf_ci_tests() -> None:
    """The dependency's lower bound is the version .ci/run runs the wire-format tests on."""
    ci = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^PROTOBUF_OLDEST=(\S+)$", ci, re.MULTILINE)
    assert match, ".ci/run sets PROTOBUF_OLDEST"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"protobuf>={match[1]},<8"' in pyproject


def test_messages_live_in_a_private_pool() -> None:
    assert caffe_pb2.DESCRIPTOR.pool is not descriptor_pool.Default()
    assert caffe_pb2.Datum.DESCRIPTOR.file is caffe_pb2.DESCRIPTOR
    with pytest.raises(KeyError):
        descriptor_pool.Default().FindFileByName("caffe.proto")


def test_module_defines_what_its_stub_declares() -> None:
    """mypy reads caffe_pb2.pyi (protoc's stub); the built module has exactly its names."""
    stub = ast.parse((PROTO_DIR / "caffe_pb2.pyi").read_text())
    declared = {n.name for n in stub.body if isinstance(n, ast.ClassDef)}
    declared |= {
        n.target.id
        for n in stub.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    built = set(_build.build_module(SERIALIZED_FILE, "m"))
    assert built == declared
    assert {name for name in vars(caffe_pb2) if not name.startswith("_")} >= declared
    assert (caffe_pb2.TRAIN, caffe_pb2.TEST) == (0, 1)
    assert caffe_pb2.Phase.Name(caffe_pb2.TEST) == "TEST"
    assert caffe_pb2.DataParameter.LMDB == 1
    assert caffe_pb2.DataParameter.DB.Name(0) == "LEVELDB"


def test_messages_pickle_by_reference() -> None:
    """Multiprocessing hands messages over by pickling: the classes must be findable."""
    datum = caffe_pb2.Datum(channels=1, height=1, width=2, data=b"ab", label=3)
    again = pickle.loads(pickle.dumps(datum))
    assert type(again) is caffe_pb2.Datum
    assert again == datum


def test_two_private_builds_do_not_conflict() -> None:
    first = _build.build_module(SERIALIZED_FILE, "first")
    second = _build.build_module(SERIALIZED_FILE, "second")
    assert first["Datum"] is not second["Datum"]
    wire = first["Datum"](channels=3, label=7).SerializeToString()
    assert second["Datum"].FromString(wire).label == 7


# A process that also imports pycaffe: its caffe_pb2 registers ITS caffe.proto
# (same file name, same package, more messages) in protobuf's default pool.
_PYCAFFE_TOO = textwrap.dedent(
    """
    import sys
    from google.protobuf import descriptor_pb2, descriptor_pool
    from blobpipe._proto._build import _message_class
    from blobpipe._proto._descriptor import SERIALIZED_FILE

    def import_pycaffe():
        proto = descriptor_pb2.FileDescriptorProto.FromString(SERIALIZED_FILE)
        solver = proto.message_type.add(name="SolverParameter")
        solver.field.add(name="base_lr", number=5, type=2, label=1)  # optional float
        pool = descriptor_pool.Default()
        pool.AddSerializedFile(proto.SerializeToString())
        return {
            name: _message_class(pool.FindMessageTypeByName("caffe." + name), pool)
            for name in ("Datum", "SolverParameter")
        }

    def import_blobpipe():
        from blobpipe._proto import caffe_pb2
        return caffe_pb2

    if sys.argv[1] == "pycaffe-first":
        pycaffe = import_pycaffe()
        ours = import_blobpipe()
    else:
        ours = import_blobpipe()
        pycaffe = import_pycaffe()
    wire = ours.Datum(channels=3, height=2, width=1, data=b"abcdef", label=4).SerializeToString()
    theirs = pycaffe["Datum"].FromString(wire)
    assert (theirs.channels, theirs.label, theirs.data) == (3, 4, b"abcdef")
    assert ours.Datum.FromString(theirs.SerializeToString()) == ours.Datum.FromString(wire)
    assert pycaffe["SolverParameter"](base_lr=0.5).base_lr == 0.5
    assert descriptor_pool.Default().FindFileByName("caffe.proto").message_types_by_name[
        "SolverParameter"
    ]
    assert not hasattr(ours, "SolverParameter")
    print("ok")
    """
)


@pytest.mark.parametrize("order", ["pycaffe-first", "blobpipe-first"])
def test_pycaffes_caffe_proto_in_the_default_pool_does_not_conflict(order: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PYCAFFE_TOO, order],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


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
    # FieldDescriptor.is_packed is protobuf >= 5; the packed option reads the same everywhere
    packed = {f.name for f in caffe_pb2.BlobProto.DESCRIPTOR.fields if f.GetOptions().packed}
    assert packed == {"data", "diff", "double_data", "double_diff"}
    assert not caffe_pb2.Datum.DESCRIPTOR.fields_by_name["float_data"].GetOptions().packed
    assert numbers(caffe_pb2.BlobShape) == {"dim": 1}
    assert caffe_pb2.BlobShape.DESCRIPTOR.fields_by_name["dim"].GetOptions().packed
    layer = numbers(caffe_pb2.LayerParameter)
    assert (layer["transform_param"], layer["data_param"], layer["blobs"]) == (100, 107, 7)
    assert numbers(caffe_pb2.NetParameter)["layer"] == 100


def test_packed_fields_are_written_packed() -> None:
    """Caffe declares BlobProto.data packed: tag 5 with wire type 2, one length."""
    wire = caffe_pb2.BlobProto(data=[1.0, 2.0]).SerializeToString()
    assert wire == b"\x2a\x08" + b"\x00\x00\x80\x3f" + b"\x00\x00\x00\x40"
    unpacked = caffe_pb2.Datum(float_data=[1.0]).SerializeToString()
    assert unpacked == b"\x35" + b"\x00\x00\x80\x3f"  # Datum.float_data is not packed


def test_caffe_written_records_round_trip_byte_for_byte() -> None:
    for _, value in lmdb_items(CAFFE / "lmdb" / "raw_color"):
        datum = caffe_pb2.Datum.FromString(value)
        assert datum.HasField("encoded") and not datum.encoded
        assert datum.SerializeToString() == value


def test_caffe_written_mean_file_round_trips_byte_for_byte() -> None:
    value = (CAFFE / "raw_color_mean.binaryproto").read_bytes()
    assert caffe_pb2.BlobProto.FromString(value).SerializeToString() == value
