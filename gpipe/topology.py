"""Where each worker sits: R replicas of a P-stage pipeline on ranks 0 ... R*P-1.

Worker rank N serves stage N mod P of replica N div P, so the ordinals of a
Kubernetes StatefulSet of R*P pods are the ranks, and a job with one replica
numbers its workers by stage as before::

    rank:     0  1  2  3  4  5        (replicas 2, stages 3)
    replica:  0  0  0  1  1  1
    stage:    0  1  2  0  1  2

The launcher, the supervisor, the driver and the stages all ask this one
place. Process groups of the data plane (one c10d world of R*P ranks):

- a replica's ranks {r*P ... r*P+P-1}: its activations and gradients go point
  to point between neighbours there, and its gradient-clipping norm is summed
  there;
- a stage's ranks {k, P+k, 2P+k, ...}: the R copies of stage k sum their
  gradients (and deferred BatchNorm statistics) there;
- the default group, every rank: what all of them must agree on.

The RPC world has the coordinator at RPC rank 0 and worker rank N at N+1.

With `virtual` model chunks per worker (schedules interleaved-1f1b and zbv),
a replica's model is cut into stages x virtual model chunks, and `place` is the
one place that says which worker holds each (model chunk g on worker g mod
stages; zbv's V puts the second half back down): the stage interpreter, the
schedules' simulator, gpipe.Pipeline, the data plane and the coordinator all
ask it. `model_chunks()` gives the (replica, model chunk) slots (`Slots`),
numbered as the ranks number workers, and `worker_of` maps a slot to the rank
holding it.
"""

from __future__ import annotations

from dataclasses import dataclass


def _v_shaped(schedule: str) -> bool:
    """Whether `schedule` places its model chunks in a V (its record says: gpipe.schedule.Record.v_shape)."""
    from gpipe.schedule import REGISTRY  # here: gpipe.schedule imports this module

    record = REGISTRY.get(schedule)
    return record is not None and record.v_shape


def place(schedule: str, model_chunk: int, stages: int) -> tuple[int, int]:
    """(worker, the worker's own number for it: its worker_chunk) of model chunk `model_chunk`, on `stages`
    workers: model chunk g is worker chunk g div stages on worker g mod stages, but a V (zbv's) puts model chunk g on
    worker 2*stages-1-g past the middle. With one model chunk a worker, model chunk g is worker g's."""
    if model_chunk >= stages and _v_shaped(schedule):
        return 2 * stages - 1 - model_chunk, 1
    return model_chunk % stages, model_chunk // stages


def model_chunk(schedule: str, worker: int, worker_chunk: int, stages: int) -> int:
    """The model chunk that is worker `worker`'s own model chunk `worker_chunk` (the inverse of `place`)."""
    if worker_chunk == 1 and _v_shaped(schedule):
        return 2 * stages - 1 - worker
    return worker_chunk * stages + worker


def rpc_name(rank: int) -> str:
    """The RPC worker name of worker rank `rank` (the coordinator is "coordinator")."""
    return f"worker{rank}"


@dataclass(frozen=True)
class Topology:
    stages: int
    replicas: int = 1
    virtual: int = 1  # model chunks per worker
    schedule: str = ""  # the job's: where each model chunk sits (`place`)

    def model_chunks(self) -> Slots:
        """The (replica, model chunk) slots, numbered as ranks are: slot replica*stages*virtual + model chunk."""
        return Slots(self.stages * self.virtual, self.replicas)

    def worker_of(self, slot: int) -> int:
        """The rank of the worker holding slot `slot` of `model_chunks()` (the slot itself with one model chunk a
        worker)."""
        per = self.stages * self.virtual
        replica, model_chunk = divmod(slot, per)
        return self.rank(replica, place(self.schedule, model_chunk, self.stages)[0])

    @property
    def world(self) -> int:
        """Workers: replicas x stages."""
        return self.stages * self.replicas

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.stages + stage

    def replica_ranks(self, replica: int) -> list[int]:
        """The ranks of one pipeline, stage 0 first."""
        return [self.rank(replica, k) for k in range(self.stages)]

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks serving stage `stage`, replica 0 first."""
        return [self.rank(r, stage) for r in range(self.replicas)]

    def ranks(self) -> list[int]:
        return list(range(self.world))

    def rpc_name(self, rank: int) -> str:
        return rpc_name(rank)

    def name(self, rank: int) -> str:
        """'stage 1', or 'stage 1 of replica 2' when there are replicas."""
        return _name(self.stage_of(rank), self.replica_of(rank), self.replicas)

    def log_name(self, rank: int) -> str:
        """A worker's log file under `run`: stage-K.log, replica-R-stage-K.log past replica 0."""
        r, k = self.replica_of(rank), self.stage_of(rank)
        return f"stage-{k}.log" if r == 0 else f"replica-{r}-stage-{k}.log"

    def describe_ranks(self) -> str:
        """'rank 0', 'ranks 0-3' or 'ranks 0-7 (2 replicas x 4 stages)': what a job waits for."""
        if self.world == 1:
            return "rank 0"
        ranks = f"ranks 0-{self.world - 1}"
        stages = f"{self.stages} stage{'s' if self.stages > 1 else ''}"
        return ranks if self.replicas == 1 else f"{ranks} ({self.replicas} replicas x {stages})"


@dataclass(frozen=True)
class Slots:
    """What a driver drives, by slot: each replica's model chunks (a stage each), numbered as ranks number workers
    (slot replica*model_chunks + model chunk); with one model chunk a worker, the slots are the ranks."""

    model_chunks: int  # per replica
    replicas: int = 1

    @property
    def count(self) -> int:
        return self.model_chunks * self.replicas

    def model_chunk_of(self, slot: int) -> int:
        return slot % self.model_chunks

    def replica_of(self, slot: int) -> int:
        return slot // self.model_chunks

    def slot(self, replica: int, model_chunk: int) -> int:
        return replica * self.model_chunks + model_chunk

    def replica_slots(self, replica: int) -> list[int]:
        """The slots of one pipeline, model chunk 0 first."""
        return [self.slot(replica, g) for g in range(self.model_chunks)]

    def slots(self) -> list[int]:
        return list(range(self.count))

    def name(self, slot: int) -> str:
        """'stage 1', or 'stage 1 of replica 2' when there are replicas (a model chunk is a stage of its own)."""
        return _name(self.model_chunk_of(slot), self.replica_of(slot), self.replicas)


def _name(stage: int, replica: int, replicas: int) -> str:
    """How a user reads a stage: 'stage 1', or 'stage 1 of replica 2' when there are replicas."""
    return f"stage {stage}" if replicas == 1 else f"stage {stage} of replica {replica}"
