"""torchgpipe's API (v0.0.7) over gpipe.Pipeline: a torchgpipe script runs with its imports prefixed.

    from gpipe.torchgpipe import GPipe          # was: from torchgpipe import GPipe
    model = GPipe(nn.Sequential(...), balance=[2, 2], chunks=8)
    loss_fn(model(input), target).backward()

A thin layer, never a second engine: GPipe (gpipe.torchgpipe.gpipe) is an
nn.Module whose forward is a gpipe.Pipeline's; skippable modules
(gpipe.torchgpipe.skip) stash and pop through gpipe.skip; balancing
(gpipe.torchgpipe.balance) measures with gpipe.balance and
gpipe.memory.footprint; is_checkpointing and is_recomputing are
gpipe.recompute's. DeferredBatchNorm (gpipe.torchgpipe.batchnorm) keeps
torchgpipe's own rule, a commit every `chunks` micro-batches. Each
torchgpipe module has its namesake here (torchgpipe.skip:
gpipe.torchgpipe.skip, ...); docs/torchgpipe.md says what maps to what and
every difference that remains.
"""

from gpipe.recompute import is_checkpointing, is_recomputing
from gpipe.torchgpipe.batchnorm import DeferredBatchNorm
from gpipe.torchgpipe.gpipe import GPipe

__all__ = ["GPipe", "is_checkpointing", "is_recomputing", "DeferredBatchNorm"]
