"""The pool's policy under many random sequences: tests/control/test_pool_model.py's state machine, run long.

    python bench/pool_model.py [--sequences 10000] [--steps 40]

Prints how many sequences ran (each up to --steps rules: workers of mixed devices joining, leaving and coming
back, jobs of mixed sizes, priorities, devices and elastic bounds submitted, failing, finishing, preempted,
shrinking and growing back, serve restarted, the clock running), the decisions they carried out, and the first
violation of an invariant, if any (exit 1). CI runs a few hundred; this is the long run the note's figure
comes from.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from tests.control.test_pool_model import PoolModel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    count = 0
    tally: collections.Counter[str] = collections.Counter()

    class Counted(PoolModel):
        def __init__(self) -> None:
            nonlocal count
            count += 1
            super().__init__()
            self.tally = tally

    t = time.perf_counter()
    violated = ""
    try:
        run_state_machine_as_test(Counted, settings=settings(
            max_examples=a.sequences, stateful_step_count=a.steps, deadline=None, database=None,
            suppress_health_check=list(HealthCheck)))
    except AssertionError as e:  # the smallest failing sequence is printed above it
        violated = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    took = time.perf_counter() - t
    print(f"decisions carried out: {', '.join(f'{k} {v:,}' for k, v in sorted(tally.items()))}")
    outcome = f"an invariant violated: {violated}" if violated else "no invariant violated"
    print(f"{count:,} sequences of up to {a.steps} steps, {outcome} ({took:.0f} s)")
    sys.exit(1 if violated else 0)


if __name__ == "__main__":
    main()
