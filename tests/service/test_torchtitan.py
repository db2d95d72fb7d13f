"""torchtitan's style (its blocks in an nn.ModuleDict) through `run`, real processes over gloo, against one device.
In process: tests/engine/test_torchtitan.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import models
from tests.support.lm import fresh, lm_loss
from tests.support.spec import job

TITAN = job(name="titan", seed=0, stages=2, chunks=2, model={"factory": "tests.support.models:titan", "args": {}},
            data={"factory": "tests.support.models:token_pairs", "args": {"n": 16}, "batch_size": 4, "shuffle": False},
            loss="cross_entropy", optimizer={"name": "sgd", "lr": 0.1}, steps=2)


@pytest.mark.multiprocess
def test_a_model_with_its_blocks_in_a_module_dict_runs_cut_at_them_and_equals_one_device(cli):
    from safetensors.torch import load_file

    from tests.support.cli import torch_threads

    r = cli.run("run", str(cli.write(TITAN)), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=120)
    assert r.returncode == 0, r.stderr
    got = load_file(cli.tmp / "state" / "titan" / "model.safetensors")
    with torch_threads(1):
        want = fresh(models.titan)
        x, y = models.token_pairs(n=16)[:]
        opt = torch.optim.SGD(want.parameters(), lr=0.1)
        for step in range(2):
            xs, ys = x[step * 4:(step + 1) * 4], y[step * 4:(step + 1) * 4]
            for xm, ym in zip(xs.chunk(2), ys.chunk(2), strict=True):
                (lm_loss(want(xm), ym) * xm.size(0) / 4).backward()
            opt.step()
            opt.zero_grad()
    assert set(got) == set(want.state_dict())
    worst = max((got[k] - v).abs().max().item() for k, v in want.state_dict().items())
    assert worst <= 1e-6, f"weights differ from one device by {worst}"
