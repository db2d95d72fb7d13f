"""`deterministic` through `run` and validate: it reaches every stage's process and keeps the math, and a value
that is not a boolean is refused. gpipe.Pipeline's setting: tests/engine/test_determinism.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from safetensors.torch import load_file

from tests.support import reference
from tests.support.spec import job, regression


def determinism(on: bool) -> dict[str, Any]:
    """The `deterministic` tests' preset: layers that check their process's setting is `on` as they run
    (tests.support.models:determinism_mlp); no probe (it runs the model in the coordinator, which never sets it)."""
    return {"name": "d", "seed": 1, "balance": [2, 3], "schedule": "1f1b", "data": regression(32, 16, 8),
            "model": {"factory": "tests.support.models:determinism_mlp", "args": {"expected": on}},
            "max_restarts": 0, "probe": False, "deterministic": on}


@pytest.mark.multiprocess
@pytest.mark.parametrize("deterministic", [True, False])
def test_the_specs_deterministic_reaches_every_stages_process_and_keeps_the_math(cli, deterministic):
    """Each stage's layers check their process's setting as they run (tests.support.models.determinism_mlp): with
    `deterministic: true` it is on in both workers, with false off; the weights are one device's either way."""
    spec = job(determinism(deterministic))
    cli.write(spec)
    r = cli.run("run", "job.yaml", "--state-dir", "st", "--no-progress", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    got = load_file(cli.tmp / "st" / "d" / "model.safetensors")
    want = reference.train(job(determinism(False)))  # this process's setting is off
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6


def test_a_deterministic_that_is_not_a_boolean_is_refused_by_validate(cli):
    cli.write({**job(determinism(True)), "deterministic": "sometimes"})
    r = cli.run("validate", "job.yaml")
    assert r.returncode == 2
    assert "deterministic" in r.stderr and "Traceback" not in r.stderr
