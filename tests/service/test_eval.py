"""Evaluation: the eval loss equals one device's, changes nothing of training, keeps the best, and the eval verb.

The runs are real (`gpipe-coordinator run` with worker processes); the model
has dropout, BatchNorm and a module that counts its training-mode calls, so
eval mode, the running statistics and any state an evaluation could touch all show.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gpipe.coordinator.attempt.eval_weights import Best
from gpipe.coordinator.attempt.metrics import EvalMetrics
from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.spec.job import parse_spec
from gpipe.errors import SpecError
from gpipe.eval_schedule import EvalSchedule
from gpipe.service import job_records, serde
from gpipe.worker.stage_server import EvalArgs, StepQueue
from tests.support import reference
from tests.support.cli import Cli, end_leftovers, torch_threads
from tests.support.local import attempt_secret, built, plan_of  # noqa: F401  # attempt_secret: a fixture
from tests.support.runs import assert_one_device, lines
from tests.support.service import Service
from tests.support.spec import EVAL, ONE_STAGE, SERVICE, job

# BatchNorm1d/2d, dropout, a call counter; the training data, the held-out data and the steps of EVAL
BN, TRAIN, HELD_OUT, STEPS = EVAL["model"], EVAL["data"], EVAL["eval"]["data"], EVAL["steps"]


@pytest.fixture(autouse=True)
def one_thread():
    """The one-device references here sum with one thread, as the stages do (`pinned`): with 2 threads
    the diverging LR made 1.9e-5 of the last bit's difference in the weights."""
    with torch_threads(1):
        yield


def pinned(c: Cli) -> Cli:
    """`c` with its stages on one intra-op thread each, whatever this machine's cores (OMP_NUM_THREADS)."""
    c.env["OMP_NUM_THREADS"] = "1"
    return c


def max_diff(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)






def run_evals(cli: Cli, spec: dict) -> list[dict]:
    """Run `spec` to its end; its eval lines."""
    pinned(cli).write(spec)
    r = cli.run("run", "job.yaml", "--state-dir", "st", "--no-progress", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [m for m in lines(cli.tmp / "st" / "e") if "eval_loss" in m]




@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same job trained with evaluation (and keep_best) and without: {"eval": Cli, "plain": Cli}."""
    out = {}
    for name, spec in (("eval", job(EVAL)), ("plain", job(EVAL, eval=None, keep_best=False))):
        c = pinned(Cli(tmp_path_factory.mktemp(name)))
        spec = {k: v for k, v in spec.items() if v is not None and not (k == "keep_best" and not v)}
        c.write(spec)
        r = c.run("run", "job.yaml", "--state-dir", "st", "--no-progress", timeout=300)
        left = end_leftovers(c)
        assert r.returncode == 0, r.stderr[-3000:]
        assert not left, f"processes left behind: {left}"
        (c.tmp / "stderr.txt").write_text(r.stderr)  # what the user saw
        out[name] = c
    return out


@pytest.mark.multiprocess
def test_no_progress_prints_every_evaluation_and_no_step_line(runs):
    seen = (runs["eval"].tmp / "stderr.txt").read_text().splitlines()
    evals = [m for m in lines(runs["eval"].tmp / "st" / "e") if "eval_loss" in m]
    shown = [x for x in seen if x.startswith("eval after step ")]
    assert [int(x.split()[3].split("/")[0]) for x in shown] == [m["step"] + 1 for m in evals], seen
    assert all(f"loss {m['eval_loss']:.4f} over 30 samples" in x for x, m in zip(shown, evals, strict=True))
    assert not any(x.startswith("step ") for x in seen)  # no progress lines


@pytest.mark.multiprocess
def test_eval_loss_after_every_step_equals_one_device_evaluation(runs):
    evals = [m for m in lines(runs["eval"].tmp / "st" / "e") if "eval_loss" in m]
    assert [m["step"] for m in evals] == list(range(STEPS)) and evals[0]["eval_samples"] == 30
    assert_one_device(job(EVAL), evals)


@pytest.mark.multiprocess
def test_evaluation_changes_nothing_of_training(runs):
    with_eval = load_file(runs["eval"].tmp / "st" / "e" / "model.safetensors")
    without = load_file(runs["plain"].tmp / "st" / "e" / "model.safetensors")
    assert set(with_eval) == set(without)
    for k in without:  # bit for bit: weights, running statistics, the call counter
        assert torch.equal(with_eval[k], without[k]), k
    assert max_diff(with_eval, reference.train(job(EVAL))) < 1e-5
    # The checkpoints too: every stage's weights, optimizer state and generator states, bit for bit.
    for step in (2, 4, 5):
        for k in range(2):
            name = f"checkpoints/step-{step}/stage-{k}.safetensors"
            a = load_file(runs["eval"].tmp / "st" / "e" / name)
            b = load_file(runs["plain"].tmp / "st" / "e" / name)
            assert set(a) == set(b) and any(key.startswith("rng/") for key in a)
            for key in b:
                assert torch.equal(a[key], b[key]), (name, key)
    steps = [m for m in lines(runs["plain"].tmp / "st" / "e")]
    assert all("eval_loss" not in m for m in steps)
    trained = [m["loss"] for m in lines(runs["eval"].tmp / "st" / "e") if "loss" in m]
    assert trained == [m["loss"] for m in steps]


@pytest.mark.multiprocess
def test_keep_best_keeps_the_lowest_eval_loss_with_its_step(runs):
    out = runs["eval"].tmp / "st" / "e"
    evals = [m for m in lines(out) if "eval_loss" in m]
    lowest = min(evals, key=lambda m: m["eval_loss"])
    assert lowest["step"] == 2 != STEPS - 1  # the LR diverges after step 2
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["step"] == 2 and best["eval_loss"] == lowest["eval_loss"]
    with safe_open(str(out / "best" / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["step"] == "2"
    assert max_diff(load_file(out / "best" / "model.safetensors"), reference.train(job(EVAL, steps=3))) < 1e-5


@pytest.mark.multiprocess
def test_a_resumed_job_does_not_regress_its_best(runs, tmp_path):
    """Resumed with more steps: the next evaluations are worse than step 2's, so the best stays."""
    c = pinned(Cli(tmp_path))
    shutil.copytree(runs["eval"].tmp / "st", tmp_path / "st")
    c.write(job(EVAL, steps=STEPS + 1))
    try:
        r = c.run("run", "job.yaml", "--state-dir", "st", "--no-progress", "--resume", timeout=300)
    finally:
        left = end_leftovers(c)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not left
    out = tmp_path / "st" / "e"
    assert [m["step"] for m in lines(out) if "eval_loss" in m][-1] == STEPS
    assert json.loads((out / "best" / "best.json").read_text())["step"] == 2


@pytest.mark.multiprocess
def test_the_eval_verb_evaluates_the_finished_weights_and_the_best(runs):
    c = runs["eval"]
    out = c.tmp / "st" / "e"
    last = [m for m in lines(out) if "eval_loss" in m][-1]
    r = c.run("eval", "job.yaml", "--state-dir", "st", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{last['eval_loss']:.6g}" in r.stdout and f"after step {STEPS}" in r.stdout
    r = c.run("eval", "job.yaml", "--state-dir", "st", "--json", "--weights", str(out / "best" / "model.safetensors"),
              timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    best = json.loads((out / "best" / "best.json").read_text())
    assert got["step"] == 2 and got["samples"] == 30
    assert abs(got["loss"] - best["eval_loss"]) < 1e-12
    assert Path(got["weights"]) == (out / "best" / "model.safetensors").resolve()
    assert not end_leftovers(c)


@pytest.mark.multiprocess
def test_eval_loss_with_deferred_batch_norm_equals_one_device(cli):
    spec = job(EVAL, deferred_batch_norm=True, steps=2, keep_best=False, schedule="gpipe", activation_checkpoint="never",
               eval={"data": {**HELD_OUT, "batch_size": 7}, "every": 2, "batches": 3})
    evals = run_evals(cli, spec)
    assert [(m["step"], m["eval_samples"]) for m in evals] == [(1, 21)]  # 3 batches of 7
    assert_one_device(spec, evals)


def test_bf16_evaluation_runs_under_the_training_autocast():
    """precision: bf16 evaluates under autocast too: the pipelined eval loss of trained weights equals one-device
    autocast evaluation of them (rounded at the same cut) to within 1e-3, and differs from float32's. (The
    service's evaluation runs the same Stage.evaluate over c10d: the `runs` above and the tests below.)"""
    spec = job(EVAL, model={"factory": "mlp", "args": {"width": 16, "depth": 3, "in_features": 8, "out_features": 8}},
               precision="bf16", steps=2, keep_best=False)
    weights, cuts = reference.train(spec), [2, 2]
    got, samples = reference.evaluate(spec, weights, cuts, pipelined=True)
    want, _ = reference.evaluate(spec, weights, cuts)
    fp32, _ = reference.evaluate({**spec, "precision": "fp32"}, weights)
    assert samples == 30 and abs(got - want) < 1e-3, (got, want, fp32)
    assert abs(got - fp32) > abs(got - want)


@pytest.mark.multiprocess
@pytest.mark.gpu(2)  # a GPU per worker: NCCL takes one rank per GPU
def test_eval_on_cuda_equals_one_device_and_changes_nothing_of_training(cli):
    spec = job(EVAL, device="cuda", steps=2, keep_best=False)
    evals = run_evals(cli, spec)
    assert [m["step"] for m in evals] == [0, 1]
    assert_one_device(spec, evals, 1e-4)
    cli.write({k: v for k, v in spec.items() if k != "eval"}, "plain.yaml")
    r = cli.run("run", "plain.yaml", "--state-dir", "plain", "--no-progress", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with_eval = load_file(cli.tmp / "st" / "e" / "model.safetensors")
    without = load_file(cli.tmp / "plain" / "e" / "model.safetensors")
    assert max_diff(with_eval, without) < 1e-6  # CUDA kernels may differ in the last bit between runs


def test_eval_loss_of_a_model_with_skip_connections_across_stages_equals_one_device():
    """Eval micro-batches travel on the activation and skip channels (int64 tensors among them), past a stage."""
    data = {"factory": "random_regression", "args": {"n": 40, "in_features": 16, "out_features": 16}}
    spec = job(EVAL, model={"factory": "tests.support.models:skip_mlp", "args": {"width": 16, "skip_width": 24}}, stages=3,
               balance=[1, 2, 3], steps=2, keep_best=False, data={**data, "batch_size": 10},
               eval={"data": {**data, "args": {**data["args"], "n": 25, "seed": 2}, "batch_size": 10}, "every": 1})
    weights = reference.train(spec)
    got, samples = reference.evaluate(spec, weights, [1, 2, 3], pipelined=True)
    want, _ = reference.evaluate(spec, weights)
    assert samples == 25 and abs(got - want) < 1e-5, (got, want)


@pytest.mark.multiprocess
def test_serve_shows_and_streams_the_eval_loss_and_keeps_it_across_a_restart(cli):
    """submit --follow shows each evaluation; status shows the latest; logs streams the eval lines, also
    once serve restarted and reads them back from metrics.jsonl."""
    s = Service(cli)
    try:
        s.start_serve()
        s.start_worker(0)
        s.start_worker(1)
        spec = job(SERVICE, name="ev", eval={"data": {**HELD_OUT, "args": {**HELD_OUT["args"], "in_features": 16,
                                                                      "out_features": 16}}, "every": 2})
        r = s.client("submit", str(cli.write(spec)), "--follow")
        assert r.returncode == 0, r.stderr + s.log("serve")
        assert r.stderr.count("eval after step") == 3  # after steps 2 and 4, and the last (5)
        evals = [m for m in lines(s.state / "ev") if "eval_loss" in m]
        assert [m["step"] for m in evals] == [1, 3, 4]
        for restarted in (False, True):
            if restarted:
                s.kill("serve")
                s.start_serve()
            r = s.client("status", "ev")
            assert r.returncode == 0 and f"eval:     loss {evals[-1]['eval_loss']:.4f} after step 5" in r.stdout
            r = s.client("logs", "ev", "--json")
            assert r.returncode == 0
            streamed = [json.loads(x) for x in r.stdout.splitlines()]
            assert [(m["step"], m["eval_loss"]) for m in streamed if "eval_loss" in m] == \
                [(m["step"], m["eval_loss"]) for m in evals]
            assert [m["step"] for m in streamed if "loss" in m] == list(range(5))
    finally:
        s.stop_all()


# -- bad input: one line naming the field, exit 2, nothing started --------------------------------------




BAD_EVAL = [
    ({"eval": {"data": {"factory": "tests.support.models:inputs_only", "batch_size": 4}, "every": 1}}, "eval.data"),
    ({"eval": {"data": HELD_OUT, "every": 1, "batches": 5}}, "eval.batches"),
    ({"eval": {"data": {**HELD_OUT, "args": {**HELD_OUT["args"], "in_features": 5}}, "every": 1}}, "eval.data"),
    ({"eval": {"data": {**HELD_OUT, "batch_size": 0}, "every": 1}}, "eval.data.batch_size"),
    ({"eval": {"data": HELD_OUT, "every": 0}}, "eval.every"),
    ({"eval": None, "keep_best": True}, "keep_best"),
]


@pytest.mark.parametrize(("change", "field"), BAD_EVAL)
def test_a_bad_eval_section_is_refused_naming_the_field(tmp_path, change, field):
    """What validate and run check before anything starts: the spec, then the plan (its model and data)."""
    spec = {k: v for k, v in job(EVAL, **change).items() if v is not None}
    with pytest.raises(SpecError) as e:
        make_plan(parse_spec(yaml.safe_dump(spec)), tmp_path)
    assert str(e.value).startswith(field), e.value


@pytest.mark.multiprocess
def test_a_bad_eval_section_is_one_line_and_exit_2_from_validate_and_run_and_nothing_starts(cli):
    change, field = BAD_EVAL[0]  # the data set's items have no targets: found by the plan, not the spec
    cli.write({k: v for k, v in job(EVAL, **change).items() if v is not None})
    for args in (("validate", "job.yaml"), ("run", "job.yaml", "--state-dir", "st")):
        r = cli.run(*args)
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and field in r.stderr, r.stderr
    assert not (cli.tmp / "st").exists()


@pytest.mark.multiprocess
def test_the_eval_verb_refuses_bad_input_with_exit_2(cli):
    cli.write({k: v for k, v in job(EVAL, eval=None, keep_best=False).items() if v is not None}, "plain.yaml")
    cli.write(job(EVAL))
    other = cli.tmp / "other.safetensors"  # another model's weights: width 4
    save_file({k: v.contiguous() for k, v in reference.train(job(EVAL, model={**BN, "args": {"width": 4}},
                                                                 data={**TRAIN, "args": {**TRAIN["args"],
                                                                       "in_features": 4, "out_features": 4}},
                                                                 steps=1)).items()}, str(other))
    (cli.tmp / "junk.safetensors").write_bytes(b"\x80\x04not a safetensors file")
    cases = [
        (("plain.yaml",), "eval"),
        (("job.yaml",), "--weights"),  # no finished job: no model.safetensors
        (("job.yaml", "--weights", "missing.safetensors"), "--weights"),
        (("job.yaml", "--weights", "junk.safetensors"), "--weights"),
        (("job.yaml", "--weights", str(other)), "does not fit the model"),
    ]
    for args, field in cases:
        r = cli.run("eval", *args, "--state-dir", "st", "--json")
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and field in r.stderr, (args, r.stderr)
        assert r.stdout == ""
    assert not (cli.tmp / "st").exists()  # nothing written, not even a log


# -- in process: the order of work on a stage, the best so far, the wire ------------------------------------


def test_eval_batches_run_between_their_steps_whatever_order_they_arrive_in():
    evals = EvalSchedule(every=2, batches=2, steps=5)
    assert [p for p in range(7) if evals.at(p)] == [2, 4, 5]
    assert EvalSchedule(None, 3, 0).at(0) == 3  # the eval verb: once, before any step
    q = StepQueue(first=1, evals=evals.at)
    futs = {}
    for key in [(3, None), (2, 1), (2, None), (1, None), (2, 0)]:  # (position, eval batch or None: the step)
        futs[key] = torch.futures.Future()
        if key[1] is None:
            q.put(key[0], futs[key], (key[0], 0.1, None, None, [1], False))
        else:
            q.put_eval(key[0], key[1], futs[key], EvalArgs(key[1], None, None, [1], False))
    order = []
    for _ in range(5):
        fut, args = q.take()
        order.append(next(k for k, f in futs.items() if f is fut))
    assert order == [(1, None), (2, 0), (2, 1), (2, None), (3, None)]
    with pytest.raises(ValueError, match="no eval batch"):
        q.put_eval(3, 0, torch.futures.Future(), EvalArgs(0, None, None, [1], False))


def test_a_stage_evaluates_in_eval_mode_and_leaves_weights_buffers_and_generators_be():
    """One stage in this process (tests/engine/test_stage.py): its evaluation equals one device's, and afterwards
    the global generator, every parameter and buffer, and training mode are as before."""
    spec = job(ONE_STAGE, model=BN, stages=1, data=TRAIN, eval={"data": HELD_OUT, "every": 1})
    plan = plan_of(spec)
    stream = plan.eval_stream()
    with built(plan, plan.stage_state(0)) as stage:
        torch.manual_seed(7)
        generator = torch.get_rng_state()
        before = {k: v.clone() for k, v in stage.layers.state_dict().items()}
        total, samples = 0.0, 0
        for b in range(stream.batches):
            xs, ys, sizes = stream.micro_batches(b)
            out = stage.evaluate(b, xs, ys, sizes)
            total, samples = total + out.loss_sum, samples + out.samples
        assert torch.equal(torch.get_rng_state(), generator)
        assert stage.layers.training
        assert max_diff(stage.layers.state_dict(), before) == 0.0
    want, n = reference.evaluate(spec, plan.stage_state(0))
    assert samples == n == 30 and abs(total / samples - want) < 1e-5


def test_best_is_replaced_only_by_a_lower_loss_and_read_back_on_resume(tmp_path):
    said: list[str] = []
    w = {"0.weight": torch.ones(2, 2)}
    best = Best(tmp_path / "best", said.append)
    assert best.offer(EvalMetrics(3, 0.5, 10, 0.1), w)
    assert not best.offer(EvalMetrics(4, 0.5, 10, 0.1), {"0.weight": torch.zeros(2, 2)})  # equal: kept
    assert not best.offer(EvalMetrics(5, float("nan"), 10, 0.1), w)
    again = Best(tmp_path / "best", said.append)  # a resumed attempt
    assert (again.step, again.loss) == (3, 0.5)
    assert not again.offer(EvalMetrics(6, 0.7, 10, 0.1), w)
    assert again.offer(EvalMetrics(7, 0.25, 10, 0.1), {"0.weight": torch.zeros(2, 2)})
    assert torch.equal(load_file(tmp_path / "best" / "model.safetensors")["0.weight"], torch.zeros(2, 2))
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 7
    (tmp_path / "best" / "model.safetensors").write_bytes(b"torn")
    assert Best(tmp_path / "best", said.append).loss == float("inf") and "unreadable" in said[-1]


def test_eval_lines_cross_the_wire_and_the_job_record():
    line = {"step": 4, "eval_loss": 0.25, "eval_samples": 30, "eval_time_s": 0.5, "attempt": 2}
    kind, value = job_records.metrics_event(line)
    assert kind == "eval"
    assert serde.event_from_pb(serde.event_to_pb((kind, value))) == ("eval", line)
    unknown = {**line, "step": None}
    assert serde.event_from_pb(serde.event_to_pb(("eval", unknown))) == ("eval", unknown)
    assert job_records.metrics_event({"step": 1, "loss": 0.1})[0] == "metrics"
    job = job_records.JobRecord(name="e", spec_yaml="", steps=5, eval_loss=0.25, eval_step=4)
    assert serde.job_from_pb(serde.job_to_pb(job)) == job
    assert job_records.JobRecord.from_json(json.loads(json.dumps(job.to_json()))) == job


@pytest.mark.multiprocess
def test_the_progress_line_shows_the_latest_eval_loss():
    code = (
        "from gpipe.coordinator.cli.progress import Follower, Progress\n"
        "f = Follower('e', Progress(5))\n"
        "f.show('eval', {'step': 1, 'eval_loss': 0.123456, 'eval_samples': 30})\n"
        "f.show('metrics', {'step': 4, 'loss': 0.5, 'samples_per_s': 10.0})\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "eval after step 2/5: loss 0.1235" in r.stderr
    assert "step 5/5" in r.stderr and "eval loss 0.1235" in r.stderr.splitlines()[-1]
