"""A CPU worker's device is a set of cores: parse them, and split a machine's cores among local workers."""

from __future__ import annotations

import os

from gpipe.errors import GpipeError


def parse_cores(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8], each a core this process may use."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise GpipeError(f"--cores: {text!r} is not a list of cores such as 0-3,8") from None
    allowed = os.sched_getaffinity(0)
    if not cores or not cores <= allowed:
        raise GpipeError(f"--cores: {text!r} names cores outside {sorted(allowed)}")
    return sorted(cores)


def split_cores(workers: int, cores: list[int] | None = None) -> list[list[int]]:
    """Disjoint core sets, one per worker (shared round-robin when workers outnumber cores)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if workers > len(cores):
        return [[cores[k % len(cores)]] for k in range(workers)]
    per = len(cores) // workers
    return [cores[k * per : (k + 1) * per] for k in range(workers)]


def threads_for(cores: list[int]) -> int:
    """Threads for a stage on `cores`: one per core, or OMP_NUM_THREADS when the user sets it."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, len(cores))
