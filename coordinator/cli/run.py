"""`gpipe-coordinator run job.yaml`: the whole job on this machine, nothing else to start.

The same supervisor as `serve` (gpipe.coordinator.supervisor.core) runs the job,
with one local worker per rank (replicas x stages: gpipe.topology;
gpipe.coordinator.supervisor.local_workers) on its share of this machine's cores, all on
loopback. On a CPU, more workers than cores share the cores round-robin, with
one warning line (none with `oversubscribe`). On a GPU each worker has one of
its own: worker k's attempt processes run with CUDA_VISIBLE_DEVICES naming GPU
k (the k-th of the list `run` was given) and see it as cuda:0; a job with fewer
GPUs than workers is refused before anything starts (NCCL refuses two ranks on
one GPU, so `oversubscribe` never applies to GPUs). So restarts, their backoff and every failure message are `serve`'s:
when an attempt fails (a stage raises, a worker dies, a wait times out) and
`max_restarts` allows, a fresh attempt resumes from the last good checkpoint,
so the job loses at most the steps since then and ends with the same weights.
Outputs go to <state-dir>/<name>/: plan.json, metrics.jsonl, checkpoints/,
logs/ and, at the end, model.safetensors.

SIGTERM is a preemption, as for serve: the attempt checkpoints at its next
step boundary (within `grace_s`, else the last good checkpoint stands), and
`run` exits 143 (EXIT_PREEMPTED); `run --resume` goes on from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpipe.coordinator.cli.progress import Follower, Progress
from gpipe.coordinator.outputs.folder import recorded_spec, running
from gpipe.coordinator.spec.job import JobSpec
from gpipe.coordinator.supervisor import pool
from gpipe.coordinator.supervisor.core import Supervisor
from gpipe.coordinator.supervisor.launcher import PLANNER_PRELOAD, ProcessLauncher
from gpipe.coordinator.supervisor.local_workers import LocalWorker
from gpipe.coordinator.supervisor.records import final_loss
from gpipe.errors import EXIT_BAD_INPUT, JobFailed, Preempted, SpecError
from gpipe.service import grpcutil
from gpipe.service.job_records import JobRecord, JobState
from gpipe.worker.agent import WARM_ENV, worker_template
from gpipe.worker.cores import split_cores, threads_for
from gpipe.worker.device import VISIBLE_ENV, Gpu, Gpus, probe

HOST = "127.0.0.1"  # local workers talk over loopback only


def _attempts_logged(out: Path) -> int:
    """The highest attempt number in the job's metrics.jsonl, so a resumed run numbers its own after it."""
    n = 0
    try:
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                n = max(n, int(json.loads(line).get("attempt", 1)))
    except OSError:
        pass
    return n


def worker_cores(spec: JobSpec, oversubscribe: bool = False) -> list[list[int]]:
    """Each local worker's cores, by rank: disjoint sets while there are enough, else shared round-robin.
    On a CPU, sharing is one warning line on stderr (silenced by `oversubscribe`)."""
    top = spec.topology
    cores = sorted(os.sched_getaffinity(0))
    if spec.device == "cpu" and top.world > len(cores) and not oversubscribe:
        print(f"warning: {_workers(spec)} share this machine's {len(cores)} CPU core(s), slower than fewer workers "
              "would be (--oversubscribe silences this)", file=sys.stderr, flush=True)
    return split_cores(top.world, cores)


def _workers(spec: JobSpec) -> str:
    return f"{spec.topology.world} workers ({spec.replicas} replica(s) x {spec.stages} stage(s))"


def too_few_gpus(spec: JobSpec, seen: Gpus) -> str | None:
    """Why `spec`'s workers cannot each have a GPU of their own among `seen`, or None. Never shared: NCCL
    refuses two ranks on one GPU ("Duplicate GPU detected"), so --oversubscribe shares CPU cores only."""
    if spec.device != "cuda" or spec.topology.world <= len(seen.gpus):
        return None
    if not seen.gpus:
        return f"device: cuda, but {seen.describe()}: `device: cpu` runs the job on the CPU"
    return (f"replicas: {_workers(spec)} need a GPU each, but {seen.describe()}: lower replicas or stages "
            "(--oversubscribe shares CPU cores, never a GPU)")


def gpu_envs(workers: int, visible: str | None) -> list[dict[str, str]]:
    """Each local worker's CUDA_VISIBLE_DEVICES, by rank: worker k's attempt processes see one GPU, as cuda:0,
    GPU k, or the k-th entry of `visible` (the CUDA_VISIBLE_DEVICES `run` was given) when that is set."""
    ids = [v.strip() for v in visible.split(",")] if visible is not None else [str(k) for k in range(workers)]
    if len(ids) < workers:
        raise SpecError(f"{VISIBLE_ENV}={visible!r} names {len(ids)} GPU(s), for {workers} workers")
    return [{VISIBLE_ENV: ids[k]} for k in range(workers)]


def worker_gpus(spec: JobSpec) -> list[tuple[Gpu | None, dict[str, str]]]:
    """Each local worker's GPU and what its attempt processes' environment adds, by rank (none on a CPU).
    SpecError when the machine has fewer GPUs than the job has workers. The GPUs are counted by a probe
    process (gpipe.worker.device): this process never touches CUDA."""
    if spec.device != "cuda":
        return [(None, {})] * spec.topology.world
    seen = probe()
    if (why := too_few_gpus(spec, seen)) is not None:
        raise SpecError(why)
    envs = gpu_envs(spec.topology.world, seen.visible)
    # Told apart by UUID (the supervisor refuses two workers on one GPU); a torch that gives none: by its id.
    return [(g if g.uuid else replace(g, uuid=f"{socket.gethostname()}/{env[VISIBLE_ENV]}"), env)
            for g, env in zip(seen.gpus, envs, strict=False)]


async def _run(spec: JobSpec, spec_path: Path, state_dir: Path, progress: bool, resume: bool,
               core_sets: list[list[int]], evaluate: Path | None = None,
               grace_s: float = grpcutil.DEFAULT_GRACE_S,
               spec_text: str | None = None) -> tuple[JobRecord, list[dict[str, Any]]]:
    """The job's record once it ended, and its evaluations; with `evaluate`, its attempts evaluate that
    weights file instead of training (logging to logs/eval/). `core_sets`: each worker's cores, by rank.
    `spec_text`: the job file's text with fields overridden (gpipe.coordinator.spec.overrides), what the attempts read
    (outputs.recorded_spec); the job's code stays by `spec_path`."""
    gpus = worker_gpus(spec)  # before anything starts: a job short of GPUs changes nothing
    with contextlib.ExitStack() as held:
        if evaluate is None:
            held.enter_context(running(spec.name, state_dir))  # `delete` refuses meanwhile
        read = spec_path.resolve() if spec_text is None else \
            held.enter_context(recorded_spec(spec.name, state_dir, spec_text))
        return await _train(spec, read, spec.code_dir(spec_path), state_dir, progress, resume, core_sets, gpus,
                            evaluate, grace_s)


async def _train(spec: JobSpec, spec_path: Path, code_dir: Path, state_dir: Path, progress: bool, resume: bool,
                 core_sets: list[list[int]], gpus: list[tuple[Gpu | None, dict[str, str]]], evaluate: Path | None,
                 grace_s: float) -> tuple[JobRecord, list[dict[str, Any]]]:
    """_run's job, its spec read from `spec_path` by the attempts, its code in `code_dir`."""
    out = state_dir / spec.name  # the first attempt prepares it, once the plan holds
    logs = out / "logs" / "eval" if evaluate else out / "logs"
    extra = ["--evaluate", str(evaluate)] if evaluate else []
    threads = min(threads_for(c) for c in core_sets)
    # The coordinator's attempt processes fork from a template that imports torch alone; the workers' from a fork
    # of it that imports what they add (torch._dynamo above all, half their start). So the coordinator plans while
    # the workers' template is still importing, torch imported once.
    planner = worker_template(dict(os.environ), threads, preload=PLANNER_PRELOAD)
    template = worker_template(dict(os.environ), threads, parent=planner)
    await planner.start()
    launcher = ProcessLauncher(state_dir, HOST, lambda name: logs / "coordinator.log", extra, planner)
    sup = Supervisor(launcher, say=lambda line: None, limits=pool.Limits(max_workers=len(core_sets)))
    # On a GPU, worker k's attempt processes see their GPU alone, as cuda:0: a stage's .cuda() lands there.
    device = "cuda:0" if spec.device == "cuda" else "cpu"
    # Their attempt processes build the job's model (on the meta device) while the coordinator plans.
    warm = {WARM_ENV: json.dumps({"model_factory": spec.model.factory, "model_args": spec.model.args,
                                  "code_dir": str(code_dir)})}
    workers = [LocalWorker(sup, k, HOST, device, cores, threads, logs / spec.topology.log_name(k), template, gpu,
                           {**env, **warm})
               for k, (cores, (gpu, env)) in enumerate(zip(core_sets, gpus, strict=True))]
    tasks = [asyncio.ensure_future(w.run()) for w in workers]
    tasks.append(asyncio.ensure_future(sup.serve_forever()))
    job = JobRecord(name=spec.name, spec_yaml=spec_path.read_text(), steps=spec.steps, output_dir=str(out),
                    attempts=_attempts_logged(out) if resume else 0)
    sup.add(job, spec, spec_path, code_dir, fresh=not resume)
    follower = Follower(spec.name, Progress(spec.steps, enabled=progress))
    evals: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()

    def preempted() -> None:  # SIGTERM: checkpoint at the next step boundary, within the grace, and stop
        sup.preempt_all("run got SIGTERM", grace_s)
        sup.preempt_waiting(spec.name, "run got SIGTERM")

    main = asyncio.current_task()
    interrupted = False

    def interrupt() -> None:  # SIGINT (Ctrl-C): stop at once, through the loop's own signal handling
        nonlocal interrupted
        interrupted = True
        if main is not None:
            main.cancel()

    before = signal.getsignal(signal.SIGTERM)
    loop.add_signal_handler(signal.SIGTERM, preempted)
    loop.add_signal_handler(signal.SIGINT, interrupt)
    try:
        async for kind, value in sup.watch(spec.name):
            if kind == "state" and (value.state.ended or value.state == JobState.PREEMPTED and sup.draining):
                break  # run_local says how it ended
            if kind == "state" and value.state in (JobState.PENDING, JobState.RUNNING):
                continue  # the usual course of a run is not news
            if kind == "eval":
                evals.append(value)
            follower.show(kind, value)
    except asyncio.CancelledError:
        if not interrupted:
            raise
        raise KeyboardInterrupt from None  # the CLI says "interrupted", exit 130
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, before)  # the CLI's (asyncio leaves SIG_DFL)
        follower.close()
        sup.shutdown()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, *sup.tasks, return_exceptions=True)
        await launcher.reap()
        await asyncio.gather(template.close(), planner.close())
    return job, evals


def _succeeded(job: JobRecord) -> None:
    """SpecError (bad input), Preempted or JobFailed unless the job succeeded."""
    if job.state != JobState.SUCCEEDED:
        message = job.history[-1].message if job.history else "the job did not finish"
        if job.state == JobState.PREEMPTED:
            raise Preempted(f"preempted: {message}; `run --resume` goes on from there")
        if job.exit_code == EXIT_BAD_INPUT:
            raise SpecError(message)
        raise JobFailed(message, None if job.failed_rank < 0 else job.failed_rank)


def run_local(spec: JobSpec, spec_path: Path, state_dir: Path, progress: bool = True,
              resume: bool = False, oversubscribe: bool = False, grace_s: float = grpcutil.DEFAULT_GRACE_S,
              spec_text: str | None = None) -> Path:
    """Train `spec` with local workers, restarting from checkpoints; return the job's output directory.
    Preempted on SIGTERM (checkpointed within `grace_s`)."""
    t0 = time.monotonic()
    core_sets = worker_cores(spec, oversubscribe)
    job, _ = asyncio.run(_run(spec, spec_path, state_dir.resolve(), progress, resume, core_sets, grace_s=grace_s,
                              spec_text=spec_text))
    _succeeded(job)
    out = Path(job.output_dir)
    again = f" after {job.restarts} restart(s)" if job.restarts else ""
    print(f"{spec.name}: done in {time.monotonic() - t0:.1f}s{again}: {final_loss(job)}weights in "
          f"{out / 'model.safetensors'}",
          file=sys.stderr, flush=True)
    return out


def eval_local(spec: JobSpec, spec_path: Path, state_dir: Path, weights: Path,
               spec_text: str | None = None) -> dict[str, Any]:
    """Evaluate weights file `weights` on the job's eval data, pipelined across local workers as `run` trains:
    {"loss", "samples", "weights", "step" (None if unknown), "time_s"}. Writes nothing but logs/eval/."""
    spec = spec.one_replica()  # evaluating needs one pipeline (the attempt process does the same)
    core_sets = worker_cores(spec, os.environ.get("GPIPE_OVERSUBSCRIBE", "") not in ("", "0"))
    job, evals = asyncio.run(_run(spec, spec_path, state_dir.resolve(), False, False, core_sets, weights.resolve(),
                                  spec_text=spec_text))
    _succeeded(job)
    if not evals:
        raise JobFailed("the evaluation ended without a result")
    m = evals[-1]
    return {"loss": m["eval_loss"], "samples": m["eval_samples"], "weights": m["weights"], "step": m["step"],
            "time_s": m["eval_time_s"]}
