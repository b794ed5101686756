"""Caffe's protobuf messages: the one module that reads and writes them.

Everything that parses or builds a ``caffe.*`` message lives here, and the rest
of blobpipe works on NumPy arrays and Python values:

* ``BlobProto`` (``.binaryproto``, a mean image): Caffe's rules for reading one
  are :func:`blob_shape` (the legacy num/channels/height/width fields when any
  is set, else ``shape.dim``) and :func:`blob_values` (``double_data`` when it
  is not empty, else ``data``; the diff likewise; every count checked against
  the shape before anything the shape sizes is allocated). ``Blob.from_proto``
  and :func:`load_mean_file` use them; :func:`fill_blobproto` and
  :func:`blobproto_bytes` write one (``Blob.to_proto``, ``compute_mean``).
* ``NetParameter``: a ``.caffemodel``'s parameter blobs (:func:`caffemodel_blobs`)
  and a net prototxt's ``Data`` layer (:func:`parse_net`,
  :func:`data_layer_fields`), with Caffe's layer filtering and its V1 upgrade.
* ``TransformationParameter``: its fields as keyword arguments of
  ``Transform`` (:func:`transform_fields`).

Protobuf's ``DecodeError`` is turned into :class:`ProtoError` in one place
(:func:`_decode`); every message names the file and what to do about it.

It converts protobuf ↔ NumPy and Python values only and sits below Blob (its
place in the layers: ``docs/design.md``): Blob's ``from_proto``/``to_proto`` are
:func:`proto_arrays`, :func:`proto_shape_equals` and :func:`fill_blobproto`; the
functions that make Blobs of files (``read_blobproto``, ``read_caffemodel``,
``write_blobproto``) are in ``_blobfile.py``, above Blob.
"""

from __future__ import annotations

import math
import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, TypedDict, TypeVar

import numpy as np
import numpy.typing as npt
from google.protobuf import text_format
from google.protobuf.message import DecodeError, Message

from ._errors import FileMissingError, ProtoError, ShapeError
from ._proto.caffe_pb2 import (
    TEST,
    TRAIN,
    BlobProto,
    DataParameter,
    LayerParameter,
    NetParameter,
    NetStateRule,
    TransformationParameter,
    V1LayerParameter,
)
from ._shape import MAX_BLOB_AXES, format_shape, validate_shape

__all__ = [
    "DATA_LAYER_TYPES",
    "BlobProto",
    "DataLayerFields",
    "TransformFields",
    "TransformationParameter",
    "blob_shape",
    "blob_values",
    "blobproto_array",
    "blobproto_bytes",
    "caffemodel_blobs",
    "data_layer_fields",
    "decode_blobproto",
    "fill_blobproto",
    "load_mean_file",
    "parse_net",
    "proto_arrays",
    "proto_shape_equals",
    "read_blobproto_file",
    "transform_fields",
]

StrPath = str | os.PathLike[str]
_M = TypeVar("_M", bound=Message)

_LEGACY_FIELDS: Final = ("num", "channels", "height", "width")
_INT_MAX: Final = 2**31 - 1
_DEPRECATED_DATA_FIELDS: Final = ("scale", "mean_file", "crop_size", "mirror")
#: The data layers a net prototxt is read for, and the V1 fields that mark each.
DATA_LAYER_TYPES: Final = ("Data", "ImageData", "HDF5Data")
_V1_DATA_PARAMS: Final = ("data_param", "image_data_param", "hdf5_data_param")

_BLOBPROTO_FIX: Final = (
    "expected a binary caffe.BlobProto such as Caffe's compute_image_mean writes; "
    "check the path, or write the file again (e.g. `blobpipe compute-mean DB OUT.binaryproto`)"
)
_CAFFEMODEL_FIX: Final = (
    "expected the binary .caffemodel Caffe writes with its weights (a net .prototxt "
    "is text; read it with read_data_layer); check the path"
)


# -- decoding --------------------------------------------------------------------------


def _decode(message: _M, data: bytes, label: str, what: str, fix: str = "") -> _M:
    """Parse ``data`` into ``message``; the one place protobuf's DecodeError is caught."""
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        hint = f"; {fix}" if fix else ""
        raise ProtoError(f"{label} is not a {what}: {exc}{hint}") from exc
    return message


def _file_bytes(path: StrPath, label: str) -> bytes:
    """The bytes of the regular file ``path``, read by its size. Anything else (a FIFO,
    whose read waits for a writer; a device such as ``/dev/zero``, which never ends;
    a directory) is refused before a byte is read: its open does not block
    (``O_NONBLOCK``) and nothing is sized by what it would deliver.

    Raises:
        FileMissingError: no such file (a FileNotFoundError).
        ProtoError: not a regular file, or it cannot be read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        raise FileMissingError(f"{label} does not exist", path=path) from exc
    except IsADirectoryError:
        fd = -1
    except OSError as exc:
        raise ProtoError(f"{label} cannot be read: {exc}") from exc
    try:
        mode = os.stat(path).st_mode if fd < 0 else os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a directory" if stat.S_ISDIR(mode)
                else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "a socket or other special file"
            )  # fmt: skip
            raise ProtoError(
                f"{label} is not a regular file ({kind}); give the path of the file "
                "itself (a .binaryproto written by compute_image_mean or Caffe)"
            )
        size = os.fstat(fd).st_size
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(size)
    except OSError as exc:
        raise ProtoError(f"{label} cannot be read: {exc}") from exc
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) != size:
        raise ProtoError(f"{label} changed while it was read ({size} bytes, then {len(data)})")
    return data


def _read(message: _M, path: StrPath, label: str, what: str, fix: str) -> _M:
    """Read the regular file ``path`` into ``message`` (see :func:`_file_bytes`)."""
    return _decode(message, _file_bytes(path, label), label, what, fix)


def decode_blobproto(data: bytes, label: str = "the record") -> BlobProto:
    """One serialized ``caffe.BlobProto`` (an LMDB record, say) as a message.

    Raises ProtoError when ``data`` does not parse; ``label`` names the bytes in
    the message (the caller adds where they came from).
    """
    return _decode(BlobProto(), data, label, "valid caffe.BlobProto")


# -- BlobProto: Caffe's reading rules ---------------------------------------------------


def blob_shape(proto: BlobProto) -> tuple[tuple[int, ...], bool]:
    """A BlobProto's dims and whether they come from the legacy fields (Caffe's rule).

    When any of num/channels/height/width is set, the shape is those four (an
    unset one reads 0, as in Caffe); else it is ``shape.dim``. The dims are
    not validated.
    """
    if any(proto.HasField(name) for name in _LEGACY_FIELDS):
        return (proto.num, proto.channels, proto.height, proto.width), True
    return tuple(int(d) for d in proto.shape.dim), False


def _value_field(proto: BlobProto, name: str) -> str:
    # Caffe's FromProto: double_data (double_diff) when it has values, else data (diff).
    double = f"double_{name}"
    return double if len(getattr(proto, double)) else name


def _as_array(proto: BlobProto, field: str) -> npt.NDArray[np.floating[Any]]:
    values = getattr(proto, field)
    dtype = np.float64 if field.startswith("double") else np.float32
    # upb's repeated fields expose a buffer: np.array copies it at memory speed
    # (np.fromiter walks the elements one by one, ~250x slower)
    return np.array(values, dtype=dtype).reshape(len(values))


def blob_values(
    proto: BlobProto, count: int, shape_text: str
) -> tuple[npt.NDArray[np.floating[Any]], npt.NDArray[np.floating[Any]] | None]:
    """The data and diff values of ``proto`` as flat arrays (Caffe's rule).

    ``double_data`` is read when it is not empty (float64), else ``data``
    (float32); the diff likewise, ``None`` when the proto has none. Both
    counts are checked against ``count`` before either array is made.

    Raises ProtoError naming ``shape_text`` when a count differs.
    """
    data_field = _value_field(proto, "data")
    n = len(getattr(proto, data_field))
    if n != count:
        raise ProtoError(
            f"BlobProto of shape {shape_text} has {n} values in {data_field}, expected {count}"
        )
    diff_field = _value_field(proto, "diff")
    n_diff = len(getattr(proto, diff_field))
    if n_diff not in (0, count):
        raise ProtoError(
            f"BlobProto of shape {shape_text} has {n_diff} values in {diff_field}, "
            f"expected {count} (or none)"
        )
    diff = _as_array(proto, diff_field) if n_diff else None
    return _as_array(proto, data_field), diff


def blobproto_array(data: bytes | bytearray | memoryview, label: str = "the record") -> np.ndarray:
    """One serialized ``caffe.BlobProto`` (an LMDB record) as an array of its shape.

    Caffe's rules: the legacy num/channels/height/width shape when any is set,
    else ``shape.dim``; ``double_data`` (float64) when it is not empty, else
    ``data`` (float32). The diff is ignored. Nothing is sized by the shape's
    claims: the values are counted first and must equal the shape's count.

    Raises:
        ProtoError: not a BlobProto, a negative or absurd dimension, or a value
            count that does not match the shape (``label`` names the bytes).
    """
    proto = _decode(BlobProto(), bytes(data), label, "valid caffe.BlobProto")
    shape, legacy = blob_shape(proto)
    fields = "num/channels/height/width" if legacy else "shape"
    if len(shape) > MAX_BLOB_AXES:
        raise ProtoError(
            f"{label} is a BlobProto of {len(shape)} axes; a Caffe blob has at most {MAX_BLOB_AXES}"
        )
    if any(d < 0 for d in shape):
        raise ProtoError(f"{label} is a BlobProto with a negative dimension in {fields}: {shape}")
    if any(d > _INT_MAX for d in shape):
        raise ProtoError(
            f"{label} is a BlobProto with a dimension above {_INT_MAX} in {fields}: {shape} "
            "(Caffe's blob dimensions are int32)"
        )
    count = 1
    nonzero = 1  # what numpy checks: the dims' product, zeros left out, must be addressable
    for d in shape:
        count *= int(d)  # Python ints: no overflow
        nonzero *= max(int(d), 1)
    if nonzero * 8 > sys.maxsize:
        raise ProtoError(
            f"{label} is a BlobProto of shape {shape}, which no array can have (the product "
            "of its dimensions exceeds what this platform can address)"
        )
    try:
        values, _ = blob_values(proto, count, format_shape(shape, count))
    except ProtoError as exc:
        raise ProtoError(f"{label}: {exc}") from None
    return values.reshape(shape)


def proto_shape_equals(proto: BlobProto, shape: tuple[int, ...]) -> bool:
    """Whether ``proto``'s shape equals ``shape`` (Caffe's ``Blob::ShapeEquals``): with
    legacy fields, ``shape`` must have at most 4 axes and match them padded with
    leading 1s (legacy parameter blobs were indexed from the end)."""
    dims, legacy = blob_shape(proto)
    if legacy:
        return len(shape) <= 4 and (1,) * (4 - len(shape)) + tuple(shape) == dims
    return dims == shape


def proto_arrays(
    proto: BlobProto,
    itemsize: int,
    expected: tuple[tuple[int, ...], int] | None,
    blob_text: str,
) -> tuple[tuple[int, ...], npt.NDArray[np.floating[Any]], npt.NDArray[np.floating[Any]] | None]:
    """What ``Blob.from_proto`` loads: the proto's shape (checked as a blob's shape of
    ``itemsize``-byte elements) and its data and diff values (Caffe's rules); with
    ``expected`` (no reshape: the blob's shape and count), the proto's shape must
    equal it.

    Raises:
        ProtoError: an unusable shape, or value counts that differ from the shape's.
        ShapeError: the shape differs from ``expected`` (``blob_text`` names the blob).
    """
    if expected is None:
        try:
            shape, count = validate_shape(blob_shape(proto)[0], itemsize)
        except ShapeError as exc:
            raise ProtoError(f"BlobProto has an unusable shape: {exc}") from exc
    else:
        shape, count = expected
        if not proto_shape_equals(proto, shape):
            dims, legacy = blob_shape(proto)
            text = " ".join(str(d) for d in dims)
            text = f"legacy {text}" if legacy else text or "()"
            raise ShapeError(
                f"from_proto: shape mismatch (reshape not set): blob {blob_text}, proto {text}"
            )
    data, diff = blob_values(proto, count, format_shape(shape, count))
    return shape, data, diff


def load_mean_file(path: StrPath) -> npt.NDArray[np.float32]:
    """Read a Caffe mean file (a binary ``BlobProto``) as a float32 ``(C, H, W)`` array.

    The blob's shape comes from the legacy ``num/channels/height/width`` fields
    when any is set (as ``compute_image_mean`` writes them), else from ``shape``;
    ``double_data`` is used when present, as in Caffe's ``Blob::FromProto``.

    Raises:
        FileNotFoundError: the file does not exist.
        ProtoError: the file is not a regular file (a FIFO, a device, a directory:
            refused before anything is read), not a BlobProto, its data count does
            not match its shape, or it holds more than one image (num > 1).
    """
    label = f"mean file {str(path)!r}"
    proto = _read(BlobProto(), path, label, "serialized caffe.BlobProto", _BLOBPROTO_FIX)
    shape, _ = blob_shape(proto)
    field = _value_field(proto, "data")
    n = len(getattr(proto, field))
    count = math.prod(int(d) for d in shape) if shape else 0  # exact: no overflow
    if len(shape) not in (3, 4) or count == 0 or n != count:
        raise ProtoError(
            f"{label}: shape {shape} with {n} values; expected a "
            "(1, C, H, W) or (C, H, W) blob with C*H*W values"
        )
    if len(shape) == 4:
        if shape[0] != 1:
            raise ProtoError(f"{label} holds {shape[0]} images (shape {shape}); expected num == 1")
        shape = shape[1:]
    values = _as_array(proto, field).astype(np.float32, copy=False)
    return np.ascontiguousarray(values.reshape(shape))


# -- BlobProto: writing -----------------------------------------------------------------


def fill_blobproto(
    proto: BlobProto | None,
    shape: Sequence[int],
    data: npt.NDArray[np.floating[Any]] | None,
    diff: npt.NDArray[np.floating[Any]] | None = None,
    *,
    legacy: bool = False,
) -> BlobProto:
    """``proto`` (cleared; a new one when None) holding ``shape``, ``data`` and ``diff``.

    float64 arrays go to ``double_data``/``double_diff``, float32 ones to
    ``data``/``diff``. The shape is written to ``shape.dim``, or with
    ``legacy`` to num/channels/height/width (at most 4 axes, padded with
    leading 1s), as ``compute_image_mean`` writes a mean.
    """
    if proto is None:
        proto = BlobProto()
    else:
        proto.Clear()
    if legacy:
        if len(shape) > 4:
            raise ValueError(f"the legacy BlobProto fields hold at most 4 axes, got {shape}")
        padded = (1,) * (4 - len(shape)) + tuple(shape)
        proto.num, proto.channels, proto.height, proto.width = padded
    else:
        proto.shape.dim.extend(shape)
    for name, values in (("data", data), ("diff", diff)):
        if values is not None and values.size:
            field = f"double_{name}" if values.dtype == np.float64 else name
            getattr(proto, field).extend(values.reshape(-1).tolist())
    return proto


def blobproto_bytes(
    data: npt.NDArray[np.floating[Any]],
    diff: npt.NDArray[np.floating[Any]] | None = None,
    *,
    legacy: bool = False,
) -> bytes:
    """``data`` (and ``diff``) serialized as a ``caffe.BlobProto`` of ``data.shape``.

    See :func:`fill_blobproto`; ``legacy=True`` writes a mean file exactly as
    Caffe's ``compute_image_mean`` does for a ``(1, C, H, W)`` array.
    """
    return fill_blobproto(None, data.shape, data, diff, legacy=legacy).SerializeToString()


# -- Blob files: the messages (``_blobfile.py`` makes Blobs of them) -------------------------


def read_blobproto_file(path: StrPath) -> BlobProto:
    """The ``caffe.BlobProto`` in the ``.binaryproto`` file ``path``.

    Raises FileNotFoundError, ProtoError (an unparsable file; the message names it).
    """
    return _read(BlobProto(), path, repr(os.fspath(path)), "valid caffe.BlobProto", _BLOBPROTO_FIX)


def caffemodel_blobs(path: StrPath) -> list[tuple[str, list[BlobProto]]]:
    """The parameter blobs of the ``.caffemodel`` file ``path``, per layer with blobs:
    layers in file order, from the ``layer`` field then the legacy V1 ``layers``.

    Raises FileNotFoundError, ProtoError (an unparsable file, two layers with blobs
    under one name).
    """
    where = os.fspath(path)
    net = _read(
        NetParameter(), path, repr(where), "valid caffe.NetParameter (.caffemodel)", _CAFFEMODEL_FIX
    )
    result: list[tuple[str, list[BlobProto]]] = []
    names: set[str] = set()
    layers: list[LayerParameter | V1LayerParameter] = [*net.layer, *net.layers]
    for layer in layers:
        if not len(layer.blobs):
            continue
        if layer.name in names:
            raise ProtoError(
                f"{where!r}: two layers named {layer.name!r} hold blobs; cannot tell "
                "their parameters apart"
            )
        names.add(layer.name)
        result.append((layer.name, list(layer.blobs)))
    return result


# -- TransformationParameter -------------------------------------------------------------


class TransformFields(TypedDict):
    """A ``caffe.TransformationParameter`` as keyword arguments of ``Transform``."""

    scale: float
    mirror: bool
    crop_size: int
    mean_file: str | None
    mean_value: tuple[float, ...]
    force_color: bool
    force_gray: bool


def transform_fields(param: TransformationParameter, base_dir: StrPath = ".") -> TransformFields:
    """The fields of ``param`` as ``Transform(**fields)`` keyword arguments.

    ``mean_file`` is None when unset; a relative one is joined to ``base_dir``
    unless that is ``"."`` or ``""`` (Caffe resolves it against the current
    directory, the default).

    Raises:
        ProtoError: ``param`` sets both ``mean_file`` and ``mean_value``.
    """
    if param.HasField("mean_file") and len(param.mean_value):
        raise ProtoError(
            "cannot specify mean_file and mean_value at the same time (Caffe's "
            f"DataTransformer refuses it): the transform_param sets mean_file "
            f"{param.mean_file!r} and mean_value {list(param.mean_value)}; keep one"
        )
    mean_file: str | None = None
    if param.HasField("mean_file"):
        base = os.fspath(base_dir)
        mean_file = param.mean_file
        if base not in ("", "."):
            mean_file = os.path.join(base, mean_file)
    return TransformFields(
        scale=param.scale,
        mirror=param.mirror,
        crop_size=param.crop_size,
        mean_file=mean_file,
        mean_value=tuple(param.mean_value),
        force_color=param.force_color,
        force_gray=param.force_gray,
    )


# -- net prototxt: the Data layer -------------------------------------------------------


@dataclass(frozen=True)
class DataLayerFields:
    """What a net prototxt's selected data layer (``Data``, ``ImageData`` or
    ``HDF5Data``) sets, as plain values; fields another type lacks keep their
    defaults (Caffe's)."""

    name: str
    source: str
    batch_size: int
    prefetch: int
    rand_skip: int
    tops: tuple[str, ...]
    transform: TransformFields
    type: str = "Data"
    backend: str = "leveldb"  # Data: data_param.backend, "lmdb" or "leveldb"
    backend_set: bool = False  # the prototxt names the backend (else protobuf's default)
    shuffle: bool = False  # ImageData, HDF5Data
    root_folder: str = ""  # ImageData
    new_height: int = 0
    new_width: int = 0
    is_color: bool = True
    has_transform: bool = False  # a transform_param block is present


def parse_net(text: str, where: str = "<string>") -> NetParameter:
    """Parse a net prototxt, skipping fields and layers this project does not model.

    Raises:
        ProtoError: the text is not a valid NetParameter prototxt.
    """
    net = NetParameter()
    try:
        text_format.Parse(text, net, allow_unknown_field=True)
    except text_format.ParseError as exc:
        raise ProtoError(f"{where}: cannot parse the net prototxt: {exc}") from exc
    return net


def _state_meets_rule(rule: NetStateRule, phase: int, level: int, stages: frozenset[str]) -> bool:
    if rule.HasField("phase") and rule.phase != phase:
        return False
    if rule.HasField("min_level") and level < rule.min_level:
        return False
    if rule.HasField("max_level") and level > rule.max_level:
        return False
    if any(s not in stages for s in rule.stage):
        return False
    return not any(s in stages for s in rule.not_stage)


def _included(
    layer: LayerParameter | V1LayerParameter,
    where: str,
    phase: int,
    level: int,
    stages: frozenset[str],
) -> bool:
    if len(layer.include) and len(layer.exclude):
        raise ProtoError(
            f"{where}: layer {layer.name!r} has both include and exclude rules; "
            "specify either include rules or exclude rules, not both (as Caffe requires)"
        )
    included = len(layer.include) == 0
    for rule in layer.exclude:
        if _state_meets_rule(rule, phase, level, stages):
            included = False
    for rule in layer.include:
        if _state_meets_rule(rule, phase, level, stages):
            included = True
    return included


def _rules_text(layer: LayerParameter | V1LayerParameter) -> str:
    def one(rule: NetStateRule) -> str:
        return text_format.MessageToString(rule, as_one_line=True) or "any"

    if len(layer.include):
        return "include " + " | ".join(one(r) for r in layer.include)
    if len(layer.exclude):
        return "exclude " + " | ".join(one(r) for r in layer.exclude)
    return "all phases"


def data_layer_fields(
    text: str,
    where: str,
    phase: str,
    *,
    name: str | None = None,
    level: int = 0,
    stages: Sequence[str] = (),
) -> DataLayerFields:
    """The data layer (``Data``, ``ImageData``, ``HDF5Data``) of the net prototxt
    ``text`` that runs in ``phase``.

    Layers are selected as Caffe's ``Net::FilterNet`` does (``phase`` is
    "train" or "test"; ``stages`` add to the file's ``state { stage }``); V1
    layers are upgraded as ``UpgradeNetDataTransformation`` does. ``where``
    names the file in messages.

    Raises:
        ProtoError: the text does not parse; no data layer (or several, without
            ``name``) is selected; ``source`` or ``batch_size`` is missing;
            deprecated transform fields in a new-format layer; an ImageData
            layer with only one of new_height and new_width.
    """
    net = parse_net(text, where)
    phase_enum = TRAIN if phase == "train" else TEST
    all_stages = frozenset(net.state.stage) | frozenset(stages)

    candidates: list[tuple[LayerParameter | V1LayerParameter, bool]] = []
    found: list[str] = []
    for layer in net.layer:
        found.append(f"{layer.name!r} (type {layer.type!r}, {_rules_text(layer)})")
        if layer.type in DATA_LAYER_TYPES and _included(
            layer, where, phase_enum, level, all_stages
        ):
            candidates.append((layer, False))
    for v1 in net.layers:
        is_data = any(v1.HasField(f) for f in _V1_DATA_PARAMS)
        found.append(f"{v1.name!r} (V1 {'data ' if is_data else ''}layer, {_rules_text(v1)})")
        if is_data and _included(v1, where, phase_enum, level, all_stages):
            candidates.append((v1, True))
    if name is not None:
        candidates = [c for c in candidates if c[0].name == name]
    kinds = "/".join(DATA_LAYER_TYPES)
    if not candidates:
        wanted = f"{kinds} layer" if name is None else f"{kinds} layer named {name!r}"
        listing = "; ".join(found) if found else "none"
        raise ProtoError(
            f"{where}: no {wanted} runs in phase {phase.upper()}; layers found: {listing}"
        )
    if len(candidates) > 1:
        names = ", ".join(repr(c[0].name) for c in candidates)
        raise ProtoError(
            f"{where}: several {kinds} layers run in phase {phase.upper()} ({names}); "
            "choose one with name=..."
        )
    chosen, is_v1 = candidates[0]
    return _layer_fields(chosen, is_v1, where)


def _layer_fields(
    layer: LayerParameter | V1LayerParameter, is_v1: bool, where: str
) -> DataLayerFields:
    label = f"{where}: layer {layer.name!r}"
    if isinstance(layer, V1LayerParameter):
        kind = next(t for t, f in zip(DATA_LAYER_TYPES, _V1_DATA_PARAMS, strict=True)
                    if layer.HasField(f))  # fmt: skip
    else:
        kind = layer.type
    tp = TransformationParameter()
    tp.CopyFrom(layer.transform_param)
    if kind == "HDF5Data":
        hp = layer.hdf5_data_param
        if not hp.source:
            raise ProtoError(f"{label} has no hdf5_data_param.source")
        if hp.batch_size <= 0:
            raise ProtoError(f"{label} needs hdf5_data_param.batch_size > 0, got {hp.batch_size}")
        return DataLayerFields(
            name=layer.name, source=hp.source, batch_size=int(hp.batch_size), prefetch=0,
            rand_skip=0, tops=tuple(layer.top), transform=transform_fields(tp), type=kind,
            shuffle=bool(hp.shuffle), has_transform=layer.HasField("transform_param"),
        )  # fmt: skip
    param = layer.image_data_param if kind == "ImageData" else layer.data_param
    prefix = "image_data_param" if kind == "ImageData" else "data_param"
    deprecated = [f for f in _DEPRECATED_DATA_FIELDS if param.HasField(f)]
    if deprecated and not is_v1:
        fields = ", ".join(f"{prefix}.{f}" for f in deprecated)
        raise ProtoError(
            f"{label} sets deprecated {fields}, which Caffe ignores in a `layer` block; "
            "move them into transform_param { ... }"
        )
    for field in deprecated:  # Caffe's UpgradeNetDataTransformation for V1 layers
        setattr(tp, field, getattr(param, field))
    if not param.source:
        raise ProtoError(f"{label} has no {prefix}.source")
    if param.batch_size <= 0:
        raise ProtoError(f"{label} needs {prefix}.batch_size > 0, got {param.batch_size}")
    if kind == "ImageData":
        ip = layer.image_data_param
        if (ip.new_height == 0) != (ip.new_width == 0):
            raise ProtoError(
                f"{label} sets only one of image_data_param.new_height ({ip.new_height}) "
                f"and new_width ({ip.new_width}); Caffe resizes only with both: set both, "
                "or neither"
            )
        return DataLayerFields(
            name=layer.name, source=ip.source, batch_size=int(ip.batch_size), prefetch=4,
            rand_skip=int(ip.rand_skip), tops=tuple(layer.top), transform=transform_fields(tp),
            type=kind, shuffle=bool(ip.shuffle), root_folder=ip.root_folder,
            new_height=int(ip.new_height), new_width=int(ip.new_width),
            is_color=bool(ip.is_color), has_transform=layer.HasField("transform_param"),
        )  # fmt: skip
    dp = layer.data_param
    return DataLayerFields(
        name=layer.name,
        source=dp.source,
        batch_size=int(dp.batch_size),
        prefetch=int(dp.prefetch),
        rand_skip=int(dp.rand_skip),
        tops=tuple(layer.top),
        transform=transform_fields(tp),
        type=kind,
        backend="lmdb" if dp.backend == DataParameter.LMDB else "leveldb",
        backend_set=dp.HasField("backend"),
        has_transform=layer.HasField("transform_param"),
    )
