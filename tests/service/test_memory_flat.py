"""A long run's memory through `run`: a language model's workers peak no higher after warm-up, and as predicted.

The job is the kind that climbed (docs/memory.md, a peak that climbs over the steps): a GPT-2 whose vocabulary
(GPT-2's, 50257) makes its embedding's gradient, adam's temporaries of it and a micro-batch's logits blocks of
24 MiB, a good share of a glibc heap, with evaluations and checkpoints between the steps. bench/memory_flat.py
runs the same for 300 steps."""

from __future__ import annotations

import json

import pytest

from tests.support.spec import DELETE, GPT2, job

WARM = 5  # steps: the optimizer's state appears after the first, the heaps settle
STEPS = 40
TOKENS = {"factory": "tests.support.models:token_pairs", "args": {"n": 64, "length": 63, "vocab": 50257},
          "batch_size": 8}

FLAT = job(GPT2, name="flat", steps=STEPS, log_every=1, checkpoint_every=10, activation_checkpoint=DELETE,
           model__args={"vocab": 50257, "width": 128, "layers": 4, "heads": 4},
           data={**TOKENS, "shuffle": True}, eval={"data": TOKENS, "every": 10, "batches": 2},
           optimizer={"name": "adamw", "lr": 1e-3, "weight_decay": 0.01}, clip_grad_norm=1.0)


@pytest.mark.multiprocess
def test_a_language_models_workers_peak_stays_flat_after_warm_up_and_within_a_fifth_of_the_prediction(cli):
    """40 steps, an evaluation and a checkpoint every 10: each worker's peak (its process's resident peak, each
    step's peak_memory_bytes) after step 5 within 5% of its value at step 5, and the prediction (plan.json)
    within 20% of the run's peak."""
    path = cli.write(FLAT)
    r = cli.run("run", str(path), "--state-dir", str(cli.tmp / "st"), "--no-progress", timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    out = cli.tmp / "st" / "flat"
    peaks: dict[int, list[int]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        for s in json.loads(line).get("stages", []):
            peaks.setdefault(s["rank"], []).append(s["peak_memory_bytes"])
    predicted = {w["rank"]: w["predicted_peak_bytes"] for w in json.loads((out / "plan.json").read_text())["workers"]}
    assert sorted(peaks) == [0, 1] and all(len(v) == STEPS for v in peaks.values())
    for rank, steps in sorted(peaks.items()):
        warm, end = steps[WARM - 1], steps[-1]
        print(f"rank {rank}: peak {warm / 2**20:.1f} MiB at step {WARM}, {end / 2**20:.1f} at step {STEPS} "
              f"({end / warm:.3f}); predicted {predicted[rank] / 2**20:.1f} ({predicted[rank] / end:.3f})")
        assert end <= 1.05 * warm, steps
        assert 0.8 <= predicted[rank] / end <= 1.2
