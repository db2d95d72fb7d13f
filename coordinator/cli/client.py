"""The client verbs of gpipe-coordinator: submit, status, list, logs, stop.

Each prints what a person needs and exits with a code a script can use:
submit --follow: 0 SUCCEEDED, 1 FAILED, 3 STOPPED; 2 when the spec was
rejected (or a flag or name is wrong); 1 when the coordinator cannot be reached.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TYPE_CHECKING, Any, cast

import grpc

from gpipe.coordinator.cli.progress import Follower, Progress
from gpipe.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, GpipeError, SpecError
from gpipe.service import grpcutil, serde
from gpipe.service.job_records import JobState
from gpipe.service.v1 import jobs_pb2, jobs_pb2_grpc, workers_pb2, workers_pb2_grpc

if TYPE_CHECKING:
    from google.protobuf.message import Message

    from gpipe.coordinator.spec.job import JobSpec

EXIT_STOPPED = 3
EXIT_BY_STATE = {JobState.SUCCEEDED: EXIT_OK, JobState.FAILED: EXIT_FAILED, JobState.STOPPED: EXIT_STOPPED}
BAD_REQUEST = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND,
               grpc.StatusCode.FAILED_PRECONDITION)


class ClientError(GpipeError):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Client:
    def __init__(self, address: str, token: str | None, tls_ca: str | None):
        self.address = address
        self.channel = grpcutil.channel(address, token, tls_ca)
        self.stub = jobs_pb2_grpc.JobServiceStub(self.channel)

    async def call(self, method: str, request: Message, timeout: float = 30.0) -> Any:
        try:
            return await getattr(self.stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise self._error(e) from None

    def _error(self, e: grpc.RpcError) -> ClientError:
        code = EXIT_BAD_INPUT if e.code() in BAD_REQUEST else EXIT_FAILED
        return ClientError(grpcutil.describe(e, self.address), code)

    async def close(self) -> None:
        await self.channel.close()

    # -- verbs -------------------------------------------------------------------------

    async def submit(self, path: str, follow: bool, progress: bool = True, max_code_mib: int = 50,
                     attach: bool = False, overrides: tuple[list[str], str | None] = ([], None)) -> int:
        """Send the job with its code: the folder of its job file (or its working_dir), packed (gpipe.service.code_archive).
        With `attach`, a job of that name with this very spec and code is followed, not refused. `overrides`: the
        --set items and --name, applied to the job file's text (gpipe.coordinator.spec.overrides): the spec sent."""
        from gpipe.coordinator.spec.job import parse_spec, read_spec_text
        from gpipe.coordinator.spec.overrides import apply
        from gpipe.service import code_archive

        text = apply(read_spec_text(path), *overrides, path)  # SpecError: unreadable, not UTF-8, too big, bad --set
        spec = parse_spec(text, source=path)  # what to pack; serve checks the spec again
        limit = code_archive.limit_bytes(max_code_mib, "--max-code-mib")
        folder = spec.code_dir(path)
        archive = await asyncio.to_thread(code_archive.pack, folder, spec.exclude, limit)
        ref = await self.upload(archive)
        try:
            pb = await self.stub.SubmitJob(jobs_pb2.SubmitJobRequest(spec_yaml=text, code_sha256=ref.sha256),
                                           timeout=300)
        except grpc.RpcError as e:
            if attach and e.code() == grpc.StatusCode.ALREADY_EXISTS:
                return await self.attach(spec.name, text, ref.sha256, follow, progress)
            raise self._error(e) from None
        job = serde.job_from_pb(pb)
        print(f"{job.name}: submitted ({job.state.value})", file=sys.stderr, flush=True)
        if not follow:
            return EXIT_OK
        return await self.follow(job.name, job.steps, progress)

    async def attach(self, name: str, spec_yaml: str, code_sha256: str, follow: bool, progress: bool) -> int:
        """Job `name` exists: follow it if it is this very job (spec text and code), as a Kubernetes Job's
        retried pod must (its first pod may have lost serve mid-follow); another job of that name is exit 2."""
        job = serde.job_from_pb(await self.call("GetJob", jobs_pb2.GetJobRequest(name=name)))
        if job.spec_yaml != spec_yaml or job.code_sha256 != code_sha256:
            other = "another spec" if job.spec_yaml != spec_yaml else "other code"
            raise ClientError(f"a job named {name!r} exists already, with {other}", EXIT_BAD_INPUT)
        print(f"{name}: submitted before ({job.state.value}): following it", file=sys.stderr, flush=True)
        if not follow:
            return EXIT_OK
        # Its whole history is shown; its end is the first past the states it has now (an ended job's: its last).
        return await self.follow(name, job.steps, progress, final_after=len(job.history) - int(job.state.ended))

    async def upload(self, archive: bytes) -> jobs_pb2.CodeRef:
        from gpipe.service.code_archive import CHUNK_BYTES

        pieces = (jobs_pb2.CodeChunk(data=archive[i:i + CHUNK_BYTES]) for i in range(0, len(archive), CHUNK_BYTES))
        try:
            ref: jobs_pb2.CodeRef = await self.stub.UploadCode(iter(pieces), timeout=300)
        except grpc.RpcError as e:
            raise self._error(e) from None
        return ref

    async def resume(self, name: str, follow: bool, progress: bool = True) -> int:
        job = serde.job_from_pb(await self.call("ResumeJob", jobs_pb2.ResumeJobRequest(name=name)))
        print(f"{job.name}: {job.state.value}: {job.history[-1].message}", file=sys.stderr, flush=True)
        if not follow:
            return EXIT_OK
        return await self.follow(job.name, job.steps, progress, since=len(job.history) - 1)

    async def follow(self, name: str, steps: int, progress: bool, since: int = 0,
                     final_after: int | None = None) -> int:
        """Show the job's events until it ends; the exit code follows its final state."""
        follower = Follower(name, Progress(steps, enabled=progress), since, final_after)
        final = None
        try:
            async for m in self.stub.WatchJob(jobs_pb2.WatchJobRequest(name=name)):
                final = follower.show(*serde.event_from_pb(m))
                if final is not None:
                    break
        except grpc.RpcError as e:
            raise self._error(e) from None
        finally:
            follower.close()
        if final is None:
            raise ClientError(f"{name}: the coordinator ended the stream before the job ended", EXIT_FAILED)
        return EXIT_BY_STATE[final]

    async def status(self, name: str) -> int:
        pb = await self.call("GetJob", jobs_pb2.GetJobRequest(name=name))
        job = serde.job_from_pb(pb)
        print(f"name:     {job.name}\nstate:    {job.state.value}\nprogress: {job.steps_done}/{job.steps} steps"
              + (f", loss {job.loss:.4f}" if job.steps_done else ""))
        if pb.waiting:
            print(f"waiting:  {pb.waiting}")
        if job.error and job.state in (JobState.FAILED, JobState.RESTARTING, JobState.RUNNING):
            rank = f" (rank {job.failed_rank})" if job.failed_rank >= 0 else ""
            first = "" if job.state == JobState.FAILED else "first failure: "
            print(f"error:    {first}{job.error}{rank}")
        spec = _spec(job.spec_yaml)
        spec_restarts = spec.max_restarts if spec is not None else "?"
        if spec is not None:
            # Which ranks the job takes: rank N serves stage N mod stages of replica N div stages.
            print(f"workers:  {spec.topology.describe_ranks()}")
            for line in await self._workers(spec.topology.world):
                print(f"  {line}")
        print(f"attempts: {job.attempts}, restarts {job.restarts} of {spec_restarts}")
        if job.eval_step >= 0:
            print(f"eval:     loss {job.eval_loss:.4f} after step {job.eval_step + 1}")
        if job.checkpoint_step:
            print(f"checkpoint: step-{job.checkpoint_step}")
        print(f"output:   {job.output_dir}\nhistory:")
        for h in job.history:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.time_unix))
            print(f"  {stamp}  {h.state.value:9}  {h.message}")
        return EXIT_OK

    async def _workers(self, world: int) -> list[str]:
        """A line per rank of a job of `world` ranks: the worker registered for it now and its device, e.g.
        'rank 0: gpu-node-3 (10.0.0.6) cuda:0, NVIDIA H100 80GB HBM3, 79.2 GiB'; none from a serve that lists none."""
        try:
            r = await workers_pb2_grpc.WorkerDirectoryStub(self.channel).ListWorkers(workers_pb2.ListWorkersRequest(),
                                                                                     timeout=30)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older serve
                return []
            raise self._error(e) from None
        by_rank = {w.rank: w for w in r.workers}
        lines = []
        for rank in range(world):
            w = by_rank.get(rank)
            if w is None:
                lines.append(f"rank {rank}: no worker registered")
                continue
            gpu = f", {w.device_name}, {w.device_memory_bytes / 2**30:.1f} GiB" if w.device_name else ""
            lines.append(f"rank {rank}: {w.hostname or w.host} ({w.host}) {w.device}{gpu}")
        return lines

    async def list_workers(self) -> int:
        """The pool: each registered worker, by rank, and the job it serves (or free)."""
        try:
            r = await workers_pb2_grpc.WorkerDirectoryStub(self.channel).ListWorkers(workers_pb2.ListWorkersRequest(),
                                                                                     timeout=30)
        except grpc.RpcError as e:
            raise self._error(e) from None
        print(f"{'RANK':>4}  {'HOST':24} {'DEVICE':8} STATE")
        for w in sorted(r.workers, key=lambda w: w.rank):
            state = f"job {w.job}" if w.job else "busy" if w.attempt_id else "free"
            if w.leaving:
                state += " (leaving)"
            print(f"{w.rank:>4}  {(w.hostname or w.host)[:24]:24} {w.device:8} {state}")
        return 0

    async def list(self, limit: int | None = None, page_token: str = "") -> int:
        """Every job from `page_token` on; with `limit`, one page of at most that many, and the command for the
        next page on stderr."""
        jobs, token = [], page_token
        while True:  # a page at a time (a page is at most 1,000 jobs)
            page = await self.call("ListJobs", jobs_pb2.ListJobsRequest(page_size=limit or serde.MAX_PAGE_SIZE,
                                                                        page_token=token))
            jobs += [(serde.job_from_pb(j), j.waiting) for j in page.jobs]
            if not (token := page.next_page_token) or limit is not None:
                break
        print(f"{'NAME':24} {'STATE':9} {'STEPS':>11} {'LOSS':>8}  SINCE")
        for j, waiting in jobs:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.history[-1].time_unix)) if j.history else ""
            loss = f"{j.loss:8.4f}" if j.steps_done else f"{'-':>8}"
            why = f"  ({waiting})" if waiting else ""  # a job the registered workers are too few for
            print(f"{j.name:24} {j.state.value:9} {f'{j.steps_done}/{j.steps}':>11} {loss}  {since}{why}")
        if token:
            print(f"more: list --limit {limit} --page-token {token}", file=sys.stderr)
        return EXIT_OK

    async def logs(self, name: str, follow: bool, as_json: bool = False) -> int:
        """The job's log so far (gpipe.coordinator.cli.logview), on stdout; with `follow`, live until the job ends,
        and the exit code follows its final state."""
        from gpipe.coordinator.cli import logview

        job = serde.job_from_pb(await self.call("GetJob", jobs_pb2.GetJobRequest(name=name)))
        # serve ends the stream once the job has ended; a running job's, only with --follow.
        idle = None if follow or job.state.ended else 1.0
        events = self.stub.WatchJob(jobs_pb2.WatchJobRequest(name=name))
        final = None
        try:
            while (m := await _next(events, idle)) is not None:
                event = serde.event_from_pb(m)
                if (text := logview.line(event, job.steps, as_json)) is not None:
                    print(text, flush=True)
                if event[0] == "state":
                    final = event[1].state
        except grpc.RpcError as e:
            raise self._error(e) from None
        finally:
            events.cancel()
        if not follow:
            return EXIT_OK
        if final is None or not final.ended:
            raise ClientError(f"{name}: the coordinator ended the stream before the job ended", EXIT_FAILED)
        return EXIT_BY_STATE[final]

    async def delete(self, name: str) -> int:
        job = serde.job_from_pb(await self.call("DeleteJob", jobs_pb2.DeleteJobRequest(name=name), 120))
        print(f"{job.name}: deleted ({job.state.value}; {job.output_dir} removed)", file=sys.stderr)
        return EXIT_OK

    async def stop(self, name: str) -> int:
        job = serde.job_from_pb(await self.call("StopJob", jobs_pb2.StopJobRequest(name=name), 120))
        print(f"{job.name}: {job.state.value}", file=sys.stderr)
        return EXIT_OK


def _spec(spec_yaml: str) -> JobSpec | None:
    from gpipe.coordinator.spec.job import parse_spec

    try:
        return parse_spec(spec_yaml)
    except SpecError:
        return None


async def _next(
    stream: grpc.aio.UnaryStreamCall[Any, jobs_pb2.JobEvent], idle: float | None
) -> jobs_pb2.JobEvent | None:
    """The stream's next message, or None at its end or once it has been quiet for `idle` seconds (caught up)."""
    try:
        m = await asyncio.wait_for(stream.read(), idle)
    except TimeoutError:
        return None
    # read() is typed `object`: EOF or the response.
    return None if m is grpc.aio.EOF else cast(jobs_pb2.JobEvent, m)
