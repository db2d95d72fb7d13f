"""How long a client verb takes to start, beside torch's own import, measured in one run.

    python bench/client_start.py [--rounds 5]

Each contender is a whole process, from exec to exit, run interleaved with the others over several rounds;
the figure is the median. The client verbs talk to a port where nothing listens (127.0.0.1:9), so what is
timed is the process's start, its imports and its one-line answer, not a server:

- `python -c "import torch"`, the cost every client verb paid before gpipe.errors became a leaf;
- `python -c pass`, the interpreter alone;
- `gpipe-coordinator --help`, `status NAME`, `list`, `logs NAME`, and `submit job.yaml` (a spec parsed and its
  folder packed before the refusal).

Target (docs: the namespace issue): every verb within 0.5 s on a quiet machine, and far below torch's import.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NOWHERE = ["--coordinator", "127.0.0.1:9"]
JOB = """name: light
model: {factory: mlp, args: {width: 16, depth: 3}}
stages: 2
data: {factory: random_regression, args: {n: 40, in_features: 16, out_features: 16}, batch_size: 8}
optimizer: {name: sgd, lr: 0.05}
steps: 2
"""


def contenders(folder: Path) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "gpipe.coordinator.cli.main"]
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        'python -c "import torch"': [sys.executable, "-c", "import torch"],
        "--help": [*cli, "--help"],
        "status NAME": [*cli, "status", "light", *NOWHERE],
        "list": [*cli, "list", *NOWHERE],
        "logs NAME": [*cli, "logs", "light", *NOWHERE],
        "submit job.yaml": [*cli, "submit", str(folder / "job.yaml"), *NOWHERE],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        (folder / "job.yaml").write_text(JOB)
        runs = contenders(folder)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for name, cmd in runs.items():
                t = time.perf_counter()
                subprocess.run(cmd, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
                times[name].append(time.perf_counter() - t)
    torch_s = statistics.median(times['python -c "import torch"'])
    print(f"{'contender':28} {'median s':>9} {'of torch':>9}   (rounds: {args.rounds})")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:28} {m:9.3f} {m / torch_s:9.2f}")


if __name__ == "__main__":
    main()
