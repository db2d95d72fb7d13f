"""The soak (make soak): four jobs at once in one pool of six workers, each worker on a host of its own, through
seeded mixed faults over an hour; every job ends SUCCEEDED on its calm twin's bits (tests.support.soak says what
strikes and what is checked).

    sudo .venv/bin/python bench/soak.py [--minutes 60] [--faults 100] [--seed 1]

Needs root (network namespaces, a tmpfs for serve's state). Prints each fault as it lands, each round as it is
checked, then the report: faults by kind, rounds, jobs, attempts and preemptions, the largest weight difference
from the calm twins, and serve's and each worker's RSS and open descriptors, first and last. Exit 0 when every
check held, 1 with the one that did not. tests/service/test_soak.py is its five-minute version.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import soak  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=60.0, help="how long faults keep coming (default 60)")
    p.add_argument("--faults", type=int, default=100, help=f"how many ({len(soak.KINDS)} or more; default 100)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=120, help="each job's steps (default 120)")
    a = p.parse_args()
    if a.faults < len(soak.KINDS) or not 1 <= a.minutes <= 24 * 60:
        p.error(f"--faults must be {len(soak.KINDS)} or more and --minutes 1-1440")
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    root = Path(tempfile.mkdtemp(prefix="gpipe-soak-"))
    try:
        report = soak.soak(root, dict(os.environ), seed=a.seed, count=a.faults, span_s=a.minutes * 60,
                           steps=a.steps, seconds=0.02, hold_s=(1.0, 10.0), cut_s=20.0,
                           say=lambda line: print(line, flush=True))
    except soak.SoakFailure as e:
        print(f"soak FAILED (started {started}): {e}\nits logs and the jobs' records: {root}", flush=True)
        return 1
    shutil.rmtree(root, ignore_errors=True)
    print(f"soak (started {started}, seed {a.seed}):")
    print("\n".join(f"  {line}" for line in report.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
