"""gpipe.skip's torchgpipe semantics: None stashed and popped, namespaces for a block used twice, and a stash
that no later layer pops refused. Pipelined through gpipe.Pipeline against the same nn.Sequential on one
device, in process."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import gpipe
from gpipe import skip
from gpipe.errors import SpecError
from gpipe.memory.probe import probe
from gpipe.wire import encode


def one_device_grads(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, chunks: int) -> nn.Sequential:
    """A copy of `model` holding one device's gradients of the batch's mean loss, on the same micro-batches."""
    ref = copy.deepcopy(model)
    with skip.use(skip.Context()):
        for xm, ym in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks), strict=True):
            (nn.functional.mse_loss(ref(xm), ym) * len(xm) / len(x)).backward()
    return ref


def assert_pipelined_equals_one_device(model: nn.Sequential, balance: list[int], chunks: int = 3,
                                       **options: str) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    ref = one_device_grads(model, x, y, chunks)
    m = copy.deepcopy(model)
    with gpipe.Pipeline(m, balance, chunks=chunks, **options) as pipe:
        pipe.step(x, y, nn.functional.mse_loss)
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert torch.allclose(p.grad, q.grad, atol=1e-6), (balance, name)


# -- None -----------------------------------------------------------------------------------------------------


class StashNone(nn.Module):
    """Stashes None under "mask" and its input under "x"."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip.stash("mask", None)
        skip.stash("x", x)
        return x * 2


class PopNone(nn.Module):
    """Pops "mask", which must be None, and "x"."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = skip.pop("mask")
        if mask is not None:
            raise AssertionError(f"popped {mask!r} for a stashed None")
        h = skip.pop("x")
        assert h is not None
        return x + h


def none_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), StashNone(), nn.Linear(4, 4), nn.Tanh(), PopNone(), nn.Linear(4, 4))


def test_none_is_stashed_and_popped_on_one_device():
    with skip.use(skip.Context()):
        skip.stash("n", None)
        assert skip.pop("n") is None
        with pytest.raises(skip.SkipError):
            skip.pop("n")  # popped once, as a tensor is
    none_model()(torch.randn(3, 4)).sum().backward()  # the default context


@pytest.mark.parametrize("balance", [[2, 2, 2], [1, 4, 1], [6]], ids=["across-stages", "within-a-stage", "one-stage"])
def test_a_stashed_none_pops_as_none_pipelined(balance):
    """[2, 2, 2]: layer 1 stashes on stage 0, layer 4 pops on stage 2; [1, 4, 1]: both on stage 1."""
    assert_pipelined_equals_one_device(none_model(), balance)


def test_a_stashed_none_pops_as_none_when_recomputed():
    assert_pipelined_equals_one_device(none_model(), [2, 2, 2], activation_checkpoint="always", schedule="1f1b")


def test_the_probe_routes_a_stashed_none_and_it_crosses_every_backend():
    routes = probe(none_model(), torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)
    assert routes == {"mask": (1, 4), "x": (1, 4)}
    for backend in ("gloo", "nccl"):
        header, text, tensors = encode(0, {"mask": skip.NONE}, [False], backend)
        assert text is not None and sum(t.numel() for t in tensors) == 0
    assert not skip.NONE.is_floating_point()  # never wants a gradient


# -- namespaces -----------------------------------------------------------------------------------------------


class Down(nn.Module):
    """A block used twice: stashes its features under the same name, in its own namespace."""

    def __init__(self, ns: skip.Namespace):
        super().__init__()
        self.ns, self.lin = ns, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        skip.stash(self.ns("down"), h)
        return h * 0.5


class Up(nn.Module):
    def __init__(self, ns: skip.Namespace):
        super().__init__()
        self.ns, self.lin = ns, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = skip.pop(self.ns("down"))
        assert h is not None
        return self.lin(x) + h


def unet_like(a: skip.Namespace, b: skip.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Down(a), Down(b), nn.Linear(4, 4), Up(b), Up(a), nn.Linear(4, 4))


def test_namespaces_give_distinct_names_that_survive_a_copy():
    a, b = skip.Namespace(), skip.Namespace()
    assert a != b and a("down") != b("down")
    assert a("down") != a("up") and a("down").startswith("down@")
    assert isinstance(a("down"), str)
    for copied in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert copied == a and hash(copied) == hash(a) and copied("down") == a("down")
    model = unet_like(a, b)
    assert copy.deepcopy(model)[1].ns("down") == a("down")
    # A label: the same names in every build (the service's workers each build the model).
    assert skip.Namespace("enc")("down") == skip.Namespace("enc")("down") == "down@enc"
    assert skip.Namespace("enc") != skip.Namespace("dec")
    # A stage's error about a namespace's name says why it may be missing there.
    assert "label" in skip.namespace_hint(a("down")) and skip.namespace_hint("down") == ""
    for bad in ("", "a@b", 3):
        with pytest.raises(TypeError):
            skip.Namespace(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("balance", [[2, 3, 2], [3, 4], [7]], ids=lambda b: "-".join(map(str, b)))
def test_a_block_used_twice_with_two_namespaces_pipelined_equals_one_device(balance):
    """[2, 3, 2]: layer 1's stash goes from stage 0 to stage 2 past stage 1, layer 2's from stage 1 to stage 1."""
    assert_pipelined_equals_one_device(unet_like(skip.Namespace(), skip.Namespace()), balance)


def test_the_probe_routes_each_namespace_on_its_own():
    a, b = skip.Namespace(), skip.Namespace()
    routes = probe(unet_like(a, b), torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)
    assert routes == {a("down"): (1, 5), b("down"): (2, 4)}


def test_a_block_used_twice_in_one_namespace_is_refused_naming_both_layers():
    ns = skip.Namespace()
    with pytest.raises(SpecError) as e:
        probe(unet_like(ns, ns), torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)
    assert "layers 1 and 2" in str(e.value) and repr(ns("down")) in str(e.value)


# -- a stash that no later layer pops ------------------------------------------------------------------------


class StashOnly(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip.stash("lost", x)
        return x + 1


def unpopped() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), StashOnly(), nn.Linear(4, 4))


def test_the_probe_refuses_a_stash_that_no_later_layer_pops():
    with pytest.raises(SpecError) as e:
        probe(unpopped(), torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)
    assert "layer 2" in str(e.value) and "'lost'" in str(e.value), str(e.value)


@pytest.mark.parametrize("balance", [[2, 2], [4]])
def test_the_pipeline_refuses_a_stash_that_no_later_layer_pops(balance):
    with gpipe.Pipeline(unpopped(), balance, chunks=2) as pipe, pytest.raises(skip.SkipError) as e:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)
    assert "layer 2" in str(e.value) and "'lost'" in str(e.value), str(e.value)
