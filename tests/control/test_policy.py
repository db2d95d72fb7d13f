"""The restart-or-fail policy (gpipe.coordinator.supervisor.policy): decided from a failure's fields, never its message."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import pytest

from gpipe.contract import Cause, StageError, disk_cause
from gpipe.coordinator.attempt import report
from gpipe.coordinator.supervisor.policy import (
    SPACE_WAIT_S,
    Action,
    after_failure,
    backoff_s,
    hopeless,
    when_away,
)
from gpipe.errors import EXIT_BAD_INPUT, EXIT_FAILED, disk_error


def failed(cause: Cause | None, step: int | None = 3, exit_code: int = EXIT_FAILED) -> report.Failed:
    return report.Failed("boom", exit_code, cause, rank=1, stage=1, replica=0, step=step, error_type="ValueError")


def test_a_failure_restarts_with_backoff_until_the_restarts_run_out():
    assert after_failure(failed(Cause.PEER), False, None, 0, 2).action == Action.RESTART
    second = after_failure(failed(Cause.PEER), False, None, 1, 2)
    assert second.action == Action.RESTART and second.delay_s == backoff_s(2) == 1.0
    last = after_failure(failed(Cause.PEER), False, None, 2, 2)
    assert (last.action, last.exit_code, last.hopeless) == (Action.FAIL, EXIT_FAILED, "")


def test_bad_input_fails_at_once_with_exit_code_2():
    assert hopeless(failed(None, exit_code=EXIT_BAD_INPUT), 1) and hopeless(None, EXIT_BAD_INPUT)
    d = after_failure(failed(Cause.RAISED), True, None, 0, 5)
    assert (d.action, d.exit_code) == (Action.FAIL, EXIT_BAD_INPUT)


@pytest.mark.parametrize("cause", [Cause.DISK, Cause.IMPORT, Cause.INPUT])
def test_what_a_restart_cannot_fix_fails_at_once_saying_why(cause):
    d = after_failure(failed(cause), False, None, 0, 5)
    assert d.action == Action.FAIL and d.exit_code == EXIT_FAILED and d.hopeless
    assert hopeless(failed(cause), 1)


def test_a_full_disk_restarts_after_a_wait_for_room_other_disk_errors_fail_at_once():
    assert disk_cause(OSError(errno.ENOSPC, "full")) == Cause.SPACE == disk_cause(OSError(errno.EDQUOT, "quota"))
    assert disk_cause(OSError(errno.EROFS, "read-only")) == Cause.DISK == disk_cause(OSError(errno.EIO, "io"))
    first, later = after_failure(failed(Cause.SPACE), False, None, 0, 5), after_failure(failed(Cause.SPACE), False,
                                                                                        None, 4, 5)
    assert first.action == later.action == Action.RESTART and not hopeless(failed(Cause.SPACE), 1)
    assert first.delay_s == SPACE_WAIT_S and later.delay_s == backoff_s(5) > SPACE_WAIT_S
    assert after_failure(failed(Cause.SPACE), False, None, 5, 5).action == Action.FAIL  # the restarts ran out


def test_the_same_error_at_the_same_step_twice_is_hopeless_a_peer_lost_twice_is_not():
    last = failed(Cause.RAISED).error()
    assert isinstance(last, StageError)
    assert after_failure(failed(Cause.RAISED), False, last, 1, 5).hopeless.startswith("the same error")
    assert after_failure(failed(Cause.RAISED, step=4), False, last, 1, 5).action == Action.RESTART
    peer = failed(Cause.PEER).error()
    assert after_failure(failed(Cause.PEER), False, peer, 1, 5).action == Action.RESTART


def test_a_job_away_past_restart_timeout_shrinks_if_elastic_else_fails_and_a_preempted_one_waits():
    plain = SimpleNamespace(restart_timeout_s=60.0, elastic=None)
    elastic = SimpleNamespace(restart_timeout_s=60.0, elastic=object())
    assert when_away(plain, False, 30) == () and when_away(elastic, False, 30) == ()
    assert when_away(plain, False, 61) == (Action.FAIL,)
    assert when_away(elastic, False, 61) == (Action.SHRINK, Action.FAIL)
    assert when_away(plain, True, 61) == () and when_away(elastic, True, 61) == (Action.SHRINK,)
    # Preempted for a job of higher priority (which holds its workers): an elastic job shrinks at once.
    assert when_away(elastic, True, 0, yielded=True) == (Action.SHRINK,) and when_away(plain, True, 0, True) == ()


def test_an_os_error_of_the_disk_or_a_file_is_the_disk_s():
    assert disk_error(OSError(errno.ENOSPC, "full")) and disk_error(OSError(errno.EPERM, "no", "/x"))
    assert not disk_error(OSError(errno.EPERM, "no"))
