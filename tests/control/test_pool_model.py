"""The pool's policy (gpipe.coordinator.supervisor.pool.decide), driven by a stateful property test: workers of
mixed devices join and leave, jobs of mixed sizes, priorities and devices are submitted, fail, finish and are
preempted, and the clock runs; after every round of decisions the pool's invariants hold:

- no worker is in two attempts;
- an attempt holds only idle, registered workers of its own device;
- a preemption frees workers the waiting job can use (it is never of another device's jobs);
- a job that can never fit its device's workers holds nothing back;
- the first job in the order that fits the idle workers it may use starts.

CI runs PROPERTY_EXAMPLES sequences (GPIPE_POOL_EXAMPLES raises it: bench/pool_model runs 10,000)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpipe.coordinator.supervisor import pool

PROPERTY_EXAMPLES = int(os.environ.get("GPIPE_POOL_EXAMPLES", "150"))
DEVICES = ("cpu", "cuda")


@dataclass
class Job:
    name: str
    priority: int
    seq: int
    slots: int
    device: str
    waited_from: float
    ranks: tuple[int, ...] = ()
    preempting: bool = False


class PoolModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0
        self.workers: dict[int, str] = {}  # rank -> device
        self.jobs: dict[str, Job] = {}
        self.seq = 0
        self.last: pool.Decision | None = None
        self.before: dict[str, Job] = {}

    # what happens to the pool

    @rule(device=st.sampled_from(DEVICES))
    def register(self, device: str) -> None:
        rank = max(self.workers, default=-1) + 1
        if rank < 12:
            self.workers[rank] = device

    @precondition(lambda self: self.workers)
    @rule(data=st.data())
    def lose_worker(self, data: st.DataObject) -> None:
        rank = data.draw(st.sampled_from(sorted(self.workers)))
        del self.workers[rank]
        for j in self.jobs.values():
            if rank in j.ranks:  # its attempt fails; the job waits again
                j.ranks, j.preempting, j.waited_from = (), False, self.clock

    @rule(slots=st.integers(1, 4), priority=st.integers(-2, 2), device=st.sampled_from(DEVICES))
    def submit(self, slots: int, priority: int, device: str) -> None:
        if len(self.jobs) < 10:
            name = f"j{self.seq}"
            self.jobs[name] = Job(name, priority, self.seq, slots, device, self.clock)
            self.seq += 1

    @precondition(lambda self: any(j.ranks for j in self.jobs.values()))
    @rule(data=st.data(), finished=st.booleans())
    def attempt_ends(self, data: st.DataObject, finished: bool) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, j in self.jobs.items() if j.ranks)))
        j = self.jobs[name]
        if finished and not j.preempting:
            del self.jobs[name]
        else:  # failed, or stopped for a preemption: waits again
            j.ranks, j.preempting, j.waited_from = (), False, self.clock

    @rule(seconds=st.sampled_from([1.0, 60.0, pool.STARVE_AFTER_S]))
    def advance(self, seconds: float) -> None:
        self.clock += seconds

    @rule()
    def decide(self) -> None:
        busy = {r for j in self.jobs.values() for r in j.ranks}
        idle = {r: d for r, d in self.workers.items() if r not in busy}
        waiting = [pool.Waiting(j.name, j.priority, j.seq, j.slots, self.clock - j.waited_from)
                   for j in self.jobs.values() if not j.ranks]
        running = [pool.Running(j.name, j.priority, j.seq, j.ranks, j.preempting)
                   for j in self.jobs.values() if j.ranks]
        self.before = {n: Job(**vars(j)) for n, j in self.jobs.items()}
        self.idle = idle
        self.last = pool.decide(waiting, idle, running, lambda w: [], self._fits, lambda d: "host", self.workers)
        for name, ranks in self.last.starts.items():
            self.jobs[name].ranks = tuple(ranks)
        for victim in self.last.preempts:
            self.jobs[victim].preempting = True

    def _fits(self, w: pool.Waiting, workers: dict[int, str]) -> dict[int, str]:
        return {r: d for r, d in workers.items() if d == self.jobs[w.name].device}

    # the invariants

    @invariant()
    def no_worker_in_two_attempts(self) -> None:
        ranks = [r for j in self.jobs.values() for r in j.ranks]
        assert len(ranks) == len(set(ranks)), {n: j.ranks for n, j in self.jobs.items() if j.ranks}

    @invariant()
    def a_start_takes_idle_registered_workers_of_its_device(self) -> None:
        if self.last is None:
            return
        for name, ranks in self.last.starts.items():
            j = self.jobs[name]
            assert len(ranks) == j.slots
            assert all(r in self.idle and self.workers.get(r) == j.device for r in ranks), (name, ranks)

    @invariant()
    def a_preemption_frees_workers_the_waiting_job_can_use(self) -> None:
        if self.last is None:
            return
        for victim, by in self.last.preempts.items():
            v, w = self.before[victim], self.before[by]
            assert v.priority < w.priority
            assert any(self.workers.get(r) == w.device for r in v.ranks), (victim, v.ranks, by, w.device)

    @invariant()
    def a_job_that_cannot_fit_its_device_holds_nothing_back(self) -> None:
        if self.last is None or self.last.blocked_by is None:
            return
        j = self.before[self.last.blocked_by]
        assert j.slots <= sum(d == j.device for d in self.workers.values()), (j, self.workers)

    @invariant()
    def the_first_job_that_fits_starts(self) -> None:
        if self.last is None:
            return
        waiting = [j for j in self.before.values() if not j.ranks]
        first = pool.order([pool.Waiting(j.name, j.priority, j.seq, j.slots, 0.0) for j in waiting])
        if first:
            j = self.before[first[0].name]
            if sum(d == j.device for d in self.idle.values()) >= j.slots:
                assert j.name in self.last.starts, (j, self.idle)
        self.last = None


PoolModel.TestCase.settings = settings(max_examples=PROPERTY_EXAMPLES, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
test_the_pool_keeps_its_invariants = PoolModel.TestCase
