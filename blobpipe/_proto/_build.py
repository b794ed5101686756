"""Message classes from a serialized FileDescriptorProto, on every supported protobuf.

``build_module`` does at run time what protoc's generated ``*_pb2`` module
does at import, through the API every runtime from 4.21.1 to 7.x has (pure
Python and upb alike; pyproject.toml holds the range, .ci/run tests both
ends), so nothing here is tied to the protoc that made the bytes:

* the file goes into a new ``DescriptorPool`` of its own, never the default
  pool, so another ``caffe.proto`` in the process (pycaffe's ``caffe_pb2``,
  same file name, same package ``caffe``, other messages) cannot conflict
  with it;
* a message class comes from ``message_factory.GetMessageClass`` (protobuf
  4.22 and later) or else ``MessageFactory(pool).GetPrototype``;
* a top-level enum becomes an ``EnumTypeWrapper`` and its values module
  constants, as in generated code; nested enums and their values are class
  attributes of their message, set by the runtime.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor
from google.protobuf.internal import enum_type_wrapper
from google.protobuf.message import Message


def _message_class(descriptor: Descriptor, pool: descriptor_pool.DescriptorPool) -> type[Message]:
    get_class: Any = getattr(message_factory, "GetMessageClass", None)
    if get_class is None:  # protobuf < 4.22
        factory: Any = message_factory.MessageFactory(pool)
        cls: type[Message] = factory.GetPrototype(descriptor)
    else:
        cls = get_class(descriptor)
    return cls


def build_module(serialized_file: bytes, module_name: str) -> dict[str, Any]:
    """The names a generated ``*_pb2`` module for ``serialized_file`` would define.

    ``DESCRIPTOR`` (the FileDescriptor), one class per top-level message, one
    ``EnumTypeWrapper`` per top-level enum and one int per top-level enum
    value, built in a private descriptor pool. ``module_name`` becomes the
    classes' ``__module__`` (so they pickle by reference, as generated ones do).
    """
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(serialized_file)
    name = descriptor_pb2.FileDescriptorProto.FromString(serialized_file).name
    file = pool.FindFileByName(name)
    names: dict[str, Any] = {"DESCRIPTOR": file}
    for message_name, descriptor in file.message_types_by_name.items():
        cls = _message_class(descriptor, pool)
        cls.__module__ = module_name
        names[message_name] = cls
    for enum_name, enum in file.enum_types_by_name.items():
        names[enum_name] = enum_type_wrapper.EnumTypeWrapper(enum)
        for value in enum.values:
            names[value.name] = value.number
    return names
