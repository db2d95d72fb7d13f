"""What a pipelined action costs beyond its compute: the service's F and B against the same blocks alone.

    python bench/action_cost.py [--rounds 3] [--steps 30]

The model and micro-batches are bench/step_time.py's: 8 x (Linear(1024)+ReLU),
batch 256 in 8 micro-batches of 32, one thread per process. Interleaved round
by round, medians over rounds:

- alone: one micro-batch's forward and backward through 4 blocks in a plain
  loop, in a process pinned to one core, once with the input wanting a
  gradient (as stage 1's) and once without (as stage 0's); with torch's own
  Linear layers, and fused as a worker's stage runs them
  (gpipe.grad_in_place.fuse: the weight gradient added into .grad), the
  "same blocks" an action is held against; and again beside the same loop
  on the other core, as a 2-stage pipeline's stages compute side by side
  (they share the last-level cache and the memory bandwidth: the 2-stage
  service's actions are held against this one);
- 1 stage: `gpipe-coordinator run` of those 4 blocks on one stage, so no data
  plane: F and B from metrics.jsonl's timeline;
- 2 stages: the 8 blocks on 2 stages, 1f1b: each stage's F and B.

The 2-stage run also gives each process's CPU per step, read from
/proc/PID/stat over the run's middle: the two workers, the coordinator's
attempt, and `run` itself. On this machine's 2 cores, the attempt shares a core
with a worker.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import BATCH, CHUNKS, WIDTH, cores, env  # noqa: E402

BLOCKS = 4  # per stage

ALONE = f"""
import statistics, sys, time, torch
from gpipe import grad_in_place
torch.set_num_threads(1)
for fused in (False, True):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear({WIDTH}, {WIDTH}), torch.nn.ReLU())
                                   for _ in range({BLOCKS})])
    if fused:
        grad_in_place.fuse(layers)  # as a worker's stage runs them
    x = torch.randn({BATCH // CHUNKS}, {WIDTH})
    for wants in (False, True):
        f, b = [], []
        for n in range(300):
            if n % {CHUNKS} == 0:
                layers.zero_grad(set_to_none=True)  # a step's micro-batches add into one gradient
            xi = x.clone().requires_grad_(wants)
            t0 = time.perf_counter(); y = layers(xi); t1 = time.perf_counter()
            y.backward(torch.ones_like(y)); t2 = time.perf_counter()
            if n >= 50:
                f.append(t1 - t0); b.append(t2 - t1)
        print(statistics.median(f), statistics.median(b))
"""


def alone(beside: bool = False) -> dict[str, float]:
    """One micro-batch's F and B through the blocks in a plain loop: torch's own Linear layers, and the same
    fused as a worker's stage runs them (gpipe.grad_in_place.fuse), the target's "alone". `beside`: with the
    same loop running on the first core meanwhile, as a 2-stage pipeline's other worker computes beside each
    stage (the two share the last-level cache and the memory bandwidth)."""
    other = None
    if beside and len(cores()) > 1:
        loop = ALONE.replace("range(300)", "range(100000)")  # until it is ended below
        other = subprocess.Popen(["taskset", "-c", str(cores()[0]), sys.executable, "-c", loop], env=env(),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # past its imports
    try:
        out = subprocess.run(["taskset", "-c", str(cores()[-1]), sys.executable, "-c", ALONE], env=env(),
                             capture_output=True, text=True, check=True, timeout=300).stdout.split()
    finally:
        if other is not None:
            other.kill()
            other.wait()
    t = list(map(float, out))
    return {"torch F (input: no grad)": t[0], "torch B (input: no grad)": t[1], "torch F": t[2], "torch B": t[3],
            "F (input: no grad)": t[4], "B (input: no grad)": t[5], "F": t[6], "B": t[7]}


def _cpu(pid: int) -> tuple[str, float] | None:
    """(name, CPU seconds) of a process, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    return name, (int(rest[11]) + int(rest[12])) / 100  # utime + stime, in clock ticks of 1/100 s


def _tree(root: int) -> list[int]:
    """`root` and every process under it."""
    parents: dict[int, list[int]] = {}
    for p in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(p.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parents.get(pid, [])
    return out


def service(stages: int, steps: int, tmp: Path, checkout: Path | None = None) -> dict[str, Any]:
    """Median F and B per stage from a `run` of `stages` stages; with 2, also CPU per step by process. With
    `checkout`, that checkout's gpipe (set up: make setup), from its own environment."""
    name = f"cost-{stages}"
    spec = {
        "name": name, "model": {"factory": "mlp", "args": {"width": WIDTH, "depth": BLOCKS * stages, "head": False}},
        "stages": stages, "chunks": CHUNKS, "schedule": "1f1b", "balance": [BLOCKS] * stages,
        "data": {"factory": "random_regression", "args": {"n": BATCH, "in_features": WIDTH, "out_features": WIDTH},
                 "batch_size": BATCH},
        "loss": "mse", "optimizer": {"name": "sgd", "lr": 1e-3}, "steps": steps + 3,
    }
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec))
    e, cmd = env(), [sys.executable, "-m", "coordinator.cli"]
    if checkout is not None:
        e.pop("PYTHONPATH", None)  # it imports its own gpipe
        cmd = [str(checkout / ".venv/bin/gpipe-coordinator")]
    p = subprocess.Popen([*cmd, "run", str(job), "--state-dir", str(tmp), "--no-progress"], env=e,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=checkout)
    metrics = tmp / name / "metrics.jsonl"
    cpu: list[tuple[str, float]] = []  # (process name, CPU seconds per step), each process
    window = 0.0
    if stages == 2:  # sample the processes from the 4th step over half the steps
        deadline = time.monotonic() + 300
        while (not metrics.exists() or len(metrics.read_text().splitlines()) < 4) and p.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the 2-stage run made no 4 steps in 300 s")
            time.sleep(0.05)
        pids = _tree(p.pid)
        before = {pid: _cpu(pid) for pid in pids}
        t0, n0 = time.monotonic(), len(metrics.read_text().splitlines())
        while len(metrics.read_text().splitlines()) < n0 + steps // 2 and p.poll() is None:
            time.sleep(0.01)
        after = {pid: _cpu(pid) for pid in pids}
        window = time.monotonic() - t0
        done = len(metrics.read_text().splitlines()) - n0
        for pid in pids:
            a, b = before[pid], after[pid]
            if a is not None and b is not None and b[1] > a[1]:
                cpu.append((b[0], (b[1] - a[1]) / max(done, 1)))
    _, err = p.communicate(timeout=600)
    if p.returncode:
        raise RuntimeError(f"run failed: {err[-2000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()[3:]]
    shutil.rmtree(tmp / name)  # the next round's run starts afresh
    out: dict[str, Any] = {"step": statistics.median(r["step_time_s"] for r in rows), "cpu": cpu, "window": window}
    for k in range(stages):
        for kind in ("F", "B"):
            out[f"stage {k} {kind}"] = statistics.median(
                b - a for r in rows for s in r["stages"] if s["stage"] == k for act, _, a, b in s["timeline"]
                if act == kind)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--before", type=Path, help="another checkout, set up (make setup): its service runs too, "
                    "interleaved, for its rows beside ours in one run")
    a = ap.parse_args()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            got = {"alone": alone(), "beside": alone(beside=True), "1 stage": service(1, a.steps, Path(d)),
                   "2 stages": service(2, a.steps, Path(d))}
            if a.before is not None:
                got["before 1 stage"] = service(1, a.steps, Path(d), a.before)
                got["before 2 stages"] = service(2, a.steps, Path(d), a.before)
            rounds.append(got)
            print(f"round {r + 1}: 2-stage step {got['2 stages']['step'] * 1e3:.1f} ms", file=sys.stderr, flush=True)

    def med(who: str, key: str) -> float:
        return float(statistics.median(r[who][key] for r in rounds)) * 1e3

    print(f"\nF and B of one micro-batch ({BATCH // CHUNKS} x {WIDTH}) through {BLOCKS} x (Linear({WIDTH})+ReLU), "
          f"ms, median of {a.rounds} rounds")
    print(f"{'where':72} {'F':>7} {'B':>7}")
    for run, where in (("alone", "alone"), ("beside", "beside a loop on the other core")):
        for who, pre in (("torch's Linear", "torch "), ("fused, as the stage", "")):
            print(f"{f'{where} ({who}), no input gradient':72} {med(run, pre + 'F (input: no grad)'):7.2f} "
                  f"{med(run, pre + 'B (input: no grad)'):7.2f}")
            print(f"{f'{where} ({who}), input gradient':72} {med(run, pre + 'F'):7.2f} {med(run, pre + 'B'):7.2f}")
    for pre in ("", "before ") if a.before is not None else ("",):
        print(f"{f'{pre}service, 1 stage (no data plane)':72} {med(pre + '1 stage', 'stage 0 F'):7.2f} "
              f"{med(pre + '1 stage', 'stage 0 B'):7.2f}")
        for k in range(2):
            print(f"{f'{pre}service, 2 stages: stage {k}':72} {med(pre + '2 stages', f'stage {k} F'):7.2f} "
                  f"{med(pre + '2 stages', f'stage {k} B'):7.2f}")
        if pre:
            print(f"{'before: 2 stages, 1f1b: step':72} {med('before 2 stages', 'step'):7.1f}")
    step = med("2 stages", "step")
    print(f"\n2 stages, 1f1b: step {step:.1f} ms; CPU per step by process (ms; the last round, "
          f"{rounds[-1]['2 stages']['window']:.1f} s of it):")
    for name, s in sorted(rounds[-1]["2 stages"]["cpu"], key=lambda kv: -kv[1]):
        print(f"  {name:20} {s * 1e3:7.2f}")


if __name__ == "__main__":
    main()
