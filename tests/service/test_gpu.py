"""`run` and serve on CUDA, real processes: a job on one GPU equals one GPU, and serve without a GPU trains a cuda
job on its worker's GPU. Marked `gpu` (skipped where torch sees no GPU; `make gpu-check` runs them);
gpipe.Pipeline on CUDA: tests/engine/test_gpu.py.
"""

from __future__ import annotations

import copy
import os

import pytest
import yaml
from safetensors.torch import load_file

from tests.support import reference
from tests.support.cuda import DEV, worst
from tests.support.spec import GPU, job

# cuBLAS reads its workspace setting when its first handle is made: before any test here runs a product.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.gpu






@pytest.mark.multiprocess
@pytest.mark.parametrize("chunks_per_worker", [1, 2], ids=["1-stage", "1-worker-2-model-chunks"])
def test_run_on_one_gpu_equals_one_gpu(cli, chunks_per_worker):
    """`gpipe-coordinator run` of a `device: cuda` job with one worker (one GPU): the weights of one GPU's
    training; with `deterministic`, to the bit."""
    # Schedules whose micro-batches' gradients add up in micro-batch order, as the reference's do (the gpipe
    # schedule's fill-drain backward adds them last to first: equal to float rounding, not to the bit).
    extra = {"schedule": "interleaved-1f1b", "virtual_stages": 2, "balance": [10, 9]} if chunks_per_worker == 2 \
        else {"schedule": "1f1b", "balance": [19]}
    spec = job(GPU, stages=1, device="cuda", optimizer={"name": "adam", "lr": 0.01}, clip_grad_norm=0.5,
               deterministic=True, **extra)
    (cli.tmp / "job.yaml").write_text(yaml.safe_dump(spec))
    r = cli.run("run", "job.yaml", "--state-dir", "st", "--no-progress", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = load_file(cli.tmp / "st" / "g" / "model.safetensors")
    from gpipe import determinism

    determinism.enable()
    want = reference.train(copy.deepcopy(spec), device=DEV)
    assert worst(got, want) == 0.0


@pytest.mark.multiprocess
def test_serve_without_a_gpu_trains_a_cuda_job_on_its_workers_gpu(tmp_path):
    """As on Kubernetes: serve (and so each attempt's coordinator) sees no GPU, the worker owns cuda:0; a
    `device: cuda` job submitted to it succeeds with one GPU's weights, to the bit with `deterministic`."""
    import signal
    import subprocess
    import sys
    import time

    from tests.support.ports import free_port

    spec = job(GPU, stages=1, balance=[19], device="cuda", schedule="1f1b", deterministic=True, max_restarts=0)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("GPIPE_OVERSUBSCRIBE", "CUDA_VISIBLE_DEVICES")}
    procs, logs = [], []

    def start(name: str, env: dict, *args: str) -> None:
        logs.append(tmp_path / f"{name}.log")
        with open(logs[-1], "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", *args], cwd=tmp_path, env=env, stdout=log,
                                          stderr=log, start_new_session=True))

    def wait_for(cond, what: str) -> None:
        deadline = time.monotonic() + 120
        while not cond():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}:\n" + "\n".join(p.read_text()[-2000:] for p in logs))
            time.sleep(0.1)

    try:
        start("serve", {**base, "CUDA_VISIBLE_DEVICES": ""}, "gpipe.coordinator.cli.main", "serve", "--port", str(port),
              "--state-dir", str(tmp_path / "s"))
        wait_for(lambda: "coordinator serving on" in logs[0].read_text(), "serve")
        start("worker", base, "gpipe.worker.daemon", "--rank", "0", "--device", "cuda:0", "--coordinator",
              f"127.0.0.1:{port}", "--log-dir", str(tmp_path / "w"))
        wait_for(lambda: "registered from" in logs[0].read_text(), "the worker")
        r = subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "submit", "job.yaml", "--follow",
                            "--no-progress", "--coordinator", f"127.0.0.1:{port}"], cwd=tmp_path, env=base,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:] + "\n".join(p.read_text()[-3000:] for p in logs)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    got = load_file(tmp_path / "s" / "g" / "model.safetensors")
    from gpipe import determinism

    determinism.enable()
    assert worst(got, reference.train(copy.deepcopy(spec), device=DEV)) == 0.0
