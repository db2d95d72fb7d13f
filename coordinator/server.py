"""`gpipe-coordinator serve`: the gRPC job and worker APIs, and the job table on disk.

Jobs, workers and attempts are the supervisor's (coordinator.supervisor,
the same one `run` uses); this module turns gRPC calls into its calls. A
submitted spec is validated in a throwaway process (its model and data are
user code), then queued. Every state change is written to
<state-dir>/<name>/job.json, so a restarted coordinator lists past jobs, and
resumes running ones once their workers have reconnected.

    gpipe-coordinator serve --port 7000 --state-dir /var/lib/gpipe [--host 10.0.0.5]
        [--auth-token-file CLIENT_TOKEN --worker-token-file WORKER_TOKEN]

Every request is bounded before it is used (sizes, ranges, names), every
string from one is escaped before it is logged, and heavy work (parsing,
validating) runs off the event loop, a few at a time.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import os
import shutil
import signal
import sys
import tempfile
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from coordinator.launcher import COORDINATOR_PRELOAD, ProcessLauncher
from coordinator.outputs import prepare_output
from coordinator.spec import MAX_SPEC_BYTES, NAME_RE, JobSpec, parse_spec
from coordinator.supervisor import (
    EVENT_WINDOW,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    RankTaken,
    Supervisor,
    Worker,
)
from gpipe import code_archive, grpcutil, serde
from gpipe.errors import EXIT_BAD_INPUT, GpipeError, SpecError, describe_os_error
from gpipe.files import atomic_write_json, naming
from gpipe.serde import SHA256_RE, Abort, JobRecord, JobState, Join, StateChange
from gpipe.text import printable
from gpipe.v1 import jobs_pb2, jobs_pb2_grpc, workers_pb2, workers_pb2_grpc
from gpipe.zygote import Template
from worker.device import DEVICE_RE, Gpu

VALIDATE_TIMEOUT_S = 120.0
MIN_VALIDATE_MEMORY_MIB, MAX_VALIDATE_MEMORY_MIB = 256, 1 << 22  # serve --validate-memory-mib's range


def default_validate_memory_mib() -> int:
    """A quarter of this machine's memory: the two validations that run at once take half at most."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    return max(MIN_VALIDATE_MEMORY_MIB, min(MAX_VALIDATE_MEMORY_MIB, total // 4))
MAX_MESSAGE_BYTES = 2 << 20  # gRPC itself refuses a bigger request (RESOURCE_EXHAUSTED)
VALIDATIONS_RUNNING, VALIDATIONS_WAITING = 2, 8  # past both, a submission is RESOURCE_EXHAUSTED
CODE_DIR = ".code"  # <state-dir>/.code/: job code archives by SHA-256 (no job name starts with a dot)
UPLOADS_AT_ONCE = 4  # code archives being received; past it, RESOURCE_EXHAUSTED
UPLOAD_TIMEOUT_S = 300.0  # one archive's upload: a stream that stalls gives its slot back
SPARE_ARCHIVES = 8  # archives kept that no job names (uploaded, not yet submitted); older ones are dropped
SECRET_ENV = (grpcutil.CLIENT_TOKEN_ENV, grpcutil.WORKER_TOKEN_ENV)  # never handed to a validation process
STOP_GRACE_S = 0.5  # on SIGTERM, how long calls in flight may finish (streams never do)
ERROR_TAIL_BYTES = 64 << 10  # what is read of a failed validation's stderr
# Bounds on worker requests: a field out of range is INVALID_ARGUMENT naming it.
MAX_HOSTNAME, MAX_HOST, MAX_DEVICE, MAX_ID = 253, 255, 64, 64
MAX_CORES, MAX_THREADS = 4096, 4096
MAX_ATTEMPT_ERROR = 4096  # a longer attempt_error is cut
MAX_WIRE_INT = 2**63 - 1
T = TypeVar("T")
Context = grpc.aio.ServicerContext[Any, Any]  # a call's: its request and response types vary by method
Handler = Any  # a method's handler, or None: grpc's stubs type its behaviours as sync, not the coroutines aio holds
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Handler]]


class JobTable:
    """The job table on disk: <state-dir>/<name>/job.json, one record per job, replaced atomically."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.code = code_archive.Store(state_dir / CODE_DIR)

    def code_dir(self, job: JobRecord) -> Path:
        """Where the job's modules are imported from: its code archive, unpacked (CodeError if it is broken);
        a job that sent none, its output folder (with its job.yaml)."""
        return self.code.unpacked(job.code_sha256) if job.code_sha256 else Path(job.output_dir)

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
        for d in sorted(self.state_dir.iterdir()):
            path = d / "job.json"
            try:
                if not d.is_dir() or not path.exists():  # PermissionError: a folder we may not read
                    continue
                job = JobRecord.from_json(json.loads(path.read_text()))
                if job.name != d.name:
                    raise ValueError(f"it names job {job.name!r}, not {d.name!r}")
                records.append((job, parse_spec(job.spec_yaml), self.code_dir(job)))
            except (OSError, ValueError, KeyError, TypeError, RecursionError, SpecError) as e:
                what = "broken job code of" if isinstance(e, code_archive.CodeError) else "unreadable job record"
                why = f"{what} {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                print(f"gpipe: skipping {why}", file=sys.stderr, flush=True)
                if not NAME_RE.fullmatch(d.name):
                    continue  # not a job's folder (lost+found, say): said, and left alone
                when = 0.0
                with contextlib.suppress(OSError):
                    when = path.stat().st_mtime
                broken.append(JobRecord(name=d.name, spec_yaml="", steps=0, state=JobState.FAILED, history=[
                    StateChange(JobState.FAILED, when, why)], error=why, output_dir=str(d),
                    exit_code=EXIT_BAD_INPUT))
        for job, spec, code_dir in sorted(records, key=lambda r: r[0].history[0].time_unix if r[0].history else 0.0):
            out = Path(job.output_dir)
            events, older = _replay(job)
            sup.add(job, spec, out / "job.yaml", code_dir, events=events, older=older)
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
            events.append(serde.metrics_event(json.loads(x)))
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

    def __init__(self, state_dir: Path, host: str | None, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
                 validate_memory_mib: int | None = None, max_code_bytes: int = code_archive.DEFAULT_LIMIT_MIB << 20):
        self.state_dir = state_dir
        self.max_code_bytes = max_code_bytes
        self.uploads = 0  # code archives being received
        self.validate_memory_mib = validate_memory_mib or default_validate_memory_mib()
        self.table = JobTable(state_dir)
        # Attempt processes fork from a template that imported torch once (gpipe.zygote); it keeps no token.
        self.template = Template(os.environ, preload=COORDINATOR_PRELOAD, hidden=SECRET_ENV)
        self.sup = Supervisor(ProcessLauncher(state_dir, host,
                                              lambda name: state_dir / name / "logs" / "coordinator.log",
                                              template=self.template),
                              self.table, heartbeat_timeout=heartbeat_timeout)
        self.table.load(self.sup)
        self.validations = asyncio.Semaphore(VALIDATIONS_RUNNING)
        self.admitted = 0  # submissions being parsed, validated or waiting to be
        self.validating: dict[str, int] = {}  # code archives of those submissions: kept while they are
        self.stopping = asyncio.Event()  # set on SIGTERM: calls in flight end UNAVAILABLE

    async def upload(self, pieces: AsyncIterator[bytes]) -> tuple[str, int]:
        """Keep a job's code archive, checked to unpack safely: (its SHA-256, its size). CodeError or Busy."""
        if self.uploads >= UPLOADS_AT_ONCE:
            raise Busy(f"{self.uploads} code archives are being sent (at most {UPLOADS_AT_ONCE} at once): "
                       "try again later")
        self.uploads += 1
        try:
            upload = self.table.code.upload(self.max_code_bytes)
            try:
                async with asyncio.timeout(UPLOAD_TIMEOUT_S):
                    async for piece in pieces:
                        upload.add(piece)
            except TimeoutError:
                upload.abort()
                raise code_archive.CodeError(f"job code: the upload took longer than {UPLOAD_TIMEOUT_S:.0f}s") from None
            except BaseException:
                upload.abort()
                raise
            sha, size = upload.finish()
            try:
                await asyncio.to_thread(self.table.code.unpacked, sha)  # unsafe or damaged: refused now
            except code_archive.CodeError:
                if sha not in self._code_in_use():
                    self.table.code.archive(sha).unlink(missing_ok=True)
                raise
        finally:
            self.uploads -= 1
        self.table.code.forget_unused(self._code_in_use() | {sha}, keep=SPARE_ARCHIVES)
        return sha, size

    def _code_in_use(self) -> set[str]:
        """The archives that jobs name, and those of submissions still being validated."""
        return {e.record.code_sha256 for e in self.sup.jobs.values() if e.record.code_sha256} | set(self.validating)

    async def submit(self, spec_yaml: str, code_sha256: str = "") -> JobRecord:
        """Parse a spec off the event loop, validate it (a few at a time, importing from its code archive
        when it names one) and queue it.

        SpecError, FileExistsError or Busy say why not.
        """
        size = len(spec_yaml.encode())
        if size > MAX_SPEC_BYTES:
            raise SpecError(f"spec_yaml: {size:,} bytes is over the limit of {MAX_SPEC_BYTES:,} (1 MiB)")
        if code_sha256 and not (SHA256_RE.fullmatch(code_sha256) and self.table.code.has(code_sha256)):
            raise SpecError(f"code_sha256: '{printable(code_sha256, 80)}' names no code archive this coordinator "
                            "holds (UploadCode first)")
        if self.admitted >= VALIDATIONS_RUNNING + VALIDATIONS_WAITING:
            raise Busy(f"{self.admitted} submissions are being validated or waiting (at most "
                       f"{VALIDATIONS_RUNNING} at once, {VALIDATIONS_WAITING} waiting): try again later")
        self.admitted += 1
        if code_sha256:
            self.validating[code_sha256] = self.validating.get(code_sha256, 0) + 1
        try:
            spec = await asyncio.to_thread(_parse, spec_yaml)
            self._unused(spec.name)
            async with self.validations:
                if self.stopping.is_set():
                    raise Stopping("the coordinator is stopping")
                code_dir = await asyncio.to_thread(self.table.code.unpacked, code_sha256) if code_sha256 else None
                await self._validate(spec_yaml, code_dir)
        finally:
            self.admitted -= 1
            if code_sha256:
                self.validating[code_sha256] -= 1
                if not self.validating[code_sha256]:
                    del self.validating[code_sha256]
        self._unused(spec.name)  # submitted twice while validating
        out = self.state_dir / spec.name
        job = JobRecord(name=spec.name, spec_yaml=spec_yaml, steps=spec.steps, output_dir=str(out),
                        code_sha256=code_sha256)
        try:
            with naming(out / "job.yaml"):
                prepare_output(spec.name, self.state_dir, fresh=True)  # the directory holds nothing of ours
                (out / "job.yaml").write_text(spec_yaml)
                self.table.save(job)  # first: a job that cannot be recorded is not taken
        except OSError as e:
            shutil.rmtree(out, ignore_errors=True)
            raise DiskError(f"cannot take the job: {describe_os_error(e)}") from None
        self.sup.add(job, spec, out / "job.yaml", code_dir or out, fresh=True)  # a new job: nothing to resume from
        return job

    def _unused(self, name: str) -> None:
        if name in self.sup.jobs:
            raise FileExistsError(f"a job named {name!r} exists already")
        d = self.state_dir / name
        if d.is_dir() and any(d.iterdir()):  # files of a job serve does not know (its job.json is gone)
            raise FileExistsError(f"{d} holds the files of another job: move them away, or pick another name")

    async def _validate(self, spec_yaml: str, code_dir: Path | None) -> None:
        """The checks that need the model and the data, in a throwaway process: user code stays out of here.

        The process is `gpipe-coordinator validate`, forked from the attempts' template (torch imported
        once, not per submission). It gets none of serve's secrets: no token in its environment, no file or
        socket of serve's open; its memory is bounded (--validate-memory-mib), its time by VALIDATE_TIMEOUT_S.
        """
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        with tempfile.TemporaryDirectory() as d:
            path, err_path = Path(d) / "job.yaml", Path(d) / "stderr"
            path.write_text(spec_yaml)
            with err_path.open("wb") as err:
                proc = await self.template.spawn(
                    "coordinator.cli",
                    ["validate", str(path), "--memory-mib", str(self.validate_memory_mib), "--skip-gpu-check",
                     *(["--code-dir", str(code_dir)] if code_dir else [])],
                    env, stderr=err.fileno())
            try:
                async with asyncio.timeout(VALIDATE_TIMEOUT_S):
                    await _unless(self.stopping, proc.wait())
            except TimeoutError:
                raise SpecError(f"model: building the model took longer than {VALIDATE_TIMEOUT_S:.0f}s") from None
            finally:  # timed out, or serve is stopping
                if proc.returncode is None:
                    proc.kill()
                    await asyncio.shield(proc.wait())
            if proc.returncode:
                with err_path.open("rb") as f:
                    f.seek(max(0, err_path.stat().st_size - ERROR_TAIL_BYTES))
                    lines = f.read().decode(errors="replace").strip().splitlines()
                raise SpecError(lines[-1].removeprefix("error: ") if lines else "the spec failed validation")


class DiskError(GpipeError):
    """The state dir cannot take a new job (full, read-only): nothing was queued."""


class Busy(GpipeError):
    """Too many submissions at once: RESOURCE_EXHAUSTED."""


class Stopping(GpipeError):
    """serve is stopping: calls in flight end UNAVAILABLE, each by itself, rather than cancelled by gRPC."""


async def _unless(stopping: asyncio.Event, aw: Awaitable[T]) -> T:
    """`aw`'s result; Stopping (and `aw` cancelled) if `stopping` is set first."""
    task, stop = asyncio.ensure_future(aw), asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise Stopping("the coordinator is stopping")
        return task.result()
    finally:
        task.cancel()
        stop.cancel()


async def _until_stopping(stopping: asyncio.Event, items: AsyncIterator[T]) -> AsyncIterator[T]:
    """The items of `items`, until `stopping` is set: then Stopping."""
    while True:
        try:
            item = await _unless(stopping, anext(items))
        except StopAsyncIteration:
            return
        yield item


def _parse(spec_yaml: str) -> JobSpec:
    """parse_spec, for a worker thread; a job name must be a whole line."""
    try:
        spec = parse_spec(spec_yaml)
    except RecursionError:
        raise SpecError("job spec: nested too deeply") from None
    if spec.steps > MAX_WIRE_INT:  # it travels as an int64: a bigger one would break ListJobs for everyone
        raise SpecError(f"steps: must be at most {MAX_WIRE_INT}, got {spec.steps}")
    if not NAME_RE.fullmatch(spec.name):
        raise SpecError(f"name: '{printable(spec.name, 80)}' must be 1-64 letters, digits, '.', '_' or '-', "
                        "starting with a letter or digit")
    return spec


# -- gRPC --------------------------------------------------------------------------------


def _bad_name(name: str) -> str | None:
    """Why `name` cannot name a job, or None."""
    if NAME_RE.fullmatch(name):
        return None
    return (f"name: '{printable(name, 80)}' is not a job name: 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit")


class JobService(jobs_pb2_grpc.JobServiceServicer):
    def __init__(self, c: Coordinator):
        self.c = c

    async def _job(self, name: str, context: Context) -> JobRecord:
        if (why := _bad_name(name)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        if name not in self.c.sup.jobs:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job named {name!r}")
        return self.c.sup.record(name)

    async def UploadCode(self, requests: AsyncIterator[jobs_pb2.CodeChunk], context: Context) -> jobs_pb2.CodeRef:
        async def pieces() -> AsyncIterator[bytes]:
            async for r in _until_stopping(self.c.stopping, requests):
                if len(r.data) > code_archive.CHUNK_BYTES:
                    raise code_archive.CodeError(f"data: a piece of {len(r.data):,} bytes is over {code_archive.CHUNK_BYTES:,}")
                yield r.data

        try:
            sha, size = await self.c.upload(pieces())
        except SpecError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, printable(str(e), 1024))
        except Busy as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Stopping as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except OSError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot keep the code: {describe_os_error(e)}")
        return jobs_pb2.CodeRef(sha256=sha, size=size)

    async def SubmitJob(self, request: jobs_pb2.SubmitJobRequest, context: Context) -> jobs_pb2.Job:
        try:
            return serde.job_to_pb(await self.c.submit(request.spec_yaml, request.code_sha256))
        except SpecError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, printable(str(e), 1024))
        except FileExistsError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except (Busy, DiskError) as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Stopping as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def GetJob(self, request: jobs_pb2.GetJobRequest, context: Context) -> jobs_pb2.Job:
        return serde.job_to_pb(await self._job(request.name, context))

    async def ListJobs(self, request: jobs_pb2.ListJobsRequest, context: Context) -> jobs_pb2.ListJobsResponse:
        # A page at a time, each job without its spec (up to 1 MiB) and all but its latest state change:
        # a page of the largest size fits in a message.
        size = request.page_size or serde.DEFAULT_PAGE_SIZE
        if not 1 <= size <= serde.MAX_PAGE_SIZE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"page_size: {request.page_size} is outside 0..{serde.MAX_PAGE_SIZE}")
        names = list(self.c.sup.jobs)
        start = 0
        if request.page_token:
            try:
                start = names.index(_token_name(request.page_token)) + 1  # after the page before's last job
            except ValueError:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"page_token: {printable(request.page_token, 80)!r} is no page of this list")
        jobs = []
        for name in names[start : start + size]:
            j = serde.job_to_pb(self.c.sup.jobs[name].record)
            j.ClearField("spec_yaml")
            del j.history[:-1]
            jobs.append(j)
        more = start + size < len(names)
        return jobs_pb2.ListJobsResponse(jobs=jobs, next_page_token=_page_token(names[start + size - 1]) if more else "")

    async def ResumeJob(self, request: jobs_pb2.ResumeJobRequest, context: Context) -> jobs_pb2.Job:
        await self._job(request.name, context)
        try:
            return serde.job_to_pb(self.c.sup.resume(request.name))
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def StopJob(self, request: jobs_pb2.StopJobRequest, context: Context) -> jobs_pb2.Job:
        await self._job(request.name, context)
        try:
            return serde.job_to_pb(await self.c.sup.stop(request.name))
        except TimeoutError as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))

    async def WatchJob(self, request: jobs_pb2.WatchJobRequest, context: Context) -> AsyncIterator[jobs_pb2.JobEvent]:
        await self._job(request.name, context)
        try:
            async for e in _until_stopping(self.c.stopping, self.c.sup.watch(request.name)):
                yield serde.event_to_pb(e)
        except Stopping as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))


def _page_token(name: str) -> str:
    """ListJobs' next_page_token: opaque to clients (AIP-158), it names the last job of the page, base64url."""
    return base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")


def _token_name(token: str) -> str:
    """The job a page token names; ValueError if it is none of ours."""
    if len(token) > 128:
        raise ValueError("too long")
    try:
        name = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ValueError("not a page token") from None
    if _page_token(name) != token:
        raise ValueError("not a page token")
    return name


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
            async for cmd in _until_stopping(self.c.stopping, _commands(w)):
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
        return workers_pb2.ListWorkersResponse(workers=[
            workers_pb2.RegisteredWorker(
                rank=w.rank, hostname=w.hostname, host=w.host, device=w.device, attempt_id=w.attempt_id or "",
                device_name=w.gpu.name if w.gpu else "", device_memory_bytes=w.gpu.memory_bytes if w.gpu else 0,
                threads=w.threads)
            for _, w in sorted(self.c.sup.workers.items())])


async def _commands(w: Worker) -> AsyncIterator[Join | Abort]:
    """A worker's commands, until it is dropped."""
    while (cmd := await w.commands.get()) is not None:
        yield cmd


JOBS, WORKERS = "/gpipe.v1.JobService/", "/gpipe.v1.WorkerService/"
DIRECTORY = "/gpipe.v1.WorkerDirectory/"  # a client's, as JOBS: it takes the client token


def _unreachable(r: workers_pb2.RegisterRequest, peer: str) -> str | None:
    """Why the worker's data-plane address cannot be reached by its peers, if we can tell: a loopback
    address from a worker that calls from another host."""
    from gpipe import net

    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    seen = rest.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
    if net.is_loopback(r.host) and not (seen.startswith("127.") or seen == "::1"):
        return (f"host: rank {r.rank} ({printable(r.hostname, MAX_HOSTNAME)}) gave {r.host!r} as its data-plane "
                f"address, but it calls from {seen}: its peers cannot reach {r.host}. Start gpipe-worker without "
                f"--host (it takes the address that routes to the coordinator), or with --host {seen}")
    return None


class TokenAuth(grpc.aio.ServerInterceptor):
    """Each service its own token: the client token for JobService and WorkerDirectory, the worker token for
    WorkerService.

    Calls carry `authorization: Bearer <token>`; health probes need none. With
    one token set and not the other, the service without one refuses every
    call (PERMISSION_DENIED): a half-configured serve opens no door.
    """

    def __init__(self, client: str | None, worker: str | None):
        self.tokens = {JOBS: _bearer(client), WORKERS: _bearer(worker)}

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler:
        handler = await continuation(details)
        if details.method.startswith("/grpc.health.v1.") or handler is None:
            return handler
        service = JOBS if details.method.startswith((JOBS, DIRECTORY)) else WORKERS
        other = WORKERS if service == JOBS else JOBS
        what, flag = (("client", "--auth-token-file") if service == JOBS else ("worker", "--worker-token-file"))
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        got = got.encode() if isinstance(got, str) else got
        expected = self.tokens[service]
        if expected is not None and hmac.compare_digest(got, expected):
            return handler
        if expected is None:
            return _deny(handler, grpc.StatusCode.PERMISSION_DENIED,
                         f"the {service.strip('/').split('.')[-1]} is closed: serve was started without a "
                         f"{what} token ({flag})")
        other_token = self.tokens[other]
        if other_token is not None and hmac.compare_digest(got, other_token):
            return _deny(handler, grpc.StatusCode.PERMISSION_DENIED,
                         f"a {'worker' if what == 'client' else 'client'} token cannot call this: the "
                         f"{what} token is needed ({flag})")
        return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, f"a valid {what} token is required ({flag})")


def _bearer(token: str | None) -> bytes | None:
    return None if token is None else f"Bearer {token}".encode()


def _deny(handler: Any, code: grpc.StatusCode, message: str) -> Any:
    """A handler like `handler` that refuses the call."""

    async def deny(request: Any, context: Context) -> None:
        await context.abort(code, message)

    make: Callable[..., Any] = (grpc.unary_stream_rpc_method_handler if handler.unary_stream
                                else grpc.stream_unary_rpc_method_handler if handler.stream_unary
                                else grpc.unary_unary_rpc_method_handler)
    return make(deny, handler.request_deserializer, handler.response_serializer)


class _Undecodable:
    def __init__(self, why: str):
        self.why = why


class StrictDecoding(grpc.aio.ServerInterceptor):
    """A request that is not a valid message (bad UTF-8 in a string, a cut field) is INVALID_ARGUMENT.

    gRPC's own answer is UNKNOWN, with the decoder's exception in it.
    """

    async def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/gpipe.v1."):
            return handler
        decode = handler.request_deserializer

        def lenient(data: bytes) -> Any:
            try:
                return decode(data)
            except DecodeError as e:
                return _Undecodable(str(e).rpartition(": ")[2] or "cannot be decoded")

        async def check(request: Any, context: Context) -> None:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request is not a valid {details.method.rpartition('/')[2]} request: "
                                    f"{request.why}")

        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
                await check(request, context)
                async for m in inner_stream(request, context):
                    yield m

            return grpc.unary_stream_rpc_method_handler(stream, lenient, handler.response_serializer)
        if handler.stream_unary:
            inner_upload = handler.stream_unary

            async def upload(requests: AsyncIterator[Any], context: Context) -> Any:
                async def checked() -> AsyncIterator[Any]:
                    async for r in requests:
                        await check(r, context)
                        yield r

                return await inner_upload(checked(), context)

            return grpc.stream_unary_rpc_method_handler(upload, lenient, handler.response_serializer)
        inner = handler.unary_unary

        async def unary(request: Any, context: Context) -> Any:
            await check(request, context)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, lenient, handler.response_serializer)


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
                grace_s: float = grpcutil.DEFAULT_GRACE_S) -> None:
    """Run until SIGTERM or SIGINT; SpecError if a port is taken.

    On SIGTERM every running job checkpoints at its next step boundary and is left PREEMPTED (a restarted
    serve resumes it), for at most `grace_s`; then serve stops within a second. SIGINT stops it at once.

    `metrics`: (host, port) for Prometheus' /metrics (coordinator.exporter); host None: the API's.
    """
    from coordinator.exporter import Exporter, listen
    from gpipe import net

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
    c = Coordinator(state_dir, host, heartbeat_timeout, validate_memory_mib, max_code_mib << 20)
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
