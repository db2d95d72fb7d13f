"""Seeding (gpipe.rng): which layers a forward seeds, and the captured models' dropout under threads.

A process's stage seeds every layer that may draw random numbers, and its last; a layer it cannot prove quiet
is seeded, as every layer was before. Threads of one process (gpipe.Pipeline) seed the layers that draw, under
one lock: a captured model's dropout is in its graph, not in a Dropout module.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gpipe
from gpipe import grad_in_place
from gpipe.capture.graph import capture
from gpipe.rng import SharedGenerators, quiet, seeded_forward, seeding


class Net(nn.Module):
    """Three linears with dropout between them, cut at b and c: three pieces once captured."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.d1, self.d2 = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.d2(torch.tanh(self.b(self.d1(torch.tanh(self.a(x)))))))


class OwnForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # a subclass's forward may draw
        return super().forward(x) + torch.rand_like(x)


def test_only_torch_s_own_quiet_modules_and_captured_graphs_without_random_operations_are_quiet():
    assert quiet(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.LayerNorm(4)))
    assert not quiet(nn.Dropout(0.1)) and not quiet(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0)))
    assert not quiet(OwnForward(4, 4))
    assert quiet(nn.MultiheadAttention(8, 2)) and not quiet(nn.MultiheadAttention(8, 2, dropout=0.1))  # draws only with dropout
    hooked = nn.Linear(4, 4)
    hooked.register_forward_pre_hook(lambda m, a: None)
    assert not quiet(hooked)
    own = nn.Linear(4, 4)
    own.forward = lambda x: x  # type: ignore[method-assign]  # an instance's own forward
    assert not quiet(own)
    fused = nn.Linear(512, 512)
    assert grad_in_place.fuse(fused) == 1 and quiet(fused)  # the fused linear's forward is vouched for
    pieces = capture(Net(), torch.randn(4, 16), ["b", "c"]).pieces
    assert [quiet(p) for p in pieces] == [False, False, True]  # the dropout is in the first two's graphs
    still = capture(Net(p=0.0), torch.randn(4, 16), ["b"]).pieces
    assert not any(quiet(p) for p in still)  # captured in training mode: dropout's op is in the graph at p=0 too


def test_a_forward_seeds_the_layers_that_may_draw_and_the_last_before_the_loss():
    layers = list(enumerate([nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4), nn.Linear(4, 4)]))
    assert seeding(layers) == [False, True, False, True]
    assert seeding(layers, loss_follows=False) == [False, True, False, False]


def test_skipping_the_quiet_layers_seeds_changes_neither_the_output_nor_the_generator_after():
    torch.manual_seed(0)
    layers = list(enumerate([nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)]))
    x = torch.randn(4, 8)
    outs, after = [], []
    for seeded in (None, seeding(layers)):
        torch.manual_seed(len(outs))  # whatever the generator held before
        outs.append(seeded_forward(layers, x, 7, 3, 1, seeded=seeded))
        after.append(torch.rand(4))
    assert torch.equal(outs[0], outs[1]) and torch.equal(after[0], after[1])
    torch.manual_seed(5)
    assert torch.equal(seeded_forward(layers, x, 7, 3, 1, seeded=seeding(layers, loss_follows=False)), outs[0])


def test_a_global_forward_hook_seeds_every_layer():
    layers = list(enumerate([nn.Linear(8, 8), nn.Linear(8, 8)]))
    x = torch.randn(4, 8)

    def draw(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out + torch.rand_like(out)

    handle = torch.nn.modules.module.register_module_forward_hook(draw)
    try:
        got = []
        for seeded in (None, seeding(layers), []):  # ([]: no layer draws, as a stage of Linears is told)
            torch.manual_seed(len(got))
            got.append(seeded_forward(layers, x, 7, 3, 1, seeded=seeded))
    finally:
        handle.remove()
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


def test_no_layer_that_draws_seeds_none_and_leaves_the_generator_as_it_was():
    layers = list(enumerate([nn.Linear(8, 8), nn.ReLU()]))
    x = torch.randn(4, 8)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    assert torch.equal(seeded_forward(layers, x, 7, 3, 1, seeded=[]), layers[1][1](layers[0][1](x)))
    assert torch.equal(torch.get_rng_state(), before)


def test_the_shared_generators_seed_a_captured_graph_that_draws():
    shared = SharedGenerators()
    pieces = capture(Net(), torch.randn(4, 16), ["b", "c"]).pieces
    assert [shared.draws(p) for p in pieces] == [True, True, False]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_captured_model_with_dropout_through_threads_equals_its_pieces_on_one_device(schedule):
    """Its dropout masks are each piece's seed's, whatever the caller's generator held: as one device's."""
    torch.manual_seed(0)
    model, x, y = Net(), torch.randn(8, 16), torch.randn(8, 16)
    ref = nn.Sequential(*capture(copy.deepcopy(model), x[:2], ["b", "c"]).pieces)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpipe.Pipeline(model, split_points=["b", "c"], chunks=4, schedule=schedule, seed=3) as pipe:
        for step in range(2):
            torch.manual_seed(100 + step)  # the caller's generator: nothing the masks may depend on
            pipe.step(x, y, nn.functional.mse_loss)
            opt.step()
            opt.zero_grad()
            for i in range(4):
                out = seeded_forward(list(enumerate(ref)), x[2 * i:2 * i + 2], 3, step, i)
                (nn.functional.mse_loss(out, y[2 * i:2 * i + 2]) * 2 / 8).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    want = {n: p for piece in ref for n, p in piece.named_parameters()}
    got = dict(model.named_parameters())
    assert set(got) == set(want)
    worst = max((got[n] - want[n]).abs().max().item() for n in got)
    assert worst <= 1e-6, f"weights differ from one device by {worst}"


@torch.library.custom_op("gpipe_test::noisy", mutates_args=())
def noisy(x: torch.Tensor) -> torch.Tensor:
    """Another library's operation that draws: torch's tags say nothing of it."""
    return x + torch.rand_like(x)


@noisy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_a_graph_that_calls_another_library_s_operation_may_draw():
    g = torch.fx.Graph()
    g.output(g.call_function(torch.ops.gpipe_test.noisy.default, (g.placeholder("x"),)))
    gm = torch.fx.GraphModule(nn.Module(), g)
    assert not quiet(gm) and SharedGenerators().draws(gm)
    layers = list(enumerate([nn.Linear(4, 4), gm, nn.Linear(4, 4)]))
    assert seeding(layers) == [False, True, True]


def test_a_module_class_whose_forward_was_patched_or_marked_random_is_not_quiet(monkeypatch):
    marked = nn.Linear(4, 4)
    marked.gpipe_random = True  # type: ignore[assignment]
    assert not quiet(marked)
    monkeypatch.setattr(nn.Tanh, "forward", lambda self, x: torch.tanh(x) + torch.rand_like(x))
    assert not quiet(nn.Tanh()) and quiet(nn.ReLU())
