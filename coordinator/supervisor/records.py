"""What the supervisor keeps: jobs, workers, attempts and what starts one; the clock, store and processes it uses."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from gpipe.contract import StageError
from gpipe.coordinator.attempt import report
from gpipe.coordinator.attempt.report import Placement
from gpipe.coordinator.spec.job import JobSpec
from gpipe.service import job_records
from gpipe.service.job_records import Abort, JobRecord, Join
from gpipe.topology import Topology
from gpipe.worker.device import Gpu

COMMIT_GRACE_S = 60.0  # a failed attempt's time to commit the checkpoints it holds before it is killed
EVENT_WINDOW = 2000  # events of a job kept in memory (older metrics are read from disk)


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
    gpu: Gpu | None = None  # the GPU its device names, as the worker's probe saw it (gpipe.worker.device)

    def gpu_key(self) -> tuple[str, ...] | None:
        """What tells its GPU apart from every other: the GPU's UUID, else its host and device; None on a CPU."""
        if not self.device.startswith("cuda"):
            return None
        return (self.gpu.uuid,) if self.gpu is not None and self.gpu.uuid else (self.hostname or self.host,
                                                                                  self.device)


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
    events: deque[job_records.Event] = field(default_factory=lambda: deque(maxlen=EVENT_WINDOW))
    older: int = 0  # metrics no longer in `events`: the first `older` lines of the job's metrics.jsonl
    watchers: set[asyncio.Queue[job_records.Event]] = field(default_factory=set)
    shape: Topology | None = None  # re-planned onto fewer workers (elastic); None: the spec's
    last_ranks: list[int] = field(default_factory=list)  # the workers of its last attempt, by slot
    waiting: str = ""  # why it waits, when it needs more workers than are registered (gpipe.coordinator.supervisor.pool.short_of)
    yielded_to: str = ""  # the job of higher priority it was preempted for, until it runs again

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


def final_loss(job: JobRecord) -> str:
    """What a finished job's last line leads with: its steps and its last step's loss, when it logged one."""
    return f"{job.steps_done}/{job.steps} steps, final loss {job.loss:.4f}; " if job.steps_done else ""
