"""The learning rate of each step: a pure function of the step, so resuming needs no state."""

from __future__ import annotations

import math
from collections.abc import Callable

from gpipe.coordinator.spec.job import CosineLR, JobSpec, LinearLR, StepLR, WsdLR

# The wsd decay's curves: progress through the decay (0, 1] to the share of (lr - floor) left.
DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1 - p,
    "sqrt": lambda p: 1 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
}


def lr_at(spec: JobSpec, step: int) -> float:
    """The LR for step `step` (0-based).

    Warmup (cosine, linear, wsd) climbs to optimizer.lr at step warmup_steps - 1. cosine and linear then fall
    from optimizer.lr at step warmup_steps to min_lr at the last step; wsd holds optimizer.lr and falls over
    its last decay steps, the first already below optimizer.lr, the last at the floor (torchtitan's WSD).
    """
    base, sched = spec.optimizer.lr, spec.lr_schedule
    if sched is None:
        return base
    if isinstance(sched, StepLR):
        return base * sched.gamma ** (step // sched.step_size)
    assert isinstance(sched, CosineLR | LinearLR | WsdLR)
    if step < sched.warmup_steps:
        return base * (step + 1) / sched.warmup_steps
    if isinstance(sched, WsdLR):
        decay = sched.decay_steps(spec.steps)
        start = spec.steps - decay
        if step < start:
            return base
        floor, p = sched.floor(base), min(1.0, (step - start + 1) / decay)
        return floor + (base - floor) * DECAY_SHAPES[sched.decay_shape](p)
    span = max(1, spec.steps - sched.warmup_steps - 1)
    t = min(1.0, (step - sched.warmup_steps) / span)
    left = 1 - t if isinstance(sched, LinearLR) else 0.5 * (1 + math.cos(math.pi * t))
    return sched.min_lr + (base - sched.min_lr) * left
