"""Data parallelism: R copies of the pipeline train as one device does on the whole batch.

Each step's batch is cut into R contiguous shards, each into `chunks`
micro-batches; the one-device reference (tests/support/reference.py) runs the same
R*chunks micro-batches with gradient accumulation, and the weights must agree
to 1e-5.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load_file

from gpipe.coordinator.plan.data import DataStream
from gpipe.topology import Topology
from tests.support import reference
from tests.support.cli import wait_for
from tests.support.runs import kill_mid_run
from tests.support.spec import TWO_STAGES, job, slow_mlp

DROPOUT = {"factory": "tests.support.models:mlp_dropout", "args": {"width": 16, "depth": 3}}


def run_job(cli, spec: dict, *flags: str):
    return cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress", *flags)


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


# -- units --------------------------------------------------------------------------------------


def test_topology_maps_ranks_to_replicas_and_stages():
    top = Topology(stages=3, replicas=2)
    assert top.world == 6
    assert [(top.replica_of(n), top.stage_of(n)) for n in top.ranks()] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert top.replica_ranks(1) == [3, 4, 5] and top.stage_ranks(2) == [2, 5]
    assert all(top.rank(top.replica_of(n), top.stage_of(n)) == n for n in top.ranks())
    assert "2 replicas x 3 stages" in top.describe_ranks() and "0-5" in top.describe_ranks()
    assert Topology(stages=2).describe_ranks() == "ranks 0-1"
    assert Topology(stages=1, replicas=2).describe_ranks() == "ranks 0-1 (2 replicas x 1 stage)"


def test_shards_are_contiguous_and_as_equal_as_possible():
    data = torch.utils.data.TensorDataset(torch.arange(7.0).unsqueeze(1), torch.arange(7))
    shards = DataStream(data, batch_size=7, chunks=2, shuffle=False, seed=0, replicas=2).shards(0)
    assert [sizes for _, _, sizes in shards] == [[2, 2], [2, 1]]
    xs = [x.flatten().tolist() for shard in shards for x in shard[0]]
    assert xs == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0]]  # replica r's micro-batch i is number r*chunks+i
    one = DataStream(data, batch_size=7, chunks=2, shuffle=False, seed=0).shards(0)
    assert one[0][2] == [4, 3]


def test_the_progress_line_shows_each_replicas_step_time(capsys):
    from gpipe.coordinator.cli.progress import Follower, Progress

    follower = Follower("t", Progress(4, enabled=True))
    follower.show("metrics", {"step": 0, "loss": 0.5, "samples_per_s": 100.0,
                              "replicas": [{"replica": 0, "step_time_s": 0.25}, {"replica": 1, "step_time_s": 0.5}]})
    follower.show("metrics", {"step": 1, "loss": 0.4, "samples_per_s": 100.0, "replicas": [{"step_time_s": 0.1}]})
    err = capsys.readouterr().err.splitlines()
    assert "replicas 0.250/0.500 s" in err[0]
    assert "replicas" not in err[1]  # one replica: nothing to compare


# -- end to end -------------------------------------------------------------------------------------

# Real processes over c10d (the replicas' gradient buckets, the clipping group); odd shards, 1f1b with
# recomputation, skips, deferred BatchNorm and bf16 with replicas run through gpipe.Pipeline in
# tests/engine/test_pipeline.py.
CASES = {
    # 2 replicas x 2 stages, dropout (seeded by the global micro-batch index), momentum, clipping after the sum;
    # zb-h1: each stage's gradient buckets are summed as its last W (not B) finishes (the other schedules'
    # replicas run in the tests below)
    "2x2-zb-h1-dropout-except_last-clip": job(TWO_STAGES, model=DROPOUT, stages=2, replicas=2, chunks=3, clip_grad_norm=0.2,
                                      schedule="zb-h1", activation_checkpoint="except_last"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_replicas_equal_one_device(cli, name):
    spec = CASES[name]
    r = run_job(cli, spec)
    assert r.returncode == 0, r.stderr
    out = cli.tmp / "state" / "t"
    diff = worst(load_file(out / "model.safetensors"), reference.train(spec))
    print(f"{name}: largest weight difference {diff:.3g}")
    assert diff <= 1e-5, f"{name}: weights differ from one device by {diff}"

    R, P = spec["replicas"], spec["stages"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(spec["steps"]))
    for m in lines:
        assert [(s["replica"], s["stage"]) for s in m["stages"]] == [(r, k) for r in range(R) for k in range(P)]
        assert [x["replica"] for x in m["replicas"]] == list(range(R))
        assert all(x["step_time_s"] > 0 and x["busy_s"] > 0 and 0 <= x["bubble_fraction"] < 1 and x["reduce_s"] >= 0
                   for x in m["replicas"])
    if spec.get("clip_grad_norm"):  # clipping took effect: the norm (over the summed gradients) was above it
        assert any(m["grad_norm"] > spec["clip_grad_norm"] for m in lines)
    plan = json.loads((out / "plan.json").read_text())
    assert [(w["rank"], w["replica"], w["stage"]) for w in plan["workers"]] == [
        (r * P + k, r, k) for r in range(R) for k in range(P)]
    assert len(plan["stages"]) == P and plan["replicas"] == R
    # one copy of each stage's state in a checkpoint
    ckpt = sorted((out / "checkpoints").iterdir())[-1]
    assert sorted(p.name for p in ckpt.glob("stage-*.safetensors")) == [f"stage-{k}.safetensors" for k in range(P)]
    assert (out / "logs" / "replica-1-stage-1.log").exists()
    trace = json.loads((out / "trace.json").read_text())
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert names == [f"replica {r} stage {k}" for r in range(R) for k in range(P)]


@pytest.mark.multiprocess
def test_replicas_with_deferred_batch_norm_equal_one_device(cli):
    bn = {"factory": "tests.support.models:bn_net", "args": {"width": 8}}
    data = {"factory": "random_regression", "args": {"n": 40, "in_features": 8, "out_features": 8}, "batch_size": 10}
    spec = job(TWO_STAGES, model=bn, data=data, stages=2, replicas=2, chunks=2, deferred_batch_norm=True, steps=2,
               optimizer={"name": "sgd", "lr": 0.1})
    r = run_job(cli, spec)
    assert r.returncode == 0, r.stderr
    got, want = load_file(cli.tmp / "state" / "t" / "model.safetensors"), reference.train(spec)
    assert int(got["1.num_batches_tracked"]) == spec["steps"]
    # A buffer that a forward updates, other than BatchNorm's, is replica 0's: it counted its own micro-batches.
    assert int(got.pop("3.calls")) == spec["steps"] * spec["chunks"]
    assert int(want.pop("3.calls")) == spec["steps"] * spec["chunks"] * spec["replicas"]
    diff = worst(got, want)
    print(f"deferred BatchNorm: largest difference (weights and running statistics) {diff:.3g}")
    assert diff <= 1e-5

    # Per micro-batch running statistics cannot equal one device across replicas: refused, nothing started.
    r = run_job(cli, {**spec, "deferred_batch_norm": False, "name": "bn2"})
    assert r.returncode == 2, r.stderr
    assert "replicas" in r.stderr and "deferred_batch_norm" in r.stderr
    assert not (cli.tmp / "state" / "bn2").exists()


@pytest.mark.multiprocess
def test_a_checkpoint_of_two_replicas_resumes_with_one(cli):
    """2 steps with 2 replicas x 2 micro-batches, then resumed with 1 replica x 4 micro-batches (the same
    micro-batches, the same dropout): the weights equal 4 uninterrupted steps."""
    spec = job(TWO_STAGES, model=DROPOUT, stages=2, replicas=2, chunks=2, steps=4, checkpoint_every=2,
               optimizer={"name": "adam", "lr": 0.01})
    r = run_job(cli, {**spec, "steps": 2})
    assert r.returncode == 0, r.stderr
    out = cli.tmp / "state" / "t"
    meta = json.loads((out / "checkpoints" / "step-2" / "checkpoint.json").read_text())
    assert meta["replicas"] == 2 and meta["data"]["next_step"] == 2
    r = run_job(cli, {**spec, "replicas": 1, "chunks": 4}, "--resume")
    assert r.returncode == 0, r.stderr
    assert "resuming from checkpoint step-2" in r.stderr
    got = load_file(out / "model.safetensors")
    assert worst(got, reference.train({**spec, "steps": 2})) > 1e-4  # it trained on
    diff = worst(got, reference.train(spec))
    print(f"resume 2 -> 1 replicas: largest weight difference {diff:.3g}")
    assert diff <= 1e-5


@pytest.mark.parametrize("field,value,words", [
    ("replicas", 0, "replicas"),
    ("replicas", 65, "replicas"),
    ("replicas", 2.0, "replicas"),
])
@pytest.mark.multiprocess
def test_bad_replicas_are_refused(cli, field, value, words):
    r = cli.run("validate", str(cli.write(job(TWO_STAGES, **{field: value}))))
    assert r.returncode == 2 and words in r.stderr, r.stderr


@pytest.mark.multiprocess
def test_replicas_times_stages_over_the_bound_names_both(cli):
    r = cli.run("validate", str(cli.write(job(TWO_STAGES, stages=5, replicas=64, data__batch_size=1024))))
    assert r.returncode == 2
    assert "64 replicas x 5 stages" in r.stderr, r.stderr
    r = cli.run("validate", str(cli.write(job(TWO_STAGES, stages=2, replicas=4, chunks=3))))  # 12 micro-batches > batch 8
    assert r.returncode == 2 and "replicas" in r.stderr and "batch_size" in r.stderr, r.stderr



@pytest.mark.multiprocess
def test_serve_waits_for_every_rank_of_every_replica_then_equals_one_device(cli):
    """Under serve a job of 2 replicas x 2 stages takes ranks 0-3: PENDING, naming them, until all four
    workers are there; then it trains as one device does."""
    from tests.support.service import Service
    s = Service(cli)
    try:
        s.start_serve()
        s.start_worker(0)
        s.start_worker(1)
        spec = {**job(TWO_STAGES, model=DROPOUT, stages=2, replicas=2, chunks=2, steps=3), "name": "dp"}
        r = s.client("submit", str(cli.write(spec)))
        assert r.returncode == 0, r.stderr
        time.sleep(1.0)  # two workers are idle and registered: the job must still wait for ranks 2 and 3
        r = s.client("status", "dp")
        assert r.returncode == 0 and "state:    PENDING" in r.stdout, r.stdout
        assert "ranks 0-3 (2 replicas x 2 stages)" in r.stdout, r.stdout
        s.start_worker(2)
        s.start_worker(3)
        s.wait_for(lambda: (s.state / "dp" / "model.safetensors").exists(), "the job to finish", 120)
        wait_for(lambda: "SUCCEEDED" in s.client("status", "dp").stdout, 30, "the job to succeed")
        diff = worst(load_file(s.state / "dp" / "model.safetensors"), reference.train(spec))
        assert diff <= 1e-5, diff
        r = s.client("logs", "dp", "--json")
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        assert [m["step"] for m in lines] == [0, 1, 2]
        assert all([x["replica"] for x in m["replicas"]] == [0, 1] for m in lines)
        assert all([st["replica"] for st in m["stages"]] == [0, 0, 1, 1] for m in lines)
        assert "joined attempt" in s.log("worker3") and "as rank 3 of 4" in s.log("worker3")
    finally:
        s.stop_all()


@pytest.mark.multiprocess
def test_a_worker_of_the_second_replica_killed_mid_run_resumes_to_the_same_weights(cli):
    """SIGKILL stage 1 of replica 1 (rank 3) after step 3: the supervisor names it, restarts every rank from
    the last checkpoint, and the job ends with one device's weights."""
    from tests.support.runs import metrics
    slow = slow_mlp(16, 0.05)
    spec = {**job(TWO_STAGES, model=slow, stages=2, replicas=2, chunks=2, steps=24, checkpoint_every=2), "name": "t"}
    out = cli.tmp / "state" / "t"
    err = kill_mid_run(cli, spec, "replica-1-stage-1.log")
    assert "stage 1 of replica 1's worker (rank 3) process died (signal SIGKILL)" in err, err
    assert "restart 1 of 3" in err
    assert any(m["attempt"] == 2 for m in metrics(out))
    assert worst(load_file(out / "model.safetensors"), reference.train(spec)) <= 1e-5






def _reduce_on(rank: int, port: int, out: str) -> None:
    """One of two ranks: gradients of 3 micro-batches, the last one's summed across ranks by GradReducer in
    buckets of at most 64 bytes; rank 1's last micro-batch leaves one parameter out, and no rank uses another."""
    import torch.distributed as dist

    from gpipe.worker.dataplane.reducer import GradReducer

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    w = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(3))]
    w.append(torch.nn.Parameter(torch.randn(2)))  # no replica's step reaches it
    reducer = GradReducer(w, dist.new_group([0, 1]), 30.0, bucket_bytes=64)
    assert len(reducer.buckets) == 4  # at most 64 bytes each: 4x4 floats alone, the two small ones together
    g = torch.Generator().manual_seed(rank + 1)
    for mb in range(3):
        x = torch.randn(2, 4, generator=g)
        if mb == 2:
            reducer.arm()
        h = ((x @ w[0]) @ w[1]).tanh()
        if not (rank == 1 and mb == 2):
            h = h @ w[2]
        (h.sum() + w[3].sum() * (mb + 1)).backward()
    reducer.finish()
    torch.save([p.grad for p in w], out)
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_the_reducer_sums_every_bucket_in_order_even_when_a_replica_skips_a_parameter(tmp_path):
    """Buckets are launched in one order on every rank, whichever becomes ready first; each rank ends with
    the sum of both ranks' gradients."""
    import multiprocessing

    from tests.support.ports import free_port
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_reduce_on, args=(r, port, str(tmp_path / f"{r}.pt"))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    # The same sums on both ranks, and they are the sums of each rank's own accumulated gradients.
    torch.manual_seed(0)
    w = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(3))]
    w.append(torch.nn.Parameter(torch.randn(2)))  # no replica's step reaches it
    for rank in range(2):
        g = torch.Generator().manual_seed(rank + 1)
        for mb in range(3):
            x = torch.randn(2, 4, generator=g)
            h = ((x @ w[0]) @ w[1]).tanh()
            if not (rank == 1 and mb == 2):
                h = h @ w[2]
            (h.sum() + w[3].sum() * (mb + 1)).backward()
    want = [p.grad for p in w]
    assert got[0][4] is None and got[1][4] is None and want[4] is None  # as on one device: no gradient at all
    for a, b, c in zip(got[0][:4], got[1][:4], want[:4], strict=True):
        assert torch.equal(a, b)
        assert torch.allclose(a, c, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.gpu
def test_replicas_on_gpus_equal_one_device(cli):
    """2 replicas x 1 stage on two GPUs (NCCL): the weights equal the one-device reference on the CPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices: one per worker")
    spec = job(TWO_STAGES, stages=1, replicas=2, chunks=2, device="cuda", clip_grad_norm=0.3)  # no dropout: CUDA draws its own
    r = run_job(cli, spec)
    assert r.returncode == 0, r.stderr
    diff = worst(load_file(cli.tmp / "state" / "t" / "model.safetensors"), reference.train(spec))
    print(f"2 replicas on GPUs: largest weight difference {diff:.3g}")
    assert diff <= 1e-4  # CUDA's float32 kernels against the CPU's


@pytest.mark.multiprocess
def test_fp16_overflow_skips_the_step_on_every_stage_of_every_replica(cli):
    """fp16 with 2 replicas x 2 stages: an inf gradient at step 1 (stage 0 of each replica, where the
    GradOverflow layer lives) skips that step on all four ranks, and the one loss scale backs off."""
    from gpipe.coordinator.outputs import checkpoint

    spec = job(TWO_STAGES, model={"factory": "tests.support.models:overflow_mlp", "args": {"width": 16, "at": [2]}}, balance=[3, 3],
               stages=2, replicas=2, chunks=2, precision="fp16", optimizer={"name": "adam", "lr": 0.01},
               checkpoint_every=1, keep_checkpoints=10)
    r = run_job(cli, spec)
    assert r.returncode == 0, r.stderr
    out = cli.tmp / "state" / "t"
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in lines] == [False, True, False, False]
    assert [m["loss_scale"] for m in lines] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
    assert [(s["replica"], s["stage"], s["skipped"]) for s in lines[1]["stages"]] == [
        (0, 0, True), (0, 1, True), (1, 0, True), (1, 1, True)]
    before, after = (checkpoint.load(out / "checkpoints" / f"step-{s}") for s in (1, 2))
    for a, b in zip(before.stages, after.stages, strict=True):
        assert all(torch.equal(t, b.tensors[n]) for n, t in a.tensors.items()
                   if not n.startswith(("rng/", "model/2.calls")))


@pytest.mark.multiprocess
def test_replica_0_evaluates_and_the_eval_verb_runs_one_pipeline(cli):
    """Evaluation with 2 replicas x 2 stages: replica 0 alone evaluates, between the steps, and the eval loss
    equals one device's on the same weights; the eval verb evaluates the finished weights on one pipeline."""
    from tests.support.runs import assert_one_device, lines
    from tests.support.spec import EVAL
    spec = job(EVAL, replicas=2, chunks=2, deferred_batch_norm=True, steps=3)  # micro-batches of 2: BatchNorm
    cli.write(spec)
    r = cli.run("run", "job.yaml", "--state-dir", "st", "--no-progress", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [m for m in lines(cli.tmp / "st" / "e") if "eval_loss" in m]
    assert [m["step"] for m in evals] == [0, 1, 2]
    assert_one_device(spec, evals)
    r = cli.run("eval", "job.yaml", "--state-dir", "st", "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert abs(json.loads(r.stdout)["loss"] - evals[-1]["eval_loss"]) < 1e-9
    assert sorted(p.name for p in (cli.tmp / "st" / "e" / "logs" / "eval").glob("*stage-*.log")) == [
        "stage-0.log", "stage-1.log"]  # one pipeline


@pytest.mark.multiprocess
def test_per_layer_init_gives_every_replica_the_same_weights(cli):
    """init per_layer: each replica's stages initialise their own layers, the same ones, so training equals
    one device from per_layer weights; a checkpoint is pulled from replica 0's stages in pieces."""
    spec = job(TWO_STAGES, model=DROPOUT, stages=2, replicas=2, chunks=2, init="per_layer", probe=False, steps=3,
               checkpoint_every=2)
    r = run_job(cli, spec)
    assert r.returncode == 0, r.stderr
    diff = worst(load_file(cli.tmp / "state" / "t" / "model.safetensors"), reference.train(spec))
    assert diff <= 1e-5, diff
