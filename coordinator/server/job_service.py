"""serve's JobService: upload, submit, get, list, resume, stop and watch jobs, as the supervisor's calls."""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from gpipe.coordinator.outputs.folder import delete_output
from gpipe.coordinator.server.submissions import (
    Busy,
    Coordinator,
    DiskError,
    NeverFits,
    Stopping,
    until_stopping,
)
from gpipe.coordinator.spec.job import name_problem
from gpipe.errors import SpecError, describe_os_error
from gpipe.service import code_archive, serde
from gpipe.service.grpcutil import Context
from gpipe.service.job_records import JobRecord
from gpipe.service.v1 import jobs_pb2, jobs_pb2_grpc
from gpipe.text import printable


def _bad_name(name: str) -> str | None:
    """Why `name` cannot name a job, or None."""
    why = name_problem(name)
    return None if why is None else f"name: {why}"


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
            async for r in until_stopping(self.c.stopping, requests):
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
        except NeverFits as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (Busy, DiskError) as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Stopping as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def GetJob(self, request: jobs_pb2.GetJobRequest, context: Context) -> jobs_pb2.Job:
        j = serde.job_to_pb(await self._job(request.name, context))
        j.waiting = self.c.sup.jobs[request.name].waiting
        return j

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
            e = self.c.sup.jobs[name]
            j = serde.job_to_pb(e.record)
            j.waiting = e.waiting
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

    async def DeleteJob(self, request: jobs_pb2.DeleteJobRequest, context: Context) -> jobs_pb2.Job:
        await self._job(request.name, context)
        try:
            job = self.c.sup.forget(request.name)  # first: no resume or submit finds it half deleted
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        try:
            await asyncio.to_thread(delete_output, Path(job.output_dir))
        except OSError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"job {request.name!r} forgotten, but its folder "
                                                         f"{job.output_dir} is left: {describe_os_error(e)}")
        return serde.job_to_pb(job)

    async def StopJob(self, request: jobs_pb2.StopJobRequest, context: Context) -> jobs_pb2.Job:
        await self._job(request.name, context)
        try:
            return serde.job_to_pb(await self.c.sup.stop(request.name))
        except TimeoutError as e:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))

    async def WatchJob(self, request: jobs_pb2.WatchJobRequest, context: Context) -> AsyncIterator[jobs_pb2.JobEvent]:
        await self._job(request.name, context)
        try:
            async for e in until_stopping(self.c.stopping, self.c.sup.watch(request.name)):
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
