"""Pipelining changes where the math runs, never the math: every run equals one device."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from gpipe.factory import resolve
from tests import reference

pytestmark = pytest.mark.multiprocess

MLP = {"factory": "mlp", "args": {"width": 16, "depth": 5}}
REGRESSION = {"factory": "random_regression", "args": {"n": 50, "in_features": 16, "out_features": 16}}


def job(**kw) -> dict:
    spec = {
        "name": "t", "seed": 3, "model": MLP, "stages": 2, "chunks": 2,
        "data": {**REGRESSION, "batch_size": 8}, "loss": "mse",
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "steps": 4,
    }
    spec.update(kw)
    return spec


# Real processes over c10d, one case per path the in-process matrix (tests/test_pipeline.py: every schedule,
# checkpointing mode and balance, Transformers, micro-batches of one) does not take: the coordinator's data
# stream (shuffled, wrapping around mid-step), balance by time and by memory, clipping across processes.
CASES = {
    # balanced by measured time; 20 items, 7 a step: the data wraps around mid-step, reshuffled each epoch;
    # uneven micro-batches (7 = 3+2+2), adam, global clipping across stages, and zb-h1's backward split into
    # B and W across processes
    "3stages-by_time-zb-h1-shuffle-wraparound-uneven-adam-clip": job(
        stages=3, balance="by_time", chunks=3, schedule="zb-h1", steps=6, clip_grad_norm=0.5,
        data={**REGRESSION, "args": {**REGRESSION["args"], "n": 20}, "batch_size": 7, "shuffle": True},
        optimizer={"name": "adam", "lr": 0.01},
    ),
    # four stages balanced by memory, 1f1b, dropout, recomputed activations
    "4stages-1f1b-dropout-checkpoint": job(
        stages=4, chunks=4, schedule="1f1b", activation_checkpoint="always", balance="by_memory",
        model={"factory": "tests.models:mlp_dropout", "args": {"width": 16, "depth": 3}},
        optimizer={"name": "adamw", "lr": 0.01},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pipelined_weights_equal_one_device(cli, name):
    train_and_compare(cli, name, CASES[name])


def train_and_compare(cli, name: str, spec: dict) -> list[dict]:
    """Run `spec` pipelined; its weights equal one device's to 1e-5. Returns the metrics' lines."""
    path = cli.write(spec)
    r = cli.run("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress")
    assert r.returncode == 0, r.stderr
    out = cli.tmp / "state" / "t"
    got = load_file(out / "model.safetensors")

    want = reference.train(spec)
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"{name}: largest weight difference {worst:.3g}")
    assert worst <= 1e-5, f"{name}: weights differ from one device by {worst}"

    # The weights load into the un-partitioned model.
    torch.manual_seed(0)
    resolve(spec["model"]["factory"])(**spec["model"]["args"]).load_state_dict(got)

    split = "W" if spec.get("schedule") == "zb-h1" else ""
    check_timeline(out, spec["stages"], spec["chunks"], spec["steps"], split)
    plan = json.loads((out / "plan.json").read_text())["schedule"]
    assert plan["name"] == spec.get("schedule", "gpipe") and len(plan["actions"]) == spec["stages"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(spec["steps"]))
    for m in lines:
        assert m["loss"] > 0 and m["step_time_s"] > 0 and m["samples_per_s"] > 0
        assert 0 <= m["bubble_fraction"] < 1
        assert [s["stage"] for s in m["stages"]] == list(range(spec["stages"]))
        assert all(s["busy_s"] > 0 and s["peak_memory_bytes"] > 0 for s in m["stages"])
    return lines


def check_timeline(out, stages: int, chunks: int, step: int, more: str = "") -> None:
    """trace.json holds each stage's forwards and backwards of step number `step` (counted from 1, as the
    progress bar counts), and the actions of kinds `more` (W); timeline.png is a PNG."""
    trace = json.loads((out / "trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert trace["traceEvents"][0]["args"]["name"] == f"step {step}"
    for k in range(stages):
        names = sorted(e["name"] for e in slices if e["tid"] == k)
        assert names == sorted(f"{kind}{i}" for kind in "FB" + more for i in range(chunks))
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in slices)
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
