"""The supervisor: jobs, workers and attempts, for `run` and `serve` alike; here, its loops and its layers joined.

Whether a failure restarts the job, fails it or shrinks it is gpipe.coordinator.supervisor.policy's
decision; the supervisor carries it out:

- A job waits PENDING (or RESTARTING) until a worker is registered, idle and
  heard from since the job's last failure, for each of its ranks.
- Then an attempt starts: an attempt process (gpipe.coordinator.attempt.process) plans
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
  (gpipe.coordinator.plan.elastic). With `elastic`, a rank still lost past
  `restart_timeout_s` re-plans the job onto fewer workers (fewer replicas,
  then fewer stages) instead of failing it, and the job grows back to its
  spec's shape at the first checkpoint after enough workers are back (both
  as the pool decides, with its starts, preemptions and refusals:
  gpipe.coordinator.supervisor.pool.decide; `schedule` carries them out). What a
  restart cannot fix fails the job at once (gpipe.coordinator.supervisor.policy). Past that
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
import sys
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterator

from gpipe.contract import Cause
from gpipe.coordinator.attempt import report
from gpipe.coordinator.plan import elastic
from gpipe.coordinator.supervisor import policy, pool
from gpipe.coordinator.supervisor.lifecycle import Lifecycle
from gpipe.coordinator.supervisor.records import (
    Attempt,
    Clock,
    Entry,
    Launcher,
    NoStore,
    Store,
    SystemClock,
    Worker,
)
from gpipe.coordinator.supervisor.registry import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    shared_gpu,
)
from gpipe.errors import EXIT_BAD_INPUT, EXIT_FAILED
from gpipe.service.job_records import JobState

WORKER_REPORT_GRACE_S = 0.5  # after a failed attempt, how long a dying worker has to say so


class Supervisor(Lifecycle):
    """Jobs, workers and attempts, and the loops that move them (`tick`, `schedule`).

    Built in layers, a module each: gpipe.coordinator.supervisor.jobs (the job records: states, events, stop, resume, watch),
    gpipe.coordinator.supervisor.registry (the workers), gpipe.coordinator.supervisor.preemption, gpipe.coordinator.supervisor.reshape (elastic shrink and
    growth) and gpipe.coordinator.supervisor.lifecycle (an attempt from launch to the job's next state); this one schedules.
    """

    def __init__(self, launcher: Launcher, store: Store | None = None, clock: Clock | None = None,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S, say: Callable[[str], None] | None = None,
                 grace_s: float = WORKER_REPORT_GRACE_S, limits: pool.Limits | None = None):
        self.launcher = launcher
        self.limits = limits or pool.Limits()  # the pool's size, when known, and its starvation bound
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
                away = policy.when_away(spec, job.state == JobState.PREEMPTED, waited, bool(e.yielded_to))
                if policy.Action.FAIL not in away:
                    continue  # it waits; an elastic one the pool may start on fewer workers (`schedule`)
                if policy.Action.SHRINK in away and self._shrinkable(e):
                    continue  # the pool re-plans it onto the workers that remain, at its turn (`schedule`)
                missing = [r for r in spec.topology.ranks() if r not in self.workers]
                if len(self.workers) >= e.topology.world and any(
                        w.attempt_id is not None for w in self.workers.values()):
                    continue  # the pool's workers are there, busy with other jobs: it waits its turn
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
        """Carry out the pool's decision (gpipe.coordinator.supervisor.pool: gang placement on idle workers,
        priorities, backfill, elastic sizes): fail the jobs it refuses, preempt the running ones it asks to stop,
        and start the waiting ones it places, re-planned onto the size it gives them."""
        if self.draining:
            return
        waiting = self._waiting()
        for e in [e for e in waiting.values() if e.spec is None]:
            del waiting[e.record.name]
            with self._own_trouble(e):
                e.job_spec  # noqa: B018  # a record that no longer parses fails here, alone
        if not waiting:
            return
        _, d = self._decide(waiting)
        for name, why in d.refuses.items():
            e = waiting.pop(name)
            with self._own_trouble(e):
                e.record.exit_code, e.record.error = EXIT_BAD_INPUT, why
                self._set_state(e, JobState.FAILED, why)
        self._note_waits(waiting)
        for victim, by in d.preempts.items():
            if (attempt := self.attempts.get(victim)) is not None:
                self.jobs[victim].yielded_to = by
                self.preempt(attempt, f"preempted by job {by} (priority {self._priority(by)})", pool.PREEMPT_GRACE_S)
        wall = self.clock.time()
        for name, ranks in d.starts.items():
            e = waiting[name]
            with self._own_trouble(e):
                if name in d.shrinks:
                    self._shrink(e, d.shrinks[name], wall - e.record.history[-1].time_unix)
                self._start(e, [self.workers[r] for r in ranks])

    def _note_waits(self, waiting: dict[str, Entry]) -> None:
        """Note, and log once, why a job waits that needs more workers than are registered of its device
        (gpipe.coordinator.supervisor.pool.short_of: the pool may grow)."""
        cuda = sum(w.device.startswith("cuda") for w in self.workers.values())
        for e in waiting.values():
            with self._own_trouble(e):
                registered = cuda if e.job_spec.device == "cuda" else len(self.workers) - cuda
                note = pool.short_of(e.topology.world, registered, self.limits)
                if note != e.waiting:
                    e.waiting = note
                    if note:
                        self._log(e, note)

    def _start(self, e: Entry, placed: list[Worker]) -> None:
        """An attempt of `e` on `placed` (by slot), at the shape of their count: the one it waited at, a smaller
        one the pool shrank it to (`_shrink`), or its spec's, grown back onto workers the pool left free."""
        job = e.record
        spec_top = e.job_spec.topology
        top = elastic.shape_for(e.job_spec, len(placed))
        if top is None or top.world != len(placed):
            raise ValueError(f"job {job.name!r} has no shape of {len(placed)} workers")
        if e.job_spec.device == "cuda" and (why := shared_gpu(placed)):
            job.exit_code, job.error = EXIT_BAD_INPUT, why  # no attempt could start: never waits
            self._set_state(e, JobState.FAILED, why)
            return
        e.shape = None if top == spec_top else top
        e.waiting, e.yielded_to = "", ""
        attempt = Attempt(uuid.uuid4().hex[:12], job.name, [w.rank for w in placed], top)
        for w in placed:
            w.attempt_id = attempt.id
        self.attempts[job.name] = attempt
        self._spawn(self._run(e, attempt))

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
