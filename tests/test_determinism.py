"""`deterministic`: the spec's option reaches every stage's process, gpipe.Pipeline's turns it on for its
own, and neither changes the math (a CPU is deterministic as it is). What it buys on CUDA (the weights of one
GPU to the bit) is tests/test_gpu.py's; the torch releases gpipe supports are checked here too."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import gpipe
from tests import reference

ROOT = Path(__file__).resolve().parent.parent


def job(deterministic: bool, **kw) -> dict:
    spec = {
        "name": "d", "seed": 1, "model": {"factory": "tests.models:determinism_mlp", "args": {"expected": deterministic}},
        "stages": 2, "balance": [2, 3], "chunks": 2, "schedule": "1f1b",
        "data": {"factory": "random_regression", "args": {"n": 32, "in_features": 16, "out_features": 16},
                 "batch_size": 8},
        "loss": "mse", "optimizer": {"name": "sgd", "lr": 0.1}, "steps": 2, "max_restarts": 0,
        "probe": False,  # the plan's probe runs the model in the coordinator, which never sets it
        "deterministic": deterministic,
    }
    spec.update(kw)
    return spec


@pytest.mark.multiprocess
@pytest.mark.parametrize("deterministic", [True, False])
def test_the_specs_deterministic_reaches_every_stages_process_and_keeps_the_math(cli, deterministic):
    """Each stage's layers check their process's setting as they run (tests.models.determinism_mlp): with
    `deterministic: true` it is on in both workers, with false off; the weights are one device's either way."""
    spec = job(deterministic)
    cli.write(spec)
    r = cli.run("run", "job.yaml", "--state-dir", "st", "--no-progress", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    got = load_file(cli.tmp / "st" / "d" / "model.safetensors")
    want = reference.train(job(False))  # this process's setting is off
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6


def test_a_deterministic_that_is_not_a_boolean_is_refused_by_validate(cli):
    cli.write({**job(True), "deterministic": "sometimes"})
    r = cli.run("validate", "job.yaml")
    assert r.returncode == 2
    assert "deterministic" in r.stderr and "Traceback" not in r.stderr


DETERMINISTIC_PIPELINE = """
import os, torch, gpipe
from tests import models
assert not torch.are_deterministic_algorithms_enabled()
torch.manual_seed(0)
model = models.determinism_mlp(True)
pipe = gpipe.Pipeline(model, balance=[2, 3], chunks=2, deterministic=True)
pipe.step(torch.randn(4, 16), torch.randn(4, 16), torch.nn.functional.mse_loss)
pipe.close()
print(os.environ["CUBLAS_WORKSPACE_CONFIG"], torch.backends.cudnn.benchmark,
      torch.backends.cuda.matmul.fp32_precision)
"""


def test_a_deterministic_pipeline_turns_deterministic_algorithms_on_for_its_process():
    r = subprocess.run([sys.executable, "-c", DETERMINISTIC_PIPELINE], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [":4096:8", "False", "ieee"]


def test_a_pipeline_refuses_a_deterministic_that_is_not_a_boolean():
    with pytest.raises(ValueError, match="deterministic"):
        gpipe.Pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2)), balance=[1], deterministic="yes")


def test_gpipe_refuses_a_torch_older_than_it_supports_in_one_line():
    with pytest.raises(ImportError, match=r"torch 2\.11 to 2\.13.*torch 2\.10\.2") as e:
        gpipe._check_torch("2.10.2+cu128")
    assert "\n" not in str(e.value)
    for supported in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu"):
        gpipe._check_torch(supported)


def test_the_package_declares_a_torch_range_and_make_test_installs_the_tested_release():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_dep = next(d for d in deps if d.startswith("torch"))
    assert "==" not in torch_dep and ">=2.11" in torch_dep, torch_dep
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()
