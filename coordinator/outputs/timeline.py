"""A step's timeline: a Chrome trace (opens in Perfetto) and a PNG pipeline diagram.

Both are drawn from one line of metrics.jsonl, where each stage reports when
each of its actions ran (forwards, backwards, and the weight-gradient passes
of a split backward: gpipe.schedule), so any logged step can be drawn after
the fact: `gpipe-coordinator timeline gpipe-state/NAME --step N` (N counted from 1, as
the progress bar counts).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from gpipe.errors import SpecError

CATEGORY = {"F": "forward", "B": "backward", "W": "weight gradients"}
COLOR = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def _rows(step: dict[str, Any]) -> list[int]:
    """The row of each stage: its own, or with virtual stages (several model chunks a worker), its worker's."""
    ranks = [s.get("rank") for s in step["stages"]]
    if None in ranks or len(set(ranks)) == len(ranks):
        return list(range(len(ranks)))
    order = list(dict.fromkeys(ranks))
    return [order.index(r) for r in ranks]


def _actions(step: dict[str, Any]) -> list[tuple[int, str, float, float]]:
    """(row, name, start s, end s) on a clock shared by the stages; a row per worker, by rank. An action is
    named by its kind and micro-batch (F3), and with virtual stages its model chunk (F3c2)."""
    t0 = min(s["start_unix"] for s in step["stages"])
    rows = _rows(step)
    chunked = len(set(rows)) < len(rows)
    out = []
    for row, s in zip(rows, step["stages"], strict=True):
        off = s["start_unix"] - t0
        for kind, mb, a, b in s["timeline"]:
            out.append((row, f"{kind}{mb}" + (f"c{s['stage']}" if chunked else ""), off + a, off + b))
    return out


def _labels(step: dict[str, Any]) -> list[str]:
    """'stage 1' per row, or 'replica 1 stage 0' when the job has replicas; with virtual stages, a worker's
    row lists its model chunks: 'rank 0: chunks 0, 3'."""
    stages, rows = step["stages"], _rows(step)
    if len(set(rows)) < len(rows):
        held: dict[int, list[str]] = {}
        for row, s in zip(rows, stages, strict=True):
            held.setdefault(row, []).append(str(s["stage"]))
        return [f"rank {stages[rows.index(r)]['rank']}: chunks {', '.join(held[r])}" for r in sorted(held)]
    if any(s.get("replica", 0) for s in stages):
        return [f"replica {s.get('replica', 0)} stage {s['stage']}" for s in stages]
    return [f"stage {s['stage']}" for s in stages]


def chrome_trace(step: dict[str, Any]) -> dict[str, Any]:
    """The Trace Event Format: one process, one thread per stage, a slice per action."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": f"step {step['step'] + 1}"}}
    ]
    for row, label in enumerate(_labels(step)):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": row, "args": {"name": label}})
    for row, name, a, b in _actions(step):
        events.append({
            "ph": "X", "pid": 0, "tid": row, "name": name,
            "cat": CATEGORY.get(name[0], name[0]),
            "ts": a * 1e6, "dur": (b - a) * 1e6, "args": {"micro_batch": int(name[1:].split("c")[0])},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def preload() -> threading.Thread:
    """Import matplotlib in a thread of its own (0.5-1 s of CPU): an attempt starts it while it waits for its
    workers, so that the drawing at the job's end does not wait for the import."""
    t = threading.Thread(target=_pyplot, name="timeline-import", daemon=True)
    t.start()
    return t


def draw_png(step: dict[str, Any], path: Path) -> None:
    """Stages against time; forwards blue, backwards orange, weight gradients (W) green, micro-batches
    labelled, bubbles white."""
    plt = _pyplot()

    actions = _actions(step)
    labels = _labels(step)
    end = max(b for *_, b in actions) if actions else 1.0
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, len(actions) * 0.25)), 0.6 * len(labels) + 1.4))
    for row, name, a, b in actions:
        color = COLOR.get(name[0], "#8C8C8C")
        ax.barh(row, (b - a) * 1e3, left=a * 1e3, height=0.8, color=color, edgecolor="black", linewidth=0.4)
        if (b - a) / end > 0.012:
            ax.text((a + b) / 2 * 1e3, row, name, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1e3)
    ax.set_xlabel("ms since the step started")
    ax.set_title(f"step {step['step'] + 1}: bubble {step['bubble_fraction']:.1%} "
                 "(blue forward, orange backward, green W, white idle)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def find_step(metrics: Path, step: int | None) -> dict[str, Any]:
    """The metrics line of step number `step`, counted from 1 as the progress bar counts (None: the last
    logged); metrics.jsonl's `step` field is the step's index, one less."""
    try:
        text = metrics.read_text()
    except OSError as e:
        raise SpecError(f"{metrics}: cannot read metrics: {e.strerror}") from None
    lines: list[dict[str, Any]] = []
    for x in text.splitlines():
        try:
            d = json.loads(x)
        except json.JSONDecodeError:  # a line cut short by a killed attempt
            continue
        if "eval_loss" not in d:  # an evaluation's line has no step timeline
            lines.append(d)
    if not lines:
        raise SpecError(f"{metrics}: no steps logged yet")
    if step is None:
        return lines[-1]
    line: dict[str, Any]  # reversed() of a list of Any-valued dicts is Any to mypy
    for line in reversed(lines):  # a resumed job ran some steps again: the latest attempt's
        if line["step"] + 1 == step:
            return line
    logged = f"{lines[0]['step'] + 1}..{lines[-1]['step'] + 1}"
    raise SpecError(f"--step: step {step} is not in {metrics} (logged: {logged})")


def write(job_dir: Path, step: int | None) -> tuple[Path, Path]:
    """Write trace.json and timeline.png for `step` into the job's directory."""
    line = find_step(job_dir / "metrics.jsonl", step)
    trace, png = job_dir / "trace.json", job_dir / "timeline.png"
    trace.write_text(json.dumps(chrome_trace(line)))
    draw_png(line, png)
    return trace, png
