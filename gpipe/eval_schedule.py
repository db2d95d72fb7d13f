"""When evaluation runs, and how its messages differ from training's: what the coordinator and the stages share.

Evaluation after step s runs on the stages between step s and step s+1, in
each stage's one queue of work (gpipe.worker.stage_server): at position p (p steps
done) come first the eval batches due at p, then step p. Both ends compute
the same `EvalSchedule`, so a stage never runs step p before the eval batches
due at p, whatever order their RPCs arrive in.

An eval micro-batch travels on the stages' channels like a training one, but
under a negative micro-batch number (`tag`), so it can never be taken for one.
Its randomness (a model that draws in eval mode) is seeded by (seed,
`seed_step(batch)`, micro-batch, layer): the same at every evaluation, and
never a training step's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalSchedule:
    """Evaluate after every `every` steps (none: never) and after the last of `steps`, `batches` batches each."""

    every: int | None
    batches: int  # per evaluation; 0: no evaluation
    steps: int  # the job's steps; 0 with no `every`: evaluate once, before any step (the eval verb)

    def at(self, position: int) -> int:
        """How many eval batches run after `position` steps (before step `position`)."""
        if self.batches == 0:
            return 0
        due = position == self.steps or (self.every is not None and 0 < position < self.steps
                                         and position % self.every == 0)
        return self.batches if due else 0


def tag(micro_batch: int) -> int:
    """The number eval micro-batch `micro_batch` travels under: negative, unlike any training micro-batch."""
    return -1 - micro_batch


def seed_step(batch: int) -> int:
    """The step number eval batch `batch` seeds its randomness with: negative, unlike any training step."""
    return -1 - batch
