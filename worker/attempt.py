"""A job attempt's worker process: joins the RPC world and serves its stage.

The coordinator drives it over RPC with the functions below, a few calls per
step; tensors between stages go over the stage's own channels. The process
lives for one attempt only: a failed attempt's processes are killed, never
reused, since an RPC world or a communicator that saw a failure cannot be
trusted again.

    python -m gpipe.worker --stage K --stages P --master HOST:PORT --host HOST
"""

from __future__ import annotations

import argparse
import importlib
import os
import threading
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from gpipe import net
from gpipe.worker.stage import Stage, StageConfig

_stage: Stage | None = None


class _StepQueue:
    """Steps by number, handed out strictly in order.

    RPCs are served by a thread pool, so run_step(s+1) may arrive before
    run_step(s); the stage must still run s first.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._steps: dict[int, tuple[torch.futures.Future, tuple[Any, ...]]] = {}
        self._next = 0
        self._closed = False

    def start_at(self, step: int) -> None:
        with self._cv:
            self._next = step

    def put(self, step: int, fut: torch.futures.Future, args: tuple[Any, ...]) -> None:
        with self._cv:
            self._steps[step] = (fut, args)
            self._cv.notify_all()

    def take(self) -> tuple[torch.futures.Future, tuple[Any, ...]] | None:
        with self._cv:
            self._cv.wait_for(lambda: self._closed or self._next in self._steps)
            if self._closed:
                return None
            job = self._steps.pop(self._next)
            self._next += 1
            return job

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


_steps = _StepQueue()


def _executor() -> None:
    """Runs the queued steps one at a time, in step order, off the RPC threads."""
    while (job := _steps.take()) is not None:
        fut, (*args, snapshot) = job
        try:
            result = _stage.step(*args)  # type: ignore[union-attr]
            if snapshot:
                # Between steps, before the next one changes anything: the stall a checkpoint costs.
                t0 = time.perf_counter()
                result["snapshot"] = _stage.snapshot()  # type: ignore[union-attr]
                result["snapshot_s"] = time.perf_counter() - t0
            fut.set_result(result)
        except BaseException as e:
            traceback.print_exc()
            fut.set_result({"error": _describe(e)})


def _describe(e: BaseException) -> str:
    """One line for the coordinator: the error's type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def build_stage(cfg: dict[str, Any], state: dict[str, torch.Tensor], first_step: int = 0,
                resume: dict[str, Any] | None = None) -> dict[str, Any]:
    """RPC: build this process's stage (and join the stages' data plane); steps start at first_step.

    `state` holds the weights; `resume`, when resuming from a checkpoint, the
    optimizer and RNG state (see Stage.snapshot).
    """
    global _stage
    _steps.start_at(first_step)
    try:
        _stage = Stage(StageConfig(**cfg), state, resume)
    except BaseException as e:
        traceback.print_exc()
        return {"error": _describe(e)}
    threading.Thread(target=_executor, name="stage-executor", daemon=True).start()
    return {"params": sum(p.numel() for p in _stage.layers.parameters()), "pid": os.getpid(),
            "threads": torch.get_num_threads()}


@rpc.functions.async_execution
def run_step(step: int, lr: float, inputs: list[torch.Tensor] | None,
             targets: list[torch.Tensor] | None, sizes: list[int], snapshot: bool = False) -> torch.futures.Future:
    """RPC: queue one step; the returned future completes when its optimizer step is done.

    The coordinator sends step s+1 while step s runs, so a stage never waits for its inputs.
    With `snapshot`, the answer also carries a copy of the stage's state after
    the step (for a checkpoint), taken before the next step starts.
    """
    fut: torch.futures.Future = torch.futures.Future()
    _steps.put(step, fut, (step, lr, inputs, targets, sizes, snapshot))
    return fut


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpipe.worker")
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
    # Building the optimizer imports torch._dynamo (1.5 s on a CPU build): import it while the RPC world forms.
    threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True).start()
    opts = net.rpc_options(a.master, a.start_timeout)
    rpc.init_rpc(f"stage{a.stage}", rank=a.stage + 1, world_size=a.stages + 1, rpc_backend_options=opts)
    rpc.shutdown()  # waits until the coordinator is done with every stage
    _steps.close()
    if _stage is not None:
        _stage.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
