"""The transport between stages in separate processes (gpipe.transport): c10d, gloo on CPU and NCCL on CUDA.

One c10d world of replicas x stages ranks (gpipe.topology). Every rank forms
every process group, in one order, as torch requires, and keeps those it is
in: one per direction per replica (activations forward, gradients back), so
each communicator carries one ordered stream; two per pair of stages that a
skip connection joins; one per replica for the clipping norm; one per stage
for its copies in the replicas. Forming the world may take start_timeout_s,
each step's waits step_timeout_s.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from gpipe.contract import StageConfig
from gpipe.net import client_store
from gpipe.topology import Topology
from gpipe.transport import Among, GradSum, Inbound, Lane, Op, Outbound
from gpipe.worker.channel import Receiver, Sender
from gpipe.worker.reducer import GradReducer

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class C10dTransport:
    """Stage `cfg.stage` of replica `cfg.replica`, joined to the job's c10d world (see the module's docstring)."""

    def __init__(self, cfg: StageConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        top = self.topology = Topology(cfg.stages, cfg.replicas)
        me = top.rank(cfg.replica, cfg.stage)
        backend = self.backend = "nccl" if device.type == "cuda" else "gloo"
        start, step = timedelta(seconds=cfg.start_timeout_s), timedelta(seconds=cfg.step_timeout_s)
        self._start, self._step = start, step
        store = dist.PrefixStore("data", client_store(cfg.store_host, cfg.store_port, cfg.start_timeout_s))
        dist.init_process_group(backend, store=store, rank=me, world_size=top.world, timeout=start)
        _set_pg_timeout(step, None)  # formed: a collective of every rank waits at most a step's timeout
        self.me = me
        every_stage = list(range(top.stages))
        forward, backward = self._per_replica(every_stage), self._per_replica(every_stage)
        self._lanes: dict[tuple[str, int, int], dist.ProcessGroup] = {}
        for a in range(top.stages - 1):
            self._lanes["activation", a, a + 1] = forward
            self._lanes["gradient", a, a + 1] = backward
        # The clipping norm: over one replica's stages (after the replicas' gradients are summed, they are the
        # same in every replica). The world's default group when there is one replica.
        self._pipeline = self._per_replica(every_stage) if top.replicas > 1 else None
        # The copies of this stage: they sum their gradients (and deferred BatchNorm's statistics).
        self._copies: dist.ProcessGroup | None = None
        if top.replicas > 1:
            for k in range(top.stages):
                group = dist.new_group(top.stage_ranks(k), backend=backend, timeout=start)
                if k == cfg.stage:
                    _set_pg_timeout(step, group)
                    self._copies = group
        # Tied weights: the stages that hold a copy of one sum its gradient (a group per set of stages).
        self._tied: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for holders in sorted({tuple(stages) for _, stages in cfg.tied if len(stages) > 1}):
            self._tied[holders] = self._per_replica(list(holders))
        for a, b in sorted({(a, b) for _, a, b in cfg.skip_routes}):
            self._lanes["skip", a, b] = self._per_replica([a, b])
            self._lanes["skip-gradient", a, b] = self._per_replica([a, b])

    def _per_replica(self, stages: list[int]) -> dist.ProcessGroup:
        """A group of `stages` in each replica, formed by every rank; this rank's own (GroupMember.NON_GROUP_MEMBER
        when this rank's stage is not among `stages`)."""
        top = self.topology
        own: dist.ProcessGroup = dist.GroupMember.NON_GROUP_MEMBER  # type: ignore[assignment]  # torch's sentinel
        for r in range(top.replicas):
            ranks = [top.rank(r, k) for k in stages]
            group = dist.new_group(ranks, backend=self.backend, timeout=self._start)
            if self.me in ranks:
                # The channels pass the step's timeout to each send and receive too, since gloo keeps its
                # connect timeout for those.
                _set_pg_timeout(self._step, group)
                own = group
        return own

    def _group(self, lane: Lane, peer: int) -> tuple[int, dist.ProcessGroup]:
        a, b = sorted((self.cfg.stage, peer))
        return self.topology.rank(self.cfg.replica, peer), self._lanes[lane, a, b]

    def sender(self, peer: int, lane: Lane, name: str) -> Outbound:
        rank, group = self._group(lane, peer)
        return Sender(rank, group, self.device, name, self.cfg.step_timeout_s)

    def receiver(self, peer: int, lane: Lane, name: str) -> Inbound:
        rank, group = self._group(lane, peer)
        return Receiver(rank, group, self.device, name, self.cfg.step_timeout_s)

    def all_reduce(self, t: torch.Tensor, among: Among, op: Op = "sum") -> None:
        group = {"job": None, "pipeline": self._pipeline, "copies": self._copies}[among]
        dist.all_reduce(t, op=OPS[op], group=group)

    def sum_among(self, t: torch.Tensor, stages: Sequence[int]) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._tied[tuple(stages)])

    def grad_sum(self, params: Sequence[torch.Tensor]) -> GradSum | None:
        if self._copies is None or not params:
            return None
        return GradReducer(params, self._copies, self.cfg.step_timeout_s)

    def close(self) -> None:
        pass  # the process group lives as long as the attempt's process
