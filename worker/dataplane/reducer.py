"""Data parallelism within a stage: the R copies of a stage sum their gradients, during the backward.

Why not DistributedDataParallel: DDP reduces in the backward that follows its
own forward, once per forward. A stage runs many forwards and backwards per
step (one per micro-batch, in the schedule's order, some recomputed under
activation checkpointing, each layer seeded by gpipe.rng), and wants one
reduction, at its last backward. DDP's no_sync covers the plain case only, and
its forward wrapper would stand between the stage and its per-layer seeding.

So this does what DDP's reducer does, for that one backward: parameters are put
in buckets of at most BUCKET_BYTES, in reverse order (the backward reaches the
last layers first). During the step's last backward,
`Tensor.register_post_accumulate_grad_hook` tells when a parameter's gradient
is final; once a bucket's parameters are all final, it is flattened and
all-reduced asynchronously on the stage's process group (the ranks serving
this stage, one per replica), while the backward goes on. Buckets are launched
strictly in order, so every replica issues the same collectives in the same
order. Once launched, each gradient is a view of its bucket, which the
all-reduce sums in place (DDP's gradient_as_bucket_view): one copy of the
gradients, not two. `finish` launches what the backward left (a parameter the
last micro-batch did not reach) and waits for all: then the gradients are
equal on every replica, before clipping and the optimizer.

Each replica's last stage weights a micro-batch's loss by its share of the
whole batch (not of its shard), so the sum is one device's gradient on the
whole batch, for shards of any size. Each bucket also sums, per parameter,
whether a replica had a gradient for it: one that no replica's step reached
keeps no gradient, as on one device (an optimizer then leaves it be).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from gpipe.memory.zero import BUCKET_BYTES  # as DistributedDataParallel's default bucket_cap_mb


class GradReducer:
    def __init__(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup, timeout_s: float,
                 bucket_bytes: int = BUCKET_BYTES):
        self.params, self.group, self.timeout = params, group, timedelta(seconds=timeout_s)
        self.buckets: list[list[int]] = []
        size = 0
        for i in reversed(range(len(params))):
            p, last = params[i], self.buckets[-1] if self.buckets else None
            nbytes = p.numel() * p.element_size()
            if last is None or size + nbytes > bucket_bytes or params[last[0]].dtype != p.dtype:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += nbytes
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.armed = False
        self._final: set[int] = set()
        self._left = [len(b) for b in self.buckets]
        self._launched: list[tuple[int, dist.Work, torch.Tensor]] = []
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(self._hook(i))  # type: ignore[no-untyped-call]  # unannotated in torch

    def arm(self) -> None:
        """The step's last backward is next: from now on a parameter's gradient is final once accumulated."""
        self.armed = True

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def final(_p: torch.Tensor) -> None:
            if self.armed and i not in self._final:
                self._final.add(i)
                self._left[self.bucket_of[i]] -= 1
                self._launch_ready()
        return final

    def _launch_ready(self) -> None:
        """Launch the buckets whose gradients are all final, in order: never one before an earlier one."""
        while len(self._launched) < len(self.buckets) and self._left[len(self._launched)] == 0:
            self._launch(len(self._launched))

    def _launch(self, b: int) -> None:
        params = [self.params[i] for i in self.buckets[b]]
        parts = [p.grad.detach().reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
        had = params[0].new_tensor([float(p.grad is not None) for p in params])  # how many replicas had a gradient
        flat = torch.cat([*parts, had])
        # Each gradient is from now on its piece of the bucket, which the all-reduce sums in place (DDP's
        # gradient_as_bucket_view): the stage holds one copy of its gradients, not two, until the optimizer.
        offset = 0
        for p in params:
            if p.grad is not None:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        work = dist.all_reduce(flat, group=self.group, async_op=True)  # the replicas' sum of this bucket
        assert work is not None  # async_op
        self._launched.append((b, work, flat))

    def finish(self) -> None:
        """Launch the buckets left, wait for every sum (each wait bounded by the step's timeout): the gradients,
        views of the buckets, are then the sums."""
        for b in range(len(self.buckets)):
            self._left[b] = 0
        self._launch_ready()
        try:
            for b, work, flat in self._launched:
                work.wait(self.timeout)
                offset = 0
                had = flat[-len(self.buckets[b]):].tolist()
                for n, i in enumerate(self.buckets[b]):
                    p = self.params[i]
                    part = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                    if had[n] == 0:
                        p.grad = None  # no replica's step reached it
                    elif p.grad is None:  # this replica's step did not reach it, another's did
                        p.grad = part
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget this step's progress (after finish, or after a step that failed)."""
        self.armed = False
        self._final.clear()
        self._left = [len(b) for b in self.buckets]
        self._launched = []
