"""gpipe-coordinator: run a pipeline-parallel training job.

    gpipe-coordinator run examples/charlm.yaml              # train on this machine
    gpipe-coordinator run job.yaml --state-dir /data/gpipe  # outputs in /data/gpipe/<name>/
    gpipe-coordinator run job.yaml --resume                 # continue from its last good checkpoint
    gpipe-coordinator validate job.yaml                     # check a spec, start nothing
    gpipe-coordinator run job.yaml --set chunks=8 --set optimizer.lr=3e-4 --name lr3e-4  # fields overridden
    gpipe-coordinator eval job.yaml [--weights F] [--json]  # the eval loss of a finished job's weights
    gpipe-coordinator timeline gpipe-state/charlm --step 5  # draw step 5 of a run
    gpipe-coordinator tokenize corpus/*.txt --tokenizer tok/ --out data/train.bin  # token files (docs/data.md)
    gpipe-coordinator serve --port 7000 [--state-dir DIR]   # the service (workers: gpipe-worker)
        [--metrics-port 9100]                               # and Prometheus' /metrics
    gpipe-coordinator submit job.yaml --follow              # send a job and its folder's code to serve, follow it
    gpipe-coordinator submit --resume NAME                  # resume a failed or stopped job
    gpipe-coordinator logs NAME [--follow] [--json]         # a step a line, checkpoints and restarts between
    gpipe-coordinator status|stop NAME; gpipe-coordinator list
    gpipe-coordinator delete NAME --yes [--state-dir DIR]    # an ended job's record and outputs (DIR: run's)

Exit codes: 0 done, 1 the job failed (the failing stage is named) or the
coordinator cannot be reached, 2 bad input (spec, flag, file or job name;
nothing was started), 3 the followed job was stopped, 130 interrupted, 143
`run` got SIGTERM and checkpointed at a step boundary (`run --resume` goes on).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NamedTuple, NoReturn, TypeVar

from gpipe.coordinator.cli import corpus
from gpipe.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, GpipeError, SpecError

if TYPE_CHECKING:
    from gpipe.coordinator.plan.job import Plan
    from gpipe.coordinator.spec.job import JobSpec
    from gpipe.coordinator.supervisor.pool import Limits

T = TypeVar("T")

DEFAULT_STATE_DIR = "gpipe-state"  # run's and eval's
DEFAULT_SERVE_STATE_DIR = "gpipe-service"  # serve's job table
DEFAULT_CODE_MIB = 50  # gpipe.service.code_archive.DEFAULT_LIMIT_MIB (imported lazily there)
EXIT_INTERRUPTED = 130
M_ARENA_MAX = -8  # mallopt's name for MALLOC_ARENA_MAX
# How torch and Python say an allocation failed, in a RuntimeError.
OUT_OF_MEMORY = ("can't allocate memory", "can't start new thread", "Cannot allocate memory")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as for a bad spec
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _knobs(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--set and --name: the job file's fields overridden (gpipe.coordinator.spec.overrides)."""
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                   help="override a field of the job file before it is checked: a dotted path, a YAML value "
                        "(--set chunks=8 --set optimizer.lr=3e-4 --set 'data.args={n: 64}'); repeatable")
    p.add_argument("--name", help="the job's name instead of the file's (to run or submit it again as another job)")
    return p


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpipe-coordinator", description="Pipeline-parallel training of one PyTorch model.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="train a job on this machine with local worker processes")
    run.add_argument("job", help="the job spec (YAML)")
    _knobs(run)
    run.add_argument(
        "--state-dir", default=os.environ.get("GPIPE_STATE_DIR", DEFAULT_STATE_DIR),
        help=f"where <name>/ outputs go (env GPIPE_STATE_DIR; default ./{DEFAULT_STATE_DIR})",
    )
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bar or step lines (evaluations, checkpoints and states still show)")
    run.add_argument("--resume", action="store_true",
                     help="continue from the job's newest good checkpoint in the state dir (default: start over)")
    run.add_argument("--grace-s", type=float, default=25.0, metavar="SECONDS",
                     help="on SIGTERM, how long the job has to checkpoint at its next step boundary before run exits "
                          "143 (1-3600; default 25); run it again with --resume to go on")
    run.add_argument("--oversubscribe", action="store_true",
                     default=os.environ.get("GPIPE_OVERSUBSCRIBE", "") not in ("", "0"),
                     help="silence the warning line when workers (replicas x stages) outnumber the CPU cores "
                          "and share them. CPU cores only: with device: cuda each worker needs a GPU of its own "
                          "(NCCL refuses two on one), and fewer GPUs than workers is exit 2 whatever this says. "
                          "Env GPIPE_OVERSUBSCRIBE=1 sets it")
    val = sub.add_parser(
        "validate", help="check a job spec and its model and data; start nothing",
        description="Check a job spec and its model and data; start nothing. A spec is often checked on one "
                    "machine and run on others (submit to serve): with device: cuda, the workers are checked "
                    "against this machine's GPUs (one each, as run needs) only when it has some; on a machine "
                    "without a GPU that check is left to where the job runs (run refuses it, serve fails it "
                    "at placement), and a line says so.")
    val.add_argument("job")
    _knobs(val)
    val.add_argument("--skip-gpu-check", action="store_true",
                     help="leave out the check of the workers against this machine's GPUs (serve's own "
                          "validation: a job's GPUs are its workers', not the coordinator's)")
    val.add_argument("--memory-mib", type=int, default=None,
                     help="fail if building the model and data needs more memory than this (MiB)")
    val.add_argument("--code-dir", default=None,
                     help="import the job's modules from this folder (default: the spec's working_dir, or the "
                          "job file's folder)")
    pl = sub.add_parser(
        "plan", help="the fastest configuration of a job that fits the workers' memory, from measured costs",
        description="Measure the job's layers on this host (as one of N local workers would run them), then "
                    "predict every configuration's step time and per-worker peak memory: stages x replicas, "
                    "schedule, chunks, activation checkpointing, optimizer.shard, the balance by time. Prints "
                    "those that fit, fastest first (docs/plan.md). Exit 2 when none fits.")
    pl.add_argument("job")
    _knobs(pl)
    pl.add_argument("--workers", type=int, required=True, help="the workers the job may use (stages x replicas)")
    pl.add_argument("--memory-gib", type=float, required=True, help="each worker's memory (GiB)")
    pl.add_argument("--json", action="store_true", help="print a JSON list, best first, as the last line")
    pl.add_argument("--write", metavar="FILE", help="write the job file with the best configuration filled in")
    pl.add_argument("--top", type=int, default=10, help="configurations shown (default 10)")
    ev = sub.add_parser("eval", help="evaluate a job's weights on its eval data, pipelined across local workers")
    ev.add_argument("job", help="the job spec (YAML), with an eval section")
    _knobs(ev)
    ev.add_argument("--state-dir", default=os.environ.get("GPIPE_STATE_DIR", DEFAULT_STATE_DIR),
                    help=f"where the job's outputs are (env GPIPE_STATE_DIR; default ./{DEFAULT_STATE_DIR})")
    ev.add_argument("--weights", help="a safetensors file of the model's weights "
                                      "(default: <state-dir>/<name>/model.safetensors, the finished job's)")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    srv = sub.add_parser("serve", help="run the coordinator service: job queue, workers, checkpoints")
    srv.add_argument("--port", type=int, default=7000, help="the gRPC port (default 7000)")
    srv.add_argument("--host", default=None,
                     help="the address to listen on; the attempts' RPC and c10d ports bind there too (default: "
                          "with tokens, every interface, each attempt on the address on the route to its "
                          "workers; without, 127.0.0.1 only)")
    srv.add_argument("--insecure", action="store_true",
                     help="allow serving a non-loopback --host without tokens: anyone who reaches it may "
                          "submit code to run")
    srv.add_argument("--state-dir", default=os.environ.get("GPIPE_STATE_DIR", DEFAULT_SERVE_STATE_DIR),
                     help=f"jobs and their outputs (env GPIPE_STATE_DIR; default ./{DEFAULT_SERVE_STATE_DIR}, apart "
                          f"from run's ./{DEFAULT_STATE_DIR}: a job run here and the service's job of the same name "
                          "never share a folder)")
    srv.add_argument("--auth-token-file",
                     help="the client token: JobService calls (submit, status, stop ...) must carry it "
                          "(or env GPIPE_TOKEN)")
    srv.add_argument("--worker-token-file",
                     help="the worker token: WorkerService calls (register, heartbeat, commands) must carry it "
                          "(or env GPIPE_WORKER_TOKEN). Set both tokens or neither: with one set, the "
                          "service without a token refuses every call")
    srv.add_argument("--validate-memory-mib", type=int, default=None,
                     help="the memory a submitted spec's validation (building its model and data) may take, "
                          "in MiB (default: a quarter of this machine's)")
    srv.add_argument("--heartbeat-timeout", type=float, metavar="SECONDS",
                     default=os.environ.get("GPIPE_HEARTBEAT_TIMEOUT_S"),
                     help="a worker whose heartbeats stop this long is dropped and its attempt fails "
                          "(env GPIPE_HEARTBEAT_TIMEOUT_S; default 10)")
    srv.add_argument("--max-workers", type=int, metavar="N", default=os.environ.get("GPIPE_MAX_WORKERS"),
                     help="the pool's size: its workers are ranks 0..N-1 (a worker of another rank is refused), "
                          "and a job needing more than N workers at once is refused at submit (exit 2). "
                          "1-4096 (env GPIPE_MAX_WORKERS; default: none, any rank may join and such a job waits)")
    srv.add_argument("--starve-after-s", type=float, metavar="SECONDS",
                     default=os.environ.get("GPIPE_STARVE_AFTER_S"),
                     help="once a waiting job has waited this long, no job after it in the queue starts before it "
                          "(backfill's bound; 1-86400, env GPIPE_STARVE_AFTER_S; default 600)")
    srv.add_argument("--max-code-mib", type=int, default=DEFAULT_CODE_MIB,
                     help=f"the largest job code archive a submit may send, in MiB (default {DEFAULT_CODE_MIB})")
    srv.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus metrics on http://HOST:PORT/metrics (default: none; 0: any free port)")
    srv.add_argument("--metrics-host", default=None,
                     help="the address /metrics listens on (default: the API's, --host)")
    srv.add_argument("--grace-s", type=float, default=25.0, metavar="SECONDS",
                     help="on SIGTERM, how long running jobs have to checkpoint at their next step boundary before "
                          "serve stops (1-3600; default 25, under Kubernetes' 30 s terminationGracePeriodSeconds)")
    srv.add_argument("--tls-cert", help="serve TLS with this certificate chain (PEM)")
    srv.add_argument("--tls-key", help="and this private key (PEM)")

    def client(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help)
        c.add_argument("--coordinator", default=os.environ.get("GPIPE_COORDINATOR", "127.0.0.1:7000"),
                       help="HOST:PORT of serve (env GPIPE_COORDINATOR; default 127.0.0.1:7000)")
        c.add_argument("--auth-token-file", help="the client token (default: env GPIPE_TOKEN)")
        c.add_argument("--tls-ca", help="the CA certificate that signed serve's TLS certificate")
        return c

    c = client("submit", help="send a job spec to serve, or resume a failed or stopped job")
    c.add_argument("job", nargs="?", help="the job spec (YAML)")
    _knobs(c)
    c.add_argument("--resume", metavar="NAME",
                   help="resume job NAME (FAILED or STOPPED) from its last good checkpoint, instead of a spec")
    c.add_argument("--priority", type=int, default=None,
                   help="the job's priority in serve's queue (-1000..1000; the spec's `priority`, default 0)")
    c.add_argument("--follow", action="store_true", help="show progress until the job ends; exit by its state")
    c.add_argument("--attach", action="store_true",
                   help="when serve has a job of that name with this very spec and code (submitted before, e.g. "
                        "by an earlier try of a Kubernetes Job), follow it instead of exit 2")
    c.add_argument("--no-progress", action="store_true",
                   help="with --follow: no progress bar or step lines (evaluations and states still show)")
    c.add_argument("--max-code-mib", type=int, default=DEFAULT_CODE_MIB,
                   help="the largest job code archive to send: the folder of the job file, or the spec's working_dir "
                        f"(default {DEFAULT_CODE_MIB} MiB; serve has its own --max-code-mib)")
    client("status", help="one job's state, progress and history").add_argument("name")
    c = client("list", help="every job serve knows, or a page of them")
    c.add_argument("--limit", type=int, default=None,
                   help="show one page of at most this many jobs (1-1000), and the command for the next page")
    c.add_argument("--page-token", default="", help="start at this page (a previous list's 'more:' line)")
    c.add_argument("--workers", action="store_true",
                   help="the pool's workers instead: each one's rank, host, device, and the job it serves or free")
    c = client("logs", help="a job's per-step metrics and events")
    c.add_argument("name")
    c.add_argument("--follow", action="store_true", help="keep printing until the job ends; exit by its state")
    c.add_argument("--json", action="store_true", help="the lines of the job's metrics.jsonl, as they are")
    client("stop", help="stop a pending or running job").add_argument("name")
    c = client("delete", help="delete an ended job: its record and outputs (weights, checkpoints, logs)")
    c.add_argument("name")
    c.add_argument("--yes", action="store_true", help="do delete (without it, nothing is deleted: exit 2)")
    c.add_argument("--state-dir", help="delete `run`'s job NAME in this state dir instead of serve's")

    corpus.add_parser(sub)
    tl = sub.add_parser("timeline", help="draw a logged step: <job dir>/trace.json and timeline.svg")
    tl.add_argument("job_dir", help="the job's output directory, <state-dir>/<name>")
    tl.add_argument("--step", type=int, default=None, help="the step to draw, counted from 1 as the progress bar counts (default: the last logged)")
    return p


def _within_memory(mib: int | None, build: Callable[[], T]) -> T:
    """build(), bounded to `mib` MiB more address space than this process holds now (RLIMIT_AS, soft and hard):
    past it, one line naming the cap (SpecError), not the host's memory.

    The address space counts every mapping, shared and file-backed ones too (RLIMIT_DATA misses a
    factory's MAP_SHARED memory). What torch and gpipe hold already is not counted against the cap. The
    build runs on one thread with at most two malloc arenas: a thread's stack and arena take address
    space, and a many-core host must not fail a small model.
    """
    if mib is None:
        return build()
    if mib < 1:
        raise SpecError(f"--memory-mib: {mib} is not a positive number of MiB")
    import ctypes
    import errno

    import torch

    torch.set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its own arenas
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, 2)
    held = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    limit = held + (mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def out_of_memory(e: BaseException | None) -> bool:  # Python's, mmap's, torch's allocator's, a thread's stack
        return (isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM)
                or (isinstance(e, RuntimeError) and any(m in str(e) for m in OUT_OF_MEMORY)))

    try:
        return build()
    except (MemoryError, OSError, RuntimeError, SpecError) as e:  # the plan names a factory's error as a SpecError
        if not (out_of_memory(e) or out_of_memory(e.__context__)):
            raise
    raise SpecError(f"model: building the model and data takes more than the {mib} MiB a validation may use "
                    "(serve --validate-memory-mib)")


def _validate_gpus(spec: JobSpec) -> str:
    """With device: cuda, SpecError if this machine has GPUs but fewer than the job's workers; a line saying
    what was checked (or why not: no GPU here, where the job may well not run). '' on a CPU."""
    if spec.device != "cuda":
        return ""
    from gpipe.coordinator.cli.run import too_few_gpus
    from gpipe.worker.device import probe

    seen = probe()
    if not seen.gpus:
        return (f"device: cuda: not checked against GPUs: {seen.describe()}; run refuses it here, and serve "
                "needs a worker with a GPU of its own per rank")
    if (why := too_few_gpus(spec, seen)) is not None:
        raise SpecError(why)
    return f"device: cuda: {spec.topology.world} worker(s), a GPU each of this machine's {len(seen.gpus)}"


def _on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt


def _pool_limits(args: argparse.Namespace) -> Limits:
    """serve's --max-workers and --starve-after-s (or their env), checked: SpecError names the one out of range."""
    from gpipe.coordinator.supervisor import pool

    n = args.max_workers  # argparse has made an int of the flag or the env's text
    if n is not None and not 1 <= n <= pool.MAX_WORKERS:
        raise SpecError(f"--max-workers: {n} is outside 1..{pool.MAX_WORKERS} (or env GPIPE_MAX_WORKERS)")
    starve = pool.STARVE_AFTER_S if args.starve_after_s is None else args.starve_after_s
    if not pool.MIN_STARVE_AFTER_S <= starve <= pool.MAX_STARVE_AFTER_S:  # nan too
        raise SpecError(f"--starve-after-s: {starve} is outside {pool.MIN_STARVE_AFTER_S:g}.."
                        f"{pool.MAX_STARVE_AFTER_S:g} seconds (or env GPIPE_STARVE_AFTER_S)")
    return pool.Limits(n, starve)


def _serve(args: argparse.Namespace) -> int:
    from gpipe import proc
    from gpipe.coordinator.server.serve import serve
    from gpipe.coordinator.server.submissions import (
        MAX_VALIDATE_MEMORY_MIB,
        MIN_VALIDATE_MEMORY_MIB,
    )
    from gpipe.coordinator.supervisor.registry import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S
    from gpipe.service import grpcutil, net

    token = grpcutil.read_token(args.auth_token_file)
    worker_token = grpcutil.read_token(args.worker_token_file, "--worker-token-file", grpcutil.WORKER_TOKEN_ENV)
    if token is not None and token == worker_token:
        raise SpecError("--auth-token-file and --worker-token-file: the client and worker tokens must differ")
    grpcutil.forget_tokens()  # read: no attempt or validation process inherits them
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SpecError("--tls-cert and --tls-key go together")
    tls = None
    if args.tls_cert:
        tls = (grpcutil.read_file("--tls-cert", args.tls_cert), grpcutil.read_file("--tls-key", args.tls_key))
    if args.host is not None:
        try:
            net.iface_for(args.host)
        except ValueError as e:
            raise SpecError(f"--host: {e}") from None
    mib = args.validate_memory_mib
    if mib is not None and not MIN_VALIDATE_MEMORY_MIB <= mib <= MAX_VALIDATE_MEMORY_MIB:
        raise SpecError(f"--validate-memory-mib: {mib} is outside {MIN_VALIDATE_MEMORY_MIB}..{MAX_VALIDATE_MEMORY_MIB}")
    heartbeat_timeout = HEARTBEAT_TIMEOUT_S if args.heartbeat_timeout is None else float(args.heartbeat_timeout)
    if not 2 * HEARTBEAT_INTERVAL_S <= heartbeat_timeout <= 3600:  # nan too
        raise SpecError(f"--heartbeat-timeout: {args.heartbeat_timeout} is outside {2 * HEARTBEAT_INTERVAL_S:g}..3600 "
                        "seconds (or env GPIPE_HEARTBEAT_TIMEOUT_S)")
    grpcutil.check_grace(args.grace_s)
    limits = _pool_limits(args)
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise SpecError(f"--metrics-port: {args.metrics_port} is outside 0..65535")
    if args.metrics_host is not None and args.metrics_port is None:
        raise SpecError("--metrics-host: needs --metrics-port")
    metrics = None if args.metrics_port is None else (args.metrics_host, args.metrics_port)
    note = ""
    if token is None and worker_token is None:
        # A spec names code to run: without tokens, only this machine may submit one.
        if args.host is None:
            args.host = "127.0.0.1"
            note = " (no tokens: this machine only; set --auth-token-file and --worker-token-file to serve others)"
        elif not net.is_loopback(args.host) and not args.insecure:
            raise SpecError(f"--host: {args.host} is reachable from other hosts, and no token is set: anyone who "
                            "reaches it could submit code to run. Set --auth-token-file and --worker-token-file "
                            "(or --insecure)")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # serve stops gracefully by its own handler
    from gpipe.service.code_archive import limit_bytes

    max_code_mib = limit_bytes(args.max_code_mib, "--max-code-mib") >> 20
    import asyncio  # here: `--help` and the parser's errors answer without it
    asyncio.run(serve(args.host, args.port, Path(args.state_dir), token, worker_token, tls, note=note,
                      validate_memory_mib=mib, heartbeat_timeout=heartbeat_timeout, max_code_mib=max_code_mib,
                      metrics=metrics, grace_s=args.grace_s, limits=limits))
    # Stopped, with every record written: skip the interpreter's teardown, which with an attempt just
    # killed took 2 s (gRPC's threads); SIGTERM must end serve well within Kubernetes' grace.
    proc.exit_now(EXIT_OK)
    return 0


async def _client(args: argparse.Namespace) -> int:
    from gpipe.coordinator.cli.client import Client
    from gpipe.service import grpcutil
    from gpipe.service.serde import MAX_PAGE_SIZE

    c = Client(args.coordinator, grpcutil.read_token(args.auth_token_file), args.tls_ca)
    try:
        if args.command == "submit":
            if args.resume:
                return await c.resume(args.resume, args.follow, not args.no_progress)
            return await c.submit(args.job, args.follow, not args.no_progress, args.max_code_mib, args.attach,
                                  overrides=([*args.set, *([f"priority={args.priority}"]
                                                          if args.priority is not None else [])], args.name))
        if args.command == "status":
            return await c.status(args.name)
        if args.command == "list":
            if args.workers:
                return await c.list_workers()
            if args.limit is not None and not 1 <= args.limit <= MAX_PAGE_SIZE:
                raise SpecError(f"--limit: {args.limit} is outside 1..{MAX_PAGE_SIZE}")
            return await c.list(args.limit, args.page_token)
        if args.command == "logs":
            return await c.logs(args.name, args.follow, args.json)
        if args.command == "delete":
            return await c.delete(args.name)
        return await c.stop(args.name)
    finally:
        await c.close()


def _delete(args: argparse.Namespace) -> int:
    """The delete verb: serve's job NAME, or with --state-dir `run`'s; bad input and a running job are exit 2."""
    if not args.yes:
        raise SpecError(f"delete: removes job {args.name!r}'s record and outputs (weights, checkpoints, logs): "
                        "add --yes")
    if args.state_dir is None:
        import asyncio  # here: `--help` and the parser's errors answer without it
        return asyncio.run(_client(args))
    from gpipe.coordinator.outputs.folder import delete_run_output
    from gpipe.coordinator.spec.job import name_problem

    if (why := name_problem(args.name)) is not None:
        raise SpecError(f"name: {why}")
    out = delete_run_output(args.name, Path(args.state_dir))
    print(f"{args.name}: deleted ({out} removed)", file=sys.stderr)
    return EXIT_OK


def _eval(spec: JobSpec, text: str | None, args: argparse.Namespace) -> int:
    """The eval verb: the loss of a weights file on the spec's eval data; bad input is SpecError (exit 2)."""
    import json

    from gpipe.coordinator.cli.run import eval_local

    if spec.eval is None:
        raise SpecError(f"{args.job}: eval: the job has no eval section to evaluate on")
    if args.weights:
        weights = Path(args.weights)
    else:
        weights = Path(args.state_dir) / spec.name / "model.safetensors"
        if not weights.exists():
            raise SpecError(f"--weights: {weights} does not exist (has the job finished?)")
    if not weights.is_file() or not os.access(weights, os.R_OK):
        raise SpecError(f"--weights: {weights} is not a readable file")
    r = eval_local(spec, Path(args.job), Path(args.state_dir), weights, spec_text=text)
    if args.json:
        print(json.dumps(r))
    else:
        step = f", after step {r['step'] + 1}" if r["step"] is not None else ""
        print(f"eval loss {r['loss']:.6g} over {r['samples']} samples ({r['weights']}{step})")
    return 0


def _predicted_lines(plan: Plan) -> list[str]:
    """Each worker's predicted peak memory (gpipe.coordinator.plan.prediction; docs/memory.md), a line a rank."""
    from gpipe.coordinator.plan import baseline, prediction

    top = plan.spec.topology
    predicted = prediction.predictions(plan, [plan.spec.device] * top.world,
                                         lambda device: baseline.runtime_bytes(plan, device))
    if predicted is None:
        return [f"predicted peak memory: not predicted ({plan.footprint_missing})"]
    return [f"rank {n} ({top.name(n)}): predicted peak {prediction.describe(p)}" for n, p in enumerate(predicted)]


def _timeline(args: argparse.Namespace) -> int:
    from gpipe.coordinator.outputs import timeline

    trace, png = timeline.write(Path(args.job_dir), args.step)
    print(f"{trace}\n{png}")
    return 0


def _client_verb(args: argparse.Namespace) -> int:
    import asyncio  # here: `--help` and the parser's errors answer without it
    return asyncio.run(_client(args))


class JobFile(NamedTuple):
    """A job file as a verb gets it: parsed, with its --set and --name applied."""

    spec: JobSpec
    text: str  # the file's text with the overrides applied
    changed: bool  # whether the overrides changed it (then run records `text`, and its attempts read that)
    folder: Path  # the job's folder: its code, and where its relative paths resolve

    @property
    def recorded(self) -> str | None:
        return self.text if self.changed else None


def _validate(job: JobFile, args: argparse.Namespace) -> int:
    spec, job_dir = job.spec, job.folder
    from gpipe.coordinator.plan.job import make_plan
    from gpipe.factory import enter_job_folder

    gpus = "" if args.skip_gpu_check else _validate_gpus(spec)
    enter_job_folder(job_dir)  # a process of this job's own: its factories run in its folder
    plan = _within_memory(args.memory_mib, lambda: make_plan(spec, job_dir))
    print(f"{args.job}: ok ({plan.summary()})")
    if spec.auto:
        print(f"  auto: {', '.join(spec.auto)}: chosen when the job starts, for its workers and their "
              "memory (`gpipe-coordinator plan` shows the choice); the figures below are the meanwhile "
              "values")
    if gpus:
        print(f"  {gpus}")
    for k in range(len(plan.balance)):
        # with virtual stages, a model chunk, on the worker that holds it
        on = f" (rank {spec.topology.worker_of(k)})" if spec.virtual_stages > 1 else ""
        print(f"  stage {k}{on}: {plan.stage_parameters(k):,} parameters: {', '.join(plan.stage_modules(k))}")
    for line in plan.cut_lines():
        print(f"  {line}")
    for line in _predicted_lines(plan):
        print(f"  {line}")
    return 0


def _plan(job: JobFile, args: argparse.Namespace) -> int:
    from gpipe.coordinator.plan import search as planner

    return planner.main(args, job.spec, job.text, job.folder)


def _run(job: JobFile, args: argparse.Namespace) -> int:
    from gpipe.coordinator.cli.run import run_local
    from gpipe.service.grpcutil import check_grace

    check_grace(args.grace_s)
    run_local(job.spec, Path(args.job), Path(args.state_dir), progress=not args.no_progress, resume=args.resume,
              oversubscribe=args.oversubscribe, grace_s=args.grace_s, spec_text=job.recorded)
    return 0


def _eval_verb(job: JobFile, args: argparse.Namespace) -> int:
    return _eval(job.spec, job.recorded, args)


def _with_spec(verb: Callable[[JobFile, argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A verb of a job file: the file read, its --set and --name applied and parsed, then `verb` called."""

    def call(args: argparse.Namespace) -> int:
        from gpipe.coordinator.spec.job import parse_spec, read_spec_text
        from gpipe.coordinator.spec.overrides import apply

        original = read_spec_text(args.job)
        overridden = apply(original, args.set, args.name, args.job)
        spec = parse_spec(overridden, source=args.job)
        folder = Path(args.code_dir).resolve() if getattr(args, "code_dir", None) else spec.code_dir(args.job)
        return verb(JobFile(spec, overridden, overridden is not original, folder), args)

    return call


# One function per verb. Each imports what it needs when called: `--help`, a flag's error and the client verbs
# (submit, status, list, logs, stop) import no torch.
VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _with_spec(_run),
    "validate": _with_spec(_validate),
    "plan": _with_spec(_plan),
    "eval": _with_spec(_eval_verb),
    "serve": _serve,
    "submit": _client_verb,
    "status": _client_verb,
    "list": _client_verb,
    "logs": _client_verb,
    "stop": _client_verb,
    "delete": _delete,
    "timeline": _timeline,
    "tokenize": corpus.main,
}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "submit" and bool(args.job) == bool(args.resume):
        parser.exit(EXIT_BAD_INPUT, "gpipe-coordinator submit: error: give a job spec or --resume NAME, not both\n"
                    if args.job else "gpipe-coordinator submit: error: give a job spec or --resume NAME\n")
    if args.command == "submit" and args.resume and (args.set or args.name is not None):
        parser.exit(EXIT_BAD_INPUT, "gpipe-coordinator submit: error: --set and --name go with a job spec, not "
                    "--resume\n")
    if args.command == "submit" and args.resume and args.attach:
        parser.exit(EXIT_BAD_INPUT, "gpipe-coordinator submit: error: --attach goes with a job spec, not --resume\n")
    warnings.filterwarnings("ignore", message="You are using a Backend")
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return VERBS[args.command](args)
    except GpipeError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (logs NAME | head): quietly, as a tool killed by SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 128 + signal.SIGPIPE
    except Exception as e:  # a bug of ours: one line, and the traceback on request
        if os.environ.get("GPIPE_DEBUG"):
            raise
        print(f"error: internal error: {type(e).__name__}: {e} (GPIPE_DEBUG=1 shows the traceback)",
              file=sys.stderr, flush=True)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
