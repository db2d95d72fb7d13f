"""The supervisor's state machine, in process: a fake clock, fake workers and scripted attempt processes.

The real path (attempt processes, local workers, daemons over gRPC) is
tested end to end in test_failures, test_resume and test_service; here each
decision is checked alone and fast: registration, loss, restart, backoff,
stop, resume, bad input.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from gpipe.contract import Cause
from gpipe.coordinator.attempt import report
from gpipe.coordinator.supervisor.jobs import STOP_CHECKPOINT_S
from gpipe.coordinator.supervisor.policy import SPACE_WAIT_S, backoff_s
from gpipe.coordinator.supervisor.registry import RankTaken
from gpipe.service.job_records import Abort, JobRecord, JobState, Join
from tests.support.harness import FakeAttempt, Harness


def raised(message: str, rank: int, step: int | None, cause: Cause = Cause.RAISED,
           error_type: str = "ValueError") -> report.Failed:
    """What an attempt reports when stage `rank` (of 2, one replica) raised at `step`."""
    return report.Failed(message, 1, cause, rank, rank % 2, rank // 2, step, error_type)


async def test_a_job_starts_once_every_rank_is_registered_and_succeeds(h):
    job = h.submit()
    h.register(0)
    await h.settle()
    assert job.state == JobState.PENDING and not h.attempts
    h.register(1)
    await h.settle()
    assert job.state == JobState.RUNNING and len(h.attempts) == 1
    a = h.attempts[0]
    assert a.launch.resume  # serve's jobs always resume (a new one finds no checkpoint)
    a.queue.put_nowait(report.Master("127.0.0.1:1234", "0" * 32))
    await h.settle()
    joins = [c for r in (0, 1) for c in h.commands(r)]
    assert [(j.rank, j.master) for j in joins if isinstance(j, Join)] == [(0, "127.0.0.1:1234"),
                                                                          (1, "127.0.0.1:1234")]
    a.queue.put_nowait(report.Metrics({"step": 3, "loss": 0.5}))
    a.end(0, report.Done())
    await h.settle()
    assert job.state == JobState.SUCCEEDED and job.steps_done == 4 and job.attempts == 1
    assert all(w.attempt_id is None for w in h.workers.values())
    assert all(isinstance(c, Abort) for r in (0, 1) for c in h.commands(r))


async def test_a_dead_worker_process_fails_the_attempt_and_the_job_restarts_when_its_ranks_are_back(h):
    job = h.submit()
    h.register(0, 1)
    await h.settle()
    first = h.attempts[0]
    assert h.sup.heartbeat(h.workers[1].id, first.launch.attempt_id, True, -9, "RuntimeError: boom")
    await h.settle()
    assert first.killed
    assert job.state == JobState.RESTARTING and job.failed_rank == 1 and job.restarts == 1
    assert "stage 1's worker process died (signal SIGKILL): RuntimeError: boom" in job.error
    # Workers not heard from since the failure do not count as back.
    await h.settle()
    assert len(h.attempts) == 1
    h.clock.advance(0.1)
    h.beat(0, 1)
    await h.settle()
    assert job.state == JobState.RUNNING and len(h.attempts) == 2
    assert h.attempts[1].launch.resume and h.attempts[1].launch.number == 2


async def test_restarts_back_off_and_are_bounded(h):
    assert [backoff_s(n) for n in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 4.0]
    job = h.submit(max_restarts=2)
    h.register(0, 1)
    for n in range(3):
        h.clock.advance(0.1 + backoff_s(n))
        h.beat(0, 1)
        await h.settle()
        assert len(h.attempts) == n + 1, n
        h.attempts[-1].end(1, raised(f"stage 0 failed at step {n}: ValueError: x", rank=0, step=n))
        await h.settle()
        if n == 1:  # the second restart waits for its backoff
            h.clock.advance(0.5)
            h.beat(0, 1)
            await h.settle()
            assert len(h.attempts) == 2 and job.state == JobState.RESTARTING
    assert job.state == JobState.FAILED and job.restarts == 2 and job.exit_code == 1
    last = job.history[-1].message
    assert last.startswith("stage 0 failed at step 0") and "gave up after 2 restarts" in last


async def test_bad_input_fails_at_once_without_a_restart(h):
    job = h.submit()
    h.register(0, 1)
    await h.settle()
    h.attempts[0].end(2, report.Failed("checkpoint step-4 does not fit the model", 2))
    await h.settle()
    assert job.state == JobState.FAILED and job.restarts == 0 and job.exit_code == 2


async def test_a_silent_worker_is_dropped_and_all_silent_workers_are_named_together(h):
    job = h.submit()
    h.register(0, 1)
    await h.settle()
    h.clock.advance(11)
    h.beat(0)
    h.sup.tick()
    await h.settle()
    assert job.state == JobState.RESTARTING and job.failed_rank == 1
    assert "missed its heartbeats" in job.error and 1 not in h.sup.workers
    assert h.commands(1)[-1] is None  # its command stream ends

    other = Harness()
    job2 = other.submit()
    other.register(0, 1)
    await other.settle()
    other.clock.advance(11)
    other.sup.tick()
    await other.settle()
    assert job2.state == JobState.RESTARTING and "all 2 workers missed their heartbeats" in job2.error


async def test_a_restarting_job_fails_when_its_ranks_stay_away(h):
    job = h.submit(restart_timeout_s=30)
    h.register(0, 1)
    await h.settle()
    h.sup.drop(h.workers[1], "stage 1's worker disconnected")
    await h.settle()
    assert job.state == JobState.RESTARTING
    h.clock.advance(31)
    h.beat(0)
    h.sup.tick()
    assert job.state == JobState.FAILED and "rank(s) 1 did not come back" in job.history[-1].message


async def test_stop_and_resume(h):
    job = h.submit()
    h.register(0, 1)
    await h.settle()
    await h.sup.stop("j")
    await h.settle()
    assert job.state == JobState.STOPPED and h.attempts[0].killed
    assert all(w.attempt_id is None for w in h.workers.values())
    h.sup.resume("j")
    with pytest.raises(ValueError):  # only a FAILED or STOPPED job resumes
        h.sup.resume("j")
    h.clock.advance(0.1)
    h.beat(0, 1)
    await h.settle()
    assert job.state == JobState.RUNNING and h.attempts[1].launch.resume
    pending = h.submit("k")
    await h.sup.stop("k")
    assert pending.state == JobState.STOPPED



async def test_stop_checkpoints_a_driving_attempt_at_the_step_boundary(h):
    job = h.submit()
    a = await started(h, job)
    stopping = asyncio.ensure_future(h.sup.stop("j"))
    await h.settle()
    assert a.preempted and not a.killed and not stopping.done()  # asked for the step boundary's checkpoint
    a.end(0, report.Preempted(3))
    await h.settle()
    await stopping
    assert job.state == JobState.STOPPED and job.checkpoint_step == 3
    assert "checkpoint step-3 taken at the step boundary" in job.history[-1].message
    h.sup.resume("j")
    assert "resuming from checkpoint step-3" in job.history[-1].message


async def test_stop_kills_an_attempt_whose_step_outlasts_the_wait(h):
    job = h.submit()
    a = await started(h, job)
    stopping = asyncio.ensure_future(h.sup.stop("j"))
    await h.settle()
    h.clock.advance(STOP_CHECKPOINT_S + 1)
    await h.settle()
    await stopping
    assert a.preempted and a.killed
    assert job.state == JobState.STOPPED and "the last good checkpoint stands" in job.history[-1].message

async def test_a_rank_held_by_a_live_worker_is_refused_and_its_attempt_runs_on(h):
    job = h.submit()
    h.register(0, 1)
    await h.settle()
    holder = h.workers[1]
    h.clock.advance(4)
    with pytest.raises(RankTaken, match=r"rank 1 is held by a live worker on host, heard from 4.0s ago: "
                                        r"it is dropped if silent 6.0s more"):
        h.sup.register(1, "10.9.9.9", "cpu", "rogue")
    await h.settle()
    assert job.state == JobState.RUNNING and h.sup.workers[1] is holder and not h.attempts[0].killed
    assert h.commands(1) == []  # nothing reached the holder

    # Silent past the timeout, the holder is replaced (a restarted daemon whose old stream was never closed).
    h.clock.advance(7)
    h.register(1)
    await h.settle()
    assert h.sup.workers[1] is not holder
    assert job.state == JobState.RESTARTING and "stage 1's worker was replaced after 11s of silence" in job.error


# -- failures a restart cannot fix, bad state, bounded memory ----------------------------------


async def test_the_same_error_at_the_same_step_twice_fails_without_more_restarts(h):
    job = h.submit(max_restarts=5)
    h.register(0, 1)
    for n in range(2):
        h.clock.advance(0.1 + backoff_s(n))
        h.beat(0, 1)
        await h.settle()
        assert len(h.attempts) == n + 1
        # The message differs (an address, a count): the fields are what repeat.
        h.attempts[-1].end(1, raised(f"stage 1 (layer 2) failed at step 3: ValueError: bad {n}", rank=1, step=3))
        await h.settle()
    assert job.state == JobState.FAILED and job.restarts == 1 and job.exit_code == 1
    assert job.failed_rank == 1 and "not restarted" in job.history[-1].message


async def test_a_different_error_each_time_keeps_restarting(h):
    job = h.submit(max_restarts=5)
    h.register(0, 1)
    for n in range(2):
        h.clock.advance(0.1 + backoff_s(n))
        h.beat(0, 1)
        await h.settle()
        h.attempts[-1].end(1, raised("stage 1 failed at step 3: ValueError: bad", rank=1, step=n))
        await h.settle()
    assert job.state == JobState.RESTARTING and job.restarts == 2


@pytest.mark.parametrize("other", [{"rank": 0}, {"error_type": "KeyError"}, {"cause": Cause.TIMEOUT},
                                   {"cause": Cause.PEER}])
async def test_the_same_message_twice_is_not_the_same_failure_unless_its_fields_are(h, other):
    # Same text each time; another rank, exception type or cause is another failure (and a timeout or a
    # lost neighbour at the same step twice may be the network's: restarted).
    job = h.submit(max_restarts=5)
    h.register(0, 1)
    failures = [raised("stage 1 failed at step 3: ValueError: bad", rank=1, step=3),
                raised("stage 1 failed at step 3: ValueError: bad", **({"rank": 1, "step": 3} | other))]
    if "cause" in other:
        failures = failures[1:] * 2
    for n, f in enumerate(failures):
        h.clock.advance(0.1 + backoff_s(n))
        h.beat(0, 1)
        await h.settle()
        h.attempts[-1].end(1, f)
        await h.settle()
    assert job.state == JobState.RESTARTING and job.restarts == 2


@pytest.mark.parametrize("cause", [Cause.DISK, Cause.IMPORT, Cause.INPUT])
async def test_a_disk_import_or_input_failure_fails_at_once(h, cause):
    job = h.submit(max_restarts=5)
    h.register(0, 1)
    await h.settle()
    h.attempts[0].end(1, report.Failed(f"a {cause} failure", 1, cause))
    await h.settle()
    assert job.state == JobState.FAILED and job.restarts == 0 and job.exit_code == 1
    assert "not restarted" in job.history[-1].message
    assert all(w.attempt_id is None for w in h.workers.values())


def test_a_failure_crosses_the_attempts_pipe_as_fields():
    from gpipe.contract import StageError
    from gpipe.errors import JobFailed

    err = StageError.of(ModuleNotFoundError("No module named 'mymodels'"), None, 3)
    err.rank, err.stage, err.replica = 3, 1, 1  # as a stage of replica 1 of 2-stage pipelines says it
    f = report.Failed.of(JobFailed("stage 1 of replica 1 (layers 2-3) failed while building its stage: "
                                   f"{err.line()}", error=err))
    assert (f.cause, f.rank, f.stage, f.replica, f.step, f.error_type) == \
        (Cause.IMPORT, 3, 1, 1, 3, "ModuleNotFoundError")
    back = report.decode(report.encode(f))
    assert back == f and back.error() is not None and back.error().same_as(err)
    # A cause the supervisor does not know is no failure it could decide by: the line is a Log.
    assert isinstance(report.decode(report.encode(f).replace('"import"', '"cosmic"')), report.Log)
    # No stage to blame: no rank, and the cause still says why.
    f = report.Failed.of(JobFailed("checkpoint: writing /x: No space left on device (ENOSPC)", cause=Cause.DISK))
    assert (f.cause, f.rank, f.stage) == (Cause.DISK, None, None)


async def test_a_lost_worker_is_blamed_by_rank_stage_and_replica(h):
    job = h.submit(stages=1, replicas=2)
    h.register(0, 1)
    await h.settle()
    attempt = h.sup.attempts["j"]
    h.sup.drop(h.workers[1], "lost")
    assert attempt.failure is not None
    assert (attempt.failure.cause, attempt.failure.rank, attempt.failure.stage, attempt.failure.replica) == \
        (Cause.PEER, 1, 0, 1)
    await h.settle()
    assert job.state == JobState.RESTARTING and job.failed_rank == 1


class FullDisk:
    def __init__(self, code: int = errno.ENOSPC) -> None:
        self.full, self.code = False, code

    def save(self, job: JobRecord) -> None:
        if self.full:
            raise OSError(self.code, os.strerror(self.code), f"{job.output_dir}/job.json")


async def test_a_record_that_cannot_be_saved_fails_its_job_frees_the_workers_and_resumes_once_it_can(h):
    h.sup.store = disk = FullDisk(errno.EIO)
    job = h.submit()
    h.register(0, 1)
    await h.settle()
    a = h.attempts[0]
    disk.full = True
    a.queue.put_nowait(report.Checkpoint(2, "/x/step-2", 10, 0.1, 0.0))  # saving the record fails
    await h.settle()
    assert a.killed and job.state == JobState.FAILED and job.restarts == 0
    assert "job.json" in job.error and "EIO" in job.error
    assert all(w.attempt_id is None for w in h.workers.values())
    other = h.submit("other", stages=1)  # the workers serve the next job
    await h.settle()
    assert other.state == JobState.FAILED  # its record cannot be saved either: failed, not stuck
    disk.full = False
    h.sup.resume("j")
    h.clock.advance(0.1)
    h.beat(0, 1)
    await h.settle()
    assert job.state == JobState.RUNNING and len(h.attempts) == 2


async def test_a_worker_that_replaces_one_of_an_ending_attempt_is_kept_for_it_until_it_has_ended(h):
    h.submit("a", stages=2)
    h.register(0, 1, 2)
    await h.settle()
    first = h.attempts[0]
    first.kill = lambda grace_s=0.0: None  # it commits its checkpoint within the grace: not ended yet
    h.submit("b", stages=2)
    h.clock.advance(h.sup.heartbeat_timeout + 1)
    h.beat(0, 2)
    h.register(1)  # rank 1's worker came back as a new process: the old one is replaced, attempt a fails
    await h.settle()
    assert first.launch.job == "a" and len(h.attempts) == 1  # b does not take the new rank 1 (nor rank 2 with it)
    assert h.workers[1].attempt_id is not None and h.sup.attempts["a"].id == h.workers[1].attempt_id
    first.end(-9)
    await h.settle()
    assert any(isinstance(c, Abort) for c in h.commands(1))  # freed with an Abort of a's attempt
    assert len(h.attempts) == 2  # and only now does the next attempt take it


async def test_a_full_disk_restarts_the_job_after_a_wait_and_it_resumes_by_itself_once_there_is_room(h):
    h.sup.store = disk = FullDisk(errno.ENOSPC)
    job = h.submit(max_restarts=5)
    h.register(0, 1)
    await h.settle()
    a = h.attempts[0]
    disk.full = True
    a.queue.put_nowait(report.Checkpoint(2, "/x/step-2", 10, 0.1, 0.0))  # saving the record fails
    await h.settle()
    # Restarting, in memory (the record cannot be written): never FAILED, its workers freed.
    assert a.killed and job.state == JobState.RESTARTING and job.restarts == 1
    assert "ENOSPC" in job.history[-1].message and "job.json" in job.history[-1].message
    assert all(w.attempt_id is None for w in h.workers.values())
    h.clock.advance(SPACE_WAIT_S - 0.5)
    h.beat(0, 1)
    await h.settle()
    assert len(h.attempts) == 1  # it waits for room to be made
    disk.full = False
    h.clock.advance(1.0)
    h.beat(0, 1)
    await h.settle()
    assert job.state == JobState.RUNNING and len(h.attempts) == 2 and job.restarts == 1


async def test_a_job_whose_bookkeeping_raises_fails_alone_and_the_scheduler_goes_on(h):
    bad = h.submit("bad")
    h.sup.jobs["bad"].spec = None  # what a record that no longer parses would look like, were it queued
    good = h.submit("good")
    h.register(0, 1)
    await h.settle()
    assert bad.state == JobState.FAILED and "internal error" in bad.error
    assert good.state == JobState.RUNNING


async def test_an_unreadable_record_is_listed_never_runs_and_cannot_be_resumed(h):
    broken = JobRecord(name="old", spec_yaml="", steps=0, state=JobState.FAILED, error="unreadable job record",
                       output_dir="/nonexistent/old")
    h.sup.add(broken, None, Path("job.yaml"), Path("."))
    h.register(0, 1)
    await h.settle()
    assert not h.attempts and "old" in h.sup.jobs
    with pytest.raises(ValueError, match="no readable record"):
        h.sup.resume("old")


async def test_events_are_a_bounded_window_and_watch_reads_older_metrics_from_disk(h, tmp_path, monkeypatch):
    import json

    from gpipe.coordinator.supervisor import records
    monkeypatch.setattr(records, "EVENT_WINDOW", 10)
    job = h.submit()
    job.output_dir = str(tmp_path)
    h.register(0, 1)
    await h.settle()
    a = h.attempts[0]
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for s in range(30):
            m = {"step": s, "loss": 1.0 / (s + 1)}
            f.write(json.dumps(m) + "\n")
            a.queue.put_nowait(report.Metrics(m))
    await h.settle()
    e = h.sup.jobs["j"]
    assert len(e.events) == 10 and e.older == 20  # steps 0-19 (dropped states are in the history)
    a.end(0, report.Done())
    await h.settle()
    steps = [ev[1]["step"] async for ev in h.sup.watch("j") if ev[0] == "metrics"]
    assert steps == list(range(30))
    states = [ev[1].state for ev in [x async for x in h.sup.watch("j")] if ev[0] == "state"]
    assert states == [JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED]


async def test_a_lost_stream_while_every_worker_is_silent_blames_the_coordinators_link(h):
    job = h.submit()
    h.register(0, 1)
    await h.settle()
    h.clock.advance(4)  # nobody heard from for 4 s: then stage 0's stream ends
    h.sup.drop(h.workers[0], "stage 0's worker disconnected")
    await h.settle()
    assert "all 2 workers missed their heartbeats" in job.error and "coordinator may be cut off" in job.error

    other = Harness()
    job = other.submit()
    other.register(0, 1)
    await other.settle()
    other.clock.advance(4)
    other.beat(1)  # stage 1 is heard from: only stage 0 is lost
    other.sup.drop(other.workers[0], "stage 0's worker disconnected")
    await other.settle()
    assert job.error.startswith("stage 0's worker disconnected")


async def test_a_watcher_that_stops_reading_holds_a_bounded_queue(h, monkeypatch):
    from gpipe.coordinator.supervisor import jobs
    monkeypatch.setattr(jobs, "WATCH_QUEUE", 5)
    h.submit()
    h.register(0, 1)
    await h.settle()
    stalled = h.sup.watch("j")
    first = await anext(stalled)  # a client that read one event, then stopped reading
    assert first[0] == "state"
    a = h.attempts[0]
    for s in range(50):
        a.queue.put_nowait(report.Metrics({"step": s, "loss": 1.0}))
    await h.settle()
    (q,) = h.sup.jobs["j"].watchers
    assert q.qsize() == 5 and q.get_nowait()[1]["step"] == 45  # the newest five are kept
    await stalled.aclose()


async def test_an_attempt_process_that_dies_without_a_report_is_named_by_its_last_words(h):
    job = h.submit(max_restarts=0)
    h.register(0, 1)
    await h.settle()
    h.attempts[0].words = "RuntimeError: what(): std::bad_alloc"
    h.attempts[0].end(-6)
    await h.settle()
    assert job.state == JobState.FAILED
    assert job.error == "the attempt process died (signal SIGABRT): RuntimeError: what(): std::bad_alloc"


def test_last_words_are_read_from_the_end_of_a_real_log(tmp_path):
    from gpipe.proc import last_error_line

    log = tmp_path / "coordinator.log"
    log.write_text("x" * 200_000 + "\nValueError: an old one\nTraceback (most recent call last):\n"
                   '  File "a.py", line 1\nMemoryError: the last one\n[W1123 socket.cpp] a warning\n')
    assert last_error_line(log) == "MemoryError: the last one"
    assert last_error_line(tmp_path / "missing.log") == "" and last_error_line(None) == ""


async def started(h: Harness, job: JobRecord) -> FakeAttempt:
    """The job's attempt, driving its stages (it reported Master)."""
    h.register(0, 1)
    await h.settle()
    a = h.attempts[-1]
    a.queue.put_nowait(report.Master("127.0.0.1:1234", "0" * 32))
    await h.settle()
    assert job.state == JobState.RUNNING
    return a


async def test_a_preempted_worker_has_its_attempt_checkpoint_and_the_job_waits_preempted_for_the_rank(h):
    job = h.submit(restart_timeout_s=5)
    a = await started(h, job)
    assert h.sup.preempt_worker(h.workers[1].id, 25.0) is True
    assert a.preempted and not a.killed  # asked to stop at the next step boundary, not killed
    a.queue.put_nowait(report.Checkpoint(3, "/x/step-3", 10, 0.1, 0.0))
    a.end(0, report.Preempted(3))
    await h.settle()
    assert job.state == JobState.PREEMPTED and job.checkpoint_step == 3 and job.restarts == 0
    assert "stage 1's worker was preempted (SIGTERM); checkpoint step-3" in job.history[-1].message
    # The leaving worker gets no attempt, though it is still registered and idle; nor does time fail the job.
    h.clock.advance(60)
    h.beat(0, 1)
    h.sup.tick()
    await h.settle()
    assert len(h.attempts) == 1 and job.state == JobState.PREEMPTED
    h.sup.drop(h.workers[1], "stage 1's worker disconnected")  # the daemon exits
    h.register(1)  # and comes back
    h.beat(0)
    await h.settle()
    assert job.state == JobState.RUNNING and len(h.attempts) == 2 and h.attempts[1].launch.resume
    assert h.sup.preempt_worker("nosuchworker", 25.0) is None


async def test_a_preemption_whose_checkpoint_misses_the_grace_falls_back_to_the_last_good_one(h):
    job = h.submit()
    a = await started(h, job)
    job.checkpoint_step = 2
    h.sup.preempt_worker(h.workers[0].id, 5.0)
    h.clock.advance(4)
    h.beat(0, 1)
    h.sup.tick()
    assert not a.killed
    h.clock.advance(2)
    h.beat(0, 1)
    h.sup.tick()
    await h.settle()
    assert a.killed and job.state == JobState.PREEMPTED and job.restarts == 0
    last = job.history[-1].message
    assert "did not finish within the grace" in last and "falling back to checkpoint step-2" in last, last


async def test_an_attempt_preempted_before_it_drives_is_killed_and_a_disk_error_still_fails_the_job(h):
    job = h.submit()
    h.register(0, 1)
    await h.settle()
    h.sup.preempt_all("the coordinator is stopping (SIGTERM)", 25.0)
    await h.settle()
    assert h.attempts[0].killed and job.state == JobState.PREEMPTED  # nothing newer than its checkpoint to save
    h.beat(0, 1)
    await h.settle()
    assert len(h.attempts) == 1  # draining: nothing starts

    other = Harness()
    job2 = other.submit()
    a = await started(other, job2)
    other.sup.preempt_worker(other.workers[0].id, 25.0)
    a.end(1, report.Failed("checkpoint: writing /x: No space left on device (ENOSPC)", 1, Cause.DISK))
    await other.settle()
    assert job2.state == JobState.FAILED and "ENOSPC" in job2.history[-1].message


async def test_run_preempts_a_waiting_job_and_a_stop_ends_a_preempted_one(h):
    job = h.submit()
    h.sup.preempt_waiting("j", "run got SIGTERM")
    assert job.state == JobState.PREEMPTED and "run got SIGTERM while pending" in job.history[-1].message
    await h.sup.stop("j")
    assert job.state == JobState.STOPPED
