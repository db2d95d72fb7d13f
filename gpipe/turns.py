"""Several model chunks on one worker: a Stage per model chunk, whose actions one thread runs in the worker's order.

An interleaved schedule (gpipe.schedule: interleaved-1f1b, zbv) gives a worker
`virtual` model chunks and one order of actions over all of them. Each model chunk
is a Stage of its own (its layers, its lanes to the model chunks before and after
it, its reductions at the step's end, all unchanged), on a thread of its own.
`Turns` joins them for a step's actions: each model chunk's thread hands in its
actions with their places in the worker's order, and once all are in, the
thread of the model chunk whose action comes first in that order runs all of
them, in that order, one at a time, as one thread of the worker would (no
hand-off between threads at each action, which on a busy machine costs a
scheduler's time slice each); the others wait for it. Always the same model
chunk's thread, step after step: on the CPU each thread allocates from its own
glibc arena, and a worker whose actions ran on whichever thread came last kept
freed activations in two arenas, its resident peak creeping up for tens of
steps (the MLP's zbv of bench/plan.py: 477 -> 606 MiB over 24 steps, against
445 -> 483 MiB plateaued by step 3 with one model chunk a worker). The model
chunks' optimizer steps go through a turn of their own the same way (gpipe.stage:
the optimizer's state and temporaries in the same arena as the activations):
with both, that worker's peak is 545 MiB. Then each model chunk's
end-of-step reductions (which wait on the other stages) run on its own
thread again, so they cannot deadlock each other. The model chunks also share the
worker's activation meter (gpipe.memory.meter), so a step's activation peak is the
worker's, all its model chunks' together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from gpipe.memory.meter import ActivationMeter

Work = Sequence[tuple[int, Callable[[], None]]]  # (place in the worker's order, the action) of one model chunk


class TurnAborted(RuntimeError):
    """Another model chunk of the worker failed: its actions will not run."""


class Turns:
    """One worker's step of actions over its model chunks (see the module's docstring), and their meter."""

    def __init__(self) -> None:
        self.meter = ActivationMeter([])  # each model chunk's stage adds its weights to what it skips
        self.members = 0  # the model chunks (stages) that joined: each hands in its actions every step
        self._cond = threading.Condition()
        self._parts: list[Work] = []
        self._round = 0  # steps (or eval batches) whose actions have run
        self._error: tuple[int, BaseException] | None = None  # the last round's: which part failed, and how
        self._running: int | None = None  # the actions of the round now running, once its runner took them
        self._failed = False

    def join(self) -> None:
        """A model chunk's stage takes part in every step from now on."""
        with self._cond:
            self.members += 1

    def reset(self) -> None:
        """A new step (or eval batch) begins: forget a failed one's."""
        with self._cond:
            self._parts, self._error, self._failed = [], None, False

    def fail(self) -> None:
        """A model chunk failed outside its actions: every model chunk waiting here gives up."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def run(self, work: Work, timeout: float, what: str) -> None:
        """Hand in this model chunk's actions of a step; return once every model chunk's have run, in the
        worker's order.

        Waits at most `timeout` seconds for the other model chunks to hand theirs in, and then `timeout` per action
        for them to run (each action's own waits are bounded by it). The model chunk whose action raised raises
        its error; the others TurnAborted.
        """
        with self._cond:
            if self._failed:
                raise TurnAborted(f"{what}: another chunk of the worker failed")
            mine, round_ = len(self._parts), self._round
            self._parts.append(work)
            if len(self._parts) == self.members:
                self._cond.notify_all()  # all in: the runner goes (this thread, or the one waiting below)
            else:  # (its runner may take the parts at once: then the round is running)
                self._wait(lambda: len(self._parts) == self.members or self._round != round_
                           or self._running is not None, timeout,
                           f"the worker's other chunks to start the step ({what})")
            if self._round != round_ or self._running is not None or not self._runs(mine):
                waiting = self._running if self._running is not None else sum(len(p) for p in self._parts)
                self._wait(lambda: self._round != round_, timeout * (waiting + 1),
                           f"the worker's actions of the step to run ({what})")
                return self._outcome(mine, what)
            parts, self._parts = self._parts, []
            self._running = sum(len(p) for p in parts)
        failed: tuple[int, BaseException] | None = None
        try:
            for _, part, action in sorted((n, i, a) for i, p in enumerate(parts) for n, a in p):
                try:
                    action()
                except BaseException as e:
                    failed = (part, e)
                    break
        finally:
            with self._cond:
                self._error, self._round, self._running = failed, self._round + 1, None
                self._cond.notify_all()
        self._outcome(mine, what)

    def _runs(self, mine: int) -> bool:
        """Whether part `mine` runs the round's actions: the one holding the worker's first action (with no
        action at all, the last to hand in)."""
        firsts = [(min(n for n, _ in p), i) for i, p in enumerate(self._parts) if p]
        return (min(firsts)[1] if firsts else len(self._parts) - 1) == mine

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self._failed:
                raise TurnAborted(f"gave up waiting for {what}: another chunk of the worker failed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            self._cond.wait(left)

    def _outcome(self, mine: int, what: str) -> None:
        if self._error is None:
            return
        part, e = self._error
        if part == mine:
            raise e
        raise TurnAborted(f"{what}: another chunk of the worker failed ({type(e).__name__}: {e})")
