"""Whether a failed or waiting job restarts, fails or shrinks: the one place that decides, from typed causes.

The supervisor (gpipe.coordinator.supervisor.core) asks here after every failed attempt,
and for every job whose workers stay away; the attempt process asks here
whether an OSError is the disk's (gpipe.coordinator.attempt.process). Every decision reads
the failure's fields (report.Failed: its cause, exit code, rank and step),
never its message:

- Bad input (exit code 2) fails the job at once, with exit code 2.
- What a restart cannot fix fails it at once (FAIL_FAST: the disk, job code
  the workers cannot import, input a stage cannot use), as does the same
  failure twice (StageError.same_as: cause, type, rank and step) where that
  means the code itself raised (HOPELESS_TWICE).
- Anything else restarts from the last good checkpoint, `max_restarts` times,
  backing off (0 s, then 1, 2, 4 ... up to BACKOFF_CAP_S); past that the job
  fails. A full disk (Cause.SPACE: ENOSPC, EDQUOT) is such a failure, as
  room may be made (old outputs deleted, a volume grown): its restarts wait
  at least SPACE_WAIT_S each.
- A job whose ranks stay away past `restart_timeout_s` shrinks onto the
  workers that remain if it is elastic, else fails (a preempted job waits on).
  An elastic job preempted for a job of higher priority shrinks onto the idle
  workers at once: it gave its workers up, they are not coming back soon.

Which of several stage errors is the one to name is the engine's rule
(gpipe.contract.blamed): a model chunk that gave up for another is never blamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gpipe.contract import Cause, StageError
from gpipe.coordinator.attempt import report
from gpipe.coordinator.spec.job import JobSpec
from gpipe.errors import EXIT_BAD_INPUT, EXIT_FAILED

BACKOFF_BASE_S, BACKOFF_CAP_S = 1.0, 60.0
SPACE_WAIT_S = 5.0  # a restart after a full disk waits at least this long for room to be made
# What a restart cannot fix: the job fails at once, saying why.
FAIL_FAST = {Cause.DISK: "a disk error: a restart would meet the same disk",
             Cause.IMPORT: "the workers cannot import the job's code",
             Cause.INPUT: "input a stage cannot use: a restart would meet it again"}
# What is hopeless once it repeats (StageError.same_as): the same code raising at the same step is no accident.
HOPELESS_TWICE = frozenset({Cause.RAISED, Cause.MEMORY})
REPEATED = "the same error at the same step twice: a restart cannot fix it"


class Action(StrEnum):
    RESTART = "restart"  # from the last good checkpoint, after `delay_s`
    FAIL = "fail"  # the job ends FAILED with `exit_code`
    SHRINK = "shrink"  # re-plan onto the workers that remain (elastic), then restart


@dataclass(frozen=True)
class Decision:
    action: Action
    exit_code: int = 0  # FAIL's
    hopeless: str = ""  # FAIL's: why no restart could help ('' : bad input, or the restarts ran out)
    delay_s: float = 0.0  # RESTART's backoff


def backoff_s(restart: int) -> float:
    """The pause before restart number `restart` (1, 2, ...): none, then doubling from 1 s up to the cap."""
    return 0.0 if restart <= 1 else min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (restart - 2))


def bad_input(reported: report.Failed | None, code: int) -> bool:
    """The attempt refused its input (exit code 2, by its process or in its report)."""
    return code == EXIT_BAD_INPUT or (reported is not None and reported.exit_code == EXIT_BAD_INPUT)


def hopeless(reported: report.Failed | None, code: int) -> bool:
    """An attempt's own failure that no restart can fix (bad input, the disk): a preemption does not hide it."""
    return bad_input(reported, code) or (reported is not None and reported.cause in FAIL_FAST)


def after_failure(failure: report.Failed, bad: bool, last: StageError | None, restarts: int,
                  max_restarts: int) -> Decision:
    """What follows a failed attempt: `failure` is the one it is blamed on, `bad` whether it refused its input
    (bad_input), `last` the previous attempt's error, `restarts` those made so far."""
    if bad:
        return Decision(Action.FAIL, EXIT_BAD_INPUT)
    error = failure.error()
    why = FAIL_FAST.get(failure.cause) if failure.cause is not None else None
    if error is not None and error.cause in HOPELESS_TWICE and error.same_as(last):
        why = REPEATED
    if why is not None:
        return Decision(Action.FAIL, EXIT_FAILED, why)
    if restarts < max_restarts:
        delay = backoff_s(restarts + 1)
        return Decision(Action.RESTART, delay_s=max(delay, SPACE_WAIT_S) if failure.cause == Cause.SPACE else delay)
    return Decision(Action.FAIL, EXIT_FAILED)


def when_away(spec: JobSpec, preempted: bool, waited: float, yielded: bool = False) -> tuple[Action, ...]:
    """What to try, in order, for a job that has waited `waited` s for its workers: nothing yet; SHRINK (elastic),
    where it fits; FAIL, for a restarting job whose ranks stayed away past restart_timeout_s. `yielded`: it was
    preempted for a job of higher priority (gpipe.coordinator.supervisor.pool), which holds its workers: an elastic one shrinks
    at once."""
    if yielded and preempted and spec.elastic is not None:
        return (Action.SHRINK,)
    if waited <= spec.restart_timeout_s:
        return ()
    shrink = (Action.SHRINK,) if spec.elastic is not None else ()
    return shrink if preempted else (*shrink, Action.FAIL)


