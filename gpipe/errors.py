"""The errors a user sees, and the exit codes they map to.

A leaf: it imports nothing of ours at run time (nor torch), so that a client verb (`--help`, `status`,
`submit`) starts at once, and any module may raise these without an import circle."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpipe.contract import Cause, StageError

EXIT_OK = 0
EXIT_FAILED = 1  # the job ran and failed: a stage raised, a worker died, a wait timed out
EXIT_BAD_INPUT = 2  # a bad spec, flag or file: nothing was started
EXIT_PREEMPTED = 143  # 128 + SIGTERM: `run` checkpointed at a step boundary and stopped; `run --resume` goes on


class GpipeError(Exception):
    """An error with one line for the user and an exit code."""

    exit_code = EXIT_FAILED


class SpecError(GpipeError):
    """The job spec (or a flag) is wrong; nothing was started."""

    exit_code = EXIT_BAD_INPUT


class Preempted(GpipeError):
    """`run` got SIGTERM: the job checkpointed at its next step boundary (or kept its last good checkpoint)."""

    exit_code = EXIT_PREEMPTED


class JobFailed(GpipeError):
    """The job started and failed: the message is the user's line; `cause` and `error` are what the supervisor
    decides by (gpipe.contract.Cause; the stage's failure, when one stage is to blame)."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, rank: int | None = None, cause: Cause | None = None,
                 error: StageError | None = None):
        super().__init__(message)
        self.error = error
        self.cause = cause if cause is not None or error is None else error.cause
        if rank is None and error is not None and error.rank >= 0:  # -1: the coordinator's own (its data)
            rank = error.rank
        self.rank = rank  # the worker rank to blame; None: none


def describe_os_error(e: OSError, doing: str = "writing") -> str:
    """'writing /path: No space left on device (ENOSPC)': the path and the errno, in one line."""
    name = errno.errorcode.get(e.errno or 0, str(e.errno))
    where = f" {e.filename}" if e.filename else ""
    return f"{doing}{where}: {e.strerror or e} ({name})"


# Errors of the disk the job's outputs are on, not bugs of an attempt. Whether a restart may help is
# gpipe.contract.disk_cause's to say: a full disk (ENOSPC, EDQUOT) can be made room on, the others cannot.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES})


def disk_error(e: OSError) -> bool:
    """An OSError of the job's files or disk (a restart would meet it again), not a bug of the attempt."""
    return e.filename is not None or e.errno in DISK_ERRNOS
