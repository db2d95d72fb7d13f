"""The optimizer state sharded across replicas (`optimizer.shard`) against unsharded: each worker's peak and the
step time, side by side in one run.

    python bench/sharding.py [--width 6144] [--depth 4] [--rounds 3] [--steps 6]

An AdamW MLP (`depth` Linear+ReLU blocks of `width`, and a head) on 2 replicas x 2 stages, run through `run`,
sharded and unsharded in turn, `rounds` times each (interleaved). Per worker: the peak resident memory of its
process (each step's `peak_memory_bytes`, the last step's), the median over rounds; the step time: the median
of every round's steps after the first two. The target (issue 37): the sharded peak at least 0.6 x (half the
stage's moments) below the unsharded one, the step at most 5% longer. Beside each measured peak, plan.json's
prediction for that worker (gpipe.memory.model) and its ratio to the measured peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def spec_of(width: int, depth: int, steps: int, shard: bool, name: str) -> dict[str, Any]:
    return {
        "name": name, "seed": 0, "stages": 2, "replicas": 2, "chunks": 4, "steps": steps, "schedule": "1f1b",
        "model": {"factory": "mlp", "args": {"width": width, "depth": depth}},
        "data": {"factory": "random_regression", "args": {"n": 64, "in_features": width, "out_features": width},
                 "batch_size": 16},
        "loss": "mse", "optimizer": {"name": "adamw", "lr": 1e-4, "shard": shard},
    }


def run(spec: dict[str, Any], tmp: Path) -> tuple[list[int], list[float], dict[str, Any]]:
    """(each rank's peak bytes at the last step, the step times after the first two, plan.json)."""
    job = tmp / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "run", str(job), "--state-dir", str(tmp),
                    "--no-progress"], env=env, check=True, capture_output=True, timeout=900)
    out = tmp / spec["name"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    peaks = {s["rank"]: s["peak_memory_bytes"] for s in lines[-1]["stages"]}
    plan = json.loads((out / "plan.json").read_text())
    return [peaks[r] for r in sorted(peaks)], [m["step_time_s"] for m in lines[2:]], plan


def predicted(plan: dict[str, Any], rank: int) -> float:
    """plan.json's predicted peak of worker `rank` (NaN where the plan has none)."""
    return float(next((w.get("predicted_peak_bytes") or "nan" for w in plan["workers"] if w["rank"] == rank), "nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=6144)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    results: dict[bool, list[tuple[list[int], list[float], dict[str, Any]]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for shard in (False, True):
                name = f"{'shard' if shard else 'whole'}-{r}"
                results[shard].append(run(spec_of(args.width, args.depth, args.steps, shard, name), Path(d)))
    plan = results[False][0][2]
    ranks = len(results[False][0][0])
    params = [s["parameters"] for s in plan["stages"]]
    print(f"AdamW MLP width {args.width} depth {args.depth}, 2 replicas x 2 stages, {args.rounds} rounds "
          f"interleaved, {args.steps} steps each")
    print(f"{'rank':>4} {'stage':>5} {'unsharded MiB':>14} {'sharded MiB':>12} {'saved MiB':>10} "
          f"{'half the moments MiB':>21} {'saved/(half)':>13} {'predicted: unsharded':>21} {'sharded':>8}")
    for rank in range(ranks):
        whole = statistics.median(res[0][rank] for res in results[False])
        part = statistics.median(res[0][rank] for res in results[True])
        stage = rank % 2
        half = params[stage] * 8 / 2 if params[stage] else float("nan")  # adamw: two fp32 moments, 8 B a parameter
        # plan.json's prediction for the rank (gpipe.memory.model), against the measured peak
        guess = [predicted(results[shard][0][2], rank) for shard in (False, True)]
        print(f"{rank:>4} {stage:>5} {whole / 2**20:>14.1f} {part / 2**20:>12.1f} {(whole - part) / 2**20:>10.1f} "
              f"{half / 2**20:>21.1f} {(whole - part) / half:>13.2f} {guess[0] / 2**20:>15.1f} "
              f"({guess[0] / whole:.2f}) {guess[1] / 2**20:>8.1f} ({guess[1] / part:.2f})")
    step = {shard: statistics.median(t for res in results[shard] for t in res[1]) for shard in (False, True)}
    rounds = [statistics.median(s[1]) / statistics.median(w[1]) for w, s in zip(results[False], results[True],
                                                                                strict=True)]
    print(f"step time: unsharded {step[False] * 1e3:.1f} ms, sharded {step[True] * 1e3:.1f} ms, "
          f"ratio {step[True] / step[False]:.3f} (per round: {', '.join(f'{x:.3f}' for x in rounds)})")
    print("targets: saved/(half the moments) >= 0.6; step ratio <= 1.05")


if __name__ == "__main__":
    main()
