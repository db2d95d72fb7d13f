"""serve --metrics-port: the jobs and workers as Prometheus metrics, on GET /metrics.

    gpipe_jobs{state}                          jobs in each state (every state, 0 included)
    gpipe_job_step{job}                        steps done (metrics.jsonl's last step + 1)
    gpipe_job_loss{job}                        the last logged step's loss
    gpipe_job_samples_per_second{job}          its samples per second
    gpipe_job_bubble_fraction{job}             its share of the stages' time spent waiting
    gpipe_job_restarts_total{job}              restarts since the job was submitted or resumed
    gpipe_job_checkpoint_age_seconds{job}      since its newest checkpoint was committed (jobs with one)
    gpipe_workers{state}                       idle, busy (in an attempt), lost (ranks a restarting or
                                               preempted job waits for that no worker holds)
    gpipe_worker_heartbeat_age_seconds{rank}   since each registered worker was last heard from

The supervisor's state lives on serve's event loop, so /metrics is served
from that loop too (asyncio), and a scrape reads the state in place: no
other thread ever does. The request is bounded (its head at most
MAX_REQUEST_BYTES, read within REQUEST_TIMEOUT_S; MAX_CONNECTIONS at once).

Labels are bounded by the job table and the ranks: a `job` label for each job
that has not ended and for the newest MAX_ENDED_JOBS that have, a `rank`
label for each registered worker. The port is on the same trust boundary as
the API's (deploy/'s NetworkPolicy lets the scrape in); it answers reads only.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpipe.coordinator.supervisor.core import Supervisor
from gpipe.coordinator.supervisor.records import Entry
from gpipe.errors import SpecError
from gpipe.service.job_records import JobState

WAITING = (JobState.RESTARTING, JobState.PREEMPTED)  # jobs that wait for their ranks' workers to come back
QUEUED = (JobState.PENDING, *WAITING)  # the pool's queue

MAX_REQUEST_BYTES = 8192  # a request's line and headers; a scrape sends a few hundred bytes
REQUEST_TIMEOUT_S = 10.0  # to send them, and to take the answer
MAX_CONNECTIONS = 16  # at once; more are closed unanswered
MAX_ENDED_JOBS = 100  # ended jobs with series of their own, the newest


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or SpecError in one line naming --metrics-port (the port is taken)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
            s.listen(MAX_CONNECTIONS)
        except BaseException:
            s.close()
            raise
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise SpecError(f"--metrics-port: cannot listen on {host}:{port}: {why}") from None
    s.setblocking(False)
    return s


class JobsCollector(Collector):
    """The supervisor's jobs and workers, read at each scrape (on the event loop)."""

    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.checkpoint_times: dict[tuple[str, int], float] = {}  # (job, step): its manifest's mtime

    def collect(self) -> Iterator[Metric]:
        sup = self.sup
        jobs = GaugeMetricFamily("gpipe_jobs", "Jobs in each state.", labels=["state"])
        count = Counter(e.record.state for e in sup.jobs.values())
        for state in JobState:
            jobs.add_metric([state.value], count[state])
        yield jobs
        yield from self._queue()
        yield from self._jobs(self._shown())
        yield from self._workers()

    def _queue(self) -> Iterator[Metric]:
        """The pool's queue (gpipe.coordinator.supervisor.pool): jobs waiting for workers by priority, and how long each has."""
        waiting = [e for e in self.sup.jobs.values() if e.record.state in QUEUED and e.spec is not None
                   and e.record.name not in self.sup.attempts]
        by_priority = GaugeMetricFamily("gpipe_queue_jobs", "Jobs waiting for workers (pending, restarting, "
                                        "preempted), by priority.", labels=["priority"])
        for priority, n in sorted(Counter(e.job_spec.priority for e in waiting).items()):
            by_priority.add_metric([str(priority)], n)
        yield by_priority
        wait = GaugeMetricFamily("gpipe_queue_wait_seconds", "Seconds each waiting job has waited in its state.",
                                 labels=["job", "priority"])
        now = self.sup.clock.time()
        for e in waiting[:MAX_ENDED_JOBS * 10]:  # bounded as the labels are
            since = e.record.history[-1].time_unix if e.record.history else now
            wait.add_metric([e.record.name, str(e.job_spec.priority)], max(0.0, now - since))
        yield wait

    def _shown(self) -> list[Entry]:
        """The jobs with series of their own: every one that has not ended, and the newest that have."""
        entries = list(self.sup.jobs.values())
        ended = [e for e in entries if e.record.state.ended and e.spec is not None]
        ended.sort(key=lambda e: e.record.history[-1].time_unix if e.record.history else 0.0)
        return [e for e in entries if not e.record.state.ended] + ended[-MAX_ENDED_JOBS:]

    def _jobs(self, shown: list[Entry]) -> Iterator[Metric]:
        step = GaugeMetricFamily("gpipe_job_step", "Steps done.", labels=["job"])
        loss = GaugeMetricFamily("gpipe_job_loss", "The last logged step's loss.", labels=["job"])
        speed = GaugeMetricFamily("gpipe_job_samples_per_second", "The last logged step's samples per second.",
                                  labels=["job"])
        bubble = GaugeMetricFamily("gpipe_job_bubble_fraction",
                                   "The last logged step's share of the stages' time spent waiting.", labels=["job"])
        restarts = CounterMetricFamily("gpipe_job_restarts", "Restarts since the job was submitted or resumed.",
                                       labels=["job"])
        age = GaugeMetricFamily("gpipe_job_checkpoint_age_seconds", "Seconds since the newest checkpoint was "
                                "committed.", labels=["job"])
        now = self.sup.clock.time()
        kept: dict[tuple[str, int], float] = {}
        for e in shown:
            job = e.record
            name = [job.name]
            step.add_metric(name, job.steps_done)
            restarts.add_metric(name, job.restarts)
            last = _last_metrics(e)
            if last is not None:
                for family, field in ((loss, "loss"), (speed, "samples_per_s"), (bubble, "bubble_fraction")):
                    if isinstance(value := last.get(field), int | float):
                        family.add_metric(name, value)
            if job.checkpoint_step > 0:
                key = (job.name, job.checkpoint_step)
                when = self.checkpoint_times.get(key)
                if when is None:
                    when = _committed_at(Path(job.output_dir), job.checkpoint_step)
                if when is not None:
                    kept[key] = when
                    age.add_metric(name, max(0.0, now - when))
        self.checkpoint_times = kept  # only the shown jobs' newest: bounded as the labels are
        yield from (step, loss, speed, bubble, restarts, age)

    def _workers(self) -> Iterator[Metric]:
        sup = self.sup
        now = sup.clock.monotonic()
        busy = sum(w.attempt_id is not None for w in sup.workers.values())
        waited_for = {r for e in sup.jobs.values() if e.record.state in WAITING and e.spec is not None
                      for r in e.spec.topology.ranks()}
        workers = GaugeMetricFamily("gpipe_workers", "Workers: idle, busy (in an attempt), lost (ranks a restarting "
                                    "or preempted job waits for that no worker holds).", labels=["state"])
        workers.add_metric(["idle"], len(sup.workers) - busy)
        workers.add_metric(["busy"], busy)
        workers.add_metric(["lost"], len(waited_for - set(sup.workers)))
        yield workers
        age = GaugeMetricFamily("gpipe_worker_heartbeat_age_seconds",
                                "Seconds since each registered worker was last heard from.", labels=["rank"])
        for rank, w in sorted(sup.workers.items()):
            age.add_metric([str(rank)], max(0.0, now - w.last_seen))
        yield age


def _last_metrics(e: Entry) -> dict[str, Any] | None:
    """The newest logged step of the job's that the supervisor holds (its events window), or None."""
    for kind, value in reversed(e.events):
        if kind == "metrics":
            return value  # type: ignore[no-any-return]
    return None


def _committed_at(out: Path, step: int) -> float | None:
    """When the checkpoint after `step` steps of the job whose outputs are in `out` was committed (its
    manifest's mtime); None if it is gone."""
    from gpipe.coordinator.outputs import checkpoint  # torch: serve has it already

    with contextlib.suppress(OSError):
        return (checkpoint.step_dir(checkpoint.folder(out), step) / checkpoint.MANIFEST).stat().st_mtime
    return None


class Exporter:
    """/metrics on a listening socket, served on the running event loop."""

    def __init__(self, sup: Supervisor):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobsCollector(sup))
        self.open = 0
        self.server: asyncio.Server | None = None

    async def start(self, sock: socket.socket) -> None:
        self.server = await asyncio.start_server(self._answer, sock=sock, limit=MAX_REQUEST_BYTES)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= MAX_CONNECTIONS:
            writer.close()
            return
        self.open += 1
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                status, body, kind = await self._respond(reader)
                head = (f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                        "Connection: close\r\n\r\n")
                writer.write(head.encode() + body)
                await writer.drain()
        except (TimeoutError, OSError):
            pass  # a client that stalls or hangs up: it gets nothing more
        except Exception as ex:  # a bug of ours: said, and serve goes on
            print(f"gpipe: /metrics: {type(ex).__name__}: {ex}", file=sys.stderr, flush=True)
        finally:
            self.open -= 1
            writer.close()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[str, bytes, str]:
        text = "text/plain; charset=utf-8"
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return "431 Request Header Fields Too Large", f"at most {MAX_REQUEST_BYTES} bytes\n".encode(), text
        except asyncio.IncompleteReadError:
            return "400 Bad Request", b"the request ended early\n", text
        method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ") + ["", ""]
        if path.split("?", 1)[0] != "/metrics":
            return "404 Not Found", b"only /metrics is here\n", text
        if method != "GET":
            return "405 Method Not Allowed", b"GET /metrics\n", text
        return "200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST
