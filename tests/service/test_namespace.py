"""One import name: a job's folder may hold files named like the product's own parts (worker.py,
coordinator.py, tests/, gpipe_utils.py, v1.py), and `run` still trains it, equal to one device. Under serve:
tests/service/test_service.py's travelling job carries the same files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.support import reference
from tests.support.spec import TWO_STAGES, job

pytestmark = pytest.mark.multiprocess

# Each fails loudly if anything of ours imports it in place of our own module.
SHADOWS = {name: f'raise ImportError("the job\'s own {name} was imported in place of gpipe\'s")\n'
           for name in ("worker.py", "coordinator.py", "gpipe_utils.py", "v1.py", "tests/__init__.py")}

MODEL = '''"""The job's own model and data."""
from gpipe.builtins import mlp, random_regression


def model():
    return mlp(width=16, depth=3)


def dataset():
    return random_regression(n=40, in_features=16, out_features=16)
'''


def shadowed_folder(root: Path, name: str) -> tuple[Path, dict]:
    """A job folder with files named like the product's parts beside its own model module; the job file, and
    the same job with the builtin factories (the one-device reference's)."""
    folder = root / name
    for file, text in SHADOWS.items():
        (folder / file).parent.mkdir(parents=True, exist_ok=True)
        (folder / file).write_text(text)
    module = f"own_{name.replace('-', '_')}_{os.getpid()}"
    (folder / f"{module}.py").write_text(MODEL)
    want = job(TWO_STAGES, name=name, model={"factory": "mlp", "args": {"width": 16, "depth": 3}}, steps=3)
    spec = {**want, "model": {"factory": f"{module}:model"}, "data": {**want["data"], "factory": f"{module}:dataset",
                                                                      "args": {}}}
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    want["data"] = {**want["data"], "factory": "random_regression",
                    "args": {"n": 40, "in_features": 16, "out_features": 16}}
    return folder / "job.yaml", want


@pytest.mark.parametrize("where", ["job-folder", "elsewhere"])
def test_run_trains_a_job_whose_folder_holds_the_product_s_names(cli, where):
    path, want = shadowed_folder(cli.tmp, "shadowed")
    # From the job's folder too: the working directory is never put ahead of the product's modules.
    cwd = path.parent if where == "job-folder" else cli.tmp
    env = {k: v for k, v in cli.env.items() if k != "PYTHONPATH"}  # the job's folder is its code
    r = subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "run", str(path), "--state-dir",
                        str(cli.tmp / "state"), "--no-progress"], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    got = load_file(cli.tmp / "state" / "shadowed" / "model.safetensors")
    ref = reference.train(want)
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5
