"""The soak: four jobs at once in one pool of workers through a seeded stream of mixed faults; every job ends
SUCCEEDED with the bits of its calm twin, and the records say no worker was in two attempts at once.

The pool is serve and WORKERS workers, each on a host of its own (a network namespace, tests.support.netns), serve's
state folder on a disk of its own (a small tmpfs), so that a host can be cut off and the disk filled. The jobs of a
round (`specs`): two with replicas, one sharded, one elastic, at mixed priorities, the two of higher priority
submitted once the others run, so that they preempt. The calm twins (the same specs, priority 0) run first with no
fault; then rounds of the same four jobs run until the faults are spent, each round checked as it ends.

The faults (KINDS), each at a seeded moment on a seeded victim, and what was killed started again as its
orchestrator would:
- worker SIGKILL: a worker's container killed (SIGKILL to its process group);
- worker SIGTERM: a worker evicted (the daemon alone, which checkpoints and leaves);
- worker SIGSTOP: a worker frozen for `hold_s` (the daemon and every process under it);
- serve SIGKILL: serve's container killed (its process group, with its attempts);
- partition: a worker's host cut off for `hold_s`, then mended;
- disk full: serve's state folder filled to the last byte for `hold_s`, then freed;
- corrupt checkpoint: the newest committed checkpoint of a running job damaged, then a worker of that job
  killed, so that it resumes from the checkpoint before.

The checks, per job: SUCCEEDED; the bits of its calm twin; each resume from the newest checkpoint serve had
heard of (or the one before it, where that one was damaged on purpose); every checkpoint on disk whole. Across
jobs: no rank in two attempts at once (from each job's history: its attempts' ranks and times). Per process:
serve's and each worker daemon's RSS and open descriptors, sampled every few seconds, first and last.

tests/service/test_soak.py runs 15 faults in about 5 minutes; bench/soak.py (make soak) 100 over an hour.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support import netns
from tests.support.cli import ROOT

KINDS = ("worker SIGKILL", "worker SIGTERM", "worker SIGSTOP", "serve SIGKILL", "partition", "disk full",
         "corrupt checkpoint")
WORKERS = 6
PORT = 7000  # serve's, on its own host's address
HEARTBEAT_TIMEOUT_S = 5
ENDED = ("SUCCEEDED", "FAILED", "STOPPED")
JOBS = ("replicas", "sharded", "elastic", "wide")  # a round's jobs, in the order they are submitted
LATE = ("sharded", "wide")  # submitted once the others run, at higher priorities: they preempt
DISK = "64m"  # serve's state folder's disk


class SoakFailure(AssertionError):
    pass


@dataclass
class Fault:
    at_s: float  # from the start of the faulty rounds
    kind: str
    rank: int  # the worker struck (worker faults, partition, a corrupt checkpoint's job's worker)
    hold_s: float  # SIGSTOP's, partition's, disk full's


def faults(seed: int, count: int, span_s: float, hold_s: tuple[float, float], cut_s: float) -> list[Fault]:
    """`count` faults over `span_s` seconds, every kind at least once (count >= len(KINDS)), in seeded order."""
    rng = random.Random(seed)
    kinds = [*KINDS, *(rng.choice(KINDS) for _ in range(count - len(KINDS)))]
    rng.shuffle(kinds)
    times = sorted(rng.uniform(0.0, span_s) for _ in kinds)
    return [Fault(round(t, 1), k, rng.randrange(WORKERS),
                  cut_s if k == "partition" else round(rng.uniform(*hold_s), 1)) for t, k in zip(times, kinds, strict=True)]


def specs(prefix: str, steps: int, seconds: float, calm: bool) -> list[dict[str, Any]]:
    """A round's four jobs, named `prefix`-<kind>: seed, data and optimizer fixed, so that a job's twin of
    another round (and the calm one) trains the same bits. Calm twins all run at priority 0."""
    def one(kind: str, **changes: Any) -> dict[str, Any]:
        spec = {"name": f"{prefix}-{kind}", "seed": 11,
                "model": {"factory": "tests.support.models:slow_mlp", "args": {"width": 16, "seconds": seconds}},
                "stages": 2, "chunks": 2,
                "data": {"factory": "random_regression", "args": {"n": 64, "in_features": 16, "out_features": 16},
                         "batch_size": 8, "shuffle": True},
                "loss": "mse", "optimizer": {"name": "adam", "lr": 0.01}, "steps": steps, "checkpoint_every": 3,
                "keep_checkpoints": 3, "max_restarts": 100, "restart_timeout_s": 20, "start_timeout_s": 60,
                "step_timeout_s": 60, "peer_timeout_s": 10}
        spec.update(changes)
        if calm:
            spec.pop("priority", None)
        return spec

    return [one("replicas", stages=1, replicas=2),
            one("sharded", stages=1, replicas=2, optimizer={"name": "adam", "lr": 0.01, "shard": True}, priority=1),
            one("elastic", elastic={"min_stages": 1}),
            one("wide", replicas=2, priority=2)]


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=30)


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it."""
    parent: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    tree = {pid}
    while more := {p for p, pp in parent.items() if pp in tree} - tree:
        tree |= more
    return sorted(tree)


def rss_and_fds(pid: int) -> tuple[int, int] | None:
    """(RSS in bytes, open descriptors) of `pid`, or None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) * 1024  # type: ignore[index]
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, TypeError):
        return None


def fill(path: Path) -> Path:
    """A file under `path` written until its disk is full (delete it to free the room)."""
    filler = path / ".filler"
    with contextlib.suppress(OSError), filler.open("wb") as f:
        while True:
            f.write(b"\0" * (1 << 20))
            f.flush()
    with contextlib.suppress(OSError), filler.open("ab") as f:  # the last few blocks too
        while True:
            f.write(b"\0" * 4096)
            f.flush()
    return filler


def read_json(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return {}


def steps_of(out: Path) -> list[tuple[int, int]]:
    """(attempt, step) of each training step in metrics.jsonl, past a line cut short."""
    found = []
    with contextlib.suppress(OSError):
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                if "loss" in (row := json.loads(line)):
                    found.append((int(row["attempt"]), int(row["step"])))
    return found


@dataclass
class Samples:
    """A process's (time, RSS, fds) samples, by what it is ('serve', 'worker3') and its pid."""

    rows: dict[tuple[str, int], list[tuple[float, int, int]]] = field(default_factory=dict)


@dataclass
class Report:
    faults: dict[str, int] = field(default_factory=dict)  # kind -> struck
    rounds: int = 0
    jobs: int = 0
    attempts: int = 0
    preemptions: int = 0
    resumes_checked: int = 0
    largest_difference: float = 0.0  # the largest |weight - calm twin's| over every job: 0.0 is bit for bit
    processes: list[str] = field(default_factory=list)  # each process's first and last RSS and fds
    seconds: float = 0.0

    def lines(self) -> list[str]:
        return [f"faults: {sum(self.faults.values())} (" + ", ".join(f"{k} {n}" for k, n in self.faults.items()) + ")",
                f"rounds: {self.rounds}, jobs: {self.jobs}, all SUCCEEDED; attempts: {self.attempts}, "
                f"preemptions: {self.preemptions}, resumes checked: {self.resumes_checked}",
                f"largest weight difference from the calm twins: {self.largest_difference:g}",
                *self.processes, f"{self.seconds:.0f} s in all"]


class Soak:
    """The pool (serve and WORKERS workers, each on a host of its own) and what strikes it; `with Soak(...)`
    ends every process, host and mount it made."""

    def __init__(self, root: Path, env: dict[str, str], say: Callable[[str], None] = print):
        self.root, self.say = root, say
        self.env = {**env, "PYTHONPATH": str(ROOT), "GPIPE_OVERSUBSCRIBE": "1"}
        self.env.pop("GPIPE_TEMPLATE_SOCKET", None)  # a worker is a machine: SIGSTOP freezes its attempts too
        self.state = root / "state"
        self.hosts = netns.Hosts(1 + WORKERS, prefix="sk")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.mounted = False
        self.samples = Samples()
        self.corrupted: set[Path] = set()
        self._sampling = threading.Event()
        self._sampler: threading.Thread | None = None
        self.cores = sorted(os.sched_getaffinity(0))

    # the pool's processes

    def __enter__(self) -> Soak:
        for d in ("tokens", "logs", "specs"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "tokens" / "client").write_text("client-soak\n")
        (self.root / "tokens" / "worker").write_text("worker-soak\n")
        self.state.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK},mode=0700", "tmpfs", str(self.state)],
                       check=True)
        self.mounted = True
        try:
            self.hosts.__enter__()
        except BaseException:
            self._unmount()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._sampling.set()
        with contextlib.suppress(OSError):  # the records outlive the state folder's disk, to read after
            for d in self.state.iterdir():
                for f in ("job.json", "metrics.jsonl"):
                    if (d / f).exists():
                        (self.root / "records" / d.name).mkdir(parents=True, exist_ok=True)
                        (self.root / "records" / d.name / f).write_bytes((d / f).read_bytes())
        if self._sampler is not None:
            self._sampler.join(timeout=10)
        for p in self.procs.values():
            _kill_group(p)
        self.procs.clear()
        self.hosts.close()
        self._unmount()

    def _unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.state)], check=False)
            self.mounted = False

    @property
    def address(self) -> str:
        return f"{self.hosts.addr(0)}:{PORT}"

    def log(self, key: str) -> str:
        path = self.root / "logs" / f"{key}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _spawn(self, key: str, host: int, args: list[str]) -> None:
        self.procs[key] = self.hosts.spawn(host, [sys.executable, *args], self.env, self.root / "logs" / f"{key}.log",
                                           cwd=self.root)

    def wait_for(self, cond: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.1)
        tails = "\n".join(f"--- {k}\n{self.log(k)[-1500:]}" for k in self.procs)
        raise SoakFailure(f"timed out after {timeout:.0f} s waiting for {what}\n{tails}")

    def start_serve(self) -> None:
        before = self.log("serve").count("coordinator serving on")
        self._spawn("serve", 0, ["-m", "gpipe.coordinator.cli.main", "serve", "--host", self.hosts.addr(0),
                                 "--port", str(PORT), "--state-dir", str(self.state),
                                 "--auth-token-file", str(self.root / "tokens" / "client"),
                                 "--worker-token-file", str(self.root / "tokens" / "worker"),
                                 "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)])
        self.wait_for(lambda: self.log("serve").count("coordinator serving on") > before, "serve to start", 90)

    def start_worker(self, rank: int, wait: bool = True) -> None:
        before = self.log("serve").count(f"worker for rank {rank} registered")
        self._spawn(f"worker{rank}", 1 + rank,
                    ["-m", "gpipe.worker.daemon", "--rank", str(rank), "--coordinator", self.address,
                     "--cores", str(self.cores[rank % len(self.cores)]),
                     "--worker-token-file", str(self.root / "tokens" / "worker"),
                     "--log-dir", str(self.root / f"worker{rank}-attempts")])
        if wait:
            self.wait_for(lambda: self.log("serve").count(f"worker for rank {rank} registered") > before,
                          f"rank {rank} to register", 90)

    def client(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.hosts.ns[0], sys.executable, "-m",
                               "gpipe.coordinator.cli.main", *args, "--coordinator", self.address,
                               "--auth-token-file", str(self.root / "tokens" / "client")],
                              env=self.env, cwd=self.root, capture_output=True, text=True, timeout=timeout)

    def submit(self, spec: dict[str, Any]) -> None:
        path = self.root / "specs" / f"{spec['name']}.yaml"
        path.write_text(yaml.safe_dump(spec))
        deadline = time.monotonic() + 120
        while True:  # refused for now (serve down, cut off, or its disk full): a user submits again
            r = self.client("submit", str(path))
            if r.returncode == 0 or (self.out(spec["name"]) / "job.json").exists():
                return
            transient = ("cannot reach the coordinator", "ENOSPC")  # serve down or cut off; its disk full
            if not any(t in r.stderr for t in transient) or time.monotonic() > deadline:
                raise SoakFailure(f"submit {spec['name']}: exit {r.returncode}: {r.stderr.strip()[-500:]}")
            time.sleep(1.0)

    def start(self) -> None:
        self.start_serve()
        for rank in range(WORKERS):
            self.start_worker(rank, wait=False)
        for rank in range(WORKERS):
            self.wait_for(lambda r=rank: f"worker for rank {r} registered" in self.log("serve"),
                          f"rank {rank} to register", 120)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._sampling.wait(5.0):
            for key, p in list(self.procs.items()):
                if (got := rss_and_fds(p.pid)) is not None:
                    self.samples.rows.setdefault((key, p.pid), []).append((time.monotonic(), *got))

    # the jobs

    def out(self, name: str) -> Path:
        return self.state / name

    def record(self, name: str) -> dict[str, Any]:
        return read_json(self.out(name) / "job.json")

    def state_of(self, name: str) -> str:
        return str(self.record(name).get("state", ""))

    def running(self) -> list[tuple[str, list[int]]]:
        """The jobs RUNNING now, with the ranks of their attempt (from their records)."""
        found = []
        with contextlib.suppress(OSError):
            for d in self.state.iterdir():
                rec = read_json(d / "job.json")
                hist = rec.get("history") or []
                if rec.get("state") == "RUNNING" and hist and (m := re.search(r"on ranks \[([\d, ]*)\]",
                                                                              hist[-1]["message"])):
                    found.append((d.name, [int(r) for r in m[1].split(",") if r.strip()]))
        return found

    def run_round(self, prefix: str, steps: int, seconds: float, calm: bool,
                  between: Callable[[], None] | None = None, timeout: float = 900) -> list[str]:
        """One round's four jobs submitted (the LATE ones once the others have trained a step), `between`
        called while they run until it returns, then every job waited for to end; their names."""
        jobs = specs(prefix, steps, seconds, calm)
        early = [s for s in jobs if s["name"].split("-", 1)[1] not in LATE]
        for s in early:
            self.submit(s)
        self.wait_for(lambda: all(steps_of(self.out(s["name"])) or self.state_of(s["name"]) in ENDED for s in early),
                      f"round {prefix}'s first jobs to train", 240)
        for s in jobs:
            if s not in early:
                self.submit(s)
        if between is not None:
            between()
        names = [s["name"] for s in jobs]
        self.wait_for(lambda: all(self.state_of(n) in ENDED for n in names), f"round {prefix}'s jobs to end",
                      timeout)
        return names

    # the faults

    def strike(self, f: Fault) -> str:
        """One fault, and what was killed started again; what it was, in words ('' : nothing to strike)."""
        key = f"worker{f.rank}"
        if f.kind == "worker SIGKILL":
            _kill_group(self.procs.pop(key))
            self.start_worker(f.rank)
            return f"{f.kind} rank {f.rank}"
        if f.kind == "worker SIGTERM":
            daemon = self.procs.pop(key)
            os.kill(daemon.pid, signal.SIGTERM)  # the daemon alone, as the kubelet signals a container's first process
            try:
                code = daemon.wait(timeout=60)  # it checkpoints its job and leaves
            except subprocess.TimeoutExpired:
                _kill_group(daemon)
                raise SoakFailure(f"rank {f.rank} did not leave within 60 s of SIGTERM\n{self.log(key)[-1500:]}") from None
            if code != 0:
                raise SoakFailure(f"rank {f.rank} left with exit {code} on SIGTERM\n{self.log(key)[-1500:]}")
            self.start_worker(f.rank)
            return f"{f.kind} rank {f.rank}"
        if f.kind == "worker SIGSTOP":
            frozen = descendants(self.procs[key].pid)
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(f.hold_s)
            finally:
                for pid in frozen:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            return f"{f.kind} rank {f.rank} for {f.hold_s} s ({len(frozen)} processes)"
        if f.kind == "serve SIGKILL":
            _kill_group(self.procs.pop("serve"))
            self.start_serve()  # the workers register again by themselves
            return f.kind
        if f.kind == "partition":
            self.hosts.cut(1 + f.rank)
            try:
                time.sleep(f.hold_s)
            finally:
                self.hosts.mend(1 + f.rank)
            return f"{f.kind} of rank {f.rank}'s host for {f.hold_s} s"
        if f.kind == "disk full":
            filler = fill(self.state)
            try:
                time.sleep(f.hold_s)
            finally:
                filler.unlink()
            return f"{f.kind} for {f.hold_s} s"
        return self._corrupt(f)

    def _corrupt(self, f: Fault) -> str:
        """The newest committed checkpoint of a running job damaged (a byte of a stage's tensors flipped),
        then one of that job's workers killed: it resumes from the checkpoint before. Waits up to a minute for
        a job with two checkpoints to run ('' : none did)."""
        deadline = time.monotonic() + 60
        while not (what := self._corrupt_one(f)) and time.monotonic() < deadline:
            time.sleep(1.0)
        return what

    def _corrupt_one(self, f: Fault) -> str:
        for name, ranks in sorted(self.running(), key=lambda j: j[0]):
            steps = sorted(int(d.name.split("-")[1]) for d in (self.out(name) / "checkpoints").glob("step-*")
                           if (d / "MANIFEST.json").exists())
            if len(steps) < 2 or not ranks:
                continue
            newest = self.out(name) / "checkpoints" / f"step-{steps[-1]}"
            if newest in self.corrupted:  # damaged already: the job has not written a newer one yet
                continue
            target = newest / "stage-0.safetensors"
            with contextlib.suppress(OSError), target.open("r+b") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(size - 5)
                b = fh.read(1)
                fh.seek(size - 5)
                fh.write(bytes([b[0] ^ 0xFF]))
                self.corrupted.add(newest)
                rank = ranks[f.rank % len(ranks)]
                _kill_group(self.procs.pop(f"worker{rank}"))
                self.start_worker(rank)
                return f"{f.kind} {name} step-{steps[-1]}, then rank {rank} killed"
        return ""

    def strike_all(self, plan: list[Fault], t0: float, report: Report) -> None:
        """Each fault at its moment (or as soon as the one before is over)."""
        for f in plan:
            time.sleep(max(0.0, t0 + f.at_s - time.monotonic()))
            t = time.monotonic()
            what = self.strike(f)
            if what:
                report.faults[f.kind] = report.faults.get(f.kind, 0) + 1
                self.say(f"  {t - t0:6.1f}s {what}: over in {time.monotonic() - t:.1f}s")

    # the checks

    def check_job(self, name: str, twin: dict[str, Any], report: Report) -> None:
        """SUCCEEDED, the twin's bits, each resume from the newest checkpoint serve had heard of, every
        checkpoint on disk whole."""
        from safetensors.torch import load_file

        from gpipe.coordinator.outputs import checkpoint

        rec = self.record(name)
        hist = rec.get("history") or []
        if rec.get("state") != "SUCCEEDED":
            raise SoakFailure(f"job {name} ended {rec.get('state')}: {hist[-1]['message'] if hist else ''}")
        got = load_file(self.out(name) / "model.safetensors")
        if set(got) != set(twin):
            raise SoakFailure(f"job {name}'s weights are named {sorted(got)}, its twin's {sorted(twin)}")
        diff = max(float((got[k].double() - twin[k].double()).abs().max()) for k in twin)
        report.largest_difference = max(report.largest_difference, diff)
        if diff != 0.0:
            raise SoakFailure(f"job {name} ended {diff:g} from its calm twin's weights")
        report.attempts += int(rec.get("attempts", 0))
        report.preemptions += sum(h["state"] == "PREEMPTED" for h in hist)
        every = 3
        rows = steps_of(self.out(name))
        first_step = {}
        for a, s in rows:
            first_step.setdefault(a, s)
        attempt = 0
        heard = 0  # the newest checkpoint serve had heard of when the attempt before ended
        for h in hist:
            if h["state"] not in ("RUNNING", "PENDING"):  # RESTARTING, PREEMPTED: where it will resume from
                heard = max([heard, *map(int, re.findall(r"checkpoint step-(\d+)", h["message"]))])
            if h["state"] == "RUNNING" and h["message"].startswith("attempt "):
                attempt = int(h["message"].split()[1])
                if attempt in first_step and attempt > 1 and heard:
                    resumed = first_step[attempt]  # metrics' steps count from 0: resuming at step-N trains N first
                    damaged = self.out(name) / "checkpoints" / f"step-{heard}" in self.corrupted
                    if resumed < heard - (every if damaged else 0):
                        raise SoakFailure(f"job {name}'s attempt {attempt} resumed at step {resumed}, though "
                                          f"checkpoint step-{heard} was committed before it")
                    report.resumes_checked += 1
        for d in (self.out(name) / "checkpoints").glob("*"):
            if d in self.corrupted:
                continue
            if not re.fullmatch(r"step-\d+", d.name) or not (d / "MANIFEST.json").exists():
                raise SoakFailure(f"job {name}: {d.name} in its checkpoints is not a committed checkpoint")
            checkpoint.verify(d)

    def check_no_double_booking(self, names: list[str]) -> None:
        """From the records: no rank is in two jobs' attempts at once."""
        spans: list[tuple[float, float, str, int]] = []
        for name in names:
            hist = self.record(name).get("history") or []
            for i, h in enumerate(hist):
                m = re.search(r"on ranks \[([\d, ]*)\]", h["message"]) if h["state"] == "RUNNING" else None
                if m is None:
                    continue
                end = hist[i + 1]["time_unix"] if i + 1 < len(hist) else float("inf")
                spans += [(h["time_unix"], end, name, int(r)) for r in m[1].split(",") if r.strip()]
        for a in spans:
            for b in spans:
                if a[3] == b[3] and a[2] != b[2] and a[0] < b[1] and b[0] < a[1]:
                    raise SoakFailure(f"rank {a[3]} in two attempts at once: {a[2]} and {b[2]}")

    def processes(self, report: Report) -> None:
        """Each process's first and last sample, for those sampled over a minute or more: first, the sample of its
        first half holding the most descriptors (its start-up over, however slow under load; a leak grows past
        it in the second half)."""
        for (key, pid), rows in sorted(self.samples.rows.items()):
            if rows[-1][0] - rows[0][0] < 60:
                continue
            (_, r0, f0), (_, r1, f1) = max(rows[:max(1, len(rows) // 2)], key=lambda r: r[2]), rows[-1]
            report.processes.append(f"{key} (pid {pid}, {rows[-1][0] - rows[0][0]:.0f} s): RSS {r0 / 2**20:.0f} -> "
                                    f"{r1 / 2**20:.0f} MiB, fds {f0} -> {f1}")


@contextlib.contextmanager
def pool(root: Path, env: dict[str, str], say: Callable[[str], None] = print) -> Iterator[Soak]:
    """The soak's pool, started; everything it made ended after."""
    if (why := netns.skip_reason("sk")) is not None:
        raise SoakFailure(f"the soak needs network namespaces: {why}")
    with Soak(root, env, say) as s:
        s.start()
        yield s


def soak(root: Path, env: dict[str, str], *, seed: int, count: int, span_s: float, steps: int, seconds: float,
         hold_s: tuple[float, float], cut_s: float, say: Callable[[str], None] = print) -> Report:
    """The calm twins, then rounds of the four jobs under `count` faults over `span_s` seconds; the report."""
    from safetensors.torch import load_file

    plan = faults(seed, count, span_s, hold_s, cut_s)
    say(f"seed {seed}: {count} faults over {span_s:.0f} s: " + ", ".join(f.kind for f in plan))
    report = Report()
    t_start = time.monotonic()
    with pool(root, env, say) as s:
        calm = s.run_round("calm", steps, seconds, calm=True)
        for name in calm:
            if s.state_of(name) != "SUCCEEDED":
                raise SoakFailure(f"calm job {name} ended {s.state_of(name)}: {s.record(name)['history'][-1]}")
        twins = {n.split("-", 1)[1]: load_file(s.out(n) / "model.safetensors") for n in calm}
        say(f"  calm twins done in {time.monotonic() - t_start:.0f} s")
        t0 = time.monotonic()
        errors: list[BaseException] = []

        def strike() -> None:
            try:
                s.strike_all(plan, t0, report)
            except BaseException as e:  # noqa: BLE001  # said by the round's loop
                errors.append(e)

        striker = threading.Thread(target=strike, daemon=True)
        striker.start()
        names: list[str] = []
        while striker.is_alive() or not names:
            report.rounds += 1
            prefix = f"r{report.rounds}"
            names += s.run_round(prefix, steps, seconds, calm=False, timeout=max(900.0, span_s))
            for n in names[-4:]:
                s.check_job(n, twins[n.split("-", 1)[1]], report)
            say(f"  {time.monotonic() - t0:6.1f}s round {prefix}: every job SUCCEEDED on its twin's bits")
            if errors:
                raise errors[0]
        striker.join(timeout=120)
        if errors:
            raise errors[0]
        report.jobs = len(names)
        s.check_no_double_booking(names)
        s.processes(report)
    report.seconds = time.monotonic() - t_start
    return report
