"""A job's record as job.json holds it (state, history, figures), its events, and a worker's commands.

Plain types: gpipe.service.serde converts them to and from the generated protobuf
classes. A record read back from disk has every field checked (a corrupt
job.json is a ValueError naming the field, never a crash later).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from gpipe.show import short


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    RESTARTING = "RESTARTING"
    PREEMPTED = "PREEMPTED"  # checkpointed on a SIGTERM (a worker's or serve's): waits for its workers, then resumes

    @property
    def ended(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


@dataclass
class StateChange:
    state: JobState
    time_unix: float
    message: str = ""


@dataclass
class JobRecord:
    name: str
    spec_yaml: str
    steps: int
    state: JobState = JobState.PENDING
    history: list[StateChange] = field(default_factory=list)
    steps_done: int = 0
    loss: float = 0.0
    failed_rank: int = -1
    error: str = ""
    output_dir: str = ""
    restarts: int = 0
    attempts: int = 0
    checkpoint_step: int = 0
    exit_code: int = 0  # once ended: 0 succeeded, 1 failed, 2 bad input (no restart could help)
    eval_loss: float = 0.0  # the latest evaluation's loss
    eval_step: int = -1  # the step it followed; -1: none yet
    code_sha256: str = ""  # the job's code archive in serve's store (gpipe.service.code_archive); "": none was sent

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        d["history"] = [{**asdict(h), "state": h.state.value} for h in self.history]
        return d

    @classmethod
    def from_json(cls, d: object) -> JobRecord:
        """The record `to_json` wrote, or ValueError with one line naming the field.

        Every field is checked: its type (an integer is no bool and no 2.0), an
        integer's range in the proto (int64 steps, int32 restarts), text that
        encodes as UTF-8. So a record read back can always be sent: `job_to_pb`
        never raises for one. A field missing from an older record takes its
        default, but name, spec_yaml, steps and state are required.
        """
        return cls(**_fields_from_json(d, _RECORD_FIELDS, "job record"))


SHA256_RE = re.compile(r"[0-9a-f]{64}")
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


def _int(lo: int, hi: int) -> Callable[[str, object], int]:
    def check(name: str, v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{name}: must be an integer between {lo} and {hi}, got {short(v)}")
        return v
    return check


def _float(finite: bool) -> Callable[[str, object], float]:
    def check(name: str, v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name}: must be a number, got {short(v)}")
        try:
            x = float(v)
        except OverflowError:
            raise ValueError(f"{name}: must be a number a double holds, got {short(v)}") from None
        if finite and not math.isfinite(x):
            raise ValueError(f"{name}: must be a finite number, got {short(v)}")
        return x
    return check


def _text(name: str, v: object) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{name}: must be text, got {short(v)}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: not valid UTF-8 text (a lone surrogate at character {e.start})") from None
    return v


def _state(name: str, v: object) -> JobState:
    if not isinstance(v, str) or v not in JobState.__members__:
        raise ValueError(f"{name}: must be one of {', '.join(JobState)}, got {short(v)}")
    return JobState(v)


def _history(name: str, v: object) -> list[StateChange]:
    if not isinstance(v, list):
        raise ValueError(f"{name}: must be a list, got {short(v)}")
    return [StateChange(**_fields_from_json(h, _CHANGE_FIELDS, f"{name}.{i}")) for i, h in enumerate(v)]


_Check = Callable[[str, object], Any]
_CHANGE_FIELDS: dict[str, tuple[_Check, bool]] = {  # name: (check, required)
    "state": (_state, True), "time_unix": (_float(finite=True), True), "message": (_text, False),
}
# Every field of JobRecord (a test checks). The proto's integer types bound the counters, so that
# ListJobs can always send a record.
def _sha256(name: str, v: object) -> str:
    if not isinstance(v, str) or (v and not SHA256_RE.fullmatch(v)):
        raise ValueError(f"{name}: must be a SHA-256 in hex, got {short(v)}")
    return v


_RECORD_FIELDS: dict[str, tuple[_Check, bool]] = {
    "name": (_text, True), "spec_yaml": (_text, True), "steps": (_int(0, INT64[1]), True),
    "state": (_state, True), "history": (_history, False), "steps_done": (_int(0, INT64[1]), False),
    "loss": (_float(finite=False), False),  # a loss that went nan is recorded as such
    "failed_rank": (_int(-1, INT32[1]), False), "error": (_text, False), "output_dir": (_text, False),
    "restarts": (_int(0, INT32[1]), False), "attempts": (_int(0, INT32[1]), False),
    "checkpoint_step": (_int(0, INT64[1]), False), "exit_code": (_int(0, 255), False),
    "eval_loss": (_float(finite=False), False), "eval_step": (_int(-1, INT64[1]), False),
    "code_sha256": (_sha256, False),
}


def _fields_from_json(d: object, checks: dict[str, tuple[_Check, bool]], what: str) -> dict[str, Any]:
    """The checked fields of a JSON object; ValueError naming the first that is wrong."""
    if not isinstance(d, dict):
        raise ValueError(f"{what}: must be an object, got {short(d)}")
    for k in d:
        if k not in checks:
            raise ValueError(f"{what}: unknown field {short(k)}")
    prefix = "" if what == "job record" else f"{what}."
    for k, (_, required) in checks.items():
        if required and k not in d:
            raise ValueError(f"{prefix}{k}: required field is missing")
    return {k: checks[k][0](prefix + k, v) for k, v in d.items()}


@dataclass
class Join:
    """Join attempt `attempt_id` as worker `rank` of `world` (stage rank mod stages of replica rank div stages)."""

    attempt_id: str
    master: str
    rank: int
    world: int  # the attempt's workers: replicas x stages
    start_timeout_s: float
    secret: str = field(repr=False)  # the attempt's: its store keys live under it (gpipe.service.net)
    code_sha256: str = ""  # the job's code archive (WorkerService.GetCode); "": none


@dataclass
class Abort:
    attempt_id: str


# An event of a job: ("state", StateChange) | ("metrics", dict) | ("eval", dict) | ("log", str)
Event = tuple[str, Any]


def metrics_event(line: dict[str, Any]) -> Event:
    """A line of metrics.jsonl as an event: an evaluation's line (it has eval_loss) or a step's."""
    return ("eval" if "eval_loss" in line else "metrics"), line
