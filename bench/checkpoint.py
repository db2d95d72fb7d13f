"""Checkpoints: how fast they reach the disk, and how long they stall training.

    python bench/checkpoint.py --rounds 3

(a) Save throughput against size: the coordinator's writer (coordinator/outputs/checkpoint.py:
    stream each tensor to disk and hash it in one pass, fsync, manifest) against
    safetensors.torch.save_file plus an fsync (no hash, no manifest), on the same
    tensors, interleaved, the median of --rounds.
(b) Stall per checkpoint: `gpipe-coordinator run` of an MLP with sgd+momentum on
    2 stages, once with a checkpoint every 5 steps and once with one at the end
    only, interleaved. In each run, the time its steps took beyond its median
    step; the stall is the checkpointed run's excess less the baseline's, per
    extra checkpoint (a difference within runs, so the drift between runs
    cancels). Next to it: what the stages spent copying their state out
    (snapshot_s in metrics.jsonl) and the write time in the background.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpipe.coordinator.outputs import checkpoint  # noqa: E402
from gpipe.state import StageState  # noqa: E402


def tensors_of(mib: int) -> list[dict[str, torch.Tensor]]:
    """Two stages' worth of state (weights and momentum) totalling `mib` MiB, in 4 MiB-or-larger tensors."""
    per_stage = mib * 2**20 // 2 // 4  # float32 elements per stage
    n = max(1, per_stage // (1 << 20))
    g = torch.Generator().manual_seed(0)
    return [{f"model/{i}.weight": torch.randn(per_stage // n, generator=g) for i in range(n)} for _ in range(2)]


def save_ours(stages: list[dict[str, torch.Tensor]], root: Path, step: int) -> float:
    snap = checkpoint.Snapshot(step, [StageState(t, {"param_groups": []}) for t in stages], {"bench": True})
    t0 = time.perf_counter()
    checkpoint.write(root, snap)
    return time.perf_counter() - t0


def save_library(stages: list[dict[str, torch.Tensor]], root: Path, step: int) -> float:
    d = root / f"lib-{step}"
    d.mkdir(parents=True)
    t0 = time.perf_counter()
    for k, t in enumerate(stages):
        path = d / f"stage-{k}.safetensors"
        save_file(t, str(path))
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t0


def throughput(rounds: int, sizes: list[int]) -> None:
    print("(a) save throughput: MB/s (median of rounds), writer vs safetensors.save_file + fsync")
    print(f"{'MiB':>6} {'writer MB/s':>12} {'save_file MB/s':>15} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        step = 0
        for mib in sizes:
            stages = tensors_of(mib)
            nbytes = sum(t.numel() * 4 for s in stages for t in s.values())
            ours, lib = [], []
            for _ in range(rounds):
                step += 1
                ours.append(nbytes / save_ours(stages, root / "ours", step) / 1e6)
                lib.append(nbytes / save_library(stages, root / "lib", step) / 1e6)
                checkpoint.prune(root / "ours", 0)
                for x in (root / "lib").iterdir():
                    for f in x.iterdir():
                        f.unlink()
                    x.rmdir()
            a, b = statistics.median(ours), statistics.median(lib)
            print(f"{mib:>6} {a:>12.0f} {b:>15.0f} {a / b:>7.2f}")


def run_job(tmp: Path, name: str, width: int, every: int | None, steps: int) -> dict:
    spec = {
        "name": name, "model": {"factory": "mlp", "args": {"width": width, "depth": 6}},
        "stages": 2, "balance": "by_params", "chunks": 4,
        "data": {"factory": "random_regression", "args": {"n": 256, "in_features": width, "out_features": width},
                 "batch_size": 32},
        "loss": "mse", "optimizer": {"name": "sgd", "lr": 0.001, "momentum": 0.9}, "steps": steps,
        "checkpoint_every": every, "keep_checkpoints": 2,
    }
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "run", str(job), "--state-dir", str(tmp)],
                       env=env, capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise SystemExit(r.stderr)
    m = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    writes = [(float(a), float(b)) for a, b in re.findall(r"checkpoint step-\d+: ([\d.,]+) MiB in ([\d.]+)s",
                                                           r.stderr.replace(",", ""))]
    body = m[1:-1]  # the first step warms up; the last one ends with the final checkpoint in both runs
    times = [x["step_time_s"] for x in body]
    typical = statistics.median(times)
    return {
        "train_s": sum(times),
        "excess_s": sum(t - typical for t in times),  # time above this run's median step, whatever its cause
        "snapshot_s": [max(s.get("snapshot_s", 0.0) for s in x["stages"]) for x in body
                       if any("snapshot_s" in s for s in x["stages"])],
        "writes": writes,
        "checkpoints": sum(1 for x in body if any("snapshot_s" in s for s in x["stages"])),
    }


def stall(rounds: int, widths: list[int], steps: int) -> None:
    print(f"\n(b) stall per checkpoint: {steps} steps, a checkpoint every 5 against one at the end (median of rounds)")
    print(f"{'width':>6} {'ckpt MiB':>9} {'write s':>8} {'MB/s':>6} {'copy-out ms':>12} {'stall ms':>9} "
          f"{'step ms':>8}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for width in widths:
            stalls, copies, writes, steps_ms = [], [], [], []
            for r in range(rounds):
                base = run_job(tmp, f"base-{width}-{r}", width, None, steps)
                ck = run_job(tmp, f"ckpt-{width}-{r}", width, 5, steps)
                extra = ck["checkpoints"] - base["checkpoints"]
                # Steps take longer than their run's median by chance too: the baseline's excess is that.
                stalls.append((ck["excess_s"] - base["excess_s"]) / extra)
                copies.append(statistics.median(ck["snapshot_s"]))
                writes += ck["writes"]
                steps_ms.append(base["train_s"] / (steps - 2) * 1e3)
            mib = statistics.median(w[0] for w in writes)
            wsec = statistics.median(w[1] for w in writes)
            print(f"{width:>6} {mib:>9.1f} {wsec:>8.3f} {mib * 2**20 / wsec / 1e6:>6.0f} "
                  f"{statistics.median(copies) * 1e3:>12.1f} {statistics.median(stalls) * 1e3:>9.1f} "
                  f"{statistics.median(steps_ms):>8.1f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sizes", default="16,64,256,1024", help="MiB per checkpoint for (a)")
    p.add_argument("--widths", default="512,1024,2048", help="MLP widths for (b)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--only", choices=["a", "b"], help="run one part only")
    a = p.parse_args()
    if a.only != "b":
        throughput(a.rounds, [int(x) for x in a.sizes.split(",")])
    if a.only != "a":
        stall(a.rounds, [int(x) for x in a.widths.split(",")], a.steps)


if __name__ == "__main__":
    main()
