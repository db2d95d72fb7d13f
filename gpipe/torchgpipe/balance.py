"""torchgpipe's automatic balancing: a balance for GPipe from each layer's time or size, measured.

    from gpipe.torchgpipe.balance import balance_by_time
    balance = balance_by_time(torch.cuda.device_count(), model, sample)
    model = GPipe(model, balance, chunks=8)

Both measure a copy of the model, in training mode, on `device` (the CPU
too), leaving the model itself as it was, and cut it as gpipe.balance cuts:
contiguous, each partition at least one layer, the largest partition's cost
as small as it can be.

- balance_by_time: each layer's forward and backward time
  (gpipe.balance.time_costs), summed over runs until `timeout` seconds have
  passed (at least one run).
- balance_by_size: each layer's bytes: what it keeps for its backward on a
  micro-batch of the input's samples / chunks (gpipe.memory.footprint, counted
  by autograd's saved tensors, the same on any device), plus its parameters'
  bytes times `param_scale` (2: weights and gradients; 4 with Adam's two
  moments). torchgpipe measured the CUDA allocator's growth across a forward
  instead, so a layer that makes new leaf tensors in its forward weighed more
  there.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
from torch import nn

from gpipe import balance as balancing
from gpipe import structure
from gpipe.memory import footprint

__all__ = ["balance_by_time", "balance_by_size"]

Device = torch.device | int | str
CUDA = torch.device("cuda")  # torchgpipe's default: the current CUDA device


def balance_by_time(partitions: int, module: nn.Sequential, sample: Any, *, timeout: float = 1.0,
                    device: Device = CUDA) -> list[int]:
    """Layers per partition for `module` cut into `partitions`, balanced by each layer's forward and backward
    time on `sample` (a tensor or a tuple of them, any batch size). ValueError when a parameter of `module`
    already has a gradient (the measurement would add to it: torchgpipe's rule)."""
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError("some parameter already has gradient: balance_by_time measures backwards, "
                         "call it before training (or zero the gradients with set_to_none)")
    dev = torch.device(device)
    sandbox = _training_copy(module)
    threads = torch.get_num_threads()
    totals = [0.0] * len(module)
    start = time.monotonic()
    while True:
        costs = balancing.time_costs(sandbox, sample, dev, threads, repeats=1)
        totals = [a + b for a, b in zip(totals, costs, strict=True)]
        if time.monotonic() - start >= timeout:
            break
    return balancing.partition(totals, partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: Any, *, chunks: int = 1,
                    param_scale: float = 2.0, device: Device = CUDA) -> list[int]:
    """Layers per partition for `module` cut into `partitions`, balanced by each layer's bytes when trained on
    mini-batch `input` cut into `chunks` micro-batches (the module's docstring)."""
    if type(chunks) is not int or chunks < 1:
        raise ValueError(f"chunks: must be a positive int, got {chunks!r}")
    dev = torch.device(device)
    sandbox = _training_copy(module).to(dev)
    x = structure.to(input, dev)
    micro_batch = math.ceil(footprint.samples_of(x) / chunks)
    fp = footprint.measure(sandbox, x)
    # memory_costs: parameters x 2 (weights, gradients) + activations; param_scale copies instead of 2
    costs = balancing.memory_costs(sandbox, fp, micro_batch, slots=0, in_flight=1)
    sized = []
    for cost, layer in zip(costs, sandbox, strict=True):
        params = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
        sized.append(max(0.0, cost + params * (param_scale - 2)))
    return balancing.partition(sized, partitions)


def _training_copy(module: nn.Sequential) -> nn.Sequential:
    """A copy of `module` in training mode, without gradients: what is measured, so `module` is left as it was."""
    sandbox = copy.deepcopy(module).train()
    sandbox.zero_grad(set_to_none=True)
    return sandbox
