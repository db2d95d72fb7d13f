"""gpipe.grad_in_place in the service's real processes: a GPT-2 whose tied embedding/head (16 MiB) and MLP weights
reach IN_PLACE_BYTES, trained through `gpipe-coordinator run` under a split backward (zb-h1) and on two
replicas, equals one device. In process, every schedule: tests/engine/test_grad_in_place.py."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from gpipe import grad_in_place
from tests.support import models
from tests.support.lm import fresh, one_device_job
from tests.support.spec import GPT2, job

pytest.importorskip("transformers")

ARGS = {"vocab": 4096, "width": 1024, "layers": 2, "heads": 4}  # the tied weight 4096 x 1024 float32: 16 MiB


@pytest.mark.multiprocess
@pytest.mark.parametrize(("schedule", "replicas"), [("zb-h1", 1), ("1f1b", 2)])
def test_a_gpt2_with_large_weights_equals_one_device(cli, schedule, replicas):
    assert ARGS["vocab"] * ARGS["width"] * 4 >= grad_in_place.IN_PLACE_BYTES  # the in-place gradients are taken
    # 4 micro-batches of 2 in all (2 a replica with 2 replicas): the one-device reference's.
    spec = job(GPT2, steps=2, schedule=schedule, replicas=replicas, chunks=4 // replicas, model__args=ARGS,
               model__split_points=["transformer.h.1"])
    r = cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr
    got = load_file(cli.tmp / "state" / "t" / "model.safetensors")
    want = one_device_job(2, fresh(models.gpt2, **ARGS))
    worst = max((got[k] - want[k]).abs().max().item() for k in got)
    assert worst <= 1e-5, f"weights differ from one device by {worst}"
