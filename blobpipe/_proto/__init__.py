"""Caffe's protobuf messages (generated from ``proto/caffe.proto``).

The generated module is data definitions only and sits at the bottom of the
layering, beside the errors: every layer that reads or writes Caffe messages
(Blob.to_proto, the codec, the LMDB reader, the transform's mean file, the
prototxt reader, the dataset tools) imports ``caffe_pb2`` from here, and
nothing here imports blobpipe. Regenerate with ``python scripts/gen_proto.py``.
"""
