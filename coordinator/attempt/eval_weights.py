"""The coordinator's side of evaluation: keeping the best weights, and reading weights for the eval verb.

`keep_best: true` keeps <state-dir>/<name>/best/model.safetensors, the
weights of the lowest eval loss so far. Its header carries the step and the
loss ({"step": "s", "eval_loss": "x"}), so the weights and what they scored
are replaced together, atomically (gpipe.files.atomic_write); best/best.json
repeats them for people and tools. A resumed job reads the header and keeps
the best it had: a lower loss replaces it, an equal or higher one never does.

Weights files are read with safetensors, never pickle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from gpipe.coordinator.attempt.driver import save_weights
from gpipe.coordinator.attempt.metrics import EvalMetrics
from gpipe.coordinator.attempt.resume import check_fits
from gpipe.errors import SpecError
from gpipe.files import atomic_write_json

BEST = "best"


def header(path: Path) -> dict[str, str]:
    """The metadata in a safetensors file's header (no tensor is read); OSError or ValueError if unreadable."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except OSError:
        raise
    except Exception as e:  # safetensors raises its own error for a file that is not one
        raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


class Best:
    """The best weights of a job so far, in `dir` (<state-dir>/<name>/best)."""

    def __init__(self, dir: Path, say: Callable[[str], None]) -> None:
        self.dir = dir
        self.path = dir / "model.safetensors"
        self.loss, self.step = math.inf, None
        if self.path.exists():
            try:
                meta = header(self.path)
                self.loss, self.step = float(meta["eval_loss"]), _int(meta.get("step"))
            except (OSError, ValueError, KeyError) as e:
                say(f"best: {self.path} is unreadable ({e}): the next evaluation replaces it")

    def offer(self, m: EvalMetrics, weights: dict[str, torch.Tensor] | None) -> bool:
        """Keep `weights` if `m` is the lowest eval loss so far; True if kept."""
        if weights is None or not m.eval_loss < self.loss:  # a nan loss is never the best
            return False
        self.dir.mkdir(parents=True, exist_ok=True)
        step = "" if m.step is None else str(m.step)
        save_weights(weights, self.path, {"step": step, "eval_loss": repr(m.eval_loss)})
        atomic_write_json(self.dir / "best.json", {"step": m.step, "eval_loss": m.eval_loss,
                                                   "eval_samples": m.eval_samples})
        self.loss, self.step = m.eval_loss, m.step
        return True


def load_weights(path: Path, want: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int | None]:
    """The tensors of weights file `path`, checked against the model's state dict `want`, and the step its
    header names (None if none); SpecError naming what does not fit."""
    where = f"--weights: {path}"
    try:
        meta = header(path)
        tensors = load_file(str(path))
    except OSError as e:
        raise SpecError(f"{where}: cannot read it: {e.strerror or e}") from None
    except Exception as e:  # not a safetensors file
        raise SpecError(f"{where}: not a safetensors file ({str(e).splitlines()[0] if str(e) else e})") from None
    check_fits(tensors, want, where)
    return tensors, _int(meta.get("step"))
