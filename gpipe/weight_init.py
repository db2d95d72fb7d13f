"""Initial weights that do not depend on where the model is cut: `init: per_layer`.

Layer i of the un-partitioned nn.Sequential is initialised on the CPU from the
default generator seeded by `layer_seed(seed, i)`: each of its submodules'
`reset_parameters()` in `modules()` order, or a hook given (layer index,
layer). So a stage can build its own layers, one at a time, without any
process building the whole model, and the weights are the same for any stage
count and balance, and the same as `per_layer(model, seed)` on one device.

A model that is not an nn.Sequential (gpipe.capture.graph) is initialised a module at a time, not a layer: each
submodule that owns parameters (under the model's own names: a tied weight's owner is the module
named_parameters() names it by) gets its own parameters from the generator seeded by `module_seed(seed, its
name)`, through its reset_parameters() or the hook given (its name, the module), on a copy that holds only
its own parameters (its submodules' are theirs to set). Its buffers are as the model builds them. So a stage
sets the parameters of its pieces alone, and `per_module(model, seed)` gives one device the same weights.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from gpipe.rng import _mix as mix  # the splitmix64 step the forward seeds use

Hook = Callable[[int, nn.Module], None]
ModuleHook = Callable[[str, nn.Module], None]  # a captured model's: (the module's name, the module)


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


def module_seed(seed: int, name: str) -> int:
    """The seed of the parameters that submodule `name` of a captured model owns."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return mix(mix(mix(seed) ^ 0x40D) ^ h) >> 1


def owners(names: Iterable[str]) -> dict[str, list[str]]:
    """Parameter names ("a.b.weight") grouped by the module that owns them: {"a.b": ["weight"]}."""
    out: dict[str, list[str]] = {}
    for n in names:
        owner, _, leaf = n.rpartition(".")
        out.setdefault(owner, []).append(leaf)
    return out


def own_values(module: nn.Module, name: str, seed: int, hook: ModuleHook | None = None) -> dict[str, torch.Tensor]:
    """The initial values of `module`'s own parameters (not its submodules'), on the CPU: a copy of it holding
    fresh tensors of its own, given to `hook(name, copy)` or its reset_parameters() under module_seed."""
    clone = copy.copy(module)  # its submodules are shared, and not written here (see the module's doc)
    clone._parameters = {k: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
                         for k, p in module._parameters.items()}
    clone._buffers = {k: None if b is None else torch.zeros(b.shape, dtype=b.dtype)
                      for k, b in module._buffers.items()}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.default_generator.manual_seed(module_seed(seed, name))
        if hook is not None:
            hook(name, clone)
        else:
            clone.reset_parameters()  # type: ignore[operator]  # checked: unresettable()
    return {k: p.detach() for k, p in clone._parameters.items() if p is not None}


def unresettable(model: nn.Module, pieces: nn.Module) -> str | None:
    """A module of `model` owning parameters of `pieces` (gpipe.capture.graph) with no reset_parameters(), named."""
    for owner in owners(k.split(".", 1)[1] for k, _ in pieces.named_parameters()):
        m = model.get_submodule(owner)
        if not callable(getattr(m, "reset_parameters", None)):
            return f"{owner or 'the model'} ({type(m).__name__})"
    return None


def init_pieces(pieces: nn.Module, model: nn.Module, seed: int, hook: ModuleHook | None = None) -> None:
    """Set the parameters of a stage's pieces (keys "i.name", gpipe.capture.graph) as per_module sets `model`'s; the
    modules of `model` (on the meta device) are read, not written."""
    values: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for key, p in pieces.named_parameters(remove_duplicate=False):
            owner, _, leaf = key.split(".", 1)[1].rpartition(".")
            if owner not in values:
                values[owner] = own_values(model.get_submodule(owner), owner, seed, hook)
            p.copy_(values[owner][leaf])


def per_module(model: nn.Module, seed: int, hook: ModuleHook | None = None) -> nn.Module:
    """Give `model` (built whole, on the CPU) the weights `init: per_layer` gives a captured model's stages;
    in place. The one-device reference of a captured model's per_layer."""
    groups = owners(n for n, _ in model.named_parameters())
    values = {owner: own_values(model.get_submodule(owner), owner, seed, hook) for owner in groups}
    with torch.no_grad():
        for owner, leaves in groups.items():
            m = model.get_submodule(owner)
            for leaf in leaves:
                getattr(m, leaf).copy_(values[owner][leaf])
    return model
