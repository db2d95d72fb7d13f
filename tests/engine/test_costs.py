"""gpipe.memory.costs and gpipe.memory.costs_together: each layer measured as the workers run it (fused, B and W as a split
backward runs them, a plain backward apart, the optimizer's step), and by one pinned process per worker at once,
with the replicas' collectives among them.
The cost lines themselves: tests/control/test_planner.py."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from gpipe import grad_in_place
from gpipe.memory import costs, costs_together
from gpipe.memory.costs import Cost, LayerCosts

# a large linear (fused: 4 MiB of weight), a small one (autograd's own), a layer without weights
MODEL = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 16), nn.ReLU())
SAMPLE = torch.randn(32, 1024)
ADAMW = (torch.optim.AdamW, {"lr": 1e-3})


def test_each_layer_is_measured_fused_and_the_plan_s_model_is_left_alone(monkeypatch):
    fused = []
    real = grad_in_place.fuse
    monkeypatch.setattr(grad_in_place, "fuse", lambda m: fused.append(m) or real(m))
    got = costs.measure(MODEL, SAMPLE, torch.device("cpu"), 1, (4, 32), repeats=1, optimizer=ADAMW)
    assert len(got) == 3 and all(isinstance(c, LayerCosts) and c.bw is not None for c in got)
    assert len(fused) == 6 and [grad_in_place.in_place_params(m) != set() for m in fused[:3]] == [True, False, False]
    assert "forward" not in MODEL[0].__dict__  # the copies were fused, not the plan's model
    first, _, relu = got
    # The first layer's input, the data, wants no gradient: no B, its W the whole backward.
    assert first.b.at(32) < first.w.at(32) / 3 and first.backward(32) > 0  # (B: only its bookkeeping)
    assert got[1].b.at(32) > 0 and got[1].w.at(32) > 0
    # The optimizer's step costs where there are weights, and most where there are most.
    assert relu.step == 0.0 and first.step > got[1].step > 0
    assert all(p.grad is None for p in MODEL.parameters())


def test_without_an_optimizer_no_step_and_a_mean_is_each_cost_s():
    got = costs.measure(MODEL, SAMPLE, torch.device("cpu"), 1, (32, 32), repeats=1)
    assert all(c.step == 0.0 for c in got)
    a, b = LayerCosts(Cost(1.0, 2.0), Cost(0, 0), Cost(0, 1), Cost(2, 2), 1.0), LayerCosts(
        Cost(3.0, 0.0), Cost(2, 0), Cost(0, 3), Cost(0, 0), 3.0)
    mean = LayerCosts.mean([a, b])
    assert mean == LayerCosts(Cost(2.0, 1.0), Cost(1, 0), Cost(0, 2), Cost(1, 1), 2.0)
    assert LayerCosts.mean([a, LayerCosts(Cost(0, 0), Cost(0, 0), Cost(0, 0))]).bw is None  # one not measured
    assert LayerCosts(Cost(0, 0), Cost(0, 1), Cost(0, 2)).backward(2) == 6.0  # no BW: B + W


@pytest.mark.multiprocess
def test_measured_together_by_pinned_processes_one_per_worker():
    cores = sorted(os.sched_getaffinity(0))
    sets = [cores[:1], cores[-1:]]  # two workers' cores (one core twice on a host of one)
    got, collectives = costs_together.measure_together(MODEL, SAMPLE, sets, [1, 1], (4, 32), repeats=1,
                                                       optimizer=ADAMW)
    assert len(got) == 3 and got[0].w.at(32) > 0 and got[0].step > 0 and got[2].step == 0.0
    # and the replicas' collectives among them: a bucket's all-reduce, a gather's round
    assert collectives.ranks == 2
    assert collectives.all_reduce.at(25 << 20) > collectives.all_reduce.at(4096) > 0
    assert collectives.all_gather.at(2 << 20) > 0 and collectives.overlapped >= 0


@pytest.mark.multiprocess
def test_a_process_that_fails_is_one_error():
    with pytest.raises(RuntimeError, match="measuring the layers in 2 processes: .*Error"):
        costs_together.measure_together(MODEL, torch.randn(32, 7), [[0], [0]], [1, 1], (4, 32), repeats=1)


def _refuse() -> None:
    raise ImportError("No module named 'elsewhere'")


class _Unloadable(nn.Module):
    """A layer that pickles but does not load back (as a class of a module a fresh interpreter cannot import)."""

    def __reduce__(self):
        return _refuse, ()

    def forward(self, x):
        return x


@pytest.mark.multiprocess
def test_a_model_the_processes_cannot_load_or_be_sent_is_one_line_without_a_traceback(capfd):
    # The processes load what they are sent themselves: a failure there is said in the one error, not printed as
    # the interpreter's traceback before the process runs (tests/engine/test_grad_in_place.py: the GraphModule
    # that failed so).
    model = nn.Sequential(nn.Linear(7, 7), _Unloadable())
    with pytest.raises(RuntimeError) as e:
        costs_together.measure_together(model, torch.randn(8, 7), [[0], [0]], [1, 1], (4, 8), repeats=1)
    assert str(e.value) == ("measuring the layers in 2 processes: loading the model there: ImportError: No module "
                            "named 'elsewhere'")
    assert "Traceback" not in capfd.readouterr().err
    unpicklable = nn.Sequential(nn.Linear(7, 7))
    unpicklable.f = lambda x: x  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="measuring the layers in 2 processes: sending them the model: "):
        costs_together.measure_together(unpicklable, torch.randn(8, 7), [[0], [0]], [1, 1], (4, 8), repeats=1)
