"""Local worker processes for `gpipe-coordinator run`: one per stage, sharing the machine's cores.

On a CPU a stage's device is a set of cores: the stages split the cores this
process may use into disjoint sets, pin themselves to them, and run as many
threads as they own cores (or OMP_NUM_THREADS, when the user sets it). Each
worker dies with the coordinator (PR_SET_PDEATHSIG), and the coordinator kills
their process groups when it is done, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpipe.proc import child_env

# A stage allocates activation-sized buffers every micro-batch (received tensors,
# outputs, gradients). glibc serves large ones with fresh mmaps and hands freed
# memory back to the OS, so each one page-faults anew: 8 MiB transfers reached
# 0.69 of raw gloo that way, 0.85 with these (bench/transfer.py). A worker owns
# its machine's memory, so keep it: the heap serves all sizes and is not trimmed.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def split_cores(stages: int, cores: list[int] | None = None) -> list[list[int]]:
    """Disjoint core sets, one per stage (shared round-robin when stages outnumber cores)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if stages > len(cores):
        return [[cores[k % len(cores)]] for k in range(stages)]
    per = len(cores) // stages
    return [cores[k * per : (k + 1) * per] for k in range(stages)]


def threads_per_stage(core_sets: list[list[int]]) -> int:
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, min(len(s) for s in core_sets))


@dataclass
class LocalWorker:
    stage: int
    proc: subprocess.Popen
    cores: list[int]
    log_path: Path


class LocalWorkers:
    """Start, watch and kill the worker processes of one attempt."""

    def __init__(self, stages: int, master: str, host: str, log_dir: Path, start_timeout: float,
                 import_paths: list[str]):
        self.workers: list[LocalWorker] = []
        core_sets = split_cores(stages)
        self.threads = threads_per_stage(core_sets)
        log_dir.mkdir(parents=True, exist_ok=True)
        for k, cores in enumerate(core_sets):
            env = child_env(dict(os.environ), cores)
            env["OMP_NUM_THREADS"] = str(self.threads)
            env["PYTHONPATH"] = os.pathsep.join([*import_paths, env.get("PYTHONPATH", "")])
            env["PYTHONUNBUFFERED"] = "1"
            for name, value in MALLOC_ENV.items():
                env.setdefault(name, value)
            log_path = log_dir / f"stage-{k}.log"
            cmd = [sys.executable, "-m", "gpipe.worker", "--stage", str(k), "--stages", str(stages),
                   "--master", master, "--host", host, "--start-timeout", str(start_timeout)]
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.workers.append(LocalWorker(k, proc, cores, log_path))

    def move_logs(self, log_dir: Path) -> None:
        """Move the workers' logs (still being written) to `log_dir`, where the filesystem allows."""
        log_dir.mkdir(parents=True, exist_ok=True)
        old = {w.log_path.parent for w in self.workers}
        for w in self.workers:
            try:
                os.replace(w.log_path, log_dir / w.log_path.name)
            except OSError:  # another filesystem: the log stays where it is, and is named as it is
                continue
            w.log_path = log_dir / w.log_path.name
        for d in old:
            with contextlib.suppress(OSError):
                d.rmdir()

    def dead(self) -> list[tuple[int, int]]:
        """(stage, exit code) of the workers that have exited."""
        return [(w.stage, w.proc.returncode) for w in self.workers if w.proc.poll() is not None]

    def why_dead(self) -> tuple[str, int] | None:
        """(why, stage) for the first worker that has exited, or None while they all run."""
        dead = self.dead()
        if not dead:
            return None
        k = dead[0][0]
        why, line = self.describe_exit(k), self.last_error_line(k)
        return (f"{why}: {line}" if line else why), k

    def describe_exit(self, stage: int) -> str:
        code = self.workers[stage].proc.returncode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"stage {stage}'s worker process died ({how}); its log: {self.workers[stage].log_path}"

    def last_error_line(self, stage: int) -> str | None:
        """The last exception line a worker printed, if any."""
        try:
            lines = self.workers[stage].log_path.read_text(errors="replace").splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            if line and not line.startswith((" ", "Traceback", "[W", "[I")) and ":" in line:
                return line.strip()
        return None

    def wait(self, timeout: float) -> bool:
        """Wait for every worker to exit by itself; True if they all did."""
        deadline = time.monotonic() + timeout
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill(self) -> None:
        """SIGKILL every worker's process group and reap it."""
        for w in self.workers:
            if w.proc.poll() is None:
                try:
                    os.killpg(w.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for w in self.workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
