"""The layers' costs as a run's workers see them: measured by one process per worker, all at once, each pinned.

gpipe.memory.costs times a layer in one process alone. In a run, the workers of one
host compute at the same time, each pinned to its share of the cores
(gpipe.worker.cores.split_cores, applied by gpipe.proc), and share what the cores
share: the last-level cache, the memory bandwidth, and whatever else runs on
the host. A pinned worker cannot move off a busy core; a process measuring
alone, unpinned, can. So the costs a run sees are measured under the same
conditions: one process per worker's core set, pinned to it, with its
threads, all starting together (a barrier), each measuring every layer
(gpipe.memory.costs.measure) and then running the layers again, as load, until
every one of them has finished its measurement. Each layer's cost is the
mean over the processes.

Then, together, the collectives the replicas run (`Collectives`): the
processes join a gloo group and time, at two sizes, a gradient bucket's
all-reduce as gpipe.worker.dataplane.reducer runs it (its gradients flattened into one
tensor, then summed) and the sharded optimizer's all-gather (gpipe.memory.zero);
and a bucket's all-reduce launched beside computation, as the reducer
launches all buckets but the last during the last backward: what it adds
there is less than its time alone, as far as gloo waits on the other ranks
rather than computing. So the replicas' step end costs what it costs on
this host's cores, not a constant bandwidth.

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
import statistics
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpipe.memory.costs import Cost, LayerCosts, Optimizer, measure
from gpipe.memory.zero import BUCKET_BYTES, GATHER_BYTES
from gpipe.show import first_line

TIMEOUT_S = 900.0  # the whole measurement, at most
SMALL = 4 << 10  # bytes: the small size the collectives are timed at (the large: a bucket, a gather's round)


@dataclass(frozen=True)
class Collectives:
    """Seconds of the replicas' collectives among `ranks` processes of this host, as lines in the bytes."""

    ranks: int
    all_reduce: Cost  # a bucket of that many bytes: flattened (torch.cat), then all-reduced
    all_gather: Cost  # each rank contributing that many bytes
    # what a bucket of BUCKET_BYTES adds when its all-reduce runs beside computation, as gpipe.worker.dataplane.reducer launches
    # the buckets but the last during the last backward (gloo waits on the other ranks without the core)
    overlapped: float = 0.0


def _timed(run: Any, repeats: int = 3) -> float:
    """The median seconds of `run()` over `repeats`, after one to warm up."""
    took = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        run()
        took.append(time.perf_counter() - t0)
    return statistics.median(took[1:])


def _collectives(store: str, rank: int, n: int) -> tuple[float, ...]:
    """(all-reduce seconds at SMALL and BUCKET_BYTES, all-gather at SMALL and GATHER_BYTES / n a rank, and what a
    bucket's all-reduce adds to computation it runs beside)."""
    dist.init_process_group("gloo", store=dist.FileStore(store, n), rank=rank, world_size=n,
                            timeout=timedelta(seconds=120))
    try:
        out = []
        for nbytes in (SMALL, BUCKET_BYTES):
            halves = [torch.ones(nbytes // 8), torch.ones(nbytes // 8)]  # float32: two gradients, one bucket
            out.append(_timed(lambda h=halves: dist.all_reduce(torch.cat(h))))
        for nbytes in (SMALL, GATHER_BYTES // n):
            mine = torch.ones(nbytes // 4)
            parts = [torch.empty_like(mine) for _ in range(n)]
            out.append(_timed(lambda m=mine, ps=parts: dist.all_gather(ps, m)))
        bucket = [torch.ones(BUCKET_BYTES // 8), torch.ones(BUCKET_BYTES // 8)]
        x = torch.ones(256, 256)
        t0 = time.perf_counter()
        x @ x
        rounds = max(1, int(out[1] / max(time.perf_counter() - t0, 1e-6)))  # computation as long as a bucket's sum

        def compute() -> None:
            for _ in range(rounds):
                x @ x

        def beside() -> None:
            work = dist.all_reduce(torch.cat(bucket), async_op=True)
            compute()
            assert work is not None
            work.wait()

        out.append(max(0.0, _timed(beside) - _timed(compute)))
        return tuple(out)
    finally:
        dist.destroy_process_group()


class _Sent:
    """What a measuring process is given (the model, its sample, the optimizer), pickled as the process starts, as
    its arguments are (the tensors in shared memory), but loaded there by `_received`: where loading fails (a
    module the fresh interpreter cannot import, a class that does not unpickle), the process says why in the
    one line the parent prints, instead of the interpreter's traceback before the process runs at all."""

    def __init__(self, value: Any):
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # Called while the process starts (its spawning Popen set): the tensors' descriptors go to that process.
        return _received, (bytes(ForkingPickler.dumps(self.value)),)


@dataclass(frozen=True)
class _Unloaded:
    why: str


def _received(data: bytes) -> Any:
    """In the measuring process: what `_Sent` pickled, or why it could not be loaded."""
    try:
        with warnings.catch_warnings():  # torch.fx's own deprecations, as it traces a GraphModule again
            warnings.simplefilter("ignore", FutureWarning)
            return ForkingPickler.loads(data)
    except Exception as e:
        return _Unloaded(first_line(e))


def _pinned(rank: int, sent: Any, cores: list[int], threads: int, sizes: tuple[int, int],
            repeats: int, start: Any, done: Any, n: int, store: str, out: Any) -> None:
    """One worker's measurement (the module's doc): pinned to `cores`, load until all `n` are done, then the
    collectives. `sent`: (model, sample, optimizer), as `_Sent` sent them."""
    try:
        if isinstance(sent, _Unloaded):
            raise _NotLoaded(f"loading the model there: {sent.why}")
        model, sample, optimizer = sent
        os.sched_setaffinity(0, cores)
        cpu = torch.device("cpu")
        start.wait(TIMEOUT_S)
        got: list[LayerCosts] | str = measure(model, sample, cpu, threads, sizes, repeats, optimizer)
    except Exception as e:  # said to the parent, which raises it
        got = str(e) if isinstance(e, _NotLoaded) else first_line(e)
        start.abort()
    with done.get_lock():
        done.value += 1
    out.put(got)
    if not isinstance(got, list):
        return
    while done.value < n:  # the neighbours still measure: compute as a worker would
        measure(model, sample, cpu, threads, sizes, 1, None, lambda: done.value < n)
    try:
        out.put(_collectives(store, rank, n))
    except Exception as e:
        out.put(f"the collectives: {first_line(e)}")


class _NotLoaded(Exception):
    """A measuring process could not load what it was sent."""


def measure_together(model: nn.Sequential, sample: Any, cores: Sequence[Sequence[int]], threads: Sequence[int],
                     sizes: tuple[int, int], repeats: int = 3,
                     optimizer: Optimizer = None) -> tuple[list[LayerCosts], Collectives]:
    """gpipe.memory.costs.measure on the CPU, in one process per core set of `cores` at once (each with its `threads`),
    each layer's costs the mean over them; and the collectives among them (the module's doc). RuntimeError when
    a process fails."""
    ctx = multiprocessing.get_context("spawn")
    n = len(cores)
    start, done, out = ctx.Barrier(n), ctx.Value("i", 0), ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gpipe-costs-") as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_pinned, name=f"costs-{k}", daemon=True,
                             args=(k, _Sent((model, sample, optimizer)), list(c), t, sizes, repeats, start, done, n,
                                   store, out))
                 for k, (c, t) in enumerate(zip(cores, threads, strict=True))]
        started = []
        try:
            for p in procs:
                p.start()
                started.append(p)
        except Exception as e:  # what it is sent does not pickle (a lambda in the model)
            for p in started:
                p.kill()
                p.join()
            raise RuntimeError(f"measuring the layers in {n} processes: sending them the model: {first_line(e)}") \
                from None
        got = _answers(procs, out, 2 * n)
    layers = [LayerCosts.mean(layer) for layer in zip(*(g for g in got if isinstance(g, list)), strict=True)]
    times = [g for g in got if isinstance(g, tuple)]
    r0, r1, g0, g1, o = (max(t[i] for t in times) for i in range(5))  # a collective ends with its slowest rank
    return layers, Collectives(n, Cost.fit(SMALL, r0, BUCKET_BYTES, r1), Cost.fit(SMALL, g0, GATHER_BYTES // n, g1),
                               o)


def _answers(procs: list[Any], out: Any, count: int) -> list[Any]:
    """`count` answers of `procs` from `out`; RuntimeError for one that failed (or none in time)."""
    n = len(procs)
    got: list[Any] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(got) < count:
            try:
                one = out.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                    ended = [f"{p.name} exited with code {p.exitcode}" for p in procs if p.exitcode]
                    why = f" ({', '.join(ended)})" if ended else f" in {TIMEOUT_S:.0f}s" if any(
                        p.is_alive() for p in procs) else ""
                    raise RuntimeError(f"measuring the layers in {n} processes: {len(got)} of {count} answers{why}")\
                        from None
                continue
            if isinstance(one, str):
                raise RuntimeError(f"measuring the layers in {n} processes: {one}")
            got.append(one)
    finally:  # each ends once every one has measured (its load stops); none is left behind
        for p in procs:
            p.join(30)
            p.kill()  # (nothing for one that ended)
            p.join()
    return got
