"""Preemption, as Kubernetes does it: SIGTERM with a grace, to a worker daemon, to serve, to `run`.

Each is real processes over loopback: the job checkpoints at its next step
boundary although `checkpoint_every` is larger than the run, waits PREEMPTED,
resumes from that checkpoint (no step before it runs again, read from
metrics.jsonl) and ends with the one-device reference's weights.

In process; the runs through real processes are in tests/service/test_preempt.py.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("token", ["kept", "a2VwdA==", "a2VwdA\n", "é", "\x00", "=" * 3, "a" * 200, "_-_-"])
def test_a_page_token_is_opaque_and_any_string_not_ours_is_refused_as_a_value_error(token):
    from gpipe.coordinator.server.job_service import _page_token, _token_name

    assert _token_name(_page_token("kept")) == "kept" and _page_token("kept") == "a2VwdA"
    with pytest.raises(ValueError):
        _token_name(token)


def test_a_sigterm_whose_leave_call_is_cancelled_under_it_leaves_without_a_traceback(tmp_path, capsys):
    """serve stopping at the same moment closes the session's channel, which cancels the Leave call in flight
    (grpc.aio raises CancelledError from the call, not from the task): one line, and the daemon leaves. A
    cancellation of the leaving task itself still propagates."""
    import argparse
    import asyncio

    from gpipe.worker.daemon import Daemon

    class Stub:
        async def Leave(self, request, timeout):  # noqa: N802 (gRPC's name)
            raise asyncio.CancelledError()

    a = argparse.Namespace(rank=1, coordinator="127.0.0.1:1", host="127.0.0.1", cores=[0], threads=1,
                           log_dir=str(tmp_path), tls_ca=None)

    async def leave() -> None:
        d = Daemon(a, None)
        d.session = (Stub(), "w-1")
        await d.leave(5.0, asyncio.Event())

    asyncio.run(leave())
    err = capsys.readouterr().err
    assert "gpipe-worker[1]: SIGTERM: could not tell the coordinator (the connection closed): leaving" in err, err

    async def cancelled() -> None:
        class Slow:
            async def Leave(self, request, timeout):  # noqa: N802
                await asyncio.sleep(30)

        d = Daemon(a, None)
        d.session = (Slow(), "w-1")
        task = asyncio.ensure_future(d.leave(5.0, asyncio.Event()))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
