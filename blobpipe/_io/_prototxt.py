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

The protobuf work (parsing, layer selection, the V1 upgrade) is
:func:`blobpipe._codec.data_layer_fields`; this module builds the
:class:`DataLayerConfig` and its :class:`Transform` from the plain fields.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._codec import data_layer_fields
from .._codec import parse_net as parse_net
from .._errors import FileMissingError
from ._transform import Layout, OutDtype, Phase, Transform, _check_phase

__all__ = ["DataLayerConfig", "read_data_layer"]


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


def read_data_layer(
    path: str | os.PathLike[str],
    phase: Phase | str = "train",
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
        phase: "train" or "test" (or Caffe's "TRAIN" / "TEST").
        name: choose this layer when several Data layers match.
        level, stages: the net state's level and extra stages (added to the
            file's ``state { stage }``), for include/exclude rules.
        layout, dtype: passed to the :class:`Transform`.

    Raises:
        FileMissingError: the prototxt or the mean file does not exist (a
            FileNotFoundError).
        ProtoError: the file does not parse; no Data layer (or several, without
            ``name``) is selected for the phase (the message lists the layers
            found); the backend is not LMDB (LEVELDB is protobuf's default when
            ``backend`` is absent); ``source`` or ``batch_size`` is missing;
            deprecated ``data_param`` transform fields in a new-format layer;
            ``mean_file`` together with ``mean_value``; a bad mean file.
        ArgumentError: a bad ``phase``, ``layout`` or ``dtype`` (a ValueError).
    """
    phase = _check_phase(phase)
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as exc:
        raise FileMissingError("the net prototxt does not exist", path=where) from exc
    fields = data_layer_fields(text, where, phase, name=name, level=level, stages=stages)
    return DataLayerConfig(
        name=fields.name,
        phase=phase,
        source=fields.source,
        batch_size=fields.batch_size,
        prefetch=fields.prefetch,
        rand_skip=fields.rand_skip,
        tops=fields.tops,
        transform=Transform(**fields.transform, layout=layout, dtype=dtype),
        prototxt=where,
    )
