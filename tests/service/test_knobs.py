"""The knobs of a run: LR schedules end to end, and the job file's fields overridden on the command line."""

from __future__ import annotations

import json

import pytest
import yaml
from safetensors.torch import load_file

from tests.support import reference
from tests.support.cli import end_leftovers, one_error_line, wait_for
from tests.support.ports import free_port_in
from tests.support.runs import train_and_compare
from tests.support.service import Service
from tests.support.spec import SERVICE, TWO_STAGES, job, slow_mlp

pytestmark = pytest.mark.multiprocess

LR_CASES = {
    "linear": job(TWO_STAGES, steps=6, optimizer={"name": "adam", "lr": 0.01},
                  lr_schedule={"name": "linear", "warmup_steps": 2, "min_lr": 0.001}),
    "wsd": job(TWO_STAGES, steps=8, optimizer={"name": "sgd", "lr": 0.1},
               lr_schedule={"name": "wsd", "warmup_steps": 2, "decay_fraction": 0.5, "decay_shape": "cosine",
                            "min_lr_ratio": 0.1}),
}


@pytest.mark.parametrize("name", list(LR_CASES))
def test_an_lr_schedule_equals_one_device(cli, name):
    spec = LR_CASES[name]
    lines = train_and_compare(cli, name, spec)
    lr = spec["optimizer"]["lr"]
    assert [m["lr"] for m in lines] == pytest.approx([lr * reference.lr_factor(spec, k) for k in range(spec["steps"])])


# --set PATH=VALUE and --name NAME: what each refuses, in the schema's one line (or the --set item's), exit 2.
BAD_SETS = [
    (["--set", "optimizer.lrr=3"], "error: optimizer.lrr: unknown field (did you mean lr?)"),
    (["--set", "chunk=4"], "error: chunk: unknown field (did you mean chunks?)"),
    (["--set", "chunks=0"], "error: chunks: must be an integer between 1 and 4096, got 0"),
    (["--set", "chunks.x=3"], "error: --set chunks.x=3: chunks is a number, not a mapping with field 'x'"),
    (["--set", "balance.2=1"], "error: --set balance.2=1: balance is a list of 2; '2' is not an index in it"),
    (["--set", "chunks"], "error: --set chunks: expected PATH=VALUE"),
    (["--set", "chunks=[1"], "error: --set chunks: not valid YAML"),
    (["--set", "lr_schedule.name=linear", "--set", "lr_schedule.warmup_steps=4"],
     "error: lr_schedule.linear.warmup_steps: 4 leaves no step of the 4 to decay"),
    (["--name", "no spaces"], "error: name: 'no spaces' is not a job name: 1-64 letters"),
]


@pytest.mark.parametrize("flags,line", BAD_SETS, ids=[" ".join(f[1:]) for f, _ in BAD_SETS])
def test_validate_refuses_a_bad_override_in_one_line(cli, flags, line):
    r = cli.run("validate", str(cli.write(job(TWO_STAGES, balance=[3, 3]))), *flags)
    assert r.returncode == 2
    one_error_line(r.stderr, line)


def test_validate_checks_the_overridden_spec(cli):
    path = cli.write(job(TWO_STAGES))
    r = cli.run("validate", str(path), "--set", "stages=3", "--set", "balance=[2, 2, 2]",
                "--set", "data.args={n: 12, in_features: 16, out_features: 16}", "--name", "three")
    assert r.returncode == 0, r.stderr
    assert "balance [2, 2, 2]" in r.stdout and "stage 2:" in r.stdout


@pytest.mark.path
def test_run_with_overrides_trains_and_records_the_overridden_spec(cli):
    path = cli.write(job(TWO_STAGES, steps=2))
    before = path.read_text()
    sets = {"steps": 5, "chunks": 4, "optimizer.lr": 0.05,
            "lr_schedule": {"name": "wsd", "warmup_steps": 1, "decay_fraction": 0.4, "min_lr": 0.01}}
    flags = [x for k, v in sets.items() for x in ("--set", f"{k}={json.dumps(v)}")]
    r = cli.run("run", str(path), *flags, "--name", "again", "--state-dir", str(cli.tmp / "state"), "--no-progress")
    assert r.returncode == 0, r.stderr
    want_spec = job(TWO_STAGES, name="again", steps=5, chunks=4, optimizer__lr=0.05, lr_schedule=sets["lr_schedule"])
    out = cli.tmp / "state" / "again"
    assert path.read_text() == before and not (cli.tmp / "state" / "t").exists()  # the file is the user's
    assert not (cli.tmp / "state" / ".run").exists()
    saved = json.loads((out / "plan.json").read_text())["spec"]  # what the attempts read
    assert (saved["name"], saved["steps"], saved["chunks"], saved["optimizer"]["lr"]) == ("again", 5, 4, 0.05)
    assert {k: saved["lr_schedule"][k] for k in sets["lr_schedule"]} == sets["lr_schedule"]
    got, want = load_file(out / "model.safetensors"), reference.train(want_spec)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5


def service(cli) -> Service:
    s = Service(cli)
    s.port = free_port_in(range(32000, 33000))
    s.address = f"127.0.0.1:{s.port}"
    return s


def test_submit_sends_the_overridden_spec_and_name(cli):
    s = service(cli)
    try:
        s.start_serve()
        s.start_worker(0)
        one = {"stages": 1, "balance": [4]}  # one worker to start
        path = cli.write(job(SERVICE, one, name="svc", steps=2))
        r = s.client("submit", str(path), "--set", "optimizer.lrr=1")
        assert r.returncode == 2
        one_error_line(r.stderr, "error: optimizer.lrr: unknown field (did you mean lr?)")
        r = s.client("submit", str(path))  # the file as it is, then again as another job
        assert r.returncode == 0, r.stderr
        r = s.client("submit", str(path))
        assert r.returncode == 2 and "exists" in r.stderr, r.stderr
        r = s.client("submit", str(path), "--name", "svc2", "--set", "steps=3", "--set", "optimizer.lr=0.01",
                     "--follow", "--no-progress")
        assert r.returncode == 0, r.stderr + s.log("serve")
        assert "svc2: SUCCEEDED: 3/3 steps" in r.stderr
        want_spec = job(SERVICE, one, name="svc2", steps=3, optimizer__lr=0.01)
        assert yaml.safe_load((s.state / "svc2" / "job.yaml").read_text()) == want_spec
        got, want = load_file(s.state / "svc2" / "model.safetensors"), reference.train(want_spec)
        assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
        r = s.client("status", "svc")
        assert r.returncode == 0 and "SUCCEEDED" in r.stdout and "2/2 steps" in r.stdout, r.stdout
    finally:
        s.stop_all()
        assert not end_leftovers(cli)


def test_delete_removes_an_ended_run_s_outputs_and_refuses_a_running_one(cli):
    state = cli.tmp / "state"
    path = cli.write(job(TWO_STAGES, steps=1))
    assert cli.run("run", str(path), "--state-dir", str(state), "--no-progress").returncode == 0
    r = cli.run("delete", "t", "--state-dir", str(state))
    assert r.returncode == 2 and (state / "t" / "model.safetensors").exists()
    one_error_line(r.stderr, "error: delete: removes job 't'")
    slow = cli.write(job(TWO_STAGES, name="slow", steps=1000, model=slow_mlp(16, 0.05), balance=[2, 2]), "slow.yaml")
    with cli.running("run", str(slow), "--state-dir", str(state), "--no-progress") as p:
        wait_for(lambda: (state / "slow" / "metrics.jsonl").exists() and
                 (state / "slow" / "metrics.jsonl").read_text(), 60, "the slow job's first step")
        r = cli.run("delete", "slow", "--yes", "--state-dir", str(state))
        assert r.returncode == 2
        one_error_line(r.stderr, "error: job 'slow' is running (a run holds it): stop it first")
        r = cli.run("run", str(slow), "--state-dir", str(state))
        assert r.returncode == 2
        one_error_line(r.stderr, f"error: job 'slow' is running already in {state}")
        assert p.poll() is None
    r = cli.run("delete", "t", "--yes", "--state-dir", str(state))
    assert r.returncode == 0, r.stderr
    assert not (state / "t").exists() and (state / "slow").exists()
    r = cli.run("delete", "t", "--yes", "--state-dir", str(state))
    assert r.returncode == 2
    one_error_line(r.stderr, f"error: no job named 't' in {state}")


def test_delete_under_serve_refuses_a_job_not_ended_then_frees_its_name(cli):
    s = service(cli)
    try:
        s.start_serve()
        s.start_worker(0)
        spec = job(SERVICE, name="slow", stages=1, balance=[4], steps=1000, model=slow_mlp(16, 0.05))
        path = cli.write(spec)
        assert s.client("submit", str(path)).returncode == 0
        r = s.client("delete", "slow", "--yes")
        assert r.returncode == 2 and "stop it first" in r.stderr, r.stderr
        assert s.client("stop", "slow").returncode == 0
        assert (s.state / "slow" / "job.json").exists()
        r = s.client("delete", "slow")
        assert r.returncode == 2 and "add --yes" in r.stderr
        r = s.client("delete", "slow", "--yes")
        assert r.returncode == 0, r.stderr
        assert "slow: deleted (STOPPED;" in r.stderr and not (s.state / "slow").exists()
        assert s.client("status", "slow").returncode == 2
        assert s.client("delete", "slow", "--yes").returncode == 2
        r = s.client("submit", str(path), "--set", "steps=1", "--set", "model={factory: mlp, args: {width: 16, depth: 3}}",
                     "--follow", "--no-progress")
        assert r.returncode == 0, r.stderr  # the name is free again
    finally:
        s.stop_all()
        assert not end_leftovers(cli)
