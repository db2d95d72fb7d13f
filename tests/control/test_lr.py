"""The LR schedules: each step's LR from gpipe.coordinator.attempt.lr equals a hand computation and torch's LambdaLR."""

from __future__ import annotations

import pytest
import torch

from gpipe.coordinator.attempt.lr import lr_at
from gpipe.coordinator.spec.job import parse_spec
from gpipe.errors import SpecError
from tests.support.reference import lr_factor
from tests.support.spec import job, job_yaml

SCHEDULES = {
    "linear": {"name": "linear"},
    "linear-warmup-floor": {"name": "linear", "warmup_steps": 3, "min_lr": 0.01},
    "cosine-warmup": {"name": "cosine", "warmup_steps": 2, "min_lr": 0.02},
    "wsd": {"name": "wsd"},
    "wsd-warmup-ratio": {"name": "wsd", "warmup_steps": 2, "decay_fraction": 0.4, "min_lr_ratio": 0.1},
    "wsd-cosine-floor": {"name": "wsd", "warmup_steps": 1, "decay_fraction": 0.5, "decay_shape": "cosine",
                         "min_lr": 0.005},
    "wsd-sqrt": {"name": "wsd", "decay_fraction": 0.3, "decay_shape": "sqrt"},
    "wsd-no-decay": {"name": "wsd", "warmup_steps": 4, "decay_fraction": 0},
    "wsd-all-decay": {"name": "wsd", "decay_fraction": 1, "decay_shape": "cosine"},
}


@pytest.mark.parametrize("steps", [1, 2, 10, 17])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_step_equals_torch_lambda_lr(name, steps):
    spec = job(steps=steps, lr_schedule=SCHEDULES[name])
    try:
        parsed = parse_spec(job_yaml(steps=steps, lr_schedule=SCHEDULES[name]))
    except SpecError:
        assert steps < 10  # warmup with the decay too long for the run: refused, tested below
        return
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_factor(spec, k))
    for step in range(steps):
        assert lr_at(parsed, step) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15), step
        opt.step()
        sched.step()


def lrs(steps: int, schedule: dict) -> list[float]:
    spec = parse_spec(job_yaml(steps=steps, optimizer={"name": "sgd", "lr": 1.0}, lr_schedule=schedule))
    return [round(lr_at(spec, k), 6) for k in range(steps)]


def test_by_hand():
    # linear: up over 2 steps, then from 1 at step 2 down to 0.1 at the last (step 5) in 3 equal steps
    assert lrs(6, {"name": "linear", "warmup_steps": 2, "min_lr": 0.1}) == [0.5, 1, 1, 0.7, 0.4, 0.1]
    # wsd: up over 2, flat, the last 3 of 10 down to 0.1 x lr (the first already below, the last at it)
    assert lrs(10, {"name": "wsd", "warmup_steps": 2, "decay_fraction": 0.3, "min_lr_ratio": 0.1}) == \
        [0.5, 1, 1, 1, 1, 1, 1, 0.7, 0.4, 0.1]
    assert lrs(4, {"name": "wsd", "decay_fraction": 0.5, "decay_shape": "cosine"}) == [1, 1, 0.5, 0]
    assert lrs(5, {"name": "wsd", "decay_fraction": 0.2, "decay_shape": "sqrt", "min_lr": 0.5}) == [1] * 4 + [0.5]
    assert lrs(3, {"name": "wsd", "decay_fraction": 0}) == [1, 1, 1]
    assert lrs(100, {"name": "wsd", "decay_fraction": 0.001})[-2:] == [1, 0]  # a fraction under a step: one


@pytest.mark.parametrize("changes,line", [
    ({"steps": 4, "lr_schedule": {"name": "linear", "warmup_steps": 4}},
     "lr_schedule.linear.warmup_steps: 4 leaves no step of the 4 to decay"),
    ({"lr_schedule": {"name": "linear", "min_lr": 0.2}}, "lr_schedule.linear.min_lr: 0.2 is above optimizer.lr 0.1"),
    ({"steps": 10, "lr_schedule": {"name": "wsd", "warmup_steps": 8, "decay_fraction": 0.3}},
     "lr_schedule.wsd.warmup_steps: 8 steps of warmup and 3 of decay (decay_fraction 0.3) exceed the 10 steps"),
    ({"steps": 10, "lr_schedule": {"name": "wsd", "warmup_steps": 11, "decay_fraction": 0}},
     "lr_schedule.wsd.warmup_steps: 11 steps of warmup and 0 of decay (decay_fraction 0) exceed the 10 steps"),
    ({"lr_schedule": {"name": "wsd", "min_lr": 0.01, "min_lr_ratio": 0.1}},
     "lr_schedule.wsd: min_lr and min_lr_ratio both set the floor; give one"),
    ({"lr_schedule": {"name": "wsd", "min_lr": 0.5}}, "lr_schedule.wsd.min_lr: 0.5 is above optimizer.lr 0.1"),
    ({"lr_schedule": {"name": "wsd", "decay_shape": "exp"}},
     "lr_schedule.wsd.decay_shape: Input should be 'linear', 'sqrt' or 'cosine'"),
    ({"lr_schedule": {"name": "wsd", "decay_fraction": 1.5}},
     "lr_schedule.wsd.decay_fraction: must be between 0 and 1, got 1.5"),
    ({"lr_schedule": {"name": "wsd", "min_lr_ratio": -0.1}},
     "lr_schedule.wsd.min_lr_ratio: must be between 0 and 1, got -0.1"),
    ({"lr_schedule": {"name": "linear", "warmup_steps": -1}},
     "lr_schedule.linear.warmup_steps: must be an integer between 0 and 1000000000, got -1"),
    ({"lr_schedule": {"name": "wsd", "decay": 0.2}}, "lr_schedule.wsd.decay: unknown field"),
])
def test_bad_combinations_are_one_line(changes, line):
    with pytest.raises(SpecError) as e:
        parse_spec(job_yaml(**changes))
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)
