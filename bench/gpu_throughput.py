"""Tokens/s on one GPU: gpipe against plain PyTorch training of the same model, side by side.

    python bench/gpu_throughput.py pipeline [--rounds 3]   # 2-stage gpipe.Pipeline vs plain one-GPU training
    python bench/gpu_throughput.py run [--steps 40]        # `gpipe-coordinator run`, one stage, vs the same
    python bench/gpu_throughput.py pipeline --deterministic   # plain and the 2-stage Pipeline, deterministic

The model is GPT-2-small-sized: examples/charlm.py's transformer_lm with d_model 768, 12 heads, ff 3072 and
12 layers (85 M parameters), batch 32 x 256 tokens, bf16 autocast, AdamW. `pipeline`: the contenders run
interleaved for --rounds rounds and each figure is the median (plain on the whole batch, plain on the same
8 micro-batches, gpipe.Pipeline with one stage, with 2 stages on the GPU: 1f1b and gpipe). `run`: the job's
median tokens/s from its metrics.jsonl (after its first 5 steps) against plain training in this process.
Each prints one `RESULT PASS|FAIL name detail` line (make gpu-check collects them). GPU_CHECK_QUICK=1: tiny
sizes, for a dry run on a CPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import charlm  # noqa: E402  (examples/)

import gpipe  # noqa: E402
from gpipe.losses import cross_entropy  # noqa: E402

QUICK = os.environ.get("GPU_CHECK_QUICK") == "1"
DEV = "cuda:0" if torch.cuda.is_available() else "cpu"
CUDA = DEV.startswith("cuda")
ARGS = dict(d_model=64, heads=4, ff=128, layers=2, dropout=0.1) if QUICK else \
    dict(d_model=768, heads=12, ff=3072, layers=12, dropout=0.1)
BATCH, SEQ, CHUNKS = (8, 32, 4) if QUICK else (32, 256, 8)


def say(status: str, name: str, detail: str) -> None:
    print(f"RESULT {status} {name} {detail}", flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (BATCH, SEQ), generator=g).to(DEV), \
        torch.randint(0, 256, (BATCH, SEQ), generator=g).to(DEV)


class Plain:
    """Plain one-GPU training: `micro` micro-batches a step, their losses weighted, bf16 autocast."""

    def __init__(self, base: torch.nn.Module, micro: int):
        self.model, self.micro = copy.deepcopy(base).to(DEV), micro
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for xm, ym in zip(x.tensor_split(self.micro), y.tensor_split(self.micro), strict=True):
            with torch.autocast(DEV.split(":")[0], dtype=torch.bfloat16, enabled=CUDA):
                out = self.model(xm)
            (cross_entropy(out.float(), ym) * (xm.size(0) / x.size(0))).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class Piped:
    """gpipe.Pipeline on this GPU: `stages` stages (each on its own CUDA stream)."""

    def __init__(self, base: torch.nn.Module, stages: int, schedule: str):
        self.model = copy.deepcopy(base)
        n = len(self.model)
        balance = [n] if stages == 1 else [n // 2, n - n // 2]
        self.pipe = gpipe.Pipeline(self.model, balance=balance, chunks=CHUNKS, schedule=schedule,
                                   devices=[DEV] * stages, precision="bf16" if CUDA else "fp32", timeout_s=120)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pipe.step(x, y, cross_entropy)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        self.pipe.close()


def timed(contender: Plain | Piped, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    """Tokens/s of `steps` steps, after one warm-up step."""
    contender.step(x, y)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        contender.step(x, y)
    sync()
    return BATCH * SEQ * steps / (time.perf_counter() - t)


def pipeline(rounds: int, steps: int, deterministic: bool = False) -> None:
    torch.manual_seed(0)
    base = charlm.transformer_lm(**ARGS)
    params = sum(p.numel() for p in base.parameters())
    x, y = batch()
    makers = {"plain, whole batch": lambda: Plain(base, 1), f"plain, {CHUNKS} micro-batches": lambda: Plain(base, CHUNKS),
              "Pipeline, 1 stage": lambda: Piped(base, 1, "gpipe"),
              "Pipeline, 2 stages, 1f1b": lambda: Piped(base, 2, "1f1b"),
              "Pipeline, 2 stages, gpipe": lambda: Piped(base, 2, "gpipe")}
    if deterministic:  # this process's setting, for every contender: the figures to hold against a run without
        from gpipe import determinism

        determinism.enable()
        makers = {k: v for k, v in makers.items() if k in (f"plain, {CHUNKS} micro-batches", "Pipeline, 2 stages, 1f1b")}
    rates: dict[str, list[float]] = {k: [] for k in makers}
    peaks: dict[str, float] = {}
    for _ in range(rounds):
        for name, make in makers.items():
            if CUDA:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            c = make()
            try:
                rates[name].append(timed(c, x, y, steps))
            finally:
                c.close()
            if CUDA:
                peaks[name] = torch.cuda.max_memory_allocated() / 2**30
            del c
    median = {k: statistics.median(v) for k, v in rates.items()}
    for name, r in median.items():
        print(f"  {name:32s} {r:12,.0f} tokens/s  (peak {peaks.get(name, 0.0):.1f} GiB)", flush=True)
    micro, two = median[f"plain, {CHUNKS} micro-batches"], median["Pipeline, 2 stages, 1f1b"]
    if deterministic:
        say("PASS", "tput-deterministic",
            f"with deterministic algorithms (gpipe.determinism), the same model and batch: plain on {CHUNKS} "
            f"micro-batches {micro:,.0f} tokens/s, 2-stage Pipeline (1f1b) {two:,.0f} tokens/s ({two / micro:.2f}x); "
            f"hold against tput-pipeline's figures of this run; median of {rounds} rounds")
        return
    plain, one = median["plain, whole batch"], median["Pipeline, 1 stage"]
    say("PASS", "tput-pipeline",
        f"transformer_lm {params / 1e6:.0f}M params, batch {BATCH}x{SEQ}, {CHUNKS} micro-batches, {'bf16' if CUDA else 'fp32'}, on "
        f"{torch.cuda.get_device_name() if CUDA else 'cpu'}: 2-stage Pipeline (1f1b) {two:,.0f} tokens/s = "
        f"{two / plain:.2f}x plain whole-batch ({plain:,.0f}), {two / micro:.2f}x plain on the same micro-batches "
        f"({micro:,.0f}); 1-stage Pipeline / plain micro-batched = {one / micro:.2f}; median of {rounds} rounds")


def run(steps: int) -> None:
    spec = yaml.safe_load((ROOT / "examples" / "charlm.yaml").read_text())
    spec.update(name="tput", stages=1, balance=[ARGS["layers"] + 2], device="cuda" if CUDA else "cpu",
                steps=steps, max_restarts=0, checkpoint_every=None, chunks=CHUNKS, precision="bf16" if CUDA else "fp32",
                model={"factory": "charlm:transformer_lm", "args": ARGS}, lr_schedule=None)
    spec["data"] = {"factory": "charlm:corpus", "args": {"seq_len": SEQ}, "batch_size": BATCH, "shuffle": True}
    spec["optimizer"] = {"name": "adamw", "lr": 1e-4}
    spec.pop("clip_grad_norm", None)
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "tput.yaml"
        job.write_text(yaml.safe_dump(spec))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples")]))
        t = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "run", str(job), "--state-dir",
                            str(Path(tmp) / "state"), "--no-progress"], capture_output=True, text=True,
                           timeout=300, env=env, cwd=ROOT / "examples")
        took = time.monotonic() - t
        if p.returncode != 0:
            say("FAIL", "tput-run", f"run exited {p.returncode} after {took:.0f}s: {p.stderr.strip()[-400:]}")
            return
        lines = [json.loads(s) for s in (Path(tmp) / "state" / "tput" / "metrics.jsonl").read_text().splitlines()
                 if s.strip()]
    served = statistics.median(m["samples_per_s"] * SEQ for m in lines[5:] if m.get("samples_per_s"))
    torch.manual_seed(0)
    base = charlm.transformer_lm(**ARGS)
    x, y = batch()
    plain = timed(Plain(base, CHUNKS), x, y, 10)
    say("PASS", "tput-run", f"`run` of transformer_lm on 1 stage ({spec['device']}, {spec['precision']}, {CHUNKS} micro-batches, "
        f"batch {BATCH}x{SEQ}): median {served:,.0f} tokens/s over steps 6-{steps} = {served / plain:.2f}x plain "
        f"training on the same micro-batches ({plain:,.0f}); the job took {took:.0f}s with its start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["pipeline", "run"])
    p.add_argument("--rounds", type=int, default=1 if QUICK else 3)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--deterministic", action="store_true", help="pipeline: with deterministic algorithms")
    a = p.parse_args()
    if a.what == "pipeline":
        pipeline(a.rounds, a.steps or (2 if QUICK else 5), a.deterministic)
    else:
        run(a.steps or (8 if QUICK else 40))


if __name__ == "__main__":
    main()
