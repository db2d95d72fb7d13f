"""Pipelining changes where the math runs, never the math: every run equals one device."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from gpipe.schedule import REGISTRY
from tests.support import reference
from tests.support.runs import check_steady, train_and_compare
from tests.support.spec import TWO_STAGES, job, slow_mlp

pytestmark = pytest.mark.multiprocess

MLP = {"factory": "mlp", "args": {"width": 16, "depth": 5}}
REGRESSION = {"factory": "random_regression", "args": {"n": 50, "in_features": 16, "out_features": 16}}






# Real processes over c10d, one case per path the in-process matrix (tests/engine/test_pipeline.py: every schedule,
# checkpointing mode and balance, Transformers, micro-batches of one) does not take: the coordinator's data
# stream (shuffled, wrapping around mid-step), balance by time and by memory, clipping across processes.
CASES = {
    # balanced by measured time; 20 items, 7 a step: the data wraps around mid-step, reshuffled each epoch;
    # uneven micro-batches (7 = 3+2+2), adam, global clipping across stages, and zb-h1's backward split into
    # B and W across processes
    "3stages-by_time-zb-h1-shuffle-wraparound-uneven-adam-clip": job(TWO_STAGES,
        stages=3, balance="by_time", chunks=3, schedule="zb-h1", steps=6, clip_grad_norm=0.5,
        data={**REGRESSION, "args": {**REGRESSION["args"], "n": 20}, "batch_size": 7, "shuffle": True},
        optimizer={"name": "adam", "lr": 0.01},
    ),
    # four stages balanced by memory, 1f1b, dropout (torch's and a layer's own F.dropout, unmarked: the
    # recomputation replays both masks), recomputed activations
    "4stages-1f1b-own-dropout-checkpoint": job(TWO_STAGES,
        stages=4, chunks=4, schedule="1f1b", activation_checkpoint="always", balance="by_memory",
        model={"factory": "tests.support.models:mlp_own_dropout", "args": {"width": 16, "depth": 3}},
        optimizer={"name": "adamw", "lr": 0.01},
    ),
}


@pytest.mark.path  # `run`, end to end (make test)
@pytest.mark.parametrize("name", list(CASES))
def test_pipelined_weights_equal_one_device(cli, name):
    train_and_compare(cli, name, CASES[name])






# Several model chunks per worker (virtual stages), over c10d: a worker process holds a Stage per chunk.
VIRTUAL = {
    # 2 workers x 3 chunks (chunk c on worker c mod 2): skips from chunk 0 to 3 (worker 0 to 1), 1 to 5 (within
    # worker 1, in memory) and 4 to 5; uneven micro-batches (10 = 3+3+2+2), recomputation, clipping summed
    # within each worker then across
    "interleaved-1f1b-skips-clip": job(TWO_STAGES,
        model={"factory": "tests.support.models:skip_mlp", "args": {"width": 16, "skip_width": 24}}, stages=2,
        virtual_stages=3, balance=[1] * 6, chunks=4, schedule="interleaved-1f1b", data={**REGRESSION, "batch_size": 10},
        activation_checkpoint="except_last", clip_grad_norm=0.5, steps=3,
    ),
    # zbv (worker 0 holds chunks 0 and 3, worker 1 chunks 1 and 2: the V's bottom is a cut within worker 1),
    # 2 replicas (each chunk's copies sum their gradients as its last W ends), dropout, recomputation, clipping
    "zbv-2replicas-dropout-clip": job(TWO_STAGES,
        model={"factory": "tests.support.models:mlp_dropout", "args": {"width": 16, "depth": 3}}, stages=2, virtual_stages=2,
        balance=[3, 2, 2, 3], chunks=3, schedule="zbv", replicas=2, data={**REGRESSION, "batch_size": 13},
        activation_checkpoint="always", clip_grad_norm=0.5, steps=3,
    ),
    # v-min and dualpipev: zbv's V in their own orders, over processes (gpipe.Pipeline's tests cover the features)
    "v-min-dropout-except_last": job(TWO_STAGES,
        model={"factory": "tests.support.models:mlp_dropout", "args": {"width": 16, "depth": 3}}, stages=2, virtual_stages=2,
        balance=[3, 2, 2, 3], chunks=5, schedule="v-min", data={**REGRESSION, "batch_size": 11},
        activation_checkpoint="except_last", steps=3,
    ),
    "dualpipev-2replicas-clip": job(TWO_STAGES,
        model={"factory": "tests.support.models:mlp_dropout", "args": {"width": 16, "depth": 3}}, stages=2, virtual_stages=2,
        balance=[3, 2, 2, 3], chunks=4, schedule="dualpipev", replicas=2, data={**REGRESSION, "batch_size": 13},
        clip_grad_norm=0.5, steps=3,
    ),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(VIRTUAL))
def test_virtual_stages_over_processes_equal_one_device(cli, name):
    spec = VIRTUAL[name]
    r = cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress")
    assert r.returncode == 0, r.stderr
    out = cli.tmp / "state" / "t"
    want = reference.train(spec)
    got = load_file(out / "model.safetensors")
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"{name}: largest weight difference {worst:.3g}")
    assert worst <= 1e-5, f"{name}: weights differ from one device by {worst}"

    P, V, R = spec["stages"], spec["virtual_stages"], spec.get("replicas", 1)
    plan = json.loads((out / "plan.json").read_text())
    chunks_of = [[c for c in range(P * V) if c % P == k] for k in range(P)] if not REGISTRY[spec["schedule"]].v_shape \
        else [[k, 2 * P - 1 - k] for k in range(P)]
    assert plan["schedule"]["model_chunks"] == chunks_of and len(plan["schedule"]["actions"]) == P
    check_steady(plan["schedule"], spec)
    assert [w["model_chunks"] for w in plan["workers"]] == chunks_of * R and len(plan["stages"]) == P * V
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(spec["steps"]))
    for m in lines:  # a stage per model chunk per replica, with its worker's rank
        assert [(s["replica"], s["stage"]) for s in m["stages"]] == [(r, c) for r in range(R) for c in range(P * V)]
        assert [s["rank"] for s in m["stages"]] == [r * P + k for r in range(R) for c in range(P * V)
                                                    for k in range(P) if c in chunks_of[k]]
        assert 0 <= m["bubble_fraction"] < 1
    # The timeline: a row per worker, its actions named with their model chunk (W: the split backward's).
    trace = json.loads((out / "trace.json").read_text())
    rows = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert rows[:P] == [f"rank {k}: chunks {', '.join(map(str, chunks_of[k]))}" for k in range(P)]
    kinds = "FBW" if REGISTRY[spec["schedule"]].v_shape else "FB"  # the V's schedules split the backward
    for k in range(P):
        names = sorted(e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == k)
        assert names == sorted(f"{a}{i}c{c}" for a in kinds for i in range(spec["chunks"]) for c in chunks_of[k])
    # A checkpoint holds a shard per model chunk.
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert len(list(ckpt.glob("stage-*.safetensors"))) == P * V


@pytest.mark.multiprocess
def test_serve_runs_zbv_on_two_workers_as_one_device(cli):
    """Under serve, a zbv job (2 workers x 2 model chunks) takes ranks 0 and 1, each daemon's attempt holding two
    chunks, and trains as one device does."""
    from tests.support.service import Service
    s = Service(cli)
    try:
        s.start_serve()
        s.start_worker(0)
        s.start_worker(1)
        spec = {**VIRTUAL["zbv-2replicas-dropout-clip"], "replicas": 1, "name": "zbv", "steps": 2}
        r = s.client("submit", str(cli.write(spec)))
        assert r.returncode == 0, r.stderr
        s.wait_for(lambda: (s.state / "zbv" / "model.safetensors").exists(), "the job to finish", 120)
        want = reference.train(spec)
        got = load_file(s.state / "zbv" / "model.safetensors")
        assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
        lines = [json.loads(x) for x in s.client("logs", "zbv", "--json").stdout.splitlines()]
        assert [[(st["stage"], st["rank"]) for st in m["stages"]] for m in lines] == [[(0, 0), (1, 1), (2, 1), (3, 0)]] * 2
    finally:
        s.stop_all()


@pytest.mark.multiprocess
def test_a_worker_of_two_model_chunks_killed_mid_run_resumes_to_the_same_weights(cli):
    """SIGKILL worker 1 (model chunks 1 and 2 of a zbv job) after step 3: the supervisor restarts every rank
    from the last checkpoint, and the job ends with one device's weights."""
    from tests.support.runs import kill_mid_run, metrics
    slow = slow_mlp(16, 0.05)
    spec = job(TWO_STAGES, model=slow, stages=2, virtual_stages=2, schedule="zbv", balance=[1, 1, 1, 1], chunks=3, steps=20,
               checkpoint_every=2)
    out = cli.tmp / "state" / "t"
    err = kill_mid_run(cli, spec, "stage-1.log")
    assert "stage 1's worker process died (signal SIGKILL)" in err and "restart 1 of 3" in err, err
    assert any(m["attempt"] == 2 for m in metrics(out))
    got, want = load_file(out / "model.safetensors"), reference.train(spec)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
