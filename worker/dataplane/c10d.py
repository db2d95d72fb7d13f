"""The transport between stages in separate processes (gpipe.transport): c10d, gloo on CPU and NCCL on CUDA.

One c10d world of replicas x workers ranks (gpipe.topology), formed once per
process (`World`) by the first of its stages to start: a worker holds one
stage, or with virtual stages several model chunks (a Stage each, taking
turns: gpipe.turns), which share the world. Every rank forms every process
group, in one order, as torch requires, and keeps those it is in: per
replica, one per direction (activations forward, gradients back) so each
communicator carries one ordered stream (with several model chunks a worker,
one per direction per cut between model chunks, since two cuts may join the same pair of
workers); two per pair of stages that a skip connection joins; one per replica
for the clipping norm; one per stage (model chunk) for its copies in the
replicas. A cut between two model chunks of one worker (zbv's V, a skip within a
worker) goes in memory (gpipe.transport.Hub). A sum among stages (the clipping
norm, the inf check, a tied weight) is taken first among the worker's model chunks,
then once per worker over c10d. Forming the world may take start_timeout_s,
each step's waits step_timeout_s.

The world forms whole at the attempt's start, warmed: after its groups, every
link and every sum this worker will take part in makes a first tiny exchange
(`World._warm`), so NCCL builds its communicators here, not inside step 1, and
a peer that never comes, or that this worker cannot reach (a wrong network
interface), fails the start within start_timeout_s, named with its address.
At the attempt's end `World.leave` destroys the groups and their communicators.

A lane between two workers of one host (one network namespace: `run`'s local
workers, workers of one pod) goes over a Unix socket of its own instead of
gloo (gpipe.worker.dataplane.unix_lane: a fraction of gloo's CPU a message, and no thread
on the path of a message the socket takes at once; bench/README.md (z)), with
a ring of shared memory beside it for messages of up to 4 MiB (no socket call
but an eventfd's; bench/README.md (ad)), formed with the groups
(`World._same_host`) and closed at the attempt's end.
Its gloo group is still formed, unused; CUDA stages keep NCCL.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from gpipe.contract import StageConfig
from gpipe.rng import SharedGenerators
from gpipe.service.net import client_store, route_source
from gpipe.show import first_line
from gpipe.topology import Topology
from gpipe.transport import Among, GradSum, Hub, Inbound, Lane, Op, Outbound
from gpipe.turns import Turns
from gpipe.wire import backend_of
from gpipe.worker.dataplane import unix_lane
from gpipe.worker.dataplane.channel import Receiver, Sender, backstop_s
from gpipe.worker.dataplane.reducer import GradReducer
from gpipe.worker.dataplane.unix_lane import (
    Listener,
    Ring,
    UnixReceiver,
    UnixSender,
    connect,
    offer_ring,
    take_ring,
)

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
JOINED_KEY = "joined/"  # + rank, in the data plane's store: that worker reached it, from this address
LANE_KEY = "lane/"  # + replica/kind/a/b, in the data plane's store: a lane's socket on this host (gpipe.worker.dataplane.unix_lane)


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

    @classmethod
    def leave(cls) -> None:
        """End this process's data plane (the attempt's end): every process group, and with it its
        communicators, destroyed now rather than left to the process's exit."""
        with cls._lock:
            if cls._current is not None:
                cls._current.close_sockets()
            cls._current = None
            _destroy()

    def __init__(self, cfg: StageConfig, device: torch.device):
        self.key = (cfg.store_host, cfg.store_port)
        self.cfg, self.device = cfg, device
        self.topology = Topology(cfg.workers, cfg.replicas, cfg.virtual_stages, cfg.schedule)
        self.me = cfg.rank
        self.backend = backend_of(device)
        self._start = timedelta(seconds=cfg.start_timeout_s)
        # (group, its timeout once warmed: None the world's), set after the warm-up, which the start's bounds
        self._steady: list[tuple[dist.ProcessGroup | None, timedelta]] = []
        self._peer: int | None = None  # the rank the warm-up waits for now
        self._forming = self.backend  # which lanes: "unix" while this host's form (_same_host)
        # Lanes to workers of this host (gpipe.worker.dataplane.unix_lane), by the key of `lanes`; the others go over c10d.
        self.sockets: dict[tuple[str, int, int], socket.socket] = {}
        self.rings: dict[tuple[str, int, int], Ring] = {}  # a lane's shared memory, where the host allows it
        store = dist.PrefixStore("data", client_store(cfg.store_host, cfg.store_port, cfg.start_timeout_s))
        store.set(f"{JOINED_KEY}{self.me}", self._address())
        self._bounded(store)
        for group, timeout in self._steady:
            _set_pg_timeout(timeout, group)
        # What stays within the worker: cuts between its own model chunks, and the first round of each sum.
        self.local = Hub(cfg.model_chunks, 1, cfg.step_timeout_s)
        # Its model chunks compute one action at a time, in order.
        self.turns = Turns() if cfg.virtual_stages > 1 else None
        self.rng = SharedGenerators() if cfg.virtual_stages > 1 else None  # and share the process's generators

    def _address(self) -> str:
        """This worker's address as its peers would reach it: its route to the store's host."""
        try:
            return route_source(self.cfg.store_host)
        except (ValueError, OSError):
            return "an unknown address"

    def _bounded(self, store: dist.Store) -> None:
        """Form the groups and warm them, on a thread, for at most start_timeout_s: a peer that never joins or
        cannot be reached fails the start naming it (`_failure`), whatever c10d or NCCL would wait for."""
        failed: list[BaseException] = []
        ended = threading.Lock()
        done, abandoned = [False], [False]

        def form() -> None:
            try:
                self._form(store, deadline)
            except BaseException as e:
                failed.append(e)
            finally:
                with ended:
                    done[0] = True
                    if abandoned[0]:  # given up on: what it formed late goes
                        self.close_sockets()

        deadline = time.monotonic() + self.cfg.start_timeout_s
        thread = threading.Thread(target=form, name="data-plane-start", daemon=True)
        thread.start()
        thread.join(self.cfg.start_timeout_s + 1.0)  # past c10d's own deadlines, so theirs say what they met
        with ended:
            abandoned[0] = not done[0]
        if abandoned[0] or failed:
            self.close_sockets()
            if not abandoned[0]:  # what formed goes: this process may try again
                with contextlib.suppress(Exception):
                    _destroy(abort=True)
            raise self._failure(store, failed[0] if failed else None, time.monotonic() >= deadline) from None

    def _failure(self, store: dist.Store, error: BaseException | None, late: bool) -> Exception:
        """One line for a start that failed: the ranks that never joined, or the peer the warm-up waited for."""
        s = self.cfg.start_timeout_s
        joined: dict[int, str] = {}
        for rank in range(self.topology.world):
            with contextlib.suppress(Exception):
                if store.check([f"{JOINED_KEY}{rank}"]):
                    joined[rank] = store.get(f"{JOINED_KEY}{rank}").decode()
        missing = [r for r in range(self.topology.world) if r not in joined]
        said = f": {first_line(error)}" if error is not None else ""
        if missing:
            who = ", ".join(self._who(r) for r in missing)
            return TimeoutError(f"the data plane did not form within {s:.0f}s: {who} never joined it")
        if self._peer is not None and self._forming == "unix":
            what = (f"the data plane did not form within {s:.0f}s: no lane on this host with "
                    f"{self._who(self._peer, joined.get(self._peer))}{said}")
            return TimeoutError(what) if late else ConnectionError(what)
        if self._peer is not None:
            what = (f"the data plane did not form within {s:.0f}s: no first exchange with "
                    f"{self._who(self._peer, joined.get(self._peer))}{said}; check that the workers reach each "
                    f"other on the {self.backend} interface (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)")
            return TimeoutError(what) if late else ConnectionError(what)
        what = f"the data plane did not form within {s:.0f}s{said}"
        return TimeoutError(what) if late else ConnectionError(what)

    def _who(self, rank: int, address: str | None = None) -> str:
        """'rank 1 (stage 1 of replica 0, at 10.0.0.5)'."""
        top = self.topology
        kind = "stage" if self.cfg.virtual_stages == 1 else "worker"
        at = f", at {address}" if address else ""
        return f"rank {rank} ({kind} {top.stage_of(rank)} of replica {top.replica_of(rank)}{at})"

    def _form(self, store: dist.Store, deadline: float) -> None:
        """The world's groups (see the module's docstring), then their warm-up."""
        cfg, top, me, backend = self.cfg, self.topology, self.me, self.backend
        model_chunks, virtual = cfg.model_chunks, cfg.virtual_stages
        step = timedelta(seconds=cfg.step_timeout_s)
        # A lane's transfers are posted ahead of the stage's wait for them (worker/dataplane/channel.py), so the group's
        # own deadline (NCCL's watchdog counts from the post) is the channel's backstop, past the stage's.
        lane = timedelta(seconds=backstop_s(cfg.step_timeout_s))
        dist.init_process_group(backend, store=store, rank=me, world_size=top.world, timeout=self._start)
        self._steady.append((None, step))  # formed: a collective of every rank waits at most a step's timeout
        worker = self.worker_of
        self.mine = [g for g in range(model_chunks) if worker(g) == cfg.worker]  # the model chunks this worker holds
        self._turn = threading.Condition()
        self._next = 0  # which of `mine` takes the next turn at the copies' gathers (in_turn)
        every_worker = list(range(top.stages))
        self.lanes: dict[tuple[str, int, int], dist.ProcessGroup] = {}
        if virtual == 1:
            forward, backward = self._per_replica(every_worker, lane), self._per_replica(every_worker, lane)
            for a in range(model_chunks - 1):
                self.lanes["activation", a, a + 1] = forward
                self.lanes["gradient", a, a + 1] = backward
        else:  # a pair of groups per cut between workers: two cuts may join the same pair
            for a in range(model_chunks - 1):
                if worker(a) != worker(a + 1):
                    self.lanes["activation", a, a + 1] = self._per_replica([worker(a), worker(a + 1)], lane)
                    self.lanes["gradient", a, a + 1] = self._per_replica([worker(a), worker(a + 1)], lane)
        # The clipping norm: over one replica's stages (after the replicas' gradients are summed, they are the
        # same in every replica). The world's default group when there is one replica.
        self.pipeline = self._per_replica(every_worker, step) if top.replicas > 1 else None
        # The copies of each stage (model chunk): they sum their gradients (and deferred BatchNorm's statistics).
        self.copies: dict[int, dist.ProcessGroup] = {}
        if top.replicas > 1:
            for g in range(model_chunks):
                ranks = top.stage_ranks(worker(g))
                group = dist.new_group(ranks, backend=backend, timeout=self._start)
                if me in ranks:
                    self._steady.append((group, step))
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
        self._same_host(store, deadline)
        self._warm(deadline)

    def _same_host(self, store: dist.Store, deadline: float) -> None:
        """The lanes to workers of this host as Unix sockets (gpipe.worker.dataplane.unix_lane), in three rounds no rank waits
        across: the worker of each lane's lower model chunk listens and says where; its peer connects, or finds no
        such socket here, and says which (under the listener's name: an answer to an earlier try's offer is not
        this one's); the first accepts. Lanes of other hosts, and every lane on CUDA or with
        GPIPE_SAME_HOST_LANES=c10d, stay on c10d. Each wait ends by `deadline`."""
        top, me = self.topology, self.me
        replica = top.replica_of(me)
        offer = self.backend == "gloo" and unix_lane.mode() == "unix"
        ends = []  # (lane's key, its store key, its first rank, its second)
        for kind, a, b in sorted(self.lanes):
            first, second = top.rank(replica, self.worker_of(a)), top.rank(replica, self.worker_of(b))
            if me in (first, second):
                ends.append(((kind, a, b), f"{LANE_KEY}{replica}/{kind}/{a}/{b}", first, second))

        def read(key: str) -> str:
            store.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
            return store.get(key).decode()

        listening: dict[tuple[str, int, int], Listener] = {}
        self._forming = "unix"
        try:
            for key, name, first, _ in ends:
                if me == first:
                    if offer:
                        with contextlib.suppress(OSError):  # this host allows no such socket: c10d
                            listening[key] = Listener()
                    mine = listening.get(key)
                    store.set(name, json.dumps({"name": mine.name, "token": mine.token.hex()} if mine else {}))
            for key, name, first, second in ends:
                if me == second:
                    self._peer = first
                    where = json.loads(read(name))
                    sock = connect(where["name"], bytes.fromhex(where["token"]), deadline) if offer and where else None
                    if sock is not None:
                        self.sockets[key] = sock
                        if (ring := offer_ring(sock)) is not None:
                            self.rings[key] = ring
                    if where:
                        store.set(f"{name}/{where['name']}", "unix" if sock is not None else "c10d")
            for key, name, _, second in ends:
                if key in listening:
                    self._peer = second
                    if read(f"{name}/{listening[key].name}") == "unix":
                        sock = self.sockets[key] = listening.pop(key).accept(deadline, self._who(second))
                        if (ring := take_ring(sock, deadline, self._who(second))) is not None:
                            self.rings[key] = ring
        finally:
            for listener in listening.values():
                listener.close()
        self._peer, self._forming = None, self.backend
        if ends:  # one line in the attempt's log (no colon: it is not an error line, gpipe.proc.last_error_line)
            unix = [f"{k} {a}-{b}" for (k, a, b), *_ in ends if (k, a, b) in self.sockets]
            gloo = [f"{k} {a}-{b}" for (k, a, b), *_ in ends if (k, a, b) not in self.sockets]
            shared = [f"{k} {a}-{b}" for (k, a, b), *_ in ends if (k, a, b) in self.rings]
            writer = "C" if unix_lane._CWriter is not None else "Python (worker/dataplane/_ring.c was not built)"
            print(f"data plane of rank {me}, lanes over a Unix socket of this host ({', '.join(unix) or 'none'}), "
                  f"of them with shared memory ({', '.join(shared) or 'none'}; its writer in {writer}), "
                  f"over {self.backend} ({', '.join(gloo) or 'none'})", file=sys.stderr, flush=True)

    def close_sockets(self) -> None:
        """Close this world's lanes of this host: a peer still reading sees their end at once."""
        socks = list(self.sockets.values())  # (the start's thread may still add one: it closes those itself)
        self.sockets.clear()
        self.rings.clear()  # (let go with the last sender or receiver that holds one)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _warm(self, deadline: float) -> None:
        """A first tiny exchange on each link and each sum this worker takes part in, so that their
        communicators form now. Every rank goes through them in one order (the lanes' keys, then the sums), each
        taking those it is in: the first exchange any rank waits on then has all its ranks at it, so none waits
        for a rank that waits for it."""
        top, me, cfg = self.topology, self.me, self.cfg
        replica = top.replica_of(me)
        one = torch.zeros(1, device=self.device)

        def left() -> timedelta:  # the start's time left (on NCCL the thread's bound is the one that holds)
            return timedelta(seconds=max(0.001, deadline - time.monotonic()))

        for (kind, a, b), group in sorted(self.lanes.items()):
            if (kind, a, b) in self.sockets:  # formed, and warm
                continue
            first, second = top.rank(replica, self.worker_of(a)), top.rank(replica, self.worker_of(b))
            if me not in (first, second):
                continue
            self._peer = second if me == first else first
            work = dist.isend(one, second, group=group) if me == first else dist.irecv(one, first, group=group)
            assert work is not None  # this rank is in `group`
            work.wait(left())
        # The sums the stages take (gpipe/stage.py): the job's (fp16's overflow check) and the pipeline's
        # (the clipping norm), over the world when there is one replica; the replicas' gradients; tied weights.
        sums: list[tuple[dist.ProcessGroup | None, list[int]]] = []
        if cfg.precision == "fp16" or (cfg.clip_grad_norm is not None and self.pipeline is None):
            sums.append((None, top.ranks()))
        if cfg.clip_grad_norm is not None and self.pipeline is not None:
            sums.append((self.pipeline, top.replica_ranks(replica)))
        for _, group in sorted(self.copies.items()):
            sums.append((group, top.stage_ranks(top.stage_of(me))))
        for holders, group in sorted(self.tied.items()):
            sums.append((group, sorted({top.rank(replica, self.worker_of(g)) for g in holders})))
        for among, ranks in sums:
            if me not in ranks:  # a tied weight this worker holds no copy of
                continue
            self._peer = next((r for r in ranks if r != me), None)
            work = dist.all_reduce(one, group=among, async_op=True)
            assert work is not None
            work.wait(left())
        self._peer = None

    @contextlib.contextmanager
    def in_turn(self, model_chunk: int, timeout: float) -> Iterator[None]:
        """The model chunks of this worker take their turns at their copies' gathers in model-chunk order: each
        chunk's gathers go on a communicator of its own, and NCCL wants the operations on several communicators
        issued in one order on every rank (each chunk runs on a thread of its own). With one chunk, no wait."""
        if len(self.mine) == 1:
            yield
            return
        with self._turn:
            if not self._turn.wait_for(lambda: self.mine[self._next] == model_chunk, timeout):
                raise TimeoutError(f"model chunk {model_chunk} waited {timeout:.0f}s for model chunk "
                                   f"{self.mine[self._next]} of its worker to gather with its copies")
        try:
            yield
        finally:
            with self._turn:
                self._next = (self._next + 1) % len(self.mine)
                self._turn.notify_all()

    def worker_of(self, model_chunk: int) -> int:
        """The worker (of a replica) holding model chunk `model_chunk` (gpipe.topology)."""
        return self.topology.worker_of(model_chunk)

    def _per_replica(self, workers: list[int], timeout: timedelta) -> dist.ProcessGroup:
        """A group of `workers` in each replica, formed by every rank; this rank's own (GroupMember.NON_GROUP_MEMBER
        when this rank is not among them), whose operations wait at most `timeout` once warmed."""
        top = self.topology
        own: dist.ProcessGroup = dist.GroupMember.NON_GROUP_MEMBER  # type: ignore[assignment]  # torch's sentinel
        for r in range(top.replicas):
            ranks = [top.rank(r, k) for k in workers]
            group = dist.new_group(ranks, backend=self.backend, timeout=self._start)
            if self.me in ranks:
                self._steady.append((group, timeout))  # formed and warmed under the start's timeout
                own = group
        return own

    def combine(self, key: tuple[object, ...], model_chunks: list[int], model_chunk: int, t: torch.Tensor, op: Op,
                c10d: Callable[[torch.Tensor], None] | None) -> None:
        """Reduce `t` in place among this worker's `model_chunks` (each calls with its own, `model_chunk`), then,
        once for the worker, across workers with `c10d` (None: no other worker takes part)."""
        if len(model_chunks) == 1:
            if c10d is not None:
                c10d(t)
            return
        who = model_chunks.index(model_chunk)
        what = f"the sum {key[0]} of model chunk {model_chunk} with model chunks {model_chunks}"
        (mine,) = self.local._reduce((*key, "within"), len(model_chunks), who, [t], op, what)
        assert mine is not None  # every model chunk gave one
        if who == 0 and c10d is not None:
            c10d(mine)
        (out,) = self.local._reduce((*key, "across"), len(model_chunks), who, [mine if who == 0 else None], op, what)
        assert out is not None  # the first model chunk gave it
        t.copy_(out)


class C10dTransport:
    """Stage (model chunk) `cfg.model_chunk` of replica `cfg.replica`, joined to its process's c10d world (see the
    module's docstring)."""

    def __init__(self, cfg: StageConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.world = World.join(cfg, device)
        self.backend = self.world.backend

    def _key(self, lane: Lane, peer: int) -> tuple[str, int, int]:
        a, b = sorted((self.cfg.model_chunk, peer))
        return lane, a, b

    def _group(self, lane: Lane, peer: int) -> tuple[int, dist.ProcessGroup] | None:
        """(peer rank, group) of a lane to stage `peer`; None when `peer` is on this worker (in memory)."""
        group = self.world.lanes.get(self._key(lane, peer))
        if group is None:
            return None
        return self.world.topology.rank(self.cfg.replica, self.world.worker_of(peer)), group

    def sender(self, peer: int, lane: Lane, name: str) -> Outbound:
        if (link := self._group(lane, peer)) is None:
            return self.world.local.transport(self.cfg.model_chunk, 0, self.device).sender(peer, lane, name)
        if (sock := self.world.sockets.get(key := self._key(lane, peer))) is not None:
            return UnixSender(sock, name, self.world.rings.get(key))
        return Sender(*link, self.device, name)

    def receiver(self, peer: int, lane: Lane, name: str) -> Inbound:
        if (link := self._group(lane, peer)) is None:
            return self.world.local.transport(self.cfg.model_chunk, 0, self.device).receiver(peer, lane, name)
        if (sock := self.world.sockets.get(key := self._key(lane, peer))) is not None:
            return UnixReceiver(sock, name, self.world.rings.get(key))
        return Receiver(*link, self.device, name, self.cfg.step_timeout_s)

    def all_reduce(self, t: torch.Tensor, among: Among, op: Op = "sum") -> None:
        w = self.world
        if among == "copies":  # one model chunk per worker in the group: no sum within the worker
            dist.all_reduce(t, op=OPS[op], group=w.copies[self.cfg.model_chunk])
            return
        group = w.pipeline if among == "pipeline" else None
        w.combine((among,), w.mine, self.cfg.model_chunk, t, op, lambda x: dist.all_reduce(x, op=OPS[op], group=group))

    def sum_among(self, t: torch.Tensor, stages: Sequence[int]) -> None:
        w = self.world
        group = w.tied.get(tuple(stages))
        here = [g for g in stages if g in w.mine]
        c10d = None if group is None else (lambda x: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group))
        w.combine(("tied", *stages), here, self.cfg.model_chunk, t, "sum", c10d)

    def gather_copies(self, t: torch.Tensor, everyone: bool) -> list[torch.Tensor] | None:
        group = self.world.copies[self.cfg.model_chunk]  # its ranks in replica order
        first = self.cfg.replica == 0
        outs = [torch.empty_like(t) for _ in range(self.cfg.replicas)] if everyone or first else None
        if everyone:
            work = dist.all_gather(outs, t, group=group, async_op=True)
        else:
            work = dist.gather(t, outs, dst=dist.get_global_rank(group, 0), group=group, async_op=True)
        assert work is not None  # async_op
        work.wait(timedelta(seconds=self.cfg.step_timeout_s))  # each gather its own deadline (NCCL's too)
        return outs

    def in_turn(self) -> contextlib.AbstractContextManager[None]:
        return self.world.in_turn(self.cfg.model_chunk, self.cfg.step_timeout_s)

    def grad_sum(self, params: Sequence[torch.Tensor]) -> GradSum | None:
        group = self.world.copies.get(self.cfg.model_chunk)
        if group is None or not params:
            return None
        return GradReducer(params, group, self.cfg.step_timeout_s)

    def close(self) -> None:
        pass  # the process group lives as long as the attempt's process


def _destroy(abort: bool = False) -> None:
    """Destroy this process's process groups and their communicators; with `abort`, without waiting for what
    they have in flight (torch 2.6 and later: _abort_process_group; before it, destroy_process_group)."""
    if not dist.is_initialized():
        return
    aborting = getattr(dist.distributed_c10d, "_abort_process_group", None) if abort else None
    if aborting is not None:
        aborting()
    else:
        dist.destroy_process_group()
