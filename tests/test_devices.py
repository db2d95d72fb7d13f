"""The worker owns its device: it checks it before registering, the coordinator never asks CUDA, and no two
workers share a GPU (NCCL refuses that). None of these needs a GPU: CUDA_VISIBLE_DEVICES='' hides any, and
GPIPE_FAKE_GPUS (worker.device's test hook) makes the probe report some."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from gpipe.errors import EXIT_BAD_INPUT, SpecError
from tests.ports import free_port
from worker.device import FAKE_GPUS_ENV, VISIBLE_ENV

JOB = {
    "name": "gpus", "model": {"factory": "mlp", "args": {"width": 8, "depth": 3}}, "stages": 2, "chunks": 2,
    "data": {"factory": "random_regression", "args": {"n": 16, "in_features": 8, "out_features": 8}, "batch_size": 4},
    "loss": "mse", "optimizer": {"name": "sgd", "lr": 0.1}, "steps": 2, "device": "cuda", "max_restarts": 0,
}


def one_error_line(stderr: str, starts: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(starts) and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("device, env, names", [
    ("cuda:0", {VISIBLE_ENV: ""}, ["no GPU", f"{VISIBLE_ENV}=''"]),
    ("cuda:1", {FAKE_GPUS_ENV: "1"}, ["cuda:1", "1 GPU(s)"]),
    ("tpu", {}, ["'tpu'", "cpu nor cuda:K"]),
    ("cuda", {}, ["'cuda'", "cpu nor cuda:K"]),
])
def test_a_worker_refuses_a_device_it_does_not_have_before_it_registers(tmp_path, device, env, names):
    with socket.socket() as coordinator:  # where it would register: it must never connect
        coordinator.bind(("127.0.0.1", 0))
        coordinator.listen()
        coordinator.setblocking(False)
        r = subprocess.run([sys.executable, "-m", "worker.daemon", "--rank", "0", "--device", device,
                            "--coordinator", f"127.0.0.1:{coordinator.getsockname()[1]}", "--log-dir", str(tmp_path)],
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        with pytest.raises(BlockingIOError):
            coordinator.accept()
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    line = one_error_line(r.stderr, "gpipe-worker: error: --device: ")
    assert all(n in line for n in names), line


def test_the_coordinator_takes_each_workers_registered_device_and_never_asks_cuda(monkeypatch):
    import torch

    from coordinator.attempt import device_for
    from coordinator.run import worker_gpus
    from coordinator.spec import parse_spec

    def poisoned(*args, **kwargs):
        raise AssertionError("the coordinator asked CUDA")

    for name in ("is_available", "device_count", "init", "get_device_properties", "current_device"):
        monkeypatch.setattr(torch.cuda, name, poisoned)
    cuda, cpu = parse_spec(yaml.safe_dump(JOB)), parse_spec(yaml.safe_dump({**JOB, "device": "cpu"}))
    assert device_for(cuda, "cuda:3", 3) == "cuda:3"  # as registered, whatever the rank
    assert device_for(cpu, "cuda:3", 3) == "cpu"  # a cpu job runs on the CPU of a GPU's worker
    with pytest.raises(SpecError, match="rank 1's worker registered 'cpu'"):
        device_for(cuda, "cpu", 1)
    # run counts the GPUs through the probe process: worker k sees GPU k alone.
    monkeypatch.setenv(FAKE_GPUS_ENV, "2")
    monkeypatch.delenv(VISIBLE_ENV, raising=False)
    gpus = worker_gpus(cuda)
    assert [env for _, env in gpus] == [{VISIBLE_ENV: "0"}, {VISIBLE_ENV: "1"}]
    assert [g.uuid for g, _ in gpus if g is not None] == ["GPU-fake-0", "GPU-fake-1"]
    assert not torch.cuda.is_initialized()


def test_each_local_worker_gets_its_own_gpu_from_the_visible_list():
    from coordinator.run import gpu_envs

    assert gpu_envs(3, None) == [{VISIBLE_ENV: "0"}, {VISIBLE_ENV: "1"}, {VISIBLE_ENV: "2"}]
    assert gpu_envs(2, "5, 7,3") == [{VISIBLE_ENV: "5"}, {VISIBLE_ENV: "7"}]
    assert gpu_envs(1, "GPU-8b3df5bc") == [{VISIBLE_ENV: "GPU-8b3df5bc"}]
    with pytest.raises(SpecError, match="names 1 GPU"):
        gpu_envs(2, "4")


def run_cli(tmp_path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("GPIPE_OVERSUBSCRIBE", FAKE_GPUS_ENV, VISIBLE_ENV)}
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], cwd=tmp_path,
                          env={**base, **env}, capture_output=True, text=True, timeout=180)


@pytest.mark.multiprocess
def test_run_refuses_a_cuda_job_with_fewer_gpus_than_workers_whatever_oversubscribe_says(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(JOB))
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
    path.write_text(yaml.safe_dump(JOB))
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
        start("serve", "coordinator.cli", "serve", "--port", str(port), "--state-dir", str(tmp_path / "s"))
        wait_for(lambda: "coordinator serving on" in logs[0].read_text(), "serve", logs)
        for rank in (0, 1):  # both on GPU 0 of this host (the fake GPU-fake-0)
            start(f"worker{rank}", "worker.daemon", "--rank", str(rank), "--device", "cuda:0",
                  "--coordinator", address, "--log-dir", str(tmp_path / f"w{rank}"))
        wait_for(lambda: logs[0].read_text().count("registered from") == 2, "both workers", logs)
        assert "(cuda:0: fake GPU 0, 0.0 GiB)" in logs[0].read_text()
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(JOB))
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
