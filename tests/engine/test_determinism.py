"""`deterministic`: the spec's option reaches every stage's process, gpipe.Pipeline's turns it on for its
own, and neither changes the math (a CPU is deterministic as it is). What it buys on CUDA (the weights of one
GPU to the bit) is tests/engine/test_gpu.py's; the torch releases gpipe supports are checked here too.

In process; the runs through real processes are in tests/service/test_determinism.py.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import gpipe

ROOT = Path(__file__).resolve().parents[2]


DETERMINISTIC_PIPELINE = """
import os, torch, gpipe
from tests.support import models
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
