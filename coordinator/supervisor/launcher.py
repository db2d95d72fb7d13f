"""Attempt processes: `python -m gpipe.coordinator.attempt.process`, one per attempt, read through typed reports.

Each attempt gets a fresh process, so a fresh RPC world and rendezvous: one
that saw a failure is never reused. It dies with its parent (gpipe.proc), and
is killed by process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from gpipe.coordinator.attempt import report
from gpipe.coordinator.supervisor.records import Launch
from gpipe.proc import child_env, last_error_line
from gpipe.service.zygote import Child, Template

# What the coordinator's attempt processes import (gpipe.service.zygote's template imports it once): no optimizer, so
# not torch._dynamo (the workers' half of a template's start).
COORDINATOR_PRELOAD = ("torch.distributed.rpc", "gpipe.coordinator.attempt.process", "gpipe.coordinator.attempt.driver",
                       "gpipe.coordinator.attempt.board")
# What `run`'s coordinator template imports (gpipe.coordinator.cli.run): torch alone, so that the workers' template, a
# fork of it, starts importing what they add as early as it can; an attempt process imports its own modules (a
# few tenths of a second), while the workers' template imports.
PLANNER_PRELOAD = ("torch",)
REPORT_LINE_LIMIT = 64 << 20  # a metrics report carries every stage's timeline


class AttemptProcess:
    def __init__(self, proc: Child, log: Path | None = None):
        self.proc, self.log = proc, log

    def last_words(self) -> str:
        return last_error_line(self.log)

    async def reports(self) -> AsyncIterator[report.Report]:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            yield report.decode(line)

    async def wait(self) -> int:
        return await self.proc.wait()

    def reaped(self) -> bool:
        """Exited, and its report pipe read to its end."""
        return self.proc.returncode is not None and (self.proc.stdout is None or self.proc.stdout.at_eof())

    def preempt(self) -> None:
        """SIGUSR1: stop at the next step boundary, with a checkpoint (gpipe.coordinator.attempt.process)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGUSR1)

    def kill(self, grace_s: float = 0.0) -> None:
        """SIGKILL the attempt's process group; with `grace_s`, SIGTERM first (it commits what it holds)."""
        if self.proc.returncode is not None:
            return
        if grace_s > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            asyncio.get_running_loop().call_later(grace_s, self.kill)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class ProcessLauncher:
    """Starts attempt processes that plan and drive on `host`, logging to `log_for(job)` once planned.

    With no `host`, each attempt's rendezvous and RPC listen on this machine's address on the route to its
    workers: the one they reach it by.
    """

    def __init__(self, state_dir: Path, host: str | None, log_for: Callable[[str], Path], extra: Sequence[str] = (),
                 template: Template | None = None):
        """With `template`, attempt processes are forked from it (gpipe.service.zygote) instead of started anew."""
        self.state_dir, self.host, self.log_for, self.template = state_dir, host, log_for, template
        self.extra = list(extra)  # more arguments for every attempt (--evaluate WEIGHTS: the eval verb)
        self.started: list[AttemptProcess] = []  # not yet reaped (see reap)

    def host_for(self, launch: Launch) -> str:
        if self.host is not None:
            return self.host
        from gpipe.service.net import route_source

        return route_source(launch.placement[0].host)

    async def __call__(self, launch: Launch) -> AttemptProcess:
        host = self.host_for(launch)
        args = ["--spec", str(launch.spec_path), "--job-dir", str(launch.job_dir), "--state-dir", str(self.state_dir),
                "--host", host, "--placement", json.dumps([asdict(p) for p in launch.placement]),
                "--attempt", str(launch.number), "--log", str(self.log_for(launch.job)),
                *(["--resume"] if launch.resume else []), *self.extra]
        if launch.topology is not None:  # re-planned (elastic): this shape instead of the spec's
            args += ["--stages", str(launch.topology.stages), "--replicas", str(launch.topology.replicas)]
        proc: Child
        if self.template is not None:
            proc = await self.template.spawn("gpipe.coordinator.attempt.process", args, child_env(dict(os.environ)),
                                             stdout=True, limit=REPORT_LINE_LIMIT)
        else:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-P", "-m", "gpipe.coordinator.attempt.process", *args, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, start_new_session=True, env=child_env(dict(os.environ)),
                limit=REPORT_LINE_LIMIT)
        self.started = [a for a in self.started if not a.reaped()]
        self.started.append(AttemptProcess(proc, self.log_for(launch.job)))
        return self.started[-1]

    async def reap(self, timeout: float = 10.0) -> None:
        """Kill every attempt process started here and wait for it and its pipe to end, at most `timeout`
        seconds: an event loop that closes first leaves asyncio complaining in the user's terminal."""
        live = [a for a in self.started if not a.reaped()]
        for a in live:
            a.kill()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                for a in live:
                    if a.proc.stdout is not None:
                        await a.proc.stdout.read()  # to its end: the pipe's transport closes
                    await a.proc.wait()
        self.started = [a for a in self.started if not a.reaped()]
