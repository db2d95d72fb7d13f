"""What `gpipe-coordinator logs NAME` prints: a training log, one line per logged step.

    step 10/200  loss 3.2104  lr 0.003  2,911 samples/s  bubble 24.1%
    checkpoint step-100: 1.2 MiB in 0.011s
    RESTARTING: rank 1 lost; restart 1 of 3: resuming from checkpoint step-100 ...
    eval after step 200/200: loss 1.6012 over 512 samples
    SUCCEEDED: 200/200 steps, final loss 1.5912; weights in ...

Steps count from 1, as the progress bar does (metrics.jsonl's `step` is the
index, one less). With --json, the lines of metrics.jsonl as they are.
"""

from __future__ import annotations

import json
from typing import Any

from gpipe.service.job_records import Event, StateChange


def step_line(m: dict[str, Any], steps: int) -> str:
    """A logged step: its number, loss, LR, throughput and bubble (fp16: its loss scale)."""
    line = (f"step {m['step'] + 1}/{steps}  loss {m['loss']:.4f}  lr {m['lr']:.4g}  "
            f"{m['samples_per_s']:,.0f} samples/s  bubble {m['bubble_fraction']:.1%}")
    if m.get("loss_scale") is not None:
        line += f"  loss scale {m['loss_scale']:g}" + ("  (skipped)" if m.get("skipped") else "")
    return line


def eval_line(m: dict[str, Any], steps: int) -> str:
    after = f" after step {m['step'] + 1}/{steps}" if m.get("step") is not None else ""
    return f"eval{after}: loss {m['eval_loss']:.4f} over {m['eval_samples']:,} samples"


def state_line(c: StateChange) -> str:
    return c.state.value + (f": {c.message}" if c.message else "")


def line(event: Event, steps: int, as_json: bool) -> str | None:
    """What `logs` prints for one event; None: nothing (with --json, only metrics.jsonl's lines)."""
    kind, value = event
    if as_json:
        return json.dumps(value) if kind in ("metrics", "eval") else None
    if kind == "metrics":
        return step_line(value, steps)
    if kind == "eval":
        return eval_line(value, steps)
    if kind == "state":
        return state_line(value)
    return str(value)  # a log line: a checkpoint, a resume
