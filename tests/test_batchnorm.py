"""BatchNorm equals one device: running statistics once per micro-batch, or once per step (deferred).

Activation checkpointing runs a micro-batch's forward again in the backward;
that recomputation must not update BatchNorm's running statistics a second
time (nor any buffer a forward updates). With `deferred_batch_norm`, the
running statistics move once a step, by the whole batch's statistics.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from gpipe import batchnorm
from gpipe.factory import resolve
from gpipe.rng import seeded_forward
from gpipe.state import StageState
from tests import reference
from tests.test_stage import attempt_secret, built, plan_of, run, weights_of  # noqa: F401  (autouse)
from tests.test_stage import job as stage_job

BN = {"factory": "tests.models:bn_net", "args": {"width": 8}}
DATA = {"factory": "random_regression", "args": {"n": 40, "in_features": 8, "out_features": 8}, "batch_size": 10}


def job(**kw) -> dict:
    return stage_job(**{"model": BN, "data": DATA, "chunks": 3, "optimizer": {"name": "sgd", "lr": 0.1}, **kw})


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest difference over weights and running statistics; counters must be equal."""
    assert set(got) == set(want)
    for k in want:
        if not want[k].is_floating_point():
            assert torch.equal(got[k], want[k]), f"{k}: {got[k]} != {want[k]}"
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def figures(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str:
    """The largest difference of the weights, and of the running statistics, for the log."""
    def worst(stats: bool) -> float:
        return max((got[k] - want[k]).abs().max().item() for k in want if ("running_" in k) == stats)
    return f"weights {worst(False):.3g}, running statistics {worst(True):.3g}"


def counts(spec: dict) -> tuple[int, int]:
    """num_batches_tracked and Calls' count after the job: per micro-batch, or per step when deferred."""
    tracked = spec["steps"] * (1 if spec.get("deferred_batch_norm") else spec["chunks"])
    return tracked, spec["steps"] * spec["chunks"]


@pytest.mark.parametrize("deferred", [False, True], ids=["per-micro-batch", "deferred"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpointing", ["never", "except_last", "always"])
def test_a_stage_with_batch_norm_equals_one_device(checkpointing, schedule, deferred):
    spec = job(schedule=schedule, activation_checkpoint=checkpointing, deferred_batch_norm=deferred)
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
    spec = job(chunks=5, steps=1, deferred_batch_norm=True)
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
    spec = job(activation_checkpoint="always", deferred_batch_norm=True, steps=4)
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


# Real processes: per-micro-batch statistics here; whole-batch (deferred) ones in the resumed job below. Every
# schedule x checkpointing x deferral runs through gpipe.Pipeline in tests/test_pipeline.py.
MULTI = {
    # three stages, the last micro-batch kept, uneven micro-batches (10 = 3+3+2+2)
    "3stages-1f1b-except_last": job(stages=3, chunks=4, schedule="1f1b", activation_checkpoint="except_last"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(MULTI))
def test_pipelined_batch_norm_equals_one_device(cli, name):
    spec = {**MULTI[name], "name": "bn"}
    r = cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress")
    assert r.returncode == 0, r.stderr
    got = load_file(cli.tmp / "state" / "bn" / "model.safetensors")
    tracked, calls = counts(spec)
    assert int(got["1.num_batches_tracked"]) == tracked and int(got["3.calls"]) == calls
    want = reference.train(spec)
    worst = compare(got, want)
    print(f"{name}: {figures(got, want)}")
    assert worst <= 1e-5, f"{name}: differs from one device by {worst}"


@pytest.mark.multiprocess
def test_a_job_with_deferred_batch_norm_resumed_mid_way_ends_as_uninterrupted(cli):
    # Two stages, all forwards then all backwards, every forward recomputed: resumed from step 4 of 6.
    spec = {**job(stages=2, deferred_batch_norm=True, activation_checkpoint="always", steps=6),
            "name": "bn", "checkpoint_every": 2, "keep_checkpoints": 2}
    path, state = cli.write(spec), cli.tmp / "state"
    r = cli.run("run", str(path), "--state-dir", str(state), "--no-progress")
    assert r.returncode == 0, r.stderr
    out = state / "bn"
    want = load_file(out / "model.safetensors")
    shutil.rmtree(out / "checkpoints" / "step-6")
    (out / "model.safetensors").unlink()
    r = cli.run("run", str(path), "--state-dir", str(state), "--no-progress", "--resume")
    assert r.returncode == 0, r.stderr
    assert "bn: resuming from checkpoint step-4 " in r.stderr
    got = load_file(out / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)  # bit for bit
    assert compare(got, reference.train(spec)) <= 1e-5


def test_plan_json_gives_each_stage_one_parameter_count_buffers_apart(tmp_path):
    import json

    from coordinator.metrics import write_plan

    plan = plan_of(stage_job(model={"factory": "tests.models:bn_net"}, stages=2, balance=[6, 6]))
    write_plan(tmp_path, plan, [{}] * 2)
    stages = json.loads((tmp_path / "plan.json").read_text())["stages"]
    model = resolve("tests.models:bn_net")()
    held = [sum(p.numel() for p in model[i].parameters()) for i in range(len(model))]
    assert [s["parameters"] for s in stages] == [sum(held[:6]), sum(held[6:])]  # running statistics apart
    assert all("params" not in s for s in stages)
