"""The pool's policy (gpipe.coordinator.supervisor.pool.decide), driven by a stateful property test: workers of
mixed devices join, leave and come back, jobs of mixed sizes, priorities, devices and elastic bounds are
submitted, fail, finish, are preempted, shrink and grow back, the pool's size is known or not (and changes when
serve restarts), and the clock runs; serve runs a round of decisions after every change, and after every step the
pool's invariants hold:

- no worker is in two attempts;
- an attempt holds only idle, registered workers of its own device, and its size is one its elastic bounds
  allow: the size it waited at, a smaller one only once it may shrink, its largest when it grows;
- a shrunk job grows back only onto workers the round left free;
- a preemption frees workers the waiting job can use (it is never of another device's jobs);
- a job that can never fit its device's workers holds nothing back, and is refused when the pool's size is known;
- no job waits past the starvation bound while it fits: it starts, else nothing after it starts, nor grows onto
  its device's workers;
- the first job in the order that fits the idle workers it may use starts;
- a job's state after a serve restart is its state before: its record written and read back through serve's job
  table (gpipe.coordinator.server.job_table) gives the supervisor the same waiting jobs, priorities, submission
  order and time waited, and the same next decision.

CI runs PROPERTY_EXAMPLES sequences (GPIPE_POOL_EXAMPLES raises it: bench/pool_model runs 10,000)."""

from __future__ import annotations

import collections
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpipe.coordinator.plan import elastic
from gpipe.coordinator.server.job_table import JobTable
from gpipe.coordinator.spec.job import JobSpec, parse_spec
from gpipe.coordinator.supervisor import pool
from gpipe.coordinator.supervisor.core import Supervisor
from gpipe.service.job_records import JobRecord, JobState, StateChange

PROPERTY_EXAMPLES = int(os.environ.get("GPIPE_POOL_EXAMPLES", "150"))
DEVICES = ("cpu", "cuda")
RANKS = 12  # at most this many workers
RESTART_TIMEOUT_S = 60.0
MAX_JOBS = 5  # waiting or running at once: a queue no longer than the pool can work through
WAITS = (JobState.PENDING, JobState.RESTARTING, JobState.PREEMPTED)


@dataclass
class Job:
    name: str
    spec: JobSpec
    record: JobRecord  # as serve keeps it: its states in order
    seq: int
    slots: int  # the size it waits at, or runs at
    sizes: tuple[int, ...]  # the sizes it may run at, largest first (gpipe.coordinator.plan.elastic): () if not elastic
    waited_from: float  # when it began its present wait
    away_from: float  # its last change of state: restart_timeout_s counts from it
    yielded: bool = False  # preempted for a job of higher priority, which holds its workers
    ranks: tuple[int, ...] = ()
    last: tuple[int, ...] = ()  # the workers of its last attempt, by slot
    preempting: bool = False

    def may_shrink(self, now: float) -> bool:
        """An elastic job away past restart_timeout_s, or preempted for another, may start smaller."""
        if not self.sizes or self.ranks or self.record.state not in (JobState.RESTARTING, JobState.PREEMPTED):
            return False
        return (self.record.state == JobState.PREEMPTED and self.yielded) or now - self.away_from > RESTART_TIMEOUT_S


@dataclass
class Round:
    """A decision and what it was decided on."""

    decision: pool.Decision
    jobs: dict[str, Job]  # as they were (copies)
    idle: dict[int, str]
    workers: dict[int, str]
    now: float
    waiting: list[pool.Waiting] = field(default_factory=list)


def spec_text(name: str, stages: int, replicas: int, priority: int, device: str, min_stages: int | None) -> str:
    return (f"name: {name}\nmodel: {{factory: mlp}}\ndata: {{factory: random_regression, batch_size: 8}}\n"
            f"optimizer: {{name: sgd, lr: 0.1}}\nsteps: 4\nstages: {stages}\nreplicas: {replicas}\nchunks: 2\n"
            f"priority: {priority}\ndevice: {device}\nrestart_timeout_s: {RESTART_TIMEOUT_S:.0f}\n"
            + (f"elastic: {{min_stages: {min_stages}}}\n" if min_stages is not None else ""))


@functools.cache
def parsed(text: str) -> JobSpec:
    return parse_spec(text)


class FrozenClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


async def no_launch(launch: object) -> object:
    raise AssertionError("a restarted serve's view of the pool starts nothing here")


class PoolModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0
        self.limits = pool.Limits()
        self.workers: dict[int, str] = {}  # rank -> device
        self.lost: dict[int, str] = {}  # workers lost, that may come back
        self.jobs: dict[str, Job] = {}
        self.ended: dict[str, JobRecord] = {}  # finished or refused: serve keeps their records
        self.seq = 0
        self.last: Round | None = None
        self.tally: collections.Counter[str] = collections.Counter()  # the decisions carried out (bench/pool_model)

    @initialize(size=st.none() | st.sampled_from(range(2, RANKS + 1)), cpus=st.integers(0, 8), gpus=st.integers(0, 4))
    def pool_size(self, size: int | None, cpus: int, gpus: int) -> None:
        """serve --max-workers N, or a pool whose size is not known; the workers registered first."""
        self.limits = pool.Limits(max_workers=size)
        devices = ["cpu"] * cpus + ["cuda"] * gpus
        self.workers = dict(enumerate(devices[:size]))

    # what happens to the pool

    def _set(self, j: Job, state: JobState, message: str = "") -> None:
        """A change of state, in the job's record as the supervisor writes it."""
        if state in WAITS and j.record.state not in WAITS:
            j.waited_from = self.clock
        j.record.state = state
        j.record.history.append(StateChange(state, self.clock, message))
        j.away_from = self.clock

    def _end_attempt(self, j: Job, state: JobState) -> None:
        j.ranks, j.preempting = (), False
        self._set(j, state)

    @rule(device=st.sampled_from(DEVICES), count=st.integers(1, 3), checkpoints=st.booleans())
    def register(self, device: str, count: int, checkpoints: bool) -> None:
        cap = RANKS if self.limits.max_workers is None else self.limits.max_workers
        for rank in [r for r in range(cap) if r not in self.workers][:count]:
            self.workers[rank] = device
        self._schedule(checkpoints)

    @precondition(lambda self: self.lost)
    @rule(data=st.data(), checkpoints=st.booleans())
    def rejoin(self, data: st.DataObject, checkpoints: bool) -> None:
        """A lost worker comes back (its pod restarted): the same rank, of the same device."""
        rank = data.draw(st.sampled_from(sorted(self.lost)))
        if rank not in self.workers and (self.limits.max_workers is None or rank < self.limits.max_workers):
            self.workers[rank] = self.lost[rank]
        del self.lost[rank]
        self._schedule(checkpoints)

    @precondition(lambda self: self.workers)
    @rule(data=st.data(), which=st.sampled_from(["any", "busy", "elastic"]))
    def lose_worker(self, data: st.DataObject, which: str) -> None:
        """A worker is lost: any, one of a running attempt (which fails), or one of an elastic job's."""
        held = {"any": sorted(self.workers), "busy": sorted(r for j in self.jobs.values() for r in j.ranks),
                "elastic": sorted(r for j in self.jobs.values() if len(j.sizes) > 1 for r in j.ranks)}
        self._lose(data.draw(st.sampled_from(held[which] or held["any"])))
        self._schedule()

    def _lose(self, rank: int) -> None:
        """Worker `rank` is gone: its attempt fails, and the job waits again (PREEMPTED if it was being
        preempted: it falls back to its last checkpoint, as the supervisor's _preempted does)."""
        self.lost[rank] = self.workers.pop(rank)
        for j in self.jobs.values():
            if rank in j.ranks:
                j.yielded = j.preempting
                self._end_attempt(j, JobState.PREEMPTED if j.preempting else JobState.RESTARTING)

    @precondition(lambda self: self._elastic_ranks())
    @rule(data=st.data(), back=st.booleans())
    def outage(self, data: st.DataObject, back: bool) -> None:
        """A worker of a running elastic job is lost for longer than restart_timeout_s (its job may shrink
        meanwhile); with `back`, it then rejoins, and the shrunk jobs reach a checkpoint (they may grow back)."""
        rank = data.draw(st.sampled_from(self._elastic_ranks()))
        self._lose(rank)
        self._schedule()
        self.clock += RESTART_TIMEOUT_S + 1
        self._schedule()
        if back:
            self.workers[rank] = self.lost.pop(rank)
            self._schedule(checkpoints=True)

    def _elastic_ranks(self) -> list[int]:
        return sorted(r for j in self.jobs.values() if len(j.sizes) > 1 for r in j.ranks)

    @rule(stages=st.integers(1, 4), replicas=st.integers(1, 2), priority=st.integers(-2, 2),
          device=st.sampled_from(DEVICES), bounded=st.booleans(), data=st.data())
    def submit(self, stages: int, replicas: int, priority: int, device: str, bounded: bool,
               data: st.DataObject) -> None:
        if len(self.jobs) >= MAX_JOBS:
            return
        min_stages = data.draw(st.integers(1, stages)) if bounded else None
        name = f"j{self.seq:03d}"  # the job table reads jobs submitted at one instant in their names' order
        text = spec_text(name, stages, replicas, priority, device, min_stages)
        spec = parsed(text)
        sizes = tuple(t.world for t in elastic.shapes(spec)) if spec.elastic is not None else ()
        record = JobRecord(name=name, spec_yaml=text, steps=4)
        j = Job(name, spec, record, self.seq, spec.topology.world, sizes, self.clock, self.clock)
        self._set(j, JobState.PENDING)
        self.jobs[name] = j
        self.seq += 1
        self._schedule()

    @precondition(lambda self: any(j.ranks for j in self.jobs.values()))
    @rule(data=st.data(), how=st.sampled_from(["finished", "failed", "stopped"]), checkpoints=st.booleans())
    def attempt_ends(self, data: st.DataObject, how: str, checkpoints: bool) -> None:
        """An attempt ends: the job finished, or failed, or (one being preempted) stopped at its step boundary."""
        running = sorted(n for n, j in self.jobs.items() if j.ranks)
        stopping = [n for n in running if self.jobs[n].preempting]
        name = data.draw(st.sampled_from(stopping if how == "stopped" and stopping else running))
        j = self.jobs[name]
        if how == "finished" and not j.preempting:
            self._end_attempt(j, JobState.SUCCEEDED)
            self.ended[name] = self.jobs.pop(name).record
        elif j.preempting:  # stopped at its step boundary for the job it made room for
            j.yielded = True
            self._end_attempt(j, JobState.PREEMPTED)
        else:
            j.yielded = False
            self._end_attempt(j, JobState.RESTARTING)
        self._schedule(checkpoints)

    @rule(seconds=st.sampled_from([1.0, RESTART_TIMEOUT_S + 1, RESTART_TIMEOUT_S + 1, pool.STARVE_AFTER_S]),
          checkpoints=st.booleans())
    def advance(self, seconds: float, checkpoints: bool) -> None:
        """Time passes: the starvation bound and restart_timeout_s come nearer; with `checkpoints`, every shrunk
        running job reaches a checkpoint meanwhile."""
        self.clock += seconds
        self._schedule(checkpoints)

    def _round(self) -> Round:
        busy = {r for j in self.jobs.values() for r in j.ranks}
        idle = {r: d for r, d in self.workers.items() if r not in busy}
        waiting = [pool.Waiting(j.name, j.spec.priority, j.seq, j.slots, self.clock - j.waited_from, j.sizes,
                                j.may_shrink(self.clock))
                   for j in self.jobs.values() if not j.ranks]
        running = [pool.Running(j.name, j.spec.priority, j.seq, j.ranks, j.preempting, j.sizes)
                   for j in self.jobs.values() if j.ranks]
        d = pool.decide(waiting, idle, running, self._prefer, self._fits, lambda d: "host", self.workers, self.limits)
        jobs = {n: replace(j, record=replace(j.record, history=list(j.record.history))) for n, j in self.jobs.items()}
        return Round(d, jobs, idle, dict(self.workers), self.clock, waiting)

    def _prefer(self, w: pool.Waiting) -> list[int]:
        j = self.jobs[w.name]
        return list(j.last) or list(range(j.spec.topology.world))

    def _fits(self, w: pool.Waiting | pool.Running, workers: dict[int, str]) -> dict[int, str]:
        return {r: d for r, d in workers.items() if d == self.jobs[w.name].spec.device}

    def _schedule(self, checkpoints: bool = False) -> None:
        """A round of schedule, as serve runs one after every change: refusals fail their jobs, victims are
        asked to stop, and the placed jobs start (re-planned onto the size the pool gives them). With
        `checkpoints`, every shrunk running job then reaches a checkpoint."""
        self.last = self._round()
        d = self.last.decision
        self.tally.update(starts=len(d.starts), shrinks=len(d.shrinks), preemptions=len(d.preempts),
                          refusals=len(d.refuses))
        for name in d.refuses:
            self._set(self.jobs[name], JobState.FAILED)
            self.ended[name] = self.jobs.pop(name).record
        for victim in d.preempts:
            self.jobs[victim].preempting = True
        for name, ranks in d.starts.items():
            j = self.jobs[name]
            if name in d.shrinks:
                self._set(j, JobState.PREEMPTED if j.yielded else JobState.RESTARTING, "shrunk")
            j.ranks = j.last = tuple(ranks)
            j.slots, j.yielded = len(ranks), False
            self._set(j, JobState.RUNNING)
        for name in self._shrunk() if checkpoints else ():
            self._checkpoint(name)

    def _shrunk(self) -> list[str]:
        return sorted(n for n, j in self.jobs.items() if j.ranks and j.sizes and len(j.ranks) < j.sizes[0])

    @precondition(lambda self: self._shrunk())
    @rule(data=st.data())
    def checkpoint(self, data: st.DataObject) -> None:
        self._checkpoint(data.draw(st.sampled_from(self._shrunk())))

    def _checkpoint(self, name: str) -> None:
        """A shrunk job's checkpoint: where the pool's decision grows it, its attempt ends to start again at
        that size."""
        if name not in self._shrunk():
            return
        self.last = self._round()
        if (size := self.last.decision.grows.get(name)) is not None:
            self.tally["grows"] += 1
            j = self.jobs[name]
            j.slots, j.yielded = size, False
            self._end_attempt(j, JobState.RESTARTING)
            self._schedule()

    @precondition(lambda self: self.jobs)
    @rule(resize=st.booleans(), size=st.none() | st.sampled_from(range(2, RANKS + 1)))
    def restart_serve(self, resize: bool, size: int | None) -> None:
        """serve restarts: its attempts end with it (their jobs RUNNING on disk), every record is read back from
        the state dir by a new supervisor, and the workers register again. With `resize`, it restarts with
        another --max-workers (`size`; None: not set): a worker of a rank past it is refused. What serve does
        not keep starts over: a re-planned shape (the spec's again), the job one yielded to, the ranks it last
        ran on, and the wait for lost ranks (restart_timeout_s counts from the restart)."""
        if resize:
            self.limits = replace(self.limits, max_workers=size)
            self.workers = {r: d for r, d in self.workers.items() if size is None or r < size}
        shm = Path("/dev/shm")  # the job table writes through fsync: memory's is quick
        state = Path(tempfile.mkdtemp(prefix="gpipe-pool-model-", dir=shm if shm.is_dir() else None))
        try:
            table = JobTable(state)
            for record in [*(j.record for j in self.jobs.values()), *self.ended.values()]:
                record.output_dir = str(state / record.name)
                table.save(record)
            sup = Supervisor(no_launch, clock=FrozenClock(self.clock), say=lambda line: None, limits=self.limits)
            table.load(sup)
            for rank, device in sorted(self.workers.items()):
                sup.register(rank, "127.0.0.1", "cpu" if device == "cpu" else f"cuda:{rank}", "host")
            asks, decision = sup._decide(sup._waiting())
            self.tally["serve restarts"] += 1
        finally:
            shutil.rmtree(state)
        for j in self.jobs.values():
            if j.ranks:
                self._end_attempt(j, JobState.RESTARTING)
            elif j.record.state == JobState.RESTARTING:
                self._set(j, JobState.RESTARTING)
            j.slots, j.yielded, j.last = j.spec.topology.world, False, ()
        mine = self._round()
        key = [(w.name, w.priority, w.slots, w.waited_s, w.sizes, w.shrink) for w in pool.order(mine.waiting)]
        theirs = [(w.name, w.priority, w.slots, w.waited_s, w.sizes, w.shrink) for w in pool.order(asks)]
        assert theirs == key, (theirs, key)
        assert decision == mine.decision, (decision, mine.decision)
        for name, e in sup.jobs.items():
            kept = self.jobs[name].record if name in self.jobs else self.ended[name]
            states = [(h.state, h.time_unix) for h in e.record.history]
            assert states == [(h.state, h.time_unix) for h in kept.history], (name, states, kept.history)
        self._schedule()

    # the invariants

    @invariant()
    def no_worker_in_two_attempts(self) -> None:
        ranks = [r for j in self.jobs.values() for r in j.ranks]
        assert len(ranks) == len(set(ranks)), {n: j.ranks for n, j in self.jobs.items() if j.ranks}

    @invariant()
    def an_attempt_holds_idle_workers_of_its_device_at_a_size_its_bounds_allow(self) -> None:
        if self.last is None:
            return
        d, before = self.last.decision, self.last.jobs
        for name, ranks in d.starts.items():
            j = before[name]
            assert all(r in self.last.idle and self.last.workers[r] == j.spec.device for r in ranks), (name, ranks)
            if name in d.shrinks:
                assert j.may_shrink(self.last.now) and len(ranks) == d.shrinks[name] < j.slots, (j, ranks)
                assert len(ranks) in j.sizes, (j, ranks)
            else:
                assert len(ranks) == j.slots or (j.sizes and len(ranks) == j.sizes[0] > j.slots), (j, ranks)
        for name, size in d.grows.items():
            j = before[name]
            assert j.ranks and j.sizes and size == j.sizes[0] > len(j.ranks), (j, size)

    @invariant()
    def a_shrunk_job_grows_back_only_onto_workers_the_round_left_free(self) -> None:
        if self.last is None:
            return
        d, before = self.last.decision, self.last.jobs
        for device in DEVICES:
            taken = sum(len(ranks) for n, ranks in d.starts.items() if before[n].spec.device == device)
            taken += sum(size - len(before[n].ranks) for n, size in d.grows.items() if before[n].spec.device == device)
            assert taken <= sum(v == device for v in self.last.idle.values()), (device, d, self.last.idle)

    @invariant()
    def a_preemption_frees_workers_the_waiting_job_can_use(self) -> None:
        if self.last is None:
            return
        for victim, by in self.last.decision.preempts.items():
            v, w = self.last.jobs[victim], self.last.jobs[by]
            assert v.spec.priority < w.spec.priority
            assert any(self.last.workers.get(r) == w.spec.device for r in v.ranks), (victim, v.ranks, by)

    @invariant()
    def a_job_that_can_never_fit_holds_nothing_back_and_is_refused_when_the_size_is_known(self) -> None:
        if self.last is None:
            return
        d = self.last.decision
        if d.blocked_by is not None:
            j = self.last.jobs[d.blocked_by]
            assert j.slots <= sum(v == j.spec.device for v in self.last.workers.values()), (j, self.last.workers)
        for w in self.last.waiting:
            never = self.limits.max_workers is not None and w.least() > self.limits.max_workers
            assert (w.name in d.refuses) == never, (w, self.limits, d.refuses)
        assert not set(d.refuses) & {*d.starts, *d.preempts.values(), d.blocked_by}, d

    @invariant()
    def no_job_waits_past_the_starvation_bound_while_it_fits(self) -> None:
        """A starved job that fits the idle workers of its device left by the jobs before it starts (unless one
        before it holds the rest back); one that fits its device's registered workers and does not start holds
        back every job after it, and no grow takes its device's workers."""
        if self.last is None:
            return
        d, before, left = self.last.decision, self.last.jobs, dict(self.last.idle)
        ordered = pool.order([w for w in self.last.waiting if w.name not in d.refuses])
        names = [w.name for w in ordered]
        for i, w in enumerate(ordered):
            device = before[w.name].spec.device
            if w.name in d.starts:  # the workers it took at its turn (a grown start's others come after)
                for r in d.starts[w.name][:d.shrinks.get(w.name, w.slots)]:
                    left.pop(r, None)
                continue
            if d.blocked_by is not None and names.index(d.blocked_by) < i:
                return  # held back by a job before it: nothing after that one starts (checked there)
            if w.waited_s < self.limits.starve_after_s:
                continue
            assert sum(v == device for v in left.values()) < w.least(), (w, left, d)
            if w.slots <= sum(v == device for v in self.last.workers.values()):
                assert not set(names[i + 1:]) & {*d.starts, *d.preempts.values()}, (w.name, d)
                assert not [n for n in d.grows if before[n].spec.device == device], (w.name, d)
                return

    @invariant()
    def the_first_job_that_fits_starts(self) -> None:
        if self.last is None:
            return
        ordered = pool.order([w for w in self.last.waiting if w.name not in self.last.decision.refuses])
        if ordered:
            w, device = ordered[0], self.last.jobs[ordered[0].name].spec.device
            if sum(v == device for v in self.last.idle.values()) >= w.least():
                assert w.name in self.last.decision.starts, (w, self.last.idle)


PoolModel.TestCase.settings = settings(max_examples=PROPERTY_EXAMPLES, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
test_the_pool_keeps_its_invariants = PoolModel.TestCase
