"""A model's activation memory, measured layer by layer: what each layer keeps for its backward.

Each layer runs forward and backward as a stage runs it: its input received
detached, requiring grad where it wants a gradient back (the model's own
inputs want none), the last layer with the loss. An ActivationMeter
(gpipe.memory.meter) counts what autograd saves, and keeps it alive until the end, so
that a storage is the same number in every layer that holds it: a stage's
activations per micro-batch are then the union of its layers' storages, each
counted once (a layer's output that the next one saves is one tensor, as on
the stage). The backward is split as the zero-bubble schedules split it
(gpipe.split_backward): B, whose releasing shows what a micro-batch keeps for
its W (which is not run: its gradients are not wanted).

The loss, on the last layer, is measured apart too (`Loss`): what it makes
for a while and lets go of, which no layer saves, counted by storage as torch
makes and frees it (gpipe.memory.meter.Made): the output beside the loss's
forward, and the loss's backward down to the output's gradient, run once with
the graph kept. On a language model these are its logits and their copies,
the largest tensors of the last stage.

Measured at 2 and at 4 samples of the first micro-batch (SAMPLES), each figure
is a line in the micro-batch's size (`Line`): what grows with it, and what does
not (a mask or a table made in each forward). So the cost is two forwards and
backwards of a few samples, as the probe's, whatever the batch. The model is
left as it was: its parameters get no gradient, its buffers are put back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from gpipe import skip, structure
from gpipe.memory.meter import ActivationMeter, Made, storage_key
from gpipe.split_backward import backward_input

LossFn = Callable[[Any, Any], Any]
SAMPLES = (2, 4)  # the sizes measured (not 1: a dimension of size 1 lets some copies be views)


@dataclass(frozen=True)
class Line:
    """Bytes as a line in the micro-batch's size: `fixed` + `per_sample` x samples."""

    fixed: float = 0.0
    per_sample: float = 0.0

    def at(self, samples: int) -> int:
        return max(0, round(self.fixed + self.per_sample * samples))

    def __add__(self, other: Line) -> Line:
        return Line(self.fixed + other.fixed, self.per_sample + other.per_sample)

    @staticmethod
    def through(a: tuple[int, int], b: tuple[int, int]) -> Line:
        """The line through two (samples, bytes) points; flat through the first when they have the same size."""
        if a[0] == b[0]:
            return Line(float(a[1]))
        slope = (b[1] - a[1]) / (b[0] - a[0])
        return Line(a[1] - slope * a[0], slope)


Storages = dict[int, int]  # storage (gpipe.memory.meter.storage_key) -> its bytes


@dataclass(frozen=True)
class Loss:
    """The loss's own memory, measured on the last layer at one size (bytes), beyond what the layer saves for its
    backward: what the stage makes for a while at the loss and lets go of (gpipe.stage: F computes the loss of
    the output, B starts from it; a checkpointed micro-batch takes the output's gradients in F)."""

    forward: int  # the most the loss's forward made at once (a cross entropy's log-softmax of the logits)
    keeps: int  # what of it the forward keeps: its saved tensors and the loss (in `held` already)
    output: int = 0  # the layer's output (the logits) that nothing saved: alive while the loss runs, then freed
    whole: int = 0  # the layer's output, all of it (a checkpointed or an evaluation forward saves nothing)
    backward: int = 0  # the most the loss's backward makes at once, down to the output's gradient (the
    # log-softmax's gradient and the logits'), what the forward kept still held
    grad: int = 0  # the output's gradient (a checkpointed micro-batch keeps it from its F to its B)


@dataclass(frozen=True)
class LossLines:
    """The loss's memory (`Loss`) as what a last stage holds beyond its other figures at each of its moments,
    lines in the micro-batch's size (all flat at 0 on any other stage)."""

    forward: Line = Line()  # during F, beyond `held`: the output and what the loss's forward has made
    backward: Line = Line()  # during B, beyond `held`: the gradients the loss's backward makes
    grad: Line = Line()  # from a checkpointed F to its B, beyond its input: the output's gradient
    alone: Line = Line()  # during a checkpointed F, beyond its input: the output, the loss and its backward
    eval: Line = Line()  # during an evaluation's F, beyond its input: the output and the loss's forward


def _union(*parts: Storages) -> int:
    seen: Storages = {}
    for p in parts:
        seen.update(p)
    return sum(seen.values())


@dataclass
class Layers:
    """One measurement, at `samples` samples: per layer, the storages it saved for its backward (the loss's
    too, on the last layer), those of its input and its output (the loss, on the last layer), and those a
    split backward's B leaves for W (with the gradients B keeps for it)."""

    samples: int
    saved: list[Storages]
    inputs: list[Storages]
    outputs: list[Storages]
    kept: list[Storages]
    wants_grad: list[bool]  # per layer: whether its input wants a gradient (as a stage's first layer's would)
    loss: Loss | None = None  # the loss's own memory (on the last layer; None without a loss)

    def held(self, start: int, end: int) -> int:
        """What a stage of layers [start, end) holds of a micro-batch from its forward to its backward: its
        input, what its layers saved, its output."""
        return _union(self.inputs[start], *self.saved[start:end], self.outputs[end - 1])

    def kept_for_weights(self, start: int, end: int) -> int:
        """What it holds from B to W when the backward is split. A stage whose inputs want no gradient (the
        first) does nothing at B: it holds everything until W."""
        if not self.wants_grad[start]:
            return self.held(start, end)
        return _union(*self.kept[start:end])

    def input_bytes(self, start: int) -> int:
        """The stage's input: all a checkpointed forward keeps."""
        return sum(self.inputs[start].values())

    def output_bytes(self, end: int) -> int:
        """What the stage of layers [.., end) sends on."""
        return sum(self.outputs[end - 1].values())


@dataclass
class Footprint:
    """A model's activation memory measured at two sizes (`one`, `two`), the stages' figures as lines."""

    one: Layers
    two: Layers

    def line(self, figure: Callable[[Layers], int]) -> Line:
        """A figure of the measurements, as a line in the micro-batch's size."""
        return Line.through((self.one.samples, figure(self.one)), (self.two.samples, figure(self.two)))

    @property
    def layers(self) -> int:
        return len(self.one.saved)

    def loss(self) -> LossLines:
        """The loss's memory at each moment of the last stage (LossLines; flat at 0 without a loss)."""
        def of(figure: Callable[[Loss], int]) -> Line:
            return self.line(lambda m: figure(m.loss) if m.loss is not None else 0)

        return LossLines(forward=of(lambda x: x.output + x.forward - x.keeps), backward=of(lambda x: x.backward),
                         grad=of(lambda x: x.grad), alone=of(lambda x: x.whole + max(x.forward, x.keeps + x.backward)),
                         eval=of(lambda x: x.whole + x.forward))


class _Keeper(ActivationMeter):
    """An ActivationMeter that keeps alive every tensor it counted, so that no address is used twice."""

    def __init__(self, params: Sequence[torch.Tensor], alive: list[torch.Tensor]):
        super().__init__(params)
        self.alive = alive

    def hold(self, t: torch.Tensor) -> Any:
        self.alive.append(t)
        return super().hold(t)


def _storages(value: Any) -> Storages:
    return {k: t.untyped_storage().nbytes() for t in structure.tensors(value) if (k := storage_key(t))}


def samples_of(x: Any) -> int:
    """The samples of micro-batch `x`: its tensors' first dimension."""
    return max((t.size(0) for t in structure.tensors(x) if t.dim()), default=1)


def _first(value: Any, n: int) -> Any:
    return structure.map_tensors(value, lambda t: t[:n].clone())


class _Received(skip.Context):
    """Skip connections as a stage receives them: a pop gets the stashed tensor detached (its storage the same),
    requiring grad as it would on the popping stage, so each layer's backward stays its own."""

    def pop(self, name: str) -> torch.Tensor:
        t = super().pop(name)
        return t.detach().requires_grad_(t.is_floating_point() and t.requires_grad)


@contextlib.contextmanager
def _left_as_it_was(model: nn.Module) -> Iterator[None]:
    """Run on the model itself, then take back what running it changed: gradients, buffers, the train flags and
    the global RNG."""
    buffers = [(b, b.clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.random.fork_rng(), skip.use(_Received()):
            model.train()
            yield
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, mode in modes:
            m.training = mode


def measure_layers(model: nn.Sequential, x: Any, target: Any = None, loss_fn: LossFn | None = None,
                   autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                   ) -> Layers:
    """Run each layer of `model` on micro-batch `x` (then the loss on `target`, if given) and count (see the
    module's docstring). `autocast`: the context each forward runs in (the job's precision)."""
    samples = samples_of(x)
    params = [*model.parameters()]
    alive: list[torch.Tensor] = []  # every tensor counted, kept to the end: no address is reused
    out = Layers(samples, [], [], [], [], [])
    with _left_as_it_was(model):
        for i, layer in enumerate(model):
            meter = _Keeper(params, alive)
            with meter.hooks():
                with autocast():
                    y = layer(x)
                    low = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
                if i == len(model) - 1 and loss_fn is not None:
                    made = Made()
                    with made:  # as the stage takes it: outside autocast, its output cast up to float32
                        end = loss_fn(_for_loss(y, low), target)
                    out.loss = Loss(forward=made.peak, keeps=made.now)
                else:
                    end = y
            alive += structure.tensors((x, y, end))
            out.saved.append(meter.held())
            out.inputs.append(_storages(x))
            out.outputs.append(_storages(end))
            ins = [t for t in structure.tensors(x) if t.requires_grad]
            out.wants_grad.append(bool(ins))
            roots = [t for t in structure.tensors(end) if t.requires_grad]
            if out.loss is not None and i == len(model) - 1:
                out.loss = _loss_backward(out.loss, y, roots, out.inputs[i] | out.saved[i] | out.outputs[i])
            w = backward_input(roots, [torch.ones_like(t) for t in roots], ins,
                               [p for p in layer.parameters() if p.requires_grad], meter.releasing)
            kept = [g for group in w.groups for grads in group.kept.values() for g in grads if g is not None]
            alive += kept
            out.kept.append(meter.held() | _storages(kept))
            del w  # W itself is not run: what it would free is known, and its gradients are not wanted
            x = structure.map_tensors(y, lambda t: t.detach().requires_grad_(t.is_floating_point() and
                                                                              t.requires_grad))
    return out


def _for_loss(y: Any, low: torch.dtype | None) -> Any:
    """The output as the loss takes it (gpipe.precision.for_loss): the autocast dtype's tensors cast up."""
    return structure.map_tensors(y, lambda t: t.float() if t.dtype == low else t)


def _loss_backward(loss: Loss, y: Any, roots: list[torch.Tensor], held: Storages) -> Loss:
    """`loss` with the figures of its output `y` and of its backward from `roots` down to `y`'s gradient, run
    once more than the layer's own (the graph retained), with `held` (what the layer holds) alive."""
    ys = _storages(y)
    loss = replace(loss, output=sum(n for k, n in ys.items() if k not in held), whole=sum(ys.values()))
    outs = [t for t in structure.tensors(y) if t.requires_grad]
    if not outs or not roots:
        return loss
    made = Made()
    with made:
        got = torch.autograd.grad(roots, outs, [torch.ones_like(t) for t in roots], retain_graph=True,
                                  allow_unused=True)
    grad = _union(_storages([g for g in got if g is not None]))
    return replace(loss, backward=made.peak, grad=grad)


def measure(model: nn.Sequential, x: Any, target: Any = None, loss_fn: LossFn | None = None,
            autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> Footprint:
    """`measure_layers` at the first SAMPLES samples of micro-batch (x, target) (as many as it has, if fewer)."""
    return Footprint(*(measure_layers(model, _first(x, n), _first(target, n) if target is not None else None,
                                      loss_fn, autocast) for n in SAMPLES))
