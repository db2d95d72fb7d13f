"""Each layer's measured costs, the step-time model's inputs: forward, input-gradient, weight-gradient and optimizer seconds.

`measure` runs a throwaway copy of the model layer by layer on the device and threads a stage has, as the
stages run it: each layer fused as a stage's are (gpipe.grad_in_place.fuse: a large linear's weight gradient
added into `.grad`, and deferred to W under a split backward), its input detached and requiring grad where it
is floating point, its output's gradient ones, its weights' `.grad` kept from one run to the next (a step's
micro-batches after its first add into it). Per layer and micro-batch size it times, as the median of a few
runs after a warm-up:

    F   the forward
    B   a split backward's B: gpipe.split_backward.backward_input (the inputs' gradients, what the stage before
        waits for; the weights' part kept for W)
    W   that micro-batch's W: WeightGradients.run (the deferred weight-gradient GEMMs, an autograd pass for
        what is not deferred)
    BW  a plain backward (torch.autograd.backward): what the schedules that do not split run; with fused
        linears it is not B + W

It does so at two micro-batch sizes and fits each cost as a line in the size (`Cost.at`): a fixed part (the
kernels' launch and the framework's per-call work, which a small micro-batch is mostly made of) and a part
per sample. The first layer's input (the data) wants no gradient: its B is nothing and its W the whole backward. And,
given the job's optimizer, the seconds of its step over each layer's parameters (no micro-batch in it).

These are one process's times. A run's workers compute at once, each on its share of the host's cores:
gpipe.costs_together measures them so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe import grad_in_place, structure
from gpipe.balance import layer_runs, sync
from gpipe.split_backward import backward_input

# The job's optimizer as the workers build it: its class and keyword arguments (picklable, for
# gpipe.costs_together's processes), or None to leave the optimizer's step out.
Optimizer = tuple[type[torch.optim.Optimizer], dict[str, Any]] | None


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

    @staticmethod
    def mean(costs: Sequence[Cost]) -> Cost:
        """The mean line (each size's mean time)."""
        return Cost(statistics.fmean(c.fixed for c in costs), statistics.fmean(c.per_sample for c in costs))


@dataclass(frozen=True)
class LayerCosts:
    """A layer's F, B and W (a split backward's halves) and BW (a plain backward: None, B + W) by micro-batch
    size, and `step`: the optimizer's step over its parameters, seconds."""

    f: Cost
    b: Cost
    w: Cost
    bw: Cost | None = None
    step: float = 0.0

    def backward(self, n: int) -> float:
        """A plain backward's seconds at micro-batch size `n`."""
        return self.bw.at(n) if self.bw is not None else self.b.at(n) + self.w.at(n)

    @staticmethod
    def mean(costs: Sequence[LayerCosts]) -> LayerCosts:
        """Each cost's mean over `costs` (one layer measured several times)."""
        bws = [c.bw for c in costs if c.bw is not None]
        return LayerCosts(Cost.mean([c.f for c in costs]), Cost.mean([c.b for c in costs]),
                          Cost.mean([c.w for c in costs]), Cost.mean(bws) if len(bws) == len(costs) else None,
                          statistics.fmean(c.step for c in costs))


def _outputs(y: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`y`'s tensors that require grad, and a gradient of ones for each."""
    outs = [t for t in structure.tensors(y) if t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


def _time_layer(layer: nn.Module, x: Any, device: torch.device, repeats: int) -> tuple[float, float, float, float]:
    """(F, B, W, BW) seconds of `layer` on input `x`: medians of `repeats` runs after one to warm up."""
    inputs = [t for t in structure.tensors(x) if t.requires_grad]
    params = [p for p in layer.parameters() if p.requires_grad]
    runs: list[tuple[float, float, float, float]] = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        y = layer(x)
        sync(device)
        t1 = time.perf_counter()
        outs, grads = _outputs(y)
        weights = backward_input(outs, grads, inputs, params)
        sync(device)
        t2 = time.perf_counter()
        weights.run()
        sync(device)
        t3 = time.perf_counter()
        del y, outs, grads, weights
        outs, grads = _outputs(layer(x))  # again, for a plain backward
        sync(device)
        t4 = time.perf_counter()
        if outs:
            torch.autograd.backward(outs, grads)
        sync(device)
        t5 = time.perf_counter()
        del outs, grads
        for t in inputs:
            t.grad = None
        runs.append((t1 - t0, t2 - t1, t3 - t2, t5 - t4))
    layer.zero_grad(set_to_none=True)
    f, b, w, bw = (statistics.median(r[i] for r in runs[1:]) for i in range(4))
    return f, b, w, bw


def _time_step(layer: nn.Module, optimizer: Optimizer, repeats: int) -> float:
    """Seconds of `optimizer`'s step over `layer`'s parameters (their gradients set): the median of `repeats` after
    two (the first makes the state)."""
    params = [p for p in layer.parameters() if p.requires_grad]
    if optimizer is None or not params:
        return 0.0
    cls, kwargs = optimizer
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = cls(params, **kwargs)
    runs = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        opt.step()
        sync(params[0].device)
        runs.append(time.perf_counter() - t0)
    layer.zero_grad(set_to_none=True)
    return statistics.median(runs[2:])


def _sized(sample: Any, n: int) -> Any:
    """The first `n` samples of a micro-batch (its tensors cut along dim 0)."""
    return structure.map_tensors(sample, lambda t: t[:n])


def measure(model: nn.Sequential, sample: Any, device: torch.device, threads: int, sizes: tuple[int, int],
            repeats: int = 3, optimizer: Optimizer = None,
            going: Callable[[], bool] = lambda: True) -> list[LayerCosts]:
    """Each layer's F, B, W and BW as lines in the micro-batch size, timed on micro-batches of `sizes` samples
    (cut from `sample`, which holds at least the larger) with `threads` threads, and `optimizer`'s step over its
    parameters (the module's doc). `going() is False` stops it early (what it measured is then of no use)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        at: list[list[tuple[float, float, float, float]]] = []
        for n in sorted(set(sizes)):
            row = []
            for i, (layer, x) in enumerate(layer_runs(model, _sized(sample, n), device)):
                if not going():
                    return []
                if i == 0:  # the data: the first stage computes no gradient for it
                    x = structure.map_tensors(x, lambda t: t.detach())
                grad_in_place.fuse(layer)  # as the workers run it (gpipe.stage fuses each stage's layers)
                row.append(_time_layer(layer, x, device, repeats))
            at.append(row)
        steps = [_time_step(layer, optimizer, repeats) for layer, _ in layer_runs(model, _sized(sample, 1), device)]
    finally:
        torch.set_num_threads(before)
    lo, hi = min(sizes), max(sizes)
    small, large = at[0], at[-1]
    out = []
    for s, g, t in zip(small, large, steps, strict=True):
        f, b, w, bw = (Cost.fit(lo, s[i], hi, g[i]) for i in range(4))
        out.append(LayerCosts(f, b, w, bw, t))
    return out
