"""Data parallelism against pipelining: the speed-up of 2 replicas x 1 stage and of 1 replica x 2 stages
over one process, for the same batch.

    python bench/replicas.py [--rounds 3] [--steps 15]

The model and batch are bench/step_time.py's: 8 x (Linear(1024)+ReLU), batch
256 as 8 micro-batches of 32, one thread per worker, each pinned to its own
core. "One process" does the 8 micro-batches on one core; 1 replica x 2 stages
pipelines them over 2 workers; 2 replicas x 1 stage gives each worker a shard
of 4 micro-batches, and the two sum their gradients (32 MiB a step) with
gloo's all-reduce, started during the backward. Each round runs every
contender once, interleaved; the figures are medians over rounds of each
run's median step time. The ideal speed-ups: 2 for 2 replicas, P*M/(M+P-1) =
1.778 for 2 stages.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import BATCH, CHUNKS, DEPTH, WIDTH, run_gpipe, run_single  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args()
    contenders = {
        "one process": (lambda tmp: run_single(a.steps), 1.0),
        "2 replicas x 1 stage": (lambda tmp: run_gpipe("gpipe", a.steps, tmp, stages=1, replicas=2), 2.0),
        "1 replica x 2 stages": (lambda tmp: run_gpipe("gpipe", a.steps, tmp, stages=2), 2 * CHUNKS / (CHUNKS + 1)),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    waits: list[float] = []  # 2 replicas: the median wait for the gradient sums after the backward, per run
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for name, (fn, _) in contenders.items():
                times[name].append(fn(Path(d)))
            lines = (Path(d) / "bench-gpipe-2x1" / "metrics.jsonl").read_text().splitlines()[3:]
            waits.append(statistics.median(max(x["reduce_s"] for x in json.loads(m)["replicas"]) for m in lines))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()),
                  file=sys.stderr, flush=True)
    base = statistics.median(times["one process"])
    print(f"\nbatch {BATCH} in {CHUNKS} micro-batches, {DEPTH} x Linear({WIDTH})+ReLU, one core per worker; "
          f"median of {a.rounds} rounds")
    print(f"{'contender':24} {'step ms':>8} {'speed-up':>9} {'ideal':>6} {'of ideal':>9}")
    for name, ts in times.items():
        t, ideal = statistics.median(ts), contenders[name][1]
        print(f"{name:24} {t * 1e3:8.1f} {base / t:9.3f} {ideal:6.3f} {base / t / ideal:9.3f}")
    print(f"2 replicas: waiting for the gradient sums after the backward {statistics.median(waits) * 1e3:.1f} ms "
          "a step (the all-reduce's part that the backward did not hide)")


if __name__ == "__main__":
    main()
