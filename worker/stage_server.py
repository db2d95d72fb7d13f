"""A stage as an RPC object: the coordinator creates it remotely and drives it through its RRef.

    rref = rpc.remote("stage1", StageServer, args=(cfg, None))      # builds the stage's layers on its worker
    rref.rpc_async(timeout=...).receive(pieces)                      # its weights, a piece at a time (init exact)
    rref.rpc_async(timeout=...).start(json_state, weights_sent)      # its figures, or a StageError
    rref.rpc_async(timeout=0).run_step(step, lr, inputs, targets, sizes, snapshot)   # a StepResult
    rref.rpc_async(timeout=...).snapshot_piece(step, i)              # the checkpoint's copy, a piece at a time
    rref.rpc_async(timeout=0).run_eval(position, batch, inputs, targets, sizes, weights)  # an EvalResult

A StageServer owns its Stage, the queue of steps (and eval batches) it was
sent, and the thread that runs them one at a time, in order, off the RPC
threads. A failure comes back as a gpipe.contract.StageError (its cause, type,
first line, rank, stage, replica and step), with the traceback also in the
worker's log, so the coordinator names the stage in one line and the
supervisor decides by fields.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed.rpc as rpc

from gpipe import determinism
from gpipe.contract import EvalResult, StageConfig, StageError, StepResult
from gpipe.eval_schedule import EvalSchedule
from gpipe.memory import meter as memory
from gpipe.memory import zero
from gpipe.rng import SharedGenerators
from gpipe.stage import Stage, build_layers
from gpipe.state import StageState
from gpipe.stream import Piece
from gpipe.transport import Transport
from gpipe.turns import TurnAborted, Turns
from gpipe.worker.dataplane.c10d import C10dTransport
from gpipe.worker.state_stream import Incoming, Outbox, Outgoing

StepArgs = tuple[int, float, list[Any] | None, list[Any] | None, list[int], bool]
Answer = torch.futures.Future[StepResult | EvalResult | StageError]


@dataclass(frozen=True)
class EvalArgs:
    """One eval batch: its number, its micro-batches' inputs (first stage) or targets (last), their sizes,
    and whether to hand back the stage's weights with the answer."""

    batch: int
    inputs: list[Any] | None
    targets: list[Any] | None
    sizes: list[int]
    weights: bool


class StepQueue:
    """Steps by number, with the eval batches due before each, handed out strictly in order.

    RPCs are served by a thread pool, so run_step(s+1) may arrive before
    run_step(s), or before the eval batches due after step s; the stage must
    still run them in order. Work at position p (p steps done) is keyed (p, i):
    the eval batches due at p are i = 0 .. n-1 (n = `evals(p)`), and step p is i = n.
    """

    def __init__(self, first: int = 0, evals: Callable[[int], int] = lambda p: 0) -> None:
        self._cv = threading.Condition()
        self._items: dict[tuple[int, int], tuple[Answer, StepArgs | EvalArgs]] = {}
        self._evals = evals
        self._next = (first, 0)
        self._closed = False

    def put(self, step: int, fut: Answer, args: StepArgs) -> None:
        self._put((step, self._evals(step)), fut, args)

    def put_eval(self, position: int, batch: int, fut: Answer, args: EvalArgs) -> None:
        """Eval batch `batch` of the evaluation after `position` steps; ValueError if none such is due."""
        if not 0 <= batch < self._evals(position):
            raise ValueError(f"no eval batch {batch} is due after {position} steps")
        self._put((position, batch), fut, args)

    def _put(self, key: tuple[int, int], fut: Answer, args: StepArgs | EvalArgs) -> None:
        with self._cv:
            self._items[key] = (fut, args)
            self._cv.notify_all()

    def take(self) -> tuple[Answer, StepArgs | EvalArgs] | None:
        """The next step or eval batch in order, waiting for it; None once closed."""
        with self._cv:
            self._cv.wait_for(lambda: self._closed or self._next in self._items)
            if self._closed:
                return None
            position, i = self._next
            job = self._items.pop(self._next)
            self._next = (position, i + 1) if i < self._evals(position) else (position + 1, 0)
            return job

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class StageServer:
    """One stage of an attempt, living on its worker for the attempt's life (see the module's docstring)."""

    # The stages this process serves, closed when it leaves the RPC world (close_all).
    live: ClassVar[list[StageServer]] = []

    def __init__(self, cfg: dict[str, Any], weights: dict[str, torch.Tensor] | None, first_step: int = 0,
                 resume: StageState | None = None, transport: Transport | None = None,
                 shared_rng: SharedGenerators | None = None, turns: Turns | None = None):
        """Build the stage (and join the stages' data plane); its steps start at `first_step`.

        `weights` are its parameters and buffers; `resume`, when resuming, the
        checkpoint's optimizer and RNG state. With no `weights`, only the layers
        are built now (initialised here with init per_layer): their weights and
        a checkpoint's state come in pieces (expect, receive), and start() builds
        the rest. A failure is kept for built() or start(). `transport`, `shared_rng` and `turns` (a model chunk's
        worker's, with virtual stages): a stage linked in memory to stages that are threads of this process
        (gpipe.coordinator.attempt.handle.LocalStage); c10d by default.
        """
        self.stage: Stage | None = None
        self.error: StageError | None = None
        config = StageConfig(**cfg)
        evals = EvalSchedule(config.eval_every, config.eval_batches, config.steps)
        self._steps = StepQueue(first_step, evals.at)
        self._thread: threading.Thread | None = None
        self._incoming: Incoming | None = None
        self._outbox = Outbox()
        self._cfg = config
        self._transport, self._shared_rng, self._turns = transport, shared_rng, turns
        StageServer.live.append(self)
        try:
            if weights is None:
                layers = build_layers(self._cfg, None, torch.device(self._cfg.device))
                self._incoming = Incoming(layers, zero.held(layers, self._cfg.replicas, self._cfg.replica)
                                          if self._cfg.sharded else None)
                return
            self.stage = self._build(weights, resume)
        except BaseException as e:
            self.error = self._failure(e)
            return
        self._thread = threading.Thread(target=self._run, name="stage-executor", daemon=True)
        self._thread.start()

    def _build(self, state: dict[str, torch.Tensor] | torch.nn.Sequential, resume: StageState | None) -> Stage:
        transport, shared_rng, turns = self._transport, self._shared_rng, self._turns
        device = torch.device(self._cfg.device)
        if self._cfg.deterministic:
            determinism.enable()  # before the layers' first product on a GPU
        if not isinstance(state, torch.nn.Sequential):  # a layer that cannot be built fails before the data plane
            state = build_layers(self._cfg, state, device)
        if transport is None:  # the service's data plane: c10d lanes to the other workers' stages
            if device.type == "cuda":
                torch.cuda.set_device(device)  # this process owns its GPU: NCCL's communicators are made on it
            c10d = transport = C10dTransport(self._cfg, device)
            if self._cfg.virtual_stages > 1:  # the model chunks of this worker process take turns, share its RNG
                turns, shared_rng = c10d.world.turns, c10d.world.rng
        stage = Stage(self._cfg, state, resume, transport, shared_rng=shared_rng)
        if turns is not None:
            stage.turns = turns
        return stage

    def _failure(self, e: BaseException, step: int | None = None) -> StageError:
        """What goes back to the coordinator for `e`; its traceback goes to the worker's log (not for a chunk
        stopped because another chunk of its worker failed: that chunk's own traceback is the one logged)."""
        if not isinstance(e, TurnAborted):
            traceback.print_exception(e)
        return StageError.of(e, self._cfg, step)

    def _refusal(self, why: str) -> StageError:
        """The build's own failure, or else `why` (a call out of order: the coordinator's bug)."""
        return self.error or StageError.of(RuntimeError(why), self._cfg)

    # -- state in pieces (gpipe.worker.state_stream) ------------------------------------

    def expect(self, entries: dict[str, tuple[str, list[int]]]) -> StageError | None:
        """Make room for a checkpoint's tensors that are not weights (name -> (dtype, shape))."""
        return self._loading(lambda inc: inc.expect(entries))

    def receive(self, pieces: list[Piece]) -> StageError | None:
        """Copy pieces of the stage's tensors in."""
        return self._loading(lambda inc: inc.receive(pieces))

    def _loading(self, do: Callable[[Incoming], None]) -> StageError | None:
        if self._incoming is None:
            return self._refusal("the stage has started already")
        try:
            do(self._incoming)
        except BaseException as e:
            return self._failure(e)
        return None

    def start(self, json_state: dict[str, Any] | None, weights_sent: bool) -> dict[str, Any] | StageError:
        """Once every piece is in: build the optimizer (with the checkpoint's state), join the data plane, start."""
        incoming, self._incoming = self._incoming, None
        if incoming is None:
            return self._refusal("the stage has started already")
        try:
            resume = incoming.finish(json_state, weights_sent)
            self.stage = self._build(incoming.layers, resume)
        except BaseException as e:
            self.error = self._failure(e)
            return self.error
        del incoming
        self._thread = threading.Thread(target=self._run, name="stage-executor", daemon=True)
        self._thread.start()
        return self.built()

    def snapshot_piece(self, step: int, index: int) -> torch.Tensor:
        """Piece `index` of the checkpoint copy taken after step `step`; the last one lets the copy go."""
        return self._outbox.piece(step, index)

    def drop_snapshot(self, step: int) -> None:
        """Let the checkpoint copy of step `step` go (it is written, or will not be)."""
        self._outbox.drop(step)

    def built(self) -> dict[str, Any] | StageError:
        """The built stage's figures, or the StageError building failed with."""
        if self.stage is None:
            return self._refusal("the stage was not built")
        return {"params": sum(p.numel() for p in self.stage.layers.parameters()), "pid": os.getpid(),
                "threads": torch.get_num_threads()}

    def activity(self) -> tuple[str, str, float]:
        """What the stage does now (Stage.activity); a stage not built is idle."""
        return self.stage.activity() if self.stage is not None else ("idle", "", 0.0)

    @rpc.functions.async_execution  # type: ignore[untyped-decorator]  # torch's decorator is untyped
    def run_step(self, step: int, lr: float, inputs: list[Any] | None, targets: list[Any] | None, sizes: list[int],
                 snapshot: bool = False) -> Answer:
        """Queue one step; the returned future completes with its StepResult when its optimizer step is done.

        The coordinator sends step s+1 while step s runs, so a stage never waits
        for its inputs. With `snapshot`, the answer also carries a copy of the
        stage's state after the step (StepResult.snapshot, for a checkpoint),
        taken before the next step starts.
        """
        fut: Answer = torch.futures.Future()
        if self.stage is None:
            fut.set_result(self._refusal("the stage was not built"))
        else:
            self._steps.put(step, fut, (step, lr, inputs, targets, sizes, snapshot))
        return fut

    @rpc.functions.async_execution  # type: ignore[untyped-decorator]  # torch's decorator is untyped
    def run_eval(self, position: int, batch: int, inputs: list[Any] | None, targets: list[Any] | None,
                 sizes: list[int], weights: bool = False) -> Answer:
        """Queue eval batch `batch` of the evaluation after `position` steps: it runs after step
        `position`-1's optimizer step and before step `position`. The future completes with the stage's
        EvalResult (Stage.evaluate), with `weights`, a copy of its weights in EvalResult.weights."""
        fut: Answer = torch.futures.Future()
        if self.stage is None:
            fut.set_result(self._refusal("the stage was not built"))
            return fut
        try:
            self._steps.put_eval(position, batch, fut, EvalArgs(batch, inputs, targets, sizes, weights))
        except ValueError as e:
            fut.set_result(self._failure(e))
        return fut

    def _evaluate(self, args: EvalArgs) -> EvalResult:
        assert self.stage is not None
        result = self.stage.evaluate(args.batch, args.inputs, args.targets, args.sizes)
        if args.weights:
            result.weights = self.stage.weights()
        self._give_back()
        return result

    def _step(self, args: StepArgs) -> StepResult:
        assert self.stage is not None
        step, lr, inputs, targets, sizes, snapshot = args
        result = self.stage.step(step, lr, inputs, targets, sizes)
        if snapshot:
            self._snapshot(step, result)
            self._give_back()
        return result

    def _give_back(self) -> None:
        """On a CPU, after an evaluation batch or a checkpoint's copy: the heaps' free memory back to the system,
        as after each optimizer step (gpipe.optim.build). What they freed (an evaluation's logits, a sharded
        checkpoint's rounds) otherwise stayed resident under the next step's peak, in blocks the step's own did
        not fit: a GPT-2 token job's first worker peaked 12 MiB higher after each of its first checkpoints
        (bench/memory_flat.py)."""
        if self.stage is not None and self.stage.device.type == "cpu":
            memory.give_back()

    def _run(self) -> None:
        """Runs the queued steps and eval batches one at a time, in order; a failure is the answer."""
        while (job := self._steps.take()) is not None:
            fut, args = job
            try:
                fut.set_result(self._evaluate(args) if isinstance(args, EvalArgs) else self._step(args))
            except BaseException as e:
                if self.stage is not None and self.stage.turns is not None:
                    self.stage.turns.fail()  # this worker's other model chunks stop waiting for this one's turns
                fut.set_result(self._failure(e, args[0] if isinstance(args, tuple) else None))

    def _snapshot(self, step: int, result: StepResult) -> None:
        """Copy the state out for the checkpoint after `step`, to be pulled in pieces while the next steps run.

        Between steps, before the next one changes anything: snapshot_s is the stall a checkpoint costs.
        A copy still being pulled is waited for first (snapshot_wait_s), so a stage holds one at most.
        """
        assert self.stage is not None
        # sharded: the optimizer state is gathered to replica 0, each model chunk of a worker in its turn
        with self.stage.transport.in_turn() if self._cfg.sharded else contextlib.nullcontext():
            self._take_snapshot(step, result)

    def _take_snapshot(self, step: int, result: StepResult) -> None:
        assert self.stage is not None
        t0 = time.perf_counter()
        if self._cfg.replica != 0:  # replica 0's copy is the checkpoint's; a sharded optimizer's pieces go to it
            self.stage.contribute_snapshot()
            result.snapshot_s = time.perf_counter() - t0
            return
        self._outbox.wait_free(self._cfg.step_timeout_s)
        t1 = time.perf_counter()
        out = Outgoing(step, self.stage.snapshot(copy=False))
        self._outbox.put(out, self._cfg.step_timeout_s)
        result.snapshot = out.describe()
        result.snapshot_s = time.perf_counter() - t1
        result.snapshot_wait_s = t1 - t0

    def close(self) -> None:
        """Stop taking steps and close the stage's channels."""
        self._steps.close()
        self._outbox.drop()
        if self.stage is not None:
            self.stage.close()

    @classmethod
    def close_all(cls) -> None:
        """Close every stage this process serves (it is leaving the RPC world)."""
        while cls.live:
            cls.live.pop().close()
