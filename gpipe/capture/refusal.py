"""torch.export's refusal of a model, as one line for its user; torch's own output held back while it traces.

While it traces, torch.export writes to stderr on its own: a logged warning
per data-dependent guard it cannot place, and the partial graph of a refused
model, printed once per wrapper it passes through (about 22 lines for a
two-layer model). What any of it says is in the exception, so `quiet` holds it
all back, and `line` says it in one line: what torch refused, the user's file
and line where torch or the traceback gives one, and what to do only where the
forward is what export cannot take (not where it raised on the sample, which
no rewrite for torch.export would fix).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import sys
import sysconfig
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


# Where no user code lives: a frame in these is torch's, ours or Python's.
def _ours() -> list[str]:
    """The folders gpipe's modules are in: gpipe's own, and those the build maps gpipe.coordinator and
    gpipe.worker from (the repository's coordinator/ and worker/ in an editable install)."""
    out = []
    for name in ("gpipe", "gpipe.coordinator", "gpipe.worker"):
        spec = importlib.util.find_spec(name)
        out += [os.path.join(p, "") for p in (spec.submodule_search_locations or [])] if spec else []
    return out


_NOT_USER = (*_ours(), os.path.dirname(torch.__file__ or "") + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)
_FRAME = re.compile(r'File "([^"]+)", line (\d+)(?:, in [^\n]*)?\n[ \t]*([^\n]*)')


class _Muted:
    """sys.stderr while one thread captures: what that thread writes is dropped, any other thread's goes on."""

    def __init__(self, under: Any, thread: int):
        self._under, self._thread = under, thread

    def write(self, text: str) -> int:
        return len(text) if threading.get_ident() == self._thread else self._under.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._under, name)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """torch's logging (every logger under `torch`, whatever its level) held back for a while, and what this
    thread writes to sys.stderr meanwhile dropped (other threads' output goes on)."""
    names = ["torch"] + [n for n in list(logging.Logger.manager.loggerDict) if n.startswith("torch.")]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        if lg.name == "torch" or lg.level != logging.NOTSET:  # the others inherit torch's
            lg.setLevel(logging.CRITICAL + 1)
    before = sys.stderr
    sys.stderr = _Muted(before, threading.get_ident())
    try:
        yield
    finally:
        sys.stderr = before
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def user_frame(e: BaseException) -> str | None:
    """'path, line N (code)': the innermost frame of the user's code that torch's message names (a data-dependent
    guard's), else that the traceback passes through; None where neither names one."""
    named = [(f, int(n), code) for f, n, code in _FRAME.findall(str(e)) if not f.startswith(_NOT_USER)]
    if not named:
        named = [(f.filename, f.lineno or 0, f.line or "") for f in traceback.extract_tb(e.__traceback__)
                 if not f.filename.startswith(_NOT_USER) and not f.filename.startswith("<")]
    if not named:
        return None
    path, n, code = named[-1]
    return f"{path}, line {n}" + (f" ({code.strip()})" if code.strip() else "")


def _advice(e: BaseException) -> str | None:
    """What to do where the forward is what torch.export cannot take; None where it raised on the sample."""
    from torch._dynamo.exc import TorchDynamoException
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        UnsupportedOperatorException,
    )
    from torch.fx.experimental.symbolic_shapes import (
        ConstraintViolationError,
        GuardOnDataDependentSymNode,
    )

    sequential = "or give an nn.Sequential (its layers are not captured)"
    if isinstance(e, GuardOnDataDependentSymNode | DataDependentOutputException):
        return f"rewrite the branch on a tensor's value with torch.cond, {sequential}"
    if isinstance(e, TorchDynamoException | ConstraintViolationError | UnsupportedOperatorException):
        return f"rewrite that operation as torch.export can take it, {sequential}"
    return None


def line(model: nn.Module, e: BaseException) -> str:
    """The one line a capture that raised `e` gives its user (CaptureError's message)."""
    text = str(e).strip()
    what = f"{type(e).__name__}: {text.splitlines()[0][:300]}" if text else type(e).__name__
    where = user_frame(e)
    at = f" at {where}" if where else ""
    name = type(model).__name__
    advice = _advice(e)
    if advice is None:
        return f"model: {name}.forward failed on a micro-batch of the data{at}: {what}"
    return f"model: torch.export cannot capture {name}{at}: {what}; {advice}"
