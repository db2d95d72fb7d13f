"""The peers gpipe is measured against, one process each (run by bench/step_time.py).

    python bench/_peers.py single   WIDTH DEPTH BATCH CHUNKS STEPS
    python bench/_peers.py pipelining SCHEDULE RANK WIDTH DEPTH BATCH CHUNKS STEPS PORT

Each prints the median step time in seconds on its last line.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from gpipe.builtins import mlp

WARMUP = 3


def data(width: int, batch: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def single(width: int, depth: int, batch: int, chunks: int, steps: int) -> float:
    """One process doing the same micro-batched work as the pipeline."""
    torch.manual_seed(0)
    model = mlp(width=width, depth=depth, head=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = data(width, batch)
    times = []
    for _ in range(steps + WARMUP):
        t0 = time.perf_counter()
        opt.zero_grad()
        for xm, ym in zip(x.tensor_split(chunks), y.tensor_split(chunks), strict=True):
            (F.mse_loss(model(xm), ym) * len(xm) / batch).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


def pipelining(schedule: str, rank: int, width: int, depth: int, batch: int, chunks: int, steps: int,
               port: int) -> float:
    """torch.distributed.pipelining on 2 stages, gloo, the same split as gpipe's balance."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = mlp(width=width, depth=depth, head=False)
    half = (len(model) + 1) // 2
    part = model[:half] if rank == 0 else model[half:]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, chunks, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=1e-3)
    x, y = data(width, batch)
    times = []
    for _ in range(steps + WARMUP):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return statistics.median(times[WARMUP:])


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    kind, *args = sys.argv[1:]
    if kind == "single":
        print(single(*map(int, args)))
    else:
        print(pipelining(args[0], *map(int, args[1:])))
