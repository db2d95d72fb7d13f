"""What a user sees while a job runs: a progress bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

from gpipe.service.job_records import JobState


class Progress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self.total = total
        self.tty = enabled and sys.stderr.isatty()
        self.enabled = enabled
        self.every = max(1, total // 20)
        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True) if self.tty else None
        self._t0 = time.monotonic()
        self.eval_loss: float | None = None  # the latest evaluation's

    def update(self, step: int, loss: float, samples_per_s: float, loss_scale: float | None = None,
               skipped: bool | None = None, replica_times: list[float] | None = None) -> None:
        """A step ended; fp16 steps also show their loss scale, and whether the step was skipped; after an
        evaluation, the latest eval loss shows too; with several replicas, each one's step time."""
        losses = [f"loss {loss:.4f}"] + ([f"eval loss {self.eval_loss:.4f}"] if self.eval_loss is not None else [])
        scale = "" if loss_scale is None else f"  loss scale {loss_scale:g}" + (" (skipped)" if skipped else "")
        times = "/".join(f"{t:.3f}" for t in replica_times or [])
        each = f"  replicas {times} s" if len(replica_times or []) > 1 else ""
        if self.bar is not None:
            self.bar.set_postfix_str(", ".join([*losses, f"{samples_per_s:,.0f} samples/s"]) + scale + each,
                                     refresh=False)
            self.bar.update(1)
        elif self.enabled and (step % self.every == 0 or step == self.total - 1 or skipped):
            print("  ".join([f"step {step + 1}/{self.total}", *losses, f"{samples_per_s:,.0f} samples/s"])
                  + scale + each,
                  file=sys.stderr, flush=True)

    def evaluated(self, step: int | None, loss: float, samples: int) -> None:
        """An evaluation after step `step`: a line of its own (with no progress shown too: it is the job's
        result, not progress), and its loss on the progress line from now on."""
        self.eval_loss = loss
        after = f"after step {step + 1}/{self.total}" if step is not None else ""
        self.write(f"eval {after}: loss {loss:.4f} over {samples:,} samples")

    def restart(self, step: int) -> None:
        """Training (re)starts at `step`: a resumed attempt."""
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def write(self, line: str) -> None:
        """A line for the user, above the bar."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def checkpoint(self, step: int, size: int, seconds: float) -> None:
        if self.enabled:
            self.write(f"checkpoint step-{step}: {size / 2**20:,.1f} MiB in {seconds:.3f}s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Follower:
    """Shows a job's events as they come: steps on `bar`, states and log lines.

    `since` skips that many state changes already shown (a resumed job's
    stream starts with its past). `show` returns the final state once the job ended:
    the first end past state number `final_after` (default `since`), as a resumed
    job's past holds the ends of its earlier runs.
    """

    def __init__(self, name: str, bar: Progress, since: int = 0, final_after: int | None = None):
        self.name, self.since, self.bar = name, since, bar
        self.final_after = since if final_after is None else final_after
        self.states = 0
        self.last_step = -1

    def show(self, kind: str, value: Any) -> JobState | None:
        if kind == "metrics":
            if value["step"] <= self.last_step:
                self.bar.restart(value["step"])
            self.last_step = value["step"]
            self.bar.update(value["step"], value["loss"], value["samples_per_s"], value.get("loss_scale"),
                            value.get("skipped"), [r["step_time_s"] for r in value.get("replicas", [])])
            return None
        if kind == "eval":
            self.bar.evaluated(value["step"], value["eval_loss"], value["eval_samples"])
            return None
        if kind == "state":
            self.states += 1
            if self.states <= self.since:
                return None
            self.write(f"{self.name}: {value.state.value}" + (f": {value.message}" if value.message else ""))
            return value.state if value.state.ended and self.states > self.final_after else None
        self.write(f"{self.name}: {value}")
        return None

    def write(self, line: str) -> None:
        self.bar.write(line)

    def close(self) -> None:
        self.bar.close()
