"""The worker owns its device: it checks it before registering, the coordinator never asks CUDA, and no two
workers share a GPU (NCCL refuses that). None of these needs a GPU: CUDA_VISIBLE_DEVICES='' hides any, and
GPIPE_FAKE_GPUS (gpipe.worker.device's test hook) makes the probe report some.

In process; the runs through real processes are in tests/service/test_devices.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from gpipe.errors import EXIT_BAD_INPUT, SpecError
from gpipe.worker.device import FAKE_GPUS_ENV, VISIBLE_ENV
from tests.support.cli import one_error_line
from tests.support.spec import CUDA, job_yaml


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
        r = subprocess.run([sys.executable, "-m", "gpipe.worker.daemon", "--rank", "0", "--device", device,
                            "--coordinator", f"127.0.0.1:{coordinator.getsockname()[1]}", "--log-dir", str(tmp_path)],
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        with pytest.raises(BlockingIOError):
            coordinator.accept()
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    line = one_error_line(r.stderr, "gpipe-worker: error: --device: ")
    assert all(n in line for n in names), line


def test_the_coordinator_takes_each_workers_registered_device_and_never_asks_cuda(monkeypatch):
    import torch

    from gpipe.coordinator.attempt.process import device_for
    from gpipe.coordinator.cli.run import worker_gpus
    from gpipe.coordinator.spec.job import parse_spec

    def poisoned(*args, **kwargs):
        raise AssertionError("the coordinator asked CUDA")

    for name in ("is_available", "device_count", "init", "get_device_properties", "current_device"):
        monkeypatch.setattr(torch.cuda, name, poisoned)
    cuda, cpu = parse_spec(job_yaml(CUDA)), parse_spec(job_yaml(CUDA, device="cpu"))
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
    from gpipe.coordinator.cli.run import gpu_envs

    assert gpu_envs(3, None) == [{VISIBLE_ENV: "0"}, {VISIBLE_ENV: "1"}, {VISIBLE_ENV: "2"}]
    assert gpu_envs(2, "5, 7,3") == [{VISIBLE_ENV: "5"}, {VISIBLE_ENV: "7"}]
    assert gpu_envs(1, "GPU-8b3df5bc") == [{VISIBLE_ENV: "GPU-8b3df5bc"}]
    with pytest.raises(SpecError, match="names 1 GPU"):
        gpu_envs(2, "4")
