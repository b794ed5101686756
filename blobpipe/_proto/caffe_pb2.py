"""Caffe's messages (``proto/caffe.proto``), built at import in a private descriptor pool.

Not protoc's generated code: the classes come from the serialized descriptor
in ``_descriptor`` (see ``_build``), so any protobuf runtime in the supported
range can import this module. ``caffe_pb2.pyi`` types it for mypy. Only
``blobpipe._codec`` imports it.
"""

from ._build import build_module
from ._descriptor import SERIALIZED_FILE

globals().update(build_module(SERIALIZED_FILE, __name__))
