"""Chaos: one job under serve through a seeded run of mixed faults ends with the weights of its calm run.

The faults are those a cluster deals out: a worker's container killed (SIGKILL to its process group), a worker
evicted (SIGTERM to the daemon, which checkpoints and leaves), a worker frozen for a few seconds (SIGSTOP to the
daemon and every process under it: to the coordinator, a worker cut off), serve's container killed (SIGKILL to
its process group, with its attempt process). Each lands after a few steps of the attempt then running, and
what was killed is started again as its orchestrator would: the worker under its rank, serve on its state dir
and port. The job must end SUCCEEDED with, bit for bit, the weights of the same job run calmly by the same serve
on the same workers just before.

GPIPE_CHAOS_SEED=N picks the faults, their order, their victims and moments (the suite runs one seed); -s prints
each fault, when it landed and how long its victim took to be back, and the job's restarts:
    for s in $(seq 1 10); do GPIPE_CHAOS_SEED=$s .venv/bin/pytest -q -s tests/service/test_chaos.py || break; done
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support.cli import Cli
from tests.support.service import ENDED, Service, with_suppress
from tests.support.soak import descendants
from tests.support.spec import SERVICE, job, slow_mlp

SEED = int(os.environ.get("GPIPE_CHAOS_SEED", "1126"))
KINDS = ("worker SIGKILL", "worker SIGTERM", "worker SIGSTOP", "serve SIGKILL")
HEARTBEAT_TIMEOUT_S = 3  # serve's: a freeze longer than this drops the worker and restarts the attempt
STEPS = 24  # the last fault lands well before the end: each lands a row or two after the one before


def spec(name: str) -> dict[str, Any]:
    """Adam and a shuffled data set: a resume must bring back the optimizer's state and the data's position."""
    return job(SERVICE, name=name, seed=7, model=slow_mlp(16, 0.02),
               data={"factory": "random_regression", "args": {"n": 48, "in_features": 16, "out_features": 16},
                     "batch_size": 8, "shuffle": True},
               optimizer={"name": "adam", "lr": 0.01}, steps=STEPS, checkpoint_every=3, max_restarts=20,
               restart_timeout_s=60)


def faults(rng: random.Random) -> list[tuple[str, int, int, float]]:
    """Five faults, each kind at least once: (kind, the worker's rank, rows of steps to wait for before it,
    seconds a freeze lasts)."""
    kinds = [*KINDS, rng.choice(KINDS)]
    rng.shuffle(kinds)
    return [(kind, rng.randrange(2), rng.randint(1, 2), round(rng.uniform(1.0, 4.0), 1)) for kind in kinds]


def strike(s: Service, kind: str, rank: int, freeze_s: float) -> str:
    """One fault, and what was killed started again; what it was, in words."""
    key = f"worker{rank}"
    if kind == "worker SIGKILL":
        s.kill(key)
        s.start_worker(rank)
        return f"{kind} rank {rank}"
    if kind == "worker SIGTERM":
        daemon = s.procs[key]
        os.kill(daemon.pid, signal.SIGTERM)  # the daemon alone, as the kubelet signals a container's first process
        assert daemon.wait(timeout=30) == 0, s.log(key)  # it checkpoints its job and leaves
        del s.procs[key]
        s.start_worker(rank)
        return f"{kind} rank {rank}"
    if kind == "worker SIGSTOP":
        frozen = descendants(s.procs[key].pid)
        for pid in frozen:
            with_suppress(lambda pid=pid: os.kill(pid, signal.SIGSTOP))
        try:
            time.sleep(freeze_s)
        finally:
            for pid in frozen:
                with_suppress(lambda pid=pid: os.kill(pid, signal.SIGCONT))
        return f"{kind} rank {rank} for {freeze_s}s ({len(frozen)} processes)"
    s.kill("serve")
    s.start_serve("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))  # the workers register again by themselves
    return kind


def steps_of(out: Path) -> list[tuple[int, int]]:
    """(attempt, step) of each training step in metrics.jsonl, past a line cut short (an attempt killed as it
    wrote, or a line being written as it is read)."""
    path, found = out / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            if "loss" in (row := json.loads(line)):
                found.append((row["attempt"], row["step"]))
    return found


def state(out: Path) -> dict[str, Any]:
    """The job's record as serve keeps it (replaced atomically); {} before it is written."""
    path = out / "job.json"
    return json.loads(path.read_text()) if path.exists() else {}


def start_workers(s: Service) -> None:
    """Both workers at once, each waited for until it is registered."""
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(s.start_worker, rank) for rank in (0, 1)]:
            f.result()


@pytest.mark.multiprocess
def test_a_job_through_a_seeded_run_of_mixed_faults_ends_with_the_weights_of_its_calm_run(cli: Cli) -> None:
    plan = faults(random.Random(SEED))
    print(f"GPIPE_CHAOS_SEED={SEED}: " + ", ".join(
        f"{kind} rank {rank}" if kind.startswith("worker") else kind for kind, rank, _, _ in plan))
    cli.env.pop("GPIPE_TEMPLATE_SOCKET", None)  # a worker is a machine: SIGSTOP freezes its attempt processes too
    s = Service(cli)
    t0 = time.monotonic()
    try:
        s.start_serve("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
        start_workers(s)
        print(f"  {time.monotonic() - t0:4.1f}s serve and 2 workers up")
        # The calm run first, then the same job under faults: serve runs them one after the other on the workers.
        for name in ("calm", "chaos"):
            assert s.client("submit", str(cli.write(spec(name), f"{name}.yaml"))).returncode == 0
        calm, out = s.state / "calm", s.state / "chaos"
        done = 0  # rows of steps in the chaos job's metrics.jsonl, of every attempt
        for kind, rank, after, freeze_s in plan:
            s.wait_for(lambda n=done + after: len(steps_of(out)) >= n or state(out).get("state") in ENDED,
                       f"{after} more steps before a {kind}", 60)
            assert state(out)["state"] not in ENDED, f"ended before a {kind}: {state(out)['history'][-1]}"
            t, step = time.monotonic(), steps_of(out)[-1][1] + 1
            what = strike(s, kind, rank, freeze_s)
            done = len(steps_of(out))
            print(f"  {t - t0:4.1f}s {what} after step {step}: back in {time.monotonic() - t:.1f}s")
        s.wait_for(lambda: state(out).get("state") in ENDED, "the job's end", 60)
        record = state(out)
        print(f"  {time.monotonic() - t0:4.1f}s {record['state']}")
        print("\n".join(f"  | {h['state']}: {h['message']}" for h in record["history"]
                        if h["state"] not in ("PENDING", "RUNNING")))
        assert record["state"] == "SUCCEEDED", record["history"][-1]
        attempts = max(a for a, _ in steps_of(out))
        assert attempts > 1, record["history"]  # the faults landed while it ran, and none while the calm run did
        assert {a for a, _ in steps_of(calm)} == {1} and state(calm)["history"][-1]["state"] == "SUCCEEDED"
        got, want = load_file(out / "model.safetensors"), load_file(calm / "model.safetensors")
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        print(f"the calm run's weights bit for bit after {attempts} attempts, {time.monotonic() - t0:.1f}s in all")
    finally:
        s.stop_all()
