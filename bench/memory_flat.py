"""A long run's memory: each worker's peak and resident memory at step 5 and at the end, and their ratio.

    python bench/memory_flat.py                       # 300 steps of a GPT-2 token job: a few minutes
    python bench/memory_flat.py --steps 40 --every 10 --curve

A GPT-2 (the vocabulary of GPT-2's tokenizer, 50257, so that its embedding, head and logits are the large
tensors of a language model; 2 blocks a stage, width 128) on random tokens, 2 stages, 1f1b, AdamW, clipping,
an evaluation and a checkpoint every `--every` steps, through `run`. Each step's metrics line has, per worker,
`peak_memory_bytes` (its process's resident peak so far: VmHWM) and `rss_bytes` (its resident memory at the
step's end). The target (issue 60): every worker's peak after warm-up (step 5) within 5% of its value at step
5, to the run's end. `--curve` prints every step's figures too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WARM = 5  # the steps a worker's memory settles in (the optimizer's state appears after the first)
TARGET = 0.05
MIB = 2**20


def spec_of(steps: int, every: int, vocab: int, seq_len: int, batch: int, shard: bool) -> dict[str, Any]:
    return {
        "name": "flat", "seed": 0, "stages": 2, "replicas": 2 if shard else 1, "chunks": 4, "schedule": "1f1b",
        "steps": steps, "log_every": 1,
        "model": {"factory": "hf:gpt2", "args": {"vocab": vocab, "width": 128, "layers": 4, "heads": 4,
                                                 "positions": seq_len},
                  "split_points": ["transformer.h.2"]},
        "data": {"factory": "tokens", "args": {"path": "data/train.bin", "seq_len": seq_len, "dtype": "uint16"},
                 "batch_size": batch, "shuffle": True},
        "eval": {"data": {"factory": "tokens", "args": {"path": "data/val.bin", "seq_len": seq_len,
                                                        "dtype": "uint16"}, "batch_size": batch},
                 "every": every, "batches": 2},
        "loss": "cross_entropy",
        "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01, **({"shard": True} if shard else {})},
        "lr_schedule": {"name": "cosine", "warmup_steps": 10, "min_lr": 1e-4},
        "clip_grad_norm": 1.0, "checkpoint_every": every,
    }


def job_folder(folder: Path, vocab: int) -> None:
    """The job's model code (examples/hf.py, which imports examples/charlm.py) and random token files."""
    import numpy as np

    (folder / "data").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, size=1_000_000, dtype=np.uint16).tofile(folder / "data" / "train.bin")
    rng.integers(0, vocab, size=50_000, dtype=np.uint16).tofile(folder / "data" / "val.bin")
    for name in ("hf.py", "charlm.py"):
        (folder / name).write_text((ROOT / "examples" / name).read_text())


def run(spec: dict[str, Any], folder: Path) -> tuple[dict[int, list[tuple[int, int]]], dict[int, int], float]:
    """Per rank, each step's (peak, rss) in bytes; plan.json's predicted peaks; the run's seconds."""
    import yaml

    job = folder / "flat.yaml"
    job.write_text(yaml.safe_dump(spec))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "run", str(job), "--state-dir",
                    str(folder / "state"), "--no-progress"], env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True,
                   capture_output=True, timeout=3600, cwd=folder)
    seconds = time.perf_counter() - t0
    out = folder / "state" / "flat"
    steps: dict[int, list[tuple[int, int]]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        for s in json.loads(line).get("stages", []):
            steps.setdefault(s["rank"], []).append((s["peak_memory_bytes"], s.get("rss_bytes") or 0))
    workers = json.loads((out / "plan.json").read_text())["workers"]
    return steps, {w["rank"]: w.get("predicted_peak_bytes") or 0 for w in workers}, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25, help="an evaluation and a checkpoint every this many steps")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--shard", action="store_true", help="2 replicas x 2 stages, optimizer.shard")
    ap.add_argument("--curve", action="store_true", help="every step's peak and resident memory too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="memory-flat-") as d:
        folder = Path(d)
        job_folder(folder, args.vocab)
        spec = spec_of(args.steps, args.every, args.vocab, args.seq_len, args.batch, args.shard)
        steps, predicted, seconds = run(spec, folder)
    print(f"GPT-2 (vocab {args.vocab}, width 128, 4 blocks) on tokens: {args.steps} steps of {args.batch} x "
          f"{args.seq_len} tokens, 4 micro-batches, 1f1b, {'2 replicas x ' if args.shard else ''}2 stages, AdamW"
          f"{', sharded' if args.shard else ''}; eval and checkpoint every {args.every}; {seconds:.0f} s")
    print(f"{'rank':>4} {'peak@5':>8} {'peak@end':>9} {'ratio':>6} {'rss@5':>8} {'rss@end':>8} {'ratio':>6} "
          f"{'worst peak/peak@5':>18} {'predicted':>10} {'pred/peak@end':>14}  MiB")
    ok = True
    for rank in sorted(steps):
        s = steps[rank]
        if len(s) <= WARM:
            print(f"{rank:>4} only {len(s)} steps")
            continue
        (p5, r5), (pe, re) = s[WARM - 1], s[-1]
        worst = max(p for p, _ in s[WARM - 1:]) / p5
        ok = ok and worst <= 1 + TARGET
        guess = predicted.get(rank, 0)
        print(f"{rank:>4} {p5 / MIB:>8.1f} {pe / MIB:>9.1f} {pe / p5:>6.3f} {r5 / MIB:>8.1f} {re / MIB:>8.1f} "
              f"{re / r5:>6.3f} {worst:>18.3f} {guess / MIB:>10.1f} {guess / pe if pe else 0:>14.3f}")
    print(f"target: every worker's peak after step {WARM} within {TARGET:.0%} of its value at step {WARM}: "
          f"{'met' if ok else 'missed'}")
    if args.curve:
        for rank in sorted(steps):
            print(f"rank {rank} peak/rss per step (MiB): " +
                  " ".join(f"{p / MIB:.0f}/{r / MIB:.0f}" for p, r in steps[rank]))


if __name__ == "__main__":
    main()
