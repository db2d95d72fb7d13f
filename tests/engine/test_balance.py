"""Balance: the contiguous cut, and the costs by parameters, time and memory."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import yaml
from torch import nn

from gpipe import balance
from gpipe.builtins import mlp
from gpipe.coordinator.attempt.metrics import write_plan
from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.spec.job import parse_spec
from gpipe.memory import footprint
from gpipe.optim import state_slots
from gpipe.schedule import simulate
from tests.support.models import Slow
from tests.support.spec import DELETE, job_yaml, regression


def best_max(costs, stages):
    """The smallest largest-stage cost over every contiguous cut (brute force)."""
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_partition_is_optimal_and_every_stage_has_a_layer(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 10, (1,), generator=g))
    costs = (torch.rand(n, generator=g) * 100).tolist()
    for stages in range(1, n + 1):
        b = balance.partition(costs, stages)
        assert len(b) == stages and sum(b) == n and min(b) >= 1
        start, loads = 0, []
        for k in b:
            loads.append(sum(costs[start:start + k]))
            start += k
        assert max(loads) <= best_max(costs, stages) * (1 + 1e-5) + 1e-4


def test_by_params():
    model = mlp(width=8, depth=8)  # 8 equal blocks and a head
    assert balance.partition(balance.param_costs(model), 2) == [5, 4]
    assert balance.partition(balance.param_costs(model), 9) == [1] * 9
    heavy = nn.Sequential(nn.Linear(2, 2), nn.Linear(100, 100), nn.Linear(2, 2), nn.Linear(2, 2))
    assert balance.partition(balance.param_costs(heavy), 3) == [1, 1, 2]


def test_by_time_measures_the_layers():
    # Two slow parameterless layers, then four light linear ones: by parameters the slow
    # pair would share a stage; by time each half of the work goes to its own stage.
    model = nn.Sequential(Slow(0.03), Slow(0.03), *[nn.Linear(64, 64) for _ in range(4)])
    costs = balance.time_costs(model, torch.randn(8, 64), torch.device("cpu"), threads=1)
    assert all(c >= 0.03 for c in costs[:2]) and all(c < 0.03 for c in costs[2:])
    assert balance.partition(costs, 2) == [1, 5]
    assert balance.partition(balance.param_costs(model), 2) != [1, 5]


def test_by_memory_counts_weights_state_and_activations():
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 4))
    x = torch.randn(5, 8)
    fp = footprint.measure(model, x)  # at 2 and 4 samples, a line through them: exact at 5
    costs = balance.memory_costs(model, fp, 5, state_slots("adam"), in_flight=3)
    # Linear keeps its input, ReLU its output: 2 x 5x8 floats. Adam: weight, grad, 2 slots.
    assert costs[0] == (8 * 8 + 8) * 4 * (2 + 2) + 2 * 5 * 8 * 4 * 3
    assert costs[1] == (8 * 4 + 4) * 4 * (2 + 2) + 5 * 8 * 4 * 3
    plain = balance.memory_costs(model, fp, 5, state_slots("sgd"), in_flight=1)
    assert plain[0] == (8 * 8 + 8) * 4 * 2 + 2 * 5 * 8 * 4


def test_balancing_leaves_the_initial_weights_alone(tmp_path):
    spec = parse_spec(job_yaml(name="b", model__args__dropout=0.5, balance="by_time", steps=1))
    plan = make_plan(spec, tmp_path)
    torch.manual_seed(0)
    fresh = mlp(width=8, depth=3, dropout=0.5)
    assert all(torch.equal(a, b) for a, b in zip(plan.model.state_dict().values(), fresh.state_dict().values(),
                                                  strict=True))
    assert sum(plan.balance) == 4 and len(plan.balance_costs) == 4


def _resume_spec(balance: str) -> str:
    return job_yaml(name="b", model__args__depth=5, balance=yaml.safe_load(balance), chunks=DELETE,
                    data=regression(8, 8, 4), steps=1)


@pytest.mark.parametrize(("balance", "checkpoints", "want", "by"), [
    ("[1, 5]", [3, 3], [1, 5], "spec"),  # the spec's own balance wins over the checkpoint's
    ("by_params", [5, 1], [5, 1], "checkpoint"),  # a computed one keeps the checkpoint's cut
    ("by_memory", [5, 1], [5, 1], "checkpoint"),
    ("by_params", [2, 2, 2], None, "by_params"),  # the checkpoint's has other stages: computed afresh
    ("by_params", None, None, "by_params"),
])
def test_a_resumed_plan_keeps_the_spec_balance_or_else_the_checkpoints(tmp_path, balance, checkpoints, want, by):
    plan = make_plan(parse_spec(_resume_spec(balance)), tmp_path, balance_of=checkpoints)
    if want is not None:
        assert plan.balance == want
    assert plan.balance_by == by and sum(plan.balance) == 6 and len(plan.balance) == 2
    write_plan(tmp_path, plan, [{"device": "cpu"}, {"device": "cpu"}])
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["balance"] == plan.balance and written["balance_by"] == by


@pytest.mark.parametrize(("schedule", "stages", "chunks"), [("gpipe", 3, 5), ("1f1b", 3, 5), ("1f1b", 4, 2)])
def test_by_memory_counts_the_micro_batches_the_schedule_holds(schedule, stages, chunks):
    in_flight = max(simulate(schedule, stages, chunks).max_in_flight)
    assert in_flight == (chunks if schedule == "gpipe" else min(stages, chunks))
