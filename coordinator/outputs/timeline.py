"""A step's timeline: a Chrome trace (opens in Perfetto) and an SVG pipeline diagram (opens in a browser).

Both are drawn from one line of metrics.jsonl, where each stage reports when
each of its actions ran (forwards, backwards, and the weight-gradient passes
of a split backward: gpipe.schedule), so any logged step can be drawn after
the fact: `gpipe-coordinator timeline gpipe-state/NAME --step N` (N counted from 1, as
the progress bar counts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

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


# The diagram's geometry, in pixels: a row per worker, the time axis across.
_ROW, _BAR, _LEFT, _TOP, _RIGHT, _BOTTOM = 34, 26, 150, 46, 20, 44
_CHAR = 6.2  # a label character's width at the diagram's 11 px sans-serif


def _ticks(end_ms: float) -> list[float]:
    """The time axis's ticks: 1, 2 or 5 times a power of ten, some 5 to 10 of them."""
    raw = end_ms / 8 if end_ms > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    step = next(k * power for k in (1, 2, 5, 10) if k * power >= raw)
    return [i * step for i in range(int(end_ms / step) + 1)]


def svg(step: dict[str, Any]) -> str:
    """Stages against time as an SVG: forwards blue, backwards orange, weight gradients (W) green, each action
    named (F3, and with virtual stages its model chunk, F3c2) where its bar has room, bubbles white; each bar's
    title (a tooltip) gives its times. Written directly: no plotting library to import at the job's end."""
    actions, labels = _actions(step), _labels(step)
    end = max((b for *_, b in actions), default=0.0) or 1.0
    width = max(900.0, min(2400.0, 28.0 * len(actions)))
    plot = width - _LEFT - _RIGHT
    height = _TOP + _ROW * len(labels) + _BOTTOM

    def x(t: float) -> float:
        return _LEFT + t / end * plot

    title = (f"step {step['step'] + 1}: bubble {step['bubble_fraction']:.1%} "
             "(blue forward, orange backward, green W, white idle)")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
           f'viewBox="0 0 {width:.0f} {height}" font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width / 2:.1f}" y="24" text-anchor="middle" font-size="13">{escape(title)}</text>']
    for row, label in enumerate(labels):
        y = _TOP + row * _ROW + _ROW / 2
        out.append(f'<text x="{_LEFT - 8}" y="{y:.1f}" text-anchor="end" dominant-baseline="middle">'
                   f'{escape(label)}</text>')
    axis = _TOP + _ROW * len(labels)
    for t in _ticks(end * 1e3):
        tx = x(t / 1e3)
        out.append(f'<line x1="{tx:.1f}" y1="{_TOP}" x2="{tx:.1f}" y2="{axis + 4}" stroke="#DDDDDD"/>')
        out.append(f'<text x="{tx:.1f}" y="{axis + 17}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{_LEFT + plot / 2:.1f}" y="{height - 8}" text-anchor="middle">'
               "ms since the step started</text>")
    for row, name, a, b in actions:
        left, right = x(a), x(b)
        top = _TOP + row * _ROW + (_ROW - _BAR) / 2
        color = COLOR.get(name[0], "#8C8C8C")
        out.append(f'<rect x="{left:.2f}" y="{top:.1f}" width="{max(right - left, 0.5):.2f}" height="{_BAR}" '
                   f'fill="{color}" stroke="black" stroke-width="0.4"><title>{escape(name)}: '
                   f'{a * 1e3:.2f}-{b * 1e3:.2f} ms</title></rect>')
        if right - left > _CHAR * len(name) + 4:
            out.append(f'<text x="{(left + right) / 2:.2f}" y="{top + _BAR / 2:.1f}" text-anchor="middle" '
                       f'dominant-baseline="middle" fill="white">{escape(name)}</text>')
    out.append(f'<line x1="{_LEFT}" y1="{axis}" x2="{_LEFT + plot:.1f}" y2="{axis}" stroke="black"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


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
    """Write trace.json and timeline.svg for `step` into the job's directory."""
    line = find_step(job_dir / "metrics.jsonl", step)
    trace, picture = job_dir / "trace.json", job_dir / "timeline.svg"
    trace.write_text(json.dumps(chrome_trace(line)))
    picture.write_text(svg(line))
    return trace, picture
