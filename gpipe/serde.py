"""The one place generated protobuf classes meet the rest of the code: plain types both ways."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from gpipe.show import short
from gpipe.v1 import jobs_pb2 as jpb
from gpipe.v1 import workers_pb2 as wpb

DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 100, 1000  # ListJobs' page_size: 0 means the default


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
    code_sha256: str = ""  # the job's code archive in serve's store (gpipe.code_archive); "": none was sent

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
    secret: str = field(repr=False)  # the attempt's: its store keys live under it (gpipe.net)
    code_sha256: str = ""  # the job's code archive (WorkerService.GetCode); "": none


@dataclass
class Abort:
    attempt_id: str


# An event of a job: ("state", StateChange) | ("metrics", dict) | ("eval", dict) | ("log", str)
Event = tuple[str, Any]


def metrics_event(line: dict[str, Any]) -> Event:
    """A line of metrics.jsonl as an event: an evaluation's line (it has eval_loss) or a step's."""
    return ("eval" if "eval_loss" in line else "metrics"), line


def state_to_pb(c: StateChange) -> jpb.StateChange:
    return jpb.StateChange(state=c.state.value, time_unix=c.time_unix, message=c.message)


def state_from_pb(m: jpb.StateChange) -> StateChange:
    return StateChange(JobState(jpb.JobState.Name(m.state)), m.time_unix, m.message)


def job_to_pb(j: JobRecord) -> jpb.Job:
    return jpb.Job(
        name=j.name, state=j.state.value, spec_yaml=j.spec_yaml,
        history=[state_to_pb(h) for h in j.history], steps=j.steps, steps_done=j.steps_done,
        loss=j.loss, failed_rank=j.failed_rank, error=j.error, output_dir=j.output_dir,
        restarts=j.restarts, attempts=j.attempts, checkpoint_step=j.checkpoint_step,
        eval_loss=j.eval_loss, eval_step=j.eval_step, code_sha256=j.code_sha256,
    )


def job_from_pb(m: jpb.Job) -> JobRecord:
    return JobRecord(
        name=m.name, spec_yaml=m.spec_yaml, steps=m.steps, state=JobState(jpb.JobState.Name(m.state)),
        history=[state_from_pb(h) for h in m.history], steps_done=m.steps_done, loss=m.loss,
        failed_rank=m.failed_rank, error=m.error, output_dir=m.output_dir,
        restarts=m.restarts, attempts=m.attempts, checkpoint_step=m.checkpoint_step,
        eval_loss=m.eval_loss, eval_step=m.eval_step, code_sha256=m.code_sha256,
    )


_METRIC_FIELDS = ("step", "loss", "lr", "step_time_s", "samples_per_s", "bubble_fraction", "attempt")
# A step's fields in metrics.jsonl's order (coordinator.metrics.StepMetrics): `logs --json` prints its lines as they are.
_METRIC_ORDER = ("step", "loss", "lr", "step_time_s", "samples_per_s", "grad_norm", "bubble_fraction", "attempt",
                 "loss_scale", "skipped", "stages", "replicas")
_EVAL_FIELDS = ("eval_loss", "eval_samples", "eval_time_s", "attempt")
_OPTIONAL_METRICS = ("grad_norm", "loss_scale", "skipped")  # unset (None) when not measured, and in older lines


def event_to_pb(e: Event) -> jpb.JobEvent:
    kind, value = e
    if kind == "state":
        return jpb.JobEvent(state=state_to_pb(value))
    if kind == "metrics":
        m = jpb.StepMetrics(**{k: value[k] for k in _METRIC_FIELDS if k in value},
                            **{k: value[k] for k in _OPTIONAL_METRICS if value.get(k) is not None},
                            stages_json=json.dumps(value["stages"]), replicas_json=json.dumps(value.get("replicas", [])))
        return jpb.JobEvent(metrics=m)
    if kind == "eval":
        step = value.get("step")
        ev = jpb.EvalMetrics(**{k: value[k] for k in _EVAL_FIELDS if k in value}, step=-1 if step is None else step)
        return jpb.JobEvent(eval=ev)
    return jpb.JobEvent(log=value)


def event_from_pb(m: jpb.JobEvent) -> Event:
    which = m.WhichOneof("event")
    if which == "state":
        return "state", state_from_pb(m.state)
    if which == "metrics":
        d = {k: getattr(m.metrics, k) for k in _METRIC_FIELDS}
        d.update({k: getattr(m.metrics, k) if m.metrics.HasField(k) else None for k in _OPTIONAL_METRICS})
        d["stages"] = json.loads(m.metrics.stages_json or "[]")
        d["replicas"] = json.loads(m.metrics.replicas_json or "[]")
        return "metrics", {k: d[k] for k in _METRIC_ORDER}
    if which == "eval":
        d = {k: getattr(m.eval, k) for k in _EVAL_FIELDS}
        return "eval", {"step": None if m.eval.step < 0 else m.eval.step, **d}
    return "log", m.log


def command_to_pb(c: Join | Abort) -> wpb.WorkerCommand:
    if isinstance(c, Join):
        return wpb.WorkerCommand(join=wpb.JoinAttempt(**asdict(c)))
    return wpb.WorkerCommand(abort=wpb.AbortAttempt(attempt_id=c.attempt_id))


def command_from_pb(m: wpb.WorkerCommand) -> Join | Abort:
    if m.WhichOneof("command") == "join":
        j = m.join
        return Join(j.attempt_id, j.master, j.rank, j.world, j.start_timeout_s, j.secret, j.code_sha256)
    return Abort(m.abort.attempt_id)
