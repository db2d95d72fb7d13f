"""Mixed precision: a stage's autocast, what crosses a cut, and fp16's dynamic loss scale.

`precision: bf16 | fp16` runs every stage's forward (and its recomputation
under activation checkpointing) under `torch.autocast` with that dtype. The
weights, their gradients and the optimizer's state stay float32, and the loss
is taken in float32 (the last stage's output is cast up before the loss).

A cut rounds: a float32 tensor that leaves a stage (an activation, a skip
connection) is cast to the autocast dtype inside the autograd graph, so it
travels in half the bytes, and its gradient comes back in that dtype too
(then the cast's backward takes it up to float32). One-device autocast may
keep such a value in float32 (an op autocast leaves alone, a residual sum of a
float32 input); the pipeline rounds it where it is cut. For the common case (a
cut after a linear layer or an activation of one) the value is in the autocast
dtype already and nothing changes; otherwise the weights differ from one-device
autocast by that rounding only. Float64 and integer tensors travel unchanged.

fp16 has a narrow range, so its gradients are taken of the loss times a
scale, which every stage divides out before clipping and the optimizer
(`LossScaler`, torch.amp.GradScaler's schedule). There is one scale for the
job: every stage checks its own gradients for inf or nan and all ranks agree
(the stage's all-reduce), so an overflow anywhere skips the optimizer step
everywhere and halves the scale; 2000 good steps in a row double it. The
scale is part of each stage's checkpointed state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, TypedDict

import torch

from gpipe import structure

Name = Literal["fp32", "bf16", "fp16"]
DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def unsupported(precision: str, device_type: str, device: torch.device | None = None) -> str | None:
    """Why this torch cannot run `precision` on `device_type` stages, or None when it can; with `device` (a
    worker's own GPU), also why that GPU cannot. The coordinator asks without a device: it never touches a GPU."""
    dtype = DTYPES[precision]
    if dtype is None:
        return None
    if not torch.amp.autocast_mode.is_autocast_available(device_type):
        return f"{precision} needs autocast, which torch {torch.__version__} lacks on {device_type}"
    if device is not None and device.type == "cuda" and dtype == torch.bfloat16:
        with torch.cuda.device(device):
            if torch.cuda.is_bf16_supported():
                return None
        return f"{precision}: {device} ({torch.cuda.get_device_name(device)}) does not support bfloat16"
    return None


class ScalerState(TypedDict):
    """A loss scaler as a checkpoint's JSON state holds it."""

    scale: float
    growth_tracker: int


class LossScaler:
    """fp16's dynamic loss scale: torch.amp.GradScaler's schedule, one scale for the whole job.

    The last stage's loss is multiplied by `scale`; after the backward every
    stage calls `unscale`, the stages agree whether any found inf or nan, and
    all call `update` with that answer: on an overflow the step is skipped and
    the scale backs off, else after `growth_interval` good steps it grows.
    """

    INIT, GROWTH_INTERVAL = 2.0**16, 2000  # the defaults (the spec's loss_scale sets them)
    GROWTH, BACKOFF = 2.0, 0.5
    MIN, MAX = 2.0**-24, 2.0**64  # what a restored scale may be: fp16's smallest step to far past its range
    MAX_TRACKER = 10**6  # what a restored count of good steps may be (the spec's largest growth_interval)

    def __init__(self, scale: float = INIT, growth_tracker: int = 0, growth_interval: int = GROWTH_INTERVAL):
        self.scale, self.growth_tracker, self.growth_interval = scale, growth_tracker, growth_interval

    def unscale(self, grads: Sequence[torch.Tensor]) -> bool:
        """Divide `grads` by the scale, in place; True if any holds inf or nan."""
        if not grads:
            return False
        inv = 1.0 / self.scale  # a power of two: exact
        torch._foreach_mul_(list(grads), inv)
        return not bool(torch.stack([g.isfinite().all() for g in grads]).all())

    def update(self, overflow: bool) -> None:
        """The step's outcome, agreed by every stage: back off after an overflow, else count towards growth."""
        if overflow:
            self.scale = max(self.scale * self.BACKOFF, self.MIN)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:  # >=: a resume may shorten the interval
            self.scale = min(self.scale * self.GROWTH, self.MAX)
            self.growth_tracker = 0

    def state(self) -> ScalerState:
        """JSON for a checkpoint (gpipe.state: loss_scale)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    @classmethod
    def from_state(cls, state: object, growth_interval: int = GROWTH_INTERVAL) -> LossScaler:
        """The scaler a checkpoint saved, growing every `growth_interval` steps; ValueError naming what is
        wrong with it."""
        if not isinstance(state, dict) or set(state) != {"scale", "growth_tracker"}:
            raise ValueError("loss_scale: not {scale, growth_tracker}")
        scale, tracker = state["scale"], state["growth_tracker"]
        if not (type(scale) in (int, float) and math.isfinite(scale) and cls.MIN <= scale <= cls.MAX):
            raise ValueError(f"loss_scale.scale: must be between 2**-24 and 2**64, got {str(scale)[:40]}")
        if not (type(tracker) is int and 0 <= tracker < cls.MAX_TRACKER):
            raise ValueError(f"loss_scale.growth_tracker: must be an integer between 0 and "
                             f"{cls.MAX_TRACKER - 1}, got {str(tracker)[:40]}")
        return cls(float(scale), tracker, growth_interval)


_NOTHING = nullcontext()  # reusable: it keeps no state


class Precision:
    """A stage's precision on `device`: its autocast, its cut's dtype and, for fp16, its loss scaler."""

    def __init__(self, name: str, device: torch.device, scaler_state: object = None,
                 init_scale: float = LossScaler.INIT, growth_interval: int = LossScaler.GROWTH_INTERVAL):
        if name not in DTYPES:
            raise ValueError(f"precision: {name!r} is not one of {', '.join(DTYPES)}")
        if why := unsupported(name, device.type, device):  # the plan checked the coordinator's torch; this, the GPU
            raise ValueError(f"precision: {why}")
        self.name, self.device = name, device
        self.dtype = DTYPES[name]
        self.scaler: LossScaler | None = None
        if name == "fp16":
            self.scaler = LossScaler(init_scale, 0, growth_interval) if scaler_state is None \
                else LossScaler.from_state(scaler_state, growth_interval)

    def autocast(self) -> AbstractContextManager[None]:
        """The context a forward runs in: autocast to the dtype, or nothing for fp32."""
        if self.dtype is None:
            return _NOTHING
        return torch.autocast(self.device.type, dtype=self.dtype)

    def cut(self, value: Any) -> Any:
        """`value` as it crosses a cut: its float32 tensors cast to the autocast dtype, in the graph."""
        dtype = self.dtype
        if dtype is None:
            return value
        return structure.map_tensors(value, lambda t: t.to(dtype) if t.dtype == torch.float32 else t)

    def for_loss(self, value: Any) -> Any:
        """The last stage's output as the loss takes it: the autocast dtype's tensors cast up to float32."""
        dtype = self.dtype
        if dtype is None:
            return value
        return structure.map_tensors(value, lambda t: t.float() if t.dtype == dtype else t)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to take gradients of: times the loss scale for fp16 (exact: a power of two)."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        """What the last stage multiplies its loss by: the scaler's scale, or 1."""
        return self.scaler.scale if self.scaler is not None else 1.0
