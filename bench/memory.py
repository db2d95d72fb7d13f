"""Peak activation memory per worker: every schedule against 1f1b, and each activation-checkpoint mode.

    python bench/memory.py
    python bench/memory.py --workers 4 --schedules 1f1b,zbv,v-half,v-min,dualpipev --checkpoint never

The example Transformer LM (examples/charlm.yaml: 2 workers, 8 micro-batches of
4 sequences of 64 bytes; its 6 layers cut [3, 3], or into 4 model chunks
[2, 1, 1, 2] for interleaved-1f1b and the V schedules: zbv, v-half, v-min, dualpipev; 2 a worker). The figures are byte
counts of what each worker holds for its backward (autograd's saved tensors
and the stashed micro-batches; a worker's chunks are counted together), the
same on every run, so one run is enough.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
VIRTUAL = ("interleaved-1f1b", "zbv", "v-half", "v-min", "dualpipev")  # 2 model chunks a worker


def peaks(schedule: str, ckpt: str, tmp: Path, workers: int = 2) -> list[int]:
    spec = yaml.safe_load((ROOT / "examples/charlm.yaml").read_text())
    spec.update(name=f"{schedule}-{ckpt}", schedule=schedule, activation_checkpoint=ckpt, chunks=8, steps=2)
    if workers == 2:
        if schedule in VIRTUAL:
            spec.update(virtual_stages=2, balance=[2, 1, 1, 2])
    else:  # 4 layers a worker (the encoder and the decoder among them): 2 a model chunk on the V
        spec["model"]["args"]["layers"] = 4 * workers - 2
        spec.update(stages=workers, balance=[2] * (2 * workers) if schedule in VIRTUAL else [4] * workers,
                    **({"virtual_stages": 2} if schedule in VIRTUAL else {}))
    spec["model"]["args"]["dropout"] = 0.0
    job = tmp / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples")]))
    subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "run", str(job), "--state-dir", str(tmp),
                    "--no-progress"], env=env, check=True, capture_output=True, timeout=600)
    last = json.loads((tmp / spec["name"] / "metrics.jsonl").read_text().splitlines()[-1])
    by_rank = {s["rank"]: s["activation_peak_bytes"] for s in last["stages"]}  # a worker's chunks: one figure
    return [by_rank[r] for r in sorted(by_rank)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="stages; past 2, the LM has 4 layers a worker")
    ap.add_argument("--schedules", default=",".join(("gpipe", "1f1b", "zb-h1", *VIRTUAL)))
    ap.add_argument("--checkpoint", default="never,except_last,always")
    a = ap.parse_args()
    names, ckpts = a.schedules.split(","), a.checkpoint.split(",")
    for must in ("gpipe", "1f1b"):  # the ratios' bases
        if must not in names:
            names.insert(0, must)
    runs = {}
    with tempfile.TemporaryDirectory() as d:
        for schedule in names:
            for ckpt in ckpts if schedule != "gpipe" else sorted({"never", *ckpts}):
                runs[(schedule, ckpt)] = peaks(schedule, ckpt, Path(d), a.workers)
    base = runs[("gpipe", "never")]
    stages, chunks = len(base), 8
    print(f"example Transformer LM, {stages} stages, {chunks} micro-batches: peak activation MiB per stage "
          f"(and the ratio to gpipe + never)")
    for (schedule, ckpt), p in runs.items():
        cells = "  ".join(f"{b / 2**20:7.2f} ({b / base[k]:.3f})" for k, b in enumerate(p))
        print(f"{schedule:16} {ckpt:12} {cells}")
    bound = [(stages - k) / chunks for k in range(stages)]
    print(f"1f1b bound stages-k/chunks per stage: {bound}; always/never target: at most 0.40")
    for schedule in [n for n in names if n not in ("gpipe", "1f1b")]:
        for ckpt in ckpts:
            zb, one = max(runs[(schedule, ckpt)]), max(runs[("1f1b", ckpt)])
            target = {"zb-h1": " (target: at most 1.10)", "zbv": " (target: at most 1.10)",
                      # Qi et al. 2024: (P+2)//2 and (P+4)//3 stages' worth against 1f1b's P, P the workers
                      "v-half": f" (the paper's bound: {(stages + 2) // 2 / stages:.2f})",
                      "v-min": f" (the paper's bound: {(stages + 4) // 3 / stages:.2f})"}.get(schedule, "")
            print(f"{schedule} / 1f1b, the largest worker's peak, {ckpt}: {zb / one:.3f}{target}")


if __name__ == "__main__":
    main()
