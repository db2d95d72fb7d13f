"""BatchNorm equals one device: running statistics once per micro-batch, or once per step (deferred).

Activation checkpointing runs a micro-batch's forward again in the backward;
that recomputation must not update BatchNorm's running statistics a second
time (nor any buffer a forward updates). With `deferred_batch_norm`, the
running statistics move once a step, by the whole batch's statistics.

In process; the runs through real processes are in tests/service/test_batchnorm.py.
"""

from __future__ import annotations

import pytest
import torch

from gpipe import batchnorm
from gpipe.factory import resolve
from gpipe.rng import seeded_forward
from gpipe.state import StageState
from tests.support import reference
from tests.support.batchnorm import compare, counts, figures
from tests.support.local import attempt_secret, built, plan_of, run, weights_of  # noqa: F401  (autouse)
from tests.support.spec import BATCHNORM, ONE_STAGE, job

BN, DATA = BATCHNORM["model"], BATCHNORM["data"]










@pytest.mark.parametrize("deferred", [False, True], ids=["per-micro-batch", "deferred"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpointing", ["never", "except_last", "always"])
def test_a_stage_with_batch_norm_equals_one_device(checkpointing, schedule, deferred):
    spec = job(ONE_STAGE, BATCHNORM, schedule=schedule, activation_checkpoint=checkpointing, deferred_batch_norm=deferred)
    plan = plan_of(spec)
    with built(plan, plan.stage_state(0)) as stage:
        run(stage, plan, range(spec["steps"]))
        got = weights_of(stage)
    tracked, calls = counts(spec)
    assert int(got["1.num_batches_tracked"]) == tracked and int(got["3.calls"]) == calls
    want = reference.train(spec)
    worst = compare(got, want)
    print(f"{checkpointing}-{schedule}-{'deferred' if deferred else 'per micro-batch'}: {figures(got, want)}")
    assert worst <= 1e-5, f"weights or running statistics differ from one device by {worst}"


def test_deferred_statistics_are_the_whole_batch_s():
    # One step: the running statistics after it are those of the batch, not of its micro-batches in turn.
    spec = job(ONE_STAGE, BATCHNORM, chunks=5, steps=1, deferred_batch_norm=True)
    want = reference.train(spec)
    per_micro_batch = reference.train({**spec, "deferred_batch_norm": False})
    stats = ("1.running_mean", "1.running_var", "6.running_mean", "6.running_var", "10.running_var")
    # The two contracts differ, so the tests tell them apart (bar a cumulative mean of equal micro-batches).
    assert all((want[k] - per_micro_batch[k]).abs().max() > 1e-3 for k in stats if k != "6.running_mean")

    # The public helper reproduces the deferred statistics on one device.
    torch.manual_seed(spec["seed"])
    model = batchnorm.convert_deferred_batch_norm(resolve(BN["factory"])(**BN["args"]))
    data = resolve(DATA["factory"])(**DATA["args"])
    x, _ = (torch.stack(t) for t in zip(*(data[i] for i in range(DATA["batch_size"])), strict=True))
    for i, xm in enumerate(torch.tensor_split(x, spec["chunks"])):
        seeded_forward(list(enumerate(model)), xm, spec["seed"], 0, i)  # the reference's dropout masks
    batchnorm.commit(model)
    got = model.state_dict()
    assert int(got["1.num_batches_tracked"]) == 1
    for k in stats:
        assert (got[k] - want[k]).abs().max() <= 1e-5, k  # the optimizer's step moved only the weights


def test_a_snapshot_with_deferred_batch_norm_resumes_bit_for_bit():
    spec = job(ONE_STAGE, BATCHNORM, activation_checkpoint="always", deferred_batch_norm=True, steps=4)
    plan = plan_of(spec)
    with built(plan, plan.stage_state(0)) as stage:
        run(stage, plan, range(2))
        snap = stage.snapshot()
        run(stage, plan, range(2, 4))
        want = weights_of(stage)
    rest = StageState({k: v for k, v in snap.tensors.items() if not k.startswith("model/")}, snap.json_state)
    with built(plan, snap.model_state(), rest) as fresh:
        run(fresh, plan, range(2, 4))
        got = weights_of(fresh)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_plan_json_gives_each_stage_one_parameter_count_buffers_apart(tmp_path):
    import json

    from gpipe.coordinator.attempt.metrics import write_plan

    plan = plan_of(job(ONE_STAGE, model={"factory": "tests.support.models:bn_net"}, stages=2, balance=[6, 6]))
    write_plan(tmp_path, plan, [{}] * 2)
    stages = json.loads((tmp_path / "plan.json").read_text())["stages"]
    model = resolve("tests.support.models:bn_net")()
    held = [sum(p.numel() for p in model[i].parameters()) for i in range(len(model))]
    assert [s["parameters"] for s in stages] == [sum(held[:6]), sum(held[6:])]  # running statistics apart
    assert all("params" not in s for s in stages)
