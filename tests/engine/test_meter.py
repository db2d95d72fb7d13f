"""The activation meter's two ways to count (gpipe.memory.meter): a handle per saved tensor, and a micro-batch's saved
tensors counted until its backward ends. The stage counts the second way when its backward is not split; the
figures must be the handles' ones."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from gpipe import grad_in_place
from gpipe.memory.meter import ActivationMeter, storage_key


def model(name: str, monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    torch.manual_seed(0)
    if name == "transformer":  # views, a weight saved transposed, softmax's saved output, layer norm's statistics
        return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
    if name == "fused-mlp":  # as a worker's stage runs its linears
        monkeypatch.setattr(grad_in_place, "IN_PLACE_BYTES", 0)
        assert grad_in_place.fuse(m) == 3
    return m


@pytest.mark.parametrize("name", ["mlp", "fused-mlp", "transformer"])
def test_counting_until_the_backward_tallies_as_the_handles_do(name, monkeypatch):
    """1f1b's order on one stage with 3 micro-batches in flight at most: the same bytes held after each forward
    and each backward, the same peak, nothing once every backward is done, and no parameter counted."""
    plain = model(name, monkeypatch)
    xs = [torch.randn(2, 4, 8) if name == "transformer" else torch.randn(4, 8) for _ in range(5)]
    order = ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "B3", "B4"]
    tallies = []
    for way in ("hooks", "counting"):
        layers = copy.deepcopy(plain)
        meter = ActivationMeter(list(layers.parameters()))
        held: dict[int, tuple[torch.Tensor, object]] = {}
        seen = []
        for act in order:
            mb = int(act[1])
            if act[0] == "F":
                x = xs[mb].clone().requires_grad_()
                with meter.hooks() if way == "hooks" else meter.counting(mb):
                    y = layers(x).square().mean()
                handle = meter.hold(x) if way == "hooks" else meter.add(mb, [x])
                held[mb] = (y, handle)
            else:
                y, handle = held.pop(mb)
                y.backward()
                del y, handle
                if way == "counting":
                    meter.release(mb)
            seen.append(meter.current)
        tallies.append((seen, meter.peak))
        assert meter.current == 0 and not meter.held()
    assert tallies[0] == tallies[1]
    assert tallies[0][1] > 0


def test_a_failed_step_s_micro_batches_are_let_go_and_other_chunks_kept():
    """release_all(keep): the stage's own keys go at a step's start (what a failed step left); another model chunk
    sharing the meter keeps its own."""
    layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    meter = ActivationMeter(list(layers.parameters()))
    outs = []
    for key in ((0, 0), (0, 1), (1, 0)):
        with meter.counting(key):
            outs.append(layers(torch.randn(4, 8, requires_grad=True)))
    one = meter.current // 3
    meter.release_all(keep=lambda key: key[0] != 0)
    assert meter.current == one
    meter.release_all()
    assert meter.current == 0 and not meter.held()


def test_parameters_saved_under_counting_are_not_counted():
    linear = nn.Linear(8, 8)
    meter = ActivationMeter(list(linear.parameters()))
    x = torch.randn(4, 8, requires_grad=True)  # the linear saves the input and the weight
    with meter.counting(0):
        y = linear(x)
    assert meter.current == x.untyped_storage().nbytes()  # the input, not the weight
    y.sum().backward()
    meter.release(0)
    assert meter.current == 0


@pytest.mark.parametrize("way", ["counting", "checking", "autograd"])
def test_a_saved_tensor_changed_in_place_fails_the_backward_as_autograd_does_but_a_buffer(way):
    """Hooks turn autograd's version check off; the meter's keep it, so a counted step, an uncounted one and one
    device agree: an input changed in place after the forward saved it fails the backward. The stage's buffers
    are exempt: BatchNorm's running statistics, which the next micro-batch's forward updates under an earlier
    one's graph (its backward does not read them)."""
    bn, linear = nn.BatchNorm1d(8), nn.Linear(8, 8)
    meter = ActivationMeter([*linear.parameters(), *bn.parameters()])
    meter.exempt |= {storage_key(b) for b in bn.buffers()}

    def ctx() -> contextlib.AbstractContextManager[object]:
        return {"counting": meter.counting(0), "checking": meter.checking, "autograd": contextlib.nullcontext()}[way]

    x = torch.randn(4, 8, requires_grad=True)
    with ctx():
        y = bn(x)
        bn(torch.randn(4, 8))  # the next micro-batch's forward: the running statistics change in place
    y.sum().backward()
    assert x.grad is not None
    saved = torch.randn(4, 8, requires_grad=True) * 1.0
    with ctx():
        z = linear(saved)
    with torch.no_grad():
        saved.mul_(2)  # the input the linear saved, changed before its backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()
