"""What splitting a backward into B and W costs, by the stage's depth (gpipe.split_backward).

    python bench/split_cost.py [--rounds 60] [--depths 2,4,16,64] [--width 1024,64] [--fused]

One process, one thread, in-process: a stage of `depth` x (Linear(width)+ReLU)
under the activation meter's hooks, as a stage runs it; one micro-batch's
plain backward against the split one's B (its input's gradient, the graph
kept) and W (the weights'). Medians over rounds, in ms; the ratio is
(B + W) / plain. `--fused`: the Linear layers fused as a worker's stage runs
them (gpipe.grad_in_place.fuse: the weight gradient added into .grad, W's
GEMMs deferred), beside torch's own.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpipe import grad_in_place
from gpipe.memory.meter import ActivationMeter
from gpipe.split_backward import backward_input


def measure(depth: int, width: int, batch: int, rounds: int, fused: bool = False) -> dict[str, float]:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    if fused:
        grad_in_place.fuse(layers)
    params = list(layers.parameters())
    meter = ActivationMeter(params)
    x = torch.randn(batch, width)
    took: dict[str, list[float]] = {"plain": [], "B": [], "W": []}
    for r in range(rounds + 5):
        for split in (False, True):
            xi = x.clone().requires_grad_(True)
            with meter.hooks():
                y = layers(xi)
            g = torch.ones_like(y)
            t0 = time.perf_counter()
            if not split:
                torch.autograd.backward([y], [g])
                if r >= 5:
                    took["plain"].append(time.perf_counter() - t0)
                continue
            w = backward_input([y], [g], [xi], params, meter.releasing)
            t1 = time.perf_counter()
            w.run()
            if r >= 5:
                took["B"].append(t1 - t0)
                took["W"].append(time.perf_counter() - t1)
    return {k: statistics.median(v) * 1e3 for k, v in took.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--depths", default="2,4,16,64")
    ap.add_argument("--width", default="1024,64", help="comma-separated layer widths (batch 32 at 1024, else 8)")
    ap.add_argument("--fused", action="store_true", help="each case fused too (gpipe.grad_in_place.fuse)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'width':>5} {'depth':>5} {'layers':>6} {'plain':>8} {'B':>8} {'W':>8} {'(B+W)/plain':>12}")
    for width in map(int, a.width.split(",")):
        for depth in map(int, a.depths.split(",")):
            if width >= 1024 and depth > 16:
                continue  # seconds a round: the small width shows the growth
            for fused in (False, True) if a.fused else (False,):
                m = measure(depth, width, 32 if width >= 1024 else 8, a.rounds, fused)
                print(f"{width:5} {depth:5} {'fused' if fused else 'torch':>6} {m['plain']:8.2f} {m['B']:8.2f} "
                      f"{m['W']:8.2f} {(m['B'] + m['W']) / m['plain']:12.2f}")


if __name__ == "__main__":
    main()
