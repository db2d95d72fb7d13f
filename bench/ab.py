"""Before and after: this checkout's step time against another checkout's, side by side.

    git worktree add /tmp/before <commit> && make -C /tmp/before setup
    python bench/ab.py --before /tmp/before [--rounds 5] [--steps 15] [--schedules gpipe,1f1b]
    python bench/ab.py --before /tmp/before --bits [--steps 4] [--schedules ...] [--replicas 2]

The job is bench/step_time.py's (8 x Linear(1024)+ReLU, batch 256 in 8
micro-batches, 2 stages, a core each), run by `gpipe-coordinator run` from each
checkout's own virtual environment, interleaved round by round; the figures are
medians over rounds of each run's median step time, and the ratio is before /
after (above 1: this checkout is faster).

`--bits`: no timing; each schedule's job, AdamW, trained once by each checkout,
and the final weights (model.safetensors) compared bit for bit: an engine
change that claims to leave the math alone must give the same bits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import BATCH, CHUNKS, DEPTH, STAGES, VIRTUAL, WIDTH, env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run(checkout: Path, schedule: str, steps: int, tmp: Path, replicas: int = 1, optimizer: str = "sgd") -> float:
    """The median step time of the job under `checkout`'s gpipe (its weights left in tmp/ab-SCHEDULE)."""
    virtual = 2 if schedule in VIRTUAL else 1  # model chunks per worker, as bench/step_time.py
    spec = {
        "name": f"ab-{schedule}", "model": {"factory": "mlp", "args": {"width": WIDTH, "depth": DEPTH, "head": False}},
        "stages": STAGES, "replicas": replicas, "chunks": CHUNKS // replicas, "schedule": schedule,
        "virtual_stages": virtual, "balance": [DEPTH // (STAGES * virtual)] * (STAGES * virtual),
        "data": {"factory": "random_regression", "args": {"n": BATCH, "in_features": WIDTH, "out_features": WIDTH},
                 "batch_size": BATCH},
        "loss": "mse", "optimizer": {"name": optimizer, "lr": 1e-3}, "steps": steps + 3,
    }
    job = tmp / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec))
    e = env()
    e.pop("PYTHONPATH", None)  # each checkout imports its own gpipe, from its own environment
    subprocess.run([str(checkout / ".venv/bin/gpipe-coordinator"), "run", str(job), "--state-dir", str(tmp),
                    "--no-progress"], env=e, cwd=checkout, check=True, capture_output=True, timeout=600)
    lines = (tmp / spec["name"] / "metrics.jsonl").read_text().splitlines()
    return statistics.median(json.loads(x)["step_time_s"] for x in lines[3:])


def same_bits(before: Path, schedules: list[str], steps: int, replicas: int) -> bool:
    """Train each schedule's job with each checkout and compare the final weights bit for bit; True if all equal."""
    import torch
    from safetensors.torch import load_file

    same = True
    for schedule in schedules:
        with tempfile.TemporaryDirectory() as b, tempfile.TemporaryDirectory() as a:
            run(before, schedule, steps, Path(b), replicas, "adamw")
            run(ROOT, schedule, steps, Path(a), replicas, "adamw")
            wb, wa = (load_file(str(Path(d) / f"ab-{schedule}" / "model.safetensors")) for d in (b, a))
        differ = [k for k in wa if k not in wb or not torch.equal(wa[k], wb[k])]
        same = same and not differ and set(wa) == set(wb)
        print(f"{schedule}, {replicas} replica(s): " + ("the same bits" if not differ else
              f"{len(differ)} of {len(wa)} tensors differ, by up to "
              f"{max((wa[k] - wb[k]).abs().max().item() for k in differ if k in wb):.3g}"))
    return same


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True, help="another checkout, set up (make setup)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated, as in a job spec")
    ap.add_argument("--bits", action="store_true", help="compare the final weights bit for bit instead of timing")
    ap.add_argument("--replicas", type=int, default=1, help="with --bits: replicas of the 2 stages")
    a = ap.parse_args()
    schedules = a.schedules.split(",")
    if a.bits:
        sys.exit(0 if same_bits(a.before.resolve(), schedules, a.steps, a.replicas) else 1)
    runs = {f"{who} {schedule}": (path, schedule) for schedule in schedules
            for who, path in (("before", a.before.resolve()), ("after", ROOT))}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(a.rounds):
        for name, (path, schedule) in runs.items():
            with tempfile.TemporaryDirectory() as d:
                times[name].append(run(path, schedule, a.steps, Path(d)))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()),
              file=sys.stderr, flush=True)
    print(f"\n{STAGES} stages, {CHUNKS} micro-batches, batch {BATCH}, {DEPTH} x Linear({WIDTH})+ReLU; "
          f"median of {a.rounds} rounds")
    print(f"{'run':24} {'step ms':>8}")
    for name, ts in times.items():
        print(f"{name:24} {statistics.median(ts) * 1e3:8.1f}")
    for schedule in schedules:
        before, after = statistics.median(times[f"before {schedule}"]), statistics.median(times[f"after {schedule}"])
        print(f"{schedule}: before / after {before / after:.3f}")


if __name__ == "__main__":
    main()
