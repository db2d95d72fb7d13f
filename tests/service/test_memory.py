"""Activation memory, counted exactly: 1f1b and checkpointing hold what they promise.

These are byte counts (autograd's saved tensors and the stashed micro-batches),
not timings, so they are the same on every run and belong in tests.
"""

from __future__ import annotations

import json

import pytest

from tests.support import reference
from tests.support.spec import job

STAGES, CHUNKS = 2, 8


def peaks(cli, **kw) -> list[int]:
    spec = job(name="m", model={"factory": "tests.support.models:tiny_lm", "args": {"d_model": 32, "layers": 4}},
               stages=STAGES, balance=[4, 3], chunks=CHUNKS,
               data={"factory": "tests.support.models:tokens", "args": {"n": 64, "seq": 16}, "batch_size": 32},
               loss="cross_entropy", **kw)
    r = cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / kw["schedule"]), "--no-progress")
    assert r.returncode == 0, r.stderr
    out = cli.tmp / kw["schedule"] / "m"
    # Every mode trains the same weights.
    from safetensors.torch import load_file

    got, want = load_file(out / "model.safetensors"), reference.train(spec)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    return [s["activation_peak_bytes"] for s in last["stages"]]


@pytest.mark.multiprocess
def test_1f1b_and_checkpointing_bound_activation_memory(cli):
    gpipe = peaks(cli, schedule="gpipe")
    one_f_one_b = peaks(cli, schedule="1f1b")
    always = peaks(cli, schedule="gpipe", activation_checkpoint="always")
    print(f"activation peak bytes per stage: gpipe {gpipe}, 1f1b {one_f_one_b}, gpipe+always {always}")
    for k in range(STAGES):
        # Stage k keeps at most stages-k micro-batches in flight instead of all of them.
        assert one_f_one_b[k] <= gpipe[k] * (STAGES - k) / CHUNKS * 1.1
        # Recomputation keeps only each micro-batch's input (and one live forward).
        assert always[k] <= 0.4 * gpipe[k]
