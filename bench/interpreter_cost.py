"""What the stage's interpreter costs an action, with no data plane and next to no compute.

    python bench/interpreter_cost.py [--rounds 5] [--width 8] [--chunks 64]

gpipe.Pipeline with one stage (the service's own Stage, its schedule's
actions, the activation meter, the seeding, the timeline) against a plain loop
of the same micro-batches' forward, loss and backward, on layers so small
(2 x Linear(width)+ReLU) that what remains is the per-action cost. One thread,
interleaved round by round, medians over rounds: (pipeline - loop) / actions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gpipe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(2) for m in (torch.nn.Linear(a.width, a.width), torch.nn.ReLU())])
    x, y = torch.randn(4 * a.chunks, a.width), torch.randn(4 * a.chunks, a.width)
    loss_fn = torch.nn.functional.mse_loss
    pipes = {s: gpipe.Pipeline(model, balance=[4], chunks=a.chunks, schedule=s) for s in ("1f1b", "zb-h1")}

    def loop() -> None:
        for xi, yi in zip(x.chunk(a.chunks), y.chunk(a.chunks), strict=True):
            (loss_fn(model(xi), yi) * (len(xi) / len(x))).backward()

    runs = {"loop": loop, **{s: (lambda p=p: p.step(x, y, loss_fn)) for s, p in pipes.items()}}
    took: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(a.rounds):
        for name, fn in runs.items():
            for _ in range(3):
                fn()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                fn()
            took[name].append((time.perf_counter() - t0) / a.steps)
        model.zero_grad(set_to_none=True)
    base = statistics.median(took["loop"])
    print(f"{a.chunks} micro-batches of 2 x Linear({a.width})+ReLU, one stage, median of {a.rounds} rounds")
    print(f"plain loop: {base * 1e3:.2f} ms a step")
    for s in pipes:
        t = statistics.median(took[s])
        actions = a.chunks * (3 if s == "zb-h1" else 2)
        print(f"gpipe.Pipeline {s}: {t * 1e3:.2f} ms a step, {(t - base) / actions * 1e6:.0f} us an action more")
    for p in pipes.values():
        p.close()


if __name__ == "__main__":
    main()
