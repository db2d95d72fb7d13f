"""Losing a worker: how soon it is seen, and how soon training goes on.

    python bench/recovery.py --rounds 3

`gpipe-coordinator run` of a 2-stage MLP (a checkpoint every 5 steps); at step
12 stage 1's worker process is SIGKILLed. Measured from the kill:
  detected: the run prints the failure (the attempt saw the process die);
  resumed:  the restarted attempt logs its first step (fresh coordinator and
            worker processes, the checkpoint verified and loaded, the stages
            rebuilt, the step run).
And the steps lost: those run again, from the checkpoint up to the kill.
Each figure is the median of --rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def worker_pid(tag: str, stage: int) -> int | None:
    """The attempt process serving `stage`: the one whose output goes to that stage's log."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            log = os.readlink(d / "fd" / "2")
        except OSError:
            continue
        if f"GPIPE_BENCH_TAG={tag}".encode() in env and log.endswith(f"/stage-{stage}.log"):
            return int(d.name)
    return None


def one_round(tmp: Path, r: int, kill_at: int) -> tuple[float, float, int]:
    name = f"rec{r}"
    spec = {
        "name": name, "model": {"factory": "mlp", "args": {"width": 256, "depth": 4}}, "stages": 2,
        "chunks": 4, "data": {"factory": "random_regression", "args": {"n": 512, "in_features": 256,
                                                                       "out_features": 256}, "batch_size": 64},
        "loss": "mse", "optimizer": {"name": "adam", "lr": 0.001}, "steps": 30, "checkpoint_every": 5,
    }
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec))
    tag = f"{os.getpid()}-{r}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPIPE_BENCH_TAG=tag)
    p = subprocess.Popen([sys.executable, "-m", "gpipe.coordinator.cli.main", "run", str(job), "--state-dir", str(tmp),
                          "--no-progress"], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), x)) for x in p.stderr], daemon=True)
    reader.start()
    metrics = tmp / name / "metrics.jsonl"

    def logged() -> list[dict]:
        try:
            return [json.loads(x) for x in metrics.read_text().splitlines() if x.endswith("}")]
        except OSError:
            return []

    try:
        while len(logged()) <= kill_at:
            time.sleep(0.002)
        os.kill(worker_pid(tag, 1), signal.SIGKILL)
        t_kill = time.monotonic()
        while not any(m["attempt"] == 2 for m in logged()):
            time.sleep(0.002)
        resumed = time.monotonic() - t_kill
        p.wait(timeout=300)
        reader.join(timeout=10)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    if p.returncode:
        raise SystemExit("".join(x for _, x in lines))
    detected = next(t for t, x in lines if "worker process died" in x) - t_kill
    m = logged()
    done_first = max(x["step"] for x in m if x["attempt"] == 1)
    first_again = min(x["step"] for x in m if x["attempt"] == 2)
    return detected, resumed, done_first + 1 - first_again


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=12)
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            rows.append(one_round(Path(d), r, a.kill_at))
            print(f"round {r}: detected {rows[-1][0]:.2f}s, resumed {rows[-1][1]:.2f}s, "
                  f"{rows[-1][2]} step(s) run again", flush=True)
    med = [statistics.median(x[i] for x in rows) for i in range(3)]
    print(f"median of {a.rounds}: detected {med[0]:.2f}s after the SIGKILL, training resumed {med[1]:.2f}s "
          f"after it, {med[2]:.0f} step(s) run again")


if __name__ == "__main__":
    main()
