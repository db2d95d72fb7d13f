"""`run`'s workers: one per rank (stage of a replica), in the coordinator's process, joining the supervisor as daemons do.

Each registers with the supervisor, takes its commands (join, abort) from its
queue, and heartbeats; its attempt processes are started by the same agent a
`gpipe-worker` daemon uses, pinned to its share of this machine's cores. Only
the transport differs: calls in process instead of gRPC, so `run` opens no
network API.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

from gpipe.coordinator.supervisor.core import Supervisor
from gpipe.coordinator.supervisor.registry import HEARTBEAT_INTERVAL_S
from gpipe.service.job_records import Join
from gpipe.service.zygote import Template
from gpipe.worker.agent import Agent
from gpipe.worker.device import Gpu


class LocalWorker:
    def __init__(self, sup: Supervisor, rank: int, host: str, device: str, cores: list[int], threads: int,
                 log: Path, template: Template | None = None, gpu: Gpu | None = None,
                 env: dict[str, str] | None = None):
        """A worker for `rank`, pinned to `cores`, its attempts' output going to `log`, their processes forked
        from `template` if given. On a GPU: `device` cuda:0, the one GPU `env`'s CUDA_VISIBLE_DEVICES leaves its
        attempt processes, `gpu` (gpipe.coordinator.cli.run.gpu_envs)."""
        self.sup, self.rank, self.host, self.device, self.log, self.gpu = sup, rank, host, device, log, gpu
        self.agent = Agent(host, cores, threads, on_change=self.beat, template=template, env=env)
        self.worker_id = ""

    def beat(self) -> None:
        if self.worker_id and not self.sup.heartbeat(self.worker_id, *self.agent.status()):
            self.worker_id = ""

    async def run(self) -> None:
        # Registered at once, its spare still starting: the job's coordinator plans meanwhile, and a join waits
        # for the spare (gpipe.worker.agent).
        warm = asyncio.ensure_future(self.agent.prestart())
        warm.add_done_callback(lambda t: t.cancelled() or t.exception())  # one that failed: the join starts anew
        beats = asyncio.ensure_future(self._heartbeats())
        try:
            while True:  # registered again whenever the supervisor drops this worker
                w = self.sup.register(self.rank, self.host, self.device, socket.gethostname(),
                                      self.agent.cores, self.agent.threads, self.gpu)
                self.worker_id = w.id
                while (cmd := await w.commands.get()) is not None:
                    if isinstance(cmd, Join):  # the job's folder on this machine: as a daemon's copy of its code
                        await self.agent.join(cmd, self.log, self.sup.job_dir_of(cmd.attempt_id))
                    else:
                        await self.agent.abort(cmd.attempt_id)
                await self.agent.abort(self.agent.attempt_id)
        finally:
            beats.cancel()
            warm.cancel()
            self.agent.kill_now()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            with contextlib.suppress(Exception):
                self.beat()
