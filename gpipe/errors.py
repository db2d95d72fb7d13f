"""The errors a user sees, and the exit codes they map to."""

EXIT_OK = 0
EXIT_FAILED = 1  # the job ran and failed: a stage raised, a worker died, a wait timed out
EXIT_BAD_INPUT = 2  # a bad spec, flag or file: nothing was started


class GpipeError(Exception):
    """An error with one line for the user and an exit code."""

    exit_code = EXIT_FAILED


class SpecError(GpipeError):
    """The job spec (or a flag) is wrong; nothing was started."""

    exit_code = EXIT_BAD_INPUT


# Why an attempt failed, where a restart cannot help (the supervisor then fails the job at once):
CAUSE_RAISED = "raised"  # a stage raised (the model's code, or ours): fatal when the same one repeats
CAUSE_IMPORT = "import"  # a stage could not import the job's code
CAUSE_DISK = "disk"  # an I/O error writing the job's state or checkpoints


class JobFailed(GpipeError):
    """The job started and failed; the message names the stage, and `cause` says why, when known."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, stage: int | None = None, cause: str = ""):
        super().__init__(message)
        self.stage = stage
        self.cause = cause


def describe_os_error(e: OSError, doing: str = "writing") -> str:
    """'writing /path: No space left on device (ENOSPC)': the path and the errno, in one line."""
    import errno as errno_names

    name = errno_names.errorcode.get(e.errno or 0, str(e.errno))
    where = f" {e.filename}" if e.filename else ""
    return f"{doing}{where}: {e.strerror or e} ({name})"
