"""A model built without its weights: its parameters on the meta device, its buffers' values kept aside.

A stage (and, with `model.weights` or `init: per_layer`, the coordinator) builds the model only to know its
structure, capture it, and take its own pieces; no process holds the whole model's weights. Building under
`torch.device("meta")` alone would also lose the values of the buffers a model computes as it is built and never
saves (Llama's rotary `inv_freq`, a causal mask, a positional table): they are no weights, no file holds them,
and no init recomputes them. So while the factory runs, each parameter is moved to the meta device as it is
registered (its initialisation then costs nothing), the buffers are built as the model builds them, and
`skeleton` hands their values back by name before moving them to the meta device too (the capture needs one
device). `fill_buffers` puts them back into a stage's pieces.

Whether a model built so can stand for the model built whole is decided here,
for the coordinator's plan (the whole model) and a stage (its slice): both
capture where the parameters are (`capture_pieces`) and build whole when the
build or the capture fails on the meta device; a stage's slice that keeps a
tensor that is no parameter or buffer (`plain_tensor`) is built whole, and so
is the plan's model when its captured forward makes a constant the build does
not hold (`unknown_constant`: a stage then gets that constant with its weights).

The coordinator's plan captures the model once; a stage takes its own pieces from that capture (`pack`,
StageConfig.pieces) rather than capturing the model again (seconds of torch.export for a language model, in
every worker). They come without weights, every tensor on the meta device as a stage's own capture of a
skeleton would hold it, and the stage goes on from them as from its own. They are pickled: they cross torch
RPC, which pickles everything it carries (its ports are the cluster's own, behind the NetworkPolicy), or go to
a process the plan starts itself (gpipe.coordinator.plan.baseline), or stay in the process (gpipe.Pipeline's
and the tests' stages); nothing is read from disk so.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from gpipe import cuts
from gpipe.capture import graph as capture

_lock = threading.Lock()  # the patch below is process-wide: one build at a time
_building = threading.local()  # and it acts in the thread that builds: another thread's modules are its own


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While inside: every parameter this thread registers on a module is moved to the meta device first."""
    with _lock:
        register = nn.Module.register_parameter  # under the lock: the original, never another build's patch

        def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and not param.is_meta and getattr(_building, "active", False):
                param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            register(self, name, param)

        nn.Module.register_parameter = on_meta  # type: ignore[method-assign]  # restored below
        _building.active = True
        try:
            yield
        finally:
            _building.active = False
            nn.Module.register_parameter = register  # type: ignore[method-assign]


def skeleton(build: Callable[[], Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """`build()`'s model with every parameter and buffer on the meta device, and its buffers' values as built
    (by the model's names: named_buffers(), persistent or not)."""
    with parameters_on_meta():
        model = build()
    if not isinstance(model, nn.Module):
        return model, {}
    values = {name: b for name, b in model.named_buffers() if not b.is_meta}
    for m in model.modules():
        for leaf, b in m._buffers.items():
            if b is not None and not b.is_meta:
                m._buffers[leaf] = b.to("meta")
    return model, values


def fill_buffers(layers: nn.Module, values: dict[str, torch.Tensor], name_of: Callable[[str], str]) -> None:
    """Copy the built values of `layers`' buffers into them (each buffer found by `name_of` its key)."""
    with torch.no_grad():
        for key, b in layers.named_buffers():
            v = values.get(name_of(key))
            if v is not None and v.shape == b.shape:
                b.copy_(v)


def capture_pieces(model: nn.Module, args: dict[str, Any]) -> capture.Captured:
    """`model` captured as gpipe.capture.graph cuts it (`args`: StageConfig.capture's split_points, output and the first
    micro-batch's signature), on a sample made where its parameters are: the meta device for a skeleton."""
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    return capture.capture(model, capture.sample_from(args["sample"], device), args["split_points"] or (),
                           args["output"])


def plain_tensor(model: nn.Module) -> str | None:
    """A tensor on the meta device that `model` keeps as a plain attribute, no parameter or buffer ("Module.name"):
    a model built on the meta device that keeps one cannot stand for the model built whole; None if none."""
    for m in model.modules():
        for name, v in vars(m).items():
            if isinstance(v, torch.Tensor) and v.is_meta:
                return f"{type(m).__name__}.{name}"
    return None


def unknown_constant(pieces: nn.Module, built: dict[str, torch.Tensor]) -> str | None:
    """A tensor of captured `pieces` that is neither saved (a weight) nor a buffer the model built (`built`, by the
    model's names): a constant the captured forward makes, which only a model built whole is sure to hold."""
    saved = set(pieces.state_dict())
    for key, _ in pieces.named_buffers():
        if key not in saved and capture.model_name(key) not in built:
            return capture.model_name(key)
    return None


def pack(pieces: nn.Sequential, start: int, end: int) -> bytes:
    """Pieces [start, end) of a capture, pickled without their values: every parameter, buffer and plain tensor on
    the meta device (a tied weight still one tensor), as a stage's own capture of a skeleton holds them; the
    graphs as they are. What StageConfig.pieces carries to the stage (see the module's doc)."""
    part = cuts.layers(pieces, start, end)
    memo: dict[int, Any] = {}
    for p in part.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for m in part.modules():
        for v in [*m._buffers.values(), *vars(m).values()]:
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and id(v) not in memo:
                memo[id(v)] = torch.empty_like(v, device="meta")
    return pickle.dumps(copy.deepcopy(part, memo), protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> nn.Sequential:
    """What `pack` made: the pieces under their indices in the whole capture ("3", "4", ...)."""
    with warnings.catch_warnings():  # a tree spec's leaves come back through torch's deprecated LeafSpec
        warnings.simplefilter("ignore", FutureWarning)
        layers = pickle.loads(data)  # noqa: S301 - from the coordinator over torch RPC (see the module's doc)
    if not isinstance(layers, nn.Sequential):
        raise TypeError(f"expected the stage's pieces, got a {type(layers).__name__}")
    return layers
