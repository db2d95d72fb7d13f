"""How far bf16 pipelined training drifts from plain one-device autocast, and how far autocast itself is from fp32.

    python bench/bf16_drift.py                  # the test Transformer LM, 2 stages, AdamW lr 1e-3: about a minute
    python bench/bf16_drift.py --steps 1 3 10

The job: tests.support.models' tiny_lm (vocabulary 97, width 32, 4 encoder layers, no dropout) on random next-token
pairs, batches of 8 in 2 micro-batches, cut [3, 4] (after the positional-encoding sum and an encoder layer: values
one-device autocast keeps in float32, which the pipeline rounds to bf16 at the cut). For each step count it trains
four ways, all through tests/support/reference.py: gpipe.Pipeline in bf16 (the pipeline), one device under autocast
with the same values rounded at the cuts (the rounded reference), one device under plain autocast, and one device
in fp32. It prints the largest weight difference of the pipeline from the rounded reference (0: the promise) and
from plain autocast, beside plain autocast's own from fp32: the cut's rounding against the precision's own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import reference  # noqa: E402

SPEC = {"model": {"factory": "tests.support.models:tiny_lm",
                  "args": {"vocab": 97, "d_model": 32, "layers": 4, "dropout": 0.0}},
        "data": {"factory": "tests.support.models:token_pairs", "args": {"n": 64, "length": 12}, "batch_size": 8},
        "loss": "cross_entropy", "optimizer": {"name": "adamw", "lr": 0.001}, "chunks": 2, "precision": "bf16"}
CUTS = [3, 4]


def worst(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 3, 10])
    args = ap.parse_args()
    print("steps | pipeline vs rounded reference | pipeline vs plain autocast | plain autocast vs fp32")
    for steps in args.steps:
        spec = {**SPEC, "steps": steps}
        piped = reference.train(spec, cuts=CUTS, pipelined=True)
        rounded = reference.train(spec, cuts=CUTS)
        plain = reference.train(spec)
        fp32 = reference.train({**spec, "precision": "fp32"})
        print(f"{steps} | {worst(piped, rounded):.2e} | {worst(piped, plain):.2e} | {worst(plain, fp32):.2e}")


if __name__ == "__main__":
    main()
