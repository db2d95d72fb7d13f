"""Randomness that does not depend on where the model is cut.

Layer l, on micro-batch i of step s, draws from the default generator seeded
with `layer_seed(seed, s, i, l)`. So dropout masks are the same for any stage
count and balance, the same as on one device, and the same when activation
checkpointing recomputes a forward in the backward.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules import module as _module

from gpipe import structure

_MASK = (1 << 64) - 1
_NONE = torch.empty(0)  # the device of a structure with no tensor: the CPU's
_NOT = object()
_CPU_GENERATORS = [torch.default_generator]  # generators(torch.device("cpu")), as a forward on the CPU seeds them


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

    A layer that may draw random numbers seeds them and runs its forward holding
    this lock, so no other stage's seed lands between its seed and its draws;
    a layer that provably draws none (`quiet`: torch.nn's own modules that
    draw nothing, a captured graph with no operation that may draw) neither
    seeds nor waits. Any other layer may draw: a custom module calling
    F.dropout or torch.rand in its forward is seeded with no mark needed, so its
    recomputation under activation checkpointing replays its forward's draws.
    `gpipe_random = False` on a module class of the user's says that its own
    forward draws nothing (its submodules are still looked at): a hint that
    lets stages run it at once, never needed for the right result.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._draws: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

    def draws(self, layer: nn.Module) -> bool:
        if hooked():  # a forward hook of every module runs inside every layer: any layer may draw
            return True
        known = self._draws.get(layer)
        if known is None:
            known = self._draws[layer] = not quiet(layer)
        return known


# torch.nn's own modules whose forward draws no random numbers, by exact class (a subclass may have a forward of
# its own). A container's forward calls its children, each proven on its own.
_QUIET_CLASSES: dict[type, Any] = {cls: cls.forward for cls in (
    nn.Module,  # exactly: a holder of parameters under nested names, with no forward (a captured piece's)
    nn.Sequential, nn.Identity, nn.Flatten, nn.Unflatten,
    nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh,
    nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.GLU,
    nn.Softmax, nn.LogSoftmax,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
)}  # each with its forward as torch defines it: one patched since (a library's noise) is not vouched for
_MHA_FORWARD = nn.MultiheadAttention.forward  # as torch defines it: draws only with dropout
# torch's own operations, told apart by their tags; any other library's (torch.library.custom_op: an attention
# kernel with its dropout) may draw, whatever its tags say.
_TAGGED_NAMESPACES = ("aten", "prims")
# Functions a captured graph may call that draw nothing, besides torch's operations.
_QUIET_FUNCTIONS: set[Callable[..., Any]] = {operator.getitem}


def vouch(what: Any) -> Any:
    """Mark a module class of ours whose own forward draws no random numbers (its submodules are proven on their
    own), or a function a captured graph calls that draws none. Returns it: usable as a decorator."""
    if isinstance(what, type):
        _QUIET_CLASSES[what] = getattr(what, "forward", None)
    else:
        _QUIET_FUNCTIONS.add(what)
    return what


def graph_draws(gm: fx.GraphModule) -> bool:
    """Whether a captured graph may draw random numbers: it calls an operation torch tags as drawing from a
    generator (dropout, bernoulli, rand, attention with its dropout...), an operation of another library than
    torch's (whose tags say nothing of it), or anything else this module cannot vouch for."""
    for n in gm.graph.nodes:
        if n.op == "call_method":
            return True
        if n.op != "call_function":
            continue
        target = n.target
        if target in _QUIET_FUNCTIONS:
            continue
        if isinstance(target, torch._ops.OpOverload) and target.namespace in _TAGGED_NAMESPACES:
            if torch.Tag.nondeterministic_seeded in target.tags:
                return True
        else:
            return True
    return False


def quiet(layer: nn.Module) -> bool:
    """Whether `layer`'s forward provably draws no random numbers: every module in it is one of torch.nn's own that
    draws none (its exact class, its class's forward), one vouched for (`vouch`, or `gpipe_random = False` on the
    module: its own forward draws none), or a captured graph that calls no operation which may draw; none has a
    forward hook or is marked `gpipe_random = True`."""
    for m in layer.modules():
        marked = getattr(m, "gpipe_random", None)
        if m._forward_hooks or m._forward_pre_hooks or marked is True:
            return False
        if marked is False:
            continue  # the user's word for this module's own forward; its submodules are looked at on their own
        if isinstance(m, fx.GraphModule):
            if graph_draws(m):
                return False
            continue
        if type(m) is nn.MultiheadAttention and type(m).forward is _MHA_FORWARD:
            if m.dropout > 0:
                return False
            continue  # attention without dropout: its forward draws nothing
        if _QUIET_CLASSES.get(type(m), _NOT) is not type(m).forward:
            return False
        own = m.__dict__.get("forward")
        if own is not None and getattr(own, "func", own) not in _QUIET_FUNCTIONS:
            return False  # an instance's own forward: only one vouched for (gpipe.grad_in_place's fused linear)
    return True


def seeding(layers: Sequence[tuple[int, nn.Module]], loss_follows: bool = True) -> list[bool]:
    """Which of a stage's (global index, layer) pairs its forward seeds: each that may draw and, when the loss
    follows the forward (the last stage), the last.

    Seeding a layer that draws nothing changes no draw: the next layer that draws is seeded before it. Before a
    loss the last is seeded still, so that the loss finds the generator as the last layer's seed left it, as on
    one device; after another stage's forward nothing draws before a layer that is seeded. Seeding costs a
    microsecond a layer, some 10 us right after the layers' products have taken the caches (bench/README.md
    (ac)). Decided when the stage is built: a hook registered on one of its layers later is not seen (one
    registered on every module is: `seeded_forward`).
    """
    return [(loss_follows and i == len(layers) - 1) or not quiet(m) for i, (_, m) in enumerate(layers)]


def hooked() -> bool:
    """Whether a forward hook of every module is registered (torch.nn.modules.module's
    register_module_forward_hook): it runs inside every layer, so any layer may draw."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)


def _generators_of(x: Any) -> Sequence[torch.Generator]:
    """The generators a forward of `x` draws from: those of its first tensor's device."""
    if type(x) is torch.Tensor and x.is_cpu:  # (a bool: cheaper than the device object x.device makes)
        return _CPU_GENERATORS
    return generators(x.device if type(x) is torch.Tensor else next(iter(structure.tensors(x)), _NONE).device)


def seeded_forward(layers: Iterable[tuple[int, nn.Module]], x: Any, seed: int, step: int, micro_batch: int,
                   shared: SharedGenerators | None = None, seeded: Sequence[bool] | None = None) -> Any:
    """Run (global index, layer) pairs in order, seeding each layer's randomness.

    `x` is what the first layer takes (a tensor, or a structure of them: gpipe.structure);
    the generators seeded are those of its first tensor's device. With `shared`, only the layers
    that draw are seeded, each under its lock. `seeded`: which layers to seed (`seeding`; empty: none), else
    every one.
    """
    if shared is None:
        # A forward hook of every module (torch.nn.modules.module.register_module_forward_hook) runs inside
        # every layer, so any layer may draw: each is seeded.
        every = seeded is None or hooked()
        if not every and not seeded:  # (an empty `seeded`: no layer draws)
            for _, layer in layers:
                x = layer(x)
            return x
        key, x0 = -1, x  # the micro-batch's key and the generators of x0's device: when a layer is first seeded
        for i, (index, layer) in enumerate(layers):
            if every or seeded[i]:  # type: ignore[index]  # (every: seeded None)
                if key < 0:
                    key, gens = _micro_batch_key(seed, step, micro_batch), _generators_of(x0)
                s = _mix(key ^ index) >> 1  # layer_seed(seed, step, micro_batch, index)
                for g in gens:
                    g.manual_seed(s)
            x = layer(x)
        return x
    gens, key = _generators_of(x), _micro_batch_key(seed, step, micro_batch)
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
