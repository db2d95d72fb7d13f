"""serve and gpipe-worker daemons as real processes (Service), and what the service tests read of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.support.cli import tagged_pids
from tests.support.ports import free_port


class Service:
    """serve and its workers as real processes, each in its own process group."""

    def __init__(self, cli, token: str | None = None, worker_token: str | None = None):
        self.cli, self.tmp, self.token, self.worker_token = cli, cli.tmp, token, worker_token
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.state = self.tmp / "state"
        self.procs: dict[str, subprocess.Popen] = {}
        # PYTHONPATH names the repository's root, where the tests' model factories live (tests.support.models): a
        # job that names its own modules next to its job.yaml still finds them only in the code it sent.
        self.env = dict(cli.env)
        self.tls: list[str] = []  # --tls-ca CERT, for clients and workers of a TLS serve
        if token:
            (self.tmp / "token").write_text(token + "\n")
        if worker_token:
            (self.tmp / "worker-token").write_text(worker_token + "\n")

    def _spawn(self, key: str, args: list[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{key}.log", "ab")
        p = subprocess.Popen([sys.executable, *args], cwd=self.tmp, env=self.env, stdout=log, stderr=log,
                             start_new_session=True)
        log.close()
        self.procs[key] = p
        return p

    def auth(self) -> list[str]:
        """A client's flags: the client token, TLS."""
        return (["--auth-token-file", str(self.tmp / "token")] if self.token else []) + self.tls

    def worker_auth(self) -> list[str]:
        """A worker's flags: the worker token, TLS."""
        return (["--worker-token-file", str(self.tmp / "worker-token")] if self.worker_token else []) + self.tls

    def serve_auth(self) -> list[str]:
        return ((["--auth-token-file", str(self.tmp / "token")] if self.token else [])
                + (["--worker-token-file", str(self.tmp / "worker-token")] if self.worker_token else []))

    def start_serve(self, *extra: str) -> None:
        before = self.log("serve").count("coordinator serving on")
        self._spawn("serve", ["-m", "gpipe.coordinator.cli.main", "serve", "--port", str(self.port),
                              "--state-dir", str(self.state), *self.serve_auth(), *extra])
        self.wait_for(lambda: self.log("serve").count("coordinator serving on") > before, "serve to start")

    def start_worker(self, rank: int, *extra: str) -> None:
        before = self.log("serve").count(f"worker for rank {rank} registered")
        cores = sorted(os.sched_getaffinity(0))
        self._spawn(f"worker{rank}", ["-m", "gpipe.worker.daemon", "--rank", str(rank), "--coordinator", self.address,
                                      "--cores", str(cores[rank % len(cores)]),
                                      "--log-dir", str(self.tmp / f"worker{rank}-attempts"), *self.worker_auth(),
                                      *extra])
        self.wait_for(lambda: self.log("serve").count(f"worker for rank {rank} registered") > before,
                      f"rank {rank} to register")

    def kill(self, key: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs.pop(key)
        with_suppress(lambda: os.killpg(p.pid, sig))
        p.wait(timeout=30)

    def log(self, key: str) -> str:
        path = self.tmp / f"{key}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for(self, cond, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.05)
        logs = "\n".join(f"--- {k}\n{self.log(k)[-2000:]}" for k in self.procs)
        pytest.fail(f"timed out waiting for {what}\n{logs}")

    def client(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.cli.run(*args, "--coordinator", self.address, *self.auth(), timeout=timeout)

    def stop_all(self) -> None:
        for key in list(self.procs):
            self.kill(key)


def with_suppress(fn) -> None:
    try:
        fn()
    except ProcessLookupError:
        pass


ENDED = ("SUCCEEDED", "FAILED", "STOPPED")


def steps_of(out) -> list[tuple[int, int]]:
    """(attempt, step) of every logged step."""
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    return [(m["attempt"], m["step"]) for m in map(yaml.safe_load, lines)]



def worker_pid(tag: str, stage: int) -> int | None:
    """The attempt process serving `stage`: the one whose output goes to that stage's log."""
    for pid in tagged_pids(tag):
        try:
            log = os.readlink(f"/proc/{pid}/fd/2")
        except OSError:
            continue
        if log.endswith((f"/stage-{stage}.log", f"-stage-{stage}.log")):
            return pid
    return None

