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


@pytest.mark.multiprocess
def test_activations_are_counted_on_the_first_every_nth_and_last_steps_and_every_step_when_split(cli):
    """activation_meter_every: 4 of 6 steps: steps 0, 4 and 5 count (the same bytes each: the same shapes), the
    others' lines say null; zb-h1, whose B lets go through the count's handles, counts on every step, the
    same bytes whether asked every step or not."""
    def lines(schedule: str, every: int) -> list[list[int | None]]:
        spec = job(name="a", stages=STAGES, balance=[2, 2], chunks=4, schedule=schedule, steps=6,
                   activation_meter_every=every)
        state = cli.tmp / f"{schedule}-{every}"
        r = cli.run("run", str(cli.write(spec)), "--state-dir", str(state), "--no-progress")
        assert r.returncode == 0, r.stderr
        rows = [json.loads(x) for x in (state / "a" / "metrics.jsonl").read_text().splitlines()]
        return [[s["activation_peak_bytes"] for s in row["stages"]] for row in rows]

    sampled = lines("1f1b", 4)
    assert [all(v is None for v in row) for row in sampled] == [False, True, True, True, False, False]
    counted = [row for row in sampled if row[0] is not None]
    assert all(row == counted[0] for row in counted) and all(v > 0 for v in counted[0])
    assert lines("1f1b", 1) == [counted[0]] * 6
    split = lines("zb-h1", 4)
    assert all(v is not None and v > 0 for row in split for v in row)
