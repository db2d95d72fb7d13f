"""The transport between stages in separate processes (gpipe.transport): c10d, gloo on CPU and NCCL on CUDA.

One c10d world of replicas x workers ranks (gpipe.topology), formed once per
process (`World`) by the first of its stages to start: a worker holds one
stage, or with virtual stages several model chunks (a Stage each, taking
turns: gpipe.turns), which share the world. Every rank forms every process
group, in one order, as torch requires, and keeps those it is in: per
replica, one per direction (activations forward, gradients back) so each
communicator carries one ordered stream (with several chunks a worker, one
per direction per cut between chunks, since two cuts may join the same pair of
workers); two per pair of stages that a skip connection joins; one per replica
for the clipping norm; one per stage (model chunk) for its copies in the
replicas. A cut between two chunks of one worker (zbv's V, a skip within a
worker) goes in memory (gpipe.transport.Hub). A sum among stages (the clipping
norm, the inf check, a tied weight) is taken first among the worker's chunks,
then once per worker over c10d. Forming the world may take start_timeout_s,
each step's waits step_timeout_s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from gpipe.contract import StageConfig
from gpipe.net import client_store
from gpipe.rng import SharedGenerators
from gpipe.topology import Topology
from gpipe.transport import Among, GradSum, Hub, Inbound, Lane, Op, Outbound
from gpipe.turns import Turns
from gpipe.worker.channel import Receiver, Sender, backstop_s
from gpipe.worker.reducer import GradReducer

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class World:
    """This process's c10d world and process groups, shared by the stages (model chunks) of its worker."""

    _lock = threading.Lock()
    _current: World | None = None

    @classmethod
    def join(cls, cfg: StageConfig, device: torch.device) -> World:
        """The world `cfg`'s data plane (store) names, formed by the first stage of this process to ask."""
        with cls._lock:
            if cls._current is None or cls._current.key != (cfg.store_host, cfg.store_port):
                cls._current = cls(cfg, device)
            return cls._current

    def __init__(self, cfg: StageConfig, device: torch.device):
        self.key = (cfg.store_host, cfg.store_port)
        self.cfg, chunks, virtual = cfg, cfg.stages, cfg.virtual_stages
        top = self.topology = Topology(cfg.workers, cfg.replicas, virtual, cfg.schedule)
        me = self.me = cfg.rank
        backend = self.backend = "nccl" if device.type == "cuda" else "gloo"
        start, step = timedelta(seconds=cfg.start_timeout_s), timedelta(seconds=cfg.step_timeout_s)
        # A lane's transfers are posted ahead of the stage's wait for them (worker/channel.py), so the group's
        # own deadline (NCCL's watchdog counts from the post) is the channel's backstop, past the stage's.
        lane = timedelta(seconds=backstop_s(cfg.step_timeout_s))
        self._start = start
        store = dist.PrefixStore("data", client_store(cfg.store_host, cfg.store_port, cfg.start_timeout_s))
        dist.init_process_group(backend, store=store, rank=me, world_size=top.world, timeout=start)
        _set_pg_timeout(step, None)  # formed: a collective of every rank waits at most a step's timeout
        worker = self.worker_of
        self.mine = [g for g in range(chunks) if worker(g) == cfg.worker]  # the model chunks this worker holds
        every_worker = list(range(top.stages))
        self.lanes: dict[tuple[str, int, int], dist.ProcessGroup] = {}
        if virtual == 1:
            forward, backward = self._per_replica(every_worker, lane), self._per_replica(every_worker, lane)
            for a in range(chunks - 1):
                self.lanes["activation", a, a + 1] = forward
                self.lanes["gradient", a, a + 1] = backward
        else:  # a pair of groups per cut between workers: two cuts may join the same pair
            for a in range(chunks - 1):
                if worker(a) != worker(a + 1):
                    self.lanes["activation", a, a + 1] = self._per_replica([worker(a), worker(a + 1)], lane)
                    self.lanes["gradient", a, a + 1] = self._per_replica([worker(a), worker(a + 1)], lane)
        # The clipping norm: over one replica's stages (after the replicas' gradients are summed, they are the
        # same in every replica). The world's default group when there is one replica.
        self.pipeline = self._per_replica(every_worker, step) if top.replicas > 1 else None
        # The copies of each stage (model chunk): they sum their gradients (and deferred BatchNorm's statistics).
        self.copies: dict[int, dist.ProcessGroup] = {}
        if top.replicas > 1:
            for g in range(chunks):
                ranks = top.stage_ranks(worker(g))
                group = dist.new_group(ranks, backend=backend, timeout=start)
                if me in ranks:
                    _set_pg_timeout(step, group)
                    self.copies[g] = group
        # Tied weights: the workers that hold a copy of one sum its gradient (a group per set of holders).
        self.tied: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for holders in sorted({tuple(stages) for _, stages in cfg.tied if len(stages) > 1}):
            workers = sorted({worker(g) for g in holders})
            if len(workers) > 1:
                self.tied[holders] = self._per_replica(workers, step)
        for a, b in sorted({(a, b) for _, a, b in cfg.skip_routes}):
            if worker(a) != worker(b):
                self.lanes["skip", a, b] = self._per_replica(sorted({worker(a), worker(b)}), lane)
                self.lanes["skip-gradient", a, b] = self._per_replica(sorted({worker(a), worker(b)}), lane)
        # What stays within the worker: cuts between its own chunks, and the first round of each sum.
        self.local = Hub(chunks, 1, cfg.step_timeout_s)
        self.turns = Turns() if virtual > 1 else None  # its chunks compute one action at a time, in order
        self.rng = SharedGenerators() if virtual > 1 else None  # and share the process's generators

    def worker_of(self, chunk: int) -> int:
        """The worker (of a replica) holding model chunk `chunk` (gpipe.topology)."""
        return self.topology.worker_of(chunk)

    def _per_replica(self, workers: list[int], timeout: timedelta) -> dist.ProcessGroup:
        """A group of `workers` in each replica, formed by every rank; this rank's own (GroupMember.NON_GROUP_MEMBER
        when this rank is not among them), whose operations wait at most `timeout` once formed."""
        top = self.topology
        own: dist.ProcessGroup = dist.GroupMember.NON_GROUP_MEMBER  # type: ignore[assignment]  # torch's sentinel
        for r in range(top.replicas):
            ranks = [top.rank(r, k) for k in workers]
            group = dist.new_group(ranks, backend=self.backend, timeout=self._start)
            if self.me in ranks:
                _set_pg_timeout(timeout, group)  # formed under the start's timeout
                own = group
        return own

    def combine(self, key: tuple[object, ...], chunks: list[int], chunk: int, t: torch.Tensor, op: Op,
                c10d: Callable[[torch.Tensor], None] | None) -> None:
        """Reduce `t` in place among this worker's `chunks` (each calls with its own), then, once for the
        worker, across workers with `c10d` (None: no other worker takes part)."""
        if len(chunks) == 1:
            if c10d is not None:
                c10d(t)
            return
        who, what = chunks.index(chunk), f"the sum {key[0]} of model chunk {chunk} with chunks {chunks}"
        (mine,) = self.local._reduce((*key, "within"), len(chunks), who, [t], op, what)
        assert mine is not None  # every chunk gave one
        if who == 0 and c10d is not None:
            c10d(mine)
        (out,) = self.local._reduce((*key, "across"), len(chunks), who, [mine if who == 0 else None], op, what)
        assert out is not None  # the first chunk gave it
        t.copy_(out)


class C10dTransport:
    """Stage (model chunk) `cfg.stage` of replica `cfg.replica`, joined to its process's c10d world (see the
    module's docstring)."""

    def __init__(self, cfg: StageConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.world = World.join(cfg, device)
        self.backend = self.world.backend

    def _group(self, lane: Lane, peer: int) -> tuple[int, dist.ProcessGroup] | None:
        """(peer rank, group) of a lane to stage `peer`; None when `peer` is on this worker (in memory)."""
        a, b = sorted((self.cfg.stage, peer))
        group = self.world.lanes.get((lane, a, b))
        if group is None:
            return None
        return self.world.topology.rank(self.cfg.replica, self.world.worker_of(peer)), group

    def sender(self, peer: int, lane: Lane, name: str) -> Outbound:
        if (link := self._group(lane, peer)) is None:
            return self.world.local.transport(self.cfg.stage, 0, self.device).sender(peer, lane, name)
        return Sender(*link, self.device, name)

    def receiver(self, peer: int, lane: Lane, name: str) -> Inbound:
        if (link := self._group(lane, peer)) is None:
            return self.world.local.transport(self.cfg.stage, 0, self.device).receiver(peer, lane, name)
        return Receiver(*link, self.device, name, self.cfg.step_timeout_s)

    def all_reduce(self, t: torch.Tensor, among: Among, op: Op = "sum") -> None:
        w = self.world
        if among == "copies":  # one chunk per worker in the group: no sum within the worker
            dist.all_reduce(t, op=OPS[op], group=w.copies[self.cfg.stage])
            return
        group = w.pipeline if among == "pipeline" else None
        w.combine((among,), w.mine, self.cfg.stage, t, op, lambda x: dist.all_reduce(x, op=OPS[op], group=group))

    def sum_among(self, t: torch.Tensor, stages: Sequence[int]) -> None:
        w = self.world
        group = w.tied.get(tuple(stages))
        here = [g for g in stages if g in w.mine]
        c10d = None if group is None else (lambda x: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group))
        w.combine(("tied", *stages), here, self.cfg.stage, t, "sum", c10d)

    def grad_sum(self, params: Sequence[torch.Tensor]) -> GradSum | None:
        group = self.world.copies.get(self.cfg.stage)
        if group is None or not params:
            return None
        return GradReducer(params, group, self.cfg.step_timeout_s)

    def close(self) -> None:
        pass  # the process group lives as long as the attempt's process
