"""A job's output directory, <state-dir>/<name>/ (no torch here: the CLI's parent process stays light)."""

from __future__ import annotations

import shutil
from pathlib import Path

from gpipe.errors import SpecError

TENSORBOARD = "tensorboard"  # a job's TensorBoard scalars (coordinator.board), in its output folder


def prepare_output(spec_name: str, state_dir: Path, fresh: bool) -> Path:
    """<state-dir>/<name>/; a fresh start empties metrics.jsonl and drops an earlier run's checkpoints, best and
    TensorBoard scalars."""
    out = state_dir / spec_name
    try:
        out.mkdir(parents=True, exist_ok=True)
        if fresh:
            (out / "metrics.jsonl").write_text("")
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            shutil.rmtree(out / "best", ignore_errors=True)
            shutil.rmtree(out / TENSORBOARD, ignore_errors=True)
        else:
            (out / "metrics.jsonl").touch()
    except OSError as e:
        raise SpecError(f"--state-dir: cannot write {out}: {e.strerror}") from None
    return out
