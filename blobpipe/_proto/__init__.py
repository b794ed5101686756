"""Caffe's protobuf messages (generated from ``proto/caffe.proto``).

The generated module is data definitions only and sits at the bottom of the
layering, beside the errors. Only ``blobpipe._codec`` imports ``caffe_pb2``:
every other module (Blob.to_proto/from_proto, the LMDB reader, the mean file,
the prototxt reader, the dataset tools) goes through the codec, and nothing
here imports blobpipe. Regenerate with ``python scripts/gen_proto.py``.
"""
