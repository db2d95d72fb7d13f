"""A job attempt's worker process: joins the RPC world and serves its stage.

The coordinator drives it over RPC with the functions below, a few calls per
step; tensors between stages go over the stage's own channels. The process
lives for one attempt only: a failed attempt's processes are killed, never
reused, since an RPC world or a communicator that saw a failure cannot be
trusted again.

    python -m worker --stage K --stages P --master HOST:PORT --host HOST
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from gpipe import net
from worker.stage import Stage, StageConfig

_stage: Stage | None = None
_jobs: queue.Queue[tuple[Any, ...] | None] = queue.Queue()


def _executor() -> None:
    """Runs queued steps one at a time, in order, off the RPC threads."""
    while (job := _jobs.get()) is not None:
        fut, args = job
        try:
            fut.set_result(_stage.step(*args))  # type: ignore[union-attr]
        except BaseException as e:
            traceback.print_exc()
            fut.set_result({"error": _describe(e)})


def _describe(e: BaseException) -> str:
    """One line for the coordinator: the error's type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def build_stage(cfg: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """RPC: build this process's stage (and join the stages' data plane)."""
    global _stage
    try:
        _stage = Stage(StageConfig(**cfg), state)
    except BaseException as e:
        traceback.print_exc()
        return {"error": _describe(e)}
    threading.Thread(target=_executor, name="stage-executor", daemon=True).start()
    return {"params": sum(p.numel() for p in _stage.layers.parameters()), "pid": os.getpid(),
            "threads": torch.get_num_threads()}


@rpc.functions.async_execution
def run_step(step: int, lr: float, inputs: list[torch.Tensor] | None,
             targets: list[torch.Tensor] | None, sizes: list[int]) -> torch.futures.Future:
    """RPC: queue one step; the returned future completes when its optimizer step is done.

    The coordinator sends step s+1 while step s runs, so a stage never waits for its inputs.
    """
    fut: torch.futures.Future = torch.futures.Future()
    _jobs.put((fut, (step, lr, inputs, targets, sizes)))
    return fut


def get_state() -> dict[str, torch.Tensor]:
    """RPC: the stage's weights on the CPU, under the full model's names."""
    return _stage.state()  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker")
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--master", required=True, help="the coordinator's rendezvous HOST:PORT")
    p.add_argument("--host", required=True, help="the address this process listens on")
    p.add_argument("--start-timeout", type=float, default=120.0)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="You are using a Backend")
    net.bind_to(a.host)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    opts = net.rpc_options(a.master, a.start_timeout)
    rpc.init_rpc(f"stage{a.stage}", rank=a.stage + 1, world_size=a.stages + 1, rpc_backend_options=opts)
    rpc.shutdown()  # waits until the coordinator is done with every stage
    _jobs.put(None)
    if _stage is not None:
        _stage.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
