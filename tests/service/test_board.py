"""TensorBoard scalars: a real `run`, read back with TensorBoard's own reader, against metrics.jsonl."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpipe.coordinator.attempt.board import STEP_SCALARS
from tests.support.spec import job, regression


def _spec() -> dict:
    # Each attempt fails at its 9th forward (2 micro-batches a step, 2 an evaluation after every second step):
    # with a checkpoint every 2 steps, attempt 2 resumes at step 2 and attempt 3 at step 4, so metrics.jsonl
    # logs some steps twice.
    return job(name="tb", seed=3, model={"factory": "tests.support.models:failing_mlp", "args": {"width": 16, "calls": 9}},
               balance=[2, 2], data=regression(48, 16, 8), optimizer__lr=0.05, clip_grad_norm=10.0, steps=6,
               checkpoint_every=2, max_restarts=2, eval={"every": 2, "data": regression(8, 16, 8)})


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    ea = EventAccumulator(str(folder))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


@pytest.mark.multiprocess
def test_run_writes_each_steps_scalars_once_through_restarts(cli):
    state = cli.tmp / "state"
    r = cli.run("run", str(cli.write(_spec())), "--state-dir", str(state), "--no-progress", timeout=150)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("RESTARTING") == 2, r.stderr
    lines = [json.loads(x) for x in (state / "tb" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss" in m]
    assert sorted({m["step"] for m in steps}) == list(range(6)) and len(steps) > 6, lines  # some steps twice
    last = {m["step"]: m for m in steps}  # each step as its last attempt ran it
    evals = {m["step"]: m["eval_loss"] for m in lines if "eval_loss" in m}
    assert sorted(evals) == [1, 3, 5] and sum("eval_loss" in m for m in lines) > 3  # some evaluated twice

    got = scalars(state / "tb" / "tensorboard")
    assert set(got) == {*STEP_SCALARS, "eval_loss"}
    for tag in STEP_SCALARS:
        # Each step once, in order (what the earlier attempts wrote of a resumed step is purged), at its value.
        assert [s for s, _ in got[tag]] == list(range(6)), (tag, got[tag])
        assert [v for _, v in got[tag]] == pytest.approx([last[s][tag] for s in range(6)], rel=1e-6), tag
    # An evaluation at the steps done before it; the resumed attempts evaluated again where they resumed.
    assert [s for s, _ in got["eval_loss"]] == [2, 4, 6]
    assert [v for _, v in got["eval_loss"]] == pytest.approx([evals[s] for s in (1, 3, 5)], rel=1e-6)

    # A fresh start (no --resume) drops the earlier run's scalars with its metrics and checkpoints.
    fresh = dict(_spec(), steps=2, model={"factory": "mlp", "args": {"width": 16, "depth": 3}})
    r = cli.run("run", str(cli.write(fresh)), "--state-dir", str(state), "--no-progress", timeout=150)
    assert r.returncode == 0, r.stderr
    assert [s for s, _ in scalars(state / "tb" / "tensorboard")["loss"]] == [0, 1]
