"""Deferred BatchNorm: running statistics of the whole batch, updated once per step.

BatchNorm normalizes each micro-batch with that micro-batch's statistics, and by
default updates its running statistics once per micro-batch, as gradient
accumulation on one device does. With `deferred_batch_norm: true` a stage
converts its BatchNorm layers so that a forward only tracks its micro-batch's
count, mean and variance, and the step's end commits them: the running mean and
the unbiased running variance move once, by the momentum, towards those of the
whole batch, and `num_batches_tracked` grows by one. Normalization and gradients
are unchanged. The running statistics are then those of one device running the
whole batch through BatchNorm.

The same on one device, in plain PyTorch::

    from gpipe import batchnorm

    model = batchnorm.convert_deferred_batch_norm(model)
    for x, y in zip(inputs, targets):  # the step's micro-batches
        (loss_fn(model(x), y) * len(x) / batch_size).backward()
    batchnorm.commit(model)  # once per step
    optimizer.step()

Conversion is in place: each BatchNorm keeps its parameters, buffers and
state_dict keys, and gets a subclass (as torch.nn.utils.parametrize does), so
optimizers and checkpoints see no difference. What a layer has tracked but not
committed is no buffer, so a checkpoint holds committed statistics only.
SyncBatchNorm is left as it is.

With data-parallel replicas, each copy of a stage tracks its own shard's
micro-batches; `all_reduce` combines what the copies tracked before they
commit, so every replica's running statistics are those of the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gpipe.recompute import is_recomputing

M = TypeVar("M", bound=nn.Module)


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm that tracks micro-batches in its forward and updates its running statistics in `commit`.

    Mixed into a BatchNorm class in front of it: `convert_deferred_batch_norm` makes the classes.
    """

    # Tracked since the last commit: count per channel, mean, and sum of squared deviations (float64).
    _tracked: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        self._check_input_dim(input)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        if not is_recomputing():  # a recomputed micro-batch was tracked by its first forward
            self._track(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def _track(self, x: torch.Tensor) -> None:
        """Add a micro-batch's statistics to the tracked ones (Chan et al.'s pairwise combination)."""
        dims = [0, *range(2, x.dim())]
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        n, mean, m2 = x.numel() // x.size(1), mean.double(), var.double() * (x.numel() // x.size(1))
        if self._tracked is not None:
            n0, mean0, m20 = self._tracked
            delta, total = mean - mean0, n0 + n
            mean, m2 = mean0 + delta * (n / total), m20 + m2 + delta.square() * (n0 * n / total)
            n = total
        self._tracked = (n, mean, m2)

    @torch.no_grad()
    def commit(self) -> None:
        """Move the running statistics once towards the tracked ones, as BatchNorm's forward does."""
        if self._tracked is None:
            return
        n, mean, m2 = self._tracked
        self._tracked = None
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        f = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        var = m2 / max(n - 1, 1)  # unbiased, as BatchNorm's running variance
        self.running_mean.copy_(self.running_mean.double() * (1 - f) + mean * f)
        self.running_var.copy_(self.running_var.double() * (1 - f) + var * f)


class DeferredBatchNorm1d(DeferredBatchNorm, nn.BatchNorm1d):
    pass


class DeferredBatchNorm2d(DeferredBatchNorm, nn.BatchNorm2d):
    pass


class DeferredBatchNorm3d(DeferredBatchNorm, nn.BatchNorm3d):
    pass


_CLASSES: dict[type[_BatchNorm], type[_BatchNorm]] = {
    nn.BatchNorm1d: DeferredBatchNorm1d, nn.BatchNorm2d: DeferredBatchNorm2d, nn.BatchNorm3d: DeferredBatchNorm3d,
}


def _deferred(cls: type[_BatchNorm]) -> type[_BatchNorm]:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Deferred{cls.__name__}", (DeferredBatchNorm, cls), {})
    return _CLASSES[cls]


def per_replica(model: nn.Module, sync_across_processes: bool) -> str | None:
    """The name of the first BatchNorm in `model` whose running statistics data-parallel replicas would keep
    apart unless deferred ("" for `model` itself), or None: one that tracks them, but for a SyncBatchNorm where
    the replicas are processes of one c10d world (`sync_across_processes`: the service; in one process it syncs
    nothing). With replicas, such a model equals one device only with deferred_batch_norm: the rule JobSpec's
    plan and gpipe.Pipeline keep."""
    for name, m in model.named_modules():
        if (isinstance(m, _BatchNorm) and m.track_running_stats
                and not (sync_across_processes and isinstance(m, nn.SyncBatchNorm))):
            return str(name)
    return None


def convert_deferred_batch_norm(module: M) -> M:
    """Make every BatchNorm in `module` that tracks running statistics a deferred one, in place; returns `module`."""
    for m in module.modules():
        if (isinstance(m, _BatchNorm) and m.track_running_stats
                and not isinstance(m, DeferredBatchNorm | nn.SyncBatchNorm)):
            m.__class__ = _deferred(type(m))
    return module


def commit(module: nn.Module) -> None:
    """Update the running statistics of every deferred BatchNorm in `module` with what it tracked: once a step."""
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            m.commit()


def discard(module: nn.Module) -> None:
    """Forget what the deferred BatchNorms in `module` tracked since the last commit (a step that failed)."""
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            m._tracked = None


@torch.no_grad()
def all_reduce(module: nn.Module, reduce: Callable[[torch.Tensor], None]) -> None:
    """Combine what the deferred BatchNorms of `module` tracked with their copies in the other replicas, in one
    sum (`reduce`, in place, among the copies: gpipe.transport): each then holds the whole batch's count, mean
    and squared deviations. Every copy must call it, with the same layers."""
    layers = [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]
    if not layers:
        return
    parts = []
    for m in layers:
        c = m.num_features
        device = m.running_mean.device if m.running_mean is not None else torch.device("cpu")
        if m._tracked is None:
            parts.append(torch.zeros(1 + 2 * c, dtype=torch.float64, device=device))
        else:
            n, mean, m2 = m._tracked
            # Sums that add up across ranks: count, sum of x, sum of squares about zero.
            parts.append(torch.cat([mean.new_tensor([float(n)]), mean * n, m2 + mean.square() * n]))
    flat = torch.cat(parts)
    reduce(flat)
    offset = 0
    for m in layers:
        c = m.num_features
        count = float(flat[offset])
        total, squares = flat[offset + 1: offset + 1 + c], flat[offset + 1 + c: offset + 1 + 2 * c]
        offset += 1 + 2 * c
        if count == 0:
            m._tracked = None
            continue
        mean = total / count
        m._tracked = (round(count), mean, squares - mean.square() * count)
