"""`gpipe-coordinator serve`: the gRPC job and worker APIs, and the job table on disk.

Jobs, workers and attempts are the supervisor's (gpipe.coordinator.supervisor,
the same one `run` uses); this module turns gRPC calls into its calls. A
submitted spec is validated in a throwaway process (its model and data are
user code), then queued. Every state change is written to
<state-dir>/<name>/job.json, so a restarted coordinator lists past jobs, and
resumes running ones once their workers have reconnected.

    gpipe-coordinator serve --port 7000 --state-dir /var/lib/gpipe [--host 10.0.0.5]
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import sys
import tempfile
from collections import deque
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gpipe import serde
from gpipe.coordinator.launcher import ProcessLauncher
from gpipe.coordinator.outputs import prepare_output
from gpipe.coordinator.spec import parse_spec
from gpipe.coordinator.supervisor import (
    EVENT_WINDOW,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    Supervisor,
)
from gpipe.errors import EXIT_BAD_INPUT, SpecError
from gpipe.files import atomic_write_json
from gpipe.serde import JobRecord, JobState, StateChange
from gpipe.v1 import jobs_pb2, jobs_pb2_grpc, workers_pb2, workers_pb2_grpc

VALIDATE_TIMEOUT_S = 120.0


class JobTable:
    """The job table on disk: <state-dir>/<name>/job.json, one record per job, replaced atomically."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir

    def save(self, job: JobRecord) -> None:
        out = Path(job.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "job.json", job.to_json())

    def load(self, sup: Supervisor) -> None:
        """Hand every record to the supervisor, oldest first, with its newest logged steps.

        A record that cannot be read, or whose spec no longer validates, is listed FAILED with one
        line naming its file, and never runs: its name stays taken, so no new job deletes its files.
        Nothing on disk is changed.
        """
        records, broken = [], []
        for d in sorted(p for p in self.state_dir.iterdir() if p.is_dir()):
            path = d / "job.json"
            if not path.exists():
                continue
            try:
                job = JobRecord.from_json(json.loads(path.read_text()))
                if job.name != d.name:
                    raise ValueError(f"it names job {job.name!r}, not {d.name!r}")
                records.append((job, parse_spec(job.spec_yaml)))
            except (OSError, ValueError, KeyError, TypeError, RecursionError, SpecError) as e:
                why = f"unreadable job record {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                print(f"gpipe: skipping {why}", file=sys.stderr, flush=True)
                broken.append(JobRecord(name=d.name, spec_yaml="", steps=0, state=JobState.FAILED, history=[
                    StateChange(JobState.FAILED, path.stat().st_mtime, why)], error=why, output_dir=str(d),
                    exit_code=EXIT_BAD_INPUT))
        for job, spec in sorted(records, key=lambda r: r[0].history[0].time_unix if r[0].history else 0.0):
            out = Path(job.output_dir)
            events, older = _replay(job)
            sup.add(job, spec, out / "job.yaml", out, events=events, older=older)
        for job in broken:
            sup.add(job, None, Path(job.output_dir) / "job.yaml", Path(job.output_dir), events=[
                ("state", job.history[0])])


def _replay(job: JobRecord) -> tuple[list[serde.Event], int]:
    """The states in order, the newest logged steps, then the final state of an ended job; and how many
    steps of metrics.jsonl were left out (read from disk if a watcher asks)."""
    last = job.history[-1:] if job.state.ended else []
    events: list[serde.Event] = [("state", h) for h in job.history[: len(job.history) - len(last)]]
    lines, older = _tail(Path(job.output_dir) / "metrics.jsonl", EVENT_WINDOW - len(job.history))
    for x in lines:
        with contextlib.suppress(ValueError):  # a line cut short by a killed attempt
            events.append(("metrics", json.loads(x)))
    events += [("state", h) for h in last]
    return events, older


def _tail(path: Path, keep: int, block: int = 1 << 20) -> tuple[list[bytes], int]:
    """The last `keep` lines of a file, and how many lines come before them; reads it once, a block at a time."""
    keep = max(1, keep)
    total, tail = 0, deque[bytes](maxlen=keep + 1)
    rest = b""
    with contextlib.suppress(OSError), path.open("rb") as f:
        while chunk := f.read(block):
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            total += len(parts)
            tail.extend(parts[-(keep + 1):])
    if rest:
        total += 1
        tail.append(rest)
    lines = list(tail)[-keep:]
    return lines, total - len(lines)


class Coordinator:
    """serve's side of the supervisor: submissions, validated in a throwaway process, into the job table."""

    def __init__(self, state_dir: Path, host: str, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S):
        self.state_dir = state_dir
        self.table = JobTable(state_dir)
        self.sup = Supervisor(ProcessLauncher(state_dir, host, lambda name: state_dir / name / "coordinator.log"),
                              self.table, heartbeat_timeout=heartbeat_timeout)
        self.table.load(self.sup)

    async def submit(self, spec_yaml: str) -> JobRecord:
        spec = parse_spec(spec_yaml)  # SpecError: INVALID_ARGUMENT
        if spec.name in self.sup.jobs:
            raise FileExistsError(f"a job named {spec.name!r} exists already")
        await self._validate(spec_yaml)
        if spec.name in self.sup.jobs:  # submitted twice while validating
            raise FileExistsError(f"a job named {spec.name!r} exists already")
        out = self.state_dir / spec.name
        job = JobRecord(name=spec.name, spec_yaml=spec_yaml, steps=spec.steps, output_dir=str(out))
        prepare_output(spec.name, self.state_dir, fresh=True)  # nothing of an older job by this name is kept
        (out / "job.yaml").write_text(spec_yaml)
        self.sup.add(job, spec, out / "job.yaml", out)
        return job

    async def _validate(self, spec_yaml: str) -> None:
        """The checks that need the model and the data, in a throwaway process: user code stays out of here."""
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "job.yaml"
            path.write_text(spec_yaml)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gpipe.coordinator.cli", "validate", str(path),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )
            try:
                _, err = await asyncio.wait_for(proc.communicate(), VALIDATE_TIMEOUT_S)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise SpecError(f"model: building the model took longer than {VALIDATE_TIMEOUT_S:.0f}s") from None
        if proc.returncode:
            lines = err.decode(errors="replace").strip().splitlines()
            raise SpecError(lines[-1].removeprefix("error: ") if lines else "the spec failed validation")


# -- gRPC --------------------------------------------------------------------------------


class JobService(jobs_pb2_grpc.JobServiceServicer):
    def __init__(self, c: Coordinator):
        self.c = c

    async def _job(self, name: str, context: grpc.aio.ServicerContext) -> JobRecord:
        if name not in self.c.sup.jobs:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job named {name!r}")
        return self.c.sup.record(name)

    async def SubmitJob(self, request, context):
        try:
            return serde.job_to_pb(await self.c.submit(request.spec_yaml))
        except SpecError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except FileExistsError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))

    async def GetJob(self, request, context):
        return serde.job_to_pb(await self._job(request.name, context))

    async def ListJobs(self, request, context):
        return jobs_pb2.ListJobsResponse(jobs=[serde.job_to_pb(e.record) for e in self.c.sup.jobs.values()])

    async def ResumeJob(self, request, context):
        await self._job(request.name, context)
        try:
            return serde.job_to_pb(self.c.sup.resume(request.name))
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def StopJob(self, request, context):
        await self._job(request.name, context)
        return serde.job_to_pb(await self.c.sup.stop(request.name))

    async def WatchJob(self, request, context):
        await self._job(request.name, context)
        async for e in self.c.sup.watch(request.name):
            yield serde.event_to_pb(e)


class WorkerService(workers_pb2_grpc.WorkerServiceServicer):
    def __init__(self, c: Coordinator):
        self.c = c

    async def Register(self, request, context):
        if request.rank < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank: must be 0 or more, got {request.rank}")
        w = self.c.sup.register(request.rank, request.host, request.device, request.hostname, list(request.cores),
                                request.threads)
        return workers_pb2.RegisterResponse(worker_id=w.id, heartbeat_interval_s=HEARTBEAT_INTERVAL_S)

    async def Heartbeat(self, request, context):
        known = self.c.sup.heartbeat(request.worker_id, request.attempt_id, request.attempt_ended,
                                     request.attempt_exit, request.attempt_error)
        return workers_pb2.HeartbeatResponse(known=known)

    async def Commands(self, request, context):
        w = self.c.sup.worker(request.worker_id)
        if w is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown worker id: register again")
            return
        try:
            while (cmd := await w.commands.get()) is not None:
                yield serde.command_to_pb(cmd)
        except asyncio.CancelledError:
            # The worker hung up: its daemon died (or restarted). Its rank waits for the next one.
            if self.c.sup.workers.get(w.rank) is w:
                self.c.sup.drop(w, f"stage {w.rank}'s worker disconnected")
            raise


class TokenAuth(grpc.aio.ServerInterceptor):
    """Every call but health probes must carry `authorization: Bearer <token>`."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if details.method.startswith("/grpc.health.v1.") or handler is None:
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self.expected):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid token is required (--auth-token-file)")

        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer,
                                                   handler.response_serializer)


async def serve(host: str, port: int, state_dir: Path, token: str | None = None,
                tls: tuple[bytes, bytes] | None = None, ready: asyncio.Event | None = None) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully."""
    from gpipe import net

    net.bind_to(host)  # the attempts' RPC and c10d ports listen here only
    state_dir.mkdir(parents=True, exist_ok=True)
    c = Coordinator(state_dir, host)
    server = grpc.aio.server(interceptors=[TokenAuth(token)] if token else None)
    jobs_pb2_grpc.add_JobServiceServicer_to_server(JobService(c), server)
    workers_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerService(c), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{host}:{port}"
    if tls:
        server.add_secure_port(address, grpc.ssl_server_credentials([(tls[1], tls[0])]))
    else:
        server.add_insecure_port(address)
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"gpipe: coordinator serving on {address}, state in {state_dir}", file=sys.stderr, flush=True)
    tasks = [asyncio.create_task(c.sup.serve_forever())]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    await health.enter_graceful_shutdown()
    c.sup.shutdown()
    await server.stop(grace=3)
    for t in tasks:
        t.cancel()
