"""`gpipe-coordinator plan` against the machine: its pick and others run, predicted beside measured.

    python bench/plan.py            # 3 models, 4 configurations each, 3 rounds: 7-8 min here (more under load)
    python bench/plan.py --models mlp --rounds 1 --steps 6 --others 2

Per model (an MLP of uneven layer widths, whose factory is below; examples/charlm.yaml; a small GPT-2 from a
config, examples/gpt2.yaml, captured and cut at its blocks) it runs `plan --workers 2 --memory-gib <budget>
--json --top 1000` and takes its pick and --others more of the configurations that fit: the fastest with
another stages x replicas, the fastest with other activation checkpointing, then the fastest of each schedule
not yet taken. Each runs through `gpipe-coordinator run` with the job file `plan --write` would write
(gpipe.coordinator.plan.search.written) for --steps steps; its step time is the median of `step_time_s` after the first
2 steps, its peak the largest `peak_memory_bytes` of any worker and step. Beside them, the time a worker spends in
its actions a step (`busy_s`, the workers' mean) against the plan's (its step time less its bubble): whether the
actions themselves took longer than their measured costs, or the time between them; and "at cost", the step the
simulator gives at the run's own action times with nothing between them (no transfer, per-action overhead,
all-reduce or optimizer step): predicted -> at cost is the costs' error, at cost -> measured what the run adds.

The machine is noisy (absolute times drift twofold between runs, and other work shares its 2 cores), so each
round plans every model again (the per-layer costs measured anew) and runs every configuration once,
interleaved; the figures are medians over rounds, of predictions and of measurements alike. The pick is the
first round's.

Targets (the issue "`gpipe-coordinator plan`"): the pick within 10% of the fastest configuration measured;
predicted step times within 25% of measured and peaks within 20%; no pick's measured peak over the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
KEY = ("stages", "replicas", "schedule", "virtual_stages", "chunks", "activation_checkpoint", "shard")
STEP_TARGET, PEAK_TARGET, PICK_TARGET = 0.25, 0.20, 0.10
WARMUP = 2  # steps left out of the step time


def uneven_mlp(in_features: int = 1024, widths: tuple[int, ...] = (4096, 1024, 3072, 512, 2048, 1024)) -> nn.Module:
    """An MLP whose layers differ fourfold and more in cost: Linear(in, w0)+ReLU, ..., the last Linear alone."""
    layers: list[nn.Module] = []
    d = in_features
    for i, w in enumerate(widths):
        last = i == len(widths) - 1
        layers.append(nn.Linear(d, w) if last else nn.Sequential(nn.Linear(d, w), nn.ReLU()))
        d = w
    return nn.Sequential(*layers)


def example(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())
    for key in ("checkpoint_every", "max_restarts"):
        spec.pop(key, None)
    return spec


def mlp() -> dict[str, Any]:
    return {"name": "mlp", "seed": 0, "stages": 2,
            "model": {"factory": "bench.plan:uneven_mlp", "args": {"in_features": 1024}},
            "data": {"factory": "random_regression", "args": {"n": 512, "in_features": 1024, "out_features": 1024},
                     "batch_size": 128},
            "loss": "mse", "optimizer": {"name": "adamw", "lr": 1e-4}, "steps": 8}


# Each model's job and its budget (GiB a worker): the MLP's leaves out its replicas (each holds the whole model
# and its AdamW state) and its 2 virtual stages a worker; charlm's its replicas, the unconstrained pick; GPT-2's
# leaves out none.
MODELS: dict[str, tuple[Any, float]] = {
    "mlp": (mlp, 0.65),
    "charlm": (lambda: example("charlm"), 0.42),
    "gpt2": (lambda: example("gpt2"), 1.0),
}


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples")]))


def key(c: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(c[k] for k in KEY)


def describe(c: dict[str, Any]) -> str:
    v = f" x{c['virtual_stages']}" if c["virtual_stages"] > 1 else ""
    return (f"{c['stages']}x{c['replicas']} {c['schedule']}{v} {c['chunks']}ch ckpt {c['activation_checkpoint']}"
            f"{' shard' if c['shard'] else ''} {c['balance']}")


def plan(job: Path, workers: int, budget: float) -> list[dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "plan", str(job), "--workers", str(workers),
                        "--memory-gib", str(budget), "--json", "--top", "1000"], env=env(), capture_output=True,
                       text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"plan {job.name}: {r.stderr.strip().splitlines()[-1:]}")
    out: list[dict[str, Any]] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def choose(fits: list[dict[str, Any]], others: int) -> list[dict[str, Any]]:
    """The pick, then the fastest of another stages x replicas, of other checkpointing, of each other schedule,
    then the next fastest: 1 + `others` in all (fewer where fewer fit)."""
    pick = fits[0]
    chosen = [pick]

    def add(want: Any) -> bool:
        for c in fits:
            if len(chosen) <= others and want(c) and all(key(c) != key(x) for x in chosen):
                chosen.append(c)
                return True
        return False

    add(lambda c: (c["stages"], c["replicas"]) != (pick["stages"], pick["replicas"]))
    add(lambda c: c["activation_checkpoint"] != pick["activation_checkpoint"])
    while add(lambda c: c["schedule"] not in {x["schedule"] for x in chosen}):
        pass
    while add(lambda c: True):
        pass
    return chosen


def run(job_text: str, c: dict[str, Any], name: str, steps: int, tmp: Path) -> dict[str, float]:
    """The configuration `c` of the job run for `steps` steps: its step time (median), peak (the largest) and each
worker's time in actions a step (the workers' mean; median)."""
    from gpipe.coordinator.plan.search import Config, written

    config = Config(c["stages"], c["replicas"], c["schedule"], c["virtual_stages"], c["chunks"],
                    c["activation_checkpoint"], c["shard"], tuple(c["balance"]))
    job = tmp / f"{name}.yaml"
    job.write_text(written(job_text, str(job), config))
    r = subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "run", str(job), "--state-dir", str(tmp),
                        "--no-progress", "--oversubscribe", "--name", name, "--set", f"steps={steps}",
                        "--set", "log_every=1"], env=env(), capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"{name}: {r.stderr.strip().splitlines()[-1:]}")
    metrics = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    subprocess.run(["rm", "-rf", str(tmp / name)], check=True)
    kept = metrics[WARMUP:] or metrics
    step = statistics.median(float(m["step_time_s"]) for m in kept)
    busy = statistics.median(worker_busy(m) for m in kept)
    peak = max(s["peak_memory_bytes"] for m in metrics for s in m["stages"])
    return {"step_s": step, "peak": float(peak), "busy_s": busy, "at_cost_s": at_cost(c, kept, job.read_text())}


def worker_busy(m: dict[str, Any]) -> float:
    """A step's seconds in actions, the workers' mean (a worker's model chunks summed)."""
    by_rank: dict[int, float] = {}
    for s in m["stages"]:
        by_rank[s["rank"]] = by_rank.get(s["rank"], 0.0) + float(s["busy_s"])
    return statistics.mean(by_rank.values())


def at_cost(c: dict[str, Any], steps: list[dict[str, Any]], job_text: str) -> float:
    """The step the simulator gives with the run's own action times (each model chunk's, kind's and
    micro-batch's median over the steps and replicas: gpipe.schedule.steady, steps in a row) and nothing
    between them: no transfer, per-action overhead, all-reduce or optimizer step; the workers that end a step
    waiting for one another as the plan has them (clipping: every worker)."""
    from gpipe import schedule
    from gpipe.coordinator.attempt.metrics import step_waits
    from gpipe.coordinator.spec.job import parse_spec
    from gpipe.topology import model_chunk

    took: dict[tuple[int, str, int], list[float]] = {}
    for m in steps:
        for s in m["stages"]:
            for kind, mb, t0, t1 in s["timeline"]:
                took.setdefault((s["stage"], kind, mb), []).append(t1 - t0)
    median = {k: statistics.median(v) for k, v in took.items()}
    n, name, v = c["stages"], c["schedule"], c["virtual_stages"]

    def length(k: int, a: Any) -> float:
        return median.get((model_chunk(name, k, a.worker_chunk, n), a.kind, a.micro_batch), 0.0)

    waits = step_waits(parse_spec(job_text), ())
    return float(schedule.steady(name, n, c["chunks"], v, length, waits=waits)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps a run (the first 2 left out of its step time)")
    ap.add_argument("--others", type=int, default=3, help="configurations run beside the pick")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--memory-gib", type=float, help="one budget for every model (default: each model's own)")
    a = ap.parse_args()
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    budgets = {m: a.memory_gib or MODELS[m][1] for m in a.models}
    chosen: dict[str, list[dict[str, Any]]] = {}
    fit_count: dict[str, int] = {}
    predicted: dict[tuple[str, tuple[Any, ...]], list[dict[str, Any]]] = {}
    measured: dict[tuple[str, tuple[Any, ...]], list[dict[str, float]]] = {}
    picks: dict[str, list[tuple[Any, ...]]] = {m: [] for m in a.models}
    texts: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for model in a.models:
            spec = MODELS[model][0]()
            spec["name"] = model
            texts[model] = yaml.safe_dump(spec, sort_keys=False)
            (tmp / f"{model}-base.yaml").write_text(texts[model])
        for r in range(a.rounds):
            for model in a.models:
                fits = plan(tmp / f"{model}-base.yaml", a.workers, budgets[model])
                if model not in chosen:
                    chosen[model], fit_count[model] = choose(fits, a.others), len(fits)
                    print(f"{model}: {len(fits)} configuration(s) fit {budgets[model]} GiB; running: "
                          + "; ".join(describe(c) for c in chosen[model]), file=sys.stderr, flush=True)
                picks[model].append(key(fits[0]))
                by_key = {key(c): c for c in fits}
                order = chosen[model][r % len(chosen[model]):] + chosen[model][:r % len(chosen[model])]
                for c in order:
                    k = (model, key(c))
                    if key(c) in by_key:  # the costs measured anew may leave it out of the budget or the top
                        predicted.setdefault(k, []).append(by_key[key(c)])
                    name = f"{model}-{chosen[model].index(c)}"
                    try:
                        measured.setdefault(k, []).append(run(texts[model], c, name, a.steps, tmp))
                    except RuntimeError as e:
                        print(f"round {r + 1}: {describe(c)} failed: {e}", file=sys.stderr, flush=True)
                        continue
                    got = measured[k][-1]
                    print(f"round {r + 1}: {model} {describe(c)}: predicted {by_key.get(key(c), c)['predicted_step_s'] * 1e3:.0f} "
                          f"ms, measured {got['step_s'] * 1e3:.0f} ms, peak {got['peak'] / 2**20:.0f} MiB",
                          file=sys.stderr, flush=True)
    mib = 2**20
    pick_ok, step_ok, peak_ok, budget_ok = [], [], [], []
    step_total = peak_total = 0
    for model in a.models:
        budget = budgets[model] * 2**30
        same = sum(p == picks[model][0] for p in picks[model])
        print(f"\n### {model}: budget {budgets[model]} GiB a worker, {fit_count[model]} configuration(s) fit; "
              f"the pick was the same in {same} of {len(picks[model])} plan(s)\n")
        print("| configuration | predicted ms | measured ms | ratio | step within 25% | predicted peak MiB | "
              "measured peak MiB | ratio | peak within 20% | busy ms predicted / measured | at cost ms |")
        print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |")
        times: dict[tuple[Any, ...], float] = {}
        pick_peak = 0.0
        for i, c in enumerate(chosen[model]):
            k = (model, key(c))
            if not measured.get(k):
                print(f"| {describe(c)} | failed | | | | | | | | |")
                continue
            preds = predicted.get(k) or [c]
            p_step = statistics.median(x["predicted_step_s"] for x in preds)
            p_peak = statistics.median(x["predicted_peak_bytes"] for x in preds)
            m_step = statistics.median(x["step_s"] for x in measured[k])
            m_peak = max(x["peak"] for x in measured[k])
            busy = statistics.median(x["busy_s"] for x in measured[k])
            cost = statistics.median(x["at_cost_s"] for x in measured[k])
            p_busy = statistics.median(x["predicted_step_s"] * (1 - x["bubble_fraction"]) for x in preds)
            times[key(c)] = m_step
            s_ok, b_ok = abs(p_step / m_step - 1) <= STEP_TARGET, abs(p_peak / m_peak - 1) <= PEAK_TARGET
            step_ok.append(s_ok)
            peak_ok.append(b_ok)
            step_total += 1
            peak_total += 1
            label = ("**pick** " if i == 0 else "") + describe(c)
            print(f"| {label} | {p_step * 1e3:.1f} | {m_step * 1e3:.1f} | {p_step / m_step:.2f} | "
                  f"{'yes' if s_ok else 'no'} | {p_peak / mib:.0f} | {m_peak / mib:.0f} | {p_peak / m_peak:.2f} | "
                  f"{'yes' if b_ok else 'no'} | {p_busy * 1e3:.0f} / {busy * 1e3:.0f} | {cost * 1e3:.0f} |")
            if i == 0:
                budget_ok.append(m_peak <= budget)
                pick_peak = m_peak
        first = key(chosen[model][0])
        if first in times:
            fastest = min(times.values())
            ok = times[first] <= fastest * (1 + PICK_TARGET)
            pick_ok.append(ok)
            best = next(describe(c) for c in chosen[model] if times.get(key(c)) == fastest)
            print(f"\n{model}: the pick measured {times[first] / fastest:.2f}x the fastest measured ({best}): "
                  f"{'within' if ok else 'outside'} 10%; its peak, {pick_peak / mib:.0f} MiB, "
                  f"{'within' if budget_ok[-1] else 'OVER'} the budget ({budget / mib:.0f} MiB)")
    print("\nsummary (medians over rounds):")
    print(f"- pick within 10% of the fastest measured: {sum(pick_ok)} of {len(pick_ok)} model(s)")
    print(f"- predicted step time within 25% of measured: {sum(step_ok)} of {step_total} configuration(s)")
    print(f"- predicted peak within 20% of measured: {sum(peak_ok)} of {peak_total} configuration(s)")
    print(f"- no pick over the budget: {sum(budget_ok)} of {len(budget_ok)} pick(s) within it")
    print(f"{a.rounds} round(s) of {a.steps} steps; {time.monotonic() - t0:.0f} s; load average (1 min) "
          f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (others' work shares these cores)")


if __name__ == "__main__":
    main()
