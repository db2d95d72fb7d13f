"""What a user sees while a job runs: a progress bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self.total = total
        self.tty = enabled and sys.stderr.isatty()
        self.enabled = enabled
        self.every = max(1, total // 20)
        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True) if self.tty else None
        self._t0 = time.monotonic()

    def update(self, step: int, loss: float, samples_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {samples_per_s:,.0f} samples/s", refresh=False)
            self.bar.update(1)
        elif self.enabled and (step % self.every == 0 or step == self.total - 1):
            print(f"step {step + 1}/{self.total}  loss {loss:.4f}  {samples_per_s:,.0f} samples/s",
                  file=sys.stderr, flush=True)

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
