"""The driver over stage handles in this process (gpipe.coordinator.attempt.handle.local_stages): its loop, in seconds.

The same Run that drives worker processes over torch RPC drives stage servers
on threads of this process, linked in memory: the steps sent ahead, the
metrics, the checkpoints pulled in pieces and written, evaluation between
steps, a resume from a checkpoint with another balance. The weights equal one
device's (tests/support/reference.py). tests/service/test_transparency.py and the service
tests drive the same code over real processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpipe.contract import Cause
from gpipe.coordinator.attempt.driver import Run
from gpipe.coordinator.attempt.handle import local_stages
from gpipe.coordinator.attempt.metrics import EvalMetrics, StepMetrics
from gpipe.coordinator.outputs import checkpoint
from gpipe.errors import JobFailed
from gpipe.worker.stage_server import StageServer
from tests.support import reference
from tests.support.local import close_stages, drive, live_copies, plan_of, worst  # noqa: F401  # close_stages: autouse
from tests.support.spec import THREE_STAGES, job

REGRESSION = {"factory": "random_regression", "args": {"n": 40, "in_features": 16, "out_features": 16}}










def model_weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    """The whole model's weights in the checkpoint after `step` steps (verified)."""
    return checkpoint.load(checkpoint.step_dir(checkpoint.folder(out), step)).model_state()






def test_the_driver_over_local_stages_trains_as_one_device(tmp_path):
    spec = job(THREE_STAGES, checkpoint_every=2)
    steps, _ = drive(plan_of(spec), tmp_path)
    assert [m.step for m in steps] == [0, 1, 2, 3]
    assert all(m.loss > 0 and m.step_time_s > 0 and 0 <= m.bubble_fraction < 1 for m in steps)
    assert all(m.grad_norm is not None for m in steps)  # clipping took the norm over the three stages
    assert [[s["stage"] for s in m.stages] for m in steps] == [[0, 1, 2]] * 4
    # Every stage ran 3 forwards and 3 backwards a step, on the timeline.
    assert all(sorted(a for a, *_ in s["timeline"]) == ["B"] * 3 + ["F"] * 3 for m in steps for s in m.stages)
    assert sorted(p.name for p in checkpoint.folder(tmp_path).iterdir() if p.name.startswith("step-")) == \
        ["step-2", "step-4"]
    assert worst(model_weights(tmp_path, 4), reference.train(spec)) <= 1e-5


def test_a_resume_with_another_balance_and_replicas_ends_as_uninterrupted(tmp_path):
    spec = job(THREE_STAGES, checkpoint_every=2)
    drive(plan_of({**spec, "steps": 2}), tmp_path / "a")
    ck = checkpoint.load(checkpoint.step_dir(checkpoint.folder(tmp_path / "a"), 2))
    resumed = {**spec, "stages": 2, "balance": [4, 3]}  # the same micro-batches, cut elsewhere
    steps, _ = drive(plan_of(resumed), tmp_path / "b", resume=ck)
    assert [m.step for m in steps] == [2, 3]
    assert worst(model_weights(tmp_path / "b", 4), reference.train(spec)) <= 1e-5


def test_evaluation_runs_between_the_steps_and_equals_one_device(tmp_path):
    held_out = {"factory": "random_regression", "args": {"n": 10, "in_features": 16, "out_features": 16, "seed": 9},
                "batch_size": 4}
    spec = job(THREE_STAGES, eval={"data": held_out, "every": 2})
    steps, evals = drive(plan_of(spec), tmp_path)
    assert [m.step for m in evals] == [1, 3]
    want, n = reference.evaluate(spec, reference.train({**spec, "steps": 2}), [2, 3, 2])
    assert evals[0].eval_samples == n == 10 and abs(evals[0].eval_loss - want) < 1e-5


def test_a_stage_that_raises_fails_the_run_naming_it_with_its_fields(tmp_path):
    # FailAfter (layer 2, on stage 1) raises on its 4th forward: the second step's first (3 micro-batches a
    # step), step 2 as the progress line counts (its StageError's step: the index, 1).
    spec = job(THREE_STAGES, model={"factory": "tests.support.models:failing_mlp", "args": {"width": 16, "calls": 4}}, balance=[1, 2, 1],
               clip_grad_norm=None, activation_checkpoint="never")
    with pytest.raises(JobFailed) as failed:
        drive(plan_of(spec), tmp_path)
    e = failed.value.error
    assert e is not None and e.cause is Cause.RAISED and e.stage == 1 and e.step == 1
    assert "stage 1 (layers 1-2) failed at step 2: ValueError: boom after 4 forwards" in str(failed.value)


def test_a_preemption_stops_at_the_first_step_not_yet_sent_with_a_checkpoint_that_resumes_as_uninterrupted(tmp_path):
    spec = job(THREE_STAGES, steps=8, checkpoint_every=100, eval={"data": {**REGRESSION, "batch_size": 8}, "every": 4})
    plan = plan_of(spec)
    steps: list[StepMetrics] = []
    evals: list[EvalMetrics] = []
    run = Run(plan, steps.append, on_eval=lambda m, w: evals.append(m))
    run.preempted = lambda: len(steps) >= 2  # asked once step 1 has ended: steps 2 and 3 are sent already
    writer = checkpoint.Writer(checkpoint.folder(tmp_path / "a"), 2, lambda *a: None)
    run.build(local_stages(plan, 0))
    run.train(0, writer.submit)
    writer.close()
    assert run.stop_after == 3 and [m.step for m in steps] == [0, 1, 2, 3]  # the steps in flight, then no more
    assert checkpoint.committed(checkpoint.folder(tmp_path / "a")) == [4]  # checkpoint_every is 100
    assert not evals  # the evaluation due after step 4 is the next attempt's, where it resumes
    StageServer.close_all()
    ck = checkpoint.load(checkpoint.step_dir(checkpoint.folder(tmp_path / "a"), 4))
    steps, evals = drive(plan_of(spec), tmp_path / "b", resume=ck)
    assert [m.step for m in steps] == [4, 5, 6, 7]  # nothing before the checkpoint runs again
    assert [m.step for m in evals] == [3, 7]  # after steps 4 and 8, counted from 1: each once
    assert worst(model_weights(tmp_path / "b", 8), reference.train(spec)) <= 1e-5


@pytest.mark.parametrize("ahead", [1, 3])
def test_the_read_ahead_is_how_many_steps_are_sent_before_the_oldest_ends(tmp_path, ahead):
    # Asked once step 1 has ended, the preemption ends the attempt at the first step not yet sent: the
    # steps in flight then are 2 ... 1 + data.read_ahead - 1, so that step is 1 + read_ahead.
    spec = job(THREE_STAGES, steps=8, checkpoint_every=100, data__read_ahead=ahead)
    steps: list[StepMetrics] = []
    run = Run(plan_of(spec), steps.append)
    run.preempted = lambda: len(steps) >= 2
    writer = checkpoint.Writer(checkpoint.folder(tmp_path), 2, lambda *a: None)
    run.build(local_stages(run.plan, 0))
    run.train(0, writer.submit)
    writer.close()
    assert run.stop_after == 1 + ahead and [m.step for m in steps] == list(range(2 + ahead))


# -- virtual stages: several model chunks per worker ----------------------------------------------------------

VIRTUAL = {
    # 2 workers x 2 chunks, chunk c on worker c mod 2; 4 micro-batches (a multiple of the workers)
    "interleaved-1f1b": job(THREE_STAGES, stages=2, virtual_stages=2, balance=[2, 2, 1, 2], chunks=4, data={**REGRESSION,
                            "batch_size": 11}, schedule="interleaved-1f1b"),
    # zbv: worker 0 holds chunks 0 and 3, worker 1 chunks 1 and 2 (a cut within a worker); 3 micro-batches
    "zbv": job(THREE_STAGES, stages=2, virtual_stages=2, balance=[2, 1, 2, 2], schedule="zbv", activation_checkpoint="always"),
}


@pytest.mark.parametrize("name", list(VIRTUAL))
def test_virtual_stages_over_local_stages_train_as_one_device_and_resume_under_1f1b(tmp_path, name):
    held_out = {"factory": "random_regression", "args": {"n": 10, "in_features": 16, "out_features": 16, "seed": 9},
                "batch_size": 4}
    spec = {**VIRTUAL[name], "checkpoint_every": 2, "eval": {"data": held_out, "every": 2}}
    steps, evals = drive(plan_of({**spec, "steps": 2}), tmp_path / "a")
    want, n = reference.evaluate(spec, reference.train({**spec, "steps": 2}))  # each chunk forward in eval mode
    assert [m.step for m in evals] == [1] and evals[0].eval_samples == n == 10
    assert abs(evals[0].eval_loss - want) < 1e-5
    # a stage per model chunk, each with its worker's rank; the bubble counts each worker's step once
    assert [(s["stage"], s["rank"]) for s in steps[0].stages] == \
        ([(0, 0), (1, 1), (2, 0), (3, 1)] if name != "zbv" else [(0, 0), (1, 1), (2, 1), (3, 0)])
    assert all(0 <= m.bubble_fraction < 1 for m in steps)
    kinds = "BFW" if name == "zbv" else "BF"
    assert all(sorted({a for a, *_ in s["timeline"]}) == list(kinds) for s in steps[0].stages)
    ck = checkpoint.load(checkpoint.step_dir(checkpoint.folder(tmp_path / "a"), 2))
    assert len(ck.shards) == 4  # a shard per model chunk
    resumed = {**spec, "virtual_stages": 1, "schedule": "1f1b", "stages": 3, "balance": [2, 3, 2]}
    steps, _ = drive(plan_of(resumed), tmp_path / "b", resume=ck)
    assert [m.step for m in steps] == [2, 3]
    assert worst(model_weights(tmp_path / "b", 4), reference.train(spec)) <= 1e-5


def test_a_model_chunk_that_raises_fails_the_run_naming_it_not_the_chunk_beside_it(tmp_path):
    # FailAfter (layer 2: model chunk 2, on worker 0 beside chunk 0) raises on its 4th forward: the first step's
    # last (step 1 as the progress line counts).
    spec = job(THREE_STAGES, model={"factory": "tests.support.models:failing_mlp", "args": {"width": 16, "calls": 4}}, stages=2,
               virtual_stages=2, schedule="interleaved-1f1b", balance=[1, 1, 1, 1], chunks=4, clip_grad_norm=None,
               activation_checkpoint="never", data={**REGRESSION, "batch_size": 8})
    with pytest.raises(JobFailed) as failed:
        drive(plan_of(spec), tmp_path)
    e = failed.value.error
    assert e is not None and e.cause is Cause.RAISED and (e.stage, e.rank, e.step) == (2, 0, 0)
    assert "model chunk 2 (layer 2) on stage 0 failed at step 1: ValueError: boom after 4 forwards" in str(failed.value)


def test_the_supervisor_s_sigterm_in_a_layer_s_backward_ends_the_attempt_and_is_never_the_model_s_error():
    """SIGTERM lands wherever the attempt process is; in the probe's backward of the job's own layer, `except
    Exception` there named it the model's error (a SpecError: bad input, the job failed for good)."""
    import os
    import signal

    from torch import nn

    from gpipe.coordinator.attempt import process
    from gpipe.memory.probe import probe

    class Term(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            os.kill(os.getpid(), signal.SIGTERM)  # the supervisor ends the attempt now
            for _ in range(1000):  # the handler runs at the next bytecode of this thread
                g = g + 0
            return g

    class Layer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Term.apply(x)

    old = signal.signal(signal.SIGTERM, process._stopped)
    try:
        with pytest.raises(process.AttemptEnded):
            probe(nn.Sequential(nn.Linear(4, 4), Layer(), nn.Linear(4, 4)), torch.randn(4, 4), torch.randn(4, 4),
                  nn.functional.mse_loss)
    finally:
        signal.signal(signal.SIGTERM, old)
