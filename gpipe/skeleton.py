"""A model built without its weights: its parameters on the meta device, its buffers' values kept aside.

A stage (and, with `model.weights` or `init: per_layer`, the coordinator) builds the model only to know its
structure, capture it, and take its own pieces; no process holds the whole model's weights. Building under
`torch.device("meta")` alone would also lose the values of the buffers a model computes as it is built and never
saves (Llama's rotary `inv_freq`, a causal mask, a positional table): they are no weights, no file holds them,
and no init recomputes them. So while the factory runs, each parameter is moved to the meta device as it is
registered (its initialisation then costs nothing), the buffers are built as the model builds them, and
`skeleton` hands their values back by name before moving them to the meta device too (the capture needs one
device). `fill_buffers` puts them back into a stage's pieces.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

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
