"""read_data_layer: Caffe net prototxts, layer filtering by phase, data/transform params."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from blobpipe._errors import ProtoError
from blobpipe._io._prototxt import DataLayerConfig, parse_net, read_data_layer

CAFFE = Path(__file__).parent / "data" / "caffe"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    return path


def _data_layer(
    name: str, rules: str = "", *, extra: str = "", source: str = "db", backend: str = "LMDB"
) -> str:
    backend_line = f"backend: {backend}" if backend else ""
    return f"""
layer {{
  name: "{name}" type: "Data" top: "data" top: "label"
  {rules}
  data_param {{ source: "{source}" batch_size: 4 {backend_line} }}
  {extra}
}}
"""


@pytest.mark.parametrize(
    "case",
    [
        "raw_color_b8",
        "raw_color_b8_meanfile_scale",
        "raw_color_b8_meanvalue_crop24",
        "encoded_jpg_b8",
    ],
)
def test_reference_prototxts(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    cfg = read_data_layer(f"ref/{case}/net.prototxt", "test")
    assert isinstance(cfg, DataLayerConfig)
    assert cfg.name == "data"
    assert cfg.batch_size == 8
    assert cfg.prefetch == 4
    assert cfg.tops == ("data", "label")
    assert cfg.labels
    assert cfg.source == ("lmdb/encoded_jpg" if case.startswith("encoded") else "lmdb/raw_color")
    t = cfg.transform
    if case == "raw_color_b8_meanfile_scale":
        assert t.scale == np.float32(0.017)
        assert t.mean_file == "raw_color_mean.binaryproto"
        assert t.mean_array((3, 32, 40)) is not None
    if case == "raw_color_b8_meanvalue_crop24":
        assert (t.crop_size, t.mean_value) == (24, (104.0, 117.0, 123.0))
    kwargs = cfg.batches_kwargs()
    assert kwargs["batch_size"] == 8
    assert kwargs["phase"] == "test"
    assert kwargs["transform"] is t
    # Only the TEST phase has a Data layer in these nets.
    with pytest.raises(
        ProtoError,
        match=r"no Data/ImageData/HDF5Data layer runs in phase TRAIN; layers found: 'data'",
    ):
        read_data_layer(f"ref/{case}/net.prototxt", "train")


def test_unknown_layers_and_nested_fields_are_skipped(tmp_path: Path) -> None:
    text = (CAFFE / "model" / "tiny.prototxt").read_text() + _data_layer(
        "d",
        extra="""
  transform_param { mirror: true crop_size: 2 future_field: 3 future_param { a: 1 b { c: "x" } } }
  made_up_param { x: 1 y: [1, 2] z { w: "v" } }
""",
    )
    text = text.replace("batch_size: 4", "batch_size: 4 some_new_option: true nested { q: 1 }")
    cfg = read_data_layer(_write(tmp_path, text), "train")
    assert cfg.name == "d"
    assert cfg.transform.mirror
    assert cfg.transform.crop_size == 2
    # tiny.prototxt alone has no Data layer: the error lists what it found.
    with pytest.raises(
        ProtoError,
        match=r"no Data/ImageData/HDF5Data layer runs in phase TEST; layers found: "
        r"'data' \(type 'Input', all phases\); 'conv1' \(type 'Convolution'",
    ):
        read_data_layer(CAFFE / "model" / "tiny.prototxt", "test")


def test_phase_selection_include_exclude(tmp_path: Path) -> None:
    text = (
        _data_layer("train_data", "include { phase: TRAIN }", source="train_db")
        + _data_layer("test_data", "include { phase: TEST }", source="test_db")
        + 'layer { name: "loss" type: "SoftmaxWithLoss" exclude { phase: TEST } }'
    )
    path = _write(tmp_path, text)
    assert read_data_layer(path, "train").source == "train_db"
    assert read_data_layer(path, "test").source == "test_db"
    # exclude rules
    text = _data_layer("not_test", "exclude { phase: TEST }", source="a")
    path = _write(tmp_path, text)
    assert read_data_layer(path, "train").name == "not_test"
    with pytest.raises(ProtoError, match="no Data/ImageData/HDF5Data layer runs in phase TEST"):
        read_data_layer(path, "test")
    # no rules: both phases
    path = _write(tmp_path, _data_layer("both"))
    assert read_data_layer(path, "train").name == read_data_layer(path, "test").name == "both"


def test_levels_and_stages(tmp_path: Path) -> None:
    text = (
        _data_layer("deploy", 'include { phase: TEST stage: "deploy" }', source="d")
        + _data_layer("val", 'include { phase: TEST not_stage: "deploy" max_level: 1 }', source="v")
        + _data_layer("hi", "include { phase: TEST min_level: 2 }", source="h")
    )
    path = _write(tmp_path, text)
    assert read_data_layer(path, "test").name == "val"
    assert read_data_layer(path, "test", stages=["deploy"]).name == "deploy"
    assert read_data_layer(path, "test", level=2).name == "hi"
    net_state = 'state { stage: "deploy" }\n' + text
    assert read_data_layer(_write(tmp_path, net_state), "test").name == "deploy"


def test_several_matching_layers_need_a_name(tmp_path: Path) -> None:
    path = _write(tmp_path, _data_layer("a", source="x") + _data_layer("b", source="y"))
    with pytest.raises(
        ProtoError, match=r"several Data/ImageData/HDF5Data layers run in phase TRAIN \('a', 'b'\)"
    ):
        read_data_layer(path)
    assert read_data_layer(path, name="b").source == "y"
    with pytest.raises(ProtoError, match="no Data/ImageData/HDF5Data layer named 'c' runs"):
        read_data_layer(path, name="c")


def test_include_and_exclude_together_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, _data_layer("x", "include { phase: TRAIN } exclude { phase: TEST }"))
    with pytest.raises(ProtoError, match="both include and exclude rules"):
        read_data_layer(path)


def test_the_backend_must_be_what_the_source_holds(tmp_path: Path) -> None:
    lmdb, leveldb = CAFFE / "lmdb" / "raw_color", CAFFE / "leveldb" / "raw_color"
    with pytest.raises(
        ProtoError,
        match=r"reads backend LEVELDB \(LEVELDB is protobuf's default when data_param sets no "
        r"backend\), but its source .* holds an LMDB, which Caffe cannot open so: set "
        r"`backend: LMDB`",
    ):
        read_data_layer(_write(tmp_path, _data_layer("d", source=str(lmdb), backend="")))
    with pytest.raises(ProtoError, match=r"reads backend LEVELDB, but its source"):
        read_data_layer(_write(tmp_path, _data_layer("d", source=str(lmdb), backend="LEVELDB")))
    config = read_data_layer(_write(tmp_path, _data_layer("d", source=str(leveldb), backend="")))
    assert (config.backend, config.source) == ("leveldb", str(leveldb))
    # a source that does not exist (yet): the reader names it when it opens it
    assert read_data_layer(_write(tmp_path, _data_layer("d", backend=""))).backend == "leveldb"


def test_missing_source_or_batch_size(tmp_path: Path) -> None:
    path = _write(tmp_path, 'layer { name: "d" type: "Data" data_param { backend: LMDB } }')
    with pytest.raises(ProtoError, match=r"layer 'd' has no data_param\.source"):
        read_data_layer(path)
    path = _write(
        tmp_path, 'layer { name: "d" type: "Data" data_param { source: "x" backend: LMDB } }'
    )
    with pytest.raises(ProtoError, match=r"needs data_param\.batch_size > 0, got 0"):
        read_data_layer(path)


def test_deprecated_data_param_transform_fields(tmp_path: Path) -> None:
    text = """
layer { name: "d" type: "Data"
  data_param { source: "x" batch_size: 2 backend: LMDB scale: 0.5 mirror: true } }
"""
    with pytest.raises(
        ProtoError,
        match=r"deprecated data_param.scale, data_param.mirror, which Caffe ignores in a `layer` "
        r"block; move them into transform_param",
    ):
        read_data_layer(_write(tmp_path, text))


def test_v1_layers_are_upgraded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    text = """
name: "old"
layers { name: "conv" type: CONVOLUTION convolution_param { num_output: 2 } }
layers {
  name: "data" type: DATA top: "data"
  include { phase: TRAIN }
  data_param {
    source: "lmdb/raw_color" batch_size: 3 backend: LMDB
    scale: 0.25 mean_file: "raw_color_mean.binaryproto" crop_size: 8 mirror: true
  }
}
"""
    cfg = read_data_layer(_write(tmp_path, text), "train")
    assert (cfg.name, cfg.batch_size, cfg.tops, cfg.labels) == ("data", 3, ("data",), False)
    t = cfg.transform
    assert (t.scale, t.crop_size, t.mirror) == (np.float32(0.25), 8, True)
    assert t.mean_file == "raw_color_mean.binaryproto"


def test_mean_file_relative_to_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = _data_layer("d", extra='transform_param { mean_file: "raw_color_mean.binaryproto" }')
    path = _write(tmp_path, text)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_data_layer(path)
    monkeypatch.chdir(CAFFE)
    assert read_data_layer(path).transform.mean_file == "raw_color_mean.binaryproto"


def test_mean_file_and_mean_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CAFFE)
    text = _data_layer(
        "d", extra='transform_param { mean_file: "raw_color_mean.binaryproto" mean_value: 1 }'
    )
    with pytest.raises(ProtoError, match="cannot specify mean_file and mean_value"):
        read_data_layer(_write(tmp_path, text))


def test_parse_errors(tmp_path: Path) -> None:
    with pytest.raises(ProtoError, match=r"net\.prototxt: cannot parse the net prototxt"):
        read_data_layer(_write(tmp_path, "layer { name: "))
    with pytest.raises(ProtoError, match="cannot parse"):
        parse_net("layer { include { phase: VALIDATE } }")
    with pytest.raises(FileNotFoundError):
        read_data_layer(tmp_path / "missing.prototxt")
    with pytest.raises(ValueError, match="phase must be"):
        read_data_layer(_write(tmp_path, _data_layer("d")), "val")  # type: ignore[arg-type]


def test_layout_and_dtype_pass_through(tmp_path: Path) -> None:
    cfg = read_data_layer(_write(tmp_path, _data_layer("d")), layout="NHWC", dtype="uint8")
    assert cfg.transform.layout == "NHWC"
    assert cfg.transform.dtype == np.uint8
