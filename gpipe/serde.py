"""The one place generated protobuf classes meet the rest of the code: plain types both ways."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from gpipe.v1 import jobs_pb2 as jpb
from gpipe.v1 import workers_pb2 as wpb


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"
    RESTARTING = "RESTARTING"

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

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        d["history"] = [{**asdict(h), "state": h.state.value} for h in self.history]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobRecord:
        d = dict(d)
        d["state"] = JobState(d["state"])
        d["history"] = [StateChange(JobState(h["state"]), h["time_unix"], h["message"]) for h in d["history"]]
        return cls(**d)


@dataclass
class Join:
    attempt_id: str
    master: str
    stage: int
    stages: int
    start_timeout_s: float
    secret: str = field(repr=False)  # the attempt's: its store keys live under it (gpipe.net)


@dataclass
class Abort:
    attempt_id: str


# An event of a job: ("state", StateChange) | ("metrics", dict) | ("log", str)
Event = tuple[str, Any]


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
    )


def job_from_pb(m: jpb.Job) -> JobRecord:
    return JobRecord(
        name=m.name, spec_yaml=m.spec_yaml, steps=m.steps, state=JobState(jpb.JobState.Name(m.state)),
        history=[state_from_pb(h) for h in m.history], steps_done=m.steps_done, loss=m.loss,
        failed_rank=m.failed_rank, error=m.error, output_dir=m.output_dir,
        restarts=m.restarts, attempts=m.attempts, checkpoint_step=m.checkpoint_step,
    )


_METRIC_FIELDS = ("step", "loss", "lr", "step_time_s", "samples_per_s", "bubble_fraction", "attempt")


def event_to_pb(e: Event) -> jpb.JobEvent:
    kind, value = e
    if kind == "state":
        return jpb.JobEvent(state=state_to_pb(value))
    if kind == "metrics":
        m = jpb.StepMetrics(**{k: value[k] for k in _METRIC_FIELDS if k in value}, stages_json=json.dumps(value["stages"]))
        return jpb.JobEvent(metrics=m)
    return jpb.JobEvent(log=value)


def event_from_pb(m: jpb.JobEvent) -> Event:
    which = m.WhichOneof("event")
    if which == "state":
        return "state", state_from_pb(m.state)
    if which == "metrics":
        d = {k: getattr(m.metrics, k) for k in _METRIC_FIELDS}
        d["stages"] = json.loads(m.metrics.stages_json or "[]")
        return "metrics", d
    return "log", m.log


def command_to_pb(c: Join | Abort) -> wpb.WorkerCommand:
    if isinstance(c, Join):
        return wpb.WorkerCommand(join=wpb.JoinAttempt(**asdict(c)))
    return wpb.WorkerCommand(abort=wpb.AbortAttempt(attempt_id=c.attempt_id))


def command_from_pb(m: wpb.WorkerCommand) -> Join | Abort:
    if m.WhichOneof("command") == "join":
        j = m.join
        return Join(j.attempt_id, j.master, j.stage, j.stages, j.start_timeout_s, j.secret)
    return Abort(m.abort.attempt_id)
