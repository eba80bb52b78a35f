"""Message classes for ``schemas/remote_write.proto`` (Prometheus remote-write 1.0).

Why no generated ``remote_write_pb2.py``: protobuf's Python runtime only promises to load gencode from
a bounded window of ``protoc`` releases (newer gencode even refuses older runtimes), while we allow
``protobuf>=5.27,<8`` and CI/Debian ship ``protoc`` 3.21.  A ``FileDescriptorProto`` built from
``descriptor_pb2`` plus ``message_factory.GetMessageClass`` is public API on every runtime in that range
and on all three backends (upb, cpp, python), so nothing here depends on which protoc produced it.
``tests/cloud/test_write.py`` compiles the ``.proto`` with ``protoc --descriptor_set_out`` and asserts the
result equals :data:`FILE_DESCRIPTOR_PROTO`, so the ``.proto`` stays the source of truth.

The descriptor lives in a private pool: registering a ``prometheus`` package in the default pool
could collide with another library that ships its own copy of prompb.

The cloud ingester does not serialize through these classes (``cloud_ingest.write`` encodes by hand,
for speed); they serve decoding and tests.  Beware the pure-Python backend
(``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``): it parses every NaN as the canonical quiet NaN,
losing the stale-marker payload, and 5.x serializes -0.0 as +0.0.  upb (the default) is bit-exact.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

__all__ = [
    "FILE_DESCRIPTOR_PROTO",
    "Label",
    "MetricMetadata",
    "Sample",
    "TimeSeries",
    "WriteRequest",
]

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "prometheus"


def _field(name: str, number: int, ftype: int, *, repeated: bool = False, type_name: str = "") -> _F:
    field = _F(
        name=name,
        number=number,
        label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL,
        type=ftype,  # type: ignore[arg-type]
        json_name=_json_name(name),
    )
    if type_name:
        field.type_name = f".{_PACKAGE}.{type_name}"
    return field


def _json_name(name: str) -> str:
    # protoc records lowerCamelCase json_name for every field in descriptor sets; mirror it so the
    # equality test compares like with like.
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _reserved(*numbers: int) -> list[descriptor_pb2.DescriptorProto.ReservedRange]:
    return [descriptor_pb2.DescriptorProto.ReservedRange(start=n, end=n + 1) for n in numbers]


def _build_file() -> descriptor_pb2.FileDescriptorProto:
    msg = descriptor_pb2.DescriptorProto
    metric_type = descriptor_pb2.EnumDescriptorProto(
        name="MetricType",
        value=[
            descriptor_pb2.EnumValueDescriptorProto(name=name, number=number)
            for number, name in enumerate(
                ["UNKNOWN", "COUNTER", "GAUGE", "HISTOGRAM", "GAUGEHISTOGRAM", "SUMMARY", "INFO", "STATESET"]
            )
        ],
    )
    return descriptor_pb2.FileDescriptorProto(
        name="remote_write.proto",
        package=_PACKAGE,
        syntax="proto3",
        message_type=[
            msg(
                name="WriteRequest",
                field=[
                    _field("timeseries", 1, _F.TYPE_MESSAGE, repeated=True, type_name="TimeSeries"),
                    _field("metadata", 3, _F.TYPE_MESSAGE, repeated=True, type_name="MetricMetadata"),
                ],
                reserved_range=_reserved(2),
            ),
            msg(
                name="TimeSeries",
                field=[
                    _field("labels", 1, _F.TYPE_MESSAGE, repeated=True, type_name="Label"),
                    _field("samples", 2, _F.TYPE_MESSAGE, repeated=True, type_name="Sample"),
                ],
                reserved_range=_reserved(3, 4),
            ),
            msg(
                name="Label",
                field=[_field("name", 1, _F.TYPE_STRING), _field("value", 2, _F.TYPE_STRING)],
            ),
            msg(
                name="Sample",
                field=[_field("value", 1, _F.TYPE_DOUBLE), _field("timestamp", 2, _F.TYPE_INT64)],
            ),
            msg(
                name="MetricMetadata",
                field=[
                    _field("type", 1, _F.TYPE_ENUM, type_name="MetricMetadata.MetricType"),
                    _field("metric_family_name", 2, _F.TYPE_STRING),
                    _field("help", 4, _F.TYPE_STRING),
                    _field("unit", 5, _F.TYPE_STRING),
                ],
                enum_type=[metric_type],
            ),
        ],
    )


FILE_DESCRIPTOR_PROTO: descriptor_pb2.FileDescriptorProto = _build_file()

_POOL = descriptor_pool.DescriptorPool()
# AddSerializedFile (not the deprecated Add) works on every backend in the supported range.
_POOL.AddSerializedFile(FILE_DESCRIPTOR_PROTO.SerializeToString())


def _message_class(name: str) -> type[Message]:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


WriteRequest = _message_class("WriteRequest")
TimeSeries = _message_class("TimeSeries")
Label = _message_class("Label")
Sample = _message_class("Sample")
MetricMetadata = _message_class("MetricMetadata")
