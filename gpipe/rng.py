"""Randomness that does not depend on where the model is cut.

Layer l, on micro-batch i of step s, draws from the default generator seeded
with `layer_seed(seed, s, i, l)`. So dropout masks are the same for any stage
count and balance, the same as on one device, and the same when activation
checkpointing recomputes a forward in the backward.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from gpipe import structure

_MASK = (1 << 64) - 1
_NONE = torch.empty(0)  # the device of a structure with no tensor: the CPU's


def _mix(x: int) -> int:
    # splitmix64: spreads nearby integers over the 64-bit range.
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def layer_seed(seed: int, step: int, micro_batch: int, layer: int) -> int:
    """The seed of layer `layer` on micro-batch `micro_batch` of step `step`."""
    return _mix(_micro_batch_key(seed, step, micro_batch) ^ layer) >> 1  # torch takes seeds below 2**63


def _micro_batch_key(seed: int, step: int, micro_batch: int) -> int:
    """What every layer's seed of one micro-batch starts from (a forward mixes it once per layer, not four times)."""
    return _mix(_mix(_mix(seed) ^ step) ^ micro_batch)


def generators(device: torch.device) -> list[torch.Generator]:
    """The default generators a layer on `device` draws from.

    Seeding them directly costs a microsecond; torch.manual_seed also queues a
    seed for every CUDA device with a captured stack, some 350 us a call.
    """
    gens = [torch.default_generator]
    if device.type == "cuda":
        gens.append(torch.cuda.default_generators[device.index if device.index is not None
                                                  else torch.cuda.current_device()])
    return gens


class SharedGenerators:
    """The default generators, shared by stages that run as threads of one process (gpipe.Pipeline).

    A layer that draws random numbers seeds them and runs its forward holding
    this lock, so no other stage's seed lands between its seed and its draws;
    a layer that draws none neither seeds nor waits. A layer draws when it is
    (or holds) one of torch's dropout modules, RReLU, a MultiheadAttention with
    dropout, or a module with `gpipe_random = True` (set it on a layer whose
    forward calls torch.rand, F.dropout and the like itself).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._draws: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

    def draws(self, layer: nn.Module) -> bool:
        if (known := self._draws.get(layer)) is not None:
            return known
        found = any(isinstance(m, _DropoutNd | nn.RReLU) or getattr(m, "gpipe_random", False)
                    or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0) for m in layer.modules())
        self._draws[layer] = found
        return found


def seeded_forward(layers: Iterable[tuple[int, nn.Module]], x: Any, seed: int, step: int, micro_batch: int,
                   shared: SharedGenerators | None = None) -> Any:
    """Run (global index, layer) pairs in order, seeding each layer's randomness.

    `x` is what the first layer takes (a tensor, or a structure of them: gpipe.structure);
    the generators seeded are those of its first tensor's device. With `shared`, only the layers
    that draw are seeded, each under its lock.
    """
    gens = generators(x.device if type(x) is torch.Tensor else next(iter(structure.tensors(x)), _NONE).device)
    key = _micro_batch_key(seed, step, micro_batch)
    if shared is None:
        for index, layer in layers:
            s = _mix(key ^ index) >> 1  # layer_seed(seed, step, micro_batch, index)
            for g in gens:
                g.manual_seed(s)
            x = layer(x)
        return x
    for index, layer in layers:
        if not shared.draws(layer):
            x = layer(x)
            continue
        with shared.lock:
            s = _mix(key ^ index) >> 1
            for g in gens:
                g.manual_seed(s)
            x = layer(x)
    return x
