"""`gpipe-worker`: a daemon that owns one device and serves one rank (stage index) of every job.

It registers with the coordinator, heartbeats, and takes commands: join an
attempt (it starts `python -m gpipe.worker` in a child process for it) or abort one
(it kills that child's process group). It keeps nothing a restart would lose,
reconnects with backoff while the coordinator is away, and stays up between
jobs. A child process never outlives its attempt: a failed RPC world or
communicator is thrown away with it.

    gpipe-worker --rank 0 --coordinator 10.0.0.5:7000 [--host 10.0.0.6] [--device cuda:0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gpipe import grpcutil, serde
from gpipe.errors import EXIT_BAD_INPUT, GpipeError
from gpipe.proc import child_env
from gpipe.v1 import workers_pb2, workers_pb2_grpc

BACKOFF_S = (0.5, 1, 2, 4, 8)


class Daemon:
    def __init__(self, a: argparse.Namespace, token: str | None):
        self.a, self.token = a, token
        self.child: asyncio.subprocess.Process | None = None
        self.child_attempt = ""
        self.child_exit: int | None = None
        self.log_dir = Path(a.log_dir)

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                await self._session()
                failures = 0
            except grpc.RpcError as e:
                self._say(f"lost the coordinator at {self.a.coordinator}: {grpcutil.describe(e, self.a.coordinator)}")
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise SystemExit(1) from None
            except ConnectionError as e:
                self._say(f"registering again: {e}")
            await self._kill_child()
            delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
            failures += 1
            await asyncio.sleep(delay)

    async def _session(self) -> None:
        async with grpcutil.channel(self.a.coordinator, self.token, self.a.tls_ca) as ch:
            stub = workers_pb2_grpc.WorkerServiceStub(ch)
            reg = await stub.Register(workers_pb2.RegisterRequest(
                rank=self.a.rank, host=self.a.host, device=self.a.device, hostname=socket.gethostname()))
            self._say(f"registered as rank {self.a.rank} with {self.a.coordinator}")
            beat = asyncio.create_task(self._heartbeat(stub, reg.worker_id, reg.heartbeat_interval_s))
            try:
                async for m in stub.Commands(workers_pb2.CommandsRequest(worker_id=reg.worker_id)):
                    cmd = serde.command_from_pb(m)
                    if isinstance(cmd, serde.Join):
                        await self._join(cmd)
                    elif cmd.attempt_id == self.child_attempt:
                        await self._kill_child()
                    if beat.done():
                        beat.result()
            finally:
                beat.cancel()

    async def _heartbeat(self, stub, worker_id: str, interval: float) -> None:
        while True:
            ended = self.child_exit is not None
            r = await stub.Heartbeat(workers_pb2.HeartbeatRequest(
                worker_id=worker_id, attempt_id=self.child_attempt, attempt_ended=ended,
                attempt_exit=self.child_exit or 0), timeout=10)
            if not r.known:
                raise ConnectionError("the coordinator forgot this worker")
            await asyncio.sleep(interval)

    async def _join(self, j: serde.Join) -> None:
        await self._kill_child()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"attempt-{j.attempt_id}-stage-{j.stage}.log", "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        from gpipe.coordinator.local import MALLOC_ENV

        for k, v in MALLOC_ENV.items():
            env.setdefault(k, v)
        # On a CPU the stage's device is this worker's cores: one thread each, unless OMP_NUM_THREADS says.
        env.setdefault("OMP_NUM_THREADS", str(len(self.a.cores)))
        self.child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpipe.worker", "--stage", str(j.stage), "--stages", str(j.stages),
            "--master", j.master, "--host", self.a.host, "--start-timeout", str(j.start_timeout_s),
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            env=child_env(env, self.a.cores),
        )
        log.close()
        self.child_attempt, self.child_exit = j.attempt_id, None
        self._say(f"joined attempt {j.attempt_id} as stage {j.stage} of {j.stages}")
        asyncio.create_task(self._reap(self.child))

    async def _reap(self, child: asyncio.subprocess.Process) -> None:
        code = await child.wait()
        if child is self.child:
            self.child_exit = code

    async def _kill_child(self) -> None:
        child, self.child = self.child, None
        if child is not None and child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            await child.wait()
        self.child_attempt, self.child_exit = "", None

    def _say(self, msg: str) -> None:
        print(f"gpipe-worker[{self.a.rank}]: {msg}", file=sys.stderr, flush=True)


async def _main(a: argparse.Namespace, token: str | None) -> None:
    health = health_aio.HealthServicer()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if a.health_port is not None:
        server.add_insecure_port(f"{a.health_host}:{a.health_port}")
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
    d = Daemon(a, token)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(d.run())
    done, _ = await asyncio.wait([task, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    task.cancel()
    await d._kill_child()
    await server.stop(grace=1)
    if task in done and task.exception():
        raise task.exception()  # type: ignore[misc]


def parse_cores(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8], each a core this process may use."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise GpipeError(f"--cores: {text!r} is not a list of cores such as 0-3,8") from None
    allowed = os.sched_getaffinity(0)
    if not cores or not cores <= allowed:
        raise GpipeError(f"--cores: {text!r} names cores outside {sorted(allowed)}")
    return sorted(cores)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpipe-worker", description="A gpipe worker daemon: one device, one rank.")
    p.add_argument("--rank", type=int, default=None, help="this worker's stage index (default: env RANK)")
    p.add_argument("--coordinator", default=os.environ.get("GPIPE_COORDINATOR"),
                   help="the coordinator's HOST:PORT (default: env GPIPE_COORDINATOR)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the cluster-network address the attempt's RPC and c10d ports listen on")
    p.add_argument("--device", default="cpu", help="cpu or cuda:K")
    p.add_argument("--cores", default=None,
                   help="the CPU cores its stages run on, e.g. 0-3,8 (default: all this process may use); "
                        "threads: one per core, or OMP_NUM_THREADS")
    p.add_argument("--health-port", type=int, default=None, help="serve grpc.health.v1 on this port")
    p.add_argument("--health-host", default="0.0.0.0", help="where the health port listens")
    p.add_argument("--log-dir", default=os.environ.get("GPIPE_WORKER_LOG_DIR", "gpipe-worker-logs"),
                   help="attempt logs (scratch: nothing here is needed after a restart)")
    p.add_argument("--auth-token-file", default=None, help="the shared token (default: env GPIPE_TOKEN)")
    p.add_argument("--tls-ca", default=None, help="CA certificate of the coordinator's TLS")
    a = p.parse_args(argv)
    try:
        if a.rank is None:
            env = os.environ.get("RANK", "")
            if not env.strip().lstrip("-").isdigit():
                raise GpipeError("--rank is required (or env RANK), the stage index this worker serves")
            a.rank = int(env)
        if a.rank < 0:
            raise GpipeError(f"--rank: must be 0 or more, got {a.rank}")
        if not a.coordinator:
            raise GpipeError("--coordinator HOST:PORT is required (or env GPIPE_COORDINATOR)")
        a.cores = parse_cores(a.cores) if a.cores else sorted(os.sched_getaffinity(0))
        if a.device != "cpu" and not a.device.startswith("cuda"):
            raise GpipeError(f"--device: {a.device!r} is neither cpu nor cuda:K")
        from gpipe import net

        net.iface_for(a.host)
        token = grpcutil.read_token(a.auth_token_file)
    except (GpipeError, ValueError) as e:
        print(f"gpipe-worker: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        asyncio.run(_main(a, token))
    except SystemExit as e:
        return int(e.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
