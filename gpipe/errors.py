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


class JobFailed(GpipeError):
    """The job started and failed; the message names the stage."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, stage: int | None = None):
        super().__init__(message)
        self.stage = stage
