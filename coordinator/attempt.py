"""One attempt of a job, in a process of its own: plan, (resume,) drive, report.

`gpipe-coordinator run` and `serve` start one per attempt, so every attempt
gets a fresh RPC world and a fresh rendezvous: one that saw a failure is never
reused. With --local it starts the stages' worker processes itself (that is
`run`); otherwise it opens the rendezvous on --host and the server tells the
workers to join. With --resume it starts from the newest checkpoint that
verifies, passing over damaged or torn ones with a line each.

It reports to its parent one JSON object a line on stdout:

    {"log": "..."}                          a line for the user
    {"resumed": N}                          training starts at step N (0: the beginning)
    {"master": "HOST:PORT"}                 the workers may join now (not with --local)
    {"metrics": {...}}                      a logged step (also in metrics.jsonl)
    {"checkpoint": {"step": N, ...}}        a checkpoint was committed
    {"error": "...", "stage": K}            the attempt failed (stage null if none is to blame)
    {"done": true}                          trained; model.safetensors is written

    python -m gpipe.coordinator.attempt --spec S --job-dir J --state-dir D --host H --devices cpu,cpu \\
        [--local] [--resume] [--attempt N]
"""

from __future__ import annotations

from gpipe import proc

if __name__ == "__main__":
    proc.adopt()  # first, before the seconds torch takes to import: die with the parent from the start

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import warnings
from dataclasses import asdict
from pathlib import Path

from gpipe.coordinator.local import LocalWorkers, split_cores, threads_per_stage
from gpipe.coordinator.spec import JobSpec, load_spec
from gpipe.errors import GpipeError, JobFailed, SpecError

# torch and what needs it are imported in main(), once the local workers are on their way.


def device_for(spec: JobSpec, stage: int) -> str:
    """A local stage's device: the CPU, or GPU k mod the GPU count."""
    import torch

    if spec.device == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise SpecError("device: cuda was asked for, but this machine has no CUDA device")
    return f"cuda:{stage % torch.cuda.device_count()}"


_tell_lock = threading.Lock()


def tell(obj: dict) -> None:
    """One report to the parent, a line of JSON (the driver and the checkpoint writer both report)."""
    line = json.dumps(obj) + "\n"
    with _tell_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpipe.coordinator.attempt")
    p.add_argument("--spec", required=True)
    p.add_argument("--job-dir", required=True, help="the job file's folder (its modules are importable)")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--devices", help="each stage's device, comma-separated (--local: from the spec)")
    p.add_argument("--local", action="store_true", help="start the stages' worker processes here")
    p.add_argument("--resume", action="store_true", help="start from the newest good checkpoint")
    p.add_argument("--attempt", type=int, default=1)
    p.add_argument("--log", help="once planned, send this process's stderr to this file")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="You are using a Backend")
    workers: LocalWorkers | None = None
    try:
        spec = load_spec(a.spec)
        out = Path(a.state_dir) / spec.name
        sock = None
        if a.local and spec.balance != "by_time":  # by_time measures the layers on idle cores: start them after
            # Started before torch is imported here, they import theirs meanwhile. Their logs wait in a
            # scratch folder until the plan holds: a job that fails its checks writes nothing.
            sock = socket.create_server((socket.gethostbyname(a.host), 0), backlog=512)
            master = f"{a.host}:{sock.getsockname()[1]}"
            scratch = Path(tempfile.mkdtemp(prefix=f"gpipe-{spec.name}-"))
            workers = LocalWorkers(spec.stages, master, a.host, scratch, spec.start_timeout_s,
                                   [str(Path(a.job_dir).resolve())])
        import torch

        from gpipe import net
        from gpipe.coordinator import checkpoint
        from gpipe.coordinator.driver import (
            MetricsLog,
            StepMetrics,
            drive,
            resume_parts,
            write_plan,
        )
        from gpipe.coordinator.outputs import prepare_output
        from gpipe.coordinator.plan import make_plan

        devices = [device_for(spec, k) for k in range(spec.stages)] if a.local else a.devices.split(",")
        resume = None
        if a.resume:
            resume = checkpoint.latest(out / "checkpoints", lambda line: tell({"log": line}))
            if resume is not None:
                tell({"log": f"resuming from checkpoint {resume.path.name} ({resume.path})"})
            else:
                tell({"log": "no checkpoint to resume from: starting at step 0"})
        tell({"resumed": resume.step if resume else 0})
        net.bind_to(a.host)
        _, port = net.bound_store(a.host, spec.start_timeout_s, sock)
        if not a.local:
            tell({"master": f"{a.host}:{port}"})
        threads = threads_per_stage(split_cores(spec.stages)) if a.local else 1
        plan = make_plan(spec, Path(a.job_dir), devices[0], threads,
                         balance_of=resume.meta.get("balance") if resume else None)
        if resume is not None:
            resume_parts(plan, resume)  # the checkpoint fits this job's model and data, or nothing starts
        # The plan holds: only now is anything written (a fresh run drops an earlier run's outputs).
        prepare_output(spec.name, Path(a.state_dir), fresh=not a.resume)
        if a.log:
            Path(a.log).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(a.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 2)
            os.close(fd)
        torch.set_num_threads(1)  # the cores belong to the stages
        if workers is not None:
            workers.move_logs(out / "logs")
        elif a.local:
            workers = LocalWorkers(spec.stages, f"{a.host}:{port}", a.host, out / "logs", spec.start_timeout_s,
                                   plan.import_paths)
        if workers is not None:
            placement = [{"device": devices[k], "cores": w.cores, "threads": workers.threads}
                         for k, w in enumerate(workers.workers)]
            tell({"log": f"{spec.stages} stages, balance {plan.balance}, {spec.chunks} micro-batches, "
                         f"schedule {spec.schedule}, {workers.threads} thread(s) per stage"})
        else:
            placement = [{"device": d} for d in devices]
        write_plan(out, plan, placement)
        log = MetricsLog(out, spec.log_every, spec.steps)

        def on_step(m: StepMetrics) -> None:
            if log.write(m):
                tell({"metrics": asdict(m)})

        def on_checkpoint(step: int, d: Path, size: int, write_s: float, stall_s: float) -> None:
            tell({"checkpoint": {"step": step, "path": str(d), "bytes": size, "write_s": write_s,
                                 "stall_s": stall_s}})

        try:
            drive(plan, out, a.host, port, devices, on_step, on_checkpoint, resume, a.attempt)
            if workers is not None and not workers.wait(30):
                raise JobFailed("the workers did not exit after the job")
        finally:
            log.close()
    except GpipeError as e:
        tell({"error": str(e), "stage": getattr(e, "stage", None)})
        return e.exit_code
    except Exception as e:
        tell({"error": f"internal error: {type(e).__name__}: {e}", "stage": None})
        return 1
    finally:
        if workers is not None:
            workers.kill()
    tell({"done": True})
    return 0


if __name__ == "__main__":
    proc.exit_now(main())
