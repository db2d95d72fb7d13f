"""A long run's memory: each worker's peak and resident memory at step 5 and at the end, and their ratio.

    python bench/memory_flat.py                       # 300 steps of a GPT-2 token job: a few minutes
    python bench/memory_flat.py --steps 40 --every 10 --curve
    python bench/memory_flat.py --serve [--shard]     # the same job through serve and gpipe-worker daemons

A GPT-2 (the vocabulary of GPT-2's tokenizer, 50257, so that its embedding, head and logits are the large
tensors of a language model; 2 blocks a stage, width 128) on random tokens, 2 stages, 1f1b, AdamW, clipping,
an evaluation and a checkpoint every `--every` steps, through `run`. With `--serve`, through the service
instead: `serve` on a free port of 127.0.0.1 (with tokens) and a `gpipe-worker` daemon per rank, each on the
cores `run` would give that rank, the job submitted and waited for. Each step's metrics line has, per worker,
`peak_memory_bytes` (its process's resident peak so far: VmHWM) and `rss_bytes` (its resident memory at the
step's end). The target (issue 60): every worker's peak after warm-up (step 5) within 5% of its value at step
5, to the run's end. `--curve` prints every step's figures too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WARM = 5  # the steps a worker's memory settles in (the optimizer's state appears after the first)
TARGET = 0.05
MIB = 2**20
CLI = [sys.executable, "-m", "gpipe.coordinator.cli.main"]
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")
JOB_TIMEOUT_S = 3600
START_TIMEOUT_S = 180  # serve's start, a worker's registration: each imports torch, on a busy machine too

Steps = dict[int, list[tuple[int, int]]]  # per rank, each step's (peak, rss) in bytes


def spec_of(steps: int, every: int, vocab: int, seq_len: int, batch: int, shard: bool) -> dict[str, Any]:
    return {
        "name": "flat", "seed": 0, "stages": 2, "replicas": 2 if shard else 1, "chunks": 4, "schedule": "1f1b",
        "steps": steps, "log_every": 1,
        "model": {"factory": "hf:gpt2", "args": {"vocab": vocab, "width": 128, "layers": 4, "heads": 4,
                                                 "positions": seq_len},
                  "split_points": ["transformer.h.2"]},
        "data": {"factory": "tokens", "args": {"path": "data/train.bin", "seq_len": seq_len, "dtype": "uint16"},
                 "batch_size": batch, "shuffle": True},
        "eval": {"data": {"factory": "tokens", "args": {"path": "data/val.bin", "seq_len": seq_len,
                                                        "dtype": "uint16"}, "batch_size": batch},
                 "every": every, "batches": 2},
        "loss": "cross_entropy",
        "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01, **({"shard": True} if shard else {})},
        "lr_schedule": {"name": "cosine", "warmup_steps": 10, "min_lr": 1e-4},
        "clip_grad_norm": 1.0, "checkpoint_every": every,
    }


def job_folder(folder: Path, vocab: int) -> None:
    """The job's model code (examples/hf.py, which imports examples/charlm.py) and random token files."""
    import numpy as np

    (folder / "data").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, size=1_000_000, dtype=np.uint16).tofile(folder / "data" / "train.bin")
    rng.integers(0, vocab, size=50_000, dtype=np.uint16).tofile(folder / "data" / "val.bin")
    for name in ("hf.py", "charlm.py"):
        (folder / name).write_text((ROOT / "examples" / name).read_text())


def write_job(spec: dict[str, Any], folder: Path) -> Path:
    import yaml

    job = folder / "job" / "flat.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def read_out(out: Path) -> tuple[Steps, dict[int, int]]:
    """A job's output folder: per rank, each step's (peak, rss); plan.json's predicted peaks."""
    steps: Steps = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        for s in json.loads(line).get("stages", []):
            steps.setdefault(s["rank"], []).append((s["peak_memory_bytes"], s.get("rss_bytes") or 0))
    workers = json.loads((out / "plan.json").read_text())["workers"]
    return steps, {w["rank"]: w.get("predicted_peak_bytes") or 0 for w in workers}


def run(spec: dict[str, Any], folder: Path) -> tuple[Steps, dict[int, int], float]:
    """Per rank, each step's (peak, rss) in bytes; plan.json's predicted peaks; the run's seconds."""
    job = write_job(spec, folder)
    t0 = time.perf_counter()
    subprocess.run([*CLI, "run", str(job), "--state-dir", str(folder / "state"), "--no-progress"], env=env(),
                   check=True, capture_output=True, timeout=JOB_TIMEOUT_S, cwd=job.parent)
    seconds = time.perf_counter() - t0
    return *read_out(folder / "state" / spec["name"]), seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """serve and a gpipe-worker daemon per rank, each in a process group of its own, their files in `root`."""

    def __init__(self, root: Path):
        self.root, self.state = root, root / "state"
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        root.mkdir()
        # Tokens: on a shared machine no other user's process may submit code to this serve or take a rank, and
        # a GPIPE_TOKEN or GPIPE_WORKER_TOKEN of the environment cannot leave serve with one token of two.
        for kind in ("client", "worker"):
            (root / f"{kind}-token").write_text(secrets.token_hex(16) + "\n")
        self.client_auth = ["--auth-token-file", str(root / "client-token")]
        self.worker_auth = ["--worker-token-file", str(root / "worker-token")]

    def spawn(self, key: str, argv: list[str]) -> None:
        with (self.root / f"{key}.log").open("ab") as log:
            self.procs[key] = subprocess.Popen(argv, cwd=self.root, env=env(), stdin=subprocess.DEVNULL,
                                               stdout=log, stderr=log, start_new_session=True)

    def log(self, key: str) -> str:
        path = self.root / f"{key}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return "".join(f"\n--- {k}.log\n{self.log(k)[-2000:]}" for k in self.procs)

    def wait(self, cond: Callable[[], bool], what: str, timeout: float) -> None:
        """Poll `cond`; SystemExit with the logs once `timeout` has passed or one of the processes has ended."""
        deadline = time.monotonic() + timeout
        while not cond():
            if gone := [k for k, p in self.procs.items() if p.poll() is not None]:
                raise SystemExit(f"{', '.join(gone)} exited while waiting for {what}{self.logs()}")
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}{self.logs()}")
            time.sleep(0.2)

    def start(self, ranks: int) -> None:
        """serve, then a worker per rank on the cores `run` would give that rank; back once all are registered
        (`ranks` 0: serve alone, back once it listens)."""
        from gpipe.worker.cores import split_cores  # type: ignore[import-not-found]  # worker/, by package-dir

        # --host: with tokens, serve would listen on every interface.
        self.spawn("serve", [*CLI, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--state-dir",
                             str(self.state), *self.client_auth, *self.worker_auth])
        self.wait(lambda: "coordinator serving on" in self.log("serve"), "serve to start", START_TIMEOUT_S)
        if not ranks:
            return
        for rank, cores in enumerate(split_cores(ranks)):
            self.spawn(f"worker{rank}", [sys.executable, "-m", "gpipe.worker.daemon", "--rank", str(rank),
                                         "--coordinator", self.address, "--cores", ",".join(map(str, cores)),
                                         "--log-dir", str(self.root / f"worker{rank}-attempts"), *self.worker_auth])
        self.wait(lambda: all(f"worker for rank {r} registered" in self.log("serve") for r in range(ranks)),
                  f"ranks 0-{ranks - 1} to register", START_TIMEOUT_S)

    def submit(self, job: Path) -> None:
        r = subprocess.run([*CLI, "submit", str(job), "--coordinator", self.address, *self.client_auth],
                           env=env(), cwd=job.parent, capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise SystemExit(f"submit exited {r.returncode}: {r.stderr.strip()[-2000:]}{self.logs()}")

    def record(self, name: str) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):  # not written yet, or read while it is replaced
            return dict(json.loads((self.state / name / "job.json").read_text()))
        return {}

    def finish(self, name: str) -> None:
        """Wait for job `name` to end; SystemExit saying why unless it SUCCEEDED."""
        self.wait(lambda: self.record(name).get("state") in ENDED, f"job {name} to end", JOB_TIMEOUT_S)
        rec = self.record(name)
        if rec["state"] != "SUCCEEDED":
            last = rec["history"][-1]["message"] if rec.get("history") else ""
            raise SystemExit(f"job {name} ended {rec['state']}: {rec.get('error') or last}"
                             f"\n--- coordinator.log\n{self.job_log(name)[-2000:]}{self.logs()}")

    def job_log(self, name: str) -> str:
        path = self.state / name / "logs" / "coordinator.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Every process group started, killed (their attempts and templates die with their parents)."""
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        self.procs.clear()


def served(spec: dict[str, Any], folder: Path) -> tuple[Steps, dict[int, int], float]:
    """`run`'s figures for the same job through serve and a worker daemon per rank; the seconds from submit
    to its end (the validation included, the service's start not)."""
    job = write_job(spec, folder)
    service = Service(folder / "service")
    try:
        service.start(spec["stages"] * spec["replicas"])
        t0 = time.perf_counter()
        service.submit(job)
        service.finish(spec["name"])
        seconds = time.perf_counter() - t0
    finally:
        service.stop()
    return *read_out(service.state / spec["name"]), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25, help="an evaluation and a checkpoint every this many steps")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--shard", action="store_true", help="2 replicas x 2 stages, optimizer.shard")
    ap.add_argument("--curve", action="store_true", help="every step's peak and resident memory too")
    ap.add_argument("--serve", action="store_true", help="through serve and gpipe-worker daemons, not run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="memory-flat-") as d:
        folder = Path(d)
        job_folder(folder / "job", args.vocab)  # a folder of its own: what submit packs as the job's code
        spec = spec_of(args.steps, args.every, args.vocab, args.seq_len, args.batch, args.shard)
        steps, predicted, seconds = (served if args.serve else run)(spec, folder)
    print(f"GPT-2 (vocab {args.vocab}, width 128, 4 blocks) on tokens: {args.steps} steps of {args.batch} x "
          f"{args.seq_len} tokens, 4 micro-batches, 1f1b, {'2 replicas x ' if args.shard else ''}2 stages, AdamW"
          f"{', sharded' if args.shard else ''}; eval and checkpoint every {args.every}; {seconds:.0f} s")
    print(f"{'rank':>4} {'peak@5':>8} {'peak@end':>9} {'ratio':>6} {'rss@5':>8} {'rss@end':>8} {'ratio':>6} "
          f"{'worst peak/peak@5':>18} {'predicted':>10} {'pred/peak@end':>14}  MiB")
    ok = True
    for rank in sorted(steps):
        s = steps[rank]
        if len(s) <= WARM:
            print(f"{rank:>4} only {len(s)} steps")
            continue
        (p5, r5), (pe, re) = s[WARM - 1], s[-1]
        worst = max(p for p, _ in s[WARM - 1:]) / p5
        ok = ok and worst <= 1 + TARGET
        guess = predicted.get(rank, 0)
        print(f"{rank:>4} {p5 / MIB:>8.1f} {pe / MIB:>9.1f} {pe / p5:>6.3f} {r5 / MIB:>8.1f} {re / MIB:>8.1f} "
              f"{re / r5:>6.3f} {worst:>18.3f} {guess / MIB:>10.1f} {guess / pe if pe else 0:>14.3f}")
    print(f"target: every worker's peak after step {WARM} within {TARGET:.0%} of its value at step {WARM}: "
          f"{'met' if ok else 'missed'}")
    if args.curve:
        for rank in sorted(steps):
            print(f"rank {rank} peak/rss per step (MiB): " +
                  " ".join(f"{p / MIB:.0f}/{r / MIB:.0f}" for p, r in steps[rank]))


if __name__ == "__main__":
    main()
