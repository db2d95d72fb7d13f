"""A stage that raises, a worker that dies, a coordinator that is stopped: exit fast, name the stage, leave nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from gpipe.errors import EXIT_PREEMPTED
from tests.support.cli import wait_for
from tests.support.service import worker_pid
from tests.support.spec import job, regression, slow_mlp

pytestmark = pytest.mark.multiprocess


# A job whose model raises on its 6th forward (tests.support.models:failing_mlp), not restarted.
FAILING = {
    "name": "f", "model": {"factory": "tests.support.models:failing_mlp", "args": {"width": 8, "calls": 5}},
    "balance": [2, 2], "data": regression(32, 8, 4), "steps": 10, "max_restarts": 0,
}


def test_stage_that_raises_fails_the_job_naming_it(cli):
    path = cli.write(job(FAILING))
    t0 = time.monotonic()
    r = cli.run("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=90)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    # The fifth forward of stage 1 raises: micro-batch 0 of the third step (the spec is 2 micro-batches a step),
    # step 3 as the progress line counts.
    assert last.startswith("error: stage 1 (layers 2-3) failed at step 3: ValueError: boom after 5 forwards"), last
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60
    # The worker's own log keeps the traceback.
    assert "Traceback" in (cli.tmp / "state" / "f" / "logs" / "stage-1.log").read_text()


def test_a_data_sets_own_index_error_fails_the_job_as_its_error_after_one_restart_not_as_an_import(cli):
    """The job's data set raises IndexError at step 5 (items 16 on, of 4 a batch): the job's own error, which
    one restart may cure, never the workers' failing to import its code."""
    s = job(FAILING, model={"factory": "mlp", "args": {"width": 8, "depth": 3}},
             data={"factory": "tests.support.models:short_data", "args": {"n": 64, "bad": 16}, "batch_size": 4},
             max_restarts=1)
    r = cli.run("run", str(cli.write(s)), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=90)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data: step 5: IndexError: item 16"), last
    assert "import" not in last, last
    assert "RESTARTING" in r.stderr  # a RAISED error is given its one restart; an import failure is not
    assert "Traceback" not in r.stderr


def test_slow_stages_are_asked_what_they_do_and_are_not_taken_for_a_partition(cli):
    # Steps of about 1.2 s against peer_timeout_s 0.5: the coordinator asks the stages (over RPC) while no
    # step finishes; one of them is always computing, so the job trains on.
    s = job(FAILING, model=slow_mlp(8, 0.3), steps=3,
             peer_timeout_s=0.5)
    r = cli.run("run", str(cli.write(s)), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "RESTARTING" not in r.stderr


def _steps_done(out: Path) -> int:
    m = out / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.exists() else 0




SLOW = slow_mlp(8, 0.02)


@pytest.mark.parametrize("victim", [0, 1])
def test_worker_killed_mid_run_fails_the_job_within_seconds(cli, victim):
    path = cli.write(job(FAILING, model=SLOW, steps=500))
    out = cli.tmp / "state" / "f"
    with cli.running("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress") as p:
        wait_for(lambda: _steps_done(out) >= 2, 90, "two steps")
        pid = worker_pid(cli.tag, victim)
        assert pid, "no worker process found"
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        _, err = p.communicate(timeout=30)
        detected = time.monotonic() - t_kill
    assert p.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert f"stage {victim}'s worker process died (signal SIGKILL)" in last, last
    print(f"stage {victim} SIGKILLed: the run ended {detected:.2f}s later")
    assert detected < 10


def _stop_coordinator_mid_run(cli, stop, state: str = "state") -> tuple[subprocess.Popen, str]:
    """Start a long run, wait for a step, stop the coordinator with `stop`, and check its workers go too."""
    path = cli.write(job(FAILING, model=SLOW, steps=500))
    out = cli.tmp / state / "f"
    with cli.running("run", str(path), "--state-dir", str(cli.tmp / state), "--no-progress") as p:
        wait_for(lambda: _steps_done(out) >= 1, 90, "a step")
        workers = [worker_pid(cli.tag, k) for k in (0, 1)]
        assert all(workers)
        stop(p)
        _, err = p.communicate(timeout=30)
    wait_for(lambda: not any(Path(f"/proc/{w}").exists() for w in workers), 10, "the workers to exit")
    return p, err


def test_coordinator_stopped_takes_its_workers_along(cli):
    p, err = _stop_coordinator_mid_run(cli, lambda p: p.send_signal(signal.SIGTERM))
    assert p.returncode == EXIT_PREEMPTED, err  # checkpointed at a step boundary first (test_preempt)
    assert err.strip().splitlines()[-1].startswith("error: preempted: run got SIGTERM"), err
    p, err = _stop_coordinator_mid_run(cli, lambda p: p.send_signal(signal.SIGINT), "other")
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted"


def test_every_message_counts_steps_from_1_as_the_progress_line_does(cli):
    # A run's progress lines, its preempted attempt's line and its last line name one step by one number: step N
    # is the Nth, and checkpoint step-N the state after it.
    path = cli.write(job(FAILING, model=SLOW, steps=40))  # a progress line every 2 steps
    out = cli.tmp / "state" / "f"
    with cli.running("run", str(path), "--state-dir", str(cli.tmp / "state")) as p:
        wait_for(lambda: _steps_done(out) >= 5, 90, "five steps")
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == EXIT_PREEMPTED, err
    shown = [int(x.split()[1].split("/")[0]) for x in err.splitlines() if x.startswith("step ")]
    (said,) = [x for x in err.splitlines() if "preempted: stopped after step" in x]
    stopped = int(said.split("stopped after step ")[1].split(",")[0])
    assert said.endswith(f"with checkpoint step-{stopped}"), said
    assert err.strip().splitlines()[-1].startswith(f"error: preempted: run got SIGTERM; checkpoint step-{stopped} "), err
    assert shown and shown[-1] <= stopped and (out / "checkpoints" / f"step-{stopped}").is_dir()
    assert _steps_done(out) == stopped  # metrics.jsonl: steps 0 .. stopped-1 counted from 0, the steps done


def test_coordinator_sigkilled_takes_its_workers_along(cli):
    p, _ = _stop_coordinator_mid_run(cli, lambda p: p.kill())
    assert p.returncode == -signal.SIGKILL

def test_a_stage_that_waits_too_long_fails_the_job_naming_what_it_waited_for(cli):
    # Stage 0 takes 2 s per micro-batch; steps may take 1 s.
    slow = slow_mlp(8, 2.0)
    path = cli.write(job(FAILING, model=slow, steps=3, step_timeout_s=1.0, balance=[2, 2]))
    r = cli.run("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=90)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage 1 (layers 2-3) failed at step 1: TimeoutError: timed out after 1s "
                           "waiting for stage 0's activation of micro-batch 0"), last
