"""The supervisor's worker registry: who holds each rank, heard from when, and what a lost worker fails."""

from __future__ import annotations

import uuid

from gpipe.contract import Cause
from gpipe.coordinator.attempt import report
from gpipe.coordinator.supervisor.jobs import Jobs
from gpipe.coordinator.supervisor.records import COMMIT_GRACE_S, Entry, Worker, describe_exit
from gpipe.errors import EXIT_FAILED
from gpipe.worker.device import Gpu

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0  # a worker silent this long is dropped, and its attempt fails
SILENT_S = 3 * HEARTBEAT_INTERVAL_S  # every worker silent this long when one is lost: the coordinator is cut off


class RankTaken(Exception):
    """A registration for a rank that a live worker holds: refused, the holder and its attempt untouched."""


def shared_gpu(workers: list[Worker]) -> str | None:
    """Why these workers cannot take one CUDA attempt together, if two share a GPU (NCCL refuses two ranks on
    one GPU: "Duplicate GPU detected"), else None."""
    seen: dict[tuple[str, ...], Worker] = {}
    for w in workers:
        key = w.gpu_key()
        if key is None:
            continue
        if (other := seen.setdefault(key, w)) is not w:
            return (f"device: cuda: the workers of ranks {other.rank} and {w.rank} share one GPU ({w.device} on "
                    f"{w.hostname or w.host}), and NCCL refuses two ranks on one GPU: give each worker a GPU of "
                    "its own (gpipe-worker --device cuda:K)")
    return None


class Registry(Jobs):
    """The workers: registration, heartbeats, and the attempt a lost worker fails."""

    def register(self, rank: int, host: str, device: str, hostname: str, cores: list[int] | None = None,
                 threads: int = 1, gpu: Gpu | None = None) -> Worker:
        """A worker for `rank` on `device` (cpu or cuda:K, its GPU `gpu`, as the worker checked them); RankTaken
        while a live worker (heard from within the timeout) holds it."""
        old = self.workers.get(rank)
        if old is not None:
            silent = self.clock.monotonic() - old.last_seen
            if silent <= self.heartbeat_timeout:
                raise RankTaken(f"rank {rank} is held by a live worker on {old.hostname or old.host}, heard from "
                                f"{silent:.1f}s ago: it is dropped if silent {self.heartbeat_timeout - silent:.1f}s "
                                "more")
            self.drop(old, f"{self.worker_name(old)} was replaced after {silent:.0f}s of silence")
        now = self.clock.monotonic()
        w = Worker(uuid.uuid4().hex, rank, host, device or "cpu", hostname, list(cores or []), max(1, threads),
                   now, registered=now, gpu=gpu)
        # An attempt that held this rank is failing (its worker was replaced or dropped) but may not have ended:
        # it committing within its grace, its processes on this device may still be leaving. The rank stays its
        # until it has ended (it frees its workers as it ends, with an Abort), never another job's meanwhile.
        if (holding := next((a for a in self.attempts.values() if rank in a.ranks), None)) is not None:
            w.attempt_id = holding.id
        self.workers[rank] = w
        on = f"{w.device}: {gpu.describe()}" if gpu is not None else w.device
        self.say(f"worker for rank {rank} registered from {hostname or host} ({on})")
        self.wake.set()
        return w

    def worker_name(self, w: Worker) -> str:
        """"stage 1's worker", or "stage 1 of replica 2's worker (rank 5)" in an attempt of a job with replicas."""
        for attempt in self.attempts.values():
            if attempt.id == w.attempt_id and w.rank in attempt.ranks:
                slot = attempt.slot(w.rank)
                if attempt.topology.replicas > 1 or slot != w.rank:
                    return f"{attempt.topology.name(slot)}'s worker (rank {w.rank})"
        return f"stage {w.rank}'s worker"

    def worker(self, worker_id: str) -> Worker | None:
        return next((w for w in self.workers.values() if w.id == worker_id), None)

    def heartbeat(self, worker_id: str, attempt_id: str = "", ended: bool = False, exit_code: int = 0,
                  error: str = "") -> bool:
        """A worker is alive; if its attempt process ended badly, that attempt fails. False: unknown worker."""
        w = self.worker(worker_id)
        if w is None:
            return False
        w.last_seen = self.clock.monotonic()
        if ended and exit_code != 0 and attempt_id and w.attempt_id == attempt_id:
            why = f"{self.worker_name(w)} process died ({describe_exit(exit_code)})"
            self._fail_attempt_of(w, f"{why}: {error}" if error else why)
        self.wake.set()
        return True

    def drop(self, w: Worker, why: str) -> None:
        """Forget a worker (lost, or replaced); its attempt fails and its command stream ends.

        If it and every other worker have been silent for a few heartbeats, the coordinator itself is the
        likelier one cut off, and the failure says so rather than blame one rank.
        """
        now = self.clock.monotonic()
        silent = [o for o in self.workers.values() if now - o.last_seen >= SILENT_S]
        if len(self.workers) > 1 and len(silent) == len(self.workers) and w in silent:
            why = (f"all {len(silent)} workers missed their heartbeats for {now - w.last_seen:.0f}s or more "
                   f"(the coordinator may be cut off); the first to go: {why}")
        if self.workers.get(w.rank) is w:
            del self.workers[w.rank]
        self._fail_attempt_of(w, why)
        w.commands.put_nowait(None)

    def _fail_attempt_of(self, w: Worker, why: str) -> None:
        for attempt in self.attempts.values():
            if attempt.id == w.attempt_id and attempt.failure is None and not attempt.stopped:
                top, slot = attempt.topology, attempt.slot(w.rank) if w.rank in attempt.ranks else w.rank
                attempt.failure = report.Failed(why, EXIT_FAILED, Cause.PEER, w.rank, top.stage_of(slot),
                                                top.replica_of(slot))
                attempt.failed.set()
                self._kill(attempt, COMMIT_GRACE_S)

    def _ready(self, e: Entry) -> dict[int, Worker]:
        """The workers that may take `e`'s next attempt, by rank: idle, and heard from since its last failure."""
        return {r: w for r, w in self.workers.items()
                if w.attempt_id is None and not w.leaving and w.last_seen > e.failed_at}
