"""Checkpoints and resume with `gpipe-coordinator run`: real SIGKILLs, real files, the one-device weights.

Each case ends with the weights of a run that was never interrupted (and the
one-device reference), so losing a worker, the coordinator, or a checkpoint
costs time and never changes the model.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from gpipe.coordinator.outputs import checkpoint
from tests.support import reference
from tests.support.cli import process_kind, tagged_pids, wait_for
from tests.support.runs import Lines, metrics
from tests.support.service import worker_pid
from tests.support.spec import job, regression, slow_mlp

SLOW = slow_mlp(16, 0.02)


# Slow steps (to be killed mid-run), adam and shuffled data: a resume must bring back both.
RESUMED = {
    "name": "r", "seed": 3, "model": SLOW, "balance": [2, 2], "data": regression(48, 16, 8, shuffle=True),
    "optimizer": {"name": "adam", "lr": 0.01}, "steps": 30, "checkpoint_every": 4,
}


def max_diff(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)






@pytest.mark.multiprocess
@pytest.mark.path  # a fault and its restart, end to end (make test)
def test_a_worker_killed_at_a_random_step_resumes_to_the_uninterrupted_weights(cli):
    # Either stage's worker: a dead worker process is noticed and resumed from the same way for each.
    seed = random.randrange(1 << 30)
    victim, at = random.Random(seed).randrange(2), random.Random(seed).randrange(5, 18)
    print(f"random seed {seed}: SIGKILL stage {victim}'s worker after step {at}")
    # Steps of about 0.2 s: the kill lands seconds before the last of the 30 steps, on a loaded machine too
    s = job(RESUMED, model={**SLOW, "args": {**SLOW["args"], "seconds": 0.05}})
    path = cli.write(s)
    out = cli.tmp / "state" / "r"
    with cli.running("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress") as p:
        lines = Lines(p)
        wait_for(lambda: len(metrics(out)) > at, 90, f"step {at}")
        pid = worker_pid(cli.tag, victim)
        assert pid, "no worker process found"
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        wait_for(lambda: any(m["attempt"] == 2 for m in metrics(out)), 90, "the second attempt's first step")
        resumed = time.monotonic() - t_kill
        p.wait(timeout=120)
        err = lines.text()
    assert p.returncode == 0, err
    detected = lines.when(f"stage {victim}'s worker process died (signal SIGKILL)")
    assert detected is not None, err
    print(f"detected {detected - t_kill:.2f}s after the SIGKILL; resumed training {resumed:.2f}s after it")
    assert "r: RESTARTING:" in err and "restart 1 of 3" in err
    # It resumed from the newest checkpoint taken before the kill, and re-ran only the steps since.
    m = metrics(out)
    first = [x["step"] for x in m if x["attempt"] == 1]
    second = [x["step"] for x in m if x["attempt"] == 2]
    assert second == list(range(second[0], 30)) and second[0] % 4 == 0 and second[0] <= first[-1] + 1
    assert f"resuming from checkpoint step-{second[0]}" in err or second[0] == 0
    assert max_diff(load_file(out / "model.safetensors"), reference.train(s)) <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.parametrize("victim", ["stage 1's worker", "the coordinator's attempt process"])
def test_a_kill_during_a_save_resumes_to_the_uninterrupted_weights(cli, victim):
    # Wide layers, so a checkpoint takes long enough on disk to be caught in the middle of its save.
    s = job(RESUMED, model={"factory": "mlp", "args": {"width": 768, "depth": 3, "in_features": 16, "out_features": 16}},
             balance=[2, 2], optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.9}, steps=12, checkpoint_every=2)
    path = cli.write(s)
    out = cli.tmp / "state" / "r"
    ckpts = out / "checkpoints"

    def saving() -> Path | None:
        if ckpts.is_dir():
            for d in ckpts.iterdir():
                if d.name.startswith("step-") and int(d.name[5:]) >= 4 and not (d / checkpoint.MANIFEST).exists():
                    return d
        return None

    with cli.running("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress") as p:
        lines = Lines(p)
        wait_for(lambda: saving() is not None, 120, "a checkpoint being saved", every=0.002)
        torn = saving()
        if victim.startswith("stage"):
            pid = worker_pid(cli.tag, 1)
        else:
            pid = next(q for q in tagged_pids(cli.tag) if process_kind(q) == "coordinator")
        os.kill(pid, signal.SIGKILL)
        p.wait(timeout=180)
        err = lines.text()
    assert p.returncode == 0, err
    print(f"killed {victim} while {torn.name} was being saved")
    assert "restart 1 of 3" in err
    resumed = int(re.search(r"r: resuming from checkpoint step-(\d+) ", err).group(1))
    if victim.startswith("stage"):
        # The stages' states stream to the writer: the save finished if the killed stage's pieces were all
        # taken, else it was passed over for the one before (checkpoints come every 2 steps).
        assert resumed >= int(torn.name[5:]) - 2, err
    else:
        # The save was cut short: the next attempt passed it over (unless the kill came just after it finished).
        assert (f"r: checkpoint {torn.name} is not used: no MANIFEST.json (the save did not finish)" in err
                or f"r: resuming from checkpoint {torn.name} " in err), err
    assert max_diff(load_file(out / "model.safetensors"), reference.train(s)) <= 1e-6
    for d in ckpts.iterdir():
        checkpoint.verify(d)  # every checkpoint left is whole


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run to the end with checkpoints at steps 6, 9 (and 3, pruned) and 10, and its weights."""
    from tests.support.cli import Cli

    c = Cli(tmp_path_factory.mktemp("finished"))
    s = job(RESUMED, model={"factory": "mlp", "args": {"width": 16, "depth": 3}}, steps=10, checkpoint_every=3,
             keep_checkpoints=3)
    path = c.write(s)
    r = c.run("run", str(path), "--state-dir", str(c.tmp / "state"), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert not c.leftovers()
    return c.tmp, s


def damage_truncate(d: Path) -> None:
    f = d / "stage-1.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def damage_flip(d: Path) -> None:
    f = d / "stage-0.safetensors"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x10
    f.write_bytes(b)


def damage_manifest(d: Path) -> None:
    (d / checkpoint.MANIFEST).unlink()


DAMAGES = [
    (damage_truncate, "stage-1.safetensors has 12844 bytes, the manifest says 12944 (truncated?)"),
    (damage_flip, "stage-0.safetensors: sha256 does not match the manifest (the file is damaged)"),
    (damage_manifest, "no MANIFEST.json (the save did not finish)"),
]


@pytest.mark.multiprocess  # the finished run
@pytest.mark.parametrize("damage,why", DAMAGES, ids=["truncated-shard", "flipped-byte", "no-manifest"])
def test_each_damage_passes_a_checkpoint_over_for_the_previous_one(finished, tmp_path, damage, why):
    """What an attempt's resume reads (checkpoint.latest) of each damage; a real run below resumes past one."""
    src, _ = finished
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(src / "state" / "r" / "checkpoints", ckpts)
    damage(ckpts / "step-10")
    said: list[str] = []
    loaded = checkpoint.latest(ckpts, said.append)
    assert said == [f"checkpoint step-10 is not used: {why}"]
    assert loaded is not None and loaded.step == 9


@pytest.mark.multiprocess
def test_a_damaged_checkpoint_is_passed_over_for_the_previous_one(cli, finished):
    damage, why = DAMAGES[1]  # a flipped byte: the damage only the hash shows
    src, s = finished
    shutil.copytree(src / "state", cli.tmp / "state")
    out = cli.tmp / "state" / "r"
    ckpts = out / "checkpoints"
    assert sorted(d.name for d in ckpts.iterdir()) == ["step-10", "step-6", "step-9"]
    want = load_file(out / "model.safetensors")
    damage(ckpts / "step-10")
    (out / "model.safetensors").unlink()
    r = cli.run("run", str(cli.write(s)), "--state-dir", str(cli.tmp / "state"), "--no-progress", "--resume")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert f"r: checkpoint step-10 is not used: {why}" in lines, r.stderr
    assert any(x.startswith("r: resuming from checkpoint step-9 ") for x in lines), r.stderr
    assert [m["step"] for m in metrics(out) if m["attempt"] == 2] == [9]
    got = load_file(out / "model.safetensors")
    assert all((got[k] == want[k]).all() for k in want) and set(got) == set(want)  # bit for bit
    assert max_diff(got, reference.train(s)) <= 1e-6
    checkpoint.verify(ckpts / "step-10")  # written again, whole


@pytest.mark.multiprocess
def test_resume_with_every_checkpoint_damaged_is_refused_naming_each_and_nothing_changes(cli, finished):
    src, s = finished
    shutil.copytree(src / "state", cli.tmp / "state")
    out = cli.tmp / "state" / "r"
    for d in (out / "checkpoints").iterdir():
        damage_flip(d)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and "logs" not in p.parts}
    r = cli.run("run", str(cli.write(s)), "--state-dir", str(cli.tmp / "state"), "--no-progress", "--resume")
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for step in (6, 9, 10):
        assert re.search(rf"step-{step} \(stage-0.safetensors: sha256 does not match", r.stderr), r.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and "logs" not in p.parts} == before


@pytest.mark.multiprocess
def test_resume_with_no_checkpoint_starts_at_step_1(cli):
    s = job(RESUMED, model={"factory": "mlp", "args": {"width": 16, "depth": 3}}, steps=3, checkpoint_every=10)
    r = cli.run("run", str(cli.write(s)), "--state-dir", str(cli.tmp / "state"), "--no-progress", "--resume")
    assert r.returncode == 0, r.stderr
    assert "r: no checkpoint to resume from: starting at step 1" in r.stderr
    assert max_diff(load_file(cli.tmp / "state" / "r" / "model.safetensors"), reference.train(s)) <= 1e-6


@pytest.mark.multiprocess
def test_restarts_are_bounded_and_the_first_failure_is_named(cli):
    # Each attempt fails 7 forwards (3 steps of 2 micro-batches, and one) after its start: step 4, then 7.
    s = job(RESUMED, model={"factory": "tests.support.models:failing_mlp", "args": {"width": 16, "calls": 7}}, balance=[2, 2],
             max_restarts=1, steps=10, checkpoint_every=1)
    r = cli.run("run", str(cli.write(s)), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=150)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("RESTARTING") == 1
    last = r.stderr.strip().splitlines()[-1]
    # The first failure is named, and the last one too.
    assert last.startswith("error: stage 1 (layers 2-3) failed at step 4: ValueError: boom after 7 forwards"), last
    assert "gave up after 1 restarts" in last and "the last failure: stage 1 (layers 2-3) failed at step 7" in last
    assert "Traceback" not in r.stderr


@pytest.mark.multiprocess
def test_the_same_error_at_the_same_step_twice_is_not_restarted_again(cli):
    s = job(RESUMED, model={"factory": "tests.support.models:failing_mlp", "args": {"width": 16, "calls": 7}}, balance=[2, 2],
             max_restarts=3, steps=10)
    r = cli.run("run", str(cli.write(s)), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=150)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("RESTARTING") == 1  # once, to tell a deterministic error from a passing one
    last = r.stderr.strip().splitlines()[-1]
    assert "failed at step 4" in last and "same error at the same step twice" in last, last


@pytest.mark.multiprocess
def test_job_code_the_workers_cannot_import_is_not_restarted(cli):
    # The plan imports the model on the coordinator's side; the stages import it again where they run.
    (cli.tmp / "vanishing.py").write_text(
        "import sys\nfrom tests.support.models import mlp_dropout\n"
        "if getattr(sys.modules['__main__'].__spec__, 'name', '').startswith('gpipe.worker'):\n"
        "    raise ImportError('not on this host')\n"
        "def model():\n    return mlp_dropout(width=16, depth=4, p=0.0)\n")
    s = job(RESUMED, model={"factory": "vanishing:model"}, balance="by_params", max_restarts=3, steps=4)
    r = cli.run("run", str(cli.write(s)), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=150)
    assert r.returncode == 1, r.stderr
    assert "RESTARTING" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "not on this host" in last and "cannot import the job's code" in last, last


@pytest.mark.multiprocess
def test_a_killed_run_resumes_with_run_resume(cli):
    s = job(RESUMED, steps=24)
    path = cli.write(s)
    out = cli.tmp / "state" / "r"
    with cli.running("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress") as p:
        wait_for(lambda: (out / "checkpoints" / "step-8" / checkpoint.MANIFEST).exists(), 90, "checkpoint step-8")
        os.killpg(p.pid, signal.SIGKILL)  # the coordinator and everything it started: a machine gone
        p.wait(timeout=30)
    wait_for(lambda: not cli.leftovers(), 10, "the workers to die with their coordinator")
    done = max(m["step"] for m in metrics(out))
    r = cli.run("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress", "--resume")
    assert r.returncode == 0, r.stderr
    resumed = int(re.search(r"r: resuming from checkpoint step-(\d+) ", r.stderr).group(1))
    assert 8 <= resumed <= done + 1
    assert [m["step"] for m in metrics(out) if m["attempt"] == 2] == list(range(resumed, 24))
    assert max_diff(load_file(out / "model.safetensors"), reference.train(s)) <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.parametrize(("change", "cut"), [
    ({"stages": 3, "balance": [1, 2, 1], "schedule": "zb-h1"}, "3 stages, balance [1, 2, 1]"),
    # 2 workers of 2 model chunks each, a V: worker 0 takes the first and the last layer's slices
    ({"stages": 2, "virtual_stages": 2, "balance": [1, 1, 1, 1], "schedule": "zbv"},
     "2 stages x 2 model chunks, balance [1, 1, 1, 1]"),
], ids=["3stages-zb-h1", "2x2-zbv"])
def test_a_checkpoint_fits_another_balance_schedule_and_a_longer_run(cli, finished, change, cut):
    # The same job (2 stages, [2, 2], gpipe) resumed with another cut and schedule, for 4 more steps: the names
    # in a checkpoint are the un-partitioned model's, so each new stage takes its slice of weights and optimizer
    # state, and no schedule is in it. (That the spec's balance wins over the checkpoint's with as many stages
    # as before is the plan's: test_balance.)
    src, s = finished
    shutil.copytree(src / "state", cli.tmp / "state")
    longer = {**s, **change, "steps": 14}
    r = cli.run("run", str(cli.write(longer)), "--state-dir", str(cli.tmp / "state"), "--no-progress", "--resume")
    assert r.returncode == 0, r.stderr
    assert "r: resuming from checkpoint step-10 " in r.stderr and cut in r.stderr
    out = cli.tmp / "state" / "r"
    plan = json.loads((out / "plan.json").read_text())
    assert plan["balance"] == change["balance"] and plan["balance_by"] == "spec"
    assert plan["schedule"]["name"] == change["schedule"]
    assert [m["step"] for m in metrics(out) if m["attempt"] == 2] == [10, 11, 12, 13]
    assert max_diff(load_file(out / "model.safetensors"), reference.train(longer)) <= 1e-6


@pytest.mark.multiprocess
def test_a_checkpoint_of_another_model_is_refused_in_one_line_and_nothing_changes(cli, finished):
    src, s = finished
    shutil.copytree(src / "state", cli.tmp / "state")
    out = cli.tmp / "state" / "r"
    before = {p.name: p.read_bytes() for p in (out / "metrics.jsonl", out / "model.safetensors")}
    wider = {**s, "model": {"factory": "mlp", "args": {"width": 32, "depth": 3}},
             "data": {**s["data"], "args": {"n": 48, "in_features": 32, "out_features": 32}}}
    r = cli.run("run", str(cli.write(wider)), "--state-dir", str(cli.tmp / "state"), "--no-progress", "--resume")
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint step-10 does not fit the model") and "0.0.weight" in last, last
    assert "RESTARTING" not in r.stderr and "Traceback" not in r.stderr
    assert {p.name: p.read_bytes() for p in (out / "metrics.jsonl", out / "model.safetensors")} == before
