"""The one place generated protobuf classes meet the rest of the code: gpipe.service.job_records' plain types both ways."""

from __future__ import annotations

import json
from dataclasses import asdict

from gpipe.service.job_records import Abort, Event, JobRecord, JobState, Join, StateChange
from gpipe.service.v1 import jobs_pb2 as jpb
from gpipe.service.v1 import workers_pb2 as wpb

DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 100, 1000  # ListJobs' page_size: 0 means the default


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
# A step's fields in metrics.jsonl's order (gpipe.coordinator.attempt.metrics.StepMetrics): `logs --json` prints its lines as they are.
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
