"""`gpipe-coordinator serve`: the gRPC server, its health and its stop, around the job and worker APIs.

Jobs, workers and attempts are the supervisor's (gpipe.coordinator.supervisor.core,
the same one `run` uses); the services turn gRPC calls into its calls
(gpipe.coordinator.server.job_service for clients, gpipe.coordinator.server.worker_service for
workers), behind gpipe.coordinator.server.interceptors (a token per service, strict
decoding). A submitted spec is validated in a throwaway process (its model
and data are user code: gpipe.coordinator.server.submissions), then queued. Every state
change is written to <state-dir>/<name>/job.json (gpipe.coordinator.server.job_table),
so a restarted coordinator lists past jobs, and resumes running ones once
their workers have reconnected.

    gpipe-coordinator serve --port 7000 --state-dir /var/lib/gpipe [--host 10.0.0.5]
        [--auth-token-file CLIENT_TOKEN --worker-token-file WORKER_TOKEN]

Every request is bounded before it is used (sizes, ranges, names), every
string from one is escaped before it is logged, and heavy work (parsing,
validating) runs off the event loop, a few at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gpipe.coordinator.server.interceptors import StrictDecoding, TokenAuth
from gpipe.coordinator.server.job_service import JobService
from gpipe.coordinator.server.submissions import Coordinator
from gpipe.coordinator.server.worker_service import WorkerDirectory, WorkerService
from gpipe.coordinator.supervisor.core import Supervisor
from gpipe.coordinator.supervisor.pool import Limits
from gpipe.coordinator.supervisor.registry import HEARTBEAT_TIMEOUT_S
from gpipe.service import code_archive, grpcutil
from gpipe.service.v1 import jobs_pb2_grpc, workers_pb2_grpc

MAX_MESSAGE_BYTES = 2 << 20  # gRPC itself refuses a bigger request (RESOURCE_EXHAUSTED)
STOP_GRACE_S = 0.5  # on SIGTERM, how long calls in flight may finish (streams never do)


async def _drain(sup: Supervisor, grace_s: float, stop: asyncio.Event) -> None:
    """SIGTERM: every running job checkpoints at its next step boundary (PREEMPTED), within `grace_s`; the
    API and the workers' streams stay up meanwhile, and no job starts. A SIGINT cuts it short."""
    running = len(sup.attempts)
    if not running:
        return
    print(f"gpipe: SIGTERM: {running} running job(s) checkpoint at their next step boundary (grace {grace_s:.0f}s)",
          file=sys.stderr, flush=True)
    sup.preempt_all("the coordinator is stopping (SIGTERM)", grace_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while sup.attempts and not stop.is_set():
        if loop.time() >= deadline:
            print(f"gpipe: {', '.join(sup.attempts)}: no checkpoint within the grace ({grace_s:.0f}s): "
                  "resumed from the last good one at the next start", file=sys.stderr, flush=True)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(deadline - loop.time(), 0.1)):
                await stop.wait()


async def serve(host: str | None, port: int, state_dir: Path, token: str | None = None, worker_token: str | None = None,
                tls: tuple[bytes, bytes] | None = None, ready: asyncio.Event | None = None, note: str = "",
                validate_memory_mib: int | None = None, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
                max_code_mib: int = code_archive.DEFAULT_LIMIT_MIB, metrics: tuple[str | None, int] | None = None,
                grace_s: float = grpcutil.DEFAULT_GRACE_S, limits: Limits | None = None) -> None:
    """Run until SIGTERM or SIGINT; SpecError if a port is taken.

    On SIGTERM every running job checkpoints at its next step boundary and is left PREEMPTED (a restarted
    serve resumes it), for at most `grace_s`; then serve stops within a second. SIGINT stops it at once.

    `metrics`: (host, port) for Prometheus' /metrics (gpipe.coordinator.server.exporter); host None: the API's. `limits`: the
    pool's size, when known, and its starvation bound (gpipe.coordinator.supervisor.pool).
    """
    from gpipe.coordinator.server.exporter import Exporter, listen
    from gpipe.service import net

    options = [grpcutil.NO_SHARED_PORT, ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               *grpcutil.SERVER_KEEPALIVE]
    # TokenAuth first: a stranger learns nothing, not even that the request was malformed.
    auth = [TokenAuth(token, worker_token)] if token or worker_token else []
    server = grpc.aio.server(interceptors=[*auth, StrictDecoding()], options=options)
    address = f"{host or '0.0.0.0'}:{port}"  # no --host: every interface (attempts pick theirs)
    creds = grpc.ssl_server_credentials([(tls[1], tls[0])]) if tls else None
    grpcutil.listen(server, address, "--port", creds)  # first: a taken port changes nothing
    metrics_sock = None if metrics is None else listen(metrics[0] or host or "0.0.0.0", metrics[1])
    if host is not None:
        net.bind_to(host)  # the attempts' RPC and c10d ports listen here only
    state_dir.mkdir(parents=True, exist_ok=True)
    c = Coordinator(state_dir, host, heartbeat_timeout, validate_memory_mib, max_code_mib << 20, limits)
    jobs_pb2_grpc.add_JobServiceServicer_to_server(JobService(c), server)
    workers_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerService(c), server)
    workers_pb2_grpc.add_WorkerDirectoryServicer_to_server(WorkerDirectory(c), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"gpipe: coordinator serving on {address}{note}, state in {state_dir}", file=sys.stderr, flush=True)
    exporter = Exporter(c.sup)
    if metrics_sock is not None:
        await exporter.start(metrics_sock)
        mhost, mport = metrics_sock.getsockname()[:2]
        print(f"gpipe: Prometheus metrics on http://{mhost}:{mport}/metrics", file=sys.stderr, flush=True)
    tasks = [asyncio.create_task(c.sup.serve_forever())]

    def died(task: asyncio.Task[None]) -> None:  # a bug of ours: the probes must see it
        if not task.cancelled():
            print(f"gpipe: the scheduler stopped: {task.exception()!r}; health is NOT_SERVING",
                  file=sys.stderr, flush=True)
            tasks.append(asyncio.ensure_future(health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)))

    tasks[0].add_done_callback(died)
    stop, term = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, term.set)
    if ready is not None:
        ready.set()
    await asyncio.wait([asyncio.ensure_future(stop.wait()), asyncio.ensure_future(term.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if term.is_set() and not stop.is_set():
        await _drain(c.sup, grace_s, stop)
    await health.enter_graceful_shutdown()
    c.stopping.set()
    c.sup.shutdown()
    exporter.close()
    await server.stop(grace=STOP_GRACE_S)
    for t in tasks:
        t.cancel()
    await c.template.close()
