"""What crosses between the driver and a stage: derived, not copied; typed answers; errors decided by fields."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from gpipe.capture.graph import CaptureError
from gpipe.contract import Cause, StageConfig, StageError, StepResult, classify
from gpipe.coordinator.plan import configs
from gpipe.coordinator.plan.configs import stage_config
from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.spec.job import JobSpec, parse_spec
from gpipe.factory import FactoryError
from gpipe.skip import SkipError
from gpipe.structure import StructureError
from gpipe.turns import TurnAborted
from tests.support.spec import job, regression

ROOT = Path(__file__).resolve().parents[2]
SPEC = job(name="c", seed=3, balance=[1, 3], replicas=2, precision="fp16", model__args={"width": 4, "depth": 3},
           data=regression(16, 4, 8), eval={"data": regression(8, 4, 4), "every": 2}, steps=4,
           loss_scale={"init": 8.0})


def test_every_spec_field_is_copied_derived_or_the_coordinators_alone():
    kinds = [configs.SAME_AS_SPEC, configs.DERIVED_FROM_SPEC, configs.COORDINATOR_ONLY]
    named = [name for kind in kinds for name in kind]
    assert sorted(named) == sorted(JobSpec.model_fields)  # each once
    config = {f.name for f in fields(StageConfig)}
    assert set(configs.SAME_AS_SPEC) <= config


def test_a_stage_config_is_derived_from_the_spec_and_says_which_rank_it_is():
    plan = make_plan(parse_spec(yaml.safe_dump(SPEC)), ROOT)
    first, other = (stage_config(plan, 1, r, "cpu", "10.0.0.1", 29500) for r in (0, 1))
    assert (first.model_chunk, first.replica, first.rank, first.start, first.end) == (1, 0, 1, 1, 4)
    assert (other.model_chunk, other.replica, other.rank) == (1, 1, 3)
    assert (first.precision, first.loss_scale, first.batch_size, first.replicas) == ("fp16", (8.0, 2000), 8, 2)
    assert (first.store_host, first.store_port, first.device) == ("10.0.0.1", 29500, "cpu")
    # Replica 0 alone evaluates.
    assert (first.eval_every, first.steps) == (2, 4) and first.eval_batches > 0
    assert (other.eval_every, other.eval_batches, other.steps) == (None, 0, 0)


def test_a_spec_field_no_one_placed_is_an_error_not_a_silent_default(monkeypatch):
    plan = make_plan(parse_spec(yaml.safe_dump(SPEC)), ROOT)
    monkeypatch.setattr(configs, "COORDINATOR_ONLY", tuple(n for n in configs.COORDINATOR_ONLY if n != "probe"))
    with pytest.raises(TypeError, match="JobSpec.probe"):
        stage_config(plan, 0, 0, "cpu", "127.0.0.1", 1)


def result(**kw: object) -> StepResult:
    values: dict[str, object] = {
        "rank": 1, "stage": 1, "replica": 0, "loss_sum": 2.5, "grad_norm": None, "busy_s": 0.5, "idle_s": 0.25,
        "activation_peak_bytes": 10, "peak_memory_bytes": 20, "start_unix": 1.0,
        "timeline": [("F", 0, 0.0, 0.1)], "sent_bytes": {"a": 1}, "received_bytes": {"b": 2}}
    return StepResult(**(values | kw))


def test_a_step_result_gives_the_metrics_line_entry_in_its_order():
    assert list(result().metrics()) == ["stage", "replica", "rank", "busy_s", "idle_s", "activation_peak_bytes",
                                        "peak_memory_bytes", "start_unix", "timeline", "sent_bytes",
                                        "received_bytes"]
    full = result(reduce_s=0.1, loss_scale=8.0, skipped=False, snapshot={"x": 1}, snapshot_s=0.2,
                  snapshot_wait_s=0.0, rss_bytes=30).metrics()
    assert list(full) == ["stage", "replica", "rank", "reduce_s", "busy_s", "idle_s", "activation_peak_bytes",
                          "peak_memory_bytes", "rss_bytes", "start_unix", "timeline", "sent_bytes", "received_bytes", "skipped",
                          "snapshot_s", "snapshot_wait_s"]
    assert json.loads(json.dumps(full))["timeline"] == [["F", 0, 0.0, 0.1]]


@pytest.mark.parametrize(("error", "cause"), [
    (ModuleNotFoundError("No module named 'x'"), Cause.IMPORT), (FactoryError("no factory y"), Cause.IMPORT),
    # the job's own code raising a LookupError (a data set's index, a dict's key) is its error, not an import's
    (IndexError("item 37"), Cause.RAISED), (KeyError("x"), Cause.RAISED), (SkipError("no skip"), Cause.RAISED),
    # what no restart changes: a value that cannot cross a cut, a model that cannot be captured
    (StructureError("a set"), Cause.INPUT), (CaptureError("branches on a value"), Cause.INPUT),
    (TimeoutError("waited"), Cause.TIMEOUT), (ConnectionResetError("gone"), Cause.PEER),
    (MemoryError(), Cause.MEMORY), (ValueError("boom"), Cause.RAISED),
    # a model chunk that gave up for its worker's other chunk: the driver waits for that one's own error
    (TurnAborted("another model chunk of this worker failed"), Cause.ABORTED),
])
def test_a_cause_is_told_by_the_exceptions_type(error, cause):
    assert classify(error) is cause


def test_the_same_failure_is_the_same_cause_type_rank_and_step_whatever_its_message():
    a = StageError(Cause.RAISED, "ValueError", "boom after 5 forwards", rank=1, stage=1, replica=0, step=2)
    assert a.line() == "ValueError: boom after 5 forwards"
    assert a.same_as(StageError(Cause.RAISED, "ValueError", "boom after 6 forwards", 1, 1, 0, 2))
    for other in (StageError(Cause.RAISED, "ValueError", "boom", 0, 0, 0, 2),
                  StageError(Cause.RAISED, "ValueError", "boom", 1, 1, 0, 3),
                  StageError(Cause.RAISED, "KeyError", "boom", 1, 1, 0, 2), None):
        assert not a.same_as(other)


def run_of(stages: int, replicas: int):  # a driver.Run with only what its waits read
    from types import SimpleNamespace

    from gpipe.coordinator.attempt.driver import Run
    from gpipe.topology import Topology

    run = object.__new__(Run)
    run.spec = SimpleNamespace(stages=stages, virtual_stages=1, topology=Topology(stages, replicas))
    run.plan = SimpleNamespace(bounds=[(2 * k, 2 * k + 2) for k in range(stages)])
    return run


def answered(value: object):
    import torch

    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def test_a_stages_error_becomes_a_job_failure_with_its_fields_and_the_users_line():
    import torch

    from gpipe.errors import JobFailed

    run = run_of(2, 2)
    err = StageError(Cause.RAISED, "ValueError", "boom", rank=3, stage=1, replica=1, step=2)
    with pytest.raises(JobFailed) as failed:
        run._result("at step 2", 3, answered(err), StepResult, 2)
    assert str(failed.value) == "stage 1 of replica 1 (layers 2-3) failed at step 2: ValueError: boom"
    assert failed.value.error is err and failed.value.rank == 3 and failed.value.cause is Cause.RAISED

    lost: torch.futures.Future = torch.futures.Future()
    lost.set_exception(RuntimeError("connection reset by peer"))
    with pytest.raises(JobFailed) as failed:
        run._result("at step 5", 2, lost, StepResult, 5)
    e = failed.value.error
    assert failed.value.cause is Cause.PEER and (e.rank, e.stage, e.replica, e.step) == (2, 0, 1, 5)

    with pytest.raises(JobFailed) as failed:
        run._wait_all({0: answered(None), 1: torch.futures.Future()}, 0.05, "while building its stage", type(None))
    assert failed.value.cause is Cause.TIMEOUT and failed.value.rank == 1


def test_a_steps_metrics_line_is_its_fields_in_their_order_as_asdict_gives_them():
    """StepMetrics.values() (once per logged step, for metrics.jsonl and the report) leaves no field out and
    writes the same JSON as dataclasses.asdict, which copied every timeline."""
    from dataclasses import asdict

    from gpipe.coordinator.attempt.metrics import StepMetrics

    m = StepMetrics(step=3, loss=0.5, lr=0.1, step_time_s=0.2, samples_per_s=10.0, grad_norm=None,
                    bubble_fraction=0.25, attempt=2, loss_scale=8.0, skipped=False,
                    stages=[result().metrics()], replicas=[{"replica": 0, "step_time_s": 0.2}])
    assert list(m.values()) == [f.name for f in fields(StepMetrics)]
    assert json.dumps(m.values()) == json.dumps(asdict(m))
