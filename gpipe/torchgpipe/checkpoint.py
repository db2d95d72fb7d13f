"""torchgpipe.checkpoint's public pair: whether a forward is a checkpointed first run or its recomputation.

    from gpipe.torchgpipe.checkpoint import is_recomputing

    class Counter(nn.Module):
        def forward(self, x):
            if not is_recomputing():  # counted once per micro-batch under checkpointing
                self.calls += 1
            return x

They are gpipe.recompute's: is_checkpointing() is true in a checkpointed
micro-batch's first forward (run without autograd), is_recomputing() in its
recomputation in the backward. torchgpipe's Checkpoint and Recompute autograd
functions are not provided: a stage of gpipe.Pipeline recomputes itself
(gpipe.stage).
"""

from gpipe.recompute import is_checkpointing, is_recomputing

__all__ = ["is_checkpointing", "is_recomputing"]
