"""serve's start and memory with a long job history: a big metrics.jsonl against an empty one.

A job record (SUCCEEDED) with a metrics.jsonl of --mib MiB is put in a state
dir, and serve is started on it; the same with an empty metrics file. Each
round starts both, interleaved; the figures are medians: the time from start
to "serving" and serve's peak resident memory (VmHWM) once it serves, and the
time to stream the whole history back through WatchJob.

    python bench/serve_memory.py --mib 200 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPEC = """name: {name}
model: {{factory: mlp, args: {{width: 16, depth: 3}}}}
stages: 2
data: {{factory: random_regression, args: {{n: 40, in_features: 16, out_features: 16}}, batch_size: 8}}
loss: mse
optimizer: {{name: sgd, lr: 0.05}}
steps: {steps}
"""


def make_state(root: Path, name: str, mib: int) -> int:
    """A state dir holding one finished job whose metrics.jsonl is about `mib` MiB; returns its line count."""
    from gpipe.service.job_records import JobRecord, JobState, StateChange

    out = root / name
    out.mkdir(parents=True)
    line = json.dumps({"step": 0, "loss": 1.2345678, "lr": 0.05, "step_time_s": 0.0123, "samples_per_s": 650.4,
                       "bubble_fraction": 0.33, "attempt": 1, "stages": [
                           {"stage": k, "forward_s": 0.001, "backward_s": 0.002, "idle_s": 0.0005,
                            "peak_mib": 12.5} for k in range(2)]})
    lines = mib * 2**20 // (len(line) + 1) if mib else 0
    with (out / "metrics.jsonl").open("w") as f:
        for s in range(lines):
            f.write(line.replace('"step": 0', f'"step": {s}', 1) + "\n")
    t = time.time()
    job = JobRecord(name=name, spec_yaml=SPEC.format(name=name, steps=max(1, lines)), steps=max(1, lines),
                    state=JobState.SUCCEEDED, steps_done=lines, output_dir=str(out), attempts=1, history=[
                        StateChange(JobState.PENDING, t), StateChange(JobState.RUNNING, t),
                        StateChange(JobState.SUCCEEDED, t)])
    (out / "job.json").write_text(json.dumps(job.to_json()))
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vm(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(state: Path, name: str) -> tuple[float, float, float]:
    """(seconds to serving, peak RSS MiB once serving, seconds to stream the history back)."""
    port = free_port()
    log = state.parent / f"{state.name}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.monotonic()
    with log.open("w") as f:
        p = subprocess.Popen([sys.executable, "-m", "gpipe.coordinator.cli.main", "serve", "--port", str(port),
                              "--state-dir", str(state)], stdout=f, stderr=f, env=env, start_new_session=True)
    try:
        while "coordinator serving on" not in log.read_text():
            if p.poll() is not None or time.monotonic() - t0 > 300:
                raise SystemExit(f"serve did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.02)
        started = time.monotonic() - t0
        peak = vm(p.pid, "VmHWM")
        t1 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "logs", name, "--coordinator",
                            f"127.0.0.1:{port}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, timeout=600)
        if r.returncode:
            raise SystemExit(f"logs failed: {r.stderr[-2000:]}")
        return started, peak, time.monotonic() - t1
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        big, empty = Path(d) / "big", Path(d) / "empty"
        lines = make_state(big, "history", a.mib)
        make_state(empty, "history", 0)
        size = (big / "history" / "metrics.jsonl").stat().st_size / 2**20
        got: dict[str, list[tuple[float, float, float]]] = {"empty": [], "big": []}
        for _ in range(a.rounds):
            got["empty"].append(one(empty, "history"))
            got["big"].append(one(big, "history"))
    print(f"metrics.jsonl: {size:.0f} MiB, {lines:,} lines; medians of {a.rounds} rounds\n")
    print("| metrics.jsonl | start s | peak RSS MiB | stream all s |\n| --- | ---: | ---: | ---: |")
    for k, label in (("empty", "empty"), ("big", f"{size:.0f} MiB")):
        s, m, w = (statistics.median(x[i] for x in got[k]) for i in range(3))
        print(f"| {label} | {s:.2f} | {m:.0f} | {w:.2f} |")


if __name__ == "__main__":
    main()
