"""Each worker's memory by phase of a step: what forward, backward, reduce, update, gather and checkpoint add.

    python bench/memory_phases.py                        # a GPT-2 token job, 2 replicas x 2 stages, sharded and not
    python bench/memory_phases.py --step 4 --steps 6 --width 1024 --mlp

Runs a job through `run` twice, unsharded then with `optimizer.shard`, with its worker processes instrumented (a
sitecustomize on PYTHONPATH patches gpipe.worker.stage_server, gpipe.stage and gpipe.memory.zero as they are
imported: the numbers come from inside each worker). A step's phases, on the thread that runs them:

    forward     every F action (gpipe.stage.Stage._forward), and the last stage's loss
    backward    every B and W action
    reduce      the replicas' gradient sum, a tied weight's sum, clipping (Stage._reduce_replicas, _sum_tied,
                _finish_gradients)
    update      the optimizer step, but for the sharded optimizer's weight gather
    gather      the sharded optimizer's weight gather (gpipe.memory.zero.ShardedOptimizer._gather_weights)
    checkpoint  the copy of the stage's state a checkpoint takes after the step (StageServer._snapshot); on the
                step `--step` only if it checkpoints then (checkpoint_every divides it)
    other       the rest of the step (its start: zero_grad; its end)

and an evaluation batch (eval, its forwards), when the job evaluates after the step. Per phase: torch's own
tensors (gpipe.memory.meter.Made, per call of the phase): `made` the bytes made and still alive at its end,
summed over its calls (the activations F leaves for B: positive; what B frees of them: not seen, since F made
them), and `most` the most one call made at once; the process's resident memory: `rss +` its growth over the
phase, and `rss peak` the highest it reached during the phase above the step's start (VmHWM, reset at each
phase's start through /proc/self/clear_refs: the workers' own `peak_memory_bytes` is then not a run's peak).
What a worker's peak is made of then reads off the table: which phase reaches it, and which one grows.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT_ENV = "GPIPE_BENCH_PHASES"  # the folder the instrumented workers write their records into
PHASES = ("forward", "backward", "reduce", "update", "gather", "checkpoint", "other")
MIB = 2**20


# -- in the workers ----------------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _Record:
    """One step's (or eval batch's) phases on one thread: resident memory by segments between phase boundaries,
    torch's tensors per call."""

    def __init__(self, rank: int, step: int, kind: str):
        self.rank, self.step, self.kind = rank, step, kind
        self.stack: list[str] = ["other"]
        self.phases: dict[str, dict[str, int]] = {}
        self.start = _rss()
        self.segment = self.start
        _reset_hwm()

    def _close_segment(self) -> None:
        now, high = _rss(), _hwm()
        p = self._phase(self.stack[-1])
        p["rss_growth"] += now - self.segment
        p["rss_peak"] = max(p["rss_peak"], high - self.start)
        self.segment = now
        _reset_hwm()

    def _phase(self, name: str) -> dict[str, int]:
        return self.phases.setdefault(name, {"calls": 0, "made": 0, "most": 0, "rss_growth": 0, "rss_peak": 0})

    def enter(self, name: str) -> None:
        self._close_segment()
        self.stack.append(name)

    def leave(self, name: str, made: int, most: int) -> None:
        self._close_segment()
        self.stack.pop()
        p = self._phase(name)
        p["calls"] += 1
        p["made"] += made
        p["most"] = max(p["most"], most)

    def finish(self) -> dict[str, Any]:
        self._close_segment()
        return {"rank": self.rank, "step": self.step, "kind": self.kind, "rss_start": self.start,
                "rss_end": _rss(), "phases": self.phases}


_local = threading.local()


def _phase(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` measured as phase `name` of the step now recorded on this thread (nothing outside a step)."""
    from gpipe.memory.meter import Made

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        rec: _Record | None = getattr(_local, "record", None)
        if rec is None:
            return fn(*args, **kwargs)
        rec.enter(name)
        made = Made(meta=False)
        try:
            with made:
                return fn(*args, **kwargs)
        finally:
            rec.leave(name, made.now, made.peak)

    return wrapped


def _recorded(kind: str, fn: Callable[..., Any], step_of: Callable[[Any], int]) -> Callable[..., Any]:
    """A StageServer method that runs a step (or an eval batch), recorded whole on its thread."""

    def wrapped(self: Any, args: Any) -> Any:
        rec = _Record(self.stage.rank, step_of(args), kind)
        _local.record = rec
        try:
            return fn(self, args)
        finally:
            _local.record = None
            with open(Path(os.environ[OUT_ENV]) / f"phases-{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(rec.finish()) + "\n")

    return wrapped


def _patch(server_module: Any) -> None:
    from gpipe import stage
    from gpipe.memory import zero

    s = stage.Stage
    actions = dict(s.ACTIONS)
    s.ACTIONS = {"F": _phase("forward", actions["F"]), "B": _phase("backward", actions["B"]),
                 "W": _phase("backward", actions["W"])}
    for name, phase in (("_reduce_replicas", "reduce"), ("_sum_tied", "reduce"), ("_finish_gradients", "reduce"),
                        ("_update", "update")):
        setattr(s, name, _phase(phase, getattr(s, name)))
    zero.ShardedOptimizer._gather_weights = _phase("gather", zero.ShardedOptimizer._gather_weights)
    server = server_module.StageServer
    server._snapshot = _phase("checkpoint", server._snapshot)
    server._step = _recorded("train", server._step, lambda a: a[0])
    server._evaluate = _recorded("eval", server._evaluate, lambda a: a.batch)


class _After(importlib.abc.MetaPathFinder):
    """Patches gpipe.worker.stage_server (and what it imports) once it is imported."""

    name = "gpipe.worker.stage_server"

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        inner = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return inner.create_module(spec)

            def exec_module(self, module: Any) -> None:
                inner.exec_module(module)
                _patch(module)

        spec.loader = Loader()
        return spec


def install() -> None:
    """In a worker (the sitecustomize this bench writes): patch the stage server when it is imported."""
    if os.environ.get(OUT_ENV):
        sys.meta_path.insert(0, _After())


# -- the bench ---------------------------------------------------------------------------------------------


def gpt2_spec(name: str, shard: bool, steps: int, every: int, vocab: int) -> dict[str, Any]:
    return {
        "name": name, "seed": 0, "stages": 2, "replicas": 2, "chunks": 4, "schedule": "1f1b", "steps": steps,
        "model": {"factory": "hf:gpt2", "args": {"vocab": vocab, "width": 128, "layers": 4, "heads": 4,
                                                 "positions": 128},
                  "split_points": ["transformer.h.2"]},
        "data": {"factory": "tokens", "args": {"path": "data/train.bin", "seq_len": 128, "dtype": "uint16"},
                 "batch_size": 16},
        "eval": {"data": {"factory": "tokens", "args": {"path": "data/val.bin", "seq_len": 128, "dtype": "uint16"},
                          "batch_size": 16}, "every": every, "batches": 1},
        "loss": "cross_entropy", "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01, "shard": shard},
        "clip_grad_norm": 1.0, "checkpoint_every": every, "log_every": 1,
    }


def mlp_spec(name: str, shard: bool, steps: int, every: int, width: int) -> dict[str, Any]:
    return {
        "name": name, "seed": 0, "stages": 2, "replicas": 2, "chunks": 4, "schedule": "1f1b", "steps": steps,
        "model": {"factory": "mlp", "args": {"width": width, "depth": 7}},
        "data": {"factory": "random_regression", "args": {"n": 64, "in_features": width, "out_features": width},
                 "batch_size": 16},
        "loss": "mse", "optimizer": {"name": "adamw", "lr": 1e-4, "shard": shard}, "checkpoint_every": every,
        "log_every": 1,
    }


def token_files(folder: Path, vocab: int) -> None:
    """Random tokens: a train and a val file of uint16 ids below `vocab` (the job's data)."""
    import numpy as np

    (folder / "data").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, size=400_000, dtype=np.uint16).tofile(folder / "data" / "train.bin")
    rng.integers(0, vocab, size=40_000, dtype=np.uint16).tofile(folder / "data" / "val.bin")
    (folder / "hf.py").write_text((ROOT / "examples" / "hf.py").read_text())
    (folder / "charlm.py").write_text((ROOT / "examples" / "charlm.py").read_text())


def run(spec: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    """Run `spec` with instrumented workers; their records."""
    import yaml

    out = folder / f"{spec['name']}-phases"
    out.mkdir()
    site = folder / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'bench')!r})\n"
                                           "import memory_phases\nmemory_phases.install()\n")
    job = folder / f"{spec['name']}.yaml"
    job.write_text(yaml.safe_dump(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), **{OUT_ENV: str(out)})
    subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "run", str(job), "--state-dir",
                    str(folder / "state"), "--no-progress"], env=env, check=True, capture_output=True, timeout=1800,
                   cwd=folder)
    return [json.loads(line) for f in sorted(out.glob("phases-*.jsonl")) for line in f.read_text().splitlines()]


def show(records: list[dict[str, Any]], step: int, title: str) -> None:
    print(f"\n{title}: step {step} (MiB; torch: made = kept at the phase's end, most = one call's most at once; "
          f"rss + = growth, rss peak = above the step's start)")
    print(f"{'rank':>4} {'phase':<11} {'calls':>5} {'made':>8} {'most':>8} {'rss +':>8} {'rss peak':>9}")
    for kind in ("train", "eval"):
        for rec in sorted((r for r in records if r["kind"] == kind and r["step"] == (step if kind == "train" else
                                                                                      r["step"])),
                          key=lambda r: r["rank"]):
            if kind == "eval" and rec is not next(r for r in records if r["kind"] == "eval" and
                                                  r["rank"] == rec["rank"]):
                continue  # an eval batch's: the first one each worker ran
            names = PHASES if kind == "train" else ("forward", "other")
            for name in names:
                p = rec["phases"].get(name)
                if p is None:
                    continue
                label = name if kind == "train" else f"eval {name}"
                print(f"{rec['rank']:>4} {label:<11} {p['calls']:>5} {p['made'] / MIB:>8.1f} {p['most'] / MIB:>8.1f} "
                      f"{p['rss_growth'] / MIB:>8.1f} {p['rss_peak'] / MIB:>9.1f}")
            print(f"{rec['rank']:>4} {'(' + kind + ')':<11} {'':>5} {'':>8} {'':>8} "
                  f"{(rec['rss_end'] - rec['rss_start']) / MIB:>8.1f}   rss {rec['rss_start'] / MIB:.1f} -> "
                  f"{rec['rss_end'] / MIB:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--step", type=int, default=3, help="the step shown (0-based; a checkpoint and an eval follow "
                                                         "it when checkpoint_every divides step + 1)")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--mlp", action="store_true", help="an AdamW MLP of 8 square layers instead of GPT-2")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--records", type=Path, help="also write every record (each worker's every step) here, JSON")
    args = ap.parse_args()
    every_record: dict[str, list[dict[str, Any]]] = {}
    every = args.step + 1
    with tempfile.TemporaryDirectory(prefix="memory-phases-") as d:
        folder = Path(d)
        if not args.mlp:
            token_files(folder, args.vocab)
        for shard in (False, True):
            name = "sharded" if shard else "unsharded"
            spec = mlp_spec(name, shard, args.steps, every, args.width) if args.mlp else \
                gpt2_spec(name, shard, args.steps, every, args.vocab)
            t0 = time.perf_counter()
            records = run(spec, folder)
            every_record[name] = records
            what = f"AdamW MLP width {args.width}" if args.mlp else f"GPT-2 (vocab {args.vocab}) on tokens"
            show(records, args.step, f"{what}, 2 replicas x 2 stages, {name} ({time.perf_counter() - t0:.0f} s)")
    if args.records:
        args.records.write_text(json.dumps(every_record))


if __name__ == "__main__":
    main()
