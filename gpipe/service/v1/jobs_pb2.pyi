from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    PENDING: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    SUCCEEDED: _ClassVar[JobState]
    FAILED: _ClassVar[JobState]
    STOPPED: _ClassVar[JobState]
    RESTARTING: _ClassVar[JobState]
    PREEMPTED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
PENDING: JobState
RUNNING: JobState
SUCCEEDED: JobState
FAILED: JobState
STOPPED: JobState
RESTARTING: JobState
PREEMPTED: JobState

class StateChange(_message.Message):
    __slots__ = ("state", "time_unix", "message")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    time_unix: float
    message: str
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., time_unix: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("name", "state", "spec_yaml", "history", "steps", "steps_done", "loss", "failed_rank", "error", "output_dir", "restarts", "attempts", "checkpoint_step", "eval_loss", "eval_step", "code_sha256", "waiting")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    FAILED_RANK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_STEP_FIELD_NUMBER: _ClassVar[int]
    CODE_SHA256_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: JobState
    spec_yaml: str
    history: _containers.RepeatedCompositeFieldContainer[StateChange]
    steps: int
    steps_done: int
    loss: float
    failed_rank: int
    error: str
    output_dir: str
    restarts: int
    attempts: int
    checkpoint_step: int
    eval_loss: float
    eval_step: int
    code_sha256: str
    waiting: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., spec_yaml: _Optional[str] = ..., history: _Optional[_Iterable[_Union[StateChange, _Mapping]]] = ..., steps: _Optional[int] = ..., steps_done: _Optional[int] = ..., loss: _Optional[float] = ..., failed_rank: _Optional[int] = ..., error: _Optional[str] = ..., output_dir: _Optional[str] = ..., restarts: _Optional[int] = ..., attempts: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., eval_loss: _Optional[float] = ..., eval_step: _Optional[int] = ..., code_sha256: _Optional[str] = ..., waiting: _Optional[str] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "loss", "lr", "step_time_s", "samples_per_s", "bubble_fraction", "stages_json", "attempt", "replicas_json", "loss_scale", "skipped", "grad_norm")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    STAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_JSON_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    lr: float
    step_time_s: float
    samples_per_s: float
    bubble_fraction: float
    stages_json: str
    attempt: int
    replicas_json: str
    loss_scale: float
    skipped: bool
    grad_norm: float
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., lr: _Optional[float] = ..., step_time_s: _Optional[float] = ..., samples_per_s: _Optional[float] = ..., bubble_fraction: _Optional[float] = ..., stages_json: _Optional[str] = ..., attempt: _Optional[int] = ..., replicas_json: _Optional[str] = ..., loss_scale: _Optional[float] = ..., skipped: _Optional[bool] = ..., grad_norm: _Optional[float] = ...) -> None: ...

class EvalMetrics(_message.Message):
    __slots__ = ("step", "eval_loss", "eval_samples", "eval_time_s", "attempt")
    STEP_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EVAL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    step: int
    eval_loss: float
    eval_samples: int
    eval_time_s: float
    attempt: int
    def __init__(self, step: _Optional[int] = ..., eval_loss: _Optional[float] = ..., eval_samples: _Optional[int] = ..., eval_time_s: _Optional[float] = ..., attempt: _Optional[int] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("state", "metrics", "log", "eval")
    STATE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    state: StateChange
    metrics: StepMetrics
    log: str
    eval: EvalMetrics
    def __init__(self, state: _Optional[_Union[StateChange, _Mapping]] = ..., metrics: _Optional[_Union[StepMetrics, _Mapping]] = ..., log: _Optional[str] = ..., eval: _Optional[_Union[EvalMetrics, _Mapping]] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec_yaml", "code_sha256")
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    CODE_SHA256_FIELD_NUMBER: _ClassVar[int]
    spec_yaml: str
    code_sha256: str
    def __init__(self, spec_yaml: _Optional[str] = ..., code_sha256: _Optional[str] = ...) -> None: ...

class CodeChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class CodeRef(_message.Message):
    __slots__ = ("sha256", "size")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size: int
    def __init__(self, sha256: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ResumeJobRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...
