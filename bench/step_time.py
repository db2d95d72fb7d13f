"""Step time: gpipe against torch.distributed.pipelining and one process, side by side.

    python bench/step_time.py [--rounds 3] [--steps 20] [--chunks 8]

The model is 8 x (Linear(1024)+ReLU), batch 256 in 8 (or --chunks)
micro-batches, 2 stages, one thread per stage (each process pinned to its own
core). gpipe runs its schedules gpipe, 1f1b and zb-h1 (the backward split into
B and W), and on 4 model chunks of 2 layers (2 per worker) interleaved-1f1b and
zbv (and the V's v-half, v-min and dualpipev), and reports each one's measured bubble (the workers' idle share of the
step, from metrics.jsonl) beside the bubble its schedule leaves at the costs
its actions measured (gpipe.schedule.steady: each stage's median F, B and W,
steps in a row as the service runs them, with no transfer or step overhead);
the difference is what the run adds. "at cost" is the step time with that
bubble and the run's own busy time: what the schedule would take with no
overhead but its actions' own. The
peer runs its ScheduleGPipe, Schedule1F1B, and, on 4 chunks of 2 layers (2 per
rank), ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble and
ScheduleZBVZeroBubble and ScheduleDualPipeV. Each round runs every contender once, interleaved, and the figures are
medians over rounds of each run's median step time, since absolute times on
these machines drift twofold between runs. Ratios are speed-ups over one
process doing the same micro-batched work; the ideal is P*M/(M+P-1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
WIDTH, DEPTH, BATCH, CHUNKS, STAGES = 1024, 8, 256, 8, 2
VIRTUAL = ("interleaved-1f1b", "zbv", "v-half", "v-min", "dualpipev")  # gpipe's schedules of 2 model chunks a worker
PEER_NAMES = {  # each of our schedules: the peer's same schedule (zb-h1 has none: its nearest is 1F1B)
    "gpipe": "torch.pipelining ScheduleGPipe", "1f1b": "torch.pipelining Schedule1F1B",
    "zb-h1": "torch.pipelining Schedule1F1B", "interleaved-1f1b": "torch.pipelining ScheduleInterleaved1F1B",
    "zbv": "torch.pipelining ScheduleZBVZeroBubble", "dualpipev": "torch.pipelining ScheduleDualPipeV",
}


def env() -> dict[str, str]:
    # Every contender runs with the malloc settings gpipe's workers use, so the
    # ratios compare the engines, not the allocator.
    from gpipe.worker.agent import MALLOC_ENV

    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **MALLOC_ENV)


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def run_single(steps: int, chunks: int = CHUNKS) -> float:
    cmd = [sys.executable, str(ROOT / "bench/_peers.py"), "single", *map(str, (WIDTH, DEPTH, BATCH, chunks, steps))]
    out = subprocess.run(["taskset", "-c", str(cores()[0]), *cmd], env=env(), capture_output=True, text=True,
                         check=True, timeout=600)
    return float(out.stdout.strip().splitlines()[-1])


def run_pipelining(schedule: str, steps: int, chunks: int = CHUNKS) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(STAGES):
        cmd = [sys.executable, str(ROOT / "bench/_peers.py"), "pipelining", schedule, str(rank),
               *map(str, (WIDTH, DEPTH, BATCH, chunks, steps, port))]
        core = cores()[rank % len(cores())]
        procs.append(subprocess.Popen(["taskset", "-c", str(core), *cmd], env=env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(f"torch.distributed.pipelining failed: {err[-2000:]}")
    return float(outs[0][0].strip().splitlines()[-1])


def run_gpipe(schedule: str, steps: int, tmp: Path, stages: int = STAGES, replicas: int = 1,
              chunks: int = CHUNKS) -> float:
    """gpipe's median step time; with `replicas`, each replica runs chunks / replicas micro-batches of the batch."""
    return statistics.median(float(m["step_time_s"]) for m in gpipe_steps(schedule, steps, tmp, stages, replicas, chunks))


def gpipe_steps(schedule: str, steps: int, tmp: Path, stages: int = STAGES, replicas: int = 1,
                chunks: int = CHUNKS, checkout: Path | None = None) -> list[dict[str, Any]]:
    """The metrics of `steps` steps of gpipe (after 3 warm-up steps); with `checkout`, that checkout's gpipe
    (set up: make setup), from its own environment."""
    name = f"bench-{schedule}-{replicas}x{stages}-{chunks}"
    virtual = 2 if schedule in VIRTUAL else 1  # model chunks per worker
    spec = {
        "name": name,
        "model": {"factory": "mlp", "args": {"width": WIDTH, "depth": DEPTH, "head": False}},
        "stages": stages, "replicas": replicas, "chunks": chunks // replicas, "schedule": schedule,
        "virtual_stages": virtual, "balance": [DEPTH // (stages * virtual)] * (stages * virtual),
        "data": {"factory": "random_regression",
                 "args": {"n": BATCH, "in_features": WIDTH, "out_features": WIDTH}, "batch_size": BATCH},
        "loss": "mse", "optimizer": {"name": "sgd", "lr": 1e-3}, "steps": steps + 3,
    }
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec))
    e, cmd = env(), [sys.executable, "-m", "gpipe.coordinator.cli.main"]
    if checkout is not None:
        e.pop("PYTHONPATH", None)  # it imports its own gpipe
        cmd = [str(checkout / ".venv/bin/gpipe-coordinator")]
    r = subprocess.run([*cmd, "run", str(job), "--state-dir", str(tmp), "--no-progress"], env=e,
                       capture_output=True, text=True, timeout=600, cwd=checkout)
    if r.returncode:
        raise RuntimeError(f"gpipe {schedule} failed: {r.stderr[-2000:]}")
    lines = (tmp / name / "metrics.jsonl").read_text().splitlines()
    shutil.rmtree(tmp / name)  # the next round's run starts afresh
    return [json.loads(x) for x in lines[3:]]


def costed_bubble(schedule: str, steps: list[dict[str, Any]], chunks: int) -> float:
    """The bubble `schedule` leaves at the costs its actions took in `steps` (each model chunk's median F, B and
    W over the steps and micro-batches), with instant transfers and no step overhead, run step after step as
    the service runs it (gpipe.schedule.steady: a worker's next step overlaps the others' ends)."""
    from gpipe import schedule as schedules
    from gpipe.topology import model_chunk

    workers, virtual = STAGES, 2 if schedule in VIRTUAL else 1
    took: dict[tuple[int, str], list[float]] = {}
    for step in steps:
        for s in step["stages"]:
            for kind, _, a, b in s["timeline"]:
                took.setdefault((s["stage"], kind), []).append(b - a)
    median = {key: statistics.median(v) for key, v in took.items()}
    return schedules.steady(schedule, workers, chunks, virtual, lambda k, a: median[
        (model_chunk(schedule, k, a.worker_chunk, workers), a.kind)])[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--chunks", type=int, default=CHUNKS)
    ap.add_argument("--before", type=Path, help="another checkout, set up (make setup): its gpipe runs each "
                    "schedule too, interleaved, for a table before and after in one run")
    ap.add_argument("--only", default="", help="a comma-separated list of schedules (gpipe's names): those alone, "
                    "ours and the peer's, with one process")
    a = ap.parse_args()
    m = a.chunks
    bubbles: dict[str, list[float]] = {}
    costed: dict[str, list[float]] = {}

    def ours(schedule: str, checkout: Path | None = None) -> Callable[[Path], float]:
        who = f"before {schedule}" if checkout is not None else f"gpipe {schedule}"

        def run(tmp: Path) -> float:
            steps = gpipe_steps(schedule, a.steps, tmp, chunks=m, checkout=checkout)
            bubbles.setdefault(who, []).append(statistics.median(float(x["bubble_fraction"]) for x in steps))
            costed.setdefault(who, []).append(costed_bubble(schedule, steps, m))
            return statistics.median(float(x["step_time_s"]) for x in steps)
        return run

    contenders: dict[str, Callable[[Path], float]] = {
        "one process": lambda tmp: run_single(a.steps, m),
        "gpipe gpipe": ours("gpipe"),
        "gpipe 1f1b": ours("1f1b"),
        "gpipe zb-h1": ours("zb-h1"),
        "gpipe interleaved-1f1b": ours("interleaved-1f1b"),
        "gpipe zbv": ours("zbv"),
        "gpipe v-half": ours("v-half"),
        "gpipe v-min": ours("v-min"),
        "gpipe dualpipev": ours("dualpipev"),
        "torch.pipelining ScheduleGPipe": lambda tmp: run_pipelining("gpipe", a.steps, m),
        "torch.pipelining Schedule1F1B": lambda tmp: run_pipelining("1f1b", a.steps, m),
        "torch.pipelining ScheduleInterleaved1F1B": lambda tmp: run_pipelining("interleaved-1f1b", a.steps, m),
        "torch.pipelining ScheduleInterleavedZeroBubble": lambda tmp: run_pipelining("interleaved-zb", a.steps, m),
        "torch.pipelining ScheduleZBVZeroBubble": lambda tmp: run_pipelining("zbv", a.steps, m),
        "torch.pipelining ScheduleDualPipeV": lambda tmp: run_pipelining("dualpipev", a.steps, m),
    }
    if a.before is not None:  # each of ours, then its before
        paired: dict[str, Callable[[Path], float]] = {}
        for name, fn in contenders.items():
            paired[name] = fn
            if name.startswith("gpipe "):
                paired[f"before {name[6:]}"] = ours(name[6:], a.before)
        contenders = paired
    if a.only:
        keep = {PEER_NAMES[x] for x in a.only.split(",") if x in PEER_NAMES} | {f"{who} {x}" for x in a.only.split(",")
                                                              for who in ("gpipe", "before")}
        contenders = {k: v for k, v in contenders.items() if k == "one process" or k in keep}
    times: dict[str, list[float]] = {k: [] for k in contenders}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for name, fn in contenders.items():
                times[name].append(fn(Path(d)))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()),
                  file=sys.stderr, flush=True)
    ideal = STAGES * m / (m + STAGES - 1)
    base = statistics.median(times["one process"])
    print(f"\n{STAGES} stages, {m} micro-batches, batch {BATCH}, {DEPTH} x Linear({WIDTH})+ReLU; "
          f"ideal speed-up {ideal:.3f}; median of {a.rounds} rounds")
    print(f"{'contender':46} {'step ms':>8} {'speed-up':>9} {'of ideal':>9} {'bubble':>7} {'costed':>7} "
          f"{'at cost':>8}")
    at_cost: dict[str, float] = {}  # the step with the run's own action costs and nothing else idle
    for name, ts in times.items():
        t = statistics.median(ts)
        bubble = ""
        if name in bubbles:
            b, c = statistics.median(bubbles[name]), statistics.median(costed[name])
            at_cost[name] = t * (1 - b) / (1 - c)
            bubble = f"{b:7.3f} {c:7.3f} {at_cost[name] * 1e3:8.1f}"
        print(f"{name:46} {t * 1e3:8.1f} {base / t:9.3f} {base / t / ideal:9.3f} {bubble}")
    for name in [k for k in times if k.startswith("before ")]:
        after = f"gpipe {name[7:]}"
        print(f"{after}: before / after {statistics.median(times[name]) / statistics.median(times[after]):.3f}x")
        peer = PEER_NAMES[name[7:]]
        if peer in times:
            print(f"  before: {name} / {peer}: {statistics.median(times[peer]) / statistics.median(times[name]):.3f}x")
    best = {who: min((statistics.median(ts), name) for name, ts in times.items() if name.startswith(who))
            for who in ("gpipe", "torch.pipelining")}
    print(f"fastest: {best['gpipe'][1]} / {best['torch.pipelining'][1]}: "
          f"{best['torch.pipelining'][0] / best['gpipe'][0]:.3f}x (target 1.05x)")
    if at_cost:
        floor = min((t, name) for name, t in at_cost.items() if name.startswith("gpipe "))
        print(f"gpipe's fastest at cost (its schedule's bubble at the run's own action costs, no other idle): "
              f"{floor[1]} {floor[0] * 1e3:.1f} ms, {best['torch.pipelining'][0] / floor[0]:.3f}x the peer's fastest")
    for ours_, peer in PEER_NAMES.items():  # the peer's same schedule (target 0.97x)
        if f"gpipe {ours_}" in times and peer in times:
            print(f"gpipe {ours_} / {peer}: "
                  f"{statistics.median(times[peer]) / statistics.median(times[f'gpipe {ours_}']):.3f}x")
    for name in ("gpipe zb-h1", "gpipe zbv", "gpipe interleaved-1f1b"):
        if name in bubbles and "gpipe 1f1b" in bubbles:
            ratio = statistics.median(bubbles[name]) / statistics.median(bubbles["gpipe 1f1b"])
            at = statistics.median(costed[name]) / statistics.median(costed["gpipe 1f1b"])
            print(f"bubble, {name.removeprefix('gpipe ')} / 1f1b: measured {ratio:.3f}, at the measured costs {at:.3f}")


if __name__ == "__main__":
    main()
