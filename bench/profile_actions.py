"""Where an action's time goes, part by part, in the service: a profile of each stage's F, B and W.

    python bench/profile_actions.py [--schedule 1f1b] [--steps 60] [--rounds 1] [--checkout DIR]

The job is bench/action_cost.py's (4 x (Linear(1024)+ReLU) a stage, 2 stages,
batch 256 in 8 micro-batches of 32, `gpipe-coordinator run`, one core a
worker). bench/profiling/sitecustomize.py times each action's parts on the
wall clock and on its thread's CPU clock (its docstring names them); the
same blocks alone in a plain loop (bench/action_cost.py) are the baseline.
Over the run's middle half, /proc gives each process's CPU, context switches
and minor page faults a step, and each worker's threads' CPU.
Figures are medians over the actions of every step after the third (and over
rounds), in ms.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
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
from action_cost import BLOCKS, _tree, alone  # noqa: E402
from step_time import BATCH, CHUNKS, ROOT, VIRTUAL, WIDTH, env  # noqa: E402

PARTS = ("wait", "compute", "autograd", "hooks", "send")


def _proc(pid: int) -> dict[str, Any] | None:
    """A process's name, CPU seconds, context switches and minor faults; its threads' CPU seconds by name."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        threads: dict[str, float] = {}
        switches = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            switches += sum(int(line.split()[1]) for line in (task / "status").read_text().splitlines()
                            if "ctxt_switches" in line)
            t = (task / "stat").read_text()
            name, rest = t[t.index("(") + 1:t.rindex(")")], t[t.rindex(")") + 2:].split()
            threads[name] = threads.get(name, 0.0) + (int(rest[11]) + int(rest[12])) / 100
    except OSError:
        return None
    name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    return {"name": name, "cpu": (int(rest[11]) + int(rest[12])) / 100, "switches": switches,
            "faults": int(rest[7]), "threads": threads}


def profile(schedule: str, steps: int, tmp: Path, checkout: Path = ROOT) -> dict[str, Any]:
    name = f"profile-{schedule}"
    virtual = 2 if schedule in VIRTUAL else 1  # model chunks per worker, as bench/step_time.py
    spec = {
        "name": name, "model": {"factory": "mlp", "args": {"width": WIDTH, "depth": BLOCKS * 2, "head": False}},
        "stages": 2, "chunks": CHUNKS, "schedule": schedule, "virtual_stages": virtual,
        "balance": [BLOCKS // virtual] * (2 * virtual),
        "data": {"factory": "random_regression", "args": {"n": BATCH, "in_features": WIDTH, "out_features": WIDTH},
                 "batch_size": BATCH},
        "loss": "mse", "optimizer": {"name": "sgd", "lr": 1e-3}, "steps": steps + 3,
    }
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec))
    prefix = tmp / "timed"
    e = env()
    e["PYTHONPATH"] = f"{Path(__file__).resolve().parent / 'profiling'}{os.pathsep}{checkout}"
    e["GPIPE_BENCH_PROFILE"] = str(prefix)
    python = sys.executable if checkout == ROOT else str(checkout / ".venv/bin/python")
    p = subprocess.Popen([python, "-m", "gpipe.coordinator.cli.main", "run", str(job), "--state-dir", str(tmp),
                          "--no-progress"], env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp / name / "metrics.jsonl"

    def done() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    deadline = time.monotonic() + 300
    while done() < 3 + steps // 4 and p.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run made no {3 + steps // 4} steps in 300 s")
        time.sleep(0.05)
    pids = _tree(p.pid)
    before, n0 = {pid: _proc(pid) for pid in pids}, done()
    while done() < n0 + steps // 2 and p.poll() is None:
        time.sleep(0.01)
    after, n = {pid: _proc(pid) for pid in pids}, done() - n0
    per_step: list[dict[str, Any]] = []
    for pid in pids:
        a, b = before[pid], after[pid]
        if a is None or b is None:
            continue
        row = {k: (b[k] - a[k]) / max(n, 1) for k in ("cpu", "switches", "faults")}
        row["name"] = b["name"]
        row["threads"] = {t: (c - a["threads"].get(t, 0.0)) / max(n, 1) for t, c in b["threads"].items()
                          if c > a["threads"].get(t, 0.0)}
        per_step.append(row)
    _, err = p.communicate(timeout=600)
    if p.returncode:
        raise RuntimeError(f"run failed: {err[-2000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()[3:]]
    timed = [json.loads(Path(f).read_text()) for f in glob.glob(f"{prefix}.*")]
    for f in glob.glob(f"{prefix}.*"):
        os.unlink(f)
    shutil.rmtree(tmp / name)
    actions: dict[tuple[int, str], list[list[Any]]] = {}
    step_over: dict[int, list[float]] = {}
    for t in timed:
        acts = t["actions"]
        for chunk in {a[0] for a in acts}:
            mine = [a for a in acts if a[0] == chunk]
            steps_of = [s for s in t["steps"] if s[0] == chunk]
            for a in mine[3 * len(mine) // max(len(steps_of), 1):]:  # after the first 3 steps
                actions.setdefault((a[0], a[1]), []).append(a)
            # Its thread's CPU outside its actions (with model chunks taking turns on one thread, the others' too).
            step_over[chunk] = [s[2] - s[4] for s in steps_of[3:]]
    out: dict[str, Any] = {"step": statistics.median(r["step_time_s"] for r in rows), "procs": per_step}
    for (chunk, kind), acts in actions.items():
        key = f"stage {chunk} {kind}"
        out[key] = {"n": len(acts), "wall": statistics.median(a[2] for a in acts),
                    "cpu": statistics.median(a[3] for a in acts)}
        for part in PARTS:
            out[key][part] = statistics.median(a[4].get(part, [0.0, 0.0])[1] for a in acts)  # CPU
            out[key][part + " wall"] = statistics.median(a[4].get(part, [0.0, 0.0])[0] for a in acts)
    for chunk, over in step_over.items():
        out[f"stage {chunk} step"] = statistics.median(over) if over else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--checkout", type=Path, default=ROOT, help="profile another checkout's gpipe (set up: make setup)")
    a = ap.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            rounds.append({"alone": alone(), "run": profile(a.schedule, a.steps, Path(d), a.checkout.resolve())})
            print(f"round {r + 1}: step {rounds[-1]['run']['step'] * 1e3:.1f} ms", file=sys.stderr, flush=True)

    def med(key: str, field: str) -> float:
        return statistics.median(r["run"][key][field] for r in rounds if key in r["run"]) * 1e3

    base = {k: statistics.median(r["alone"][k] for r in rounds) * 1e3 for k in rounds[0]["alone"]}
    print(f"\n{a.schedule}, 2 stages, step {statistics.median(r['run']['step'] for r in rounds) * 1e3:.1f} ms; "
          f"one action's parts, ms (CPU of the stage's thread; wall where marked), median of {a.rounds} round(s)")
    head = f"{'action':12} {'alone':>6} {'wall':>6} {'CPU':>6} {'+CPU':>6} " + \
        " ".join(f"{p:>8}" for p in ("compute", "autograd", "hooks", "send", "rest")) + f" {'wait wall':>9}"
    print(head)
    chunks = sorted({int(k.split()[1]) for r in rounds for k in r["run"] if k.startswith("stage ")})
    for chunk in chunks:
        for kind in ("F", "B", "W"):
            key = f"stage {chunk} {kind}"
            if not any(key in r["run"] for r in rounds):
                continue
            # Alone is 4 blocks: a model chunk of fewer is compared with its share.
            share = 1 / (len(chunks) // 2)
            split = any(f"stage {chunk} W" in r["run"] for r in rounds)  # B is then the inputs' gradients alone
            ref = share * {"F": base["F (input: no grad)"] if chunk == 0 else base["F"],
                           "B": base["B (input: no grad)"] if chunk == 0 else base["B"], "W": 0.0}[kind]
            if split and kind != "F":
                ref = 0.0  # alone has no split backward: compare B + W (the next line) with its B
            cpu = med(key, "cpu")
            parts = {p: med(key, p) for p in PARTS}
            rest = cpu - parts["wait"] - parts["compute"] - parts["autograd"] - parts["send"]
            print(f"{key:12} {ref:6.2f} {med(key, 'wall') - med(key, 'wait wall'):6.2f} "
                  f"{cpu - parts['wait']:6.2f} {cpu - parts['wait'] - ref if ref else 0.0:6.2f} "
                  f"{parts['compute']:8.2f} {parts['autograd']:8.2f} {parts['hooks']:8.2f} {parts['send']:8.2f} "
                  f"{rest:8.2f} {med(key, 'wait wall'):9.2f}")
            if kind == "W":
                both = med(f"stage {chunk} B", "cpu") - med(f"stage {chunk} B", "wait") + med(key, "cpu")
                alone_b = share * (base["B (input: no grad)"] if chunk == 0 else base["B"])
                print(f"{f'stage {chunk} B+W':12} {alone_b:6.2f} {'':6} {both:6.2f} {both - alone_b:6.2f}")
        if len(chunks) == 2:  # (model chunks taking turns on one thread share its CPU clock: not told apart)
            key = f"stage {chunk} step"
            print(f"stage {chunk}: CPU a step outside its actions "
                  f"{statistics.median(r['run'][key] for r in rounds) * 1e3:.2f} ms")
    print("\nper step, the last round's middle half: process, CPU ms, context switches, minor faults; busiest threads")
    for row in sorted(rounds[-1]["run"]["procs"], key=lambda r: -r["cpu"]):
        threads = ", ".join(f"{t} {c * 1e3:.1f}" for t, c in sorted(row["threads"].items(), key=lambda kv: -kv[1])[:4])
        print(f"  {row['name']:16} {row['cpu'] * 1e3:7.1f} {row['switches']:7.1f} {row['faults']:7.1f}   {threads}")


if __name__ == "__main__":
    main()
