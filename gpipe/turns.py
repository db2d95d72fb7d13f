"""Several model chunks on one worker: a Stage per chunk, on a thread each, taking turns in the worker's order.

An interleaved schedule (gpipe.schedule: interleaved-1f1b) gives a worker
`virtual` model chunks and one order of actions over all of them. Each chunk
is a Stage of its own (its layers, its lanes to the chunks before and after
it, its reductions at the step's end, all unchanged), and the worker's order
is kept by `Turns`: a chunk's stage runs its n-th action of the worker's
order only once the worker's action n-1 (on whichever chunk) has ended. So
the worker computes one action at a time, in the schedule's order, exactly as
one thread would, while each chunk's end-of-step reductions (which wait on
the other stages) run on their own threads and cannot deadlock each other.
The chunks also share the worker's activation meter (gpipe.memory), so a
step's activation peak is the worker's, all its chunks' together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gpipe.memory import ActivationMeter


class TurnAborted(RuntimeError):
    """Another chunk of the worker failed: its turn will never end."""


class Turns:
    """The position in one worker's order of actions, shared by the stages of its chunks (and their meter)."""

    def __init__(self) -> None:
        self.meter = ActivationMeter([])  # each chunk's stage adds its weights to what it skips
        self._cond = threading.Condition()
        self._next = 0
        self._failed = False

    def reset(self) -> None:
        """A new step (or eval batch) begins at the worker's first action."""
        with self._cond:
            self._next, self._failed = 0, False

    def fail(self) -> None:
        """A chunk failed: every chunk waiting for its turn gives up."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    @contextmanager
    def turn(self, n: int, total: int, timeout: float, what: str) -> Iterator[None]:
        """Wait (at most `timeout` seconds) until action `n` of the worker's `total` is next, run the body, then
        hand the turn on to action n+1 (also when the body raised: the step fails either way); after the last,
        to the next step's first (a worker whose chunks are driven step by step, without `reset`)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._next != n and not self._failed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"waited {timeout:.0f} s for the worker's action {n} ({what}): its action "
                                       f"{self._next} on another chunk has not ended")
                self._cond.wait(left)
            if self._failed:
                raise TurnAborted(f"{what}: another chunk of the worker failed")
        try:
            yield
        finally:
            with self._cond:
                self._next = (n + 1) % total
                self._cond.notify_all()
