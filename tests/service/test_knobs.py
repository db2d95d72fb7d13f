"""The knobs of a run: LR schedules end to end, and the job file's fields overridden on the command line."""

from __future__ import annotations

import pytest

from tests.support import reference
from tests.support.runs import train_and_compare
from tests.support.spec import TWO_STAGES, job

pytestmark = pytest.mark.multiprocess

LR_CASES = {
    "linear": job(TWO_STAGES, steps=6, optimizer={"name": "adam", "lr": 0.01},
                  lr_schedule={"name": "linear", "warmup_steps": 2, "min_lr": 0.001}),
    "wsd": job(TWO_STAGES, steps=8, optimizer={"name": "sgd", "lr": 0.1},
               lr_schedule={"name": "wsd", "warmup_steps": 2, "decay_fraction": 0.5, "decay_shape": "cosine",
                            "min_lr_ratio": 0.1}),
}


@pytest.mark.path
@pytest.mark.parametrize("name", list(LR_CASES))
def test_an_lr_schedule_equals_one_device(cli, name):
    spec = LR_CASES[name]
    lines = train_and_compare(cli, name, spec)
    lr = spec["optimizer"]["lr"]
    assert [m["lr"] for m in lines] == pytest.approx([lr * reference.lr_factor(spec, k) for k in range(spec["steps"])])
