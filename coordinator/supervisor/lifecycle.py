"""An attempt's life in the supervisor: launch it, follow its reports, and decide the job's next state."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

from gpipe.coordinator.attempt import report
from gpipe.coordinator.attempt.report import Placement
from gpipe.coordinator.plan import elastic
from gpipe.coordinator.supervisor import policy
from gpipe.coordinator.supervisor.records import (
    Attempt,
    Entry,
    Launch,
    describe_exit,
    final_loss,
)
from gpipe.coordinator.supervisor.reshape import Reshape, shape_change
from gpipe.errors import EXIT_BAD_INPUT, EXIT_FAILED
from gpipe.service.job_records import Abort, JobState, Join


@dataclass
class Ending:
    """How an attempt ended, as its reports and its process said."""

    done: bool = False  # it reported Done
    reported: report.Failed | None = None  # the failure it reported
    stopped_at: report.Preempted | None = None  # where it stopped, preempted, with a checkpoint
    code: int = -1  # its process's exit status


class Lifecycle(Reshape):
    """An attempt from its start to its end: launched, its reports followed, then the job's next state."""

    async def _run(self, e: Entry, attempt: Attempt) -> None:
        """Start `attempt`, follow its reports to its end, free its workers, and move the job on."""
        job, spec = e.record, e.job_spec
        job.attempts += 1
        resuming = job.state in (JobState.RESTARTING, JobState.PREEMPTED)
        top = attempt.topology
        shape = f" ({elastic.describe(top)} of the spec's {elastic.describe(spec.topology)})" if e.shape else ""
        self._set_state(e, JobState.RUNNING, f"attempt {job.attempts} ({attempt.id}) on ranks {attempt.ranks}"
                        + shape + (f", resuming from {self._from(job)}" if resuming else ""))
        e.last_ranks = list(attempt.ranks)
        end = Ending()
        try:
            placement = [Placement(w.host, w.device, w.cores, w.threads, w.rank, w.gpu.memory_bytes if w.gpu else 0)
                         for w in (self.workers[r] for r in attempt.ranks)]
            attempt.process = await self.launcher(Launch(
                job.name, attempt.id, job.attempts, e.spec_path, e.job_dir, placement, resume=not e.fresh,
                topology=e.shape))
            e.fresh = False
            if attempt.stopped or attempt.failure or attempt.preempt:
                attempt.process.kill()
            async for r in attempt.process.reports():
                self._follow(e, attempt, r, end)
            end.code = await attempt.process.wait()
            if (not end.done and end.stopped_at is None and attempt.failure is None
                    and not (attempt.stopped or attempt.regrow) and end.code != EXIT_BAD_INPUT):
                # A worker that died is the likelier cause: give its report a moment to arrive.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.grace_s):
                        await attempt.failed.wait()
        except Exception as ex:  # the launch itself failed (no such file, no memory): the attempt fails
            end.reported = report.Failed(f"the attempt could not start: {type(ex).__name__}: {ex}", EXIT_FAILED)
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
        self._next_state(e, attempt, end)

    def _follow(self, e: Entry, attempt: Attempt, r: report.Report, end: Ending) -> None:
        """One report of the attempt: its workers told to join, the job's figures, its log, or how it ended."""
        job, spec = e.record, e.job_spec
        if isinstance(r, report.Master):
            attempt.driving = True
            for slot, rank in enumerate(attempt.ranks):
                w = self.workers.get(rank)
                if w is not None and w.attempt_id == attempt.id:
                    # The worker's slot, and the attempt's count of workers.
                    w.commands.put_nowait(Join(attempt.id, r.address, slot, attempt.topology.world,
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
            end.reported = r
        elif isinstance(r, report.Done):
            end.done = True
        elif isinstance(r, report.Preempted):
            end.stopped_at = r

    def _next_state(self, e: Entry, attempt: Attempt, end: Ending) -> None:
        """The job's state after its attempt ended: STOPPED, RESTARTING to grow back, SUCCEEDED, PREEMPTED, or
        as a failure decides (`_failed`)."""
        job, spec = e.record, e.job_spec
        succeeded = end.done and end.code == 0
        if attempt.stopped:
            if end.stopped_at is not None and end.code == 0:
                job.checkpoint_step = max(job.checkpoint_step, end.stopped_at.step)
                saved = f"checkpoint step-{end.stopped_at.step} taken at the step boundary"
            else:
                saved = f"{self._from(job)} stands"
            self._set_state(e, JobState.STOPPED, f"stopped while running; {saved}")
        elif attempt.regrow and not succeeded:
            e.shape = None
            self._set_state(e, JobState.RESTARTING,
                            f"{shape_change(attempt.topology, spec.topology)}: enough workers are back; resuming "
                            f"from {self._from(job)} once {spec.topology.describe_ranks()} are free")
        elif succeeded:
            self._set_state(e, JobState.SUCCEEDED, f"{final_loss(job)}weights in "
                                                   f"{Path(job.output_dir) / 'model.safetensors'}")
        elif attempt.preempt and not policy.hopeless(end.reported, end.code):
            self._preempted(e, attempt, end.stopped_at if end.code == 0 else None)
        else:
            self._failed(e, attempt, end.reported, end.code)

    def _failed(self, e: Entry, attempt: Attempt, reported: report.Failed | None, code: int) -> None:
        """Restart the job, or fail it, as gpipe.coordinator.supervisor.policy decides from the failure's fields."""
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
                            f"{wait}: resuming from {self._from(job)} once {spec.topology.describe_ranks()} are back")
            return
        job.exit_code = decision.exit_code
        if bad_input:
            self._set_state(e, JobState.FAILED, message)
        elif decision.hopeless:
            self._set_state(e, JobState.FAILED, f"{message} (not restarted: {decision.hopeless})")
        else:
            gave_up = f" (gave up after {job.restarts} restarts; the last failure: {message})" if job.restarts else ""
            self._set_state(e, JobState.FAILED, f"{job.error}{gave_up}")
