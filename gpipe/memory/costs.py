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
gpipe.memory.costs_together measures them so.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe import grad_in_place, structure
from gpipe.balance import layer_runs, sync
from gpipe.split_backward import WeightGradients, backward_input

# The job's optimizer as the workers build it: its class and keyword arguments (picklable, for
# gpipe.memory.costs_together's processes), or None to leave the optimizer's step out.
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


def _clock(device: torch.device, times: list[float], since: float) -> float:
    """Append the seconds since `since` (the device's work done) to `times`; return now."""
    sync(device)
    now = time.perf_counter()
    times.append(now - since)
    return now


def _time_layers(runs: list[tuple[nn.Module, Any]], device: torch.device,
                 repeats: int) -> list[tuple[float, float, float, float]]:
    """Per layer of `runs` (each with its input), its (F, B, W, BW) seconds: medians of `repeats` runs after one
    to warm up. Each run times the layers in the order a stage runs them (the forwards first to last, then the
    backwards last to first), not one layer over and over: each then finds the caches as a stage's actions leave
    them, its weights and gradients moved out by the other layers'."""
    n = len(runs)
    times: list[list[list[float]]] = [[[], [], [], []] for _ in runs]
    inputs = [[t for t in structure.tensors(x) if t.requires_grad] for _, x in runs]
    params = [[p for p in layer.parameters() if p.requires_grad] for layer, _ in runs]
    for _ in range(repeats + 1):
        ys = []
        for i, (layer, x) in enumerate(runs):
            t0 = time.perf_counter()
            ys.append(layer(x))
            _clock(device, times[i][0], t0)
        weights: list[WeightGradients | None] = [None] * n
        for i in reversed(range(n)):  # B: the inputs' gradients, the weights' part kept for W
            outs, grads = _outputs(ys[i])
            t0 = time.perf_counter()
            weights[i] = backward_input(outs, grads, inputs[i], params[i])
            _clock(device, times[i][1], t0)
        for i in reversed(range(n)):  # W
            w = weights[i]
            assert w is not None
            t0 = time.perf_counter()
            w.run()
            _clock(device, times[i][2], t0)
        del ys, weights
        _clear(inputs)
        plain = [_outputs(layer(x)) for layer, x in runs]  # again, for a plain backward
        for i in reversed(range(n)):
            outs, grads = plain[i]
            t0 = time.perf_counter()
            if outs:
                torch.autograd.backward(outs, grads)
            _clock(device, times[i][3], t0)
        del plain
        _clear(inputs)
    for layer, _ in runs:
        layer.zero_grad(set_to_none=True)
    return [(statistics.median(f[1:]), statistics.median(b[1:]), statistics.median(w[1:]), statistics.median(bw[1:]))
            for f, b, w, bw in times]


def _clear(inputs: list[list[torch.Tensor]]) -> None:
    for ts in inputs:
        for t in ts:
            t.grad = None


def _time_steps(layers: list[nn.Module], optimizer: Optimizer, device: torch.device, repeats: int) -> list[float]:
    """Per layer, the seconds of `optimizer`'s step over its parameters (their gradients set): the median of
    `repeats` after two (the first makes the state), the layers stepped one after another as a worker's
    optimizer steps them."""
    params = [[p for p in layer.parameters() if p.requires_grad] for layer in layers]
    if optimizer is None:
        return [0.0] * len(layers)
    cls, kwargs = optimizer
    opts = [cls(ps, **kwargs) if ps else None for ps in params]
    for p in (p for ps in params for p in ps):
        p.grad = torch.full_like(p, 1e-3)
    times: list[list[float]] = [[] for _ in layers]
    for _ in range(repeats + 2):
        for opt, took in zip(opts, times, strict=True):
            if opt is not None:
                t0 = time.perf_counter()
                opt.step()
                _clock(device, took, t0)
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return [statistics.median(t[2:]) if t else 0.0 for t in times]


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
            if not going():
                return []
            # every layer with its input, the copy's contexts (skips replayed, randomness forked) still open
            gen = layer_runs(model, _sized(sample, n), device)
            runs = list(itertools.islice(gen, len(model)))
            for layer, _ in runs:
                grad_in_place.fuse(layer)  # as the workers run it (gpipe.stage fuses each stage's layers)
            first, x = runs[0]  # its input is the data: the first stage computes no gradient for it
            runs[0] = first, structure.map_tensors(x, lambda t: t.detach())
            try:
                at.append(_time_layers(runs, device, repeats))
            finally:
                gen.close()
            del runs
        steps = _time_steps([layer for layer, _ in layer_runs(model, _sized(sample, 1), device)], optimizer, device,
                            repeats)
    finally:
        torch.set_num_threads(before)
    lo, hi = min(sizes), max(sizes)
    small, large = at[0], at[-1]
    out = []
    for s, g, t in zip(small, large, steps, strict=True):
        f, b, w, bw = (Cost.fit(lo, s[i], hi, g[i]) for i in range(4))
        out.append(LayerCosts(f, b, w, bw, t))
    return out
