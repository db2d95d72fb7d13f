"""BatchNorm through `run`: the pipelined job equals one device, and a deferred job resumed mid-way ends as
uninterrupted. A Stage in process: tests/engine/test_batchnorm.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.support import reference
from tests.support.batchnorm import compare, counts, figures
from tests.support.local import attempt_secret, built, plan_of, run, weights_of  # noqa: F401  (autouse)
from tests.support.spec import BATCHNORM, ONE_STAGE, job

# Real processes: per-micro-batch statistics here; whole-batch (deferred) ones in the resumed job below. Every
# schedule x checkpointing x deferral runs through gpipe.Pipeline in tests/engine/test_pipeline.py.
MULTI = {
    # three stages, the last micro-batch kept, uneven micro-batches (10 = 3+3+2+2)
    "3stages-1f1b-except_last": job(ONE_STAGE, BATCHNORM, stages=3, chunks=4, schedule="1f1b", activation_checkpoint="except_last"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(MULTI))
def test_pipelined_batch_norm_equals_one_device(cli, name):
    spec = {**MULTI[name], "name": "bn"}
    r = cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress")
    assert r.returncode == 0, r.stderr
    got = load_file(cli.tmp / "state" / "bn" / "model.safetensors")
    tracked, calls = counts(spec)
    assert int(got["1.num_batches_tracked"]) == tracked and int(got["3.calls"]) == calls
    want = reference.train(spec)
    worst = compare(got, want)
    print(f"{name}: {figures(got, want)}")
    assert worst <= 1e-5, f"{name}: differs from one device by {worst}"


@pytest.mark.multiprocess
def test_a_job_with_deferred_batch_norm_resumed_mid_way_ends_as_uninterrupted(cli):
    # Two stages, all forwards then all backwards, every forward recomputed: resumed from step 4 of 6.
    spec = {**job(ONE_STAGE, BATCHNORM, stages=2, deferred_batch_norm=True, activation_checkpoint="always", steps=6),
            "name": "bn", "checkpoint_every": 2, "keep_checkpoints": 2}
    path, state = cli.write(spec), cli.tmp / "state"
    r = cli.run("run", str(path), "--state-dir", str(state), "--no-progress")
    assert r.returncode == 0, r.stderr
    out = state / "bn"
    want = load_file(out / "model.safetensors")
    shutil.rmtree(out / "checkpoints" / "step-6")
    (out / "model.safetensors").unlink()
    r = cli.run("run", str(path), "--state-dir", str(state), "--no-progress", "--resume")
    assert r.returncode == 0, r.stderr
    assert "bn: resuming from checkpoint step-4 " in r.stderr
    got = load_file(out / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)  # bit for bit
    assert compare(got, reference.train(spec)) <= 1e-5
