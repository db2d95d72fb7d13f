from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisteredWorker(_message.Message):
    __slots__ = ("rank", "hostname", "host", "device", "device_name", "device_memory_bytes", "attempt_id", "threads", "job", "leaving")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    rank: int
    hostname: str
    host: str
    device: str
    device_name: str
    device_memory_bytes: int
    attempt_id: str
    threads: int
    job: str
    leaving: bool
    def __init__(self, rank: _Optional[int] = ..., hostname: _Optional[str] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., device_name: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ..., attempt_id: _Optional[str] = ..., threads: _Optional[int] = ..., job: _Optional[str] = ..., leaving: _Optional[bool] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[RegisteredWorker]
    def __init__(self, workers: _Optional[_Iterable[_Union[RegisteredWorker, _Mapping]]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "grace_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    grace_s: float
    def __init__(self, worker_id: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("checkpointing",)
    CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    checkpointing: bool
    def __init__(self, checkpointing: _Optional[bool] = ...) -> None: ...

class GetCodeRequest(_message.Message):
    __slots__ = ("worker_id", "sha256")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    sha256: str
    def __init__(self, worker_id: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class CodePiece(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("rank", "host", "device", "hostname", "cores", "threads", "device_name", "device_memory_bytes", "device_uuid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CORES_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    device: str
    hostname: str
    cores: _containers.RepeatedScalarFieldContainer[int]
    threads: int
    device_name: str
    device_memory_bytes: int
    device_uuid: str
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., device: _Optional[str] = ..., hostname: _Optional[str] = ..., cores: _Optional[_Iterable[int]] = ..., threads: _Optional[int] = ..., device_name: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_s: float
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "attempt_id", "attempt_exit", "attempt_ended", "attempt_error")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_EXIT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ENDED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_ERROR_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    attempt_id: str
    attempt_exit: int
    attempt_ended: bool
    attempt_error: str
    def __init__(self, worker_id: _Optional[str] = ..., attempt_id: _Optional[str] = ..., attempt_exit: _Optional[int] = ..., attempt_ended: _Optional[bool] = ..., attempt_error: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class CommandsRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class JoinAttempt(_message.Message):
    __slots__ = ("attempt_id", "master", "rank", "world", "start_timeout_s", "secret", "code_sha256")
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    START_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    CODE_SHA256_FIELD_NUMBER: _ClassVar[int]
    attempt_id: str
    master: str
    rank: int
    world: int
    start_timeout_s: float
    secret: str
    code_sha256: str
    def __init__(self, attempt_id: _Optional[str] = ..., master: _Optional[str] = ..., rank: _Optional[int] = ..., world: _Optional[int] = ..., start_timeout_s: _Optional[float] = ..., secret: _Optional[str] = ..., code_sha256: _Optional[str] = ...) -> None: ...

class AbortAttempt(_message.Message):
    __slots__ = ("attempt_id",)
    ATTEMPT_ID_FIELD_NUMBER: _ClassVar[int]
    attempt_id: str
    def __init__(self, attempt_id: _Optional[str] = ...) -> None: ...

class WorkerCommand(_message.Message):
    __slots__ = ("join", "abort")
    JOIN_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    join: JoinAttempt
    abort: AbortAttempt
    def __init__(self, join: _Optional[_Union[JoinAttempt, _Mapping]] = ..., abort: _Optional[_Union[AbortAttempt, _Mapping]] = ...) -> None: ...
