from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRunRequest(_message.Message):
    __slots__ = ("run_id", "length", "max_clients", "round", "signature", "prime_field", "participants")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PRIME_FIELD_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    length: int
    max_clients: int
    round: int
    signature: bytes
    prime_field: bool
    participants: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., length: _Optional[int] = ..., max_clients: _Optional[int] = ..., round: _Optional[int] = ..., signature: _Optional[bytes] = ..., prime_field: _Optional[bool] = ..., participants: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterRunReply(_message.Message):
    __slots__ = ("server_id", "active_runs")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RUNS_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    active_runs: int
    def __init__(self, server_id: _Optional[str] = ..., active_runs: _Optional[int] = ...) -> None: ...

class PushShareRequest(_message.Message):
    __slots__ = ("run_id", "round", "client", "share", "length", "signature", "participants_digest", "min_summed")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MIN_SUMMED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    client: str
    share: bytes
    length: int
    signature: bytes
    participants_digest: bytes
    min_summed: int
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., client: _Optional[str] = ..., share: _Optional[bytes] = ..., length: _Optional[int] = ..., signature: _Optional[bytes] = ..., participants_digest: _Optional[bytes] = ..., min_summed: _Optional[int] = ...) -> None: ...

class PushShareReply(_message.Message):
    __slots__ = ("clients_received", "duplicate")
    CLIENTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    clients_received: int
    duplicate: bool
    def __init__(self, clients_received: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class CheckShareRequest(_message.Message):
    __slots__ = ("run_id", "round", "client", "length", "signature", "participants_digest", "min_summed")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MIN_SUMMED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    client: str
    length: int
    signature: bytes
    participants_digest: bytes
    min_summed: int
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., client: _Optional[str] = ..., length: _Optional[int] = ..., signature: _Optional[bytes] = ..., participants_digest: _Optional[bytes] = ..., min_summed: _Optional[int] = ...) -> None: ...

class CheckShareReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPartialSumRequest(_message.Message):
    __slots__ = ("run_id", "round", "expected_clients", "signature")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    expected_clients: _containers.RepeatedScalarFieldContainer[str]
    signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., expected_clients: _Optional[_Iterable[str]] = ..., signature: _Optional[bytes] = ...) -> None: ...

class GetPartialSumReply(_message.Message):
    __slots__ = ("partial_sum", "length", "num_clients")
    PARTIAL_SUM_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    partial_sum: bytes
    length: int
    num_clients: int
    def __init__(self, partial_sum: _Optional[bytes] = ..., length: _Optional[int] = ..., num_clients: _Optional[int] = ...) -> None: ...

class AbortRoundRequest(_message.Message):
    __slots__ = ("run_id", "round", "signature")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., signature: _Optional[bytes] = ...) -> None: ...

class AbortRoundReply(_message.Message):
    __slots__ = ("shares_dropped",)
    SHARES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    shares_dropped: int
    def __init__(self, shares_dropped: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("nonce", "signature")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    nonce: str
    signature: bytes
    def __init__(self, nonce: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("server_id", "active_runs", "active_rounds", "stored_bytes", "pid")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RUNS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    active_runs: int
    active_rounds: int
    stored_bytes: int
    pid: int
    def __init__(self, server_id: _Optional[str] = ..., active_runs: _Optional[int] = ..., active_rounds: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: str
    def __init__(self, status: _Optional[str] = ...) -> None: ...
