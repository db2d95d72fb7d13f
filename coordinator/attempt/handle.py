"""The driver's end of a stage (a handle): build it, step it, evaluate, pull its snapshot, ask what it does.

Every call answers with a torch future, completed with what the stage's
server (gpipe.worker.stage_server.StageServer) returned: its figures, a StepResult,
an EvalResult, a piece of its state, or the StageError it failed with. The
driver (gpipe.coordinator.attempt.driver) waits on them under its own deadlines, whatever
runs the stage:

- `RRefStage`: a StageServer on a worker, through its RRef (torch RPC): the
  service and `run`, one stage per worker process, c10d between them;
- `LocalStage`: a StageServer in this process, called directly, its stage
  linked to the others in memory (gpipe.transport.Hub): the driver's loop,
  checkpoints and evaluation tested without a process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from gpipe.stream import Piece

if TYPE_CHECKING:
    import torch.distributed.rpc as rpc

    from gpipe.coordinator.plan.job import Plan
    from gpipe.worker.stage_server import StageServer

Future = torch.futures.Future[Any]


class StageHandle(Protocol):
    """One stage, as the driver sees it (the StageServer's calls; see its module for what each answers)."""

    def expect(self, declared: dict[str, tuple[str, list[int]]]) -> Future: ...

    def receive(self, pieces: list[Piece]) -> Future: ...

    def start(self, json_state: dict[str, Any] | None, weights_sent: bool) -> Future: ...

    def run_step(self, step: int, lr: float, inputs: list[Any] | None, targets: list[Any] | None,
                 sizes: list[int], snapshot: bool) -> Future: ...

    def run_eval(self, position: int, batch: int, inputs: list[Any] | None, targets: list[Any] | None,
                 sizes: list[int], weights: bool) -> Future: ...

    def activity(self, timeout: float) -> Future: ...

    def snapshot_piece(self, step: int, index: int) -> Future: ...

    def drop_snapshot(self, step: int) -> Future: ...


class RRefStage:
    """A StageServer on a worker, through its RRef. Building calls wait at most `start_timeout`, pieces of a
    snapshot `step_timeout`; a step or an eval batch has no RPC timeout: the driver's deadlines bound it."""

    def __init__(self, rref: rpc.RRef[StageServer], start_timeout: float, step_timeout: float):
        self.rref, self.start_timeout, self.step_timeout = rref, start_timeout, step_timeout

    def expect(self, declared: dict[str, tuple[str, list[int]]]) -> Future:
        return _rpc(self.rref.rpc_async(timeout=self.start_timeout).expect(declared))

    def receive(self, pieces: list[Piece]) -> Future:
        return _rpc(self.rref.rpc_async(timeout=self.start_timeout).receive(pieces))

    def start(self, json_state: dict[str, Any] | None, weights_sent: bool) -> Future:
        return _rpc(self.rref.rpc_async(timeout=self.start_timeout).start(json_state, weights_sent))

    def run_step(self, step: int, lr: float, inputs: list[Any] | None, targets: list[Any] | None,
                 sizes: list[int], snapshot: bool) -> Future:
        return _rpc(self.rref.rpc_async(timeout=0).run_step(step, lr, inputs, targets, sizes, snapshot))

    def run_eval(self, position: int, batch: int, inputs: list[Any] | None, targets: list[Any] | None,
                 sizes: list[int], weights: bool) -> Future:
        return _rpc(self.rref.rpc_async(timeout=0).run_eval(position, batch, inputs, targets, sizes, weights))

    def activity(self, timeout: float) -> Future:
        return _rpc(self.rref.rpc_async(timeout=timeout).activity())

    def snapshot_piece(self, step: int, index: int) -> Future:
        return _rpc(self.rref.rpc_async(timeout=self.step_timeout).snapshot_piece(step, index))

    def drop_snapshot(self, step: int) -> Future:
        return _rpc(self.rref.rpc_async(timeout=self.step_timeout).drop_snapshot(step))


def _rpc(answer: Any) -> Future:
    """An RPC's answer, as torch's untyped proxies (and the async_execution decorator) return it."""
    return cast(Future, answer)


def _now(call: Callable[[], Any]) -> Future:
    """A future completed with call()'s value, or with the exception it raised (as an RPC's would be)."""
    fut: Future = torch.futures.Future()
    try:
        fut.set_result(call())
    except Exception as e:
        fut.set_exception(e)
    return fut


class LocalStage:
    """A StageServer in this process, called directly: what would cross torch RPC is passed by reference."""

    def __init__(self, server: StageServer):
        self.server = server

    def expect(self, declared: dict[str, tuple[str, list[int]]]) -> Future:
        return _now(lambda: self.server.expect(declared))

    def receive(self, pieces: list[Piece]) -> Future:
        return _now(lambda: self.server.receive(pieces))

    def start(self, json_state: dict[str, Any] | None, weights_sent: bool) -> Future:
        return _now(lambda: self.server.start(json_state, weights_sent))

    def run_step(self, step: int, lr: float, inputs: list[Any] | None, targets: list[Any] | None,
                 sizes: list[int], snapshot: bool) -> Future:
        return _rpc(self.server.run_step(step, lr, inputs, targets, sizes, snapshot))

    def run_eval(self, position: int, batch: int, inputs: list[Any] | None, targets: list[Any] | None,
                 sizes: list[int], weights: bool) -> Future:
        return _rpc(self.server.run_eval(position, batch, inputs, targets, sizes, weights))

    def activity(self, timeout: float) -> Future:
        return _now(self.server.activity)

    def snapshot_piece(self, step: int, index: int) -> Future:
        return _now(lambda: self.server.snapshot_piece(step, index))

    def drop_snapshot(self, step: int) -> Future:
        return _now(lambda: self.server.drop_snapshot(step))


def local_stages(plan: Plan, first_step: int = 0, device: str = "cpu") -> list[StageHandle]:
    """Every rank's stage (every model chunk's) of `plan` in this process, each on its executor thread, linked in
    memory; by rank (slot: gpipe.topology).

    What `run` and the service run in worker processes over torch RPC and c10d, without them: the same
    stage servers, the same driver (tests; close them with StageServer.close_all()).
    """
    from gpipe.coordinator.plan.configs import stage_config
    from gpipe.rng import SharedGenerators
    from gpipe.transport import Hub
    from gpipe.turns import Turns
    from gpipe.worker.stage_server import StageServer

    spec, workers = plan.spec, plan.spec.topology
    slots = workers.model_chunks()  # a stage per model chunk; with virtual stages, a worker's take turns
    hub, rng = Hub(slots.model_chunks, slots.replicas, spec.step_timeout_s), SharedGenerators()
    turns = {rank: Turns() for rank in workers.ranks()} if spec.virtual_stages > 1 else {}
    handles: list[StageHandle] = []
    for slot in slots.slots():
        g, replica = slots.model_chunk_of(slot), slots.replica_of(slot)
        cfg = stage_config(plan, g, replica, device, "", 0)
        server = StageServer(asdict(cfg), None, first_step, transport=hub.transport(g, replica, torch.device(device)),
                             shared_rng=rng, turns=turns.get(workers.worker_of(slot)))
        handles.append(LocalStage(server))
    return handles
