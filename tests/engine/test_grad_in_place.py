"""A large weight's gradient computed into its `.grad` (gpipe.grad_in_place) equals autograd's own: one device's
weights under every schedule, split backward, recomputation and replicas, one tensor per gradient, and the
replicas' hooks fired as after a plain backward.

In process, every captured weight made "large" (IN_PLACE_BYTES 0); the service's real processes at the default
size are in tests/service/test_grad_in_place.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import gpipe
from gpipe import grad_in_place
from gpipe.capture.graph import capture
from tests.support import models
from tests.support.lm import batches, fresh, lm_loss, one_device

pytest.importorskip("transformers")


@pytest.fixture
def every_weight(monkeypatch):
    monkeypatch.setattr(grad_in_place, "IN_PLACE_BYTES", 0)


def _pipelined(model, data, chunks: int, **kw) -> gpipe.Pipeline:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pipe = gpipe.Pipeline(model, chunks=chunks, **kw)
    for x, y in data:
        pipe.step(x, y, lm_loss)
        opt.step()
        opt.zero_grad()
    pipe.close()
    return pipe


def _worst(got: torch.nn.Module, want: torch.nn.Module) -> float:
    g, w = dict(got.named_parameters()), dict(want.named_parameters())
    assert set(g) == set(w)
    return max((g[k] - w[k]).abs().max().item() for k in w)


def _in_place_nodes(pipe: gpipe.Pipeline) -> int:
    assert pipe.captured is not None
    return sum(n.target in (grad_in_place.linear, grad_in_place.addmm, grad_in_place.embedding)
               for p in pipe.captured.pieces for n in p._gp_graph.graph.nodes)


@pytest.mark.parametrize(("factory", "cut", "schedule", "checkpointing", "replicas"), [
    (models.gpt2, {"split_points": ["transformer.h.2"]}, "gpipe", "never", 1),
    (models.gpt2, {"stages": 3}, "1f1b", "always", 1),
    (models.gpt2, {"split_points": ["transformer.h.1", "transformer.h.3"]}, "zb-h1", "except_last", 1),
    (models.gpt2, {"stages": 2, "virtual_stages": 2}, "zbv", "never", 1),  # the tied pair on one worker
    (models.gpt2, {"stages": 1}, "gpipe", "never", 1),  # the tied weight used twice in one stage
    (models.gpt2, {"split_points": ["transformer.h.2"]}, "1f1b", "never", 2),  # the replicas' bucketed sums
    (models.llama, {"split_points": ["model.layers.2"]}, "zb-h1", "never", 1),  # linear without bias
    (models.gpt2, {"split_points": ["lm_head"]}, "zb-h1", "never", 1),  # the received input straight into the head
], ids=["gpt2-gpipe", "gpt2-1f1b-recompute", "gpt2-zb-h1", "gpt2-zbv", "gpt2-one-stage", "gpt2-replicas",
        "llama-zb-h1", "gpt2-zb-h1-head-alone"])
def test_in_place_gradients_equal_one_device(every_weight, monkeypatch, factory, cut, schedule, checkpointing,
                                             replicas):
    data = batches(3, 8, 10)
    want = fresh(factory)
    one_device(want, data, chunks=4, replicas=replicas)
    got = fresh(factory)
    taken = []
    take = grad_in_place._taken
    monkeypatch.setattr(grad_in_place, "_taken", lambda w: taken.append(w.grad is not None) or take(w))
    pipe = _pipelined(got, data, chunks=4, schedule=schedule, activation_checkpoint=checkpointing,
                      replicas=replicas, **cut)
    assert _in_place_nodes(pipe) > 0  # the captured graphs took the in-place forms
    assert any(taken)  # and their backwards added into .grad
    assert _worst(got, want) <= 1e-5


class _NewTensors(TorchDispatchMode):
    """Counts the tensors of `numel` elements that operations make anew (not an input's storage, as addmm_ or
    index_add_ give back)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.made = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        self.made += sum(t.numel() == self.numel and t.untyped_storage().data_ptr() not in ins
                         for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("repacked", [False, True], ids=["saved-as-is", "saved-repacked"])
def test_after_the_first_micro_batch_no_gradient_of_a_weight_is_made_and_its_hook_fires_each_time(repacked):
    # An embedding and a head (a pipeline's first and last stage hold a tied pair as two tensors): micro-batch 0
    # makes each gradient's tensor; 1 and 2 add into them and make no tensor of a weight's size (autograd's own
    # makes one a weight a micro-batch). `repacked`: the saved tensors come back as other tensor objects (the
    # stage's activation meter packs them), the parameter's .grad is still the one added into. The
    # post-accumulate hooks fire after each backward, as after autograd's own accumulation.
    torch.manual_seed(0)
    emb, head = torch.nn.Parameter(torch.randn(50, 8)), torch.nn.Parameter(torch.randn(50, 8))
    fired: list[tuple[int, int]] = []
    for p in (emb, head):
        p.register_post_accumulate_grad_hook(lambda p: fired.append((id(p), p.grad.data_ptr())))
    ids = torch.randint(0, 50, (3, 3, 5))
    plain = [emb.detach().clone().requires_grad_(), head.detach().clone().requires_grad_()]
    made = []
    hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: t.view_as(t), lambda t: t.view_as(t)) if repacked
             else contextlib.nullcontext())
    for x in ids:
        with hooks:
            y = grad_in_place.linear(torch.tanh(grad_in_place.embedding(emb, x)), head).square().mean()
        with _NewTensors(emb.numel()) as count:
            y.backward()
        made.append(count.made)
        h = torch.tanh(torch.ops.aten.embedding.default(plain[0], x))
        torch.ops.aten.linear.default(h, plain[1]).square().mean().backward()
    assert made[1:] == [0, 0], made
    assert len(fired) == 6 and len(set(fired)) == 2  # each weight's hook, each time with its one .grad tensor
    assert {(id(emb), emb.grad.data_ptr()), (id(head), head.grad.data_ptr())} == set(fired)
    for got, want in zip((emb, head), plain, strict=True):
        assert (got.grad - want.grad).abs().max().item() <= 1e-6


def test_padding_rows_take_no_gradient_and_small_weights_stay_autograd_s():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(10, 4))
    x = torch.tensor([[0, 3, 3, 9]])
    grad_in_place.embedding(w, x, padding_idx=3).sum().backward()
    want = torch.zeros(10, 4)
    want[0] = want[9] = 1
    assert torch.equal(w.grad, want)
    # Under autocast, without grad mode, or with scale_grad_by_freq: autograd's own operation.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grad_in_place.linear(torch.randn(2, 4), w).grad_fn.name() != "_LinearBackward"
    assert grad_in_place.embedding(w, x, scale_grad_by_freq=True).grad_fn.name() == "EmbeddingBackward0"
    with torch.no_grad():
        assert grad_in_place.linear(torch.randn(2, 4), w).grad_fn is None


def test_only_weights_of_at_least_in_place_bytes_are_rewritten():
    # GPT-2 at width 32, vocab 97: no weight reaches 16 MiB, the graphs stay autograd's; at 0 bytes every
    # embedding, linear and addmm on a weight changes.
    sample = torch.randint(0, 97, (2, 6))
    small = capture(fresh(models.gpt2), sample)
    assert not any(getattr(n.target, "__module__", "") == "gpipe.grad_in_place"
                   for p in small.pieces for n in p._gp_graph.graph.nodes)
    grad_in_place.IN_PLACE_BYTES, size = 0, grad_in_place.IN_PLACE_BYTES
    try:
        every = capture(fresh(models.gpt2), sample)
    finally:
        grad_in_place.IN_PLACE_BYTES = size
    targets = [n.target for p in every.pieces for n in p._gp_graph.graph.nodes]
    assert targets.count(grad_in_place.embedding) == 2  # tokens and positions
    assert targets.count(grad_in_place.linear) == 1  # the head
    assert targets.count(grad_in_place.addmm) == 4 * 4  # four Conv1D a block


def test_a_rewritten_capture_pickles_and_loads_back_with_its_in_place_forms(every_weight):
    # An unpickled GraphModule is traced again from its code (torch.fx): the plan's measuring processes get the
    # captured pieces so. The in-place forms must come back as the graph's calls, not be run on fx's Proxies
    # (TraceError: symbolically traced variables cannot be used as inputs to control flow).
    import pickle

    sample = torch.randint(0, 97, (2, 6))
    pieces = capture(fresh(models.gpt2), sample).pieces
    loaded = pickle.loads(pickle.dumps(pieces))
    forms = (grad_in_place.linear, grad_in_place.addmm, grad_in_place.embedding)
    for before, after in zip(pieces, loaded, strict=True):
        want = [n.target for n in before._gp_graph.graph.nodes if n.target in forms]
        assert [n.target for n in after._gp_graph.graph.nodes if n.target in forms] == want
    assert sum(n.target in forms for p in loaded for n in p._gp_graph.graph.nodes) == 2 + 1 + 16
    x, y = sample, sample
    for model in (pieces, loaded):
        lm_loss(model(x), y).backward()
    for a, b in zip(pieces.parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_hooks_autograd_grad_determinism_and_a_pipeline_s_shared_weight_keep_autograd_s_own():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    # A tensor hook sees each micro-batch's gradient: the weight's gradient stays autograd's.
    w = torch.nn.Parameter(torch.randn(8, 8))
    w.register_hook(lambda g: g * 0.5)
    for _ in range(2):
        grad_in_place.linear(x, w).sum().backward()
    plain = w.detach().clone().requires_grad_()
    plain.register_hook(lambda g: g * 0.5)
    for _ in range(2):
        torch.nn.functional.linear(x, plain).sum().backward()
    assert torch.equal(w.grad, plain.grad)
    # autograd.grad on a weight hands its gradient back and leaves .grad as it was.
    v = torch.nn.Parameter(torch.randn(8, 8))
    grad_in_place.linear(x, v).sum().backward()
    before = v.grad.clone()
    (g,) = torch.autograd.grad(grad_in_place.linear(x, v).sum(), [v])
    assert torch.equal(v.grad, before) and torch.allclose(g, before)
    # Deterministic mode and a weight gpipe.Pipeline shares between stage threads: autograd's own op.
    u = torch.nn.Parameter(torch.randn(8, 8))
    torch.use_deterministic_algorithms(True)
    try:
        assert grad_in_place.linear(x, u).grad_fn.name() != "_LinearBackward"
    finally:
        torch.use_deterministic_algorithms(False)
    grad_in_place.exclude(u)
    assert grad_in_place.linear(x, u).grad_fn.name() != "_LinearBackward"
    assert grad_in_place.linear(x, torch.nn.Parameter(torch.randn(8, 8))).grad_fn.name() == "_LinearBackward"


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(12, 12), torch.nn.ReLU())],
                               torch.nn.Linear(12, 3, bias=False))


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean()


@pytest.mark.parametrize(("schedule", "kw", "deferred"), [
    ("gpipe", {"balance": [5, 4]}, 0),
    ("1f1b", {"balance": [4, 5], "activation_checkpoint": "always"}, 0),
    ("zb-h1", {"balance": [3, 4, 2]}, 3),
    ("zb-h1", {"balance": [5, 4], "replicas": 2}, 2 * 2),  # W's accumulation fires the replicas' bucketed sums
    ("zbv", {"balance": [2, 2, 2, 3], "virtual_stages": 2}, 4),
    ("zb-h1", {"balance": [9]}, 0),  # one stage: its input wants no gradient, its whole backward is W's
], ids=["gpipe", "1f1b-recompute", "zb-h1", "zb-h1-replicas", "zbv", "zb-h1-one-stage"])
def test_a_plain_models_linears_are_fused_and_their_deferred_weight_gradients_equal_one_device(
        every_weight, monkeypatch, schedule, kw, deferred):
    # gpipe.Pipeline (and a worker's stage) fuses a plain model's nn.Linear layers (grad_in_place.fuse): each
    # backward adds its weight gradient into .grad, and a split backward (zb-h1, zbv) keeps the gradient on the
    # linear's node in B and runs the weight-gradient GEMMs in W without an autograd pass: `deferred` linears a
    # micro-batch (those past the first stage, whose input wants no gradient and whose whole backward is W's),
    # summed over the replicas. One device's weights.
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)) for _ in range(3)]
    want = _mlp()
    opt = torch.optim.SGD(want.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            (_mse(want(xs), ys) * ys.size(0) / x.size(0)).backward()
        opt.step()
        opt.zero_grad()
    ran = []
    run = grad_in_place.run_deferred
    monkeypatch.setattr(grad_in_place, "run_deferred", lambda node: ran.append(node) or run(node))
    got = _mlp()
    opt = torch.optim.SGD(got.parameters(), lr=0.1, momentum=0.9)
    pipe = gpipe.Pipeline(got, chunks=4, schedule=schedule, **kw)
    for x, y in data:
        pipe.step(x, y, _mse)
        opt.step()
        opt.zero_grad()
    pipe.close()
    assert all(getattr(m, grad_in_place._FUSED, False) for m in got if isinstance(m, torch.nn.Linear))
    assert len(ran) == deferred * 4 * len(data)  # (each replica runs its 4 micro-batches of its half)
    assert _worst(got, want) <= 1e-5
