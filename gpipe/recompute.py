"""A recomputed forward changes no state: each micro-batch updates running statistics once.

Activation checkpointing runs a micro-batch's forward twice: first without
autograd, then again in the backward to rebuild what the backward needs.
BatchNorm updates its running statistics on every forward in training mode,
so the recomputation would count each micro-batch twice. `Buffers` keeps the
buffers a forward updates as the first forward left them: it copies them
before the recomputation and writes the copies back after, bit for bit. The
recomputation itself runs unchanged, in training mode on the batch's own
statistics, so its output and gradients are those of the first forward.

Which buffers to keep: those of every BatchNorm that tracks running statistics
(its kernel updates the mean and variance without telling autograd's version
counters), and those of any module that an earlier first forward updated in
place (seen by the version counters), such as a module counting its calls.

`is_recomputing()` tells a layer that its forward is a recomputation; deferred
BatchNorm (gpipe.batchnorm) uses it to track each micro-batch once.
`is_checkpointing()` tells it that its forward is the first of a checkpointed
micro-batch, run without autograd (torchgpipe's pair of names).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_recomputing: ContextVar[bool] = ContextVar("gpipe_recomputing", default=False)
_checkpointing: ContextVar[bool] = ContextVar("gpipe_checkpointing", default=False)
_NOTHING = nullcontext()  # reusable: it keeps no state


def is_recomputing() -> bool:
    """True inside `Buffers.recompute`: the forward being run is a recomputation."""
    return _recomputing.get()


def is_checkpointing() -> bool:
    """True inside `checkpointing`: the forward being run is a checkpointed micro-batch's first, without
    autograd; its backward will recompute it."""
    return _checkpointing.get()


@contextmanager
def checkpointing() -> Iterator[None]:
    """Run a checkpointed micro-batch's first forward (`is_checkpointing()` is true within)."""
    token = _checkpointing.set(True)
    try:
        yield
    finally:
        _checkpointing.reset(token)


class Buffers:
    """The buffers of `module` that its forward updates, kept unchanged across recomputations."""

    def __init__(self, module: nn.Module):
        self.updated: dict[int, torch.Tensor] = {}
        self.unseen: list[nn.Module] = []  # modules with buffers that no forward has updated yet
        for m in module.modules():
            if isinstance(m, _BatchNorm) and m.track_running_stats:
                self._add(m)
            elif next(m.buffers(recurse=False), None) is not None:
                self.unseen.append(m)

    def _add(self, m: nn.Module) -> None:
        for b in m.buffers(recurse=False):
            self.updated[id(b)] = b

    def watch(self) -> AbstractContextManager[None]:
        """Run a forward, and learn which modules it updates in place (nothing to do once every module with
        buffers is known to)."""
        return self._watch() if self.unseen else _NOTHING

    @contextmanager
    def _watch(self) -> Iterator[None]:
        before = [[b._version for b in m.buffers(recurse=False)] for m in self.unseen]
        yield
        for m, versions in zip(list(self.unseen), before, strict=True):
            if [b._version for b in m.buffers(recurse=False)] != versions:
                self._add(m)
                self.unseen.remove(m)

    @contextmanager
    def recompute(self) -> Iterator[None]:
        """Run a recomputation: the updated buffers are as they were before it, whatever it does."""
        saved = [(b, b.clone()) for b in self.updated.values()]
        token = _recomputing.set(True)
        try:
            yield
        finally:
            _recomputing.reset(token)
            with torch.no_grad():
                for b, copy in saved:
                    b.copy_(copy)
