"""The supervisor: jobs, workers and attempts, for `run` and `serve` alike.

Whether a failure restarts the job, fails it or shrinks it is coordinator.policy's
decision; the supervisor carries it out:

- A job waits PENDING (or RESTARTING) until a worker is registered, idle and
  heard from since the job's last failure, for each of its ranks.
- Then an attempt starts: an attempt process (coordinator.attempt) plans
  the job, resumes from its newest good checkpoint, and reports `Master`; each
  rank's worker is told to join; the attempt drives the stages to the end.
- A worker is lost when its attempt process dies (its next heartbeat says so),
  when its command stream ends, or when it is silent for `heartbeat_timeout`.
  Its attempt is killed on every stage. What the supervisor saw explains a
  failure better than what the attempt process reported, so it comes first.
- A failed attempt restarts from the last good checkpoint, `max_restarts`
  times, backing off (0 s, then 1, 2, 4 ... up to `BACKOFF_CAP_S`), once all
  its ranks are back (within `restart_timeout_s`). A worker's rank is its
  preferred slot: a restart places a spare idle worker in a lost rank's slot
  (coordinator.elastic). With `elastic`, a rank still lost past
  `restart_timeout_s` re-plans the job onto fewer workers (fewer replicas,
  then fewer stages) instead of failing it, and the job grows back to its
  spec's shape at the first checkpoint after enough workers are back. What a
  restart cannot fix fails the job at once (coordinator.policy). Past that
  the job is FAILED, naming the first failure.
- Preemption (a worker's SIGTERM: `preempt_worker`; serve's or run's:
  `preempt_all`) is no failure: the attempt is asked to stop at its next
  step boundary with a checkpoint (SIGUSR1, once it drives the stages;
  before that it is killed: its checkpoint is the one it resumed from).
  Past the grace it is killed, and the job falls back to its last good
  checkpoint. Either way the job waits PREEMPTED, with no timeout and no
  restart counted, until its ranks have idle workers again; a leaving
  worker is given no attempt.
- One job's trouble is its own: an error in its bookkeeping fails that job,
  never the loops, and a record that cannot be saved (a full disk) fails the
  job and frees its workers. `serve` marks itself NOT_SERVING if a loop dies.
- Memory is bounded by the work: each job keeps its newest `EVENT_WINDOW`
  events; `watch` reads older metrics from the job's metrics.jsonl.

`serve` gives it daemons over gRPC and a job table on disk; `run` gives it
local workers in process and keeps nothing but the job's outputs. Time comes
from a clock that tests replace, and the loops are `tick` and `schedule`,
which tests call directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
import traceback
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from coordinator import elastic, policy, report
from coordinator.spec import JobSpec
from gpipe import serde
from gpipe.contract import Cause, StageError
from gpipe.errors import EXIT_BAD_INPUT, EXIT_FAILED, describe_os_error
from gpipe.serde import Abort, JobRecord, JobState, Join, StateChange
from gpipe.topology import Topology
from worker.device import Gpu

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0  # a worker silent this long is dropped, and its attempt fails
SILENT_S = 3 * HEARTBEAT_INTERVAL_S  # every worker silent this long when one is lost: the coordinator is cut off
WORKER_REPORT_GRACE_S = 0.5  # after a failed attempt, how long a dying worker has to say so
COMMIT_GRACE_S = 60.0  # a failed attempt's time to commit the checkpoints it holds before it is killed
STOP_TIMEOUT_S = 30.0  # how long `stop` waits for a killed attempt to be reaped
STOP_CHECKPOINT_S = 25.0  # how long `stop` waits for the checkpoint at the next step boundary, then kills
EVENT_WINDOW = 2000  # events of a job kept in memory (older metrics are read from disk)
WATCH_QUEUE = 10_000  # events waiting for one watcher; a watcher that falls further behind loses the oldest


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def time(self) -> float: ...


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


class Store(Protocol):
    """Where job records are kept between state changes (serve: job.json; run: nowhere)."""

    def save(self, job: JobRecord) -> None: ...


class NoStore:
    def save(self, job: JobRecord) -> None:
        pass


class AttemptProcess(Protocol):
    """A running attempt: its reports, its end, and a way to end it."""

    def reports(self) -> AsyncIterator[report.Report]: ...
    async def wait(self) -> int: ...
    def kill(self, grace_s: float = 0.0) -> None:
        """End it: at once, or with `grace_s` to commit the checkpoints it holds (SIGTERM, then SIGKILL)."""
        ...

    def last_words(self) -> str:
        """The last error line it wrote to its log, or '' (for a process that died without a report)."""
        ...

    def preempt(self) -> None:
        """Ask it to stop at the next step boundary, with a checkpoint (it then reports `Preempted`)."""
        ...


@dataclass(frozen=True)
class Placement:
    """Where one stage of an attempt runs: its worker's address, device, cores and threads, and its rank."""

    host: str
    device: str
    cores: list[int]
    threads: int
    rank: int | None = None  # the worker's own; None: the slot


@dataclass(frozen=True)
class Launch:
    """What an attempt process is started with."""

    job: str
    attempt_id: str
    number: int  # the job's attempt count, this one included
    spec_path: Path
    job_dir: Path  # the job's code: its working_dir (run), or its archive unpacked (serve): its modules are importable
    placement: list[Placement]
    resume: bool  # from the newest good checkpoint; else a fresh start that drops earlier outputs
    topology: Topology | None = None  # a re-planned shape (elastic); None: the spec's


Launcher = Callable[[Launch], Awaitable[AttemptProcess]]


@dataclass
class Worker:
    id: str
    rank: int
    host: str
    device: str
    hostname: str
    cores: list[int]
    threads: int
    last_seen: float
    commands: asyncio.Queue[Join | Abort | None] = field(default_factory=asyncio.Queue)
    attempt_id: str | None = None
    registered: float = 0.0  # monotonic time of its registration
    leaving: bool = False  # preempted (Leave): given no attempt again
    gpu: Gpu | None = None  # the GPU its device names, as the worker's probe saw it (worker.device)

    def gpu_key(self) -> tuple[str, ...] | None:
        """What tells its GPU apart from every other: the GPU's UUID, else its host and device; None on a CPU."""
        if not self.device.startswith("cuda"):
            return None
        return (self.gpu.uuid,) if self.gpu is not None and self.gpu.uuid else (self.hostname or self.host,
                                                                                  self.device)


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


@dataclass
class Entry:
    """A job as the supervisor holds it: its record and what it was submitted with."""

    record: JobRecord
    spec: JobSpec | None  # None: a record that could not be read back (listed, never run or resumed)
    spec_path: Path
    job_dir: Path
    fresh: bool = False  # the next attempt starts over instead of resuming
    failed_at: float = float("-inf")  # monotonic time of the last failure: workers heard since count as back
    not_before: float = float("-inf")  # monotonic time before which no restart starts (backoff)
    last_error: StageError | None = None  # the previous attempt's failure, to tell one that repeats
    events: deque[serde.Event] = field(default_factory=lambda: deque(maxlen=EVENT_WINDOW))
    older: int = 0  # metrics no longer in `events`: the first `older` lines of the job's metrics.jsonl
    watchers: set[asyncio.Queue[serde.Event]] = field(default_factory=set)
    shape: Topology | None = None  # re-planned onto fewer workers (elastic); None: the spec's
    last_ranks: list[int] = field(default_factory=list)  # the workers of its last attempt, by slot

    @property
    def topology(self) -> Topology:
        """The shape its attempts run at: the spec's, or a re-planned one."""
        return self.shape or self.job_spec.topology

    @property
    def job_spec(self) -> JobSpec:
        if self.spec is None:
            raise ValueError(f"job {self.record.name!r} has no readable record: {self.record.error}")
        return self.spec

    @property
    def metrics_path(self) -> Path:
        return Path(self.record.output_dir) / "metrics.jsonl"


@dataclass
class Attempt:
    """One try of a job: the workers it runs on, its process, and a failure decided here."""

    id: str
    job: str
    ranks: list[int]  # its workers' ranks, by slot: slot k (stage k mod P of replica k div P) is ranks[k]'s
    topology: Topology
    process: AttemptProcess | None = None
    stopped: bool = False
    failure: report.Failed | None = None  # decided here (a lost worker, a record that cannot be saved)
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    driving: bool = False  # it reported Master: it handles a preemption request (SIGUSR1)
    preempt: str = ""  # why it was asked to stop at the next step boundary ('' : it was not)
    preempt_by: float = float("inf")  # monotonic time past which a preempted attempt is killed
    regrow: bool = False  # ended at a checkpoint to grow back to the spec's shape: no failure

    def slot(self, rank: int) -> int:
        """The slot that worker `rank` serves in this attempt."""
        return self.ranks.index(rank)


def describe_exit(code: int) -> str:
    """'signal SIGKILL' or 'exit code 3'."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def newest_committed(out: Path) -> int:
    """The newest step of the job whose outputs are in `out` with a checkpoint manifest in place (0: none);
    the attempt verifies it."""
    # Imported here: it brings torch, which only a restarted serve's first look needs.
    from coordinator import checkpoint

    with contextlib.suppress(OSError):
        return max(checkpoint.committed(checkpoint.folder(out)), default=0)
    return 0


def _ranks(spec: JobSpec) -> str:
    """The ranks a job takes: 0 ... replicas x stages - 1 (gpipe.topology)."""
    return spec.topology.describe_ranks()


def _read_metrics(path: Path, count: int, batch: int = 1000) -> Iterator[list[serde.Event]]:
    """The first `count` lines of a metrics.jsonl as events, `batch` at a time (run off the event loop)."""
    import json

    with contextlib.suppress(OSError), path.open("rb") as f:
        out: list[serde.Event] = []
        for n, line in enumerate(f):
            if n >= count:
                break
            with contextlib.suppress(ValueError):  # a line cut short by a killed attempt
                out.append(serde.metrics_event(json.loads(line)))
            if len(out) >= batch:
                yield out
                out = []
        if out:
            yield out


class RankTaken(Exception):
    """A registration for a rank that a live worker holds: refused, the holder and its attempt untouched."""


class Supervisor:
    def __init__(self, launcher: Launcher, store: Store | None = None, clock: Clock | None = None,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S, say: Callable[[str], None] | None = None,
                 grace_s: float = WORKER_REPORT_GRACE_S):
        self.launcher = launcher
        self.store: Store = store or NoStore()
        self.clock: Clock = clock or SystemClock()
        self.heartbeat_timeout, self.grace_s = heartbeat_timeout, grace_s
        self.say = say or (lambda line: print(f"gpipe: {line}", file=sys.stderr, flush=True))
        self.jobs: dict[str, Entry] = {}
        self.workers: dict[int, Worker] = {}
        self.attempts: dict[str, Attempt] = {}  # by job name
        self.tasks: set[asyncio.Task[None]] = set()
        self.wake = asyncio.Event()
        self.shutting_down = False  # running jobs stay RUNNING on disk, for the next start to pick up
        self.draining = False  # preempt_all: no attempt starts

    # -- jobs -------------------------------------------------------------------------

    def add(self, job: JobRecord, spec: JobSpec | None, spec_path: Path, job_dir: Path, fresh: bool = False,
            events: list[serde.Event] | None = None, older: int = 0) -> Entry:
        """Take a job: new ones go PENDING; known ones (a restarted serve's) keep their state or resume.

        `spec` None is a record that could not be read back: it is listed, FAILED, and never runs, so
        that its name (and its files) cannot be taken by a new job. `older` counts the metrics of its
        metrics.jsonl that `events` leaves out.
        """
        e = Entry(job, spec, spec_path, job_dir, fresh=fresh)
        e.events.extend(events or [])
        e.older = older
        self.jobs[job.name] = e
        if spec is None:
            return e
        if not job.history:
            self._set_state(e, JobState.PENDING, f"waiting for workers of {_ranks(spec)}")
        elif job.state == JobState.PREEMPTED:  # stays PREEMPTED (no restart counted) until it runs again
            job.checkpoint_step = max(job.checkpoint_step, newest_committed(Path(job.output_dir)))
        elif job.state in (JobState.RUNNING, JobState.RESTARTING):
            # A checkpoint committed just before serve died may not have reached the record: the disk says.
            job.checkpoint_step = max(job.checkpoint_step, newest_committed(Path(job.output_dir)))
            # Not the job's fault: no restart is counted.
            self._set_state(e, JobState.RESTARTING, f"the coordinator restarted; resuming from {self._from(job)} "
                                                    f"once {_ranks(spec)} are back")
        self.wake.set()
        return e

    def record(self, name: str) -> JobRecord:
        return self.jobs[name].record  # KeyError: no such job

    def job_dir_of(self, attempt_id: str) -> Path | None:
        """The folder of the code of the job whose attempt is `attempt_id` (None: no such attempt now)."""
        attempt = next((a for a in self.attempts.values() if a.id == attempt_id), None)
        return self.jobs[attempt.job].job_dir if attempt is not None else None

    async def stop(self, name: str) -> JobRecord:
        e = self.jobs[name]  # KeyError: no such job
        job = e.record
        attempt = self.attempts.get(name)
        if attempt is None and job.state in (JobState.PENDING, JobState.RESTARTING, JobState.PREEMPTED):
            self._set_state(e, JobState.STOPPED, f"stopped while {job.state.value.lower()}")
        elif attempt is not None:
            attempt.stopped = True
            if attempt.driving and attempt.process is not None:
                attempt.process.preempt()  # as a preemption: a checkpoint at the next step boundary, then it ends
                if await self._ended(name, STOP_CHECKPOINT_S):
                    return job
            self._kill(attempt)  # still planning (nothing newer to save), or its step outlasted the wait
            if not await self._ended(name, STOP_TIMEOUT_S):
                raise TimeoutError(f"job {name!r}: its attempt did not end within {STOP_TIMEOUT_S:.0f}s "
                                   "of being killed")
        return job

    async def _ended(self, name: str, wait_s: float) -> bool:
        """Whether job `name`'s attempt ended within `wait_s` (its task records STOPPED and frees the workers)."""
        deadline = self.clock.monotonic() + wait_s
        while name in self.attempts:
            if self.clock.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def resume(self, name: str) -> JobRecord:
        """Queue a FAILED or STOPPED job again, to resume from its last good checkpoint."""
        e = self.jobs[name]  # KeyError: no such job
        job = e.record
        if job.state not in (JobState.FAILED, JobState.STOPPED):
            raise ValueError(f"job {name!r} is {job.state.value}: only a FAILED or STOPPED job can be resumed")
        spec = e.job_spec  # ValueError: its record could not be read
        job.restarts, job.error, job.failed_rank, job.exit_code = 0, "", -1, 0
        e.not_before, e.last_error = float("-inf"), None
        self._set_state(e, JobState.RESTARTING,
                        f"resume requested: resuming from {self._from(job)} once {_ranks(spec)} are free")
        self.wake.set()
        return job

    def _from(self, job: JobRecord) -> str:
        return f"checkpoint step-{job.checkpoint_step}" if job.checkpoint_step else "the last good checkpoint"

    def _emit(self, e: Entry, event: serde.Event) -> None:
        if len(e.events) == e.events.maxlen and e.events[0][0] in ("metrics", "eval"):
            e.older += 1  # the oldest is dropped from memory; metrics.jsonl still has it
        e.events.append(event)
        for q in e.watchers:
            if q.full():  # a watcher that stopped reading: it loses its oldest event, serve no memory
                q.get_nowait()
            q.put_nowait(event)

    def _set_state(self, e: Entry, state: JobState, message: str = "") -> None:
        change = StateChange(state, self.clock.time(), message)
        e.record.state = state
        e.record.history.append(change)
        self._emit(e, ("state", change))
        self.say(f"job {e.record.name} {state.value}{': ' + message if message else ''}")
        self._save(e)

    def _save(self, e: Entry) -> None:
        """Keep the record; if it cannot be written, the job fails (its workers are freed), not the loops."""
        try:
            self.store.save(e.record)
        except OSError as ex:
            why = f"cannot save the job's state: {describe_os_error(ex)}"
            self.say(f"job {e.record.name}: {why}")
            attempt = self.attempts.get(e.record.name)
            if attempt is not None:
                if attempt.failure is None and not attempt.stopped:
                    attempt.failure = report.Failed(why, EXIT_FAILED, Cause.DISK)
                    attempt.failed.set()
                self._kill(attempt)  # its task frees the workers and records FAILED
            elif not e.record.state.ended:
                if not e.record.error:
                    e.record.error = why
                e.record.exit_code = 1
                change = StateChange(JobState.FAILED, self.clock.time(), why)
                e.record.state = JobState.FAILED
                e.record.history.append(change)
                self._emit(e, ("state", change))
                self.say(f"job {e.record.name} FAILED: {why}")
                with contextlib.suppress(OSError):
                    self.store.save(e.record)

    async def watch(self, name: str) -> AsyncIterator[serde.Event]:
        """The job's events so far, then live ones until it ends."""
        e = self.jobs[name]  # KeyError: no such job
        q: asyncio.Queue[serde.Event] = asyncio.Queue(maxsize=WATCH_QUEUE)
        e.watchers.add(q)
        try:
            window = list(e.events)
            if e.older:
                # The states before the window, then the metrics it left out, read from disk in batches.
                first = next((ev[1].time_unix for ev in window if ev[0] == "state"), float("inf"))
                for h in e.record.history:
                    if h.time_unix <= first and ("state", h) not in window:
                        yield "state", h
                batches = _read_metrics(e.metrics_path, e.older)
                none: list[serde.Event] = []
                while batch := await asyncio.to_thread(next, batches, none):
                    for ev in batch:
                        yield ev
            for ev in window:
                yield ev
            if e.record.state.ended:
                return
            while True:
                ev = await q.get()
                yield ev
                if ev[0] == "state" and ev[1].state.ended:
                    return
        finally:
            e.watchers.discard(q)

    # -- workers ----------------------------------------------------------------------

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

    # -- preemption -------------------------------------------------------------------

    def preempt_worker(self, worker_id: str, grace_s: float) -> bool | None:
        """The worker is leaving within `grace_s` (SIGTERM): it gets no attempt again, and its attempt stops at
        the next step boundary with a checkpoint. True: it was in one; False: it was idle; None: unknown."""
        w = self.worker(worker_id)
        if w is None:
            return None
        w.leaving = True
        attempt = next((a for a in self.attempts.values() if a.id == w.attempt_id), None)
        self.say(f"worker for rank {w.rank} is leaving within {grace_s:.0f}s (preempted)"
                 + (f": job {attempt.job} checkpoints at its next step boundary" if attempt else ""))
        if attempt is None:
            return False
        self.preempt(attempt, f"{self.worker_name(w)} was preempted (SIGTERM)", grace_s)
        return True

    def preempt_all(self, why: str, grace_s: float) -> None:
        """Every running attempt stops at its next step boundary with a checkpoint, within `grace_s`; no attempt
        starts after this (serve or run is stopping)."""
        self.draining = True
        for attempt in list(self.attempts.values()):
            self.preempt(attempt, why, grace_s)

    def preempt_waiting(self, name: str, why: str) -> None:
        """A job that waits (PENDING, RESTARTING) is PREEMPTED now: nothing runs to checkpoint (run's SIGTERM)."""
        e = self.jobs[name]  # KeyError: no such job
        if name not in self.attempts and e.record.state in (JobState.PENDING, JobState.RESTARTING):
            self._set_state(e, JobState.PREEMPTED, f"{why} while {e.record.state.value.lower()}: "
                                                   f"{self._from(e.record)} stands")

    def preempt(self, attempt: Attempt, why: str, grace_s: float) -> None:
        """Ask `attempt` to stop at its next step boundary with a checkpoint; past `grace_s` it is killed."""
        if attempt.preempt or attempt.stopped or attempt.failure is not None:
            return
        attempt.preempt, attempt.preempt_by = why, self.clock.monotonic() + grace_s
        e = self.jobs.get(attempt.job)
        if e is not None:
            self._log(e, f"{why}: checkpointing at the next step boundary (grace {grace_s:.0f}s)")
        if attempt.process is not None:
            if attempt.driving:
                attempt.process.preempt()
            else:  # still planning or resuming: nothing newer than the checkpoint it resumes from to save
                attempt.process.kill()
        self.wake.set()

    # -- the loops --------------------------------------------------------------------

    def tick(self) -> None:
        """Drop workers whose heartbeats stopped; fail restarting jobs whose workers stay away."""
        now = self.clock.monotonic()
        silent = [w for w in self.workers.values() if now - w.last_seen > self.heartbeat_timeout]
        everyone = len(silent) > 1 and len(silent) == len(self.workers)
        for w in silent:
            why = f"{self.worker_name(w)} missed its heartbeats for {self.heartbeat_timeout:.0f}s"
            if everyone:
                why = (f"all {len(silent)} workers missed their heartbeats for {self.heartbeat_timeout:.0f}s "
                       "(the coordinator may be cut off)")
            self.drop(w, why)
        for attempt in list(self.attempts.values()):
            if attempt.preempt and now > attempt.preempt_by and attempt.failure is None:
                attempt.failure = report.Failed("its checkpoint did not finish within the grace", EXIT_FAILED,
                                                Cause.TIMEOUT)
                attempt.failed.set()
                self._kill(attempt)
        for e in list(self.jobs.values()):
            job = e.record
            if job.state not in (JobState.RESTARTING, JobState.PREEMPTED) or job.name in self.attempts:
                continue
            with self._own_trouble(e):
                spec = e.job_spec
                waited = self.clock.time() - job.history[-1].time_unix
                for action in policy.when_away(spec, job.state == JobState.PREEMPTED, waited):
                    if action == policy.Action.SHRINK and self._replan(e, waited):
                        break
                    if action == policy.Action.FAIL:
                        missing = [r for r in spec.topology.ranks() if r not in self.workers]
                        who = (f"rank(s) {', '.join(map(str, missing))} did not come back" if missing
                               else "its workers stayed busy")
                        first = f"; the first failure: {job.error}" if job.error else ""
                        job.exit_code = 1
                        self._set_state(e, JobState.FAILED,
                                        f"{who} within restart_timeout_s ({spec.restart_timeout_s:.0f}s){first}")
        self.wake.set()

    @contextlib.contextmanager
    def _own_trouble(self, e: Entry) -> Iterator[None]:
        """A job whose bookkeeping raises fails alone: the loops and the other jobs go on."""
        try:
            yield
        except Exception as ex:  # a bug of ours, met by one job: it must not stop the service
            traceback.print_exc(file=sys.stderr)
            if not e.record.state.ended and e.record.name not in self.attempts:
                e.record.exit_code = 1
                e.record.error = e.record.error or f"internal error: {type(ex).__name__}: {ex}"
                with contextlib.suppress(Exception):
                    self._set_state(e, JobState.FAILED, f"internal error: {type(ex).__name__}: {ex}")

    def schedule(self) -> None:
        """Start each waiting job, oldest first, once every rank it needs has an idle worker heard from lately."""
        now = self.clock.monotonic()
        if self.draining:
            return
        for e in list(self.jobs.values()):
            job = e.record
            if job.state not in (JobState.PENDING, JobState.RESTARTING, JobState.PREEMPTED) or job.name in self.attempts:
                continue
            if now < e.not_before:
                continue
            with self._own_trouble(e):
                ready = self._ready(e)
                if job.state == JobState.PENDING:  # the first placement: each rank its own slot
                    ready = {r: w for r, w in ready.items() if r < e.topology.world}
                # The spec's shape where it fits (a re-planned job grows back at a restart), else the re-planned.
                for top in dict.fromkeys([e.job_spec.topology, e.topology]):
                    placed = elastic.place(top.world, ready)
                    if placed is not None and e.job_spec.device == "cuda" and (why := shared_gpu(placed)):
                        job.exit_code, job.error = EXIT_BAD_INPUT, why  # no attempt could start: never waits
                        self._set_state(e, JobState.FAILED, why)
                        break
                    if placed is not None:
                        e.shape = None if top == e.job_spec.topology else top
                        attempt = Attempt(uuid.uuid4().hex[:12], job.name, [w.rank for w in placed], top)
                        for w in placed:
                            w.attempt_id = attempt.id
                        self.attempts[job.name] = attempt
                        self._spawn(self._run(e, attempt))
                        break

    def _ready(self, e: Entry) -> dict[int, Worker]:
        """The workers that may take `e`'s next attempt, by rank: idle, and heard from since its last failure."""
        return {r: w for r, w in self.workers.items()
                if w.attempt_id is None and not w.leaving and w.last_seen > e.failed_at}

    def _replan(self, e: Entry, waited: float) -> bool:
        """A restarting job whose ranks stayed away past restart_timeout_s: re-plan it onto the workers that
        remain (elastic), saying why. False: it is not elastic, or not even its min_stages fit."""
        spec, job = e.job_spec, e.record
        ready = self._ready(e)
        top = elastic.shape_for(spec, len(ready)) if spec.elastic is not None else None
        if top is None or top == e.topology or top.world > e.topology.world:
            return False
        was = e.last_ranks or e.topology.ranks()  # none yet: a restarted serve's job, last run at the spec's shape
        lost = [r for r in was if r not in self.workers] or [r for r in was if r not in ready]
        who = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}" if lost else "its workers"
        # Since the failure; for a restarted serve's job, since it began waiting.
        since = self.clock.monotonic() - e.failed_at if e.failed_at > float("-inf") else waited
        change = _change(e.topology, top)
        e.shape = top
        self._set_state(e, JobState.RESTARTING, f"{change}: {who} lost for {since:.0f} s, no spare worker; "
                                                f"resuming from {self._from(job)} on {elastic.describe(top)}")
        return True

    async def serve_forever(self) -> None:
        """Run `tick` every heartbeat interval and `schedule` whenever something changed."""
        next_tick = self.clock.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_tick - self.clock.monotonic())):
                    await self.wake.wait()
            self.wake.clear()
            if self.clock.monotonic() >= next_tick:
                self.tick()
                next_tick = self.clock.monotonic() + HEARTBEAT_INTERVAL_S
            self.schedule()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and (ex := task.exception()) is not None:
            traceback.print_exception(ex, file=sys.stderr)  # a bug of ours: said, never silent

    def shutdown(self) -> None:
        """Kill every attempt; jobs keep their state (a restarted serve resumes them)."""
        self.shutting_down = True
        for attempt in list(self.attempts.values()):
            self._kill(attempt)

    # -- attempts ---------------------------------------------------------------------

    def _kill(self, attempt: Attempt, grace_s: float = 0.0) -> None:
        if attempt.process is not None:
            attempt.process.kill(grace_s)

    async def _run(self, e: Entry, attempt: Attempt) -> None:
        job, spec = e.record, e.job_spec
        job.attempts += 1
        resuming = job.state in (JobState.RESTARTING, JobState.PREEMPTED)
        top = attempt.topology
        shape = f" ({elastic.describe(top)} of the spec's {elastic.describe(spec.topology)})" if e.shape else ""
        self._set_state(e, JobState.RUNNING, f"attempt {job.attempts} ({attempt.id}) on ranks {attempt.ranks}"
                        + shape + (f", resuming from {self._from(job)}" if resuming else ""))
        e.last_ranks = list(attempt.ranks)
        done, reported, code = False, None, -1
        stopped_at: report.Preempted | None = None
        try:
            placement = [Placement(w.host, w.device, w.cores, w.threads, w.rank)
                         for w in (self.workers[r] for r in attempt.ranks)]
            attempt.process = await self.launcher(Launch(
                job.name, attempt.id, job.attempts, e.spec_path, e.job_dir, placement, resume=not e.fresh,
                topology=e.shape))
            e.fresh = False
            if attempt.stopped or attempt.failure or attempt.preempt:
                attempt.process.kill()
            async for r in attempt.process.reports():
                if isinstance(r, report.Master):
                    attempt.driving = True
                    for slot, rank in enumerate(attempt.ranks):
                        w = self.workers.get(rank)
                        if w is not None and w.attempt_id == attempt.id:
                            # The worker's slot, and the attempt's count of workers.
                            w.commands.put_nowait(Join(attempt.id, r.address, slot, top.world,
                                                       spec.start_timeout_s, r.secret, job.code_sha256))
                elif isinstance(r, report.Metrics):
                    job.steps_done, job.loss = int(r.values["step"]) + 1, float(r.values["loss"])
                    self._emit(e, ("metrics", r.values))
                elif isinstance(r, report.Eval):
                    step = r.values.get("step")
                    job.eval_loss, job.eval_step = float(r.values["eval_loss"]), -1 if step is None else int(step)
                    self._emit(e, ("eval", r.values))
                elif isinstance(r, report.Resumed):
                    job.steps_done = r.step
                elif isinstance(r, report.Checkpoint):
                    job.checkpoint_step = r.step
                    self._save(e)
                    self._log(e, f"checkpoint step-{r.step}: {r.bytes / 2**20:,.1f} MiB in {r.write_s:.3f}s")
                    self._grow_back(e, attempt, r.step)
                elif isinstance(r, report.Log):
                    self._log(e, r.line)
                elif isinstance(r, report.Failed):
                    reported = r
                elif isinstance(r, report.Done):
                    done = True
                elif isinstance(r, report.Preempted):
                    stopped_at = r
            code = await attempt.process.wait()
            if (not done and stopped_at is None and attempt.failure is None
                    and not (attempt.stopped or attempt.regrow) and code != EXIT_BAD_INPUT):
                # A worker that died is the likelier cause: give its report a moment to arrive.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.grace_s):
                        await attempt.failed.wait()
        except Exception as ex:  # the launch itself failed (no such file, no memory): the attempt fails
            reported = report.Failed(f"the attempt could not start: {type(ex).__name__}: {ex}", EXIT_FAILED)
        finally:
            self._kill(attempt)
            for rank in attempt.ranks:
                w = self.workers.get(rank)
                if w is not None and w.attempt_id == attempt.id:
                    w.commands.put_nowait(Abort(attempt.id))
                    w.attempt_id = None
            del self.attempts[job.name]
            self.wake.set()
        if self.shutting_down and not attempt.preempt:
            return
        if attempt.stopped:
            if stopped_at is not None and code == 0:
                job.checkpoint_step = max(job.checkpoint_step, stopped_at.step)
                saved = f"checkpoint step-{stopped_at.step} taken at the step boundary"
            else:
                saved = f"{self._from(job)} stands"
            self._set_state(e, JobState.STOPPED, f"stopped while running; {saved}")
        elif attempt.regrow and not (done and code == 0):
            e.shape = None
            self._set_state(e, JobState.RESTARTING, f"{_change(top, spec.topology)}: enough workers are back; "
                                                    f"resuming from {self._from(job)} once {_ranks(spec)} are free")
        elif done and code == 0:
            self._set_state(e, JobState.SUCCEEDED, f"{final_loss(job)}weights in "
                                                   f"{Path(job.output_dir) / 'model.safetensors'}")
        elif attempt.preempt and not policy.hopeless(reported, code):
            self._preempted(e, attempt, stopped_at if code == 0 else None)
        else:
            self._failed(e, attempt, reported, code)

    def _preempted(self, e: Entry, attempt: Attempt, stopped_at: report.Preempted | None) -> None:
        """The attempt ended on a preemption: the job waits PREEMPTED for its workers (no restart is counted)."""
        job, spec = e.record, e.job_spec
        e.failed_at = self.clock.monotonic()
        if stopped_at is not None:
            job.checkpoint_step = max(job.checkpoint_step, stopped_at.step)
            saved = f"checkpoint step-{stopped_at.step} taken at the step boundary"
        else:
            why = (attempt.failure.message if attempt.failure is not None
                   else "the attempt ended first" if attempt.driving else "the attempt was still starting")
            saved = f"no checkpoint at the step boundary ({why}): falling back to {self._from(job)}"
        then = "" if self.draining else f"; resuming once {_ranks(spec)} are back"
        self._set_state(e, JobState.PREEMPTED, f"{attempt.preempt}; {saved}{then}")

    def _grow_back(self, e: Entry, attempt: Attempt, step: int) -> None:
        """At a checkpoint of a re-planned job: if the spec's shape can be placed on the idle workers and this
        attempt's own, end the attempt (it has committed the checkpoint) so that the next runs at that shape."""
        spec = e.job_spec
        if e.shape is None or attempt.regrow or attempt.failure or attempt.stopped or step >= spec.steps:
            return
        mine = {r: self.workers[r] for r in attempt.ranks if r in self.workers}
        if elastic.place(spec.topology.world, {**self._ready(e), **mine}) is None:
            return
        attempt.regrow = True
        self._log(e, f"{_change(attempt.topology, spec.topology)}: enough workers are registered; ending this "
                     f"attempt at checkpoint step-{step}")
        self._kill(attempt, COMMIT_GRACE_S)

    def _failed(self, e: Entry, attempt: Attempt, reported: report.Failed | None, code: int) -> None:
        """Restart the job, or fail it, as coordinator.policy decides from the failure's fields."""
        job, spec = e.record, e.job_spec
        bad_input = policy.bad_input(reported, code)
        if attempt.failure is not None and not bad_input:
            failure = attempt.failure  # what the supervisor saw explains it better than the attempt's report
        elif reported is not None:
            failure = reported
        else:
            message = f"the attempt process died ({describe_exit(code)})"
            if words := attempt.process.last_words() if attempt.process is not None else "":
                message += f": {words}"
            failure = report.Failed(message, EXIT_FAILED)
        message = failure.message
        e.failed_at = self.clock.monotonic()
        if not job.error:  # the first failure is the one a user needs
            job.error, job.failed_rank = message, -1 if failure.rank is None else failure.rank
        decision = policy.after_failure(failure, bad_input, e.last_error, job.restarts, spec.max_restarts)
        e.last_error = failure.error()
        if decision.action == policy.Action.RESTART:
            job.restarts += 1
            e.not_before = e.failed_at + decision.delay_s
            wait = f" in {decision.delay_s:.0f}s" if decision.delay_s else ""
            self._set_state(e, JobState.RESTARTING, f"{message}; restart {job.restarts} of {spec.max_restarts}"
                            f"{wait}: resuming from {self._from(job)} once {_ranks(spec)} are back")
            return
        job.exit_code = decision.exit_code
        if bad_input:
            self._set_state(e, JobState.FAILED, message)
        elif decision.hopeless:
            self._set_state(e, JobState.FAILED, f"{message} (not restarted: {decision.hopeless})")
        else:
            gave_up = f" (gave up after {job.restarts} restarts; the last failure: {message})" if job.restarts else ""
            self._set_state(e, JobState.FAILED, f"{job.error}{gave_up}")

    def _log(self, e: Entry, line: str) -> None:
        self.say(f"job {e.record.name}: {line}")
        self._emit(e, ("log", line))


def _change(old: Topology, new: Topology) -> str:
    """'stage count 3 -> 2', 'replicas 2 -> 1', or both."""
    parts = [f"replicas {old.replicas} -> {new.replicas}"] if old.replicas != new.replicas else []
    if old.stages != new.stages:
        parts.append(f"stage count {old.stages} -> {new.stages}")
    return ", ".join(parts)


def final_loss(job: JobRecord) -> str:
    """What a finished job's last line leads with: its steps and its last step's loss, when it logged one."""
    return f"{job.steps_done}/{job.steps} steps, final loss {job.loss:.4f}; " if job.steps_done else ""
