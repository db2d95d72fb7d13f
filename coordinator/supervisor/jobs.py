"""The supervisor's jobs: taking them, their states and events (kept in the store), stop, resume and watch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from gpipe.contract import Cause, disk_cause
from gpipe.coordinator.attempt import report
from gpipe.coordinator.spec.job import JobSpec
from gpipe.coordinator.supervisor import pool
from gpipe.coordinator.supervisor.records import Attempt, Clock, Entry, Launcher, Store, Worker
from gpipe.errors import EXIT_FAILED, describe_os_error
from gpipe.service import job_records
from gpipe.service.job_records import JobRecord, JobState, StateChange

STOP_TIMEOUT_S = 30.0  # how long `stop` waits for a killed attempt to be reaped
STOP_CHECKPOINT_S = 25.0  # how long `stop` waits for the checkpoint at the next step boundary, then kills
WATCH_QUEUE = 10_000  # events waiting for one watcher; a watcher that falls further behind loses the oldest


def newest_committed(out: Path) -> int:
    """The newest step of the job whose outputs are in `out` with a checkpoint manifest in place (0: none);
    the attempt verifies it."""
    # Imported here: it brings torch, which only a restarted serve's first look needs.
    from gpipe.coordinator.outputs import checkpoint

    with contextlib.suppress(OSError):
        return max(checkpoint.committed(checkpoint.folder(out)), default=0)
    return 0


def _read_metrics(path: Path, count: int, batch: int = 1000) -> Iterator[list[job_records.Event]]:
    """The first `count` lines of a metrics.jsonl as events, `batch` at a time (run off the event loop)."""
    import json

    with contextlib.suppress(OSError), path.open("rb") as f:
        out: list[job_records.Event] = []
        for n, line in enumerate(f):
            if n >= count:
                break
            with contextlib.suppress(ValueError):  # a line cut short by a killed attempt
                out.append(job_records.metrics_event(json.loads(line)))
            if len(out) >= batch:
                yield out
                out = []
        if out:
            yield out


class Jobs:
    """The supervisor's state, and its jobs: taking them, their states and events, stop, resume and watch."""

    launcher: Launcher
    store: Store
    clock: Clock
    heartbeat_timeout: float
    grace_s: float  # after a failed attempt, how long a dying worker has to say so
    say: Callable[[str], None]
    jobs: dict[str, Entry]
    workers: dict[int, Worker]
    attempts: dict[str, Attempt]  # by job name
    tasks: set[asyncio.Task[None]]
    wake: asyncio.Event
    shutting_down: bool  # running jobs stay RUNNING on disk, for the next start to pick up
    draining: bool  # preempt_all: no attempt starts
    limits: pool.Limits  # the pool's size, when known, and its starvation bound

    def add(self, job: JobRecord, spec: JobSpec | None, spec_path: Path, job_dir: Path, fresh: bool = False,
            events: list[job_records.Event] | None = None, older: int = 0) -> Entry:
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
            n = spec.topology.world
            self._set_state(e, JobState.PENDING, f"waiting for {n} idle worker{'s' if n > 1 else ''} at once "
                            f"(priority {spec.priority}; {spec.topology.describe_ranks()} first)")
        elif job.state == JobState.PREEMPTED:  # stays PREEMPTED (no restart counted) until it runs again
            job.checkpoint_step = max(job.checkpoint_step, newest_committed(Path(job.output_dir)))
        elif job.state in (JobState.RUNNING, JobState.RESTARTING):
            # A checkpoint committed just before serve died may not have reached the record: the disk says.
            job.checkpoint_step = max(job.checkpoint_step, newest_committed(Path(job.output_dir)))
            # Not the job's fault: no restart is counted.
            self._set_state(e, JobState.RESTARTING, f"the coordinator restarted; resuming from {self._from(job)} "
                                                    f"once {spec.topology.describe_ranks()} are back")
        self.wake.set()
        return e

    def record(self, name: str) -> JobRecord:
        return self.jobs[name].record  # KeyError: no such job

    def forget(self, name: str) -> JobRecord:
        """Drop an ended job from the table (its files are the caller's to delete): its record.
        ValueError if it has not ended: stop it first."""
        e = self.jobs[name]  # KeyError: no such job
        if not e.record.state.ended or name in self.attempts:
            raise ValueError(f"job {name!r} is {e.record.state.value}: stop it first")
        del self.jobs[name]
        return e.record

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
        if (why := pool.never_fits(name, spec.topology.world, self.limits)) is not None:
            raise ValueError(why)
        job.restarts, job.error, job.failed_rank, job.exit_code = 0, "", -1, 0
        e.not_before, e.last_error = float("-inf"), None
        self._set_state(e, JobState.RESTARTING,
                        f"resume requested: resuming from {self._from(job)} once "
                        f"{spec.topology.describe_ranks()} are free")
        self.wake.set()
        return job

    def _from(self, job: JobRecord) -> str:
        return f"checkpoint step-{job.checkpoint_step}" if job.checkpoint_step else "the last good checkpoint"

    def _emit(self, e: Entry, event: job_records.Event) -> None:
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
        """Keep the record; if it cannot be written, the job fails (its workers are freed), not the loops. On a full
        disk (Cause.SPACE) a running attempt fails and the job restarts as the policy says (room may be made), and
        a job with none keeps its state here: its next save writes the record whole."""
        try:
            self.store.save(e.record)
        except OSError as ex:
            why = f"cannot save the job's state: {describe_os_error(ex)}"
            self.say(f"job {e.record.name}: {why}")
            attempt = self.attempts.get(e.record.name)
            if attempt is not None:
                if attempt.failure is None and not attempt.stopped:
                    attempt.failure = report.Failed(why, EXIT_FAILED, disk_cause(ex))
                    attempt.failed.set()
                self._kill(attempt)  # its task frees the workers and records the job's next state
            elif not e.record.state.ended and disk_cause(ex) != Cause.SPACE:
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

    async def watch(self, name: str) -> AsyncIterator[job_records.Event]:
        """The job's events so far, then live ones until it ends."""
        e = self.jobs[name]  # KeyError: no such job
        q: asyncio.Queue[job_records.Event] = asyncio.Queue(maxsize=WATCH_QUEUE)
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
                none: list[job_records.Event] = []
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

    def _log(self, e: Entry, line: str) -> None:
        self.say(f"job {e.record.name}: {line}")
        self._emit(e, ("log", line))

    def _kill(self, attempt: Attempt, grace_s: float = 0.0) -> None:
        if attempt.process is not None:
            attempt.process.kill(grace_s)
