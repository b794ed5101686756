"""Caffe's protobuf messages (``proto/caffe.proto``), built at import.

``caffe_pb2`` builds the message classes from ``_descriptor`` (the file as a
serialized FileDescriptorProto) in a private descriptor pool (``_build``), so
any protobuf runtime from 4.21.1 to 7.x can load them and pycaffe's own
``caffe_pb2`` (same file name, other messages, the default pool) can be
imported beside them. ``caffe_pb2.pyi`` types the module for mypy.

The package is data definitions only and sits at the bottom of the layering,
beside the errors. Only ``blobpipe._codec`` imports ``caffe_pb2``: every other
module (Blob.to_proto/from_proto, the LMDB reader, the mean file, the prototxt
reader, the dataset tools) goes through the codec, and nothing here imports
blobpipe. Regenerate ``_descriptor.py`` and the stub with
``python scripts/gen_proto.py``.
"""
