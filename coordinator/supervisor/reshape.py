"""The pool's view of the supervisor (what gpipe.coordinator.supervisor.pool decides on), and the elastic moves it
decides: a job started on fewer workers than it waited for, and one grown back at a checkpoint."""

from __future__ import annotations

from collections.abc import Mapping

from gpipe.coordinator.plan import elastic
from gpipe.coordinator.supervisor import policy, pool
from gpipe.coordinator.supervisor.preemption import Preemption
from gpipe.coordinator.supervisor.records import COMMIT_GRACE_S, Attempt, Entry, Worker
from gpipe.service.job_records import JobRecord, JobState
from gpipe.topology import Topology

WAITS = (JobState.PENDING, JobState.RESTARTING, JobState.PREEMPTED)  # the states of a job waiting for workers


class Reshape(Preemption):
    """The pool's decision on the supervisor's state; elastic jobs re-planned onto the workers that remain, and
    grown back to the spec's shape at a checkpoint, as it decides."""

    def _waiting(self) -> dict[str, Entry]:
        """The jobs waiting for workers now (PENDING, RESTARTING, PREEMPTED, past their backoff), by name."""
        now = self.clock.monotonic()
        return {name: e for name, e in self.jobs.items()
                if e.record.state in WAITS and name not in self.attempts and now >= e.not_before}

    def _decide(self, waiting: Mapping[str, Entry]) -> tuple[list[pool.Waiting], pool.Decision]:
        """The `waiting` jobs as the pool's policy sees them, and its decision on the supervisor's state now
        (gpipe.coordinator.supervisor.pool.decide). Nothing changes here: `schedule` carries the decision out,
        and a shrunk job's checkpoint reads whether it grows."""
        seq = {name: i for i, name in enumerate(self.jobs)}
        idle = {r: w for r, w in self.workers.items() if w.attempt_id is None and not w.leaving}
        running = [pool.Running(a.job, self._priority(a.job), seq.get(a.job, 0), tuple(a.ranks), bool(a.preempt),
                                self._sizes(self.jobs[a.job]) if a.job in self.jobs else ())
                   for a in self.attempts.values()]
        wall = self.clock.time()
        asks = []
        for name, e in waiting.items():
            spec, job = e.job_spec, e.record
            began = waiting_since(job)
            away = wall - job.history[-1].time_unix if job.history else 0.0
            shrink = job.state != JobState.PENDING and policy.Action.SHRINK in policy.when_away(
                spec, job.state == JobState.PREEMPTED, away, bool(e.yielded_to))
            asks.append(pool.Waiting(name, spec.priority, seq[name], e.topology.world,
                                     0.0 if began is None else wall - began, self._sizes(e), shrink))

        def prefer(ask: pool.Waiting) -> list[int]:
            e = self.jobs[ask.name]
            return e.last_ranks or list(e.job_spec.topology.ranks())

        def fits(job: pool.Waiting | pool.Running, workers: Mapping[int, Worker]) -> dict[int, Worker]:
            return self._fits(self.jobs[job.name], workers)

        return asks, pool.decide(asks, idle, running, prefer, fits, lambda w: w.host, self.workers, self.limits)

    def _fits(self, e: Entry, workers: Mapping[int, Worker]) -> dict[int, Worker]:
        """Those of `workers` that may take `e`: of its device (cpu, or cuda), heard from since its last failure."""
        cuda = e.job_spec.device == "cuda"
        return {r: w for r, w in workers.items() if w.last_seen > e.failed_at and w.device.startswith("cuda") == cuda}

    def _sizes(self, e: Entry) -> tuple[int, ...]:
        """The sizes an elastic job may run at, largest first (gpipe.coordinator.plan.elastic.shapes); () if not."""
        if e.spec is None or e.spec.elastic is None:
            return ()
        return tuple(t.world for t in elastic.shapes(e.spec))

    def _priority(self, name: str) -> int:
        e = self.jobs.get(name)
        return e.job_spec.priority if e is not None and e.spec is not None else 0

    def _shrinkable(self, e: Entry) -> bool:
        """Whether the workers that may take `e` carry a smaller shape of it (pool.shrink_to): an elastic job
        away past restart_timeout_s is then re-planned onto them at its turn (`schedule`), not failed."""
        available = len(self._fits(e, self._ready(e)))
        return pool.shrink_to(self._sizes(e), e.topology.world, available) is not None

    def _shrink(self, e: Entry, size: int, waited: float) -> None:
        """The pool starts `e` on `size` workers, fewer than it waited for: re-plan it onto the shape of that
        size (elastic), saying why. `waited`: since its last state change."""
        spec, job = e.job_spec, e.record
        top = elastic.shape_for(spec, size)
        if top is None or top.world != size:
            raise ValueError(f"job {job.name!r} has no shape of {size} workers")
        change = shape_change(e.topology, top)
        resuming = f"resuming from {self._from(job)} on {elastic.describe(top)}"
        if e.yielded_to:  # preempted for a job of higher priority: it runs on the workers left rather than wait
            e.shape = top
            self._set_state(e, JobState.PREEMPTED, f"{change}: job {e.yielded_to} holds its other workers; "
                                                   f"{resuming} until they are free")
            return
        ready = self._ready(e)
        was = e.last_ranks or e.topology.ranks()  # none yet: a restarted serve's job, last run at the spec's shape
        lost = [r for r in was if r not in self.workers] or [r for r in was if r not in ready]
        who = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}" if lost else "its workers"
        # Since the failure; for a restarted serve's job, since it began waiting.
        since = self.clock.monotonic() - e.failed_at if e.failed_at > float("-inf") else waited
        e.shape = top
        self._set_state(e, JobState.RESTARTING, f"{change}: {who} lost for {since:.0f} s, no spare worker; {resuming}")

    def _grow_back(self, e: Entry, attempt: Attempt, step: int) -> None:
        """At a checkpoint of a re-planned job: if the pool's decision grows it (its spec's shape placed on this
        attempt's workers and those the waiting jobs leave free), end the attempt (it has committed the
        checkpoint) so that the next runs at that shape."""
        spec = e.job_spec
        if e.shape is None or attempt.regrow or attempt.failure or attempt.stopped or step >= spec.steps:
            return
        waiting = {name: w for name, w in self._waiting().items() if w.spec is not None}
        if e.record.name not in self._decide(waiting)[1].grows:
            return
        attempt.regrow = True
        self._log(e, f"{shape_change(attempt.topology, spec.topology)}: enough workers are registered; ending this "
                     f"attempt at checkpoint step-{step}")
        self._kill(attempt, COMMIT_GRACE_S)


def waiting_since(job: JobRecord) -> float | None:
    """When the job began its present wait: the first of its newest states that wait (a note of a restarted serve
    or of a re-plan does not start it again); None when it does not wait."""
    began = None
    for change in reversed(job.history):
        if change.state not in WAITS:
            break
        began = change.time_unix
    return began


def shape_change(old: Topology, new: Topology) -> str:
    """'stage count 3 -> 2', 'replicas 2 -> 1', or both."""
    parts = [f"replicas {old.replicas} -> {new.replicas}"] if old.replicas != new.replicas else []
    if old.stages != new.stages:
        parts.append(f"stage count {old.stages} -> {new.stages}")
    return ", ".join(parts)
