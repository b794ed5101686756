"""Reading and writing Caffe's binary protobuf files as Blobs.

* ``.binaryproto``: one serialized ``caffe.BlobProto`` (a mean image, say).
* ``.caffemodel``: a serialized ``caffe.NetParameter``; each layer's ``blobs``
  are its parameters (``layer`` field, or the legacy ``layers`` field of old
  V1 files).

Everything read is validated before a Blob is allocated: a file that does not
parse, a shape that is not a blob shape, or a value count that differs from
the shape's raise ProtoError naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ._backends import Backend
from ._blob import Blob
from ._errors import ProtoError

__all__ = ["read_blobproto", "read_caffemodel", "write_blobproto"]

StrPath = str | os.PathLike[str]


def _parse(message: Any, path: StrPath, what: str) -> None:
    from google.protobuf.message import DecodeError

    data = Path(path).read_bytes()
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise ProtoError(f"{os.fspath(path)!r} is not a valid {what}: {exc}") from exc


def _blob_from(proto: Any, dtype: Any, backend: Backend | str | None, where: str) -> Blob:
    blob = Blob(dtype=dtype, backend=backend)
    try:
        blob.from_proto(proto, reshape=True)
    except ProtoError as exc:
        blob.close()
        raise ProtoError(f"{where}: {exc}") from exc
    except BaseException:
        blob.close()
        raise
    return blob


def read_blobproto(
    path: StrPath, *, dtype: Any = np.float32, backend: Backend | str | None = None
) -> Blob:
    """Read a ``.binaryproto`` file (one ``caffe.BlobProto``) into a new Blob.

    The shape comes from the legacy num/channels/height/width fields when any
    is set, else from ``shape`` (Caffe's rule); ``double_data`` is read when
    present, else ``data``, cast to ``dtype`` (float32 or float64). The caller
    owns the Blob (close it, or use it as a context manager).

    Raises FileNotFoundError, ProtoError (unparsable file, bad shape, value
    count mismatch), UnsupportedOperationError for an integer ``dtype``.
    """
    from ._proto import caffe_pb2

    proto = caffe_pb2.BlobProto()
    _parse(proto, path, "caffe.BlobProto")
    return _blob_from(proto, dtype, backend, f"{os.fspath(path)!r}")


def write_blobproto(blob: Blob, path: StrPath, *, write_diff: bool = False) -> None:
    """Write ``blob`` as a ``.binaryproto`` file (see :meth:`Blob.to_proto`).

    The ``shape`` field is written, never the legacy num/channels/height/width
    ones; Caffe reads either. The message is built before the file is opened,
    so a blob that cannot be written leaves no file behind.

    Raises UnsupportedOperationError for integer blobs, StateError for a
    closed blob, OSError from the filesystem.
    """
    payload = blob.to_proto(write_diff=write_diff).SerializeToString()
    Path(path).write_bytes(payload)


def read_caffemodel(
    path: StrPath, *, dtype: Any = np.float32, backend: Backend | str | None = None
) -> dict[str, list[Blob]]:
    """The parameter blobs of a ``.caffemodel``: layer name → list of Blobs.

    Layers come in file order, from the ``layer`` field and then the legacy
    V1 ``layers`` field; layers without blobs are left out (like pycaffe's
    ``net.params``). The caller owns the Blobs.

    Raises FileNotFoundError, ProtoError (unparsable file, a bad blob, two
    layers with blobs under one name), UnsupportedOperationError for an
    integer ``dtype``.
    """
    from ._proto import caffe_pb2

    net = caffe_pb2.NetParameter()
    _parse(net, path, "caffe.NetParameter (.caffemodel)")
    where = os.fspath(path)
    result: dict[str, list[Blob]] = {}
    try:
        layers: list[Any] = [*net.layer, *net.layers]
        for layer in layers:
            if not len(layer.blobs):
                continue
            if layer.name in result:
                raise ProtoError(
                    f"{where!r}: two layers named {layer.name!r} hold blobs; cannot tell "
                    "their parameters apart"
                )
            blobs: list[Blob] = []
            result[layer.name] = blobs
            for i, proto in enumerate(layer.blobs):
                blobs.append(
                    _blob_from(proto, dtype, backend, f"{where!r}, layer {layer.name!r} blob {i}")
                )
    except BaseException:
        for blobs in result.values():
            for blob in blobs:
                blob.close()
        raise
    return result
