"""Child processes that never outlive their parent, set up by the child itself.

No preexec_fn: forking a process that runs gRPC or c10d threads and running
Python in the child before exec can deadlock or crash. The parent passes its
pid (and the child's cores) in the environment, and the child applies them
first thing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1
PARENT_ENV, CORES_ENV = "GPIPE_PARENT_PID", "GPIPE_CORES"


def child_env(env: dict[str, str], cores: list[int] | None = None) -> dict[str, str]:
    """`env` for a child that must die with this process (and run on `cores`)."""
    env = dict(env)
    env[PARENT_ENV] = str(os.getpid())
    if cores:
        env[CORES_ENV] = ",".join(map(str, cores))
    else:
        env.pop(CORES_ENV, None)
    return env


def adopt() -> None:
    """In the child: die with the parent (even a SIGKILLed one), and pin to the given cores."""
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit():
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
        if os.getppid() != int(parent):  # the parent died before prctl took effect
            os._exit(1)
    cores = os.environ.pop(CORES_ENV, "")
    if cores:
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])


def exit_now(code: int) -> None:
    """End this process once its output is flushed, skipping interpreter teardown.

    For attempt processes whose work is written and fsynced: torch's teardown
    takes about a second, on every attempt's critical path.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def last_error_line(log: Path | None, tail: int = 64 << 10) -> str:
    """The last line of `log`'s final `tail` bytes that reads like an error ('Type: message'), or ''."""
    if log is None:
        return ""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line and not line.startswith((" ", "Traceback", "[W", "[I")) and ":" in line:
            return line.strip()[:500]
    return ""
