"""`gpipe-coordinator run job.yaml`: the whole job on this machine, nothing else to start.

It plans the job (every check that needs the model runs here, before any
process starts), starts one worker process per stage on loopback, drives them,
and writes <state-dir>/<name>/: plan.json, metrics.jsonl, logs/ and, at the
end, model.safetensors.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from coordinator.driver import MetricsLog, StepMetrics, drive, prepare_output, write_plan
from coordinator.local import LocalWorkers, split_cores, threads_per_stage
from coordinator.plan import make_plan
from coordinator.progress import Progress
from coordinator.spec import JobSpec
from gpipe import net
from gpipe.errors import JobFailed, SpecError

HOST = "127.0.0.1"  # local workers talk over loopback only


def device_for(spec: JobSpec, stage: int) -> str:
    if spec.device == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise SpecError("device: cuda was asked for, but this machine has no CUDA device")
    return f"cuda:{stage % torch.cuda.device_count()}"


def run_local(spec: JobSpec, job_dir: Path, state_dir: Path, progress: bool = True) -> Path:
    """Train `spec` with local workers; return the job's output directory."""
    devices = [device_for(spec, k) for k in range(spec.stages)]
    plan = make_plan(spec, job_dir, devices[0], threads_per_stage(split_cores(spec.stages)))
    out = prepare_output(spec.name, state_dir)
    torch.set_num_threads(1)  # the cores belong to the stages
    net.bind_to(HOST)
    _, port = net.bound_store(HOST, spec.start_timeout_s)
    workers = LocalWorkers(spec.stages, f"{HOST}:{port}", HOST, out / "logs", spec.start_timeout_s,
                           plan.import_paths)
    write_plan(out, plan, [{"device": devices[k], "cores": w.cores, "threads": workers.threads}
                           for k, w in enumerate(workers.workers)])
    print(f"{spec.name}: {spec.stages} stages, balance {plan.balance}, {spec.chunks} micro-batches, "
          f"schedule {spec.schedule}, {workers.threads} thread(s) per stage", file=sys.stderr, flush=True)

    def alive() -> str | None:
        dead = workers.dead()
        if not dead:
            return None
        k = dead[0][0]
        why = workers.describe_exit(k)
        line = workers.last_error_line(k)
        return f"{why}: {line}" if line else why

    bar = Progress(spec.steps, enabled=progress)
    log = MetricsLog(out, spec.log_every, spec.steps)

    def on_step(m: StepMetrics) -> None:
        log.write(m)
        bar.update(m.step, m.loss, m.samples_per_s)

    ok = False
    t0 = time.monotonic()
    try:
        drive(plan, out, HOST, port, devices, alive, on_step)
        ok = workers.wait(30)
    finally:
        bar.close()
        log.close()
        if not ok:
            workers.kill()
    if not ok:
        raise JobFailed("the workers did not exit after the job")
    print(f"{spec.name}: done in {time.monotonic() - t0:.1f}s; weights in {out / 'model.safetensors'}",
          file=sys.stderr, flush=True)
    return out
