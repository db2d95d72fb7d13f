"""The learning rate of each step: a pure function of the step, so resuming needs no state."""

from __future__ import annotations

import math

from coordinator.spec import CosineLR, JobSpec, StepLR


def lr_at(spec: JobSpec, step: int) -> float:
    """The LR for step `step` (0-based)."""
    base, sched = spec.optimizer.lr, spec.lr_schedule
    if sched is None:
        return base
    if isinstance(sched, StepLR):
        return base * sched.gamma ** (step // sched.step_size)
    assert isinstance(sched, CosineLR)
    if step < sched.warmup_steps:
        return base * (step + 1) / sched.warmup_steps
    span = max(1, spec.steps - sched.warmup_steps - 1)
    t = min(1.0, (step - sched.warmup_steps) / span)
    return sched.min_lr + (base - sched.min_lr) * 0.5 * (1 + math.cos(math.pi * t))
