"""The optimizer state sharded across replicas (gpipe.memory.zero), in this process: R copies on threads, linked by the
in-memory transport, each stepping its share; the weights equal one unsharded optimizer's, and the state a
checkpoint holds is the unsharded state, whatever R it is restored on."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gpipe.memory import zero
from gpipe.memory.zero import Cut, ShardedOptimizer
from gpipe.optim import optimizer_class
from gpipe.transport import Hub

# Odd sizes, one-element parameters, a parameter that spans a bucket on its own, a second dtype (its own bucket).
SHAPES = [(7, 5), (1,), (3,), (13,), (1,), (2, 2, 3)]
OPTIMIZERS = {
    "adamw": {"lr": 0.01, "weight_decay": 0.01},
    "adam": {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6},
    "sgd-momentum": {"lr": 0.1, "momentum": 0.9, "nesterov": True},
}


def params_of(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def grads_of(step: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(100 + step)
    out: list[torch.Tensor | None] = [torch.randn(s, generator=g) for s in SHAPES]
    out[4] = None  # a parameter no step reached: no state, no update, as unsharded
    return out


def on_copies(replicas: int, body: Callable[[int, Any], Any]) -> list[Any]:
    """Run body(replica, gather) on `replicas` threads joined by the in-memory transport."""
    hub = Hub(stages=1, replicas=replicas, timeout=30)
    out: list[Any] = [None] * replicas
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = body(r, hub.transport(0, r, torch.device("cpu")).gather_copies)
        except BaseException as e:  # noqa: BLE001  # re-raised below, after every thread ended
            errors.append(e)
            hub.fail(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def step_all(opt: Any, params: list[torch.Tensor], steps: range) -> None:
    for s in steps:
        for p, g in zip(params, grads_of(s), strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)


def name_of(opt_name: str) -> str:
    return opt_name.split("-")[0]


@pytest.mark.parametrize("replicas", [2, 3, 5])
def test_the_cut_covers_every_element_once_in_shards_as_equal_as_elements_allow(replicas):
    params = [torch.zeros(s) for s in SHAPES] + [torch.zeros(9, dtype=torch.float64)]
    cut = Cut(params, replicas, bucket_bytes=64)  # small buckets: several, and a parameter larger than one
    seen = [torch.zeros(p.numel(), dtype=torch.int64) for p in params]
    for r in range(replicas):
        for pc in cut.mine(r):
            seen[pc.param][pc.lo:pc.hi] += 1
    assert all(bool((s == 1).all()) for s in seen)
    sizes = cut.sizes()
    assert max(sizes) - min(sizes) <= len(cut.buckets)  # at most one element apart per bucket
    assert sum(sizes) == sum(p.numel() for p in params)
    assert all(params[first].dtype == params[end - 1].dtype for first, end in cut.buckets)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("gather_bytes", [4 << 20, 24])  # one round a bucket; rounds of two elements a copy
@pytest.mark.parametrize("slice_bytes", [4 << 20, 12])  # a piece stepped whole; in slices of 3 elements
def test_sharded_steps_equal_one_unsharded_optimizer(opt_name, replicas, gather_bytes, slice_bytes, monkeypatch):
    monkeypatch.setattr(zero, "GATHER_BYTES", gather_bytes)
    monkeypatch.setattr(zero, "SLICE_BYTES", slice_bytes)
    cls, kwargs = optimizer_class(name_of(opt_name)), OPTIMIZERS[opt_name]
    want = params_of()
    step_all(cls(want, **kwargs), want, range(4))

    def copy(r: int, gather: Any) -> list[torch.Tensor]:
        params = params_of()
        opt = ShardedOptimizer(cls, kwargs, params, [str(i) for i in range(len(params))], replicas, r, gather)
        assert not any(opt._stepped())
        step_all(opt, params, range(4))
        # state is kept for the parameters that had a gradient (adam's made at the start, in one block per kind)
        assert opt._stepped() == [i != 4 for i in range(len(params))]
        assert opt.prefilled == (opt_name != "sgd-momentum")
        held = {id(t) for st in opt.inner.state.values() for t in st.values()}
        assert len(opt.inner.state) <= len(opt.slices) and len(held) == sum(len(st) for st in opt.inner.state.values())
        assert all(t.numel() <= slice_bytes // 4 for t in opt.slices) and len(opt.slices) >= len(opt.mine)
        return params

    for got in on_copies(replicas, copy):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize(("gather_bytes", "slice_bytes"), [(4 << 20, 4 << 20), (24, 4 << 20), (24, 12), (4 << 20, 8)])
def test_the_checkpointed_state_is_the_unsharded_state_and_restores_on_another_replica_count(opt_name, gather_bytes,
                                                                                              slice_bytes, monkeypatch):
    """Gathered in one round a tensor or in rounds of two elements; each piece stepped whole or in slices of 3 or
    2 elements."""
    monkeypatch.setattr(zero, "GATHER_BYTES", gather_bytes)
    monkeypatch.setattr(zero, "SLICE_BYTES", slice_bytes)
    cls, kwargs = optimizer_class(name_of(opt_name)), OPTIMIZERS[opt_name]
    whole = params_of()
    ref = cls(whole, **kwargs)
    step_all(ref, whole, range(3))
    names = [str(i) for i in range(len(whole))]

    def saved(r: int, gather: Any) -> dict[tuple[int, str], torch.Tensor] | None:
        params = params_of()
        opt = ShardedOptimizer(cls, kwargs, params, names, 2, r, gather)
        step_all(opt, params, range(3))
        entries = opt.snapshot_entries([True] * len(params))
        got = {k: opt.fetch(k[0], k[1], meta.dim() == 0) for k, meta in sorted(entries.items())}
        if r != 0:
            assert all(v is None for v in got.values())
            return None
        for (i, key), meta in entries.items():
            assert got[i, key].shape == meta.shape and got[i, key].dtype == meta.dtype
        return {k: v for k, v in got.items() if v is not None}

    state = on_copies(2, saved)[0]
    # the same tensors as the unsharded optimizer's, none for the parameter no step reached
    want = {(i, k): v for i, p in enumerate(whole) for k, v in ref.state[p].items()}
    assert set(state) == set(want) and not any(i == 4 for i, _ in state)
    for k in want:
        torch.testing.assert_close(state[k], want[k].float() if want[k].dim() == 0 else want[k], rtol=0, atol=0)

    # restored on 3 copies, and unsharded: the next steps equal the uninterrupted optimizer's
    step_all(ref, whole, range(3, 5))
    entries = {i: {k: v for (j, k), v in state.items() if j == i} for i in range(len(whole))}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in ref.param_groups]
    start = params_after(cls, kwargs, 3)

    def resumed(r: int, gather: Any) -> list[torch.Tensor]:
        params = [p.detach().clone().requires_grad_() for p in start]
        opt = ShardedOptimizer(cls, kwargs, params, names, 3, r, gather)
        opt.restore(entries, groups)
        step_all(opt, params, range(3, 5))
        return params

    for got in on_copies(3, resumed):
        for g, w in zip(got, whole, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def params_after(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], steps: int) -> list[torch.Tensor]:
    params = params_of()
    step_all(cls(params, **kwargs), params, range(steps))
    return [p.detach() for p in params]


def test_a_copy_with_no_piece_still_takes_part():
    """More copies than elements: a copy that holds nothing steps nothing, and gathers all the same."""
    cls = optimizer_class("adam")

    def copy(r: int, gather: Any) -> list[float]:
        params = [torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)]
        opt = ShardedOptimizer(cls, {"lr": 0.1}, params, ["a", "b"], 3, r, gather)
        for _ in range(2):
            for p in params:
                p.grad = torch.full((1,), 0.5)
            opt.step()
        return [float(p.detach()) for p in params]

    got = on_copies(3, copy)
    ref = [torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)]
    opt = cls(ref, lr=0.1)
    for _ in range(2):
        for p in ref:
            p.grad = torch.full((1,), 0.5)
        opt.step()
    assert all(g == [float(p.detach()) for p in ref] for g in got)
