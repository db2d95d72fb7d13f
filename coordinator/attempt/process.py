"""One attempt of a job, in a process of its own: plan, resume, open the rendezvous, drive, report.

The supervisor starts one per attempt (for `run` and `serve` alike), so every
attempt gets a fresh RPC world and a fresh rendezvous: one that saw a failure
is never reused. It plans the job first (a job that fails its checks writes
nothing), then reports `Master` with the attempt's secret, and the supervisor
tells each rank's worker to join, handing it the secret over the authenticated
command stream. With --resume it starts from the newest checkpoint that verifies,
passing over damaged or torn ones with a line each (at step 0 where none was
committed; bad input, naming each, where every one committed is damaged);
without it, it starts over and drops an earlier run's metrics and checkpoints.

It reports to the supervisor in typed messages (gpipe.coordinator.attempt.report) on
the stream that was its stdout; the model's own prints go to its log.

    python -m gpipe.coordinator.attempt.process --spec S --job-dir J --state-dir D --host H \\
        --placement '[{"host": H, "device": "cpu", "cores": [0], "threads": 1}, ...]' [--resume] [--attempt N]

With --evaluate WEIGHTS it trains nothing and writes nothing: it evaluates the
weights file on the job's eval data (the eval verb) and reports one `Eval`.

SIGUSR1 (a worker or serve preempted) has it stop at the next step boundary
with a checkpoint, leave, and report `Preempted`; SIGTERM (a worker lost) fails
it, committing the checkpoints it took.
"""

from __future__ import annotations

from gpipe import proc

if __name__ == "__main__":
    proc.adopt()  # first, before the seconds torch takes to import: die with the parent from the start

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import threading
import traceback
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpipe.contract import disk_cause
from gpipe.coordinator.attempt import report
from gpipe.coordinator.attempt.report import Placement
from gpipe.coordinator.spec.job import JobSpec, load_spec
from gpipe.errors import (
    EXIT_FAILED,
    GpipeError,
    SpecError,
    describe_os_error,
    disk_error,
)
from gpipe.factory import enter_job_folder

if TYPE_CHECKING:
    from gpipe.coordinator.plan.job import Plan


def device_for(spec: JobSpec, device: str, rank: int) -> str:
    """Where rank `rank`'s stage runs: cpu for a cpu job, else the device its worker registered (cuda:K, checked
    by the worker at its start). Nothing here decides a GPU or asks CUDA: the coordinator may have none."""
    if spec.device == "cpu":
        return "cpu"
    if not device.startswith("cuda:"):
        raise SpecError(f"device: cuda, but rank {rank}'s worker registered {device!r}, not a GPU: start it with "
                        "--device cuda:K")
    return device


def _parse_placement(text: str) -> list[Placement]:
    try:
        return [Placement(str(p["host"]), str(p["device"]), [int(c) for c in p["cores"]], int(p["threads"]),
                          None if p.get("rank") is None else int(p["rank"]), int(p.get("memory_bytes", 0)))
                for p in json.loads(text)]
    except (ValueError, KeyError, TypeError) as e:
        raise SpecError(f"--placement: not a list of stage placements ({e})") from None


def _redirect_stderr(path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def _placed(a: argparse.Namespace, spec: JobSpec) -> tuple[list[Placement], list[str]]:
    """Each stage's worker and device."""
    placement = _parse_placement(a.placement)
    if len(placement) != spec.topology.world:
        raise SpecError(f"--placement: {len(placement)} workers for {spec.replicas} replica(s) x {spec.stages} "
                        "stages")
    # A worker's device follows its own rank, not the slot it serves (elastic: a spare serves another's).
    return placement, [device_for(spec, p.device, k if p.rank is None else p.rank) for k, p in enumerate(placement)]


def _auto(spec: JobSpec, a: argparse.Namespace, placement: list[Placement], out: Path,
          tell: report.Reporter) -> tuple[JobSpec, dict[str, Any] | None]:
    """`spec` with its `auto` fields chosen (gpipe.coordinator.plan.search.resolve), and the record plan.json keeps; a
    resumed attempt takes the choice its job made before (plan.json's `auto`), so its micro-batches stay."""
    if not spec.auto:
        return spec, None
    from gpipe.coordinator.plan import search as planner

    if a.resume:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            before = json.loads((out / "plan.json").read_text())["auto"]
            if before and before.get("fields") == sorted(spec.auto):
                resolved = planner.chosen(spec, before)
                tell(report.Log(f"auto: as chosen before: {_chosen_line(before)}"))
                return resolved, before
    budget = min(p.memory_bytes or _cpu_share(spec.topology.world) for p in placement)
    resolved, record = planner.resolve(spec, Path(a.job_dir), spec.topology.world, placement[0].threads, budget)
    tell(report.Log(f"auto: {_chosen_line(record)}; {record['why']}"))
    return resolved, record


def _predict_step(plan: Plan, threads: int) -> None:
    """plan.json's predicted step time: the auto choice's, or the job's own (gpipe.coordinator.plan.search.predict_step);
    a prediction that fails stops nothing."""
    if plan.auto:
        plan.predicted_step_s = plan.auto["predicted_step_s"]
        return
    from gpipe.coordinator.plan import search as planner

    try:  # the layers measured: kept for the unchanged job's next plan too (gpipe.coordinator.plan.probe_cache)
        plan.predicted_step_s, plan.predicted_step_missing = plan.probes.answer(
            "step", lambda: planner.predict_step(plan, threads), tuple[float | None, str])
    except Exception as e:
        plan.predicted_step_missing = f"{type(e).__name__}: {e}"


def _step_against_prediction(times: list[float], predicted: float | None) -> str | None:
    """The attempt's step time (the median, past the first step, which builds the optimizer's state) against
    the predicted one: `step 112.0 ms (predicted 105.0)`."""
    if not times:
        return None
    ms = statistics.median(times[1:] or times) * 1e3
    said = f"predicted {predicted * 1e3:.1f}" if predicted is not None else "not predicted"
    return f"step {ms:.1f} ms, the median of {len(times)} ({said})"


def _chosen_line(record: dict[str, Any]) -> str:
    chosen = ", ".join(f"{k} {v}" for k, v in record["chosen"].items())
    return f"{chosen} (predicted {record['predicted_step_s'] * 1e3:.1f} ms a step)"


def _cpu_share(workers: int) -> int:
    """A CPU worker's memory, as the auto values plan for it: this host's available memory split among `workers`
    (run's local workers; under serve, workers on other hosts are taken to have as much)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 // max(1, workers)
    return 1 << 40  # no /proc: not bounded here


def _rendezvous(a: argparse.Namespace, spec: JobSpec) -> tuple[int, str]:
    """Open this attempt's rendezvous store on --host: its port, and the attempt's secret."""
    from gpipe.service import net

    net.bind_to(a.host)
    secret = net.new_secret()  # this attempt's: the workers get it from the supervisor, never from argv
    net.use_secret(secret)
    _, port = net.bound_store(a.host, spec.start_timeout_s)
    return port, secret


def evaluate(a: argparse.Namespace, tell: report.Reporter) -> None:
    """The eval verb's attempt: plan, load the weights, open the rendezvous, evaluate once, report."""
    spec = load_spec(a.spec).one_replica()  # evaluating needs one pipeline
    if spec.eval is None:
        raise SpecError(f"{a.spec}: eval: the job has no eval section to evaluate on")
    placement, devices = _placed(a, spec)
    import torch

    from gpipe.coordinator.attempt.driver import drive_eval
    from gpipe.coordinator.attempt.eval_weights import load_weights
    from gpipe.coordinator.plan.job import make_plan

    # The model built whole, to hold the weights evaluated (not model.weights', which a job starts from).
    plan = make_plan(spec, Path(a.job_dir), "cpu", placement[0].threads, meta=False)  # the coordinator's CPU
    plan.evaluate_only, plan.weights = True, None
    own = plan.model.state_dict()  # a captured model's pieces hold the weights the file names by the model's names
    weights, step = load_weights(Path(a.evaluate), {plan.weight_name(k): t for k, t in own.items()})
    plan.model.load_state_dict({k: weights[plan.weight_name(k)] for k in own})
    port, secret = _rendezvous(a, spec)
    if a.log:
        _redirect_stderr(a.log)
    torch.set_num_threads(1)  # the cores belong to the stages
    tell(report.Master(f"{a.host}:{port}", secret))
    m = drive_eval(plan, a.host, port, devices)
    tell(report.Eval({**asdict(m), "step": step, "weights": str(Path(a.evaluate).resolve())}))


PREEMPTED = threading.Event()  # SIGUSR1: stop at the next step boundary, with a checkpoint


def _shaped(a: argparse.Namespace, spec: JobSpec) -> JobSpec:
    """The job at --stages x --replicas (a re-planned attempt: gpipe.coordinator.plan.elastic), or as its spec says."""
    if a.stages is None and a.replicas is None:
        return spec
    from gpipe.coordinator.plan.elastic import describe, shapes

    want = spec.topology_at(spec.stages if a.stages is None else a.stages,
                            spec.replicas if a.replicas is None else a.replicas)
    if want not in shapes(spec):
        raise SpecError(f"--stages/--replicas: {describe(want)} is not a shape this job may re-plan onto "
                        "(elastic: the same micro-batches on fewer replicas, then down to min_stages)")
    return spec.reshaped(want.stages, want.replicas)


def attempt(a: argparse.Namespace, tell: report.Reporter) -> int | None:
    """Train; the checkpoint step it stopped at when preempted (reported `Preempted`), else None."""
    spec = _shaped(a, load_spec(a.spec))
    out = Path(a.state_dir) / spec.name
    placement, devices = _placed(a, spec)
    import torch

    from gpipe.coordinator.attempt.board import Board
    from gpipe.coordinator.attempt.driver import drive
    from gpipe.coordinator.attempt.eval_weights import BEST, Best
    from gpipe.coordinator.attempt.metrics import EvalMetrics, MetricsLog, StepMetrics, write_plan
    from gpipe.coordinator.attempt.resume import resume_parts
    from gpipe.coordinator.outputs import checkpoint
    from gpipe.coordinator.outputs.folder import prepare_output
    from gpipe.coordinator.plan import prediction
    from gpipe.coordinator.plan.job import make_plan
    from gpipe.coordinator.plan.probe_cache import Probes
    from gpipe.memory.meter import map_apart, resident_peak_bytes

    resume = None
    if a.resume:
        try:
            resume = checkpoint.latest(checkpoint.folder(out), lambda line: tell(report.Log(line)))
        except checkpoint.NoUsableCheckpoint as e:  # starting over would drop them: the user decides
            raise SpecError(str(e)) from None
        if resume is not None:
            tell(report.Log(f"resuming from checkpoint {resume.path.name} ({resume.path})"))
        else:
            tell(report.Log("no checkpoint to resume from: starting at step 1"))
    tell(report.Resumed(resume.step if resume else 0))
    port, secret = _rendezvous(a, spec)
    spec, auto = _auto(spec, a, placement, out, tell)
    # Planned on this process's CPU: the coordinator never touches a GPU (its pod has none); by_time measures
    # the layers there, a stand-in for the workers' devices.
    plan = make_plan(spec, Path(a.job_dir), "cpu", placement[0].threads,
                     balance_of=resume.meta.get("balance") if resume else None,
                     probes=Probes.of(out, spec, Path(a.job_dir), placement[0].threads))
    plan.auto = auto
    if resume is not None:
        resume_parts(plan, resume)  # the checkpoint fits this job's model and data, or nothing starts
    _predict_step(plan, placement[0].threads)
    # The plan holds: only now is anything written (a fresh start drops an earlier run's outputs).
    prepare_output(spec.name, Path(a.state_dir), fresh=not a.resume)
    plan.probes.save()
    if a.log:
        _redirect_stderr(a.log)
    if plan.probes.reused:
        print(f"gpipe: attempt {a.attempt}: the probes as an earlier plan of this model, spec and code measured them "
              f"({', '.join(plan.probes.reused)}: {plan.probes.path})", file=sys.stderr, flush=True)
    print(f"gpipe: attempt {a.attempt}: rendezvous store on {a.host}:{port}", file=sys.stderr, flush=True)
    torch.set_num_threads(1)  # the cores belong to the stages
    map_apart()  # state passes through here in pieces: each goes back to the system once written or sent
    tell(report.Master(f"{a.host}:{port}", secret))
    threads = sorted({p.threads for p in placement})
    copies = f"{spec.replicas} replicas x " if spec.replicas > 1 else ""
    virtual = f" x {spec.virtual_stages} model chunks" if spec.virtual_stages > 1 else ""
    tell(report.Log(f"{copies}{spec.stages} stages{virtual}, balance {plan.balance}, {spec.chunks} micro-batches, "
                    f"schedule {spec.schedule}, {'/'.join(map(str, threads))} thread(s) per stage"))
    placed = [{"device": devices[k], "host": p.host, "cores": p.cores, "threads": p.threads,
               "worker": k if p.rank is None else p.rank}  # the worker's own rank (the pool's: any idle one)
              for k, p in enumerate(placement)]
    predicted = prediction.Announced(plan, devices, lambda p, why: write_plan(out, plan, placed, p, why),
                                     lambda line: tell(report.Log(line)))
    log = MetricsLog(out, spec.log_every, spec.steps)
    # A resumed attempt runs the steps from its checkpoint's again: TensorBoard drops what was shown of them.
    board = Board(out, purge_step=resume.step if resume else 0)
    best = Best(out / BEST, lambda line: tell(report.Log(line))) if spec.keep_best else None

    step_times: list[float] = []

    def on_step(m: StepMetrics) -> None:
        step_times.append(m.step_time_s)
        if log.logs(m.step):
            values = m.values()
            log.write(values)
            board.step(m)
            tell(report.Metrics(values))

    def on_eval(m: EvalMetrics, weights: dict[str, torch.Tensor] | None) -> None:
        log.write_eval(m)
        board.eval(m)
        tell(report.Eval(asdict(m)))
        if best is not None and best.offer(m, weights):
            after = m.step + 1 if m.step is not None else 0  # steps done, as status counts them
            tell(report.Log(f"best: after step {after}, eval loss {m.eval_loss:.6g}: {best.path}"))

    def on_checkpoint(step: int, d: Path, size: int, write_s: float, stall_s: float) -> None:
        board.flush()  # a resumed attempt purges only the steps after this checkpoint: those before are written
        tell(report.Checkpoint(step, str(d), size, write_s, stall_s))

    try:
        stopped_at = drive(plan, out, a.host, port, devices, on_step, on_checkpoint, resume, a.attempt, on_eval,
                           spec.keep_best, PREEMPTED.is_set)
    finally:
        log.close()
        board.close()
    predicted.finish()  # plan.json complete before the job is done
    if stopped_at is not None:
        tell(report.Log(f"preempted: stopped after step {stopped_at}, with checkpoint step-{stopped_at}"))
        tell(report.Preempted(stopped_at))
        return stopped_at
    if (line := _step_against_prediction(step_times, plan.predicted_step_s)) is not None:
        tell(report.Log(line))
    # What this process held at most: with init per_layer, not the model (docs/running.md: bigger than one machine).
    tell(report.Log(f"attempt {a.attempt}: peak resident memory {resident_peak_bytes() / 2**20:.1f} MiB (VmHWM)"))
    return None


class AttemptEnded(BaseException):
    """SIGTERM from the supervisor, raised wherever this process is: a BaseException, as KeyboardInterrupt is, so
    that no handler of the job's own code's errors (`except Exception`: a probe naming the layer that raised)
    takes it for the model's failure; an end decided by the supervisor is never the model's, nor its repeat."""


ENDED_BY_SUPERVISOR = "the supervisor ended this attempt"


def _stopped(signum: int, frame: object) -> None:
    """SIGTERM from the supervisor (a worker of this attempt was lost): fail, committing the snapshots taken."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the commit that follows must not be cut short
    raise AttemptEnded(ENDED_BY_SUPERVISOR)


def main(argv: list[str] | None = None) -> int:
    # Reports go to the stream that was stdout; from here on, anything printed goes to the log.
    tell = report.Reporter(os.fdopen(os.dup(1), "w"))
    os.dup2(2, 1)
    p = argparse.ArgumentParser(prog="python -m gpipe.coordinator.attempt.process")
    p.add_argument("--spec", required=True)
    p.add_argument("--job-dir", required=True, help="the job file's folder (its modules are importable)")
    p.add_argument("--state-dir", required=True)
    p.add_argument("--host", required=True, help="where the rendezvous and this process's RPC listen")
    p.add_argument("--placement", required=True,
                   help="each worker, by rank: JSON [{host, device, cores, threads}]")
    p.add_argument("--resume", action="store_true", help="start from the newest good checkpoint")
    p.add_argument("--attempt", type=int, default=1)
    p.add_argument("--stages", type=int, help="re-planned (elastic): this many stages instead of the spec's")
    p.add_argument("--replicas", type=int, help="re-planned (elastic): this many replicas instead of the spec's")
    p.add_argument("--log", help="once planned, send this process's stderr to this file")
    p.add_argument("--evaluate", metavar="WEIGHTS", help="evaluate this safetensors file on the job's eval data; "
                   "train and write nothing")
    a = p.parse_args(argv)
    for name in ("spec", "job_dir", "state_dir", "log", "evaluate"):  # as given, before the job's folder is entered
        if getattr(a, name):
            setattr(a, name, os.path.abspath(getattr(a, name)))
    warnings.filterwarnings("ignore", message="You are using a Backend")
    signal.signal(signal.SIGTERM, _stopped)
    signal.signal(signal.SIGUSR1, lambda signum, frame: PREEMPTED.set())
    try:
        enter_job_folder(a.job_dir)  # the job's factories run there, as on its workers
        stopped_at = None
        if a.evaluate:
            evaluate(a, tell)
        else:
            stopped_at = attempt(a, tell)
    except GpipeError as e:
        tell(report.Failed.of(e))
        return e.exit_code
    except AttemptEnded:
        tell(report.Failed(ENDED_BY_SUPERVISOR, EXIT_FAILED))
        return EXIT_FAILED
    except OSError as e:
        if not disk_error(e):
            traceback.print_exc()
            tell(report.Failed(f"internal error: {type(e).__name__}: {e}", EXIT_FAILED))
            return EXIT_FAILED
        tell(report.Failed(describe_os_error(e), EXIT_FAILED, disk_cause(e)))  # the policy decides by the errno
        return EXIT_FAILED
    except Exception as e:
        traceback.print_exc()  # to the log: a bug of ours
        tell(report.Failed(f"internal error: {type(e).__name__}: {e}", EXIT_FAILED))
        return EXIT_FAILED
    if stopped_at is None:
        tell(report.Done())
    return 0


if __name__ == "__main__":
    proc.exit_now(main())
