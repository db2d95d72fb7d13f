"""gpipe.Pipeline's training forward, torchgpipe's contract: `output = pipe(x)`, then `loss.backward()`.

Every result is held against one device on the same micro-batches (torch.chunk's cut, each micro-batch's layers
seeded as gpipe.rng seeds them): the output, the parameters' and the input's gradients, BatchNorm's statistics.
"""

from __future__ import annotations

import copy
import gc
import time
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpipe
from gpipe import batchnorm, skip
from gpipe.recompute import is_checkpointing, is_recomputing
from gpipe.rng import seeded_forward

MODES = ["always", "except_last", "never"]


class OwnDropout(nn.Module):
    """A layer that draws random numbers itself, with no mark: torchgpipe's test_parallel_randoms."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5, self.training)


class Noise(nn.Module):
    """A layer whose own forward draws from torch.rand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + torch.rand_like(x)) if self.training else x


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), OwnDropout(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(),
                         nn.Linear(16, 16), Noise(), nn.Dropout(0.3), nn.Linear(16, 4))


def one_device(model: nn.Sequential, x: torch.Tensor, chunks: int, loss_of: Callable[[torch.Tensor], torch.Tensor],
               step: int = 0) -> torch.Tensor:
    """The model on one device, micro-batch after micro-batch (torch.chunk's), each layer seeded as gpipe seeds
    it; the loss of the joined output, backwarded. Returns the output."""
    outs = [seeded_forward(list(enumerate(model)), xm, 0, step, i) for i, xm in enumerate(torch.chunk(x, chunks))]
    out = torch.cat(outs)
    loss_of(out).backward()
    return out


def assert_same(got: nn.Module, want: nn.Module, tolerance: float = 1e-6) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        assert (a.grad - b.grad).abs().max().item() <= tolerance, f"{name}'s gradient"
    for (name, a), b in zip(got.named_buffers(), want.buffers(), strict=True):
        assert torch.allclose(a.double(), b.double(), atol=tolerance, rtol=0), f"buffer {name}"


@pytest.mark.parametrize("balance", [[9], [2, 3, 4], [1, 2, 2, 4]], ids=lambda b: "-".join(map(str, b)))
@pytest.mark.parametrize("mode", MODES)
def test_a_whole_batch_loss_backwards_through_the_pipeline_as_on_one_device(mode, balance):
    """out.var() mixes the micro-batches: step() cannot say it. Own random layers, BatchNorm, x's gradient."""
    model, ref = mlp(), mlp()
    x = torch.randn(11, 8)  # micro-batches of 3, 3, 3, 2
    xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    with gpipe.Pipeline(model, balance, chunks=4, activation_checkpoint=mode) as pipe:
        out = pipe(xp)
        assert out.requires_grad and out.shape == (11, 4)
        out.var().backward()
        assert pipe.results and all(r.stage == k for k, r in enumerate(pipe.results))
    want = one_device(ref, xr, 4, torch.Tensor.var)
    assert (out - want).abs().max().item() <= 1e-6
    assert_same(model, ref)
    assert xp.grad is not None and (xp.grad - xr.grad).abs().max().item() <= 1e-6


def test_the_forward_without_an_input_gradient_and_a_second_step_equal_one_device():
    """No input requires grad (the output still does); two steps with an optimizer between them."""
    model, ref = mlp(), mlp()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    xs, ys = torch.randn(2, 8, 8), torch.randn(2, 8, 4)
    with gpipe.Pipeline(model, [3, 6], chunks=2, activation_checkpoint="except_last") as pipe:
        for step in range(2):
            F.mse_loss(pipe(xs[step]), ys[step]).backward()
            opt.step()
            opt.zero_grad()
            one_device(ref, xs[step], 2, lambda out, s=step: F.mse_loss(out, ys[s]), step=step)
            ref_opt.step()
            ref_opt.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.allclose(a.double(), b.double(), atol=1e-6, rtol=0), name


@pytest.mark.parametrize("mode", MODES)
def test_deferred_batch_norm_commits_the_whole_batch_once_as_on_one_device(mode):
    model, ref = mlp(), mlp()
    batchnorm.convert_deferred_batch_norm(ref)  # the documented one-device recipe (gpipe/batchnorm.py)
    x = torch.randn(12, 8)
    with gpipe.Pipeline(model, [4, 5], chunks=3, activation_checkpoint=mode, deferred_batch_norm=True) as pipe:
        pipe(x).square().mean().backward()
    one_device(ref, x, 3, lambda out: out.square().mean())
    batchnorm.commit(ref)
    assert int(model[3].num_batches_tracked) == 1
    assert_same(model, ref)


class Stash(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name, self.linear = name, nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip.stash(self.name, x)
        return torch.tanh(self.linear(x))


class Pop(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name, self.linear = name, nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + skip.pop(self.name)


def skipping() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(Stash("a"), OwnDropout(), Stash("b"), nn.Linear(8, 8), Pop("b"), nn.Linear(8, 8), Pop("a"))


@pytest.mark.parametrize("mode", MODES)
def test_skip_connections_across_stages_backward_as_on_one_device(mode):
    model, ref = skipping(), skipping()
    x = torch.randn(6, 8)
    xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    with gpipe.Pipeline(model, [2, 2, 3], chunks=3, activation_checkpoint=mode) as pipe:
        out = pipe(xp)
        (out * torch.linspace(-1, 1, 8)).sum().backward()
    want = one_device(ref, xr, 3, lambda o: (o * torch.linspace(-1, 1, 8)).sum())
    assert (out - want).abs().max().item() <= 1e-6
    assert_same(model, ref)
    assert (xp.grad - xr.grad).abs().max().item() <= 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_a_captured_hugging_face_model_backwards_as_on_one_device(mode):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=4, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 97, (4, 8))
    with gpipe.Pipeline(model, stages=2, chunks=2, activation_checkpoint=mode) as pipe:
        logits = pipe({"input_ids": ids})
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    outs = [ref(input_ids=part).logits for part in torch.chunk(ids, 2)]
    want = torch.cat(outs)
    F.cross_entropy(want[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert (logits - want).abs().max().item() <= 1e-5
    assert model.transformer.wte.weight is model.lm_head.weight
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (a.grad - b.grad).abs().max().item() <= 1e-6, name


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_forward_equals_the_step_of_the_same_loss(precision):
    """In bf16 and fp16 the training forward and step() of a loss that is a sum over micro-batches give the same
    gradients (fp16 through the loss scale, unscaled)."""
    model, other = mlp(), mlp()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with gpipe.Pipeline(model, [3, 6], chunks=2, precision=precision, activation_checkpoint="always") as pipe:
        F.mse_loss(pipe(x), y).backward()
        assert pipe.skipped is (False if precision == "fp16" else None)
    with gpipe.Pipeline(other, [3, 6], chunks=2, precision=precision, activation_checkpoint="always") as pipe:
        pipe.step(x, y, F.mse_loss)  # each micro-batch's mean times |m|/B: the batch's mean
    for (name, a), b in zip(model.named_parameters(), other.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-3), name


def test_replicas_share_the_batch_and_sum_their_gradients_as_one_device():
    model, ref = mlp(), mlp()
    x = torch.randn(12, 8)
    with gpipe.Pipeline(model, [4, 5], chunks=2, replicas=2, deferred_batch_norm=True) as pipe:
        out = pipe(x)
        out.var().backward()
    batchnorm.convert_deferred_batch_norm(ref)
    # replica r's micro-batch i is number r*chunks+i: each replica's shard cut in two
    outs = [seeded_forward(list(enumerate(ref)), xm, 0, 0, r * 2 + i)
            for r, shard in enumerate(torch.tensor_split(x, 2)) for i, xm in enumerate(torch.chunk(shard, 2))]
    want = torch.cat(outs)
    want.var().backward()
    batchnorm.commit(ref)
    assert (out - want).abs().max().item() <= 1e-6
    assert_same(model, ref)


# -- the same math for any layer, under step() and run ---------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mode", MODES)
def test_a_layer_drawing_its_own_random_numbers_is_replayed_when_recomputed(mode, schedule):
    """No mark on OwnDropout or Noise: the recomputation replays the forward's draws, so the gradients are
    those of the forward's mask (one device's)."""
    model, ref = mlp(), mlp()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with gpipe.Pipeline(model, [2, 3, 4], chunks=4, activation_checkpoint=mode, schedule=schedule) as pipe:
        pipe.step(x, y, F.mse_loss)
    for i, (xm, ym) in enumerate(zip(torch.chunk(x, 4), torch.chunk(y, 4), strict=True)):
        (F.mse_loss(seeded_forward(list(enumerate(ref)), xm, 0, 0, i), ym) * len(xm) / 8).backward()
    assert_same(model, ref)


def test_only_provably_quiet_layers_skip_the_shared_generators_lock():
    from gpipe.rng import SharedGenerators

    shared = SharedGenerators()
    assert shared.draws(OwnDropout()) and shared.draws(Noise()) and shared.draws(nn.Sequential(nn.Linear(2, 2),
                                                                                                 OwnDropout()))

    class Quiet(nn.Module):
        gpipe_random = False  # the hint: this class's own forward draws nothing

        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * 2

    assert not shared.draws(Quiet(nn.Linear(2, 2)))
    assert shared.draws(Quiet(nn.Dropout(0.1)))  # the hint covers its own forward, not its submodules


@pytest.mark.parametrize(("mode", "schedule"), [("always", "gpipe"), ("except_last", "gpipe"), ("never", "gpipe"),
                                                ("always", "1f1b"), ("always", "zb-h1")])
def test_the_loss_function_runs_once_per_micro_batch(mode, schedule):
    calls: list[int] = []

    def counting(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(len(out))
        return F.mse_loss(out, y)

    model, ref = mlp(), mlp()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with gpipe.Pipeline(model, [4, 5], chunks=4, activation_checkpoint=mode, schedule=schedule) as pipe:
        loss = pipe.step(x, y, counting)
    assert calls == [2, 2, 2, 2]
    want = 0.0
    for i, (xm, ym) in enumerate(zip(torch.chunk(x, 4), torch.chunk(y, 4), strict=True)):
        part = F.mse_loss(seeded_forward(list(enumerate(ref)), xm, 0, 0, i), ym) * len(xm) / 8
        part.backward()
        want += part.item()
    assert abs(loss.item() - want) <= 1e-6
    assert_same(model, ref)


def test_a_layer_knows_whether_it_is_checkpointing_or_recomputing():
    seen: list[tuple[bool, bool]] = []

    class Watch(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((is_checkpointing(), is_recomputing()))
            return x * 2

    model = nn.Sequential(nn.Linear(4, 4), Watch(), nn.Linear(4, 4))
    with gpipe.Pipeline(model, [1, 2], chunks=2, activation_checkpoint="except_last") as pipe:
        with torch.no_grad():
            pipe(torch.randn(4, 4))  # built (the probe runs the layers too)
        seen.clear()
        pipe(torch.randn(4, 4)).sum().backward()
    # micro-batch 0 checkpointed (its first forward, then its recomputation); micro-batch 1 kept
    assert sorted(seen) == sorted([(True, False), (False, False), (False, True)])
    assert not is_checkpointing() and not is_recomputing()


# -- batch shapes, the state between forward and backward, refusals --------------------------------------------------


def test_batches_are_cut_as_torch_chunk_cuts_them():
    sizes: list[int] = []

    class Sizes(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            sizes.append(len(x))
            return x

    model = nn.Sequential(nn.Linear(4, 4), Sizes(), nn.BatchNorm1d(4), nn.Linear(4, 4))
    with gpipe.Pipeline(model, [2, 2], chunks=4) as pipe:
        with torch.no_grad():
            pipe(torch.randn(4, 4))  # built (the probe runs the layers too)
        sizes.clear()
        pipe(torch.randn(6, 4)).sum().backward()  # BatchNorm1d in training: no micro-batch of one
        assert sizes == [2, 2, 2]
    model = nn.Sequential(nn.Linear(4, 4), Sizes(), nn.Linear(4, 4))
    with gpipe.Pipeline(model, [2, 1], chunks=4) as pipe:
        with torch.no_grad():
            pipe(torch.randn(4, 4))
        sizes.clear()
        pipe.step(torch.randn(2, 4), torch.randn(2, 4), F.mse_loss)  # fewer samples than chunks: a sample each
        assert sizes == [1, 1]


def test_a_forward_nobody_backwards_is_let_go():
    model = mlp()
    with gpipe.Pipeline(model, [4, 5], chunks=2, activation_checkpoint="never") as pipe:
        out = pipe(torch.randn(4, 8))
        held = weakref.ref(pipe._pending())  # type: ignore[misc]
        del out
        gc.collect()
        assert held() is None  # the output freed: its forward's state with it
        first = pipe(torch.randn(4, 8))
        second = pipe(torch.randn(4, 8))  # the next forward drops the first's state
        with pytest.raises(RuntimeError, match="dropped"):
            first.sum().backward()
        second.sum().backward()
        with pytest.raises(RuntimeError, match="dropped"):  # its backward ran already
            pipe(torch.randn(4, 8))
            again = pipe(torch.randn(4, 8))
            again.sum().backward(retain_graph=True)
            again.sum().backward()


def test_no_grad_and_eval_mode_keep_the_forward_only_path():
    model = mlp()
    x = torch.randn(6, 8)
    with gpipe.Pipeline(model, [4, 5], chunks=2) as pipe:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            out = pipe(x)
        assert out.grad_fn is None and model.training
        model.eval()
        evaluated = pipe(x)
        assert evaluated.grad_fn is None and torch.equal(out, evaluated)
        assert not any(m.training for m in model.modules())  # each module's mode as it was
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert torch.allclose(out, model(x), atol=1e-6)


def test_a_schedule_that_needs_a_loss_per_micro_batch_names_step():
    with gpipe.Pipeline(mlp(), [4, 5], chunks=2, schedule="1f1b") as pipe, \
            pytest.raises(ValueError, match=r"pipe\.step"):
        pipe(torch.randn(4, 8))


def test_stages_count_workers_whatever_the_virtual_stages():
    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x

    with gpipe.Pipeline(Blocks(), stages=2, virtual_stages=2, chunks=2, schedule="interleaved-1f1b") as pipe:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
        assert len(pipe.devices) == 2 and len(pipe.balance) == 4


def test_each_layers_own_mode_is_kept_by_the_first_call_and_by_an_eval_call():
    """A BatchNorm kept in eval mode in a model that trains stays so (and its statistics with it)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2))
    model[1].eval()
    before = model[1].running_mean.clone()
    with gpipe.Pipeline(model, [2, 1], chunks=2) as pipe:
        pipe(torch.randn(4, 2) + 5).sum().backward()
        with torch.no_grad():
            pipe(torch.randn(4, 2))
    assert model.training and model[0].training and not model[1].training
    assert torch.equal(before, model[1].running_mean)


def test_a_failing_stage_stops_the_others_before_their_next_micro_batch():
    """Stage 3 fails while stage 2 computes its second micro-batch, which stage 2 holds until the failure is known: it
    then sends nothing more, and computes no third micro-batch."""
    calls: list[int] = []
    running: list[gpipe.Pipeline] = []

    class Counter(nn.Module):
        gpipe_random = False  # draws nothing: runs beside the other stages, not under the generators' lock

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training and torch.is_grad_enabled():
                calls.append(len(x))
                if len(calls) == 2:  # the failure lands while this micro-batch is computed
                    deadline = time.monotonic() + 30
                    while running[0]._hub._error is None and time.monotonic() < deadline:
                        time.sleep(0.01)
            return x

    class Fails(nn.Module):
        gpipe_random = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training and torch.is_grad_enabled():
                deadline = time.monotonic() + 30
                while len(calls) < 2 and time.monotonic() < deadline:  # fails once stage 2 is inside micro-batch 1
                    time.sleep(0.01)
                raise RuntimeError("this stage fails")
            return x

    model = nn.Sequential(nn.Identity(), nn.Identity(), Counter(), Fails())
    with gpipe.Pipeline(model, [1, 1, 1, 1], chunks=3) as pipe, pytest.raises(RuntimeError, match="this stage"):
        running.append(pipe)
        pipe(torch.rand(3, 1))
    assert calls == [1, 1]  # micro-batch 0, and micro-batch 1 that was under way when stage 3 failed
