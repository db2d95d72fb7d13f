"""The shared pool through real serve and worker processes: two jobs at once on four workers, each the same bits
as its own `run` alone; a job of higher priority preempting one of two running jobs, all three SUCCEEDED, the
preempted one the same bits as an uninterrupted twin; a worker lost while two jobs run; a job larger than the pool
(refused with --max-workers, waiting for workers to join without); serve restarted with a job running and two
queued; backfill and its starvation bound; an elastic job preempted for priority running on fewer stages
meanwhile. The policy in process: tests/control/test_pool.py."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator

import pytest
import torch
from safetensors.torch import load_file

from tests.support.cli import end_leftovers, one_error_line
from tests.support.ports import free_port_in
from tests.support.service import Service
from tests.support.spec import SERVICE, job, slow_mlp

PORTS = range(43000, 44000)  # this module's servers listen here only
STEPS = 60  # the slow jobs' steps: long enough that a job submitted meanwhile finds them running, under load


@contextlib.contextmanager
def _pool(cli, *serve_flags: str, workers: int = 4) -> Iterator[Service]:
    """serve (with `serve_flags`) and `workers` workers (ranks 0-3), ended after, nothing left behind."""
    s = Service(cli)
    s.port = free_port_in(PORTS)
    s.address = f"127.0.0.1:{s.port}"
    try:
        s.start_serve(*serve_flags)
        for rank in range(workers):
            s.start_worker(rank)
        yield s
    finally:
        s.stop_all()
        assert not end_leftovers(cli)


def _alone(cli, spec: dict, name: str) -> dict[str, torch.Tensor]:
    """`spec` trained by `run` alone: the twin a pool's job must equal bit for bit."""
    r = cli.run("run", str(cli.write(spec | {"name": name}, f"{name}.yaml")), "--state-dir", str(cli.tmp / "alone"),
                "--no-progress", "--oversubscribe", timeout=240)
    assert r.returncode == 0, r.stderr
    return load_file(cli.tmp / "alone" / name / "model.safetensors")


def _submit_all(cli, s: Service, specs: list[dict]) -> None:
    """Submit `specs` at once (one client process each), so that they queue together."""
    procs = [cli.start("submit", str(cli.write(spec, f"{spec['name']}.yaml")), "--coordinator", s.address,
                       *s.auth()) for spec in specs]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err


def _same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def _ranks(out) -> list[int]:
    return [w["worker"] for w in json.loads((out / "plan.json").read_text())["workers"]]


def _gated(gate, seconds: float) -> dict:
    """A model held slow (tests.support.models.gated_mlp) while the file `gate` exists: a job a test holds running
    until what it acts on has landed, however loaded the host, and then lets run fast."""
    gate.touch()
    return {"factory": "tests.support.models:gated_mlp", "args": {"gate": str(gate), "width": 16, "seconds": seconds}}


def _record(out) -> dict:
    return json.loads((out / "job.json").read_text())


def _said(out, text: str) -> bool:
    """Whether the job's record holds a change whose message says `text`."""
    return (out / "job.json").exists() and any(text in h["message"] for h in _record(out)["history"])


def _steps(out) -> list[tuple[int, int]]:
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    return [(r["attempt"], r["step"]) for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.multiprocess
def test_two_jobs_run_at_once_on_four_workers_each_the_bits_of_its_run_alone(cli):
    x = job(SERVICE, name="x", model=slow_mlp(16, 0.05), steps=12)
    y = job(SERVICE, name="y", seed=7, model=slow_mlp(16, 0.05), steps=12, optimizer={"name": "adam", "lr": 0.01})
    with _pool(cli) as s:
        _submit_all(cli, s, [x, y])
        # Both running at once (before: the second waited for ranks 0-1 while 2-3 sat idle).
        s.wait_for(lambda: all(_steps(s.state / n) for n in ("x", "y")), "both jobs stepping", 120)
        for n in ("x", "y"):
            r = s.client("logs", n, "--follow", timeout=180)  # exits by the job's state
            assert r.returncode == 0, r.stdout + r.stderr
        # one on ranks 0-1, the other on the idle 2-3 (alone, each would have taken the ranks it names: 0-1)
        assert sorted([_ranks(s.state / "x"), _ranks(s.state / "y")]) == [[0, 1], [2, 3]]
    for spec in (x, y):
        got = load_file(s.state / spec["name"] / "model.safetensors")
        assert _same_bits(got, _alone(cli, spec, f"alone-{spec['name']}")), spec["name"]


@pytest.mark.multiprocess
@pytest.mark.timeout(480)  # four jobs and an uninterrupted twin, on a loaded host
def test_a_priority_job_preempts_one_of_two_running_jobs_and_all_three_succeed(cli):
    # Both held slow until urgent has preempted one of them: neither can end first, however loaded the host.
    gate = cli.tmp / "pool.gate"
    slow = job(SERVICE, model=_gated(gate, 0.5), steps=STEPS, checkpoint_every=1000)
    first, low = slow | {"name": "first"}, slow | {"name": "low", "seed": 3}
    urgent = job(SERVICE, name="urgent", steps=3, priority=5)
    with _pool(cli) as s:
        _submit_all(cli, s, [first, low])
        s.wait_for(lambda: all(_steps(s.state / n) for n in ("first", "low")), "both stepping", 120)
        r = s.client("list", "--workers")  # the pool: which job holds each worker
        held = [line.split()[-1] for line in r.stdout.splitlines()[1:]]
        assert r.returncode == 0 and sorted(held) == ["first", "first", "low", "low"], r.stdout
        assert s.client("submit", str(cli.write(urgent, "urgent.yaml"))).returncode == 0
        s.wait_for(lambda: any(_said(s.state / n, "preempted by job urgent") for n in ("first", "low")),
                   "urgent to preempt first or low", 120)
        gate.unlink()
        for n in ("urgent", "first", "low"):
            r = s.client("logs", n, "--follow", timeout=240)
            assert r.returncode == 0, r.stdout + r.stderr + s.log("serve")
        said = {n: s.client("logs", n).stdout for n in ("first", "low")}
        (hit,) = [n for n, text in said.items() if "preempted by job urgent (priority 5)" in text]  # the newest
        calm = "low" if hit == "first" else "first"
        steps = _steps(s.state / hit)
        assert {a for a, _ in steps} == {1, 2}  # stopped once, resumed: no step lost or run twice
        assert [st for _, st in steps] == list(range(STEPS))
        assert [a for a, _ in _steps(s.state / calm)] == [1] * STEPS  # the other ran on
        r = s.client("list", "--workers")
        assert [line.split()[-1] for line in r.stdout.splitlines()[1:]] == ["free"] * 4, r.stdout
    got = load_file(s.state / hit / "model.safetensors")
    assert _same_bits(got, _alone(cli, first if hit == "first" else low, "twin"))


@pytest.mark.multiprocess
@pytest.mark.timeout(360)  # two jobs, a loss and a restart: each wait is bounded inside
def test_a_worker_lost_while_two_jobs_run_restarts_its_job_alone(cli):
    slow = job(SERVICE, model=slow_mlp(16, 0.1), steps=24, checkpoint_every=2)
    one, two = slow | {"name": "one"}, slow | {"name": "two", "seed": 5}
    with _pool(cli) as s:
        _submit_all(cli, s, [one, two])
        s.wait_for(lambda: all(len(_steps(s.state / n)) >= 3 for n in ("one", "two")), "both at step 3", 120)
        hit = next(n for n in ("one", "two") if 3 in _ranks(s.state / n))
        calm = "two" if hit == "one" else "one"
        s.kill("worker3")  # one of `hit`'s workers
        s.start_worker(3)  # and back, as Kubernetes restarts a pod
        for n in ("one", "two"):
            r = s.client("logs", n, "--follow", timeout=240)
            assert r.returncode == 0, r.stdout + r.stderr + s.log("serve")
        assert {a for a, _ in _steps(s.state / calm)} == {1}  # never stopped
        assert max(a for a, _ in _steps(s.state / hit)) >= 2  # restarted from its checkpoint
    for spec in (one, two):
        got = load_file(s.state / spec["name"] / "model.safetensors")
        assert _same_bits(got, _alone(cli, spec, f"alone-{spec['name']}")), spec["name"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_job_larger_than_the_pool_s_known_size_is_refused_at_submit_and_nothing_changes(cli):
    huge = job(SERVICE, name="huge", replicas=2)  # 4 workers, on a pool of at most 2
    with _pool(cli, "--max-workers", "2", workers=2) as s:
        r = s.client("submit", str(cli.write(huge, "huge.yaml")))
        line = one_error_line(r.stderr, "error:")
        assert r.returncode == 2 and "'huge'" in line and "needs 4" in line and "at most 2" in line, r.stderr
        assert "huge" not in s.client("list").stdout and not (s.state / "huge").exists()
        # The pool's size holds: a worker of a rank past it is refused, in one line, and exits 2.
        p = s._spawn("worker2", ["-m", "gpipe.worker.daemon", "--rank", "2", "--coordinator", s.address])
        assert p.wait(timeout=60) == 2 and "ranks 0-1" in s.log("worker2") and "Traceback" not in s.log("worker2")
        assert s.client("list", "--workers").stdout.count("free") == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_job_larger_than_the_registered_workers_waits_saying_so_and_runs_once_they_join(cli):
    wide = job(SERVICE, name="wide", replicas=2)  # 4 workers; the pool's size is not set: more may join
    with _pool(cli, workers=2) as s:
        assert s.client("submit", str(cli.write(wide, "wide.yaml"))).returncode == 0
        s.wait_for(lambda: "2 registered" in s.client("list").stdout, "the job's wait in list", 30)
        row = next(x for x in s.client("list").stdout.splitlines() if x.startswith("wide"))
        assert row.split()[1] == "PENDING" and "needs 4 workers" in row, row
        waiting = [x for x in s.client("status", "wide").stdout.splitlines() if x.startswith("waiting:")]
        assert len(waiting) == 1 and "needs 4" in waiting[0] and "2 registered" in waiting[0]
        s.start_worker(2)
        s.start_worker(3)
        r = s.client("logs", "wide", "--follow", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr + s.log("serve")
        assert "waiting:" not in s.client("status", "wide").stdout


def _started(out) -> list[float]:
    """When each of the job's attempts started running (its record's RUNNING changes), in order."""
    history = json.loads((out / "job.json").read_text())["history"]
    return [h["time_unix"] for h in history if h["state"] == "RUNNING"]


@pytest.mark.multiprocess
@pytest.mark.timeout(180)  # a twin run besides: about 90 s on a loaded 2-core host
def test_serve_restarted_with_a_job_running_and_two_queued_runs_all_three_in_priority_order(cli):
    steps = 40  # long enough to be running still once the two others are submitted, under load
    gate = cli.tmp / "top.gate"  # top held slow until serve's SIGTERM has been handled: it cannot end first
    top = job(SERVICE, name="top", model=_gated(gate, 0.5), steps=steps, checkpoint_every=1000, priority=5)
    low, mid = job(SERVICE, name="low", steps=3), job(SERVICE, name="mid", steps=3, priority=3)
    with _pool(cli, workers=2) as s:
        assert s.client("submit", str(cli.write(top, "top.yaml"))).returncode == 0
        s.wait_for(lambda: len(_steps(s.state / "top")) >= 2, "top stepping", 90)
        _submit_all(cli, s, [low, mid])  # both wait: top holds the two workers, and outranks them
        s.kill("serve", signal.SIGTERM)  # top checkpoints at its step boundary; the queue stays on disk
        states = {n: json.loads((s.state / n / "job.json").read_text())["state"] for n in ("top", "low", "mid")}
        assert states == {"top": "PREEMPTED", "low": "PENDING", "mid": "PENDING"}, states
        gate.unlink()
        s.start_serve()  # the same state dir and port: the workers register again by themselves
        for n in ("top", "mid", "low"):
            r = s.client("logs", n, "--follow", timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr + s.log("serve")
        # top resumed first (priority 5), then mid (3), then low (0), though low was submitted before mid.
        assert _started(s.state / "top")[-1] < _started(s.state / "mid")[0] < _started(s.state / "low")[0]
        ran = _steps(s.state / "top")
        assert {a for a, _ in ran} == {1, 2} and [st for _, st in ran] == list(range(steps))  # none lost or twice
        assert json.loads((s.state / "top" / "job.json").read_text())["restarts"] == 0  # no failure: none counted
    got = load_file(s.state / "top" / "model.safetensors")
    assert _same_bits(got, _alone(cli, top, "twin"))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)  # about 70 s on a loaded 2-core host
def test_a_small_job_backfills_beside_a_waiting_large_one_which_is_not_starved_past_the_bound(cli):
    bound = 10.0  # serve --starve-after-s: big waits longer than this for ranks 0-1, held by `hold`
    # hold runs until stopped below, whatever the host's load (a fixed number of steps ended before late came,
    # under CI's load)
    hold = job(SERVICE, name="hold", model=slow_mlp(16, 0.1), steps=5000)
    big = job(SERVICE, name="big", replicas=2, steps=3)  # all four workers
    small, late = job(SERVICE, name="small", steps=3), job(SERVICE, name="late", steps=3)
    with _pool(cli, "--starve-after-s", str(bound)) as s:
        assert s.client("submit", str(cli.write(hold, "hold.yaml"))).returncode == 0
        s.wait_for(lambda: _steps(s.state / "hold"), "hold stepping", 90)
        _submit_all(cli, s, [big, small])
        # Backfill: small fits on the idle ranks 2-3 and runs to its end while big waits for all four.
        assert s.client("logs", "small", "--follow", timeout=90).returncode == 0
        assert _ranks(s.state / "small") == [2, 3] and _record(s.state / "big")["state"] == "PENDING"
        # Past the bound, big holds back what comes after it: late waits, though ranks 2-3 are idle.
        since = _record(s.state / "big")["history"][0]["time_unix"]
        s.wait_for(lambda: time.time() > since + bound + 1, "big to wait past the bound", bound + 5)
        assert s.client("submit", str(cli.write(late, "late.yaml"))).returncode == 0
        time.sleep(3.0)  # (serve's queue is decided within a second of a change)
        assert _record(s.state / "late")["state"] == "PENDING" and _record(s.state / "hold")["state"] == "RUNNING"
        assert s.client("stop", "hold").returncode == 0  # ranks 0-1 free: big first, then late
        for n in ("big", "late"):
            r = s.client("logs", n, "--follow", timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr + s.log("serve")
    hold_ended = _record(s.state / "hold")["history"][-1]["time_unix"]
    assert _record(s.state / "hold")["state"] == "STOPPED"
    assert _started(s.state / "small")[0] < _started(s.state / "big")[0]  # backfilled before big
    assert hold_ended <= _started(s.state / "big")[0] < _started(s.state / "late")[0]  # big first, once 0-1 freed


@pytest.mark.multiprocess
@pytest.mark.timeout(180)  # about 70 s on a loaded 2-core host
def test_an_elastic_job_preempted_for_priority_runs_on_fewer_stages_meanwhile_to_the_one_device_weights(cli):
    from tests.support import reference

    # flex is held slow (0.1 s a layer's call, 120 steps) until it has grown back, so that it does not end first.
    gate = cli.tmp / "flex.gate"
    flex = job(SERVICE, name="flex", stages=4, balance=[1, 1, 1, 1], model=_gated(gate, 0.1), steps=120,
               checkpoint_every=4, elastic={"min_stages": 2})
    urgent = job(SERVICE, name="urgent", model=slow_mlp(16, 0.1), steps=10, priority=5)  # 2 workers
    with _pool(cli) as s:
        assert s.client("submit", str(cli.write(flex, "flex.yaml"))).returncode == 0
        s.wait_for(lambda: len(_steps(s.state / "flex")) >= 3, "flex stepping", 90)
        assert s.client("submit", str(cli.write(urgent, "urgent.yaml"))).returncode == 0
        s.wait_for(lambda: 3 in {a for a, _ in _steps(s.state / "flex")}, "flex to grow back", 150)
        gate.unlink()
        for n in ("urgent", "flex"):
            r = s.client("logs", n, "--follow", timeout=150)
            assert r.returncode == 0, r.stdout + r.stderr + s.log("serve")
        rec = _record(s.state / "flex")
    # Preempted, it ran on the two workers urgent left (2 stages of 4) while urgent ran, then grew back.
    assert any("stage count 4 -> 2" in h["message"] and "job urgent" in h["message"] for h in rec["history"])
    assert {a for a, _ in _steps(s.state / "flex")} == {1, 2, 3} and rec["restarts"] == 0
    urgent_ended = _record(s.state / "urgent")["history"][-1]["time_unix"]
    assert _started(s.state / "flex")[1] < urgent_ended
    got, want = load_file(s.state / "flex" / "model.safetensors"), reference.train(flex)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
