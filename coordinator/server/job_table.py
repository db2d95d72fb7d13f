"""serve's job table on disk: one job.json per job, read back (with its newest metrics) when serve restarts."""

from __future__ import annotations

import contextlib
import json
import sys
from collections import deque
from pathlib import Path

from gpipe.coordinator.spec.job import name_problem, parse_spec
from gpipe.coordinator.supervisor.core import Supervisor
from gpipe.coordinator.supervisor.records import EVENT_WINDOW
from gpipe.errors import EXIT_BAD_INPUT, SpecError
from gpipe.files import atomic_write_json
from gpipe.service import code_archive, job_records
from gpipe.service.job_records import JobRecord, JobState, StateChange

CODE_DIR = ".code"  # <state-dir>/.code/: job code archives by SHA-256 (no job name starts with a dot)


class JobTable:
    """The job table on disk: <state-dir>/<name>/job.json, one record per job, replaced atomically."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.code = code_archive.Store(state_dir / CODE_DIR)

    def code_dir(self, job: JobRecord) -> Path:
        """Where the job's modules are imported from: its code archive, unpacked (CodeError if it is broken);
        a job that sent none, its output folder (with its job.yaml)."""
        return self.code.unpacked(job.code_sha256) if job.code_sha256 else Path(job.output_dir)

    def save(self, job: JobRecord) -> None:
        out = Path(job.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "job.json", job.to_json())

    def load(self, sup: Supervisor) -> None:
        """Hand every record to the supervisor, oldest first, with its newest logged steps.

        A record that cannot be read, or whose spec no longer validates, is listed FAILED with one
        line naming its file, and never runs: its name stays taken, so no new job deletes its files.
        Nothing on disk is changed.
        """
        records, broken = [], []
        for d in sorted(self.state_dir.iterdir()):
            path = d / "job.json"
            try:
                if not d.is_dir() or not path.exists():  # PermissionError: a folder we may not read
                    continue
                job = JobRecord.from_json(json.loads(path.read_text()))
                if job.name != d.name:
                    raise ValueError(f"it names job {job.name!r}, not {d.name!r}")
                records.append((job, parse_spec(job.spec_yaml), self.code_dir(job)))
            except (OSError, ValueError, KeyError, TypeError, RecursionError, SpecError) as e:
                what = "broken job code of" if isinstance(e, code_archive.CodeError) else "unreadable job record"
                why = f"{what} {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                print(f"gpipe: skipping {why}", file=sys.stderr, flush=True)
                if name_problem(d.name) is not None:
                    continue  # not a job's folder (lost+found, say): said, and left alone
                when = 0.0
                with contextlib.suppress(OSError):
                    when = path.stat().st_mtime
                broken.append(JobRecord(name=d.name, spec_yaml="", steps=0, state=JobState.FAILED, history=[
                    StateChange(JobState.FAILED, when, why)], error=why, output_dir=str(d),
                    exit_code=EXIT_BAD_INPUT))
        for job, spec, code_dir in sorted(records, key=lambda r: r[0].history[0].time_unix if r[0].history else 0.0):
            out = Path(job.output_dir)
            events, older = _replay(job)
            sup.add(job, spec, out / "job.yaml", code_dir, events=events, older=older)
        for job in broken:
            sup.add(job, None, Path(job.output_dir) / "job.yaml", Path(job.output_dir), events=[
                ("state", job.history[0])])


def _replay(job: JobRecord) -> tuple[list[job_records.Event], int]:
    """The states in order, the newest logged steps, then the final state of an ended job; and how many
    steps of metrics.jsonl were left out (read from disk if a watcher asks)."""
    last = job.history[-1:] if job.state.ended else []
    events: list[job_records.Event] = [("state", h) for h in job.history[: len(job.history) - len(last)]]
    lines, older = _tail(Path(job.output_dir) / "metrics.jsonl", EVENT_WINDOW - len(job.history))
    for x in lines:
        with contextlib.suppress(ValueError):  # a line cut short by a killed attempt
            events.append(job_records.metrics_event(json.loads(x)))
    events += [("state", h) for h in last]
    return events, older


def _tail(path: Path, keep: int, block: int = 1 << 20) -> tuple[list[bytes], int]:
    """The last `keep` lines of a file, and how many lines come before them; reads it once, a block at a time."""
    keep = max(1, keep)
    total, tail = 0, deque[bytes](maxlen=keep + 1)
    rest = b""
    with contextlib.suppress(OSError), path.open("rb") as f:
        while chunk := f.read(block):
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            total += len(parts)
            tail.extend(parts[-(keep + 1):])
    if rest:
        total += 1
        tail.append(rest)
    lines = list(tail)[-keep:]
    return lines, total - len(lines)
