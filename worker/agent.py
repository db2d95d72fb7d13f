"""A worker's attempts: start the attempt process on a join, kill it on abort, say how it ended.

The one worker start-up, for the `gpipe-worker` daemon (commands over gRPC)
and `run`'s local workers (commands in process) alike. It keeps one spare
attempt process warm (torch imported, waiting for its join line on stdin), so
joining an attempt, the first or a restart, costs no import time. An attempt
process never outlives its attempt, and dies with its agent: a failed RPC world
or communicator is thrown away with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from gpipe.proc import child_env, last_error_line
from gpipe.service.job_records import Join
from gpipe.service.zygote import Child, Template

# A stage allocates activation-sized buffers every micro-batch (received tensors,
# outputs, gradients). glibc serves large ones with fresh mmaps and hands freed
# memory back to the OS, so each one page-faults anew: 8 MiB transfers reached
# 0.69 of raw gloo that way, 0.85 with these (bench/transfer.py). So the heap
# serves blocks under 16 MiB, and a step's own churn there is reused; the heap
# is not trimmed as it goes, but around each optimizer step and after an
# evaluation batch or a checkpoint (gpipe.optim.build, gpipe.memory.zero,
# gpipe.worker.stage_server), so what one freed does not stay resident under
# the next one's peak. Bigger blocks are mapped on
# their own when the heap has no free room for them (glibc serves any request
# from free heap first: the threshold decides only how the heap grows). A thread's
# arena is heaps of 64 MiB, and blocks of a good share of one (a vocabulary's
# rows: a GPT-2's 24.5 MiB embedding gradient, adam's temporaries of it, a
# micro-batch's logits) left holes that the next pattern of blocks (an
# evaluation's, a checkpoint's) did not fit: at a threshold of 64 MiB a GPT-2
# token job's last worker grew from 818 to 974 MiB over 40 steps, twice its
# prediction (bench/README.md (ah)); under 16 MiB, a heap holds four of
# its largest blocks at least. The main arena's heap has no 64 MiB limit, and a
# stage thread that shares it (threads outnumber a core's 8 arenas, and which
# one a thread gets is a matter of timing) kept a whole set of gradients freed
# at zero_grad beside the next step's: one stage of the scale run 1.9 GB above
# the others. glibc unmaps a thread's heap once it is all free, or shrinks its
# top, whatever the trim threshold: when a step's allocations moved across a
# heap's edge, a stage re-faulted 7 MiB a step (1,800 minor faults,
# bench/README.md (s)). A top pad of a whole heap keeps both from happening
# (each heap growth asks for it; pages cost memory once touched only).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(16 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
              "MALLOC_TOP_PAD_": str(64 << 20)}


# `run`'s attempt processes' environment: the job's model as JSON ({"model_factory", "model_args", "code_dir"}), which
# they build while waiting for their join (gpipe.stage.warm; run knows the job before any plan).
WARM_ENV = "GPIPE_WARM_MODEL"

# What a worker's attempt processes import (gpipe.service.zygote's template imports it once). Its optimizer imports
# torch._dynamo: half the template's start, 1.2 of 2.5 CPU-s.
WORKER_PRELOAD = ("torch._dynamo", "torch.distributed.rpc", "gpipe.worker.attempt")


def worker_template(env: dict[str, str], threads: int, hidden: tuple[str, ...] = (),
                    preload: Iterable[str] = WORKER_PRELOAD, parent: Template | None = None) -> Template:
    """The template a worker's attempt processes fork from (gpipe.service.zygote), started with what they start with:
    glibc's malloc settings and the worker's threads (numpy's BLAS sizes its pool from them at import).
    `preload`: what its forks import; `parent`: a template it is forked from (`run`'s coordinator's)."""
    return Template(dict(env, **MALLOC_ENV, OMP_NUM_THREADS=str(threads)), preload=preload, hidden=hidden,
                    parent=parent)


class Agent:
    """Runs one worker's attempt processes on its cores; `on_change` hears when one ends or is killed."""

    def __init__(self, host: str, cores: list[int], threads: int, on_change: Callable[[], None] = lambda: None,
                 template: Template | None = None, env: Mapping[str, str] | None = None):
        """With `template`, attempt processes are forked from it (gpipe.service.zygote) instead of started anew. `env`:
        what their environment holds beyond this process's (`run`'s worker k: CUDA_VISIBLE_DEVICES, its GPU)."""
        self.host, self.cores, self.threads, self.on_change = host, cores, threads, on_change
        self.template = template
        self.env = dict(env or {})
        self.spare: Child | None = None
        self.child: Child | None = None
        self.attempt_id = ""
        self.exit_code: int | None = None  # the child's, once it ended by itself
        self.log: Path | None = None
        self._warming = asyncio.Lock()  # one spare at a time: a join while it starts waits for it

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        for k, v in MALLOC_ENV.items():
            env.setdefault(k, v)
        # On a CPU the stage's device is this worker's cores: one thread each, unless OMP_NUM_THREADS says.
        env["OMP_NUM_THREADS"] = str(self.threads)
        return child_env(env, self.cores)

    async def prestart(self) -> None:
        """Have a spare attempt process importing torch, ready for the next join (started once: a join that comes
        while it starts waits for it)."""
        async with self._warming:
            if self.spare is None or self.spare.returncode is not None:
                if self.template is not None:
                    self.spare = await self.template.spawn("gpipe.worker", [], self._env(), stdin=True)
                else:
                    self.spare = await asyncio.create_subprocess_exec(
                        sys.executable, "-P", "-m", "gpipe.worker", stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.DEVNULL, start_new_session=True, env=self._env())

    async def join(self, j: Join, log: Path, code_dir: Path | None = None) -> None:
        """Start rank `j.rank` of attempt `j.attempt_id` (ending any attempt this worker was in); its stage
        imports the job's modules from `code_dir` when the job sent its code."""
        await self._kill(self.child)
        log.parent.mkdir(parents=True, exist_ok=True)
        # Over the child's stdin: the secret never goes on a command line.
        line = json.dumps({"rank": j.rank, "world": j.world, "master": j.master, "host": self.host,
                           "start_timeout_s": j.start_timeout_s, "log": str(log), "secret": j.secret,
                           "code_dir": str(code_dir or "")}) + "\n"
        child = None
        for _ in range(2):  # a spare that died meanwhile is replaced once
            await self.prestart()
            child, self.spare = self.spare, None
            assert child is not None and child.stdin is not None
            try:
                child.stdin.write(line.encode())
                await child.stdin.drain()
                child.stdin.close()
                break
            except (BrokenPipeError, ConnectionResetError):
                await self._kill(child)
        assert child is not None
        self.child, self.attempt_id, self.exit_code, self.log = child, j.attempt_id, None, log
        asyncio.ensure_future(self._reap(child))

    async def fail(self, j: Join, log: Path, error: str) -> None:
        """Attempt `j.attempt_id` cannot start here (its code could not be had): it ended, exit 2, `error` its
        last words, as the heartbeat tells the coordinator."""
        await self._kill(self.child)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(f"error: {error}\n")
        self.child, self.attempt_id, self.exit_code, self.log = None, j.attempt_id, 2, log
        self.on_change()

    async def _reap(self, child: Child) -> None:
        code = await child.wait()
        if child is self.child:
            self.exit_code = code
            self.on_change()

    async def abort(self, attempt_id: str) -> None:
        """Kill the attempt process of `attempt_id`, if that is the one running; warm a spare."""
        if attempt_id == self.attempt_id:
            child, self.child, self.attempt_id, self.exit_code = self.child, None, "", None
            await self._kill(child)
            self.on_change()
        await self.prestart()

    def running(self) -> bool:
        """Whether an attempt process is alive."""
        return self.child is not None and self.child.returncode is None

    def status(self) -> tuple[str, bool, int, str]:
        """(attempt id, whether its process ended, its exit code, its last error line)."""
        ended = self.exit_code is not None
        error = last_error_line(self.log) if ended and self.exit_code and self.log else ""
        return self.attempt_id, ended, self.exit_code or 0, error

    async def close(self) -> None:
        """Kill the attempt process and the spare."""
        child, spare, self.child, self.spare, self.attempt_id = self.child, self.spare, None, None, ""
        await self._kill(child)
        await self._kill(spare)

    @staticmethod
    async def _kill(p: Child | None) -> None:
        if p is not None and p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            await p.wait()

    def kill_now(self) -> None:
        """Kill both processes without waiting (from a finally that cannot await)."""
        for p in (self.child, self.spare):
            if p is not None and p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
