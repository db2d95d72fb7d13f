"""v-half and v-min: V-shaped schedules of bounded activation memory (gpipe.schedule's records).

From "Pipeline Parallelism with Controllable Memory" (Qi, Wan, Amar, Lin; NeurIPS 2024, arXiv 2405.15362).
A schedule there is one micro-batch's *building block* (when each worker runs each of that micro-batch's
passes), repeated every few slots for the next micro-batch, then squeezed; a worker holds a micro-batch's
activations from its forward to its W, so the block's *lifespans* (from each F to its W) fix the peak: the
sum of a worker's lifespans over the repeat interval. Both schedules place the model as zbv does (worker k
holds model chunks k and 2P-1-k, a V) and split the backward into B and W, so a worker runs six passes of a
micro-batch (F, B and W on each of its two model chunks), a slot each, and the block repeats every 6 slots.
Worker k's passes of micro-batch 0 (F0, F1: the forwards on its model chunks 0 and 1; B1, B0: the backwards,
chunk 1's first, as the V runs back):

    v-min   F0 at k     F1 at 2P-1-k    B1 at 2P+g+k      B0 at 4P+g-1-k      (g = 2 if P % 3 == 0, else 0)
    v-half  F0 at 2k    F1 at 3P-2-k    B1 at 3P-1+g+2k   B0 at 6P-2+g-k      (g = 3 if P % 2 == 0, else 0)

v-min's passes each follow the one they wait for at once: the shortest lifespans, about 4P slots for a
micro-batch on a worker's two model chunks together, so about 4P/6 model chunks' activations held, a third of
1f1b's P stages' worth for large P (the paper: (P+4)//3 micro-batches of a stage against 1f1b's P). v-half
spaces the passes of model chunk 0's forward and model chunk 1's backward two slots apart: lifespans of about
6P slots, half of 1f1b's ((P+2)//2). `g` keeps a worker's four passes on different slots of the 6. Each W
takes the first free slot after its B, in the order of the B's.

The repeated blocks leave the first and last micro-batches' workers idle (the warm-up and the drain). Here,
as the paper's optional reordering does, each F and B then moves to the earliest free slot after what it waits
for (and after the same pass of the micro-batch before), taken in the order of the repeated blocks, wherever
that keeps every worker's activations within the repeated blocks' peak (the W's filling the free slots as
before). Every pass stays after what it waits for, so the order is free of deadlock; the simulator
(gpipe.schedule.simulate) then squeezes what idle time is left.

Each worker's actions come back as (kind, micro-batch, worker chunk) triples (gpipe.schedule.Action's
fields); a model chunk's forwards, backwards and W's each go in micro-batch order.
"""

from __future__ import annotations

import functools
from typing import Literal

Kind = Literal["F", "B", "W"]
Step = tuple[Kind, int, int]  # (kind F/B/W, micro-batch, the worker's model chunk 0 or 1)
Memory = Literal["half", "min"]
PERIOD = 6  # slots between a micro-batch's block and the next's: the six passes of a micro-batch on a worker


def block(memory: Memory, stages: int, worker: int) -> dict[tuple[Kind, int], int]:
    """The slot of each F and B of micro-batch 0 on `worker` ((kind, worker chunk) -> slot); micro-batch m's
    are PERIOD*m later."""
    p, k = stages, worker
    if memory == "min":
        g = 2 if p % 3 == 0 else 0
        return {("F", 0): k, ("F", 1): 2 * p - 1 - k, ("B", 1): 2 * p + g + k, ("B", 0): 4 * p + g - 1 - k}
    g = 3 if p % 2 == 0 else 0
    return {("F", 0): 2 * k, ("F", 1): 3 * p - 2 - k, ("B", 1): 3 * p - 1 + g + 2 * k, ("B", 0): 6 * p - 2 + g - k}


def steps(memory: Memory, worker: int, stages: int, chunks: int) -> list[Step]:
    """Worker `worker`'s actions of one step: the repeated blocks, reordered (see the module's docstring)."""
    return list(_orders(memory, stages, chunks)[worker])


class _Worker:
    """One worker's F and B passes by slot, and what the W's filling its free slots leave it holding."""

    def __init__(self, at: dict[Step, int], length: int) -> None:
        self.at = at  # pass -> slot
        self.slots: list[Step | None] = [None] * length
        for s, t in at.items():
            self.slots[t] = s
        # At the start of each slot: how many B's wait for their W, and the activations held. A free slot runs
        # the oldest waiting B's W, so the counts alone say where the W's go (which W is which: `order`). The
        # counts are right up to the start of slot `known`, and brought up to date when asked past it.
        self.waiting = [0] * (length + 1)
        self.held = [0] * (length + 1)
        self.known = 0
        self.count(length)

    def count(self, until: int) -> None:
        """Bring the counts up to date to the start of slot `until`."""
        t, waiting, held = self.known, self.waiting[self.known], self.held[self.known]
        while t < until:
            s = self.slots[t]
            if s is None:
                if waiting:
                    waiting, held = waiting - 1, held - 1
            elif s[0] == "F":
                held += 1
            else:
                waiting += 1
            t += 1
            self.waiting[t], self.held[t] = waiting, held
        self.known = max(self.known, until)

    def move(self, s: Step, to: int, cap: int) -> bool:
        """Move pass `s` to the free slot `to`, earlier than its own, if the worker then holds at most `cap`.

        From slot `to` on the counts change; past the pass's old slot, once as few B's wait as before, no more
        W's wait than before from there on, so the worker holds no more than before: the check stops there,
        and the counts after it are brought up to date when next asked."""
        old = self.at[s]
        self.count(old + 1)  # the counts as they are, before the move, past its old slot
        self.slots[to], self.slots[old] = s, None
        waiting, held = self.waiting[to], self.held[to]
        waits: list[int] = []
        counts: list[int] = []
        t = to
        while t < len(self.slots):
            x = self.slots[t]
            if x is None:
                if waiting:
                    waiting, held = waiting - 1, held - 1
            elif x[0] == "F":
                held += 1
                if held > cap:
                    self.slots[to], self.slots[old] = None, s
                    return False
            else:
                waiting += 1
            waits.append(waiting)
            counts.append(held)
            t += 1
            if t > old:
                self.count(t)
                if waiting <= self.waiting[t]:
                    break
        fewer = waiting < self.waiting[t]
        self.waiting[to + 1:t + 1], self.held[to + 1:t + 1] = waits, counts
        if fewer:  # what follows waits on fewer B's than counted: count it again when asked
            self.known = t
        self.at[s] = to
        return True

    def order(self) -> tuple[Step, ...]:
        """The worker's actions: its F's and B's by slot, each free slot the W of the oldest B still waiting."""
        out: list[Step] = []
        waiting: list[Step] = []
        for s in self.slots:
            if s is not None:
                out.append(s)
                if s[0] == "B":
                    waiting.append(s)
            elif waiting:
                b = waiting.pop(0)
                out.append(("W", b[1], b[2]))
        return tuple(out)


def _waits(s: Step, worker: int, stages: int) -> list[tuple[int, Step]]:
    """The passes (worker, pass) that pass `s` of `worker` waits for: the model chunk before's forward (after
    its backward), and the same pass of the micro-batch before."""
    kind, mb, c = s
    k, last = worker, stages - 1
    out: list[tuple[int, Step]] = []
    if kind == "F" and c == 0 and k > 0:
        out.append((k - 1, ("F", mb, 0)))
    elif kind == "F" and c == 1:
        out.append((k + 1, ("F", mb, 1)) if k < last else (k, ("F", mb, 0)))
    elif kind == "B" and c == 1:
        out.append((k - 1, ("B", mb, 1)) if k > 0 else (k, ("F", mb, 1)))
    elif kind == "B" and c == 0:
        out.append((k + 1, ("B", mb, 0)) if k < last else (k, ("B", mb, 1)))
    if mb > 0:
        out.append((k, (kind, mb - 1, c)))
    return out


@functools.lru_cache(maxsize=8)  # a process runs one or a few shapes; a large one holds 6 x P x M steps
def _orders(memory: Memory, stages: int, chunks: int) -> tuple[tuple[Step, ...], ...]:
    """Every worker's actions (a step's: all workers are built together, as the reordering needs)."""
    blocks = [block(memory, stages, k) for k in range(stages)]
    for k, b in enumerate(blocks):
        if len({t % PERIOD for t in b.values()}) != len(b):
            raise AssertionError(f"v-{memory}: worker {k}'s passes share a slot at {stages} workers")
    length = max(max(b.values()) for b in blocks) + PERIOD * chunks + 2 * chunks + 1  # room for the last W's
    workers = [_Worker({(kind, mb, c): t + PERIOD * mb for (kind, c), t in b.items() for mb in range(chunks)},
                       length) for b in blocks]
    cap = max(max(w.held) for w in workers)  # the repeated blocks' peak: no worker goes past it
    for t, k, s in sorted((t, k, s) for k, w in enumerate(workers) for s, t in w.at.items()):
        w = workers[k]
        earliest = max((workers[j].at[d] + 1 for j, d in _waits(s, k, stages)), default=0)
        for to in range(earliest, t):
            if w.slots[to] is None and w.move(s, to, cap):
                break
    return tuple(w.order() for w in workers)
