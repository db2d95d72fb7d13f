"""serve's submissions: code archives and specs, validated in a throwaway process, into the job table."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TypeVar

from gpipe.coordinator.outputs.folder import prepare_output
from gpipe.coordinator.server.job_table import JobTable
from gpipe.coordinator.spec.job import MAX_SPEC_BYTES, JobSpec, name_problem, parse_spec
from gpipe.coordinator.supervisor.core import Supervisor
from gpipe.coordinator.supervisor.launcher import COORDINATOR_PRELOAD, ProcessLauncher
from gpipe.coordinator.supervisor.pool import MAX_QUEUED, Limits, never_fits
from gpipe.coordinator.supervisor.registry import HEARTBEAT_TIMEOUT_S
from gpipe.errors import EXIT_BAD_INPUT, GpipeError, SpecError, describe_os_error
from gpipe.files import naming
from gpipe.service import code_archive, grpcutil
from gpipe.service.job_records import SHA256_RE, JobRecord, JobState
from gpipe.service.zygote import Template
from gpipe.text import printable

VALIDATE_TIMEOUT_S = 120.0
MIN_VALIDATE_MEMORY_MIB, MAX_VALIDATE_MEMORY_MIB = 256, 1 << 22  # serve --validate-memory-mib's range


def default_validate_memory_mib() -> int:
    """A quarter of this machine's memory: the two validations that run at once take half at most."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20
    return max(MIN_VALIDATE_MEMORY_MIB, min(MAX_VALIDATE_MEMORY_MIB, total // 4))


VALIDATIONS_RUNNING, VALIDATIONS_WAITING = 2, 8  # past both, a submission is RESOURCE_EXHAUSTED
UPLOADS_AT_ONCE = 4  # code archives being received; past it, RESOURCE_EXHAUSTED
UPLOAD_TIMEOUT_S = 300.0  # one archive's upload: a stream that stalls gives its slot back
SPARE_ARCHIVES = 8  # archives kept that no job names (uploaded, not yet submitted); older ones are dropped
SECRET_ENV = (grpcutil.CLIENT_TOKEN_ENV, grpcutil.WORKER_TOKEN_ENV)  # never handed to a validation process
ERROR_TAIL_BYTES = 64 << 10  # what is read of a failed validation's stderr
MAX_WIRE_INT = 2**63 - 1
T = TypeVar("T")


class Coordinator:
    """serve's side of the supervisor: submissions, validated in a throwaway process, into the job table."""

    def __init__(self, state_dir: Path, host: str | None, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
                 validate_memory_mib: int | None = None, max_code_bytes: int = code_archive.DEFAULT_LIMIT_MIB << 20,
                 limits: Limits | None = None):
        self.state_dir = state_dir
        self.max_code_bytes = max_code_bytes
        self.uploads = 0  # code archives being received
        self.validate_memory_mib = validate_memory_mib or default_validate_memory_mib()
        self.table = JobTable(state_dir)
        # Attempt processes fork from a template that imported torch once (gpipe.service.zygote); it keeps no token.
        self.template = Template(os.environ, preload=COORDINATOR_PRELOAD, hidden=SECRET_ENV)
        self.sup = Supervisor(ProcessLauncher(state_dir, host,
                                              lambda name: state_dir / name / "logs" / "coordinator.log",
                                              template=self.template),
                              self.table, heartbeat_timeout=heartbeat_timeout, limits=limits)
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
            if (why := never_fits(spec.name, spec.topology.world, self.sup.limits)) is not None:
                raise NeverFits(why)  # before its validation: nothing is started, nothing kept
            self._unused(spec.name)
            self._room()
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

    def _room(self) -> None:
        """Busy past the queue's bound: MAX_QUEUED jobs waiting for workers (gpipe.coordinator.supervisor.pool)."""
        queued = sum(e.record.state in (JobState.PENDING, JobState.RESTARTING, JobState.PREEMPTED)
                     for e in self.sup.jobs.values())
        if queued >= MAX_QUEUED:
            raise Busy(f"{queued} jobs wait for workers already (at most {MAX_QUEUED} queued): try again once "
                       "some have started, or stop some")

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
                    "gpipe.coordinator.cli.main",
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


class NeverFits(GpipeError):
    """The job needs more workers than the pool can ever have (serve --max-workers): FAILED_PRECONDITION."""

    exit_code = EXIT_BAD_INPUT


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


async def until_stopping(stopping: asyncio.Event, items: AsyncIterator[T]) -> AsyncIterator[T]:
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
    if (why := name_problem(spec.name)) is not None:
        raise SpecError(f"name: {why}")
    return spec
