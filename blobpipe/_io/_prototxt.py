"""Reading a Caffe net prototxt's data layer: ``Data``, ``ImageData`` or ``HDF5Data``.

Only what a data pipeline needs is read: the data layers, their include/exclude
rules, ``data_param`` / ``image_data_param`` / ``hdf5_data_param`` and
``transform_param``. Every other layer type and every
field this project's ``caffe.proto`` subset does not know (``convolution_param``
and the like, V1 ``type: DATA`` enums) is skipped by protobuf's text parser
(``allow_unknown_field=True`` skips unknown scalar *and* nested message fields).

Layer selection follows Caffe's ``Net::FilterNet``/``StateMeetsRule``: a layer with
no include rules is in unless an exclude rule matches; a layer with include
rules is in when one of them matches. A rule matches when its phase (if set)
equals the requested phase, the level lies within ``min_level``/``max_level``,
every ``stage`` is among the net's stages and no ``not_stage`` is.

Paths (``source``, ``mean_file``, ``root_folder``, the files an HDF5 list names) are
relative to the current working directory, as in Caffe; ``read_data_layer`` loads
the mean file immediately.

A ``Data`` layer's ``backend`` (LEVELDB when absent, protobuf's default) must agree
with what its ``source`` directory holds, as Caffe cannot open the other kind; an
``ImageData`` layer reads its list file and images (``_imagelist.py``), an
``HDF5Data`` layer its list of ``.h5`` files (``_hdf5.py``).

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

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._codec import data_layer_fields
from .._codec import parse_net as parse_net
from .._errors import FileMissingError, ProtoError
from ._database import database_kind
from ._transform import Layout, OutDtype, Phase, Transform, check_phase

__all__ = ["DataLayerConfig", "read_data_layer"]


@dataclass(frozen=True)
class DataLayerConfig:
    """What a Caffe data layer asks for, ready for :class:`Batches` and :class:`Loader`.

    Attributes:
        name: the layer's name.
        phase: the phase the layer was selected for, "train" or "test".
        source: ``data_param.source`` (the database), ``image_data_param.source``
            (the list file) or ``hdf5_data_param.source`` (the list of ``.h5``
            files), as written in the prototxt (relative to the current directory).
        batch_size: records per batch.
        prefetch: Caffe's prefetch queue depth (data_param.prefetch, default 4).
        rand_skip: data_param.rand_skip / image_data_param.rand_skip; a random skip
            at start, which blobpipe does not apply (``Loader.from_prototxt`` warns;
            use ``order="shuffle"`` or shards).
        tops: the layer's top blob names (a second top means labels are wanted; an
            HDF5Data layer's tops are its datasets).
        transform: the layer's transform, mean file already loaded (an ImageData
            layer's decodes as ``is_color`` says).
        prototxt: the file the configuration was read from.
        type: "Data", "ImageData" or "HDF5Data".
        backend: a Data layer's database kind, "lmdb" or "leveldb".
        shuffle: an ImageData or HDF5Data layer's ``shuffle``.
        root_folder, new_height, new_width, is_color: an ImageData layer's.
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
    type: str = "Data"
    backend: str = "lmdb"
    shuffle: bool = False
    root_folder: str = ""
    new_height: int = 0
    new_width: int = 0
    is_color: bool = True

    @property
    def labels(self) -> bool:
        """Whether the layer outputs labels (it has a second top)."""
        return len(self.tops) > 1

    def batches_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Batches(**config.batches_kwargs())``.

        ``source``, ``batch_size``, ``transform`` and ``phase``; ``mode`` is
        "wrap" and ``order`` "key" (or "shuffle" for a layer that shuffles), as
        Caffe's layers behave. ``source`` is the database path for a Data layer, an
        :class:`ImageList` for an ImageData layer and an :class:`Hdf5Data` (one
        source per top) for an HDF5Data layer.

        Raises:
            DataError, FileMissingError: an ImageData or HDF5Data layer's list file,
                or an ``.h5`` file it names, cannot be read.
            MissingDependencyError: an HDF5Data layer without h5py installed.
        """
        kwargs: dict[str, Any] = {
            "source": self.source,
            "batch_size": self.batch_size,
            "transform": self.transform,
            "phase": self.phase,
            "mode": "wrap",
            "order": "shuffle" if self.shuffle else "key",
        }
        if self.type == "ImageData":
            from ._imagelist import ImageList

            kwargs["source"] = ImageList(
                self.source, self.root_folder, new_height=self.new_height,
                new_width=self.new_width, is_color=self.is_color,
            )  # fmt: skip
        elif self.type == "HDF5Data":
            from ._hdf5 import Hdf5Data

            kwargs["source"] = Hdf5Data(self.source, self.tops)
            kwargs["transform"] = None
        return kwargs


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
        ProtoError: the file does not parse; no data layer (or several, without
            ``name``) is selected for the phase (the message lists the layers
            found); a Data layer's backend that is not what its source holds
            (LEVELDB is protobuf's default when ``backend`` is absent); ``source``
            or ``batch_size`` is missing; deprecated transform fields in a
            new-format layer's ``data_param`` / ``image_data_param``;
            ``mean_file`` together with ``mean_value``; a bad mean file; an
            ImageData layer with only one of new_height and new_width; an
            HDF5Data layer with a ``transform_param``.
        ArgumentError: a bad ``phase``, ``layout`` or ``dtype`` (a ValueError).
    """
    phase = check_phase(phase)
    where = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as exc:
        raise FileMissingError("the net prototxt does not exist", path=where) from exc
    fields = data_layer_fields(text, where, phase, name=name, level=level, stages=stages)
    label = f"{where}: layer {fields.name!r}"
    if fields.type == "HDF5Data" and fields.has_transform:
        raise ProtoError(
            f"{label} is an HDF5Data layer with a transform_param; Caffe refuses it "
            "(HDF5Data does not transform data): remove the transform_param block"
        )
    if fields.type == "Data":
        found = None  # a missing source: the reader names it when it opens it
        if os.path.exists(fields.source):
            with contextlib.suppress(FileNotFoundError):
                found = database_kind(fields.source)
        if found is not None and found != fields.backend:
            implicit = "" if fields.backend_set else " (LEVELDB is protobuf's default " \
                "when data_param sets no backend)"  # fmt: skip
            raise ProtoError(
                f"{label} reads backend {fields.backend.upper()}{implicit}, but its source "
                f"{fields.source!r} holds an {'LMDB' if found == 'lmdb' else 'LevelDB'}, "
                f"which Caffe cannot open so: set `backend: {found.upper()}` in data_param"
            )
    return DataLayerConfig(
        name=fields.name,
        phase=phase,
        source=fields.source,
        batch_size=fields.batch_size,
        prefetch=fields.prefetch or 4,
        rand_skip=fields.rand_skip,
        tops=fields.tops,
        transform=Transform(**fields.transform, layout=layout, dtype=dtype),
        prototxt=where,
        type=fields.type,
        backend=fields.backend,
        shuffle=fields.shuffle,
        root_folder=fields.root_folder,
        new_height=fields.new_height,
        new_width=fields.new_width,
        is_color=fields.is_color,
    )
