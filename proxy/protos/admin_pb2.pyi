from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListBackendsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBackendsResponse(_message.Message):
    __slots__ = ("snapshot_version", "backends")
    SNAPSHOT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    snapshot_version: int
    backends: _containers.RepeatedCompositeFieldContainer[BackendStatus]
    def __init__(self, snapshot_version: _Optional[int] = ..., backends: _Optional[_Iterable[_Union[BackendStatus, _Mapping]]] = ...) -> None: ...

class GetBackendRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SetWeightRequest(_message.Message):
    __slots__ = ("name", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("name", "drain")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    drain: bool
    def __init__(self, name: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class BackendStatus(_message.Message):
    __slots__ = ("name", "url", "grpc_address", "health", "weight", "configured_weight", "routable", "stale", "load_score", "has_load_score", "inflight_requests", "inflight_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    LOAD_SCORE_FIELD_NUMBER: _ClassVar[int]
    HAS_LOAD_SCORE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    url: str
    grpc_address: str
    health: str
    weight: float
    configured_weight: float
    routable: bool
    stale: bool
    load_score: float
    has_load_score: bool
    inflight_requests: int
    inflight_tokens: int
    def __init__(self, name: _Optional[str] = ..., url: _Optional[str] = ..., grpc_address: _Optional[str] = ..., health: _Optional[str] = ..., weight: _Optional[float] = ..., configured_weight: _Optional[float] = ..., routable: _Optional[bool] = ..., stale: _Optional[bool] = ..., load_score: _Optional[float] = ..., has_load_score: _Optional[bool] = ..., inflight_requests: _Optional[int] = ..., inflight_tokens: _Optional[int] = ...) -> None: ...
