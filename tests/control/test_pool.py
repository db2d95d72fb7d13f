"""The shared pool, in process: gpipe.coordinator.supervisor.pool's policy on its own (placement, order, backfill, starvation,
victims, refusals, the size an elastic job starts at, growing back), then the supervisor carrying it out on a fake clock (tests.support.harness): two jobs at once on four
workers, backfill, a priority job preempting a running one, and the preempted job resuming without a restart
counted (an elastic one at once, on fewer stages); a job larger than the pool, refused or waiting. Through real serve and worker processes: tests/service/test_pool.py."""

from __future__ import annotations

from gpipe.coordinator.attempt import report
from gpipe.coordinator.supervisor import pool
from gpipe.coordinator.supervisor.pool import Running, Waiting
from gpipe.service.job_records import JobState


def _decide(waiting, idle, running=(), prefer=None, starve=pool.STARVE_AFTER_S):
    hosts = idle if isinstance(idle, dict) else {r: "h" for r in idle}
    registered = {**hosts, **{k: "h" for r in running for k in r.ranks}}
    return pool.decide(waiting, hosts, running, prefer or (lambda w: []), lambda w, left: left,
                       lambda h: h, registered, pool.Limits(starve_after_s=starve))


def test_placement_takes_the_preferred_ranks_then_one_host_s_workers_together():
    idle = {0: "a", 1: "b", 2: "b", 3: "a", 5: "b"}
    assert pool.place(2, idle, [3, 0], lambda h: h) == [3, 0]
    assert pool.place(3, idle, [9, 1], lambda h: h) == [0, 1, 3]  # 1 as preferred, then one host's together
    assert pool.place(2, {0: "a", 1: "b", 2: "b"}, [], lambda h: h) == [1, 2]  # the host with more first
    assert pool.place(6, idle, [], lambda h: h) is None


def test_order_is_priority_then_submission():
    jobs = [Waiting("a", 0, 0, 1, 0), Waiting("b", 5, 2, 1, 0), Waiting("c", 5, 1, 1, 0), Waiting("d", -1, 3, 1, 0)]
    assert [w.name for w in pool.order(jobs)] == ["c", "b", "a", "d"]


def test_two_jobs_start_at_once_on_their_own_workers_and_a_small_one_backfills_past_a_large_one():
    d = _decide([Waiting("x", 0, 0, 2, 0), Waiting("y", 0, 1, 2, 0)], [0, 1, 2, 3])
    assert d.starts == {"x": [0, 1], "y": [2, 3]} and not d.preempts
    # A 4-worker job waits for workers that are busy; the 1-worker job after it starts beside it.
    d = _decide([Waiting("big", 0, 0, 4, 10.0), Waiting("small", 0, 1, 1, 0)], [2, 3],
                [Running("r", 0, 5, (0, 1))])
    assert d.starts == {"small": [2]} and d.blocked_by is None


def test_a_job_waiting_past_the_bound_stops_backfill_and_one_that_can_never_fit_does_not():
    running = [Running("r", 0, 5, (0, 1))]
    d = _decide([Waiting("big", 0, 0, 4, 601.0), Waiting("small", 0, 1, 1, 0)], [2, 3], running)
    assert d.starts == {} and d.blocked_by == "big"
    d = _decide([Waiting("huge", 0, 0, 9, 601.0), Waiting("small", 0, 1, 1, 0)], [2, 3], running)
    assert d.starts == {"small": [2]}  # 9 workers: more than the pool has, it holds nothing back


def test_the_pool_refuses_a_job_that_can_never_fit_its_known_size_and_it_holds_nothing_back():
    waiting = [Waiting("big", 5, 0, 8, 601.0), Waiting("small", 0, 1, 1, 0.0)]
    d = pool.decide(waiting, {0: "h", 1: "h"}, [], lambda w: [], lambda w, left: left, lambda h: h,
                    {0: "h", 1: "h"}, pool.Limits(max_workers=4))
    assert d.refuses == {"big": pool.never_fits("big", 8, pool.Limits(max_workers=4))}
    assert d.starts == {"small": [0]} and d.blocked_by is None
    # An elastic job that may start smaller now is refused only when not even its least size fits.
    flex = Waiting("flex", 0, 2, 8, 0.0, (8, 4, 2), shrink=True)
    d = pool.decide([flex], {0: "h", 1: "h", 2: "h"}, [], lambda w: [], lambda w, left: left, lambda h: h,
                    {0: "h", 1: "h", 2: "h"}, pool.Limits(max_workers=4))
    assert d.refuses == {} and d.starts == {"flex": [0, 1]} and d.shrinks == {"flex": 2}


def test_an_elastic_job_starts_smaller_only_once_it_may_shrink_and_at_the_largest_size_that_fits():
    sizes = (6, 3, 2)
    d = _decide([Waiting("flex", 0, 0, 6, 100.0, sizes)], [0, 1, 2, 3, 4])
    assert d.starts == {} and d.shrinks == {}  # not yet: it waits for its lost ranks
    d = _decide([Waiting("flex", 0, 0, 6, 100.0, sizes, shrink=True)], [0, 1, 2, 3, 4])
    assert d.starts == {"flex": [0, 1, 2]} and d.shrinks == {"flex": 3}
    # A higher-ordered job takes its workers first: the size is what is left.
    d = _decide([Waiting("first", 1, 1, 2, 0.0), Waiting("flex", 0, 0, 6, 100.0, sizes, shrink=True)],
                [0, 1, 2, 3, 4])
    assert d.starts == {"first": [0, 1], "flex": [2, 3, 4]} and d.shrinks == {"flex": 3}


def test_a_shrunk_job_grows_back_only_onto_workers_the_round_left_free():
    shrunk = Running("flex", 0, 0, (0, 1), sizes=(4, 2))
    d = _decide([], [2, 3], [shrunk])
    assert d.grows == {"flex": 4}
    # A waiting job takes one of the idle workers: too few are left to grow onto.
    d = _decide([Waiting("other", 0, 1, 1, 0.0)], [2, 3], [shrunk])
    assert d.starts == {"other": [2]} and d.grows == {}
    # A starved job that fits the pool keeps the idle workers for itself: nothing grows onto them.
    d = _decide([Waiting("big", 0, 1, 4, 601.0)], [2, 3], [shrunk])
    assert d.blocked_by == "big" and d.grows == {}
    # One being preempted does not grow; one starting shrunk grows at once onto what the others left.
    d = _decide([], [2, 3], [Running("flex", 0, 0, (0, 1), preempting=True, sizes=(4, 2))])
    assert d.grows == {}
    d = _decide([Waiting("flex", 0, 0, 2, 0.0, (4, 2)), Waiting("other", 0, 1, 1, 0.0)], [0, 1, 2, 3, 4])
    assert d.starts == {"flex": [0, 1, 3, 4], "other": [2]}


def test_a_higher_priority_job_preempts_the_fewest_lower_ones_and_no_more_while_they_stop():
    running = [Running("a", 0, 1, (0, 1)), Running("b", 0, 2, (2,)), Running("c", 5, 3, (3,))]
    d = _decide([Waiting("urgent", 3, 9, 2, 0), Waiting("later", 0, 10, 1, 0)], [], running)
    assert d.preempts == {"a": "urgent"} and d.starts == {} and d.blocked_by == "urgent"  # c's priority is higher
    stopping = [Running("a", 0, 1, (0, 1), preempting=True), *running[1:]]
    d = _decide([Waiting("urgent", 3, 9, 2, 0)], [], stopping)
    assert d.preempts == {}  # a's two workers are on their way
    d = _decide([Waiting("equal", 0, 9, 1, 0)], [], running)
    assert d.preempts == {}  # never a job of the same priority


async def started(h, job, *ranks):
    a = next(x for x in h.attempts if x.launch.job == job.name)
    a.queue.put_nowait(report.Master("127.0.0.1:1234", "0" * 32))
    await h.settle()
    return a


async def test_the_supervisor_runs_two_jobs_at_once_on_four_workers(h):
    x, y = h.submit("x"), h.submit("y")
    h.register(0, 1, 2, 3)
    await h.settle()
    assert x.state == y.state == JobState.RUNNING
    by_job = {a.launch.job: [p.rank for p in a.launch.placement] for a in h.attempts}
    assert by_job == {"x": [0, 1], "y": [2, 3]}


async def test_a_priority_job_preempts_a_running_one_which_resumes_after_without_a_restart(h):
    first, low = h.submit("first"), h.submit("low")
    h.register(0, 1, 2, 3)
    await h.settle()
    await started(h, first)
    a = await started(h, low)
    urgent = h.submit("urgent", priority=5)
    await h.settle()
    # Two running jobs of equal size and priority: the newest is stopped, at its next step boundary.
    assert urgent.state == JobState.PENDING and a.preempted and not a.killed
    a.queue.put_nowait(report.Checkpoint(2, "/x/step-2", 10, 0.1, 0.0))
    a.end(0, report.Preempted(2))
    await h.settle()
    assert low.state == JobState.PREEMPTED and low.restarts == 0
    assert "preempted by job urgent (priority 5)" in low.history[-1].message
    assert urgent.state == JobState.RUNNING and first.state == JobState.RUNNING
    u = next(x for x in h.attempts if x.launch.job == "urgent")
    assert sorted(p.rank for p in u.launch.placement) == sorted(p.rank for p in a.launch.placement)
    (await started(h, urgent)).end(0, report.Done())
    h.clock.advance(1)
    h.beat(0, 1, 2, 3)  # heard from since low stopped
    await h.settle()
    assert urgent.state == JobState.SUCCEEDED and low.state == JobState.RUNNING  # back, resuming
    assert low.attempts == 2 and low.restarts == 0 and h.attempts[-1].launch.resume


async def test_prometheus_shows_the_queue_by_priority_and_each_job_s_wait(h):
    from gpipe.coordinator.server.exporter import JobsCollector

    h.submit("a", priority=2)
    h.submit("b")
    h.submit("c")
    h.register(0, 1)
    await h.settle()  # a runs; b and c wait
    h.clock.advance(30)
    families = {m.name: m for m in JobsCollector(h.sup).collect()}
    queued = {s.labels["priority"]: s.value for s in families["gpipe_queue_jobs"].samples}
    assert queued == {"0": 2}
    waits = {s.labels["job"]: s.value for s in families["gpipe_queue_wait_seconds"].samples}
    assert waits == {"b": 30.0, "c": 30.0}
    busy = {s.labels["state"]: s.value for s in families["gpipe_workers"].samples}
    assert busy["busy"] == 2 and busy["idle"] == 0


async def test_the_queue_is_bounded_submit_says_busy_past_it(h, monkeypatch):
    import types

    from gpipe.coordinator.server import submissions

    monkeypatch.setattr(submissions, "MAX_QUEUED", 2)
    h.submit("a")
    fake = types.SimpleNamespace(sup=h.sup)
    submissions.Coordinator._room(fake)  # one waiting: room for more
    h.submit("b")
    try:
        submissions.Coordinator._room(fake)
    except submissions.Busy as e:
        assert "2 jobs wait for workers already (at most 2 queued)" in str(e)
    else:
        raise AssertionError("a third queued job was taken")
    h.register(0, 1)
    await h.settle()  # a starts: one waits
    submissions.Coordinator._room(fake)


def test_a_job_larger_than_a_known_pool_never_fits_and_one_larger_than_the_registered_workers_waits():
    assert pool.never_fits("big", 8, pool.Limits(max_workers=4)) == (
        "job 'big' needs 8 workers at once, and this pool has at most 4 (serve --max-workers 4)")
    assert pool.never_fits("big", 4, pool.Limits(max_workers=4)) is None
    assert pool.never_fits("big", 4096, pool.Limits()) is None  # the pool's size unknown: it may grow
    assert "needs 8 workers at once, 2 registered" in pool.short_of(8, 2, pool.Limits())
    assert pool.short_of(2, 2, pool.Limits()) == ""
    assert pool.short_of(8, 2, pool.Limits(max_workers=8)) == ""  # it fits: its workers are on their way


async def test_a_waiting_job_says_it_needs_more_workers_than_are_registered_until_they_join(h):
    big = h.submit("big", replicas=2)  # 4 workers
    h.register(0, 1)
    await h.settle()
    e = h.sup.jobs["big"]
    assert big.state == JobState.PENDING and "needs 4 workers at once, 2 registered" in e.waiting
    assert sum(ev == ("log", e.waiting) for ev in e.events) == 1  # said once in its log, not each round
    await h.settle()
    assert sum(ev[0] == "log" for ev in e.events) == 1
    h.register(2, 3)
    await h.settle()
    assert big.state == JobState.RUNNING and e.waiting == ""


async def test_a_queued_job_the_known_pool_can_never_fit_fails_at_once_and_is_not_resumed(h):
    big, small = h.submit("big", replicas=2), h.submit("small")
    h.sup.limits = pool.Limits(max_workers=2)  # as a serve restarted with a smaller --max-workers
    h.register(0, 1)
    await h.settle()
    assert big.state == JobState.FAILED and big.exit_code == 2 and "at most 2" in big.history[-1].message
    assert small.state == JobState.RUNNING
    try:
        h.sup.resume("big")
    except ValueError as ex:
        assert "serve --max-workers 2" in str(ex)
    else:
        raise AssertionError("a job the pool can never fit was queued again")
    assert big.state == JobState.FAILED


async def test_an_elastic_job_preempted_for_priority_resumes_at_once_on_the_workers_left_then_grows_back(h):
    from gpipe.topology import Topology

    flex = h.submit("flex", stages=4, elastic="{min_stages: 2}")
    h.register(0, 1, 2, 3)
    await h.settle()
    a = await started(h, flex)
    urgent = h.submit("urgent", priority=5)  # 2 workers
    await h.settle()
    assert a.preempted
    a.end(0, report.Checkpoint(1, "/x/step-1", 10, 0.1, 0.0), report.Preempted(1))
    await h.settle()
    assert urgent.state == JobState.RUNNING and flex.state == JobState.PREEMPTED
    h.clock.advance(1)
    h.beat(0, 1, 2, 3)  # heard from since flex stopped
    h.sup.tick()  # not restart_timeout_s (60 s) later: at once
    await h.settle()
    shrink = next(c.message for c in flex.history if "stage count 4 -> 2" in c.message)
    assert "job urgent" in shrink and flex.state == JobState.RUNNING and flex.restarts == 0
    b = h.attempts[-1]
    assert b.launch.topology == Topology(2, 1) and b.launch.resume
    u = next(x for x in h.attempts if x.launch.job == "urgent")
    assert not {p.rank for p in b.launch.placement} & {p.rank for p in u.launch.placement}
    # urgent ends; at flex's next checkpoint it grows back onto all four.
    (await started(h, urgent)).end(0, report.Done())
    await h.settle()
    await started(h, flex)
    b.queue.put_nowait(report.Checkpoint(2, "/x/step-2", 10, 0.1, 0.0))
    await h.settle()
    assert b.killed and h.attempts[-1].launch.job == "flex" and h.attempts[-1].launch.topology is None


def _by_device(waiting, devices: dict[int, str], busy: dict[int, str], running=(), wants=None):
    """decide() on workers of mixed devices: `devices` rank -> 'cpu' or 'cuda' for every registered worker,
    `busy` those running; `wants` job name -> the device it runs on."""
    idle = {r: d for r, d in devices.items() if r not in busy}
    return pool.decide(waiting, idle, running, lambda w: [],
                       lambda job, workers: {r: d for r, d in workers.items() if d == wants[job.name]},
                       lambda d: "h", devices)


def test_a_job_preempts_only_jobs_holding_workers_of_its_device():
    """Before the fix a CUDA job that cannot fit preempted CPU jobs whose workers it can never use, which then
    restarted on their CPU workers and were preempted again, forever."""
    devices = {0: "cuda", 1: "cpu", 2: "cpu"}
    cpu_job = Running("cpu-job", 0, 1, (1, 2))
    d = _by_device([Waiting("gpu-job", 5, 2, 2, 0.0)], devices, {1: "cpu", 2: "cpu"}, [cpu_job],
                   {"gpu-job": "cuda"})
    assert d.preempts == {} and d.starts == {}
    # A lower-priority job on the other GPU is a victim: its worker is one the waiting job can use.
    devices[3] = "cuda"
    gpu_low = Running("gpu-low", 0, 0, (3,))
    d = _by_device([Waiting("gpu-job", 5, 2, 2, 0.0)], devices, {1: "cpu", 2: "cpu", 3: "cuda"},
                   [cpu_job, gpu_low], {"gpu-job": "cuda"})
    assert d.preempts == {"gpu-low": "gpu-job"}
    assert pool.victims(Waiting("gpu-job", 5, 2, 2, 0.0), 1, [cpu_job, gpu_low], {0, 3}) == ["gpu-low"]
    assert pool.victims(Waiting("gpu-job", 5, 2, 3, 0.0), 1, [cpu_job, gpu_low], {0, 3}) is None


def test_a_starved_job_that_cannot_fit_its_device_holds_nothing_back():
    """A CUDA job needing 2 GPUs on a pool of 1 GPU and 2 CPU workers, past the starvation bound: a CPU job
    after it still starts (before the fix the bound compared with every worker, and it waited an hour)."""
    devices = {0: "cuda", 1: "cpu", 2: "cpu"}
    waiting = [Waiting("gpu-job", 0, 0, 2, pool.STARVE_AFTER_S + 1), Waiting("cpu-job", 0, 1, 1, 0.0)]
    d = _by_device(waiting, devices, {}, (), {"gpu-job": "cuda", "cpu-job": "cpu"})
    assert d.starts == {"cpu-job": [1]} and d.blocked_by is None
    # With a second GPU registered (busy), the starved job does hold the rest back, as the bound means.
    devices[3] = "cuda"
    busy = Running("other", 0, 9, (3,))
    d = _by_device(waiting, devices, {3: "cuda"}, [busy], {"gpu-job": "cuda", "cpu-job": "cpu"})
    assert d.starts == {} and d.blocked_by == "gpu-job"
