"""Before and after: this checkout's step time against another checkout's, side by side.

    git worktree add /tmp/before <commit> && make -C /tmp/before setup
    python bench/ab.py --before /tmp/before [--rounds 5] [--steps 15] [--schedules gpipe,1f1b]

The job is bench/step_time.py's (8 x Linear(1024)+ReLU, batch 256 in 8
micro-batches, 2 stages, a core each), run by `gpipe-coordinator run` from each
checkout's own virtual environment, interleaved round by round; the figures are
medians over rounds of each run's median step time, and the ratio is before /
after (above 1: this checkout is faster).
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


def run(checkout: Path, schedule: str, steps: int, tmp: Path) -> float:
    """The median step time of the job under `checkout`'s gpipe."""
    virtual = 2 if schedule in VIRTUAL else 1  # model chunks per worker, as bench/step_time.py
    spec = {
        "name": f"ab-{schedule}", "model": {"factory": "mlp", "args": {"width": WIDTH, "depth": DEPTH, "head": False}},
        "stages": STAGES, "chunks": CHUNKS, "schedule": schedule, "virtual_stages": virtual,
        "balance": [DEPTH // (STAGES * virtual)] * (STAGES * virtual),
        "data": {"factory": "random_regression", "args": {"n": BATCH, "in_features": WIDTH, "out_features": WIDTH},
                 "batch_size": BATCH},
        "loss": "mse", "optimizer": {"name": "sgd", "lr": 1e-3}, "steps": steps + 3,
    }
    job = tmp / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec))
    e = env()
    e.pop("PYTHONPATH", None)  # each checkout imports its own gpipe, from its own environment
    subprocess.run([str(checkout / ".venv/bin/gpipe-coordinator"), "run", str(job), "--state-dir", str(tmp),
                    "--no-progress"], env=e, cwd=checkout, check=True, capture_output=True, timeout=600)
    lines = (tmp / spec["name"] / "metrics.jsonl").read_text().splitlines()
    return statistics.median(json.loads(x)["step_time_s"] for x in lines[3:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True, help="another checkout, set up (make setup)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated, as in a job spec")
    a = ap.parse_args()
    schedules = a.schedules.split(",")
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
