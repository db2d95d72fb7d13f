"""Balance: how many consecutive layers each stage gets.

A cost per layer (parameters, measured time, or memory), then the contiguous
cut into `stages` non-empty parts that minimises the largest part's cost.

- by_params: a layer's parameter count (+1, so parameterless layers spread too).
- by_time: a layer's forward and backward time with the stages' threads,
  measured on the job's first micro-batch (median of 3 runs), on the device
  the plan is made on: the CPU of the coordinator (which never touches a GPU),
  so for a `device: cuda` job the CPU's times stand in for the GPU's.
- by_memory: a layer's bytes at its peak: parameters, gradients and optimizer
  state, plus the activations it keeps for backward (gpipe.memory.footprint, as the
  predicted peaks count them) times the micro-batches in flight at once (chunks
  under gpipe, stages under 1f1b).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Generator, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from gpipe import skip, structure
from gpipe.memory.footprint import Footprint, Layers


def partition(costs: Sequence[float], stages: int) -> list[int]:
    """Layers per stage: contiguous, each at least one, minimising the largest stage's cost."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} stages")
    scale = 1e6 / max(max(costs), 1e-12)  # integers, so the search ends exactly
    w = [max(1, round(c * scale)) for c in costs]

    def cut(limit: int) -> list[int] | None:
        # Greedy from the left, leaving at least one layer for each later stage.
        out, i = [], 0
        for k in range(stages):
            j, load = i, 0
            while j < n - (stages - k - 1) and (j == i or load + w[j] <= limit):
                load += w[j]
                j += 1
            out.append(j - i)
            i = j
        return out if i == n else None

    lo, hi = max(w), sum(w)
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    result = cut(lo)
    assert result is not None
    return result


def param_costs(model: nn.Sequential) -> list[float]:
    return [float(sum(p.numel() for p in layer.parameters()) + 1) for layer in model]


class _Replay(skip.Context):
    """A layer runs several times here: a pop leaves the stashed tensor for the next run."""

    def pop(self, name: str) -> torch.Tensor:
        return self.stashed[name]


def layer_runs(model: nn.Sequential, sample: Any, device: torch.device) -> Generator[tuple[nn.Module, Any], None, None]:
    """Yield (layer, input) for each layer of a throwaway copy of the model, input ready for autograd."""
    model = copy.deepcopy(model).to(device)  # the plan's model holds the initial weights: leave it be
    x = structure.to(sample, device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), skip.use(_Replay()):
        for layer in model:
            x_in = structure.map_tensors(x, lambda t: t.detach().requires_grad_(t.is_floating_point()))
            yield layer, x_in
            with torch.no_grad():
                x = layer(x_in)


def _backward(y: Any) -> None:
    """Backward from every tensor of `y` that requires grad, with gradients of ones."""
    outs = [t for t in structure.tensors(y) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_costs(model: nn.Sequential, sample: Any, device: torch.device, threads: int,
               repeats: int = 3) -> list[float]:
    """Seconds of forward + backward per layer on `device` with `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    costs = []
    try:
        for layer, x in layer_runs(model, sample, device):
            runs = []
            for _ in range(repeats + 1):  # the first run warms up
                sync(device)
                t0 = time.perf_counter()
                y = layer(x)
                _backward(y)
                sync(device)
                runs.append(time.perf_counter() - t0)
                layer.zero_grad(set_to_none=True)
                for t in structure.tensors(x):
                    t.grad = None
            costs.append(statistics.median(runs[1:]))
    finally:
        torch.set_num_threads(before)
    return costs


def _saved(i: int, m: Layers) -> int:
    return sum(m.saved[i].values())


def memory_costs(model: nn.Sequential, fp: Footprint, samples: int, slots: int, in_flight: int) -> list[float]:
    """Bytes per layer: parameters x (weight, gradient, `slots` optimizer state tensors) + activations x
    in_flight, the activations what the layer saves for its backward on a micro-batch of `samples` (`fp`:
    gpipe.memory.footprint; `slots`: gpipe.optim)."""
    costs = []
    for i, layer in enumerate(model):
        param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
        activations = fp.line(partial(_saved, i)).at(samples)
        costs.append(float(param_bytes * (2 + slots) + activations * in_flight))
    return costs
