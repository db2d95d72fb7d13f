"""model.weights through validate: a file that does not fit is exit 2 and one line. In process:
tests/control/test_weights.py.
"""

from __future__ import annotations

import pytest

from tests.support.lm import _drop, _edit, pretrained_gpt2
from tests.support.local import close_stages, drive, live_copies, plan_of, worst  # noqa: F401  # close_stages: a fixture
from tests.support.spec import GPT2, job

pytest.importorskip("transformers")








@pytest.mark.multiprocess
def test_validate_refuses_a_bad_file_with_exit_2_and_one_line(cli):
    pretrained_gpt2(cli.tmp / "pre")
    _edit(cli.tmp / "pre" / "model.safetensors", cli.tmp / "bad.safetensors", _drop)
    spec = job(GPT2, model__weights="bad.safetensors")  # beside the job file
    r = cli.run("validate", str(cli.write(spec)))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "transformer.h.1.mlp.c_fc.weight" in lines[0] and "Traceback" not in r.stderr
