"""`gpipe-coordinator serve`: the job queue, the worker registry, and the attempts.

A job waits PENDING until a worker is registered, and idle, for each of its
stages (ranks 0 .. stages-1). Then an attempt starts: a child process
(gpipe.coordinator.attempt) plans the job, resumes from its newest good checkpoint
if it has one, and opens a rendezvous; each rank's worker is told to join it,
and the child drives the stages to the end, checkpointing as it goes. The
server follows the child's reports, the workers' heartbeats, and stop
requests.

When an attempt fails (a worker process dies, a worker goes silent, a stage
raises), the attempt is killed on every stage and the job is RESTARTING: it
waits for all its ranks to be back (as Kubernetes restarts a pod) and resumes
from its last good checkpoint, up to `max_restarts` times, then fails naming
the first failure. Every state change is written to <state-dir>/<name>/job.json,
so a restarted coordinator lists past jobs, and resumes running ones once
their workers have reconnected.

    gpipe-coordinator serve --port 7000 --state-dir /var/lib/gpipe [--host 10.0.0.5]
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gpipe import serde
from gpipe.coordinator.outputs import prepare_output
from gpipe.coordinator.spec import JobSpec, parse_spec
from gpipe.errors import EXIT_BAD_INPUT, SpecError
from gpipe.proc import child_env
from gpipe.serde import Abort, JobRecord, JobState, Join, StateChange
from gpipe.v1 import jobs_pb2, jobs_pb2_grpc, workers_pb2, workers_pb2_grpc

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0  # a worker silent this long is dropped, and its attempt fails
VALIDATE_TIMEOUT_S = 120.0


@dataclass
class Worker:
    id: str
    rank: int
    host: str
    device: str
    hostname: str
    last_seen: float
    commands: asyncio.Queue = field(default_factory=asyncio.Queue)
    attempt_id: str | None = None


@dataclass
class Attempt:
    id: str
    job: str
    ranks: list[int]
    proc: asyncio.subprocess.Process | None = None
    stopped: bool = False
    failure: tuple[str, int | None] | None = None  # (message, rank) decided by the server


class Coordinator:
    def __init__(self, state_dir: Path, host: str, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S):
        self.state_dir, self.host = state_dir, host
        self.heartbeat_timeout = heartbeat_timeout
        self.jobs: dict[str, JobRecord] = {}
        self.events: dict[str, list[serde.Event]] = {}
        self.watchers: dict[str, set[asyncio.Queue]] = {}
        self.workers: dict[int, Worker] = {}
        self.attempts: dict[str, Attempt] = {}  # by job name
        self.failed_at: dict[str, float] = {}  # by job name: when its last attempt failed (monotonic)
        self.wake = asyncio.Event()
        self.shutting_down = False  # running jobs stay RUNNING on disk, for the next start to pick up
        self._load()

    # -- the job table on disk ------------------------------------------------

    def _load(self) -> None:
        records = []
        for path in self.state_dir.glob("*/job.json"):
            try:
                records.append(JobRecord.from_json(json.loads(path.read_text())))
            except (OSError, ValueError, KeyError, TypeError) as e:
                print(f"gpipe: ignoring {path}: not a job record ({e})", file=sys.stderr, flush=True)
        for job in sorted(records, key=lambda j: j.history[0].time_unix if j.history else 0.0):
            self.jobs[job.name] = job
            self.events[job.name] = self._replay(job)
            if job.state in (JobState.RUNNING, JobState.RESTARTING):
                # Not the job's fault: no restart is counted.
                self._set_state(job, JobState.RESTARTING,
                                f"the coordinator restarted; resuming from {self._from(job)} once ranks "
                                f"0-{parse_spec(job.spec_yaml).stages - 1} are back")

    def _replay(self, job: JobRecord) -> list[serde.Event]:
        # The states in order, the logged steps, then the final state of an ended job.
        last = job.history[-1:] if job.state.ended else []
        events: list[serde.Event] = [("state", h) for h in job.history[: len(job.history) - len(last)]]
        metrics = Path(job.output_dir) / "metrics.jsonl"
        with contextlib.suppress(OSError):
            for x in metrics.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a line cut short by a killed attempt
                    events.append(("metrics", json.loads(x)))
        events += [("state", h) for h in last]
        return events

    def _save(self, job: JobRecord) -> None:
        out = Path(job.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out, prefix=".job.", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(job.to_json(), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out / "job.json")

    def _emit(self, name: str, event: serde.Event) -> None:
        self.events[name].append(event)
        for q in self.watchers.get(name, ()):
            q.put_nowait(event)

    def _set_state(self, job: JobRecord, state: JobState, message: str = "") -> None:
        change = StateChange(state, time.time(), message)
        job.state = state
        job.history.append(change)
        self._save(job)
        self._emit(job.name, ("state", change))
        print(f"gpipe: job {job.name} {state.value}{': ' + message if message else ''}", file=sys.stderr,
              flush=True)

    # -- jobs -------------------------------------------------------------------

    async def submit(self, spec_yaml: str) -> JobRecord:
        spec = parse_spec(spec_yaml)  # SpecError: INVALID_ARGUMENT
        if spec.name in self.jobs:
            raise FileExistsError(f"a job named {spec.name!r} exists already")
        await self._validate(spec_yaml)
        if spec.name in self.jobs:  # submitted twice while validating
            raise FileExistsError(f"a job named {spec.name!r} exists already")
        out = self.state_dir / spec.name
        job = JobRecord(name=spec.name, spec_yaml=spec_yaml, steps=spec.steps, output_dir=str(out))
        self.jobs[job.name] = job
        self.events[job.name] = []
        prepare_output(spec.name, self.state_dir, fresh=True)  # nothing of an older job by this name is kept
        (out / "job.yaml").write_text(spec_yaml)
        self._set_state(job, JobState.PENDING, f"waiting for workers of ranks 0-{spec.stages - 1}")
        self.wake.set()
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

    async def stop(self, name: str) -> JobRecord:
        job = self.jobs[name]  # KeyError: NOT_FOUND
        if job.state in (JobState.PENDING, JobState.RESTARTING) and name not in self.attempts:
            self._set_state(job, JobState.STOPPED, f"stopped while {job.state.value.lower()}")
        elif job.state == JobState.RUNNING and name in self.attempts:
            attempt = self.attempts[name]
            attempt.stopped = True
            self._kill(attempt)
            while name in self.attempts:  # the attempt's task records STOPPED and frees the workers
                await asyncio.sleep(0.05)
        return job

    def resume(self, name: str) -> JobRecord:
        """Queue a FAILED or STOPPED job again, to resume from its last good checkpoint."""
        job = self.jobs[name]  # KeyError: NOT_FOUND
        if job.state not in (JobState.FAILED, JobState.STOPPED):
            raise ValueError(f"job {name!r} is {job.state.value}: only a FAILED or STOPPED job can be resumed")
        job.restarts = 0
        job.error, job.failed_rank = "", -1
        stages = parse_spec(job.spec_yaml).stages
        self._set_state(job, JobState.RESTARTING,
                        f"resume requested: resuming from {self._from(job)} once ranks 0-{stages - 1} are free")
        self.wake.set()
        return job

    def _from(self, job: JobRecord) -> str:
        return f"checkpoint step-{job.checkpoint_step}" if job.checkpoint_step else "the last good checkpoint"

    # -- workers ------------------------------------------------------------------

    def register(self, rank: int, host: str, device: str, hostname: str) -> Worker:
        old = self.workers.get(rank)
        if old is not None:
            self._drop(old, f"stage {rank}'s worker registered again (it restarted)")
        w = Worker(uuid.uuid4().hex, rank, host, device or "cpu", hostname, time.monotonic())
        self.workers[rank] = w
        print(f"gpipe: worker for rank {rank} registered from {hostname or host} ({w.device})", file=sys.stderr,
              flush=True)
        self.wake.set()
        return w

    def worker(self, worker_id: str) -> Worker | None:
        return next((w for w in self.workers.values() if w.id == worker_id), None)

    def heartbeat(self, worker_id: str, attempt_id: str, ended: bool, exit_code: int) -> bool:
        w = self.worker(worker_id)
        if w is None:
            return False
        w.last_seen = time.monotonic()
        if ended and exit_code != 0 and attempt_id and w.attempt_id == attempt_id:
            how = f"signal {signal.Signals(-exit_code).name}" if exit_code < 0 else f"exit code {exit_code}"
            self._fail_attempt_of(w, f"stage {w.rank}'s worker process died ({how})")
        return True

    def _drop(self, w: Worker, why: str) -> None:
        if self.workers.get(w.rank) is w:
            del self.workers[w.rank]
        self._fail_attempt_of(w, why)
        w.commands.put_nowait(None)  # ends its command stream

    def _fail_attempt_of(self, w: Worker, why: str) -> None:
        for attempt in self.attempts.values():
            if attempt.id == w.attempt_id and attempt.failure is None and not attempt.stopped:
                attempt.failure = (why, w.rank)
                self._kill(attempt)

    async def reap(self) -> None:
        """Drop workers whose heartbeats stopped; fail restarting jobs whose workers stay away."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if now - w.last_seen > self.heartbeat_timeout:
                    self._drop(w, f"stage {w.rank}'s worker missed its heartbeats for {self.heartbeat_timeout:.0f}s")
            for job in list(self.jobs.values()):
                if job.state != JobState.RESTARTING or job.name in self.attempts:
                    continue
                spec = parse_spec(job.spec_yaml)
                waited = time.time() - job.history[-1].time_unix
                if waited > spec.restart_timeout_s:
                    missing = [r for r in range(spec.stages) if r not in self.workers]
                    who = (f"rank(s) {', '.join(map(str, missing))} did not come back" if missing
                           else "its workers stayed busy")
                    first = f"; the first failure: {job.error}" if job.error else ""
                    self._set_state(job, JobState.FAILED,
                                    f"{who} within restart_timeout_s ({spec.restart_timeout_s:.0f}s){first}")
            self.wake.set()

    # -- attempts -------------------------------------------------------------------

    async def schedule(self) -> None:
        """Start each pending job, oldest first, once every rank it needs has an idle worker."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            for job in list(self.jobs.values()):
                if job.state not in (JobState.PENDING, JobState.RESTARTING) or job.name in self.attempts:
                    continue
                spec = parse_spec(job.spec_yaml)
                ranks = list(range(spec.stages))
                # After a failure, only workers heard from since then count as back.
                since = self.failed_at.get(job.name, 0.0)
                if all(r in self.workers and self.workers[r].attempt_id is None and self.workers[r].last_seen > since
                       for r in ranks):
                    attempt = Attempt(uuid.uuid4().hex[:12], job.name, ranks)
                    for r in ranks:
                        self.workers[r].attempt_id = attempt.id
                    self.attempts[job.name] = attempt
                    asyncio.create_task(self._run(job, spec, attempt))

    def _kill(self, attempt: Attempt) -> None:
        if attempt.proc is not None and attempt.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(attempt.proc.pid, signal.SIGKILL)

    async def _run(self, job: JobRecord, spec: JobSpec, attempt: Attempt) -> None:
        out = Path(job.output_dir)
        devices = [self.workers[r].device for r in attempt.ranks]
        job.attempts += 1
        resuming = job.state == JobState.RESTARTING
        self._set_state(job, JobState.RUNNING, f"attempt {job.attempts} ({attempt.id}) on ranks {attempt.ranks}"
                        + (f", resuming from {self._from(job)}" if resuming else ""))
        done, reported = False, None
        log = open(out / "coordinator.log", "ab")
        try:
            attempt.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gpipe.coordinator.attempt", "--spec", str(out / "job.yaml"), "--job-dir", str(out),
                "--state-dir", str(self.state_dir), "--host", self.host, "--devices", ",".join(devices),
                "--resume", "--attempt", str(job.attempts),
                stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True,
                env=child_env(dict(os.environ)),
            )
            assert attempt.proc.stdout is not None
            async for raw in attempt.proc.stdout:
                try:
                    msg = json.loads(raw)
                except ValueError:
                    continue
                if "master" in msg:
                    for r in attempt.ranks:
                        self.workers[r].commands.put_nowait(
                            Join(attempt.id, msg["master"], r, spec.stages, spec.start_timeout_s))
                elif "metrics" in msg:
                    m = msg["metrics"]
                    job.steps_done, job.loss = m["step"] + 1, m["loss"]
                    self._emit(job.name, ("metrics", m))
                elif "resumed" in msg:
                    job.steps_done = msg["resumed"]
                elif "checkpoint" in msg:
                    job.checkpoint_step = msg["checkpoint"]["step"]
                    self._save(job)
                elif "log" in msg:
                    self._say(job, msg["log"])
                elif "error" in msg:
                    reported = (msg["error"], msg.get("stage"))
                elif msg.get("done"):
                    done = True
            await attempt.proc.wait()
        finally:
            log.close()
            self._kill(attempt)
            for r in attempt.ranks:
                w = self.workers.get(r)
                if w is not None and w.attempt_id == attempt.id:
                    w.commands.put_nowait(Abort(attempt.id))
                    w.attempt_id = None
            del self.attempts[job.name]
            self.wake.set()
        if self.shutting_down:
            return
        if attempt.stopped:
            self._set_state(job, JobState.STOPPED, "stopped while running")
        elif done and attempt.proc.returncode == 0:
            self._set_state(job, JobState.SUCCEEDED, f"weights in {out / 'model.safetensors'}")
        else:
            # The server's own finding (a dead or silent worker) explains more than the driver's.
            message, stage = attempt.failure or reported or (
                f"the attempt process exited with code {attempt.proc.returncode}", None)
            rank = -1 if stage is None else int(stage)
            self.failed_at[job.name] = time.monotonic()
            if not job.error:  # the first failure is the one a user needs
                job.error, job.failed_rank = message, rank
            if job.restarts < spec.max_restarts and attempt.proc.returncode != EXIT_BAD_INPUT:
                job.restarts += 1
                self._set_state(job, JobState.RESTARTING, f"{message}; restart {job.restarts} of "
                                f"{spec.max_restarts}: resuming from {self._from(job)} once ranks "
                                f"0-{spec.stages - 1} are back")
            else:
                gave_up = f" (gave up after {job.restarts} restarts; the last failure: {message})" if job.restarts else ""
                self._set_state(job, JobState.FAILED, f"{job.error}{gave_up}")

    def _say(self, job: JobRecord, line: str) -> None:
        print(f"gpipe: job {job.name}: {line}", file=sys.stderr, flush=True)
        self._emit(job.name, ("log", line))

    async def watch(self, name: str) -> AsyncIterator[serde.Event]:
        job = self.jobs[name]  # KeyError: NOT_FOUND
        q: asyncio.Queue = asyncio.Queue()
        self.watchers.setdefault(name, set()).add(q)
        try:
            for e in list(self.events[name]):
                yield e
            if job.state.ended:
                return
            while True:
                e = await q.get()
                yield e
                if e[0] == "state" and e[1].state.ended:
                    return
        finally:
            self.watchers[name].discard(q)


# -- gRPC --------------------------------------------------------------------------------


class JobService(jobs_pb2_grpc.JobServiceServicer):
    def __init__(self, c: Coordinator):
        self.c = c

    async def _job(self, name: str, context: grpc.aio.ServicerContext) -> JobRecord:
        if name not in self.c.jobs:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job named {name!r}")
        return self.c.jobs[name]

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
        return jobs_pb2.ListJobsResponse(jobs=[serde.job_to_pb(j) for j in self.c.jobs.values()])

    async def ResumeJob(self, request, context):
        await self._job(request.name, context)
        try:
            return serde.job_to_pb(self.c.resume(request.name))
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def StopJob(self, request, context):
        await self._job(request.name, context)
        return serde.job_to_pb(await self.c.stop(request.name))

    async def WatchJob(self, request, context):
        await self._job(request.name, context)
        async for e in self.c.watch(request.name):
            yield serde.event_to_pb(e)


class WorkerService(workers_pb2_grpc.WorkerServiceServicer):
    def __init__(self, c: Coordinator):
        self.c = c

    async def Register(self, request, context):
        if request.rank < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"rank: must be 0 or more, got {request.rank}")
        w = self.c.register(request.rank, request.host, request.device, request.hostname)
        return workers_pb2.RegisterResponse(worker_id=w.id, heartbeat_interval_s=HEARTBEAT_INTERVAL_S)

    async def Heartbeat(self, request, context):
        known = self.c.heartbeat(request.worker_id, request.attempt_id, request.attempt_ended, request.attempt_exit)
        return workers_pb2.HeartbeatResponse(known=known)

    async def Commands(self, request, context):
        w = self.c.worker(request.worker_id)
        if w is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown worker id: register again")
        try:
            while (cmd := await w.commands.get()) is not None:
                yield serde.command_to_pb(cmd)
        except asyncio.CancelledError:
            # The worker hung up: its daemon died (or restarted). Its rank waits for the next one.
            if self.c.workers.get(w.rank) is w:
                self.c._drop(w, f"stage {w.rank}'s worker disconnected")
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
    tasks = [asyncio.create_task(c.schedule()), asyncio.create_task(c.reap())]
    c.wake.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    await health.enter_graceful_shutdown()
    c.shutting_down = True
    for attempt in list(c.attempts.values()):
        c._kill(attempt)
    await server.stop(grace=3)
    for t in tasks:
        t.cancel()
