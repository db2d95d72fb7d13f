"""Mixed precision: bf16 equals one-device autocast, cuts carry half the bytes, fp16's one loss scale.

In process; the runs through real processes are in tests/service/test_precision.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from gpipe.coordinator.spec.job import parse_spec
from gpipe.errors import SpecError
from gpipe.precision import LossScaler, Precision
from gpipe.service import serde
from tests.support.spec import PRECISION, TWO_STAGES, job


@pytest.mark.parametrize(("changes", "field"), [
    ({"loss_scale": {"init": 1000.0}}, "loss_scale.init"),  # not a power of two
    ({"loss_scale": {"init": 2.0**30}}, "loss_scale.init"),
    ({"loss_scale": {"init": 0.5}}, "loss_scale.init"),
    ({"loss_scale": {"growth_interval": 0}}, "loss_scale.growth_interval"),
    ({"loss_scale": {"growth_interval": 2.0}}, "loss_scale.growth_interval"),
    ({"loss_scale": {"backoff": 0.5}}, "loss_scale.backoff"),
    ({"loss_scale": {"init": 1024.0}, "precision": "bf16"}, "loss_scale"),  # fp16's alone
])
def test_a_bad_loss_scale_is_named(changes, field):
    with pytest.raises(SpecError, match=f"^{field}: "):
        parse_spec(yaml.safe_dump({**job(TWO_STAGES, PRECISION, precision="fp16"), **changes}))
    assert parse_spec(yaml.safe_dump(job(TWO_STAGES, PRECISION, precision="fp16", loss_scale={"init": 1024.0}))).loss_scale.init == 1024


# -- the pieces, in process ---------------------------------------------------------------------------------

def test_the_loss_scaler_follows_grad_scalers_schedule():
    s = LossScaler()
    assert (s.scale, s.growth_tracker) == (2.0**16, 0)
    s.update(overflow=True)
    assert (s.scale, s.growth_tracker) == (2.0**15, 0)
    for _ in range(LossScaler.GROWTH_INTERVAL - 1):
        s.update(overflow=False)
    assert (s.scale, s.growth_tracker) == (2.0**15, LossScaler.GROWTH_INTERVAL - 1)
    s.update(overflow=False)
    assert (s.scale, s.growth_tracker) == (2.0**16, 0)
    s.update(overflow=False)
    s.update(overflow=True)  # an overflow starts the count again
    assert (s.scale, s.growth_tracker) == (2.0**15, 0)
    # torch's own scaler, step by step on the same outcomes
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**15, growth_interval=3)
    mine = LossScaler(2.0**15, 0, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for overflow in [False, False, False, True, False, False, False, False]:
        ref.scale(torch.ones(()))  # (GradScaler wants a scale() before unscale_)
        p.grad = torch.full((2,), float("inf") if overflow else 1.0) * ref.get_scale()
        ref.unscale_(opt)
        ref.step(opt)
        ref.update()
        grads = [torch.full((2,), float("inf") if overflow else 1.0) * mine.scale]
        assert mine.unscale(grads) == overflow
        if not overflow:
            assert torch.equal(grads[0], torch.ones(2))
        mine.update(overflow)
        assert mine.scale == ref.get_scale()


def test_the_loss_scaler_state_round_trips_and_bad_state_is_named():
    s = LossScaler(1024.0, 7)
    assert LossScaler.from_state(json.loads(json.dumps(s.state()))).state() == s.state()
    for bad, field in [({"scale": float("inf"), "growth_tracker": 0}, "loss_scale.scale"),
                       ({"scale": -1.0, "growth_tracker": 0}, "loss_scale.scale"),
                       ({"scale": 2.0, "growth_tracker": 10**6}, "loss_scale.growth_tracker"),
                       ({"scale": 2.0, "growth_tracker": 1.5}, "loss_scale.growth_tracker"),
                       ({"scale": 2.0}, "loss_scale"), ([1, 2], "loss_scale")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            LossScaler.from_state(bad)


def test_a_cut_casts_float32_only_and_keeps_the_graph():
    p = Precision("bf16", torch.device("cpu"))
    x = torch.ones(2, requires_grad=True)
    value = {"h": x * 2, "ids": torch.arange(3), "d": torch.ones(1, dtype=torch.float64), "m": torch.ones(1) > 0}
    cut = p.cut(value)
    assert cut["h"].dtype == torch.bfloat16 and cut["ids"].dtype == torch.int64
    assert cut["d"].dtype == torch.float64 and cut["m"].dtype == torch.bool
    cut["h"].backward(torch.ones(2, dtype=torch.bfloat16))
    assert x.grad is not None and x.grad.dtype == torch.float32  # the gradient comes back through the cast
    assert Precision("fp32", torch.device("cpu")).cut(value) is value
    assert p.for_loss(cut["h"]).dtype == torch.float32


def test_metrics_carry_the_loss_scale_over_grpc_and_old_lines_read_as_null():
    line = {"step": 3, "loss": 0.5, "lr": 0.1, "step_time_s": 0.01, "samples_per_s": 800.0,
            "bubble_fraction": 0.2, "attempt": 1, "stages": [{"stage": 0, "skipped": True}]}
    for extra in ({"loss_scale": 32768.0, "skipped": True}, {"loss_scale": None, "skipped": None}, {}):
        kind, back = serde.event_from_pb(serde.event_to_pb(("metrics", {**line, **extra})))
        assert kind == "metrics" and back["stages"] == line["stages"]
        assert (back["loss_scale"], back["skipped"]) == (extra.get("loss_scale"), extra.get("skipped"))
