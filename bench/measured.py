"""`schedule: measured` against the fixed schedules: simulated from this host's measured costs, and (--run) in real runs.

    python bench/measured.py [--chunks 8] [--shapes bench unequal] [--run --rounds 3 --steps 15]

Two shapes on 2 workers, one thread each: the bench shape (bench/step_time.py's: 8 x Linear(1024)+ReLU, batch 256,
mse) and an unequal one, the same blocks between an Embedding(8192, 1024) and a Linear(1024, 8192) vocabulary
head (cross-entropy over token ids, batch 256): the first worker's W (the embedding's whole gradient) and the
last one's F, B and W (the head: 8 blocks' work) far from a block's. Each on one model chunk a worker (gpipe,
1f1b, zb-h1) and on zbv's V (zbv, v-half, v-min, dualpipev; interleaved-1f1b, another placement, beside them).

Simulated: the layers' costs measured as a measured job measures them at its start
(gpipe.coordinator.plan.search.measure: F, B, W and the optimizer's step of each layer on this host, the 2
workers' processes at once), the balance by measured time (a split backward's, zb-h1's or zbv's) the same for
every schedule of a placement and measured (interleaved-1f1b at its own), each schedule's step as `plan`
predicts it (steps in a row, transfers, the engine's per-action time,
the optimizer's step); measured's order built by search.build_measured within the memory a worker's share of
this host leaves. "x measured": the schedule's step over measured's (above 1: measured is faster).

--run: each shape's best fixed schedule of the simulation and measured on its best placement there (a measured
job measures and builds its order at its start, as any does), each at its simulated balance, run for real with
bench/step_time.py's method: rounds interleaved, each run's median step after 3 warm-up steps, the median over
rounds; the ratio best fixed / measured. Run it nice'd.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WIDTH, DEPTH, BATCH, VOCAB, WORKERS = 1024, 8, 256, 8192, 2

UNEQUAL = textwrap.dedent('''\
    """The unequal shape: an embedding and a vocabulary head around bench/step_time.py's blocks."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset


    def model(width: int, depth: int, vocab: int) -> nn.Sequential:
        blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
        return nn.Sequential(nn.Embedding(vocab, width), *blocks, nn.Linear(width, vocab))


    def tokens(n: int, vocab: int, seed: int = 0) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        return TensorDataset(torch.randint(0, vocab, (n,), generator=g), torch.randint(0, vocab, (n,), generator=g))
''')


def spec(shape: str, schedule: str, virtual: int, chunks: int, steps: int, balance: list[int] | None = None,
         ) -> dict[str, Any]:
    if shape == "bench":
        model = {"factory": "mlp", "args": {"width": WIDTH, "depth": DEPTH, "head": False}}
        data = {"factory": "random_regression", "args": {"n": BATCH, "in_features": WIDTH, "out_features": WIDTH},
                "batch_size": BATCH}
        loss = "mse"
    else:
        model = {"factory": "unequal:model", "args": {"width": WIDTH, "depth": DEPTH, "vocab": VOCAB}}
        data = {"factory": "unequal:tokens", "args": {"n": BATCH, "vocab": VOCAB}, "batch_size": BATCH}
        loss = "cross_entropy"
    out = {"name": f"measured-{shape}-{schedule}-{virtual}", "model": model, "data": data, "loss": loss,
           "stages": WORKERS, "virtual_stages": virtual, "chunks": chunks, "schedule": schedule,
           "optimizer": {"name": "sgd", "lr": 1e-3}, "steps": steps}
    if balance is not None:
        out["balance"] = balance
    return out


def share() -> int:
    """A worker's memory as a job on this host plans for it: the host's available memory split among the workers."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 // WORKERS
    return 1 << 40


Row = tuple[int, str, float, float, str, list[int]]  # (model chunks a worker, schedule, step s, bubble, note, balance)


def simulated(shape: str, chunks: int, folder: Path) -> list[Row]:
    """Each schedule's predicted step: the V's and one model chunk a worker's each at their split backward's
    balance by measured time (zbv's, zb-h1's), measured beside them at the same; interleaved-1f1b (its own
    placement) at its own."""
    from gpipe.coordinator.plan import search as planner
    from gpipe.coordinator.spec.job import JobSpec
    from gpipe.factory import enter_job_folder

    enter_job_folder(folder)
    base = JobSpec.model_validate(spec(shape, "gpipe", 1, chunks, 1))
    m = planner.measure(base, folder, WORKERS, 1)
    budget = share()
    n = BATCH // chunks
    out: list[Row] = []
    for v, names, by in ((1, ("gpipe", "1f1b", "zb-h1", "measured"), "zb-h1"),
                         (2, ("zbv", "v-half", "v-min", "dualpipev", "measured"), "zbv"),
                         (2, ("interleaved-1f1b",), "interleaved-1f1b")):
        balance = planner.balance_for(m, planner.Config(WORKERS, 1, by, v, chunks, "never", False), n)
        configs = [planner.Config(WORKERS, 1, name, v, chunks, "never", False) for name in names]
        fits, over = planner.evaluate(m, configs, budget, balance)
        for x in fits + over:
            note = "" if x in fits else "over the memory"
            if x.built is not None:
                note = "its own order" if x.built.source == "measured" else f"{x.built.source}'s order"
            out.append((v, planner.shown(x.config.schedule), x.step_s, x.bubble, note, balance))
    return out


def run_steps(shape: str, schedule: str, virtual: int, chunks: int, steps: int, balance: list[int],
              tmp: Path) -> float:
    """A real run's median step time (after 3 warm-up steps), at `balance` (measured keeps a balance given)."""
    from bench.step_time import env

    s = spec(shape, schedule, virtual, chunks, steps + 3, balance)
    job = tmp / f"{s['name']}.yaml"
    job.write_text(yaml.safe_dump(s))
    r = subprocess.run(["nice", sys.executable, "-m", "gpipe.coordinator.cli.main", "run", str(job), "--state-dir",
                        str(tmp / "state"), "--no-progress"], env=env(), capture_output=True, text=True,
                       timeout=1200, cwd=tmp)
    if r.returncode:
        raise RuntimeError(f"{s['name']} failed: {r.stderr[-2000:]}")
    out = tmp / "state" / s["name"]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    shutil.rmtree(out)
    return statistics.median(float(json.loads(x)["step_time_s"]) for x in lines[3:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--shapes", nargs="+", default=["bench", "unequal"], choices=["bench", "unequal"])
    ap.add_argument("--run", action="store_true", help="also run measured and the best fixed schedule for real")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "unequal.py").write_text(UNEQUAL)
        pairs: dict[str, tuple[Row, Row]] = {}  # per shape: the best fixed schedule's row and measured's best
        for shape in a.shapes:
            rows = simulated(shape, a.chunks, tmp)
            print(f"\n{shape}: {WORKERS} workers, {a.chunks} micro-batches; simulated from this host's measured "
                  "costs, balance by measured time (a split backward's: zb-h1's, zbv's; interleaved-1f1b its own)")
            print("| model chunks a worker | schedule | balance | step ms | bubble | x measured | |")
            print("| ---: | --- | --- | ---: | ---: | ---: | --- |")
            mine = {v: row for row in rows if row[1] == "measured" for v in (row[0],)}
            for row in rows:
                v, name, step, bubble, note, balance = row
                print(f"| {v} | {name} | {balance} | {step * 1e3:.1f} | {bubble:.3f} | {step / mine[v][2]:.3f} | "
                      f"{note} |")
            fixed = min((r for r in rows if r[1] != "measured" and r[4] != "over the memory"), key=lambda r: r[2])
            best = min(mine.values(), key=lambda r: r[2])
            print(f"best fixed: {fixed[1]} ({fixed[0]} a worker) {fixed[2] * 1e3:.1f} ms; measured's best "
                  f"({best[0]} a worker) {best[2] * 1e3:.1f} ms: {fixed[2] / best[2]:.3f}x")
            pairs[shape] = (fixed, best)
        if not a.run:
            return
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(a.rounds):
            for shape in a.shapes:
                for who, row in zip(("fixed", "measured"), pairs[shape], strict=True):
                    times.setdefault((shape, who), []).append(run_steps(shape, row[1], row[0], a.chunks, a.steps,
                                                                        row[5], tmp))
            print(f"round {r + 1}: " + ", ".join(f"{s} {w} {t[-1] * 1e3:.0f} ms" for (s, w), t in times.items()),
                  file=sys.stderr, flush=True)
        print(f"\nreal runs, median of {a.rounds} rounds (each run's median of {a.steps} steps)")
        for shape in a.shapes:
            fixed, best = pairs[shape]
            f, mm = statistics.median(times[(shape, "fixed")]), statistics.median(times[(shape, "measured")])
            each = ", ".join(f"{x / y:.3f}" for x, y in zip(times[(shape, "fixed")], times[(shape, "measured")],
                                                            strict=True))
            print(f"{shape}: {fixed[1]} x{fixed[0]} {fixed[5]} {f * 1e3:.1f} ms, measured x{best[0]} {best[5]} "
                  f"{mm * 1e3:.1f} ms: {f / mm:.3f}x (by round: {each})")


if __name__ == "__main__":
    main()
