"""serve's WorkerService (register, heartbeat, commands, leave, code) and WorkerDirectory (for `status`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from gpipe.coordinator.server.submissions import Coordinator, Stopping, until_stopping
from gpipe.coordinator.supervisor.records import Worker
from gpipe.coordinator.supervisor.registry import HEARTBEAT_INTERVAL_S, RankTaken
from gpipe.errors import SpecError
from gpipe.service import code_archive, grpcutil, serde
from gpipe.service.grpcutil import Context
from gpipe.service.job_records import SHA256_RE, Abort, Join
from gpipe.service.v1 import workers_pb2, workers_pb2_grpc
from gpipe.text import printable
from gpipe.worker.device import DEVICE_RE, Gpu

# Bounds on worker requests: a field out of range is INVALID_ARGUMENT naming it.
MAX_HOSTNAME, MAX_HOST, MAX_DEVICE, MAX_ID = 253, 255, 64, 64
MAX_CORES, MAX_THREADS = 4096, 4096
MAX_ATTEMPT_ERROR = 4096  # a longer attempt_error is cut


def _bad_registration(r: workers_pb2.RegisterRequest) -> str | None:
    """The first field of a registration out of range, named, or None."""
    if not 0 <= r.rank <= grpcutil.MAX_RANK:
        return f"rank: must be 0-{grpcutil.MAX_RANK}, got {r.rank}"
    for field, value, limit in (("host", r.host, MAX_HOST), ("device", r.device, MAX_DEVICE)):
        if len(value) > limit:
            return f"{field}: at most {limit} characters, got {len(value)}"
        if not value.isprintable() or " " in value:
            return f"{field}: '{printable(value, 80)}' has spaces or control characters"
    if not r.host:
        return "host: required (the address its attempt processes listen on)"
    if r.device and r.device != "cpu" and DEVICE_RE.fullmatch(r.device) is None:
        return f"device: '{printable(r.device, 80)}' is neither cpu nor cuda:K"
    if len(r.device_name) > MAX_HOSTNAME or not r.device_name.isprintable():
        return f"device_name: at most {MAX_HOSTNAME} printable characters"
    if len(r.device_uuid) > MAX_DEVICE or not r.device_uuid.isprintable():
        return f"device_uuid: at most {MAX_DEVICE} printable characters"
    if r.device_memory_bytes < 0:
        return f"device_memory_bytes: must be 0 or more, got {r.device_memory_bytes}"
    if len(r.hostname) > MAX_HOSTNAME:
        return f"hostname: at most {MAX_HOSTNAME} characters, got {len(r.hostname)}"
    if len(r.cores) > MAX_CORES:
        return f"cores: at most {MAX_CORES} entries, got {len(r.cores)}"
    if (bad := next((c for c in r.cores if not 0 <= c < MAX_CORES), None)) is not None:
        return f"cores: each must be 0-{MAX_CORES - 1}, got {bad}"
    if not 1 <= r.threads <= MAX_THREADS:
        return f"threads: must be 1-{MAX_THREADS}, got {r.threads}"
    return None


def _bad_id(field: str, value: str) -> str | None:
    if len(value) > MAX_ID or not value.isalnum() and value:
        return f"{field}: '{printable(value, 80)}' is not an id (at most {MAX_ID} letters and digits)"
    return None


class WorkerService(workers_pb2_grpc.WorkerServiceServicer):
    def __init__(self, c: Coordinator):
        self.c = c
        self.streaming: set[str] = set()  # the workers whose command stream is open

    async def Register(self, request: workers_pb2.RegisterRequest, context: Context) -> workers_pb2.RegisterResponse:
        if (why := _bad_registration(request) or _unreachable(request, context.peer())) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        sup, rank = self.c.sup, request.rank
        if (n := sup.limits.max_workers) is not None and rank >= n:  # the pool's size is a promise to submit
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"rank: this pool's workers are ranks 0-{n - 1} (serve --max-workers {n}), got {rank}")
        old = sup.workers.get(rank)
        if (old is not None and old.id not in self.streaming  # registered, but never took its commands
                and sup.clock.monotonic() - old.registered > sup.heartbeat_timeout / 2):
            sup.drop(old, f"{sup.worker_name(old)} registered again before it took its commands")
        try:
            gpu = Gpu(request.device_name, request.device_memory_bytes, request.device_uuid) \
                if request.device.startswith("cuda") else None
            w = sup.register(rank, request.host, request.device, printable(request.hostname, MAX_HOSTNAME),
                             list(request.cores), request.threads, gpu)
        except RankTaken as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        return workers_pb2.RegisterResponse(worker_id=w.id, heartbeat_interval_s=HEARTBEAT_INTERVAL_S)

    async def Heartbeat(self, request: workers_pb2.HeartbeatRequest, context: Context) -> workers_pb2.HeartbeatResponse:
        for field in ("worker_id", "attempt_id"):
            if (why := _bad_id(field, getattr(request, field))) is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        known = self.c.sup.heartbeat(request.worker_id, request.attempt_id, request.attempt_ended,
                                     request.attempt_exit, printable(request.attempt_error, MAX_ATTEMPT_ERROR))
        return workers_pb2.HeartbeatResponse(known=known)

    async def Commands(self, request: workers_pb2.CommandsRequest, context: Context) -> AsyncIterator[workers_pb2.WorkerCommand]:
        if (why := _bad_id("worker_id", request.worker_id)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        w = self.c.sup.worker(request.worker_id)
        if w is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "worker_id: unknown worker: register again")
            return
        if w.id in self.streaming:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, "worker_id: its command stream is open already")
        self.streaming.add(w.id)
        try:
            await context.send_initial_metadata(())  # the worker may know its stream is open
            async for cmd in until_stopping(self.c.stopping, _commands(w)):
                yield serde.command_to_pb(cmd)
        except Stopping as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except asyncio.CancelledError:
            # The worker hung up: its daemon died (or restarted). Its rank waits for the next one.
            if self.c.sup.workers.get(w.rank) is w:
                self.c.sup.drop(w, f"{self.c.sup.worker_name(w)} disconnected")
            raise
        finally:
            self.streaming.discard(w.id)


    async def Leave(self, request: workers_pb2.LeaveRequest, context: Context) -> workers_pb2.LeaveResponse:
        if (why := _bad_id("worker_id", request.worker_id)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        try:
            grpcutil.check_grace(request.grace_s, "grace_s")
        except SpecError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        checkpointing = self.c.sup.preempt_worker(request.worker_id, request.grace_s)
        if checkpointing is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "worker_id: unknown worker: register again")
        return workers_pb2.LeaveResponse(checkpointing=bool(checkpointing))

    async def GetCode(self, request: workers_pb2.GetCodeRequest, context: Context) -> AsyncIterator[workers_pb2.CodePiece]:
        if (why := _bad_id("worker_id", request.worker_id)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        if self.c.sup.worker(request.worker_id) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "worker_id: unknown worker: register again")
        store = self.c.table.code
        if not SHA256_RE.fullmatch(request.sha256) or not store.has(request.sha256):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"sha256: '{printable(request.sha256, 80)}' names no code archive this coordinator holds")
        with store.archive(request.sha256).open("rb") as f:
            while piece := await asyncio.to_thread(f.read, code_archive.CHUNK_BYTES):
                yield workers_pb2.CodePiece(data=piece)


class WorkerDirectory(workers_pb2_grpc.WorkerDirectoryServicer):
    """The registered workers, for clients (`status`): it takes the client token."""

    def __init__(self, c: Coordinator):
        self.c = c

    async def ListWorkers(self, request: workers_pb2.ListWorkersRequest,
                          context: Context) -> workers_pb2.ListWorkersResponse:
        held = {a.id: a.job for a in self.c.sup.attempts.values()}  # attempt -> its job
        return workers_pb2.ListWorkersResponse(workers=[
            workers_pb2.RegisteredWorker(
                rank=w.rank, hostname=w.hostname, host=w.host, device=w.device, attempt_id=w.attempt_id or "",
                device_name=w.gpu.name if w.gpu else "", device_memory_bytes=w.gpu.memory_bytes if w.gpu else 0,
                threads=w.threads, job=held.get(w.attempt_id or "", ""), leaving=w.leaving)
            for _, w in sorted(self.c.sup.workers.items())])


async def _commands(w: Worker) -> AsyncIterator[Join | Abort]:
    """A worker's commands, until it is dropped."""
    while (cmd := await w.commands.get()) is not None:
        yield cmd



def _unreachable(r: workers_pb2.RegisterRequest, peer: str) -> str | None:
    """Why the worker's data-plane address cannot be reached by its peers, if we can tell: a loopback
    address from a worker that calls from another host."""
    from gpipe.service import net

    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    seen = rest.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
    if net.is_loopback(r.host) and not (seen.startswith("127.") or seen == "::1"):
        return (f"host: rank {r.rank} ({printable(r.hostname, MAX_HOSTNAME)}) gave {r.host!r} as its data-plane "
                f"address, but it calls from {seen}: its peers cannot reach {r.host}. Start gpipe-worker without "
                f"--host (it takes the address that routes to the coordinator), or with --host {seen}")
    return None
