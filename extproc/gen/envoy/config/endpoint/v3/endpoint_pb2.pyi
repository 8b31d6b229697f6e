from extproc.gen.envoy.config.endpoint.v3 import endpoint_components_pb2 as _endpoint_components_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClusterLoadAssignment(_message.Message):
    __slots__ = ("cluster_name", "endpoints")
    CLUSTER_NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    cluster_name: str
    endpoints: _containers.RepeatedCompositeFieldContainer[_endpoint_components_pb2.LocalityLbEndpoints]
    def __init__(self, cluster_name: _Optional[str] = ..., endpoints: _Optional[_Iterable[_Union[_endpoint_components_pb2.LocalityLbEndpoints, _Mapping]]] = ...) -> None: ...
