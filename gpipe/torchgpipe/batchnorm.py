"""torchgpipe's DeferredBatchNorm: running statistics of a mini-batch, committed after `chunks` micro-batches.

    from gpipe.torchgpipe.batchnorm import DeferredBatchNorm
    model = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)

Each forward in training mode normalizes its micro-batch with the
micro-batch's own statistics, as BatchNorm does, and adds the micro-batch's
per-channel sum and sum of squares to the buffers `sum` and `sum_squares`
(a recomputation under checkpointing adds nothing: gpipe.recompute). The
`chunks`-th micro-batch tracked commits: the running mean and the unbiased
running variance move once, by the momentum, towards those of every value
tracked, and `num_batches_tracked` grows by one, so the running statistics
are those of one BatchNorm that saw the whole mini-batch. GPipe(...,
deferred_batch_norm=True) converts its module's BatchNorms with its chunks.

gpipe's own deferred BatchNorm (gpipe.batchnorm, `gpipe.Pipeline(...,
deferred_batch_norm=True)`) commits once a step instead, after the backward;
this class keeps torchgpipe's rule, buffers and state_dict keys, so a
torchgpipe checkpoint loads.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gpipe.recompute import is_recomputing

__all__ = ["DeferredBatchNorm"]

M = TypeVar("M", bound=nn.Module)


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm that tracks `chunks` micro-batches and then updates its running statistics once."""

    sum: torch.Tensor
    sum_squares: torch.Tensor

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 chunks: int = 1) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.register_buffer("sum", torch.zeros(num_features))
        self.register_buffer("sum_squares", torch.zeros(num_features))
        self.counter = 0  # values per channel tracked since the last commit
        self.tracked = 0  # micro-batches tracked since the last commit
        self.chunks = chunks

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @torch.no_grad()
    def _track(self, input: torch.Tensor) -> None:
        dims = [0, *range(2, input.dim())]  # every dimension but the channels'
        self.sum += input.sum(dims, dtype=torch.float64).to(self.sum.dtype)
        self.sum_squares += input.square().sum(dims, dtype=torch.float64).to(self.sum_squares.dtype)
        self.counter += input.numel() // input.size(1)
        self.tracked += 1

    @torch.no_grad()
    def _commit(self) -> None:
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked += 1
        f = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        n = self.counter
        mean = self.sum.double() / n
        var = (self.sum_squares.double() - mean.square() * n) / max(n - 1, 1)  # unbiased, as BatchNorm's
        self.running_mean.copy_(self.running_mean.double() * (1 - f) + mean * f)
        self.running_var.copy_(self.running_var.double() * (1 - f) + var * f)
        self.sum.zero_()
        self.sum_squares.zero_()
        self.counter = self.tracked = 0

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        if not is_recomputing():  # a recomputed micro-batch was tracked by its first forward
            self._track(input)
            if self.tracked == self.chunks:
                self._commit()
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @classmethod
    def convert_deferred_batch_norm(cls, module: M, chunks: int = 1) -> M:
        """`module` with every BatchNorm in it that tracks running statistics replaced by a DeferredBatchNorm of
        `chunks` sharing its parameters and buffers (`module` itself when it is one: a new module). A
        DeferredBatchNorm of the same chunks is left as it is."""
        if isinstance(module, DeferredBatchNorm) and module.chunks == chunks:
            return module
        out: nn.Module = module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            out = DeferredBatchNorm(module.num_features, module.eps, module.momentum, module.affine, chunks)
            if module.affine:
                out.register_parameter("weight", module.weight)
                out.register_parameter("bias", module.bias)
            out.register_buffer("running_mean", module.running_mean)
            out.register_buffer("running_var", module.running_var)
            out.register_buffer("num_batches_tracked", module.num_batches_tracked)
            assert module.running_mean is not None
            out.register_buffer("sum", torch.zeros_like(module.running_mean))
            out.register_buffer("sum_squares", torch.zeros_like(module.running_mean))
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return out  # type: ignore[return-value]  # a BatchNorm converted is a module of another class
