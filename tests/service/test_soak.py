"""The soak's five-minute version (tests.support.soak): four jobs at once in one pool of six workers, each on a
host of its own, through 15 seeded faults of every kind (worker SIGKILL, SIGTERM and SIGSTOP, serve SIGKILL, a
host cut off, serve's disk full, a damaged newest checkpoint); every job ends SUCCEEDED on its calm twin's bits,
each resume from the newest checkpoint serve had heard of, no checkpoint half-written, no rank in two attempts at
once, and serve's and the workers' descriptors flat. The hour: bench/soak.py (make soak).

GPIPE_SOAK_SEED=N picks the faults; -s prints each fault and the report:
    for s in 1 2 3 4 5; do GPIPE_SOAK_SEED=$s .venv/bin/pytest -q -s tests/service/test_soak.py || break; done
"""

from __future__ import annotations

import os
import re

import pytest

from tests.support import netns, soak

SEED = int(os.environ.get("GPIPE_SOAK_SEED", "2911"))


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)  # the calm twins, then the faulty rounds until 15 faults have landed, on 2 loaded cores
def test_four_jobs_through_fifteen_mixed_faults_end_on_their_calm_twins_bits(cli) -> None:
    if (why := netns.skip_reason("sk")) is not None:
        pytest.skip(why)
    report = soak.soak(cli.tmp / "soak", cli.env, seed=SEED, count=15, span_s=150.0, steps=60, seconds=0.02,
                       hold_s=(1.0, 6.0), cut_s=10.0)
    print("\n".join(report.lines()))
    assert sum(report.faults.values()) >= 14 and set(report.faults) == set(soak.KINDS), report.faults
    assert report.largest_difference == 0.0 and report.attempts > report.jobs and report.preemptions > 0
    for line in report.processes:  # a process sampled a minute or more: its descriptors flat
        fds = re.search(r"fds (\d+) -> (\d+)", line)
        assert fds is not None and int(fds[2]) <= int(fds[1]) + 16, line
