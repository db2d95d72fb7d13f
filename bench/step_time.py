"""Step time: gpipe against torch.distributed.pipelining and one process, side by side.

    python bench/step_time.py [--rounds 3] [--steps 20]

The model is 8 x (Linear(1024)+ReLU), batch 256 in 8
micro-batches, 2 stages, one thread per stage (each process pinned to its own
core). Each round runs every contender once, interleaved, and the figures are
medians over rounds of each run's median step time, since absolute times on
these machines drift twofold between runs. Ratios are speed-ups over one
process doing the same micro-batched work; the ideal is P*M/(M+P-1).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WIDTH, DEPTH, BATCH, CHUNKS, STAGES = 1024, 8, 256, 8, 2


def env() -> dict[str, str]:
    # Every contender runs with the malloc settings gpipe's workers use, so the
    # ratios compare the engines, not the allocator.
    from gpipe.worker.agent import MALLOC_ENV

    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **MALLOC_ENV)


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def run_single(steps: int) -> float:
    cmd = [sys.executable, str(ROOT / "bench/_peers.py"), "single", *map(str, (WIDTH, DEPTH, BATCH, CHUNKS, steps))]
    out = subprocess.run(["taskset", "-c", str(cores()[0]), *cmd], env=env(), capture_output=True, text=True,
                         check=True, timeout=600)
    return float(out.stdout.strip().splitlines()[-1])


def run_pipelining(schedule: str, steps: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(STAGES):
        cmd = [sys.executable, str(ROOT / "bench/_peers.py"), "pipelining", schedule, str(rank),
               *map(str, (WIDTH, DEPTH, BATCH, CHUNKS, steps, port))]
        core = cores()[rank % len(cores())]
        procs.append(subprocess.Popen(["taskset", "-c", str(core), *cmd], env=env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(f"torch.distributed.pipelining failed: {err[-2000:]}")
    return float(outs[0][0].strip().splitlines()[-1])


def run_gpipe(schedule: str, steps: int, tmp: Path, stages: int = STAGES, replicas: int = 1) -> float:
    """gpipe's median step time; with `replicas`, each replica runs CHUNKS / replicas micro-batches of the batch."""
    spec = {
        "name": f"bench-{schedule}-{replicas}x{stages}",
        "model": {"factory": "mlp", "args": {"width": WIDTH, "depth": DEPTH, "head": False}},
        "stages": stages, "replicas": replicas, "chunks": CHUNKS // replicas, "schedule": schedule,
        "balance": [DEPTH // stages] * stages,
        "data": {"factory": "random_regression",
                 "args": {"n": BATCH, "in_features": WIDTH, "out_features": WIDTH}, "batch_size": BATCH},
        "loss": "mse", "optimizer": {"name": "sgd", "lr": 1e-3}, "steps": steps + 3,
    }
    job = tmp / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec))
    subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli", "run", str(job), "--state-dir", str(tmp),
                    "--no-progress"], env=env(), check=True, capture_output=True, timeout=600)
    lines = (tmp / spec["name"] / "metrics.jsonl").read_text().splitlines()
    return statistics.median(json.loads(x)["step_time_s"] for x in lines[3:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    contenders = {
        "one process": lambda tmp: run_single(a.steps),
        "gpipe gpipe": lambda tmp: run_gpipe("gpipe", a.steps, tmp),
        "gpipe 1f1b": lambda tmp: run_gpipe("1f1b", a.steps, tmp),
        "torch.pipelining ScheduleGPipe": lambda tmp: run_pipelining("gpipe", a.steps),
        "torch.pipelining Schedule1F1B": lambda tmp: run_pipelining("1f1b", a.steps),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for name, fn in contenders.items():
                times[name].append(fn(Path(d)))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()),
                  file=sys.stderr, flush=True)
    ideal = STAGES * CHUNKS / (CHUNKS + STAGES - 1)
    base = statistics.median(times["one process"])
    print(f"\n{STAGES} stages, {CHUNKS} micro-batches, batch {BATCH}, {DEPTH} x Linear({WIDTH})+ReLU; "
          f"ideal speed-up {ideal:.3f}; median of {a.rounds} rounds")
    print(f"{'contender':34} {'step ms':>8} {'speed-up':>9} {'of ideal':>9}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:34} {t * 1e3:8.1f} {base / t:9.3f} {base / t / ideal:9.3f}")
    for ours, theirs in (("gpipe gpipe", "torch.pipelining ScheduleGPipe"),
                         ("gpipe 1f1b", "torch.pipelining Schedule1F1B")):
        print(f"{ours} / {theirs}: {statistics.median(times[theirs]) / statistics.median(times[ours]):.3f}x")


if __name__ == "__main__":
    main()
