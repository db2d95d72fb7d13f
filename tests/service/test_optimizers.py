"""Optimizers by import path, end to end: trained, resumed and validated through `gpipe-coordinator`.

torch.optim:RMSprop with momentum (state: square_avg, momentum_buffer and step tensors) under a cosine LR
schedule, and a user's own class in a module next to the job file (a tensor and a JSON number of state),
each equal to the one-device reference (tests.support.reference builds the same optimizer); a run resumed
from a checkpoint equal to an uninterrupted one; serve's submit refusing a bad option, and training with the
user's class from the job's code archive. The checks themselves are in tests/control/test_optim_check.py.
"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from tests.support import reference
from tests.support.cli import end_leftovers, one_error_line
from tests.support.optimizers import USER_CODE, USER_MODULE
from tests.support.runs import metrics, train_and_compare
from tests.support.service import Service
from tests.support.spec import SERVICE, TWO_STAGES, job

pytestmark = pytest.mark.multiprocess

RMSPROP = {"name": "torch.optim:RMSprop", "lr": 0.01, "args": {"alpha": 0.9, "momentum": 0.5}}
USERS = {"name": f"{USER_MODULE}:SoftSignMomentum", "lr": 0.01, "args": {"beta": 0.8}}
OPTIMIZERS = {"rmsprop": RMSPROP, "users": USERS}


@pytest.fixture
def user_code(cli, monkeypatch):
    """The user's optimizer next to the job file, where the run finds it; the reference too (sys.path)."""
    (cli.tmp / f"{USER_MODULE}.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(cli.tmp))


def test_rmsprop_with_momentum_and_an_lr_schedule_equals_one_device(cli):
    spec = job(TWO_STAGES, steps=6, optimizer=RMSPROP,
               lr_schedule={"name": "cosine", "warmup_steps": 2, "min_lr": 0.001})
    lines = train_and_compare(cli, "rmsprop", spec)
    assert [m["lr"] for m in lines] == pytest.approx([0.01 * reference.lr_factor(spec, k) for k in range(6)])


def test_a_users_own_optimizer_next_to_the_job_file_equals_one_device(cli, user_code):
    train_and_compare(cli, "users", job(TWO_STAGES, steps=4, optimizer=USERS))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_resumed_run_equals_an_uninterrupted_one(cli, user_code, name):
    # 4 steps with a checkpoint at each 2, then the same job to 7 steps from the checkpoint at step 4: the
    # optimizer's tensors (safetensors) and numbers (JSON) come back as they were.
    first = job(TWO_STAGES, name="r", steps=4, checkpoint_every=2, optimizer=OPTIMIZERS[name])
    state = ["--state-dir", str(cli.tmp / "state"), "--no-progress"]
    r = cli.run("run", str(cli.write(first)), *state)
    assert r.returncode == 0, r.stderr
    saved = cli.tmp / "state" / "r" / "checkpoints" / "step-4"
    with safe_open(saved / "stage-0.safetensors", "pt") as f:
        assert "optim/0.0.weight/" + {"rmsprop": "momentum_buffer", "users": "momentum"}[name] in f.keys()
    if name == "users":  # its step count, a number, in the stage's JSON
        assert json.loads((saved / "stage-0.json").read_text())["optimizer_state"]["0.0.weight"] == {"steps": 4}
    longer = {**first, "steps": 7}
    r = cli.run("run", str(cli.write(longer)), *state, "--resume")
    assert r.returncode == 0, r.stderr
    assert "r: resuming from checkpoint step-4 " in r.stderr, r.stderr
    out = cli.tmp / "state" / "r"
    assert [m["step"] for m in metrics(out) if m["attempt"] == 2] == [4, 5, 6]
    got, want = load_file(out / "model.safetensors"), reference.train(longer)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5


BAD = [
    ({"name": "torch.optim:RMSprop", "lr": 0.01, "args": {"alpha": -0.5}}, "error: optimizer.args.alpha: "),
    ({"name": "torch.optim:RMSprop", "lr": 0.01, "args": {"alpah": 0.5}}, "error: optimizer.args.alpah: "),
    ({"name": "torch.optim:LBFGS", "lr": 0.01}, "error: optimizer.name: "),
    ({"name": f"{USER_MODULE}:SoftSignMomentum", "lr": 0.01, "args": {"beta": 1.5}}, "error: optimizer.args.beta: "),
]


@pytest.mark.parametrize("optimizer,starts", BAD, ids=["alpha", "unknown", "lbfgs", "users"])
def test_validate_refuses_a_bad_optimizer_in_one_line(cli, user_code, optimizer, starts):
    r = cli.run("validate", str(cli.write(job(TWO_STAGES, optimizer=optimizer))))
    assert r.returncode == 2
    one_error_line(r.stderr, starts)


def test_serve_checks_at_submit_and_trains_the_users_optimizer_from_the_code_archive(cli, user_code):
    s = Service(cli)
    try:
        s.start_serve()
        s.start_worker(0)
        one = {"stages": 1, "balance": [4]}
        bad = job(SERVICE, one, name="bad", optimizer={**USERS, "args": {"beta": 1.5}})
        r = s.client("submit", str(cli.write(bad)))
        assert r.returncode == 2
        one_error_line(r.stderr, "error: optimizer.args.beta: ")
        good = job(SERVICE, one, name="svc", steps=3, optimizer=USERS)
        r = s.client("submit", str(cli.write(good)), "--follow", "--no-progress")
        assert r.returncode == 0, r.stderr + s.log("serve")
        assert "svc: SUCCEEDED: 3/3 steps" in r.stderr
        got, want = load_file(s.state / "svc" / "model.safetensors"), reference.train(good)
        assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    finally:
        s.stop_all()
        assert not end_leftovers(cli)
