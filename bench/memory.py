"""Peak activation memory per stage: gpipe against 1f1b and zb-h1, and each activation-checkpoint mode.

    python bench/memory.py

The example Transformer LM (examples/charlm.yaml: 2 stages, 8 micro-batches of
4 sequences of 64 bytes). The figures are byte counts of what each stage holds
for its backward (autograd's saved tensors and the stashed micro-batches), the
same on every run, so one run is enough.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def peaks(schedule: str, ckpt: str, tmp: Path) -> list[int]:
    spec = yaml.safe_load((ROOT / "examples/charlm.yaml").read_text())
    spec.update(name=f"{schedule}-{ckpt}", schedule=schedule, activation_checkpoint=ckpt, chunks=8, steps=2)
    spec["model"]["args"]["dropout"] = 0.0
    job = tmp / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples")]))
    subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli", "run", str(job), "--state-dir", str(tmp),
                    "--no-progress"], env=env, check=True, capture_output=True, timeout=600)
    last = json.loads((tmp / spec["name"] / "metrics.jsonl").read_text().splitlines()[-1])
    return [s["activation_peak_bytes"] for s in last["stages"]]


def main() -> None:
    runs = {}
    with tempfile.TemporaryDirectory() as d:
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            for ckpt in ("never", "except_last", "always"):
                runs[(schedule, ckpt)] = peaks(schedule, ckpt, Path(d))
    base = runs[("gpipe", "never")]
    stages, chunks = len(base), 8
    print(f"example Transformer LM, {stages} stages, {chunks} micro-batches: peak activation MiB per stage "
          f"(and the ratio to gpipe + never)")
    for (schedule, ckpt), p in runs.items():
        cells = "  ".join(f"{b / 2**20:7.2f} ({b / base[k]:.3f})" for k, b in enumerate(p))
        print(f"{schedule:6} {ckpt:12} {cells}")
    bound = [(stages - k) / chunks for k in range(stages)]
    print(f"1f1b bound stages-k/chunks per stage: {bound}; always/never target: at most 0.40")
    for ckpt in ("never", "except_last", "always"):
        zb, one = max(runs[("zb-h1", ckpt)]), max(runs[("1f1b", ckpt)])
        print(f"zb-h1 / 1f1b, the largest stage's peak, {ckpt}: {zb / one:.3f} (target: at most 1.10)")


if __name__ == "__main__":
    main()
