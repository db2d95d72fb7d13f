"""Every schedule side by side in one process: gpipe.Pipeline's 1f1b, zb-h1, interleaved-1f1b and zbv.

    python bench/schedules.py [--rounds 5] [--steps 6] [--chunks 8]

The model is bench/step_time.py's, 8 x (Linear(1024)+ReLU), batch 256 in
--chunks micro-batches, on 2 workers: a thread each in this process, torch on
one intra-op thread (the workers' threads run on the machine's cores at once:
torch lets go of the GIL in its kernels). interleaved-1f1b and zbv cut the
model into 4 chunks of 2 layers, 2 on each worker (bench/step_time.py runs
every schedule in the service's processes). "One thread" does the same
micro-batched work in one thread. Each round runs every contender once,
interleaved; the figures are medians over rounds of each run's median step.
A worker's measured bubble is the share of the step its chunks were not
computing (busy_s, as metrics.jsonl's bubble_fraction).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

import gpipe
from gpipe.topology import place

WIDTH, DEPTH, BATCH, WORKERS = 1024, 8, 256, 2
CONTENDERS = {  # name: (schedule, virtual stages)
    "1f1b": ("1f1b", 1), "zb-h1": ("zb-h1", 1), "interleaved-1f1b": ("interleaved-1f1b", 2), "zbv": ("zbv", 2),
}


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(DEPTH)])


def one_thread(steps: int, chunks: int) -> tuple[float, float]:
    m, x, y = model(), torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for xs, ys in zip(x.tensor_split(chunks), y.tensor_split(chunks), strict=True):
            torch.autograd.backward(nn.functional.mse_loss(m(xs), ys) * len(xs) / BATCH)
        times.append(time.perf_counter() - t)
    return statistics.median(times), 0.0


def pipelined(schedule: str, virtual: int, steps: int, chunks: int) -> tuple[float, float]:
    """(median step s, median of the workers' largest bubble)."""
    parts = WORKERS * virtual
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    times, bubbles = [], []
    with gpipe.Pipeline(model(), [DEPTH // parts] * parts, chunks=chunks, schedule=schedule,
                        virtual_stages=virtual) as pipe:
        pipe.step(x, y, nn.functional.mse_loss)  # builds the stages
        for _ in range(steps):
            t = time.perf_counter()
            pipe.step(x, y, nn.functional.mse_loss)
            wall = time.perf_counter() - t
            times.append(wall)
            busy = [0.0] * WORKERS
            for g, r in enumerate(pipe.results):
                busy[place(schedule, g, WORKERS)[0]] += r.busy_s
            bubbles.append(max(1 - b / wall for b in busy))
    return statistics.median(times), statistics.median(bubbles)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--chunks", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(1)
    runs = {"one thread": lambda: one_thread(a.steps, a.chunks)} | {
        name: (lambda s=s, v=v: pipelined(s, v, a.steps, a.chunks)) for name, (s, v) in CONTENDERS.items()}
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    for r in range(a.rounds):
        for name, fn in runs.items():
            got[name].append(fn())
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1][0] * 1e3:.0f} ms" for k, v in got.items()),
              file=sys.stderr, flush=True)
    base = statistics.median(t for t, _ in got["one thread"])
    ideal = WORKERS * a.chunks / (a.chunks + WORKERS - 1)
    print(f"\n{WORKERS} workers, {a.chunks} micro-batches, batch {BATCH}, {DEPTH} x Linear({WIDTH})+ReLU, one process; "
          f"1F1B's ideal speed-up {ideal:.3f}; median of {a.rounds} rounds")
    print(f"{'contender':18} {'step ms':>8} {'speed-up':>9} {'bubble':>7}")
    for name, rows in got.items():
        t = statistics.median(x for x, _ in rows)
        bubble = f"{statistics.median(b for _, b in rows):7.3f}" if name != "one thread" else ""
        print(f"{name:18} {t * 1e3:8.1f} {base / t:9.3f} {bubble}")
    one = statistics.median(t for t, _ in got["1f1b"])
    for name in ("zb-h1", "interleaved-1f1b", "zbv"):
        print(f"{name} / 1f1b: {one / statistics.median(t for t, _ in got[name]):.3f}x")


if __name__ == "__main__":
    main()
