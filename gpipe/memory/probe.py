"""The probe: one small micro-batch forward and backward through the model, layer by layer, as the stages would.

Before anything starts (`validate`, and every `run` and `submit`), the model
runs on the CPU of the host that validates, on a copy of its initial weights,
with at most PROBE_SAMPLES samples of the first micro-batch. Every layer
boundary is treated as a cut: what a layer returns goes through the wire
format's checks (gpipe.wire.encode, with the dtypes the job's backend
carries: gloo on the CPU, NCCL on CUDA) and reaches the next layer as
the stage would receive it, detached, requiring grad where it wants a
gradient back; the backward then runs layer by layer with the gradients the
stages would send. So a model that cannot be pipelined fails here, naming the
layer and what it received, not in the middle of a run. The probe also
records which layer stashes and which pops each skip connection (gpipe.skip),
and refuses a pop with no stash, a name stashed twice or popped twice, and a
stash that no later layer pops.

Its cost is one forward and backward of a few samples and a copy of the
model; `probe: false` in the spec skips it for a model too big for that host.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpipe import skip, structure
from gpipe.errors import SpecError
from gpipe.show import first_line
from gpipe.stage import backward
from gpipe.wire import encode, gradient_message, gradients, wants_grad

PROBE_SAMPLES = 2  # samples of the first micro-batch the probe runs

LossFn = Callable[[Any, Any], Any]  # (the last layer's output, the target) -> a scalar tensor


def _received(y: Any, wants: list[bool]) -> Any:
    """`y` as the next stage gets it: detached copies, requiring grad where it wants a gradient back."""
    it = iter(wants)
    return structure.map_tensors(y, lambda t: t.detach().clone().requires_grad_(next(it)))


def _grads(x: Any) -> list[torch.Tensor]:
    """The gradients a stage sends back for its input `x`."""
    wanted = [t for t in structure.tensors(x) if t.requires_grad]
    return gradients(gradient_message(wanted)) if wanted else []


@dataclass
class _Skip:
    stashed_by: int
    sent: torch.Tensor  # as stashed, in the graph of its layer
    received: torch.Tensor | None = None  # as the popping layer gets it
    popped_by: int | None = None


class Recorder(skip.Context):
    """The probe's skip context: records the routes and refuses a pop with no stash or a name stashed twice;
    `check`, once the forward is done, refuses a stash that no layer popped."""

    def __init__(self, backend: str = "gloo") -> None:
        super().__init__()
        self.backend = backend  # what carries a skip between stages (gpipe.wire.CARRIES)
        self.layer = 0
        self.skips: dict[str, _Skip] = {}

    def stash(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.skips:
            raise skip.SkipError(f"layers {self.skips[name].stashed_by} and {self.layer} both stash {name!r}: "
                                 "a name is stashed once per forward")
        try:
            encode(0, tensor, [tensor.is_floating_point()], self.backend)
        except ValueError as e:
            raise skip.SkipError(f"layer {self.layer} stashes {name!r}, {structure.describe(tensor)}, which cannot "
                                 f"travel between stages: {e}") from None
        self.skips[name] = _Skip(self.layer, tensor)

    def pop(self, name: str) -> torch.Tensor:
        s = self.skips.get(name)
        if s is None:
            raise skip.SkipError(f"layer {self.layer} pops {name!r}, which no earlier layer stashed")
        if s.popped_by is not None:
            raise skip.SkipError(f"layers {s.popped_by} and {self.layer} both pop {name!r} (stashed by layer "
                                 f"{s.stashed_by}): a stash is popped once")
        s.popped_by = self.layer
        wants = s.sent.is_floating_point() and s.sent.requires_grad
        s.received = s.sent.detach().clone().requires_grad_(wants)
        return s.received

    def check(self) -> None:
        """SkipError naming the layer and the name when a stash was popped by no later layer (the forward done)."""
        for name, s in self.skips.items():
            if s.popped_by is None:
                raise skip.SkipError(f"layer {s.stashed_by} stashes {name!r}, which no later layer pops")

    def routes(self) -> dict[str, tuple[int, int]]:
        """name -> (the layer that stashes it, the layer that pops it), for the names popped."""
        return {n: (s.stashed_by, s.popped_by) for n, s in self.skips.items() if s.popped_by is not None}


def _first_samples(x: Any, target: Any) -> tuple[Any, Any]:
    """The first PROBE_SAMPLES samples of micro-batch (x, target)."""
    n = min(PROBE_SAMPLES, *(t.size(0) for t in structure.tensors(x)))
    return structure.map_tensors(x, lambda t: t[:n]), structure.map_tensors(target, lambda t: t[:n])


def probe_eval(model: nn.Sequential, x: Any, target: Any, loss_fn: LossFn) -> None:
    """Run the first samples of eval micro-batch (x, target) through `model` and the loss, in eval mode and
    without gradients, as an evaluation would; SpecError naming eval.data when they do not fit."""
    x, target = _first_samples(x, target)
    model = copy.deepcopy(model).eval()
    if not any(t.is_meta for t in model.parameters()):  # on the meta device (gpipe.capture.skeleton): shapes only
        model = model.cpu()
    try:
        with torch.no_grad(), torch.random.fork_rng():
            loss_fn(model(x), target)
    except Exception as e:
        raise SpecError(f"eval.data: its first samples do not fit the model or the loss: {first_line(e)}") from None


def probe(model: nn.Sequential, x: Any, target: Any, loss_fn: LossFn,
          backend: str = "gloo") -> dict[str, tuple[int, int]]:
    """Run micro-batch (x, target) through `model` as the stages would; return the skip routes.

    SpecError naming the layer and what it received when a layer fails, or
    returns what cannot cross a cut over `backend` (its dtype named), or the loss or a backward fails.
    """
    x, target = _first_samples(x, target)
    model = copy.deepcopy(model).cpu().train()  # the plan's model holds the initial weights: leave it be
    rec = Recorder(backend)
    inputs, outputs, wants_of = [], [], []
    with torch.random.fork_rng(), skip.use(rec):
        torch.manual_seed(0)
        for i, layer in enumerate(model):
            rec.layer = i
            what = f"layer {i} ({type(layer).__name__})"
            try:
                y = layer(x)
            except skip.SkipError as e:
                raise SpecError(f"model: {e}") from None
            except Exception as e:
                raise SpecError(f"model: {what} raised {first_line(e)}, given {structure.describe(x)}") from None
            inputs.append(x)
            outputs.append(y)
            if i == len(model) - 1:
                break
            wants = wants_grad(y, checkpointed=False)
            try:
                encode(0, y, wants, backend)
            except ValueError as e:
                raise SpecError(f"model: {what} returned {structure.describe(y)}, which cannot cross to layer "
                                f"{i + 1}: {e}") from None
            wants_of.append(wants)
            x = _received(y, wants)
        try:
            rec.check()
        except skip.SkipError as e:
            raise SpecError(f"model: {e}") from None
        try:
            loss = loss_fn(y, target)
        except Exception as e:
            raise SpecError(f"loss: raised {first_line(e)}, given the output {structure.describe(y)} and the "
                            f"target {structure.describe(target)}") from None
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            raise SpecError(f"loss: returned {structure.describe(loss)}, expected a floating-point scalar")
        _backward(model, loss, inputs, outputs, wants_of, rec)
    return rec.routes()


def _backward(model: nn.Sequential, loss: torch.Tensor, inputs: list[Any], outputs: list[Any],
              wants_of: list[list[bool]], rec: Recorder) -> None:
    """Layer by layer from the loss back, each with the gradients of its output and of the skips it stashed."""
    for i in reversed(range(len(model))):
        what = f"the backward of layer {i} ({type(model[i]).__name__})"
        try:
            skips = [(s.sent, s.received.grad if s.received.grad is not None else torch.zeros_like(s.received))
                     for s in rec.skips.values() if s.stashed_by == i and s.received is not None
                     and s.received.requires_grad]
            if i == len(model) - 1:
                backward(loss, [True], [torch.ones_like(loss)], skips)
            else:
                backward(outputs[i], wants_of[i], _grads(inputs[i + 1]), skips)
        except Exception as e:
            raise SpecError(f"model: {what} raised {first_line(e)}") from None
