"""`optimizer.shard` through `run` (real processes, c10d's gathers among each stage's copies): the weights equal
one device's on the same micro-batches, each copy holds its share of the state, checkpoints hold the unsharded
state under the model's names, and a job resumes across shard on and off and across replica counts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.support import reference
from tests.support.spec import TWO_STAGES, job

DROPOUT = {"factory": "tests.support.models:mlp_dropout", "args": {"width": 16, "depth": 3}}
ODD = {"factory": "tests.support.models:mlp_dropout", "args": {"width": 7, "depth": 5}}  # 7x7 + 7: odd cuts
DATA = {"factory": "random_regression", "args": {"n": 64, "in_features": 16, "out_features": 16}, "batch_size": 8}


def run_job(cli, spec: dict, *flags: str):
    return cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress", *flags,
                   timeout=240)


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def sharded(**changes) -> dict:
    base = {"model": DROPOUT, "data": DATA, "stages": 2, "replicas": 2, "chunks": 2, "steps": 3,
            "optimizer": {"name": "adamw", "lr": 0.01, "shard": True}}
    return job(TWO_STAGES, base, **changes)


CASES = {
    # 2 replicas x 2 stages: adamw, clipping to the global norm (taken once, over whole gradients), 1f1b
    "2x2-adamw-clip-1f1b": sharded(clip_grad_norm=0.2, schedule="1f1b"),
    # 2 replicas x 3 stages: adam, odd parameter sizes cut mid-parameter, recomputation
    "2x3-adam-odd-ckpt": sharded(model=ODD, stages=3, balance=[6, 6, 4], activation_checkpoint="always",
                                 data={**DATA, "args": {"n": 64, "in_features": 7, "out_features": 7}},
                                 optimizer={"name": "adam", "lr": 0.01, "shard": True}),
    # sgd with momentum, zbv (two model chunks a worker, each sharded among its own copies)
    "2x2-sgd-momentum-zbv": sharded(schedule="zbv", virtual_stages=2, balance=[3, 2, 2, 3], chunks=2,
                                    optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9, "shard": True}),
    # fp16: the loss scale and the job's inf check on whole gradients, then the sharded step
    "2x3-adamw-fp16": sharded(stages=3, balance=[4, 3, 3], precision="fp16"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_sharded_replicas_equal_one_device(cli, name):
    spec = CASES[name]
    r = run_job(cli, spec)
    assert r.returncode == 0, r.stderr[-3000:]
    out = cli.tmp / "state" / "t"
    cuts = spec.get("balance") if spec.get("precision") == "fp16" else None
    diff = worst(load_file(out / "model.safetensors"), reference.train(spec, cuts=cuts))
    print(f"{name}: largest weight difference {diff:.3g}")
    assert diff <= 1e-5, f"{name}: weights differ from one device by {diff}"
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert not any(m.get("skipped") for m in lines)  # every step stepped (fp16: no overflow skipped one)
    assert worst(load_file(out / "model.safetensors"), reference.train({**spec, "steps": 0})) > 1e-3  # it trained


@pytest.mark.multiprocess
def test_a_checkpoint_holds_the_unsharded_state_and_resumes_across_shard_and_replica_counts(cli):
    """2 steps sharded on 2 replicas, then 2 unsharded on 1 replica, then 2 sharded on 2 replicas again (the
    same micro-batches each time): the weights equal 6 uninterrupted steps, and the sharded checkpoint's
    optimizer tensors equal those of the same 2 steps unsharded."""
    spec = sharded(steps=6, checkpoint_every=2)
    out = cli.tmp / "state" / "t"
    r = run_job(cli, {**spec, "steps": 2})
    assert r.returncode == 0, r.stderr[-3000:]
    step2 = out / "checkpoints" / "step-2"
    got = {k: v for k in sorted(step2.glob("stage-*.safetensors")) for k, v in load_file(k).items()}
    moments = {k: v for k, v in got.items() if k.startswith("optim/")}
    # every parameter's two moments and step, each whole, named by the model's names
    assert {k.rsplit("/", 1)[1] for k in moments} == {"exp_avg", "exp_avg_sq", "step"}
    for k, v in moments.items():
        name = k.removeprefix("optim/").rsplit("/", 1)[0]
        assert v.shape == (got["model/" + name].shape if not k.endswith("/step") else ())

    # the same 2 steps unsharded, in another job: the same optimizer tensors
    plain = {**spec, "name": "u", "steps": 2, "optimizer": {"name": "adamw", "lr": 0.01}}
    r = run_job(cli, plain)
    assert r.returncode == 0, r.stderr[-3000:]
    want = {k: v for k in sorted((cli.tmp / "state" / "u" / "checkpoints" / "step-2").glob("stage-*.safetensors"))
            for k, v in load_file(k).items() if k.startswith("optim/")}
    assert set(want) == set(moments)
    assert max((moments[k] - want[k]).abs().max().item() for k in want) <= 1e-6

    r = run_job(cli, {**spec, "steps": 4, "replicas": 1, "chunks": 4,
                      "optimizer": {"name": "adamw", "lr": 0.01}}, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from checkpoint step-2" in r.stderr
    r = run_job(cli, spec, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from checkpoint step-4" in r.stderr
    diff = worst(load_file(out / "model.safetensors"), reference.train(spec))
    print(f"resume sharded 2 -> unsharded 1 -> sharded 2: largest weight difference {diff:.3g}")
    assert diff <= 1e-5
    meta = json.loads((out / "checkpoints" / "step-6" / "checkpoint.json").read_text())
    assert meta["replicas"] == 2


@pytest.mark.multiprocess
def test_shard_with_one_replica_is_refused_in_one_line(cli):
    r = run_job(cli, job(TWO_STAGES, optimizer={"name": "adamw", "lr": 0.01, "shard": True}))
    assert r.returncode == 2
    assert "optimizer.shard" in r.stderr and "replica" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (cli.tmp / "state" / "t").exists()


def test_a_resumed_copy_holds_only_its_slice_of_each_optimizer_tensor():
    """gpipe.worker.state_stream.Incoming with a sharded optimizer: a checkpoint's whole optim/ tensors come in pieces of
    any size; the copy keeps its elements of each (gpipe.memory.zero.held), nothing of a parameter it holds no piece
    of, and a number whole; a missing byte is still refused."""
    from gpipe import stream
    from gpipe.memory import zero
    from gpipe.worker.state_stream import Incoming

    layers = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))  # 15, 3, 3, 1 elements
    full = {f"optim/{n}/exp_avg": torch.arange(p.numel(), dtype=torch.float32).view_as(p) + 100 * i
            for i, (n, p) in enumerate(layers.named_parameters())}
    full["optim/0.weight/step"] = torch.tensor(3.0)
    for replica in range(2):
        held = zero.held(layers, 2, replica)
        inc = Incoming(layers, held)
        inc.expect({k: (stream.DTYPES[v.dtype], list(v.shape)) for k, v in full.items()})
        for name, t in full.items():
            raw = stream.as_bytes(t.contiguous())
            for at in range(0, len(raw), 7):  # pieces that cut elements
                inc.receive([(name, at, raw[at:at + 7])])
        state = inc.finish({"param_groups": []}, weights_sent=False)
        assert state is not None
        for n, (lo, hi) in held.items():
            got = state.tensors[f"optim/{n}/exp_avg"]
            assert torch.equal(got, full[f"optim/{n}/exp_avg"].reshape(-1)[lo:hi])
        assert float(state.tensors["optim/0.weight/step"]) == 3.0
    assert sum(hi - lo for r in range(2) for lo, hi in zero.held(layers, 2, r).values()) == 22

    inc = Incoming(layers, zero.held(layers, 2, 1))
    inc.expect({"optim/0.weight/exp_avg": ("F32", [3, 5])})
    inc.receive([("optim/0.weight/exp_avg", 0, stream.as_bytes(torch.zeros(14)))])
    with pytest.raises(ValueError, match="56 of its 60 bytes"):
        inc.finish({}, weights_sent=False)


def test_a_checkpoint_copy_refuses_a_tensor_its_header_did_not_declare(monkeypatch):
    """gpipe.worker.state_stream.Outgoing checks every tensor against the header written before it: a sharded
    optimizer's step declared float32 and fetched as float64 (a job whose code sets a float64 default) shifted
    every later tensor in the file, rng/cpu included, and nothing noticed. Now the declared dtype is the fetched
    one (gpipe.memory.zero._scalar_dtype), and a mismatch is refused, naming the tensor."""
    from gpipe.memory import zero
    from gpipe.state import StageState
    from gpipe.worker import state_stream

    declared = {"optim/0.weight/step": torch.empty((), dtype=torch.float32, device="meta"),
                "rng/cpu": torch.zeros(4, dtype=torch.uint8)}
    wrong = StageState(dict(declared), fetch=lambda name: torch.tensor(3.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"optim/0.weight/step: the header declares F32 \[\], the tensor written "
                                         r"is F64 \[\]"):
        state_stream.Outgoing(1, wrong)
    monkeypatch.setattr(state_stream, "IN_MEMORY_BYTES", 0)  # the same check on the way into a file
    with pytest.raises(ValueError, match="the header declares F32"):
        state_stream.Outgoing(1, wrong)
    right = StageState(dict(declared), fetch=lambda name: torch.tensor(3.0, dtype=torch.float32))
    assert state_stream.Outgoing(1, right).data_bytes == 4 + 4
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert zero._scalar_dtype() == torch.float64  # what fetch() returns, and now what is declared
    finally:
        torch.set_default_dtype(before)
