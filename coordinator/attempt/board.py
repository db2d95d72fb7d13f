"""A job's scalars for TensorBoard: <state-dir>/<name>/tensorboard/, beside metrics.jsonl.

The attempt process writes the steps metrics.jsonl logs (every `log_every`-th
and the last) and every evaluation, each scalar at its step, with torch's
SummaryWriter, whose thread flushes once a second (FLUSH_S), and flushes after
an evaluation, a checkpoint and at the end, so that `tensorboard --logdir <state-dir>` shows every job as
it trains without a write to the disk per step on the thread that drives the
stages. A step's
scalars are at its metrics.jsonl step (counted from 0); an evaluation's at the
steps done before it (its metrics.jsonl step + 1), where the loss of the step
that ran on the same weights is.

A resumed attempt runs again the steps after its checkpoint, and the
evaluation due there. Its writer starts with a purge at the step it resumes
from (SummaryWriter's `purge_step`): TensorBoard's readers then drop what
earlier attempts wrote from that step on, so a curve neither doubles back nor
holds a step twice. A fresh start drops the folder (gpipe.coordinator.outputs.folder).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from gpipe.contract import disk_cause
from gpipe.coordinator.attempt.metrics import EvalMetrics, StepMetrics
from gpipe.coordinator.outputs.folder import TENSORBOARD
from gpipe.errors import JobFailed, describe_os_error

# metrics.jsonl's fields that TensorBoard shows, under the same names.
STEP_SCALARS = ("loss", "lr", "grad_norm", "samples_per_s", "bubble_fraction")
FLUSH_S = 1  # seconds between the writer thread's flushes: how long a step's scalars may wait to be written


class Board:
    """The scalars of one attempt of a job whose outputs are in `out`; `purge_step`: the step it resumes at."""

    def __init__(self, out: Path, purge_step: int | None = None):
        self.path = out / TENSORBOARD
        try:
            # its writer thread flushes every FLUSH_S: a step's scalars reach the disk off the driving thread
            self.w = SummaryWriter(str(self.path), purge_step=purge_step, flush_secs=FLUSH_S)
        except OSError as e:
            raise self._failed(e) from None

    def step(self, m: StepMetrics) -> None:
        for tag in STEP_SCALARS:
            value = getattr(m, tag)
            if value is not None:  # grad_norm: None when no stage measured it
                self.w.add_scalar(tag, value, m.step)

    def eval(self, m: EvalMetrics) -> None:
        """eval_loss at the count of steps done (metrics.jsonl's step + 1): the weights it measured are those
        the loss at that step ran with, and an evaluation a resumed attempt runs again is purged too."""
        if m.step is not None:
            self.w.add_scalar("eval_loss", m.eval_loss, m.step + 1)
            self._flush()

    def flush(self) -> None:
        """Everything added so far to the disk: after a checkpoint, whose steps a later attempt does not purge.
        From the checkpoint's thread: a failed write is left to the next evaluation's flush, or the end's, to
        report."""
        with contextlib.suppress(OSError):
            self.w.flush()

    def _flush(self) -> None:
        try:
            self.w.flush()
        except OSError as e:  # a full disk: the job fails, naming the folder, as for metrics.jsonl
            raise self._failed(e) from None

    def _failed(self, e: OSError) -> JobFailed:
        return JobFailed(f"tensorboard: {describe_os_error(OSError(e.errno, e.strerror, str(self.path)))}",
                         cause=disk_cause(e))

    def close(self) -> None:
        try:
            self.w.close()
        except OSError:  # a write that failed already said so
            pass
