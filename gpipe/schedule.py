"""Pipeline schedules as data: for each stage, the ordered actions of one step.

An action is a forward (F) or a backward (B) of one micro-batch. The receive
of a forward's input and the send of its output (and the same for a backward's
gradient) are implied by the action and run on the stage's channel threads,
so sends never block compute and receives are posted ahead of time.

gpipe (fill-drain), 4 stages, 4 micro-batches; a cell is the micro-batch each
stage runs at each tick (Fi forward, Bi backward, . idle):

    tick      0  1  2  3  4  5  6  7  8  9 10 11 12 13
    stage 0  F0 F1 F2 F3  .  .  .  .  .  . B3 B2 B1 B0
    stage 1   . F0 F1 F2 F3  .  .  .  . B3 B2 B1 B0  .
    stage 2   .  . F0 F1 F2 F3  .  . B3 B2 B1 B0  .  .
    stage 3   .  .  . F0 F1 F2 F3 B3 B2 B1 B0  .  .  .

1f1b, 4 stages, 6 micro-batches: stage k runs stages-k-1 warm-up forwards,
then alternates one forward and one backward, so it holds at most stages-k
micro-batches' activations at once (gpipe holds all of them):

    tick      0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17
    stage 0  F0 F1 F2 F3  .  .  . B0 F4 B1 F5 B2  . B3  . B4  . B5
    stage 1   . F0 F1 F2  .  . B0 F3 B1 F4 B2 F5 B3  . B4  . B5  .
    stage 2   .  . F0 F1  . B0 F2 B1 F3 B2 F4 B3 F5 B4  . B5  .  .
    stage 3   .  .  . F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5  .  .  .

(each tick is one forward or one backward, taken as equally long.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple


class Action(NamedTuple):
    kind: Literal["F", "B"]
    micro_batch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def gpipe(stage: int, stages: int, chunks: int) -> list[Action]:
    """All forwards in order, then all backwards in reverse (as torchgpipe does)."""
    return [Action("F", i) for i in range(chunks)] + [Action("B", i) for i in reversed(range(chunks))]


def one_f_one_b(stage: int, stages: int, chunks: int) -> list[Action]:
    """Warm up with stages-stage-1 forwards, then alternate forward and backward, then drain."""
    warmup = min(stages - stage - 1, chunks)
    actions = [Action("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < chunks:
        actions += [Action("F", f), Action("B", b)]
        f, b = f + 1, b + 1
    actions += [Action("B", i) for i in range(b, chunks)]
    return actions


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def build(name: str, stage: int, stages: int, chunks: int) -> list[Action]:
    """The actions of `stage` for one step of the schedule `name`."""
    return SCHEDULES[name](stage, stages, chunks)


class Simulation(NamedTuple):
    ticks: int  # the step's length, in ticks
    timeline: list[list[Action | None]]  # [stage][tick]
    max_in_flight: list[int]  # per stage: micro-batches forwarded and not yet backwarded

    @property
    def bubble_fraction(self) -> float:
        busy = sum(a is not None for row in self.timeline for a in row)
        return 1.0 - busy / (len(self.timeline) * self.ticks)


def simulate(name: str, stages: int, chunks: int) -> Simulation:
    """Run a schedule with unit-time actions and instant transfers.

    A forward of micro-batch i on stage k needs stage k-1's forward of i; a
    backward needs stage k+1's backward of i (or, on the last stage, its own
    forward). Raises RuntimeError if no stage can make progress: a deadlock.
    """
    plans = [build(name, k, stages, chunks) for k in range(stages)]
    pos = [0] * stages
    done: dict[tuple[int, Action], int] = {}  # (stage, action) -> tick it finished
    timeline: list[list[Action | None]] = [[] for _ in range(stages)]
    in_flight = [0] * stages
    peak = [0] * stages
    tick = 0
    while any(p < len(plan) for p, plan in zip(pos, plans, strict=True)):
        ran = []
        for k in range(stages):
            if pos[k] == len(plans[k]):
                timeline[k].append(None)
                continue
            a = plans[k][pos[k]]
            if a.kind == "F":
                dep = (k - 1, Action("F", a.micro_batch)) if k > 0 else None
            else:
                dep = (k + 1, Action("B", a.micro_batch)) if k < stages - 1 else (k, Action("F", a.micro_batch))
            if dep is None or done.get(dep, tick) < tick:
                ran.append((k, a))
                timeline[k].append(a)
            else:
                timeline[k].append(None)
        if not ran:
            raise RuntimeError(f"{name}: deadlock at tick {tick}, stages waiting at {pos}")
        for k, a in ran:
            done[(k, a)] = tick
            pos[k] += 1
            in_flight[k] += 1 if a.kind == "F" else -1
            peak[k] = max(peak[k], in_flight[k])
        tick += 1
    return Simulation(tick, timeline, peak)
