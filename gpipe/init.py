"""Initial weights that do not depend on where the model is cut: `init: per_layer`.

Layer i of the un-partitioned nn.Sequential is initialised on the CPU from the
default generator seeded by `layer_seed(seed, i)`: each of its submodules'
`reset_parameters()` in `modules()` order, or a hook given (layer index,
layer). So a stage can build its own layers, one at a time, without any
process building the whole model, and the weights are the same for any stage
count and balance, and the same as `per_layer(model, seed)` on one device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gpipe.rng import _mix as mix  # the splitmix64 step the forward seeds use

Hook = Callable[[int, nn.Module], None]


def layer_seed(seed: int, layer: int) -> int:
    """The seed of layer `layer`'s initial weights (apart from the forward's seeds: gpipe.rng)."""
    return mix(mix(mix(seed) ^ 0x1A17) ^ layer) >> 1  # torch takes seeds below 2**63


def _holds_tensors(m: nn.Module) -> bool:
    return any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))


def uninitialisable(layer: nn.Module) -> str | None:
    """A submodule that holds tensors of its own but has no reset_parameters(), named; None when all can be reset."""
    for name, m in layer.named_modules():
        if _holds_tensors(m) and not callable(getattr(m, "reset_parameters", None)):
            return f"{name or 'the layer'} ({type(m).__name__})"
    return None


def init_layer(layer: nn.Module, index: int, seed: int, hook: Hook | None = None) -> None:
    """Initialise `layer` (on the CPU) in place, as layer `index` of a model seeded with `seed`."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.default_generator.manual_seed(layer_seed(seed, index))
        if hook is not None:
            hook(index, layer)
            return
        for m in layer.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
        if (what := uninitialisable(layer)) is not None:
            raise ValueError(f"layer {index}: {what} has parameters or buffers but no reset_parameters(); "
                             "give init_hook")


def materialise(layer: nn.Module, index: int, seed: int, device: torch.device, hook: Hook | None = None) -> nn.Module:
    """A layer built on the meta device, allocated on the CPU, initialised, then moved to `device`."""
    layer = layer.to_empty(device="cpu")
    init_layer(layer, index, seed, hook)
    return layer.to(device)


def per_layer(model: nn.Sequential, seed: int, hook: Hook | None = None) -> nn.Sequential:
    """Give `model` (on the CPU, or on the meta device) the weights `init: per_layer` gives its stages; in place."""
    for i in range(len(model)):
        layer = model[i]
        if any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
            model[i] = materialise(layer, i, seed, torch.device("cpu"), hook)
        else:
            init_layer(layer, i, seed, hook)
    return model
