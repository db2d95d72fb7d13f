"""`gpipe-worker`: a daemon that owns one device and serves one rank (stage index) of every job.

It registers with the coordinator, heartbeats, and takes commands: join an
attempt (it starts `python -m worker` in a child process for it) or abort one
(it kills that child's process group). It keeps nothing a restart would lose,
reconnects with backoff while the coordinator is away, and stays up between
jobs. A child process never outlives its attempt: a failed RPC world or
communicator is thrown away with it.

    gpipe-worker --rank 0 --coordinator 10.0.0.5:7000 [--host 10.0.0.6] [--device cuda:0]
        [--worker-token-file WORKER_TOKEN]

A rank held by a live worker is refused (ALREADY_EXISTS): the daemon waits
with backoff until it is free.

SIGTERM (a pod eviction, a spot reclaim) is a preemption: the daemon tells the
coordinator (Leave), whose job checkpoints at its next step boundary and ends
the attempt; once its attempt process has ended, or `--grace-s` (default 25 s)
has passed, the daemon exits 0. SIGINT stops it at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gpipe import proc
from gpipe.errors import EXIT_BAD_INPUT, GpipeError, SpecError, describe_os_error
from gpipe.service import code_archive, grpcutil, job_records, serde
from gpipe.service.code_archive import CodeError
from gpipe.service.v1 import workers_pb2, workers_pb2_grpc
from gpipe.worker.agent import WORKER_PRELOAD, Agent, worker_template
from gpipe.worker.cores import parse_cores, threads_for
from gpipe.worker.dataplane import unix_lane
from gpipe.worker.device import check as check_device

BACKOFF_S = (0.5, 1, 2, 4, 8)
STOP_GRACE_S = 0.2  # on SIGTERM, for health probes in flight
CODE_FETCH_TIMEOUT_S = 300.0  # a job's code archive, at most serve's --max-code-mib
CODE_KEPT = 16  # jobs' code archives kept in --log-dir/code, the newest
LEAVE_CALL_TIMEOUT_S = 5.0  # telling the coordinator of a SIGTERM


class Daemon:
    def __init__(self, a: argparse.Namespace, token: str | None):
        self.a, self.token = a, token
        # Attempt processes fork from a template that imported torch once (gpipe.service.zygote); it keeps no token.
        self.template = worker_template(dict(os.environ), a.threads, preload=WORKER_PRELOAD,
                                        hidden=(grpcutil.CLIENT_TOKEN_ENV, grpcutil.WORKER_TOKEN_ENV))
        self.agent = Agent(a.host, a.cores, a.threads, on_change=self._changed, template=self.template)
        self.changed = asyncio.Event()  # the attempt process ended or was killed: heartbeat at once
        self.log_dir = Path(a.log_dir)
        self.failures = 0  # since the last registration: picks the backoff
        self.session: tuple[workers_pb2_grpc.WorkerServiceStub, str] | None = None  # while registered
        self.leaving = False  # SIGTERM: a session that ends is not followed by another

    def _changed(self) -> None:
        self.changed.set()

    async def run(self) -> None:
        await self.template.start()
        await self.agent.prestart()
        while not self.leaving:
            try:
                await self._session()
            except grpc.RpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise GpipeError(grpcutil.describe(e, self.a.coordinator)) from None
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise SpecError(f"the coordinator refused this worker: {e.details()}") from None
                if code == grpc.StatusCode.ALREADY_EXISTS:  # another worker holds this rank: wait for it to go
                    self._say(f"registration refused: {e.details()}")
                else:
                    self._say(f"lost the coordinator at {self.a.coordinator}: "
                              f"{grpcutil.describe(e, self.a.coordinator)}")
            except ConnectionError as e:
                self._say(f"registering again: {e}")
            await self.agent.abort(self.agent.attempt_id)
            delay = BACKOFF_S[min(self.failures, len(BACKOFF_S) - 1)]
            self.failures += 1
            await asyncio.sleep(delay)

    async def _session(self) -> None:
        """One registration: take commands and heartbeat until either fails, whichever comes first."""
        async with grpcutil.channel(self.a.coordinator, self.token, self.a.tls_ca) as ch:
            stub = workers_pb2_grpc.WorkerServiceStub(ch)
            gpu = self.a.gpu
            reg = await stub.Register(workers_pb2.RegisterRequest(
                rank=self.a.rank, host=self.a.host, device=self.a.device, hostname=socket.gethostname(),
                cores=self.a.cores, threads=self.a.threads, device_name=gpu.name if gpu else "",
                device_memory_bytes=gpu.memory_bytes if gpu else 0, device_uuid=gpu.uuid if gpu else ""))
            self.failures = 0
            self.session = stub, reg.worker_id
            self._say(f"registered as rank {self.a.rank} with {self.a.coordinator}")
            tasks = [asyncio.ensure_future(self._commands(stub, reg.worker_id)),
                     asyncio.ensure_future(self._heartbeat(stub, reg.worker_id, reg.heartbeat_interval_s))]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()  # the failure that ended the session
            finally:
                self.session = None
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def leave(self, grace_s: float, stop: asyncio.Event) -> None:
        """Preempted (SIGTERM): tell the coordinator, then wait, within `grace_s` (or until `stop`), for the
        attempt process to end once its job has checkpointed; commands and heartbeats go on meanwhile."""
        t0 = time.monotonic()
        self.leaving = True
        session = self.session
        if session is None:
            self._say("SIGTERM: not registered: leaving")
            return
        stub, worker_id = session
        try:
            r = await stub.Leave(workers_pb2.LeaveRequest(worker_id=worker_id, grace_s=grace_s),
                                 timeout=min(LEAVE_CALL_TIMEOUT_S, grace_s))
        except grpc.RpcError as e:
            self._say(f"SIGTERM: could not tell the coordinator ({grpcutil.describe(e, self.a.coordinator)}): "
                      "leaving")
            return
        except asyncio.CancelledError:  # the call, not this task: the session's channel closed under it
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            self._say("SIGTERM: could not tell the coordinator (the connection closed): leaving")
            return
        if not r.checkpointing:
            self._say("SIGTERM: in no attempt: leaving")
            return
        self._say(f"SIGTERM: preempted: the job checkpoints at its next step boundary (grace {grace_s:g}s)")
        while self.agent.running() and not stop.is_set():
            left = grace_s - (time.monotonic() - t0)
            if left <= 0:
                self._say(f"the attempt did not end within the grace ({grace_s:g}s): leaving anyway; the job "
                          "resumes from its last good checkpoint")
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.1)):
                    await stop.wait()
        self._say(f"the attempt ended {time.monotonic() - t0:.2f}s after SIGTERM: leaving")

    async def _commands(self, stub: workers_pb2_grpc.WorkerServiceStub, worker_id: str) -> None:
        async for m in stub.Commands(workers_pb2.CommandsRequest(worker_id=worker_id)):
            cmd = serde.command_from_pb(m)
            if isinstance(cmd, job_records.Join):
                log = self.log_dir / f"attempt-{cmd.attempt_id}-stage-{cmd.rank}.log"
                try:
                    code_dir = await self._code(stub, worker_id, cmd.code_sha256) if cmd.code_sha256 else None
                except (CodeError, TimeoutError, OSError) as e:  # OSError: this worker's disk (--log-dir)
                    why = str(e) if isinstance(e, CodeError) else \
                        f"job code: no archive in {CODE_FETCH_TIMEOUT_S:.0f}s" if isinstance(e, TimeoutError) else \
                        f"job code: {describe_os_error(e)}"
                    self._say(f"attempt {cmd.attempt_id}: {why}")
                    await self.agent.fail(cmd, log, why)
                    continue
                await self.agent.join(cmd, log, code_dir)
                self._say(f"joined attempt {cmd.attempt_id} as rank {cmd.rank} of {cmd.world}")
            else:
                await self.agent.abort(cmd.attempt_id)
        raise ConnectionError("the coordinator ended this worker's command stream")

    async def _code(self, stub: workers_pb2_grpc.WorkerServiceStub, worker_id: str, sha256: str) -> Path:
        """The job's code, unpacked in this worker's scratch: fetched from the coordinator once, its hash checked."""
        store = code_archive.Store(self.log_dir / "code")
        if not store.has(sha256):
            upload = store.upload(code_archive.MAX_LIMIT_MIB << 20)
            try:
                async with asyncio.timeout(CODE_FETCH_TIMEOUT_S):
                    async for piece in stub.GetCode(workers_pb2.GetCodeRequest(worker_id=worker_id, sha256=sha256)):
                        upload.add(piece.data)
                got, size = upload.finish()
            except grpc.RpcError as e:
                upload.abort()
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    raise CodeError(f"job code: {e.details()}") from None
                raise
            except BaseException:
                upload.abort()
                raise
            if got != sha256:
                store.archive(got).unlink(missing_ok=True)
                raise CodeError(f"job code: the archive the coordinator sent ({size:,} bytes) does not match "
                                f"its hash {sha256[:12]}...")
            self._say(f"job code {sha256[:12]}: {size / 2**20:,.2f} MiB fetched")
            store.forget_unused({sha256}, keep=CODE_KEPT - 1)  # the scratch holds the newest few jobs' code
        return await asyncio.to_thread(store.unpacked, sha256)

    async def _heartbeat(self, stub: workers_pb2_grpc.WorkerServiceStub, worker_id: str, interval: float) -> None:
        while True:
            attempt_id, ended, code, error = self.agent.status()
            self.changed.clear()
            r = await stub.Heartbeat(workers_pb2.HeartbeatRequest(
                worker_id=worker_id, attempt_id=attempt_id, attempt_ended=ended, attempt_exit=code,
                attempt_error=error), timeout=10)
            if not r.known:
                raise ConnectionError("the coordinator forgot this worker")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.changed.wait()

    def _say(self, msg: str) -> None:
        print(f"gpipe-worker[{self.a.rank}]: {msg}", file=sys.stderr, flush=True)


async def _main(a: argparse.Namespace, token: str | None) -> None:
    health = health_aio.HealthServicer()
    server = grpc.aio.server(options=[grpcutil.NO_SHARED_PORT])
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if a.health_port is not None:
        grpcutil.listen(server, f"{a.health_host}:{a.health_port}", "--health-port")
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"gpipe-worker[{a.rank}]: data-plane address {a.address_note}", file=sys.stderr, flush=True)
    d = Daemon(a, token)
    stop, term = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, term.set)
    task = asyncio.create_task(d.run())
    done, _ = await asyncio.wait([task, asyncio.create_task(stop.wait()), asyncio.create_task(term.wait())],
                                 return_when=asyncio.FIRST_COMPLETED)
    if term.is_set() and task not in done:
        await d.leave(a.grace_s, stop)
    task.cancel()
    await d.agent.close()
    await d.template.close()
    await server.stop(grace=STOP_GRACE_S)
    if task in done and task.exception():
        raise task.exception()  # type: ignore[misc]  # a done task with an exception: not None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpipe-worker", description="A gpipe worker daemon: one device, one rank.")
    p.add_argument("--rank", type=int, default=None, help="this worker's stage index (default: env RANK)")
    p.add_argument("--coordinator", default=os.environ.get("GPIPE_COORDINATOR"),
                   help="the coordinator's HOST:PORT (default: env GPIPE_COORDINATOR)")
    p.add_argument("--host", default=None,
                   help="the cluster-network address the attempt's RPC and c10d ports listen on (default: "
                        "this machine's address on the route to the coordinator)")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda:K, checked at start (a GPU torch does not see here: exit 2)")
    p.add_argument("--cores", default=None,
                   help="the CPU cores its stages run on, e.g. 0-3,8 (default: all this process may use); "
                        "threads: one per core, or OMP_NUM_THREADS")
    p.add_argument("--health-port", type=int, default=None, help="serve grpc.health.v1 on this port")
    p.add_argument("--health-host", default="0.0.0.0", help="where the health port listens")
    p.add_argument("--log-dir", default=os.environ.get("GPIPE_WORKER_LOG_DIR", "gpipe-worker-logs"),
                   help="attempt logs, and the code of the jobs it ran (scratch: nothing here is needed after a "
                        "restart)")
    p.add_argument("--worker-token-file", "--auth-token-file", default=None,
                   help="the worker token, serve's --worker-token-file (default: env GPIPE_WORKER_TOKEN)")
    p.add_argument("--tls-ca", default=None, help="CA certificate of the coordinator's TLS")
    p.add_argument("--grace-s", type=float, default=grpcutil.DEFAULT_GRACE_S, metavar="SECONDS",
                   help="on SIGTERM, how long to wait for the job to checkpoint at its next step boundary before "
                        f"exiting ({grpcutil.MIN_GRACE_S:g}-{grpcutil.MAX_GRACE_S:g}; default "
                        f"{grpcutil.DEFAULT_GRACE_S:g}, under Kubernetes' 30 s terminationGracePeriodSeconds)")
    p.add_argument("--same-host-lanes", choices=unix_lane.MODES, default=None,
                   help="how activations and gradients go to a worker of this host (same network namespace): "
                        "unix, a Unix socket of the attempt (default); c10d, gloo as between hosts (default: env "
                        f"{unix_lane.MODE_ENV}, else unix). CPU only: CUDA stages use NCCL")
    a = p.parse_args(argv)
    try:
        if a.same_host_lanes is not None:  # the attempt processes read it
            os.environ[unix_lane.MODE_ENV] = a.same_host_lanes
        unix_lane.mode()  # a bad env value: one line, exit 2
        if a.rank is None:
            env = os.environ.get("RANK", "")
            if not env.strip().lstrip("-").isdigit():
                raise GpipeError("--rank is required (or env RANK), the stage index this worker serves")
            a.rank = int(env)
        if not 0 <= a.rank <= grpcutil.MAX_RANK:
            raise GpipeError(f"--rank: must be 0-{grpcutil.MAX_RANK}, got {a.rank}")
        if not a.coordinator:
            raise GpipeError("--coordinator HOST:PORT is required (or env GPIPE_COORDINATOR)")
        grpcutil.check_grace(a.grace_s)
        a.cores = parse_cores(a.cores) if a.cores else sorted(os.sched_getaffinity(0))
        a.threads = threads_for(a.cores)
        a.gpu = check_device(a.device)  # before registering: a worker without its GPU never joins
        from gpipe.service import net

        if a.host is None:
            try:
                a.host = net.route_source(a.coordinator)
            except ValueError as e:
                raise GpipeError(f"--coordinator: {e}") from None
            a.address_note = (f"{a.host}, the address that routes to the coordinator at {a.coordinator} "
                              "(--host overrides)")
        else:
            net.iface_for(a.host)
            a.address_note = f"{a.host} (--host)"
        token = grpcutil.read_token(a.worker_token_file, "--worker-token-file", grpcutil.WORKER_TOKEN_ENV)
        grpcutil.forget_tokens()  # read: no attempt process inherits it
    except (GpipeError, ValueError) as e:
        print(f"gpipe-worker: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        asyncio.run(_main(a, token))
    except GpipeError as e:  # the port is taken, or the coordinator refused this worker
        print(f"gpipe-worker: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    proc.exit_now(0)  # stopped, its attempt processes killed: no interpreter teardown (gRPC's threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
