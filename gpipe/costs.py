"""Each layer's measured costs, the step-time model's inputs: forward, input-gradient and weight-gradient seconds.

`measure` runs a throwaway copy of the model layer by layer on the device and threads a stage has, as the
stages would: each layer's input detached and requiring grad where it is floating point, its output's
gradient ones. Per layer and micro-batch size it times, as the median of a few runs after a warm-up:

    F  the forward
    B  the backward to the layer's input only (autograd.grad to the inputs, the graph kept): what a split
       backward's B does, and what the stage before waits for
    W  the whole backward less B: the weights' gradients (a split backward's W; B + W is a plain backward)

It does so at two micro-batch sizes and fits each cost as a line in the size (`Cost.at`): a fixed part (the
kernels' launch and the framework's per-call work, which a small micro-batch is mostly made of) and a part
per sample. The first layer's input wants no gradient: its B is nothing and its W the whole backward.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe import structure
from gpipe.balance import layer_runs, sync


@dataclass(frozen=True)
class Cost:
    """Seconds as a line in the micro-batch's samples: fixed + per_sample x n (never below 0)."""

    fixed: float
    per_sample: float

    def at(self, n: int) -> float:
        return max(0.0, self.fixed + self.per_sample * n)

    @staticmethod
    def fit(n0: int, t0: float, n1: int, t1: float) -> Cost:
        """The line through (n0, t0) and (n1, t1); a flat one when the sizes are equal or the times fall."""
        if n1 == n0 or t1 <= t0:
            return Cost(max(t0, t1), 0.0)
        slope = (t1 - t0) / (n1 - n0)
        return Cost(max(0.0, t0 - slope * n0), slope)


@dataclass(frozen=True)
class LayerCosts:
    f: Cost
    b: Cost
    w: Cost


def _time_layer(layer: nn.Module, x: Any, device: torch.device, repeats: int) -> tuple[float, float, float]:
    """(F, B, W) seconds of `layer` on input `x`: medians of `repeats` runs after one to warm up."""
    inputs = [t for t in structure.tensors(x) if t.requires_grad]
    f_runs, b_runs, full_runs = [], [], []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        y = layer(x)
        sync(device)
        t1 = time.perf_counter()
        outs = [t for t in structure.tensors(y) if t.requires_grad]
        grads = [torch.ones_like(t) for t in outs]
        if outs and inputs:
            torch.autograd.grad(outs, inputs, grads, retain_graph=True, allow_unused=True)
        sync(device)
        t2 = time.perf_counter()
        del y, outs, grads
        y = layer(x)  # again, for the whole backward alone
        outs = [t for t in structure.tensors(y) if t.requires_grad]
        sync(device)
        t3 = time.perf_counter()
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        sync(device)
        t4 = time.perf_counter()
        layer.zero_grad(set_to_none=True)
        for t in inputs:
            t.grad = None
        f_runs.append(t1 - t0)
        b_runs.append(t2 - t1)
        full_runs.append(t4 - t3)
    f, b, full = (statistics.median(r[1:]) for r in (f_runs, b_runs, full_runs))
    return f, min(b, full), max(0.0, full - b)


def _sized(sample: Any, n: int) -> Any:
    """The first `n` samples of a micro-batch (its tensors cut along dim 0)."""
    return structure.map_tensors(sample, lambda t: t[:n])


def measure(model: nn.Sequential, sample: Any, device: torch.device, threads: int, sizes: tuple[int, int],
            repeats: int = 3) -> list[LayerCosts]:
    """Each layer's F, B and W as lines in the micro-batch size, timed on micro-batches of `sizes` samples
    (cut from `sample`, which holds at least the larger) with `threads` threads (the module's doc)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        at: list[list[tuple[float, float, float]]] = []
        for n in sorted(set(sizes)):
            at.append([_time_layer(layer, x, device, repeats) for layer, x in layer_runs(model, _sized(sample, n), device)])
    finally:
        torch.set_num_threads(before)
    lo, hi = min(sizes), max(sizes)
    small, large = at[0], at[-1]
    return [LayerCosts(*(Cost.fit(lo, s[i], hi, g[i]) for i in range(3))) for s, g in zip(small, large, strict=True)]
