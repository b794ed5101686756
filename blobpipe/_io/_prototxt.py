"""Reading a Caffe net prototxt's ``Data`` layer.

Only what a data pipeline needs is read: the ``Data`` layers, their include/exclude
rules, ``data_param`` and ``transform_param``. Every other layer type and every
field this project's ``caffe.proto`` subset does not know (``convolution_param``
and the like, V1 ``type: DATA`` enums) is skipped by protobuf's text parser
(``allow_unknown_field=True`` skips unknown scalar *and* nested message fields).

Layer selection follows Caffe's ``Net::FilterNet``/``StateMeetsRule``: a layer with
no include rules is in unless an exclude rule matches; a layer with include
rules is in when one of them matches. A rule matches when its phase (if set)
equals the requested phase, the level lies within ``min_level``/``max_level``,
every ``stage`` is among the net's stages and no ``not_stage`` is.

Paths (``source``, ``mean_file``) are relative to the current working directory,
as in Caffe; ``read_data_layer`` loads the mean file immediately.

Old-format nets (``layers { ... }``, V1) are upgraded as Caffe's
``UpgradeNetDataTransformation`` does: a V1 layer with a ``data_param`` is a data
layer, and its deprecated ``data_param`` ``scale``/``mean_file``/``crop_size``/
``mirror`` move into ``transform_param``. In a new-format ``layer`` those
deprecated fields are ignored by Caffe, so blobpipe rejects them rather than
silently dropping a transform.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import text_format

from .._errors import ProtoError
from .._proto import caffe_pb2
from ._transform import Layout, OutDtype, Phase, Transform, _check_phase

__all__ = ["DataLayerConfig", "read_data_layer"]

_DEPRECATED = ("scale", "mean_file", "crop_size", "mirror")


@dataclass(frozen=True)
class DataLayerConfig:
    """What a Caffe ``Data`` layer asks for, ready for :class:`Batches`.

    Attributes:
        name: the layer's name.
        phase: the phase the layer was selected for, "train" or "test".
        source: the LMDB path, as written in the prototxt (relative to the
            current directory, as in Caffe).
        batch_size: records per batch.
        prefetch: Caffe's prefetch queue depth (data_param.prefetch, default 4).
        rand_skip: data_param.rand_skip; Caffe master no longer applies it, nor
            does blobpipe (use ``order="shuffle"``); kept for reference.
        tops: the layer's top blob names (a second top means labels are wanted).
        transform: the layer's transform, mean file already loaded.
        prototxt: the file the configuration was read from.
    """

    name: str
    phase: Phase
    source: str
    batch_size: int
    prefetch: int
    rand_skip: int
    tops: tuple[str, ...]
    transform: Transform
    prototxt: str

    @property
    def labels(self) -> bool:
        """Whether the layer outputs labels (it has a second top)."""
        return len(self.tops) > 1

    def batches_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Batches(**config.batches_kwargs())``.

        ``source``, ``batch_size``, ``transform`` and ``phase``; ``mode`` is
        "wrap" and ``order`` "key", as Caffe's DataLayer behaves.
        """
        return {
            "source": self.source,
            "batch_size": self.batch_size,
            "transform": self.transform,
            "phase": self.phase,
            "mode": "wrap",
            "order": "key",
        }


def _state_meets_rule(
    rule: caffe_pb2.NetStateRule, phase: int, level: int, stages: frozenset[str]
) -> bool:
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
    layer: caffe_pb2.LayerParameter | caffe_pb2.V1LayerParameter,
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


def _rules_text(layer: caffe_pb2.LayerParameter | caffe_pb2.V1LayerParameter) -> str:
    def one(rule: caffe_pb2.NetStateRule) -> str:
        return text_format.MessageToString(rule, as_one_line=True) or "any"

    if len(layer.include):
        return "include " + " | ".join(one(r) for r in layer.include)
    if len(layer.exclude):
        return "exclude " + " | ".join(one(r) for r in layer.exclude)
    return "all phases"


def parse_net(text: str, where: str = "<string>") -> caffe_pb2.NetParameter:
    """Parse a net prototxt, skipping fields and layers this project does not model.

    Raises:
        ProtoError: the text is not a valid NetParameter prototxt.
    """
    net = caffe_pb2.NetParameter()
    try:
        text_format.Parse(text, net, allow_unknown_field=True)
    except text_format.ParseError as exc:
        raise ProtoError(f"{where}: cannot parse the net prototxt: {exc}") from exc
    return net


def read_data_layer(
    path: str | os.PathLike[str],
    phase: Phase = "train",
    *,
    name: str | None = None,
    level: int = 0,
    stages: Sequence[str] = (),
    layout: Layout = "NCHW",
    dtype: OutDtype = "float32",
) -> DataLayerConfig:
    """Read the ``Data`` layer that a Caffe net prototxt runs in ``phase``.

    Args:
        path: the net prototxt.
        phase: "train" or "test".
        name: choose this layer when several Data layers match.
        level, stages: the net state's level and extra stages (added to the
            file's ``state { stage }``), for include/exclude rules.
        layout, dtype: passed to the :class:`Transform`.

    Raises:
        FileNotFoundError: the prototxt or the mean file does not exist.
        ProtoError: the file does not parse; no Data layer (or several, without
            ``name``) is selected for the phase (the message lists the layers
            found); the backend is not LMDB (LEVELDB is protobuf's default when
            ``backend`` is absent); ``source`` or ``batch_size`` is missing;
            deprecated ``data_param`` transform fields in a new-format layer;
            ``mean_file`` together with ``mean_value``; a bad mean file.
        ValueError: a bad ``phase``, ``layout`` or ``dtype``.
    """
    phase = _check_phase(phase)
    where = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        net = parse_net(f.read(), where)
    phase_enum = caffe_pb2.TRAIN if phase == "train" else caffe_pb2.TEST
    all_stages = frozenset(net.state.stage) | frozenset(stages)

    candidates: list[tuple[caffe_pb2.LayerParameter | caffe_pb2.V1LayerParameter, bool]] = []
    found: list[str] = []
    for layer in net.layer:
        found.append(f"{layer.name!r} (type {layer.type!r}, {_rules_text(layer)})")
        if layer.type == "Data" and _included(layer, where, phase_enum, level, all_stages):
            candidates.append((layer, False))
    for v1 in net.layers:
        is_data = v1.HasField("data_param")
        found.append(f"{v1.name!r} (V1 {'data ' if is_data else ''}layer, {_rules_text(v1)})")
        if is_data and _included(v1, where, phase_enum, level, all_stages):
            candidates.append((v1, True))
    if name is not None:
        candidates = [c for c in candidates if c[0].name == name]
    if not candidates:
        wanted = "Data layer" if name is None else f"Data layer named {name!r}"
        listing = "; ".join(found) if found else "none"
        raise ProtoError(
            f"{where}: no {wanted} runs in phase {phase.upper()}; layers found: {listing}"
        )
    if len(candidates) > 1:
        names = ", ".join(repr(c[0].name) for c in candidates)
        raise ProtoError(
            f"{where}: several Data layers run in phase {phase.upper()} ({names}); "
            "choose one with name=..."
        )
    chosen, is_v1 = candidates[0]
    return _config(chosen, is_v1, where, phase, layout, dtype)


def _config(
    layer: caffe_pb2.LayerParameter | caffe_pb2.V1LayerParameter,
    is_v1: bool,
    where: str,
    phase: Phase,
    layout: Layout,
    dtype: OutDtype,
) -> DataLayerConfig:
    label = f"{where}: layer {layer.name!r}"
    dp = layer.data_param
    tp = caffe_pb2.TransformationParameter()
    tp.CopyFrom(layer.transform_param)
    deprecated = [f for f in _DEPRECATED if dp.HasField(f)]
    if deprecated and not is_v1:
        fields = ", ".join(f"data_param.{f}" for f in deprecated)
        raise ProtoError(
            f"{label} sets deprecated {fields}, which Caffe ignores in a `layer` block; "
            "move them into transform_param { ... }"
        )
    for field in deprecated:  # Caffe's UpgradeNetDataTransformation for V1 layers
        setattr(tp, field, getattr(dp, field))
    if dp.backend != caffe_pb2.DataParameter.LMDB:
        implicit = "" if dp.HasField("backend") else " (protobuf's default when no backend is set)"
        raise ProtoError(
            f"{label} uses backend LEVELDB{implicit}; blobpipe reads LMDB only: convert "
            "the database to LMDB (e.g. rerun Caffe's convert_imageset with --backend=lmdb, "
            "or copy its records into an LMDB) and set `backend: LMDB` in data_param"
        )
    if not dp.source:
        raise ProtoError(f"{label} has no data_param.source")
    if dp.batch_size <= 0:
        raise ProtoError(f"{label} needs data_param.batch_size > 0, got {dp.batch_size}")
    transform = Transform.from_proto(tp, layout=layout, dtype=dtype)
    return DataLayerConfig(
        name=layer.name,
        phase=phase,
        source=dp.source,
        batch_size=int(dp.batch_size),
        prefetch=int(dp.prefetch),
        rand_skip=int(dp.rand_skip),
        tops=tuple(layer.top),
        transform=transform,
        prototxt=where,
    )
