"""A model bigger than any one process should hold: memory per process, step time, checkpoint and resume.

    python bench/scale.py                 # 16 x Linear(8192, 8192)+ReLU, 1.07 B parameters, 4.3 GB of float32
    python bench/scale.py --width 2048    # the same shape, 16 times smaller, for a quick look

4 stages, sgd without momentum, `init: per_layer`, batch 8 in 4 micro-batches.
`gpipe-coordinator run` trains 3 steps with a checkpoint after step 2 (and the
final one after step 3); then the final checkpoint is set aside and the job is
resumed from step-2 for 1 step. Reported:
  - each process's peak resident memory: VmHWM from /proc/<pid>/status, polled
    every 0.2 s, and as the processes report it themselves at the end (the
    coordinator's attempt process in its log, each stage in metrics.jsonl);
  - against the targets: the attempt process under 1 GB, and each stage at most
    1.25 x (its parameters + gradients) + 0.5 GB;
  - each step's time, the checkpoint's copy-out (the stages' pause), its write
    time and throughput, and the time to resume (from the resumed attempt's
    "resuming" line to its first step's start, all stages built);
  - whether the resumed weights equal the uninterrupted run's bit for bit
    (the sha256 of model.safetensors and of each stage's checkpoint file).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DATA = '''
import torch
from torch.utils.data import TensorDataset

def wide(n: int, width: int) -> TensorDataset:
    """n random (input, target) pairs of `width` features, without a width x width matrix."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g) * 0.1)
'''


def vm_hwm(pid: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def role(cmdline: bytes) -> str:
    args = cmdline.split(b"\0")
    text = b" ".join(args).decode(errors="replace")
    for key, name in (("gpipe.coordinator.attempt.process", "coordinator attempt"), ("worker", "worker"),
                      ("gpipe.coordinator.cli.main", "run (supervisor)")):
        if key in text:
            return name
    return text[:60]


class Watcher:
    """Polls the VmHWM of every process carrying the tag in its environment."""

    def __init__(self, tag: str):
        self.needle = f"GPIPE_BENCH_TAG={tag}".encode()
        self.peaks: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for d in Path("/proc").iterdir():
                if not d.name.isdigit():
                    continue
                pid = int(d.name)
                try:
                    if pid not in self.peaks and self.needle not in (d / "environ").read_bytes().split(b"\0"):
                        continue
                    name = role((d / "cmdline").read_bytes())  # anew: a fork takes a moment to exec
                except OSError:
                    continue
                hwm = vm_hwm(d.name)
                if hwm:
                    self.peaks[pid] = (name, max(hwm, self.peaks.get(pid, ("", 0))[1]))
            self._stop.wait(0.2)

    def stop(self) -> dict[int, tuple[str, int]]:
        self._stop.set()
        self._t.join()
        return self.peaks


def run(tmp: Path, tag: str, *extra: str) -> tuple[list[tuple[float, str]], dict[int, tuple[str, int]]]:
    """`run` the job; its stderr lines with their arrival times, and each process's peak VmHWM."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPIPE_BENCH_TAG=tag)
    w = Watcher(tag)
    p = subprocess.Popen([sys.executable, "-m", "gpipe.coordinator.cli.main", "run", str(tmp / "job.yaml"),
                          "--state-dir", str(tmp / "state"), "--no-progress", *extra],
                         env=env, stderr=subprocess.PIPE, text=True, cwd=tmp)
    lines = []
    assert p.stderr is not None
    for line in p.stderr:
        lines.append((time.time(), line.rstrip()))
        print("   ", line.rstrip(), flush=True)
    p.wait(timeout=3600)
    peaks = w.stop()
    if p.returncode:
        raise SystemExit(f"run failed ({p.returncode})")
    return lines, peaks


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def report(title: str, lines: list[tuple[float, str]], peaks: dict[int, tuple[str, int]], out: Path,
           attempt: int, share: list[int]) -> None:
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    mine = [m for m in metrics if m["attempt"] == attempt]
    print(f"\n{title}")
    bound = 1.25 * max(share) + 0.5e9
    print(f"  peak resident memory (VmHWM, polled), against the targets (attempt: under 1 GB; a stage: "
          f"1.25 x {max(share) / 1e9:.2f} GB of weights and gradients + 0.5 GB = {bound / 1e9:.2f} GB):")
    for pid, (name, hwm) in sorted(peaks.items(), key=lambda x: x[1][0]):
        target = 1e9 if name == "coordinator attempt" else bound if name == "worker" else None
        verdict = "" if target is None else ("  met" if hwm <= target else f"  MISSED by {hwm / target - 1:.1%}")
        print(f"    {name:22} pid {pid:>7}  {hwm / 1e9:6.2f} GB{verdict}")
    said = [re.search(r"peak resident memory ([\d.]+) MiB", t) for _, t in lines]
    attempt_mib = next(float(m.group(1)) for m in said if m)
    stages = ", ".join(f"{s['peak_memory_bytes'] / 1e9:.2f}" for s in mine[-1]["stages"])
    print(f"  as the processes report it: the attempt {attempt_mib * 2**20 / 1e9:.2f} GB; the stages at the end "
          f"of their last step {stages} GB")
    for m in mine:
        copy = max((s.get("snapshot_s", 0.0) for s in m["stages"]), default=0.0)
        wait = max((s.get("snapshot_wait_s", 0.0) for s in m["stages"]), default=0.0)
        extra = f"  checkpoint copy-out {copy * 1e3:.0f} ms (waited {wait * 1e3:.0f} ms for the previous one)" \
            if any("snapshot_s" in s for s in m["stages"]) else ""
        print(f"  step {m['step']}: {m['step_time_s']:.2f} s{extra}")
    for _, t in lines:
        if w := re.search(r"checkpoint (step-\d+): ([\d.,]+) MiB in ([\d.]+)s", t):
            mib, sec = float(w.group(2).replace(",", "")), float(w.group(3))
            print(f"  {w.group(1)} written: {mib:.0f} MiB in {sec:.2f} s, {mib * 2**20 / sec / 1e6:.0f} MB/s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--dir", help="where the state goes (default: a temporary folder, removed)")
    a = p.parse_args()
    tmp = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="gpipe-scale-"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        (tmp / "scale_data.py").write_text(DATA)
        spec = {
            "name": "scale", "seed": 0, "stages": a.stages, "chunks": 4, "init": "per_layer", "probe": False,
            "model": {"factory": "mlp", "args": {"width": a.width, "depth": a.depth, "head": False}},
            "data": {"factory": "scale_data:wide", "args": {"n": 16, "width": a.width}, "batch_size": 8},
            "loss": "mse", "optimizer": {"name": "sgd", "lr": 0.001}, "steps": 3, "checkpoint_every": 2,
            "keep_checkpoints": 2, "start_timeout_s": 1800, "step_timeout_s": 1800,
        }
        (tmp / "job.yaml").write_text(yaml.safe_dump(spec))
        params = a.depth * (a.width * a.width + a.width)
        per_stage = [a.depth // a.stages + (k < a.depth % a.stages) for k in range(a.stages)]
        share = [n * (a.width * a.width + a.width) * 4 * 2 for n in per_stage]  # float32 weights + gradients
        print(f"{a.depth} x Linear({a.width}, {a.width}): {params / 1e9:.3f} B parameters, "
              f"{params * 4 / 1e9:.2f} GB of float32; {a.stages} stages")
        out = tmp / "state" / "scale"
        t0 = time.perf_counter()
        lines, peaks = run(tmp, uuid.uuid4().hex)
        print(f"\ntrained 3 steps in {time.perf_counter() - t0:.1f} s (wall, with start-up)")
        report("uninterrupted run (3 steps, checkpoints after steps 2 and 3)", lines, peaks, out, 1, share)
        weights = sha256(out / "model.safetensors")
        final = json.loads((out / "checkpoints" / "step-3" / "MANIFEST.json").read_text())
        shutil.rmtree(out / "checkpoints" / "step-3")
        (out / "model.safetensors").unlink()
        t0 = time.perf_counter()
        lines, peaks = run(tmp, uuid.uuid4().hex, "--resume")
        print(f"\nresumed and trained 1 step in {time.perf_counter() - t0:.1f} s (wall, with start-up)")
        report("resumed from step-2 (1 step)", lines, peaks, out, 2, share)
        since = next(t for t, line in lines if "resuming from checkpoint step-2" in line)
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        first = min(s["start_unix"] for s in metrics[-1]["stages"])
        print(f"  resume: {first - since:.1f} s from the resuming line to the first step's start")
        again = json.loads((out / "checkpoints" / "step-3" / "MANIFEST.json").read_text())
        same_files = all(again["files"][f"stage-{k}.safetensors"]["sha256"] == final["files"][f"stage-{k}.safetensors"]
                         ["sha256"] for k in range(a.stages))
        same = sha256(out / "model.safetensors") == weights
        print(f"\nresumed weights bit-identical to the uninterrupted run's: model.safetensors {same}, "
              f"every stage's checkpoint file {same_files}")
    finally:
        if not a.dir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
