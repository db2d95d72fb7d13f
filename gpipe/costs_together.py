"""The layers' costs as a run's workers see them: measured by one process per worker, all at once, each pinned.

gpipe.costs times a layer in one process alone. In a run, the workers of one
host compute at the same time, each pinned to its share of the cores
(worker.cores.split_cores, applied by gpipe.proc), and share what the cores
share: the last-level cache, the memory bandwidth, and whatever else runs on
the host. A pinned worker cannot move off a busy core; a process measuring
alone, unpinned, can. So the costs a run sees are measured under the same
conditions: one process per worker's core set, pinned to it, with its
threads, all starting together (a barrier), each measuring every layer
(gpipe.costs.measure) and then running the layers again, as load, until
every one of them has finished its measurement. Each layer's cost is the
mean over the processes.

Why not measure alone and scale by a factor: the slowdown differs by layer
(a GEMM whose weights fit in a core's cache loses little; one that streams
its weights from memory loses most), so one factor is wrong for some layers
of every model. Why every layer on every process, rather than each process
its own stage's: the search has not chosen the stages yet; what the
measurement needs is that the neighbours compute as workers do.

The processes are started with `spawn` (a fork of a process that ran torch's
OpenMP pool can hang in the child), and take the model and sample pickled.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpipe.costs import LayerCosts, Optimizer, measure

TIMEOUT_S = 900.0  # the whole measurement, at most


def _pinned(model: nn.Sequential, sample: Any, cores: list[int], threads: int, sizes: tuple[int, int],
            repeats: int, optimizer: Optimizer, start: Any, done: Any, n: int, out: Any) -> None:
    """One worker's measurement (the module's doc): pinned to `cores`, then load until all `n` are done."""
    try:
        os.sched_setaffinity(0, cores)
        cpu = torch.device("cpu")
        start.wait(TIMEOUT_S)
        got: list[LayerCosts] | str = measure(model, sample, cpu, threads, sizes, repeats, optimizer)
    except Exception as e:  # said to the parent, which raises it
        got = f"{type(e).__name__}: {e}"
        start.abort()
    with done.get_lock():
        done.value += 1
    out.put(got)
    while isinstance(got, list) and done.value < n:  # the neighbours still measure: compute as a worker would
        measure(model, sample, cpu, threads, sizes, 1, None, lambda: done.value < n)


def measure_together(model: nn.Sequential, sample: Any, cores: Sequence[Sequence[int]], threads: Sequence[int],
                     sizes: tuple[int, int], repeats: int = 3, optimizer: Optimizer = None) -> list[LayerCosts]:
    """gpipe.costs.measure on the CPU, in one process per core set of `cores` at once (each with its `threads`),
    each layer's costs the mean over them (the module's doc). RuntimeError when a process fails."""
    ctx = multiprocessing.get_context("spawn")
    n = len(cores)
    start, done, out = ctx.Barrier(n), ctx.Value("i", 0), ctx.Queue()
    procs = [ctx.Process(target=_pinned, name=f"costs-{k}", daemon=True,
                         args=(model, sample, list(c), t, sizes, repeats, optimizer, start, done, n, out))
             for k, (c, t) in enumerate(zip(cores, threads, strict=True))]
    for p in procs:
        p.start()
    got: list[list[LayerCosts]] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(got) < n:
            try:
                one = out.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                    raise RuntimeError(f"measuring the layers in {n} processes: {len(got)} answered") from None
                continue
            if isinstance(one, str):
                raise RuntimeError(f"measuring the layers in {n} processes: {one}")
            got.append(one)
    finally:  # each ends once every one has measured (its load stops); none is left behind
        for p in procs:
            p.join(30)
            p.kill()  # (nothing for one that ended)
            p.join()
    return [LayerCosts.mean(layer) for layer in zip(*got, strict=True)]
