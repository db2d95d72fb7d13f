"""Preemption, as Kubernetes does it, to real processes: SIGTERM with a grace to a worker daemon, to serve, to
`run`; a checkpoint at the next step boundary and a resume to the same weights. The supervisor's part in
process: tests/control/test_preempt.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from gpipe.errors import EXIT_PREEMPTED
from tests.support import reference
from tests.support.ports import free_port_in
from tests.support.service import Service
from tests.support.spec import SERVICE, job, slow_mlp


def checkpoints(out: Path) -> list[int]:
    d = out / "checkpoints"
    return sorted(int(p.name.removeprefix("step-")) for p in d.glob("step-*") if (p / "MANIFEST.json").exists()) \
        if d.exists() else []


PORTS = range(42000, 43000)  # this module's servers listen here only
SLOW = slow_mlp(16, 0.03)
STEPS = 14  # stopped after step 6: the rest for the resumed attempt


def steps_of(out: Path) -> list[tuple[int, int]]:
    """(attempt, step) of each training step in the job's metrics.jsonl."""
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    rows = [json.loads(x) for x in lines if x.strip()]
    return [(r["attempt"], r["step"]) for r in rows if "loss" in r]




def assert_resumed_at_the_boundary(out: Path, spec: dict) -> int:
    """Attempt 1 ran steps 0..N-1 and checkpointed step-N; attempt 2 ran N..end; the weights are the
    reference's. Returns N."""
    steps = steps_of(out)
    first = [s for a, s in steps if a == 1]
    second = [s for a, s in steps if a == 2]
    n = second[0]
    assert first == list(range(n)), steps  # nothing lost past the checkpoint: it was taken at the last step run
    assert second == list(range(n, spec["steps"])), steps  # and nothing before it ran again
    got = load_file(out / "model.safetensors")
    want = reference.train(spec)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    return n


def service(cli) -> Service:
    s = Service(cli)
    s.port = free_port_in(PORTS)
    s.address = f"127.0.0.1:{s.port}"
    return s


@pytest.mark.multiprocess
def test_a_worker_given_sigterm_has_its_job_checkpoint_then_exits_0_and_the_job_resumes_when_it_is_back(cli):
    s = service(cli)
    try:
        s.start_serve()
        s.start_worker(0)
        s.start_worker(1)
        spec = job(SERVICE, name="evicted", model=SLOW, steps=STEPS, checkpoint_every=1000)
        out = s.state / "evicted"
        assert s.client("submit", str(cli.write(spec))).returncode == 0
        s.wait_for(lambda: len(steps_of(out)) >= 6, "step 6", 90)
        worker = s.procs.pop("worker1")
        t0 = time.monotonic()
        os.kill(worker.pid, signal.SIGTERM)  # the daemon alone, as the kubelet signals a container's first process
        code = worker.wait(timeout=30)
        took = time.monotonic() - t0
        assert code == 0, s.log("worker1")
        assert re.search(r"attempt ended [\d.]+s after SIGTERM: leaving", s.log("worker1")), s.log("worker1")
        assert not re.search("Traceback|never retrieved", s.log("worker1")), s.log("worker1")
        r = s.client("status", "evicted")
        assert "state:    PREEMPTED" in r.stdout and "attempts: 1, restarts 0 of" in r.stdout, r.stdout
        taken = checkpoints(out)
        assert len(taken) == 1 and f"checkpoint: step-{taken[0]}" in r.stdout, (taken, r.stdout)
        assert "stage 1's worker was preempted (SIGTERM)" in r.stdout, r.stdout
        s.start_worker(1)  # as the StatefulSet brings the pod back
        r = s.client("logs", "evicted", "--follow", timeout=180)
        assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("SUCCEEDED: "), r.stdout + r.stderr
        assert assert_resumed_at_the_boundary(out, spec) == taken[0]
        print(f"SIGTERM to the worker's exit: {took:.2f}s (checkpoint step-{taken[0]})")
    finally:
        s.stop_all()


@pytest.mark.multiprocess
def test_a_worker_whose_job_cannot_checkpoint_within_the_grace_exits_anyway_and_the_job_falls_back(cli):
    s = service(cli)
    try:
        s.start_serve()
        s.start_worker(0)
        s.start_worker(1, "--grace-s", "1")
        # A step takes about 1.5 s: the steps in flight and the one that would checkpoint take longer than 1 s.
        spec = job(SERVICE, name="hurried", model=slow_mlp(16, 0.5),
                   steps=6, checkpoint_every=2)
        out = s.state / "hurried"
        assert s.client("submit", str(cli.write(spec))).returncode == 0
        s.wait_for(lambda: 2 in checkpoints(out), "checkpoint step-2", 120)
        worker = s.procs.pop("worker1")
        t0 = time.monotonic()
        os.kill(worker.pid, signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, s.log("worker1")
        took = time.monotonic() - t0
        assert took < 5 and "did not end within the grace (1s): leaving anyway" in s.log("worker1"), took
        s.wait_for(lambda: "state:    PREEMPTED" in s.client("status", "hurried").stdout, "PREEMPTED", 60)
        r = s.client("status", "hurried")
        assert "no checkpoint at the step boundary" in r.stdout and "restarts 0 of" in r.stdout, r.stdout
        s.start_worker(1)
        r = s.client("logs", "hurried", "--follow", timeout=180)
        assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("SUCCEEDED: "), r.stdout + r.stderr
        second = [st for a, st in steps_of(out) if a == 2]
        assert second == list(range(second[0], 6)) and second[0] % 2 == 0  # from the last good checkpoint
        got = load_file(out / "model.safetensors")
        want = reference.train(spec)
        assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    finally:
        s.stop_all()


@pytest.mark.multiprocess
def test_serve_given_sigterm_checkpoints_its_running_job_exits_and_resumes_it_on_restart(cli):
    s = service(cli)
    try:
        s.start_serve()
        s.start_worker(0)
        s.start_worker(1)
        # Held slow (tests.support.models.gated_mlp) until serve's SIGTERM has been handled: the job cannot end first.
        gate = cli.tmp / "drained.gate"
        gate.touch()
        model = {"factory": "tests.support.models:gated_mlp", "args": {"gate": str(gate), "width": 16, "seconds": 0.2}}
        spec = job(SERVICE, name="drained", model=model, steps=STEPS, checkpoint_every=1000)
        out = s.state / "drained"
        assert s.client("submit", str(cli.write(spec))).returncode == 0
        s.wait_for(lambda: len(steps_of(out)) >= 6, "step 6", 90)
        serve = s.procs.pop("serve")
        os.kill(serve.pid, signal.SIGTERM)
        assert serve.wait(timeout=30) == 0, s.log("serve")
        record = json.loads((out / "job.json").read_text())
        assert record["state"] == "PREEMPTED", record["history"][-1]
        assert "the coordinator is stopping (SIGTERM)" in record["history"][-1]["message"]
        taken = checkpoints(out)
        assert len(taken) == 1 and record["checkpoint_step"] == taken[0], (taken, record)
        gate.unlink()
        s.start_serve()  # the workers register again by themselves
        r = s.client("logs", "drained", "--follow", timeout=180)
        assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("SUCCEEDED: "), r.stdout + r.stderr
        assert assert_resumed_at_the_boundary(out, spec) == taken[0]
        assert "restarts 0 of" in s.client("status", "drained").stdout

        # A page at a time: the token goes on where the page before ended; one that is none of ours is exit 2.
        assert s.client("submit", str(cli.write(job(SERVICE, name="other"), "other.yaml"))).returncode == 0
        r = s.client("list", "--limit", "1")
        assert r.returncode == 0 and re.search(r"^drained ", r.stdout, re.M) and "other" not in r.stdout, r.stdout
        token = re.search(r"--page-token (\S+)", r.stderr).group(1)
        r = s.client("list", "--limit", "1", "--page-token", token)
        assert r.returncode == 0 and re.search(r"^other ", r.stdout, re.M) and "--page-token" not in r.stderr
        r = s.client("list", "--page-token", "not-a-token")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "page_token" in r.stderr, r.stderr
        r = s.client("list", "--limit", "0")
        assert r.returncode == 2 and "--limit" in r.stderr, r.stderr
    finally:
        s.stop_all()


@pytest.mark.multiprocess
def test_run_given_sigterm_checkpoints_exits_143_and_run_resume_goes_on_to_the_same_weights(cli):
    spec = job(SERVICE, name="local", model=SLOW, steps=STEPS, checkpoint_every=1000)
    path = cli.write(spec)
    out = cli.tmp / "gpipe-state" / "local"
    with cli.running("run", str(path), "--no-progress") as p:
        deadline = time.monotonic() + 90
        while len(steps_of(out)) < 6:
            assert p.poll() is None and time.monotonic() < deadline, "run did not reach step 6"
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert p.returncode == EXIT_PREEMPTED, err
    taken = checkpoints(out)
    assert len(taken) == 1 and f"checkpoint step-{taken[0]} taken at the step boundary" in err, err
    assert "run --resume" in err and not (out / "model.safetensors").exists()
    r = cli.run("run", str(path), "--resume", "--no-progress", timeout=120)
    assert r.returncode == 0, r.stderr
    assert assert_resumed_at_the_boundary(out, spec) == taken[0]
