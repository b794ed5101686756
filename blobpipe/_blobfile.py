"""Blobs from and to Caffe's files: ``.binaryproto`` (one BlobProto) and ``.caffemodel``.

Above Blob in the layers (``docs/design.md``): the codec (``_codec.py``) reads and
writes the messages, Blob's ``from_proto``/``to_proto`` carry the values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ._backends import Backend
from ._blob import Blob
from ._codec import BlobProto, StrPath, caffemodel_blobs, read_blobproto_file
from ._errors import ArgumentTypeError, ProtoError

__all__ = ["read_blobproto", "read_caffemodel", "write_blobproto"]


def _blob_from(proto: BlobProto, dtype: Any, backend: Backend | str | None, where: str) -> Blob:
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
    proto = read_blobproto_file(path)
    return _blob_from(proto, dtype, backend, repr(os.fspath(path)))


def write_blobproto(blob: Blob, path: StrPath, *, write_diff: bool = False) -> None:
    """Write ``blob`` as a ``.binaryproto`` file (see :meth:`Blob.to_proto`).

    The ``shape`` field is written, never the legacy num/channels/height/width
    ones; Caffe reads either. The message is built before the file is opened,
    so a blob that cannot be written leaves no file behind.

    Raises ArgumentTypeError (a TypeError) when ``blob`` is not a Blob (the blob
    comes first, where ``numpy.save`` takes the file first; swapped arguments are
    named as such),
    UnsupportedOperationError for integer blobs, StateError for a closed blob,
    OSError from the filesystem.
    """
    if not isinstance(blob, Blob):
        if isinstance(path, Blob):
            raise ArgumentTypeError(
                "write_blobproto(blob, path) takes the blob first: got a "
                f"{type(blob).__name__} ({blob!r}) and then a Blob; swap the arguments"
            )
        raise ArgumentTypeError(
            f"write_blobproto: blob must be a Blob, got {type(blob).__name__} ({blob!r})"
        )
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
    where = os.fspath(path)
    layers = caffemodel_blobs(path)
    result: dict[str, list[Blob]] = {}
    try:
        for name, protos in layers:
            blobs: list[Blob] = []
            result[name] = blobs
            for i, proto in enumerate(protos):
                blobs.append(
                    _blob_from(proto, dtype, backend, f"{where!r}, layer {name!r} blob {i}")
                )
    except BaseException:
        for blobs in result.values():
            for blob in blobs:
                blob.close()
        raise
    return result
