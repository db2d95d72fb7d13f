"""The supervisor in process (Harness): a fake clock, fake workers and scripted attempt processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from gpipe.coordinator.attempt import report
from gpipe.coordinator.spec.job import parse_spec
from gpipe.coordinator.supervisor.core import Supervisor
from gpipe.coordinator.supervisor.records import Launch, Worker
from gpipe.service.job_records import Abort, JobRecord, Join


class Clock:
    def __init__(self) -> None:
        self.mono, self.wall = 1000.0, 1.7e9

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.wall

    def advance(self, s: float) -> None:
        self.mono += s
        self.wall += s


class FakeAttempt:
    """An attempt process whose reports the test sends, and that ends when told or killed."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self.queue: asyncio.Queue[report.Report | None] = asyncio.Queue()
        self.code: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.killed = False
        self.preempted = False  # asked to stop at the next step boundary

    async def reports(self) -> AsyncIterator[report.Report]:
        while (r := await self.queue.get()) is not None:
            yield r

    async def wait(self) -> int:
        return await self.code

    def end(self, code: int, *reports: report.Report) -> None:
        for r in reports:
            self.queue.put_nowait(r)
        self.queue.put_nowait(None)
        if not self.code.done():
            self.code.set_result(code)

    def kill(self, grace_s: float = 0.0) -> None:
        if not self.code.done():
            self.killed = True
            self.end(-9)

    def last_words(self) -> str:
        return self.words

    def preempt(self) -> None:
        self.preempted = True

    words = ""


class Harness:
    def __init__(self) -> None:
        self.clock = Clock()
        self.attempts: list[FakeAttempt] = []
        self.sup = Supervisor(self.launch, clock=self.clock, say=lambda line: None, grace_s=0.0)
        self.workers: dict[int, Worker] = {}

    async def launch(self, launch: Launch) -> FakeAttempt:
        a = FakeAttempt(launch)
        self.attempts.append(a)
        return a

    def submit(self, name: str = "j", **kw: object) -> JobRecord:
        fields = {"stages": 2, "max_restarts": 2, "restart_timeout_s": 60} | kw
        text = (f"name: {name}\nmodel: {{factory: mlp}}\ndata: {{factory: random_regression, batch_size: 4}}\n"
                "optimizer: {name: sgd, lr: 0.1}\nsteps: 4\n" + "".join(f"{k}: {v}\n" for k, v in fields.items()))
        job = JobRecord(name=name, spec_yaml=text, steps=4, output_dir=f"/nonexistent/{name}")
        self.sup.add(job, parse_spec(text), Path("job.yaml"), Path("."))
        return job

    def register(self, *ranks: int) -> None:
        for r in ranks:
            self.workers[r] = self.sup.register(r, "127.0.0.1", "cpu", "host", [r], 1)

    def beat(self, *ranks: int) -> None:
        for r in ranks:
            assert self.sup.heartbeat(self.workers[r].id)

    async def settle(self) -> None:
        """Let the supervisor's tasks run until they wait for something."""
        for _ in range(3):
            self.sup.schedule()
            for _ in range(20):
                await asyncio.sleep(0)

    def commands(self, rank: int) -> list[Join | Abort | None]:
        out = []
        q = self.workers[rank].commands
        while not q.empty():
            out.append(q.get_nowait())
        return out



