"""gpipe.torchgpipe: torchgpipe's API over gpipe.Pipeline, against the same nn.Sequential on one device."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from gpipe.torchgpipe import DeferredBatchNorm, GPipe, is_checkpointing, is_recomputing
from gpipe.torchgpipe.balance import balance_by_size, balance_by_time
from gpipe.torchgpipe.skip import Namespace, pop, skippable, stash, verify_skippables


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8),
                         nn.Tanh(), nn.Linear(8, 3))


def run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The output, the input's gradient and the parameters' gradients of a loss of the whole batch."""
    x = x.detach().clone().requires_grad_()
    y = model(x)
    (y.square().sum() + y.var()).backward()
    assert x.grad is not None
    return y.detach(), x.grad, [p.grad for p in model.parameters()]  # type: ignore[misc]


def assert_same(a: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]],
                b: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-6)
    assert len(a[2]) == len(b[2]) and all(g is not None for g in a[2])
    for ga, gb in zip(a[2], b[2], strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance, chunks", [([7], 1), ([3, 4], 4), ([2, 3, 2], 3)])
def test_forward_and_backward_equal_one_device(checkpoint, balance, chunks):
    x = torch.randn(10, 6)
    reference = run(mlp(), x)
    model = GPipe(mlp(), balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=checkpoint)
    assert_same(run(model, x), reference)
    ref = mlp()
    run(ref, x)
    assert_same(run(model, x), run(ref, x))  # a second forward and backward: the gradients add up as on one device


def test_a_tuple_input_and_output():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, ab):
            a, b = ab
            return self.a(a), self.b(b) * a

    torch.manual_seed(1)
    ref = nn.Sequential(Two(), Two())
    model = GPipe(copy.deepcopy(ref), [1, 1], devices=["cpu", "cpu"], chunks=3)
    a, b = torch.randn(5, 2, requires_grad=True), torch.randn(5, 2, requires_grad=True)
    ya, yb = model((a, b))
    (ya.sum() + yb.square().sum()).backward()
    ra, rb = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    za, zb = ref((ra, rb))
    (za.sum() + zb.square().sum()).backward()
    torch.testing.assert_close((ya, yb, a.grad, b.grad), (za, zb, ra.grad, rb.grad), rtol=1e-6, atol=1e-6)


# -- skips ----------------------------------------------------------------------------------------


@skippable(stash=["skip"])
class Down(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        yield stash("skip", x)
        return torch.tanh(self.fc(x))


@skippable(pop=["skip"])
class Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        skip = yield pop("skip")
        return self.fc(x) * skip


def unet() -> nn.Sequential:
    """One skippable class used twice each side, told apart by namespaces."""
    torch.manual_seed(2)
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(Down().isolate(outer), Down().isolate(inner), nn.Linear(4, 4), Up().isolate(inner),
                         Up().isolate(outer))


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("balance", [[5], [1, 1, 1, 1, 1], [2, 2, 1]])
def test_skippables_with_namespaces_equal_one_device(balance, checkpoint):
    x = torch.randn(6, 4)
    model = unet()
    reference = run(copy.deepcopy(model), x)  # outside GPipe: the thread's own skips, one device
    piped = GPipe(model, balance, devices=["cpu"] * len(balance), chunks=3, checkpoint=checkpoint)
    assert_same(run(piped, x), reference)


def test_a_skippable_holds_the_module_and_its_declarations():
    layer = Down()
    assert isinstance(layer.module, nn.Module) and type(layer.module).__name__ == "Down"
    assert type(layer).__name__ == "Down" and layer.stashable_names == {"skip"} and layer.poppable_names == set()
    ns = Namespace()
    assert layer.isolate(ns) is layer and layer.namespaced("skip") == (ns, "skip")
    assert repr(layer).startswith("@skippable(")
    assert isinstance(None, Namespace) and Namespace() != Namespace() and copy.copy(ns) == ns


def test_stash_none_across_stages():
    @skippable(stash=["none"])
    class StashNone(nn.Module):
        def forward(self, x):
            yield stash("none", None)
            return x * 2

    @skippable(pop=["none"])
    class PopNone(nn.Module):
        def forward(self, x):
            got = yield pop("none")
            assert got is None
            return x + 1

    x = torch.rand(4, requires_grad=True)
    GPipe(nn.Sequential(StashNone(), PopNone()), [1, 1], devices=["cpu", "cpu"], chunks=2)(x).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((4,), 2.0))


def names_in(error: BaseException) -> str:
    return str(error).lower()


@skippable(stash=["a"])
class StashA(nn.Module):
    def forward(self, x):
        yield stash("a", x)
        return x


@skippable(pop=["a"])
class PopA(nn.Module):
    def forward(self, x):
        a = yield pop("a")
        return x + a


@skippable(stash=["a"], pop=["a"])
class Both(nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize("layers, layer, problem", [
    ([StashA], "'0'", "poppable but stashed"),                    # stashed, never popped
    ([PopA], "'0'", "not stashed"),                               # popped, never stashed
    ([PopA, StashA], "'0'", "not stashed"),                       # popped before its stash
    ([StashA, StashA, PopA], "'1'", "redeclared"),                # stashed twice in one namespace
    ([StashA, PopA, PopA], "'2'", "redeclared"),                  # popped twice in one namespace
    ([Both], "'0'", "both"),                                      # stashed and popped by one layer
])
def test_verify_skippables_refuses_unpaired_stashes_and_pops(layers, layer, problem):
    model = nn.Sequential(*(cls() for cls in layers))
    for check in (lambda: verify_skippables(model), lambda: GPipe(model, [len(layers)], devices=["cpu"])):
        with pytest.raises(TypeError) as e:
            check()
        assert "'a'" in str(e.value) and problem in str(e.value)
        if problem != "poppable but stashed":
            assert layer in str(e.value)


def test_verify_skippables_takes_namespaces_apart():
    one, two = Namespace(), Namespace()
    verify_skippables(nn.Sequential(StashA().isolate(one), StashA().isolate(two), PopA().isolate(two),
                                    PopA().isolate(one)))


def test_a_skippable_refuses_what_it_did_not_declare_or_do():
    @skippable(stash=["declared"])
    class Forgets(nn.Module):
        def forward(self, x):
            return x

    @skippable()
    class Undeclared(nn.Module):
        def forward(self, x):
            yield stash("other", x)
            return x

    x = torch.ones(2)
    for layer, word in ((Forgets(), "declared"), (Undeclared(), "other"), (PopA(), "'a'")):
        with pytest.raises(RuntimeError, match=word):
            layer(x)


# -- the container ---------------------------------------------------------------------------------


def test_len_indexing_and_iteration_are_the_module_s():
    layers = [nn.Linear(1, 1) for _ in range(5)]
    model = GPipe(nn.Sequential(*layers), [2, 3], devices=["cpu", "cpu"])
    assert len(model) == 5 and list(model) == layers
    assert all(model[i] is layers[i] for i in range(5)) and model[-1] is layers[4] and model[-5] is layers[0]
    for bad in (5, -6):
        with pytest.raises(IndexError):
            model[bad]
    assert [len(p) for p in model.partitions] == [2, 3] and isinstance(model.partitions, nn.ModuleList)
    assert "partitions.1.2.weight" in model.state_dict()  # the module's own names, in their partitions
    assert model.balance == [2, 3] and model.chunks == 1 and model.checkpoint == "except_last"


def test_moving_is_refused_casting_is_not():
    model = GPipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [1, 1], devices=["cpu", "cpu"])
    for move in (lambda: model.cuda(), lambda: model.cpu(), lambda: model.to("cpu"),
                 lambda: model.to(torch.device("cpu")), lambda: model.to(0), lambda: model.to(device="cpu"),
                 lambda: model.to(torch.rand(1)), lambda: model.to(tensor=torch.rand(1))):
        with pytest.raises(TypeError):
            move()
    assert model.to(torch.float64) is model and all(p.dtype is torch.float64 for p in model.parameters())
    model.to(dtype=torch.float32)
    assert model(torch.rand(2, 1)).dtype is torch.float32


def test_bad_arguments_are_refused():
    seq = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    cases = [
        (ValueError, lambda: GPipe(seq)),                                   # no balance
        (ValueError, lambda: GPipe(seq, [1])),                              # does not cut the module
        (ValueError, lambda: GPipe(seq, [0, 2])),
        (ValueError, lambda: GPipe(seq, [2], chunks=0)),
        (ValueError, lambda: GPipe(seq, [2], checkpoint="sometimes")),
        (TypeError, lambda: GPipe(nn.ModuleList([nn.Linear(1, 1)]), [1])),  # not an nn.Sequential
        (IndexError, lambda: GPipe(seq, [1, 1], devices=["cpu"])),          # fewer devices than partitions
    ]
    for error, build in cases:
        with pytest.raises(error):
            build()
    lin = nn.Linear(1, 1)
    with pytest.raises(ValueError, match="duplicate"):
        GPipe(nn.Sequential(lin, lin), [2])

    class Holder(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    with pytest.raises(ValueError, match="parameters"):
        GPipe(nn.Sequential(Holder(lin), Holder(lin)), [2])
    with pytest.raises(ValueError, match="torchgpipe.balance"):  # where to get a balance from
        GPipe(seq)


def test_devices_default_and_extra():
    seq = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    assert GPipe(seq, [1, 1], devices=["cpu"] * 4).devices == [torch.device("cpu")] * 2
    if not torch.cuda.is_available():
        assert GPipe(seq, [1, 1]).devices == [torch.device("cpu")] * 2  # no CUDA device: the CPU per partition


def test_inputs_and_outputs_are_tensors_or_tuples_of_them():
    class Word(nn.Module):
        def forward(self, x):
            return "hello"

    with pytest.raises(TypeError):
        GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"])("hello")
    with pytest.raises(TypeError):
        GPipe(nn.Sequential(Word()), [1], devices=["cpu"])(torch.rand(1))
    empty = GPipe(nn.Sequential(), [])
    x = torch.rand(3)
    assert empty(x) is x


def test_eval_mode_and_no_grad_are_torchgpipe_s():
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.BatchNorm1d(3), nn.Linear(3, 3))
    model = GPipe(copy.deepcopy(ref), [2, 2], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(8, 3)
    model.eval()
    ref.eval()
    assert_same(run(model, x), run(ref, x))  # eval mode with gradients: differentiable, dropout off
    assert not any(layer.training for layer in model)
    with torch.no_grad():
        out = model(x)
    assert out.grad_fn is None
    torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-6)

    # Training mode under no_grad: the layers train (BatchNorm's running statistics move), without a graph.
    model.train()
    model[0].train(False)  # layers kept in eval mode by their user stay so
    model[1].train(False)
    with torch.no_grad():
        out = model(x)
    assert out.grad_fn is None and [layer.training for layer in model] == [False, False, True, True]
    ref[2].train()
    with torch.no_grad():
        for chunk in x.chunk(2):  # BatchNorm's statistics move once per micro-batch
            ref[2](ref[0](chunk))
    torch.testing.assert_close((model[2].running_mean, model[2].running_var), (ref[2].running_mean,
                                                                               ref[2].running_var))


def test_a_layer_kept_in_eval_mode_stays_so_in_training():
    torch.manual_seed(4)
    ref = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 3))
    ref[1].eval()  # a frozen BatchNorm: its running statistics normalize, and do not move
    with torch.no_grad():
        ref[1].running_mean.fill_(0.5)
    model = GPipe(copy.deepcopy(ref), [2, 1], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(8, 3)
    for _ in range(2):
        assert_same(run(model, x), run(ref, x))
        assert [layer.training for layer in model] == [True, False, True]
    assert torch.equal(model[1].running_mean, ref[1].running_mean)
    assert torch.equal(model[1].running_mean, torch.full((3,), 0.5))


def test_checkpointing_and_recomputing_are_told_to_layers():
    seen = []

    class Detect(nn.Module):
        def forward(self, x):
            if self.training:  # (the first call's probe of skip routes runs in eval mode)
                seen.append((is_checkpointing(), is_recomputing()))
            return x * 2

    model = GPipe(nn.Sequential(nn.Linear(1, 1), Detect()), [1, 1], devices=["cpu", "cpu"], chunks=2,
                  checkpoint="except_last")
    model(torch.rand(4, 1)).sum().backward()
    assert sorted(seen) == [(False, False), (False, True), (True, False)]


def test_a_copy_and_a_pickle_run_on_their_own():
    model = GPipe(mlp(), [3, 4], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 6)
    y = model(x)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        torch.testing.assert_close(other(x), y)


# -- BatchNorm ---------------------------------------------------------------------------------------


def test_deferred_batch_norm_constructor_and_conversion():
    dbn = DeferredBatchNorm(3, eps=1e-3, momentum=0.2, affine=False, chunks=4)
    assert (dbn.num_features, dbn.eps, dbn.momentum, dbn.chunks) == (3, 1e-3, 0.2, 4)
    assert dbn.weight is None and dbn.track_running_stats
    assert {"sum", "sum_squares", "running_mean", "running_var"} <= set(dbn.state_dict())
    assert DeferredBatchNorm(5).chunks == 1 and DeferredBatchNorm(5).affine

    bn = nn.BatchNorm2d(3)
    seq = DeferredBatchNorm.convert_deferred_batch_norm(nn.Sequential(nn.Conv2d(3, 3, 1), bn), chunks=2)
    assert isinstance(seq[1], DeferredBatchNorm) and seq[1].weight is bn.weight and seq[1].chunks == 2
    assert DeferredBatchNorm.convert_deferred_batch_norm(seq[1], chunks=2) is seq[1]
    assert DeferredBatchNorm.convert_deferred_batch_norm(seq[1], chunks=3) is not seq[1]
    untracked = nn.BatchNorm2d(3, track_running_stats=False)
    assert DeferredBatchNorm.convert_deferred_batch_norm(untracked) is untracked


def test_deferred_batch_norm_commits_after_chunks_micro_batches():
    bn = nn.BatchNorm2d(3)
    dbn = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(bn), chunks=4)
    x = torch.randn(8, 3, 5, 5) * torch.tensor([1.0, 10.0, 0.1]).view(1, 3, 1, 1) + 3
    for i, chunk in enumerate(x.chunk(4)):
        dbn(chunk)
        if i < 3:  # not yet
            assert torch.equal(dbn.running_mean, torch.zeros(3)) and int(dbn.num_batches_tracked) == 0
    bn(x)  # the whole batch at once
    torch.testing.assert_close((dbn.running_mean, dbn.running_var), (bn.running_mean, bn.running_var))
    assert int(dbn.num_batches_tracked) == 1


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_gpipe_deferred_batch_norm_tracks_the_mini_batch(checkpoint):
    bn = nn.BatchNorm2d(3)
    model = GPipe(nn.Sequential(nn.Conv2d(3, 3, 1), copy.deepcopy(bn)), [1, 1], devices=["cpu", "cpu"],
                  chunks=2, checkpoint=checkpoint, deferred_batch_norm=True)
    assert isinstance(model[1], DeferredBatchNorm)
    x = torch.randn(4, 3, 4, 4)
    model(x).mean().backward()
    with torch.no_grad():
        bn(model[0](x))
    torch.testing.assert_close((model[1].running_mean, model[1].running_var), (bn.running_mean, bn.running_var))


# -- balancing ----------------------------------------------------------------------------------------


def valid(balance: list[int], layers: int, partitions: int) -> bool:
    return len(balance) == partitions and sum(balance) == layers and all(type(n) is int and n > 0 for n in balance)


def test_balance_by_time_on_the_cpu_leaves_the_model_as_it_was():
    model = mlp().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    balance = balance_by_time(3, model, torch.randn(4, 6), timeout=0.0, device="cpu")
    assert valid(balance, len(model), 3)
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model(torch.randn(2, 6)).sum().backward()
    with pytest.raises(ValueError, match="gradient"):
        balance_by_time(2, model, torch.randn(4, 6), timeout=0.0, device="cpu")


def test_balance_by_size_on_the_cpu():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1024))
    sample = torch.randn(8, 16)
    assert valid(balance_by_size(3, model, sample, chunks=2, device="cpu"), 5, 3)
    assert balance_by_size(2, model, sample, param_scale=100, device="cpu") == [4, 1]  # the big layer alone
    assert all(p.grad is None for p in model.parameters())
