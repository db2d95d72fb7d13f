"""gpipe.split_backward: B (the inputs' gradients) then W (the weights') equal one plain backward, and compute
nothing twice (the matmuls are counted)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gpipe import grad_in_place
from gpipe.memory.meter import ActivationMeter
from gpipe.split_backward import backward_input

MATMULS = {"aten.mm", "aten.addmm", "aten.addmm_", "aten.bmm"}


class Matmuls(TorchDispatchMode):
    """Counts the matrix products run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += str(func.overloadpacket) in MATMULS
        return func(*args, **(kwargs or {}))


class Twice(nn.Module):
    """One Linear used twice in a row: its weight is reached from two split nodes, one below the other."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


class Apart(nn.Module):
    """Two outputs, one of which no input reaches (a parameter's own function)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pos = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.lin(x), (self.pos * 2).expand(3, 4).sin()


class Halves(nn.Module):
    """A node with two outputs (chunk) between the weights and the input."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(4, 4)

    def forward(self, x):
        h1, h2 = self.a(x).chunk(2, dim=1)
        return self.b(torch.relu(h1)) * h2


class Mixed(nn.Module):
    """A Linear's weight used by the Linear and again by a plain matmul above it: fused, one split node defers
    its weight's gradient to W and the other takes an autograd pass."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h @ self.lin.weight.T


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


CASES = [("mlp", mlp, True, 0), ("first-stage", mlp, False, 0), ("halves", Halves, True, 0),
         ("apart", Apart, True, 0), ("a-weight-used-twice", Twice, True, 1), ("mixed", Mixed, True, 1)]


@pytest.fixture(params=[False, True], ids=["autograd", "fused"])
def fused(request, monkeypatch) -> bool:
    """Whether the split model's Linear layers are grad_in_place's (fuse, at every size): their weights'
    gradients kept on the node in B and computed in W without autograd."""
    monkeypatch.setattr(grad_in_place, "IN_PLACE_BYTES", 0 if request.param else 1 << 62)
    return bool(request.param)


@pytest.mark.parametrize(("name", "make", "input_grad", "again"), CASES, ids=[c[0] for c in CASES])
def test_b_then_w_equals_one_backward_and_computes_nothing_twice(fused, name, make, input_grad, again):
    torch.manual_seed(0)
    plain = make()
    split = copy.deepcopy(plain)
    assert (grad_in_place.fuse(split) > 0) == fused
    x = torch.randn(3, 4)
    xp, xs = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
    meter = ActivationMeter(list(split.parameters()))
    yp = plain(xp)
    with meter.hooks():  # B lets go of what W will not use (gpipe.memory.meter.ActivationMeter.releasing)
        ys = split(xs)
    yp, ys = (yp if isinstance(yp, tuple) else (yp,)), (ys if isinstance(ys, tuple) else (ys,))
    grads = [torch.randn_like(t) for t in yp]
    whole, b, w = Matmuls(), Matmuls(), Matmuls()
    with whole:
        torch.autograd.backward(list(yp), grads)
    with b:
        weights = backward_input(list(ys), grads, [xs], list(split.parameters()), meter.releasing)
    assert all(p.grad is None for p in split.parameters())  # B touches no weight
    if input_grad:
        assert torch.equal(xs.grad, xp.grad)
    with w:
        weights.run()
    for (n, p), q in zip(plain.named_parameters(), split.parameters(), strict=True):
        assert q.grad is not None, n
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6)
    # Each matrix product once (a weight used twice: the input path between its uses runs again in W, unless
    # its W is the deferred GEMMs, which run no path).
    assert b.n + w.n == whole.n + (0 if fused and name != "mixed" else again)
    if input_grad:
        assert b.n > 0 and w.n > 0


def test_a_scalar_loss_and_the_post_accumulate_hooks(fused):
    """The last stage's root is its loss (gradient None: one); W accumulates through AccumulateGrad (or, fused,
    as it does), so the hooks the replicas' sums start from fire once per weight."""
    torch.manual_seed(0)
    model = mlp()
    grad_in_place.fuse(model)
    fired = []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: fired.append(i))
    x = torch.randn(3, 4, requires_grad=True)
    loss = model(x).pow(2).mean()
    weights = backward_input([loss], [None], [x], list(model.parameters()))
    assert fired == [] and x.grad is not None
    weights.run()
    assert sorted(fired) == list(range(len(list(model.parameters()))))


def test_w_frees_the_activations_b_kept(fused):
    """Regression: the activation meter's handle held a saved output (ReLU's) with its grad_fn, a cycle that
    nothing freed once B kept the graph (retain_graph): every micro-batch's activations stayed for good."""
    model = mlp()
    grad_in_place.fuse(model)
    meter = ActivationMeter(list(model.parameters()))
    for _ in range(3):
        x = torch.randn(3, 4, requires_grad=True)
        with meter.hooks():
            y = model(x)
        held = meter.current
        weights = backward_input([y], [torch.ones_like(y)], [x], list(model.parameters()))
        del y
        assert 0 < meter.current <= held  # what W needs stays until W
        weights.run()
        del weights, x
        assert meter.current == 0


def test_b_lets_go_of_what_w_does_not_use(fused):
    """Between B and W a micro-batch holds its weights' inputs only: attention's saved queries, keys and values,
    and the loss's log-probabilities, go at B (a split node keeps every node below it alive, with what it
    saved); the gradients are the same to the bit."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), nn.Linear(16, 50))
    x, target = torch.randn(4, 8, 16), torch.randint(0, 50, (32,))
    kept, got = [], []
    for release in (False, True):
        model = copy.deepcopy(plain)
        grad_in_place.fuse(model)  # (fused: the feed-forward's and the head's Linear layers)
        meter = ActivationMeter(list(model.parameters()))
        xs = x.clone().requires_grad_()
        with meter.hooks():
            loss = nn.functional.cross_entropy(model(xs).flatten(0, 1), target)
        weights = backward_input([loss], [None], [xs], list(model.parameters()), meter.releasing if release else None)
        del loss
        kept.append(meter.current)
        weights.run()
        del weights
        assert meter.current == 0
        got.append([xs.grad, *(p.grad for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*got, strict=True))
    assert kept[1] < 0.8 * kept[0], kept


@pytest.mark.parametrize(("name", "make"), [("a-weight-used-twice", Twice), ("mixed", Mixed), ("mlp", mlp)])
def test_each_weights_hooks_fire_once_after_all_of_w_with_its_final_gradient(fused, name, make):
    """Regression: fused, W added a weight used twice in two parts and fired its post-accumulate hooks after each;
    the replicas' reducer (gpipe.worker.dataplane.reducer) takes the first as final and all-reduces a half-made gradient while
    the second part is added into its bucket. Each weight's hooks fire once, seeing the gradient a plain
    backward gives."""
    torch.manual_seed(0)
    plain = make()
    split = copy.deepcopy(plain)
    grad_in_place.fuse(split)
    x = torch.randn(3, 4)
    grads = []
    for model in (plain, split):
        xi = x.clone().requires_grad_()
        y = model(xi)
        g = torch.randn_like(y, generator=torch.Generator().manual_seed(1))
        grads.append((model, xi, y, g))
    (_, _, yp, gp), (_, xs, ys, gs) = grads
    torch.autograd.backward([yp], [gp])
    seen: dict[int, list[torch.Tensor]] = {}
    for p in split.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.setdefault(id(p), []).append(p.grad.clone()))
    backward_input([ys], [gs], [xs], list(split.parameters())).run()
    for p, q in zip(plain.parameters(), split.parameters(), strict=True):
        assert len(seen[id(q)]) == 1
        torch.testing.assert_close(seen[id(q)][0], p.grad, rtol=0, atol=1e-6)


def test_a_fused_model_pickles_and_loads_back(fused):
    import io

    model = mlp()
    assert (grad_in_place.fuse(model) > 0) == fused
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    x = torch.randn(3, 4)
    assert torch.equal(back(x), model(x))
