"""How training waits: for the next stage's answer, under a deadline, a look for a partition and a check.

While no step finishes, three things are due on their own clocks: the
checkpoint writer's check (every CHECK_EVERY_S: a full disk ends the attempt at
once), a look at what the stages are doing (after peer_timeout_s without news,
then every LOOK_EVERY_S: a partition between workers that still reach the
coordinator shows as every stage waiting on a neighbour), and the step's
deadline (step_timeout_s after the last news). `Watch.next` waits for the
next answer under all three.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gpipe.contract import Cause
from gpipe.coordinator.attempt.handle import Future, StageHandle
from gpipe.errors import JobFailed
from gpipe.topology import Slots

T = TypeVar("T")
LOOK_EVERY_S = 2.0  # while no step finishes, how often the stages are asked what they are doing
LOOK_TIMEOUT_S = 5.0
CHECK_EVERY_S = 1.0  # while no step finishes, how often the attempt checks its checkpoint writer


@dataclass
class Looking:
    """The stages' answers to "what are you doing?", asked at `since`."""

    answers: list[Future]
    since: float


class PartitionWatch:
    """Tells a partition between workers (every stage waiting on a neighbour) from a slow stage (one computing)."""

    def __init__(self, stages: Sequence[StageHandle], slots: Slots, peer_timeout_s: float):
        self.stages, self.slots, self.peer_timeout_s = stages, slots, peer_timeout_s
        self.looking: Looking | None = None

    def look(self, step: int) -> None:
        """No stage has finished a step for a while: ask each stage what it is doing, and judge the answers
        at the next look. This never waits: a stage cut off must not hold up the attempt (nor a SIGTERM).

        If every stage is waiting on a neighbour, and has been for peer_timeout_s, none computing, the data
        between them is not arriving (a partition between workers that still reach the coordinator, which
        heartbeats cannot see): JobFailed now, not at step_timeout_s. A stage that is computing, or idle, or
        does not answer in time proves nothing.
        """
        looking = self.looking
        if looking is not None and all(f.done() for f in looking.answers):
            self.looking = None
            seen = []
            for rank, f in enumerate(looking.answers):
                try:
                    state, what, seconds = f.value()
                except Exception:  # no answer: the heartbeats and step_timeout_s judge that
                    return
                if state != "waiting" or seconds < self.peer_timeout_s:
                    return
                seen.append(f"{self.slots.name(rank)} for {what}")
            raise JobFailed(f"step {step + 1}: every stage has waited on its neighbours for {self.peer_timeout_s:.0f}s "
                            f"or more, none computing (a network partition between workers?): {'; '.join(seen)}",
                            cause=Cause.PEER)
        if looking is not None and time.monotonic() < looking.since + LOOK_TIMEOUT_S:
            return  # answers still to come
        self.looking = Looking([stage.activity(LOOK_TIMEOUT_S) for stage in self.stages], time.monotonic())

    def news(self) -> None:
        """A stage finished: what was asked is moot."""
        self.looking = None


class Watch:
    """Training's waits for the stages' answers (see the module's docstring)."""

    def __init__(self, stages: Sequence[StageHandle], slots: Slots, step_timeout_s: float, peer_timeout_s: float,
                 check: Callable[[], None]):
        self.partition = PartitionWatch(stages, slots, peer_timeout_s)
        self.step_timeout_s, self.peer_timeout_s, self.check = step_timeout_s, peer_timeout_s, check
        self.q: queue.Queue[Any] = queue.Queue()
        self.news()

    def news(self) -> None:
        """A step ended (or training began): the deadlines start again."""
        now = time.monotonic()
        self.deadline = now + self.step_timeout_s + 10.0
        self.next_look = now + min(self.peer_timeout_s, self.step_timeout_s)
        self.partition.news()

    def notify(self, fut: Future, key: Any) -> None:
        """When `fut` completes, `next` hands out `key`."""
        fut.add_done_callback(lambda _f: self.q.put(key))

    def next(self, step: int, timed_out: Callable[[], JobFailed]) -> Any:
        """The key of the next future to complete; meanwhile the check, the look for a partition at `step`,
        and JobFailed from `timed_out()` once the deadline passes."""
        while True:
            self.check()
            wake = min(self.deadline, self.next_look, time.monotonic() + CHECK_EVERY_S)
            try:
                key = self.q.get(timeout=max(0.0, wake - time.monotonic()))
            except queue.Empty:
                now = time.monotonic()
                if now >= self.deadline:
                    raise timed_out() from None
                if now >= self.next_look:
                    self.partition.look(step)
                    self.next_look = now + LOOK_EVERY_S
                continue
            self.next_look = time.monotonic() + min(self.peer_timeout_s, self.step_timeout_s)
            self.partition.news()
            return key
