"""Devices through the CLI and serve: run refuses a cuda job with fewer GPUs than workers, validate checks a
machine's GPUs, serve fails a job whose workers share one GPU. The worker's and coordinator's checks in
process: tests/control/test_devices.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gpipe.errors import EXIT_BAD_INPUT
from gpipe.worker.device import FAKE_GPUS_ENV, VISIBLE_ENV
from tests.support.cli import one_error_line
from tests.support.ports import free_port
from tests.support.spec import CUDA, job_yaml


def run_cli(tmp_path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("GPIPE_OVERSUBSCRIBE", FAKE_GPUS_ENV, VISIBLE_ENV)}
    return subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", *args], cwd=tmp_path,
                          env={**base, **env}, capture_output=True, text=True, timeout=180)


@pytest.mark.multiprocess
def test_run_refuses_a_cuda_job_with_fewer_gpus_than_workers_whatever_oversubscribe_says(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(job_yaml(CUDA))
    r = run_cli(tmp_path, {VISIBLE_ENV: ""}, "run", str(path))  # no GPU at all: device: cpu is the way
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    line = one_error_line(r.stderr, "error: device: cuda")
    assert "no GPU" in line and f"{VISIBLE_ENV}=''" in line and "device: cpu" in line, line
    assert "oversubscribe" not in line, line
    for extra in ([], ["--oversubscribe"]):
        r = run_cli(tmp_path, {FAKE_GPUS_ENV: "1"}, "run", str(path), *extra)
        assert r.returncode == EXIT_BAD_INPUT, r.stderr
        line = one_error_line(r.stderr, "error: replicas: 2 workers")
        assert "1 GPU(s)" in line and "never a GPU" in line, line
    assert not (tmp_path / "gpipe-state").exists()  # nothing started


@pytest.mark.multiprocess
def test_validate_checks_the_gpus_of_a_machine_that_has_some(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(job_yaml(CUDA))
    r = run_cli(tmp_path, {FAKE_GPUS_ENV: "1"}, "validate", str(path))
    assert r.returncode == EXIT_BAD_INPUT and "2 workers" in r.stderr and "1 GPU(s)" in r.stderr, r.stderr
    r = run_cli(tmp_path, {FAKE_GPUS_ENV: "2"}, "validate", str(path))
    assert r.returncode == 0 and "a GPU each of this machine's 2" in r.stdout, r.stdout + r.stderr
    r = run_cli(tmp_path, {VISIBLE_ENV: ""}, "validate", str(path))  # a laptop checking a cluster's job
    assert r.returncode == 0 and "not checked against GPUs" in r.stdout, r.stdout + r.stderr


def wait_for(cond, what: str, logs: list, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}:\n" + "\n".join(p.read_text()[-2000:] for p in logs if p.exists()))


@pytest.mark.multiprocess
def test_serve_fails_a_cuda_job_whose_workers_share_one_gpu_and_status_shows_each_workers_device(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    env = {**{k: v for k, v in os.environ.items() if k != VISIBLE_ENV}, FAKE_GPUS_ENV: "1"}
    procs, logs = [], []

    def start(name: str, *args: str) -> None:
        logs.append(tmp_path / f"{name}.log")
        with open(logs[-1], "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", *args], cwd=tmp_path, env=env, stdout=log,
                                          stderr=log, start_new_session=True))

    try:
        start("serve", "gpipe.coordinator.cli.main", "serve", "--port", str(port), "--state-dir", str(tmp_path / "s"))
        wait_for(lambda: "coordinator serving on" in logs[0].read_text(), "serve", logs)
        for rank in (0, 1):  # both on GPU 0 of this host (the fake GPU-fake-0)
            start(f"worker{rank}", "gpipe.worker.daemon", "--rank", str(rank), "--device", "cuda:0",
                  "--coordinator", address, "--log-dir", str(tmp_path / f"w{rank}"))
        wait_for(lambda: logs[0].read_text().count("registered from") == 2, "both workers", logs)
        assert "(cuda:0: fake GPU 0, 0.0 GiB)" in logs[0].read_text()
        path = tmp_path / "job.yaml"
        path.write_text(job_yaml(CUDA))
        r = run_cli(tmp_path, env, "submit", str(path), "--follow", "--no-progress", "--coordinator", address)
        assert r.returncode == 1, r.stderr  # FAILED, at placement: no attempt started
        status = run_cli(tmp_path, env, "status", "gpus", "--coordinator", address).stdout
        error = next(line for line in status.splitlines() if line.startswith("error:"))
        assert "ranks 0 and 1 share one GPU" in error and "NCCL" in error, status
        assert "attempts: 0" in status, status
        for rank in (0, 1):
            assert f"rank {rank}: " in status and "cuda:0, fake GPU 0, 0.0 GiB" in status, status
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
