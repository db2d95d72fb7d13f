"""The supervisor's elastic moves: shrink a job whose ranks stay away, grow it back at a checkpoint."""

from __future__ import annotations

from gpipe.coordinator.plan import elastic
from gpipe.coordinator.supervisor.preemption import Preemption
from gpipe.coordinator.supervisor.records import COMMIT_GRACE_S, Attempt, Entry
from gpipe.service.job_records import JobState
from gpipe.topology import Topology


class Reshape(Preemption):
    """Elastic jobs: re-planned onto the workers that remain, grown back to the spec's shape at a checkpoint."""

    def _replan(self, e: Entry, waited: float) -> bool:
        """A restarting job whose ranks stayed away past restart_timeout_s: re-plan it onto the workers that
        remain (elastic), saying why. False: it is not elastic, or not even its min_stages fit."""
        spec, job = e.job_spec, e.record
        ready = self._ready(e)
        top = elastic.shape_for(spec, len(ready)) if spec.elastic is not None else None
        if top is None or top == e.topology or top.world > e.topology.world:
            return False
        change = shape_change(e.topology, top)
        resuming = f"resuming from {self._from(job)} on {elastic.describe(top)}"
        if e.yielded_to:  # preempted for a job of higher priority: it runs on the workers left rather than wait
            e.shape = top
            self._set_state(e, JobState.PREEMPTED, f"{change}: job {e.yielded_to} holds its other workers; "
                                                   f"{resuming} until they are free")
            return True
        was = e.last_ranks or e.topology.ranks()  # none yet: a restarted serve's job, last run at the spec's shape
        lost = [r for r in was if r not in self.workers] or [r for r in was if r not in ready]
        who = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}" if lost else "its workers"
        # Since the failure; for a restarted serve's job, since it began waiting.
        since = self.clock.monotonic() - e.failed_at if e.failed_at > float("-inf") else waited
        e.shape = top
        self._set_state(e, JobState.RESTARTING, f"{change}: {who} lost for {since:.0f} s, no spare worker; {resuming}")
        return True

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
        self._log(e, f"{shape_change(attempt.topology, spec.topology)}: enough workers are registered; ending this "
                     f"attempt at checkpoint step-{step}")
        self._kill(attempt, COMMIT_GRACE_S)


def shape_change(old: Topology, new: Topology) -> str:
    """'stage count 3 -> 2', 'replicas 2 -> 1', or both."""
    parts = [f"replicas {old.replicas} -> {new.replicas}"] if old.replicas != new.replicas else []
    if old.stages != new.stages:
        parts.append(f"stage count {old.stages} -> {new.stages}")
    return ", ".join(parts)
