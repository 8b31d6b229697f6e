from google.protobuf import wrappers_pb2 as _wrappers_pb2
from extproc.gen.envoy.config.core.v3 import address_pb2 as _address_pb2
from extproc.gen.envoy.config.core.v3 import health_check_pb2 as _health_check_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Endpoint(_message.Message):
    __slots__ = ("address", "hostname")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    address: _address_pb2.Address
    hostname: str
    def __init__(self, address: _Optional[_Union[_address_pb2.Address, _Mapping]] = ..., hostname: _Optional[str] = ...) -> None: ...

class LbEndpoint(_message.Message):
    __slots__ = ("endpoint", "health_status", "load_balancing_weight")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HEALTH_STATUS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BALANCING_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    endpoint: Endpoint
    health_status: _health_check_pb2.HealthStatus
    load_balancing_weight: _wrappers_pb2.UInt32Value
    def __init__(self, endpoint: _Optional[_Union[Endpoint, _Mapping]] = ..., health_status: _Optional[_Union[_health_check_pb2.HealthStatus, str]] = ..., load_balancing_weight: _Optional[_Union[_wrappers_pb2.UInt32Value, _Mapping]] = ...) -> None: ...

class LocalityLbEndpoints(_message.Message):
    __slots__ = ("lb_endpoints", "load_balancing_weight", "priority")
    LB_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BALANCING_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    lb_endpoints: _containers.RepeatedCompositeFieldContainer[LbEndpoint]
    load_balancing_weight: _wrappers_pb2.UInt32Value
    priority: int
    def __init__(self, lb_endpoints: _Optional[_Iterable[_Union[LbEndpoint, _Mapping]]] = ..., load_balancing_weight: _Optional[_Union[_wrappers_pb2.UInt32Value, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...
