from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PushShareRequest(_message.Message):
    __slots__ = ("run_id", "round", "client_id", "share", "length")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    client_id: int
    share: bytes
    length: int
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., client_id: _Optional[int] = ..., share: _Optional[bytes] = ..., length: _Optional[int] = ...) -> None: ...

class PushShareReply(_message.Message):
    __slots__ = ("clients_received", "duplicate")
    CLIENTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    clients_received: int
    duplicate: bool
    def __init__(self, clients_received: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class GetPartialSumRequest(_message.Message):
    __slots__ = ("run_id", "round", "expected_clients")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    expected_clients: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., expected_clients: _Optional[_Iterable[int]] = ...) -> None: ...

class GetPartialSumReply(_message.Message):
    __slots__ = ("partial_sum", "length", "num_clients")
    PARTIAL_SUM_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    partial_sum: bytes
    length: int
    num_clients: int
    def __init__(self, partial_sum: _Optional[bytes] = ..., length: _Optional[int] = ..., num_clients: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("status", "server_id", "active_rounds", "pid")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    status: str
    server_id: str
    active_rounds: int
    pid: int
    def __init__(self, status: _Optional[str] = ..., server_id: _Optional[str] = ..., active_rounds: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...
