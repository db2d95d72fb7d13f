"""A GPT-2-shaped model of about 1 B parameters started from `model.weights` on 4 stages: memory per process.

    python bench/pretrained.py                      # n_embd 2048, 18 layers, 16 heads, vocab 50257: 1.01 B
    python bench/pretrained.py --width 512 --layers 8   # the same shape, smaller, for a quick look

A GPT2LMHeadModel (transformers, from a config: no download) whose weights are written once, a tensor at a
time, as a safetensors file under the model's names (the tied embedding once, as save_pretrained writes it).
`gpipe-coordinator run` then trains it 2 steps on 4 stages from that file (balance by_params, 4 micro-batches
of 2 sequences of 32 tokens, sgd without momentum, fp32). Nothing builds the whole model: the coordinator
captures it on the meta device and reads only the file's header, and each stage builds its own pieces and is
sent its own tensors from the file. Reported:
  - each process's peak resident memory (VmHWM from /proc/<pid>/status, polled every 0.2 s; and each stage's
    own figure in metrics.jsonl) against its share: the parameters it holds (plan.json, the tied weight on
    both the first and the last stage), as float32 weights, and weights + gradients;
  - the target of bench/scale.py: a stage at most 1.25 x (its weights + gradients) + 0.5 GB; the
    coordinator's attempt process under 1 GB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import run  # noqa: E402  # the same run and VmHWM watcher

MODEL = '''
import torch
from torch.utils.data import TensorDataset


def gpt2(width: int, layers: int, heads: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=width, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def tokens(n: int, length: int, vocab: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, length + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])
'''


def write_weights(path: Path, args: dict[str, int]) -> int:
    """The model's weights, random (std 0.02), written a tensor at a time; the parameter count."""
    sys.path.insert(0, str(path.parent))
    from bench_gpt2 import gpt2  # type: ignore[import-not-found]  # written beside the job

    from gpipe import stream
    from gpipe.capture import skeleton
    from gpipe.coordinator.outputs.checkpoint import StageStream, write_stream

    model, _ = skeleton.skeleton(lambda: gpt2(**args))
    shapes = dict(model.named_parameters())  # the tied weight once, under its first name
    shapes |= {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in shapes
               and not any(v is p for p in shapes.values())}
    head, total = stream.header(shapes)
    g = torch.Generator().manual_seed(1)

    def pieces() -> Iterator[torch.Tensor]:
        for name in sorted(shapes):
            t = torch.randn(shapes[name].shape, generator=g) * 0.02
            yield stream.as_bytes(t)

    write_stream(StageStream(head, total, {}, pieces), path)
    return sum(t.numel() for t in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--dir", help="where the weights and the state go (default: a temporary folder, removed)")
    a = p.parse_args()
    tmp = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="gpipe-pretrained-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        (tmp / "bench_gpt2.py").write_text(MODEL)
        args = {"width": a.width, "layers": a.layers, "heads": a.heads, "vocab": a.vocab}
        t0 = time.perf_counter()
        params = write_weights(tmp / "model.safetensors", args)
        size = (tmp / "model.safetensors").stat().st_size
        print(f"GPT-2 n_embd {a.width}, {a.layers} layers, {a.heads} heads, vocab {a.vocab}: {params / 1e9:.3f} B "
              f"parameters; model.safetensors {size / 1e9:.2f} GB written in {time.perf_counter() - t0:.0f} s")
        spec = {
            "name": "pretrained", "seed": 0, "stages": a.stages, "chunks": 4, "balance": "by_params",
            "model": {"factory": "bench_gpt2:gpt2", "args": args, "weights": "model.safetensors"},
            "data": {"factory": "bench_gpt2:tokens", "args": {"n": 16, "length": 32, "vocab": a.vocab},
                     "batch_size": 8},
            "loss": "cross_entropy", "optimizer": {"name": "sgd", "lr": 0.0001}, "steps": 2,
            "checkpoint_every": None, "keep_checkpoints": 2, "start_timeout_s": 1800, "step_timeout_s": 1800,
        }
        (tmp / "job.yaml").write_text(yaml.safe_dump(spec))
        t0 = time.perf_counter()
        lines, peaks = run(tmp, uuid.uuid4().hex)
        print(f"\ntrained 2 steps in {time.perf_counter() - t0:.1f} s (wall, with start-up)")
        out = tmp / "state" / "pretrained"
        plan = json.loads((out / "plan.json").read_text())
        last = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
        held = [s["parameters"] for s in plan["stages"]]
        print(f"\nbalance {plan['balance']} (blocks); per stage: parameters held, its share as float32 weights "
              "(W) and weights + gradients (W+G), its peak resident memory (the stage's own VmHWM), and "
              "the target 1.25 x (W+G) + 0.5 GB:")
        print("| stage | parameters | W GB | W+G GB | peak GB | peak / W | peak / (W+G) | target GB | |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for k, n in enumerate(held):
            w = n * 4
            peak = next(s["peak_memory_bytes"] for s in last["stages"] if s["stage"] == k)
            target = 1.25 * 2 * w + 0.5e9
            print(f"| {k} | {n / 1e6:.0f} M | {w / 1e9:.2f} | {2 * w / 1e9:.2f} | {peak / 1e9:.2f} | "
                  f"{peak / w:.2f} | {peak / (2 * w):.2f} | {target / 1e9:.2f} | "
                  f"{'met' if peak <= target else 'MISSED'} |")
        print("\nevery process of the run (VmHWM, polled):")
        for pid, (name, hwm) in sorted(peaks.items(), key=lambda x: x[1][0]):
            print(f"    {name:22} pid {pid:>7}  {hwm / 1e9:6.2f} GB")
        print(f"  the whole model's float32 weights: {params * 4 / 1e9:.2f} GB")
        losses = [json.loads(x).get("loss") for x in (out / "metrics.jsonl").read_text().splitlines()]
        print(f"  losses: {losses}")
    finally:
        if not a.dir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
