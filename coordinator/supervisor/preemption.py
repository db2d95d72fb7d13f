"""The supervisor's preemptions: an attempt asked to stop at its next step boundary with a checkpoint, no failure."""

from __future__ import annotations

from gpipe.coordinator.attempt import report
from gpipe.coordinator.supervisor.records import Attempt, Entry
from gpipe.coordinator.supervisor.registry import Registry
from gpipe.service.job_records import JobState


class Preemption(Registry):
    """A leaving worker's (SIGTERM), serve's or run's: a checkpoint at the next step boundary, then PREEMPTED."""

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
        then = "" if self.draining else f"; resuming once {spec.topology.describe_ranks()} are back"
        self._set_state(e, JobState.PREEMPTED, f"{attempt.preempt}; {saved}{then}")
