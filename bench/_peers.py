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


PEER_SCHEDULES = {  # ours: (the peer's class name, its placement of 4 model chunks: None for one stage per rank)
    "gpipe": ("ScheduleGPipe", None),
    "1f1b": ("Schedule1F1B", None),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


def pipelining(schedule: str, rank: int, width: int, depth: int, batch: int, chunks: int, steps: int,
               port: int) -> float:
    """torch.distributed.pipelining on 2 ranks, gloo: the same split as gpipe's balance, or for the schedules of
    several stages per rank, 4 equal chunks (rank r holds r and r+2, or r and 3-r in ZBV's V)."""
    import torch.distributed as dist
    from torch.distributed import pipelining as pp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = mlp(width=width, depth=depth, head=False)
    name, placement = PEER_SCHEDULES[schedule]
    cls = getattr(pp, name)
    if placement is None:
        half = (len(model) + 1) // 2
        part = model[:half] if rank == 0 else model[half:]
        held, parts = [rank], [part]
        sched = cls(pp.PipelineStage(part, rank, 2, torch.device("cpu")), chunks, loss_fn=F.mse_loss)
    else:
        n = len(model)
        held = [rank, rank + 2] if placement == "loop" else [rank, 3 - rank]
        parts = [model[i * n // 4:(i + 1) * n // 4] for i in held]
        stages = [pp.PipelineStage(part, i, 4, torch.device("cpu")) for part, i in zip(parts, held, strict=True)]
        sched = cls(stages, chunks, loss_fn=F.mse_loss)
    last = 3 if placement is not None else 1
    opt = torch.optim.SGD([p for part in parts for p in part.parameters()], lr=1e-3)
    x, y = data(width, batch)
    times = []
    for _ in range(steps + WARMUP):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        args = (x,) if 0 in held else ()
        kwargs = {"target": y, "losses": []} if last in held else {}
        sched.step(*args, **kwargs)
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
