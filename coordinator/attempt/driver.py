"""The driver of one job attempt (a Run): its stages' handles, from building to the last step.

Per step it sends one call through each stage's handle (gpipe.coordinator.attempt.handle:
to each replica's first stage the inputs of its shard, to its last stage the
targets, the LR to all) and gets one answer back from each, so control costs
O(workers) messages per step, and activations never pass through here. Steps
s+1 ... s+read_ahead-1 (the spec's data.read_ahead, 2 by default) are read and
sent while step s runs, so the first stage never waits for its inputs.
The handles reach the stages over torch RPC (gpipe.coordinator.attempt.rpcworld: the service
and `run`) or in this process (LocalStage: tests).

Every wait has a deadline and names what it waited for (gpipe.coordinator.attempt.watch).
Watching the worker processes is the supervisor's part: it kills this attempt
when one dies.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import save_file

from gpipe import stream
from gpipe.contract import Cause, EvalResult, StageError, StepResult, blamed, disk_cause
from gpipe.coordinator.attempt import state_stream as streaming
from gpipe.coordinator.attempt.handle import Future, StageHandle
from gpipe.coordinator.attempt.lr import lr_at
from gpipe.coordinator.attempt.metrics import (
    EvalMetrics,
    OnEval,
    StepMetrics,
    step_metrics,
    step_span,
)
from gpipe.coordinator.attempt.resume import checkpoint_meta, resume_parts, weight_parts
from gpipe.coordinator.attempt.rpcworld import RpcWorld
from gpipe.coordinator.attempt.watch import Watch
from gpipe.coordinator.outputs import checkpoint, timeline
from gpipe.coordinator.plan.data import DataStream
from gpipe.coordinator.plan.job import Plan
from gpipe.errors import JobFailed, SpecError, describe_os_error
from gpipe.files import atomic_write
from gpipe.show import first_line
from gpipe.state import model_key
from gpipe.topology import Slots

T = TypeVar("T")
EVAL_AHEAD = 2  # eval batches sent to the stages before the oldest one finished


class Run:
    """Drives one attempt of `plan` through its stages' handles (an attempt is a job's try, numbered; this is
    the driving of one). `stages` are by rank: `build` fills them."""

    def __init__(self, plan: Plan, on_step: Callable[[StepMetrics], None], attempt_no: int = 1,
                 on_eval: OnEval | None = None, eval_weights: bool = False):
        self.plan, self.spec = plan, plan.spec
        self.evals = plan.eval_schedule()
        self.on_step, self.attempt_no = on_step, attempt_no
        self.on_eval, self.eval_weights = on_eval, eval_weights
        self.stages: list[StageHandle] = []
        # Called at least every CHECK_EVERY_S while training waits: raises what must end the attempt now
        # (the checkpoint writer's failure).
        self.check: Callable[[], None] = lambda: None
        # Asked after each step's answer: True once the attempt is to stop at the next step boundary (preemption).
        self.preempted: Callable[[], bool] = lambda: False
        self.stop_after: int | None = None  # the step that ends training early, with a checkpoint (preempted)

    @property
    def slots(self) -> Slots:
        """The stages the driver drives, by slot: each replica's model chunks (a stage each, or virtual_stages
        of them on each worker: gpipe.topology); with one model chunk a worker, the slots are the ranks."""
        return self.spec.topology.model_chunks()

    # -- answers -------------------------------------------------------------------------------------

    def stage_name(self, rank: int) -> str:
        """'stage 1 (layers 2-3)', with 'of replica R' when there are replicas."""
        start, end = self.plan.bounds[self.slots.model_chunk_of(rank)]
        layers = f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"
        if self.spec.virtual_stages > 1:  # a model chunk, on the worker that holds it
            workers = self.spec.topology
            return f"model chunk {self.slots.model_chunk_of(rank)} ({layers}) on {workers.name(workers.worker_of(rank))}"
        return f"{self.slots.name(rank)} ({layers})"

    def _blame(self, rank: int, cause: Cause, message: str, step: int | None = None,
               type_: str = "") -> StageError:
        """A failure of the worker of slot `rank` seen from here (lost contact, a wait that ran out)."""
        slots = self.slots
        return StageError(cause=cause, type=type_, message=message, rank=self.spec.topology.worker_of(rank),
                          stage=slots.model_chunk_of(rank), replica=slots.replica_of(rank), step=step)

    def _result(self, what: str, rank: int, fut: Future, kind: type[T], step: int | None = None) -> T:
        """Worker `rank`'s answer, of type `kind`; JobFailed naming its stage if it failed or was lost."""
        try:
            value = fut.wait()
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise JobFailed(f"lost contact with {self.stage_name(rank)} {what}: {first}",
                            error=self._blame(rank, Cause.PEER, first, step, type(e).__name__)) from None
        if isinstance(value, StageError):
            raise JobFailed(f"{self.stage_name(rank)} failed {what}: {value.line()}", error=value)
        if not isinstance(value, kind):  # a stage of another version: its answers cannot be read
            raise JobFailed(f"{self.stage_name(rank)} answered {what} with a {type(value).__name__}, not a "
                            f"{kind.__name__}", error=self._blame(rank, Cause.RAISED, "", step, "TypeError"))
        return value

    def _wait_all(self, futs: dict[int, Future], timeout: float, what: str, kind: type[T],
                  step: int | None = None) -> dict[int, T]:
        """Every worker's answer in `futs` (by rank), within `timeout`; JobFailed naming those it waited for."""
        q: queue.Queue[int] = queue.Queue()
        for k, f in futs.items():
            f.add_done_callback(lambda _f, k=k: q.put(k))  # type: ignore[misc]  # k bound per future
        out: dict[int, T] = {}
        deadline = time.monotonic() + timeout
        while len(out) < len(futs):
            try:
                k = q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                late = [k for k in futs if k not in out]
                pending = ", ".join(self.stage_name(k) for k in late)
                message = f"timed out after {timeout:.0f}s {what}, waiting for {pending}"
                raise JobFailed(message, error=self._blame(late[0], Cause.TIMEOUT, message, step)) from None
            out[k] = self._result(what, k, futs[k], kind, step)
        return out

    # -- building --------------------------------------------------------------------------------------

    def build(self, stages: list[StageHandle], resume: checkpoint.Loaded | None = None) -> dict[int, dict[str, Any]]:
        """Send each created stage (by rank) its weights (init exact) or, resuming, its slice of the checkpoint,
        in pieces (gpipe.coordinator.attempt.state_stream), and start them all.

        Every replica's copy of stage k starts from the same state. Returns each worker's figures (parameters,
        pid, threads), by rank, once all are built.
        """
        spec, slots = self.spec, self.slots
        self.stages = stages
        slices, files = None, None
        if resume is not None:
            slices, files = resume_parts(self.plan, resume), resume.shards
        elif self.plan.weights is not None:  # model.weights: each stage its own tensors, read from the files
            slices, files = weight_parts(self.plan), self.plan.weights.shards
        for rank in slots.slots():  # each replica's copy of stage k gets stage k's state
            self._send_state(rank, slices[slots.model_chunk_of(rank)] if slices is not None else None, files)
        sent = spec.init == "exact" or (resume is None and self.plan.weights is not None)
        futs = {rank: self.stages[rank].start(slices[slots.model_chunk_of(rank)].json_state if slices is not None
                                              else None, sent)
                for rank in slots.slots()}
        return self._wait_all(futs, spec.start_timeout_s, "while building its stage", dict)

    def _send_state(self, rank: int, part: streaming.StageSlice | None,
                    files: Sequence[checkpoint.Shard] | None) -> None:
        """Worker `rank`'s initial tensors, a piece at a time: its stage's weights from the plan (init exact), its
        slice of a checkpoint or of model.weights (from `files`), or nothing (init per_layer: the stage made its
        own)."""
        stage = self.stages[rank]

        def check(fut: Future) -> None:
            self._result("while receiving its state", rank, fut, type(None))

        if part is None:
            if self.spec.init == "exact":
                weights = {model_key(n): t for n, t in self.plan.stage_state(self.slots.model_chunk_of(rank)).items()}
                streaming.send_pieces(stage, stream.pieces(weights), check)
            return
        assert files is not None  # a slice is of files
        check(stage.expect(part.declared))
        streaming.send_pieces(stage, part.pieces(files), check)

    # -- training --------------------------------------------------------------------------------------

    def train(self, first_step: int = 0, on_snapshot: Callable[[checkpoint.Snapshot], None] | None = None) -> None:
        """Run steps first_step .. steps-1, data.read_ahead at a time, reporting each as it ends.

        After every checkpoint_every-th step and the last, replica 0's stages also hand back a copy of their
        state, which goes to `on_snapshot`. Once `preempted()` says so, the first step not yet sent is the last,
        with a checkpoint (`stop_after`): the steps already sent cannot give one, their state is gone.
        """
        spec, slots = self.spec, self.slots
        watch = Watch(self.stages, slots, spec.step_timeout_s, spec.peer_timeout_s, self.check)
        pending: dict[int, dict[int, Future]] = {}  # by step, by rank
        results: dict[int, dict[int, StepResult]] = {}
        issued, finished = first_step, first_step
        t_prev: float | None = time.perf_counter()  # when the previous step ended; None: an evaluation followed it

        def timed_out() -> JobFailed:
            late = [k for k in pending[finished] if k not in results[finished]]
            message = (f"step {finished + 1} timed out after {spec.step_timeout_s:.0f}s waiting for "
                       f"{', '.join(self.stage_name(k) for k in late)}")
            return JobFailed(message, error=self._blame(late[0], Cause.TIMEOUT, message, finished))

        data = self.plan.stream()
        if self.evals.at(first_step):  # resumed where an evaluation is due: the stages wait for it
            self.evaluate(first_step)
        end = spec.steps
        while finished < end:
            if self.stop_after is None and issued < end - 1 and self.preempted():  # (the last step ends the job)
                self.stop_after, end = issued, issued + 1
            while issued < end and issued - finished < spec.data.read_ahead:
                pending[issued], results[issued] = self._issue(data, issued, on_snapshot is not None, watch), {}
                issued += 1
            s, rank = watch.next(finished, timed_out)
            try:
                results[s][rank] = self._result(f"at step {s + 1}", rank, pending[s][rank], StepResult, s)
            except JobFailed as e:
                if e.error is None or blamed(e.error.cause):
                    raise
                # A model chunk that gave up because another chunk of its worker failed: that chunk's own answer
                # (on its way) names the failure. Until it comes, this one is not counted as answered.
                continue
            while finished in results and len(results[finished]) == slots.count:
                per_rank = results.pop(finished)
                del pending[finished]
                if on_snapshot is not None and self.snapshot_after(finished):
                    on_snapshot(self._snapshot(finished, per_rank))
                now = time.perf_counter()
                self.on_step(step_metrics(self.plan, finished, per_rank,
                                          now - t_prev if t_prev is not None else step_span(per_rank),
                                          self.attempt_no))
                t_prev = now
                finished += 1
                # After this step, before the next (queued behind it on the stages); a preempted attempt leaves
                # it to the next one, which evaluates where it resumes.
                if self.evals.at(finished) and not (self.stop_after is not None and finished == end):
                    self.evaluate(finished)
                    t_prev = None  # the next step ran behind it on the stages: its time is theirs
                watch.news()

    def _issue(self, data: DataStream, step: int, snapshots: bool, watch: Watch) -> dict[int, Future]:
        """Send step `step` to every stage: inputs to each replica's first, targets to its last, the LR to all."""
        spec, slots = self.spec, self.slots
        try:
            shards = data.shards(step)  # per replica: (inputs, targets, sizes) of its micro-batches
        except Exception as e:  # the job's data set or collate, on a later batch than the plan checked
            raise JobFailed(f"data: step {step + 1}: {first_line(e)}", error=StageError.of(e, None, step)) from None
        lr, last = lr_at(spec, step), slots.model_chunks - 1
        keep = snapshots and self.snapshot_after(step)
        sharded = spec.optimizer.shard and slots.replicas > 1
        futs: dict[int, Future] = {}
        for rank in slots.slots():
            (xs, ys, sizes), k = shards[slots.replica_of(rank)], slots.model_chunk_of(rank)
            # One copy of each stage's state goes into a checkpoint: replica 0's, to which the other replicas
            # give their pieces of a sharded optimizer's state (gpipe.memory.zero).
            futs[rank] = self.stages[rank].run_step(step, lr, xs if k == 0 else None, ys if k == last else None,
                                                    sizes, keep and (slots.replica_of(rank) == 0 or sharded))
            watch.notify(futs[rank], (step, rank))
        return futs

    def _snapshot(self, step: int, per_rank: dict[int, StepResult]) -> checkpoint.Snapshot:
        """The checkpoint after `step`: replica 0's stages' copies, pulled in pieces as the writer writes."""
        ranks = self.slots.replica_slots(0)
        parts = [streaming.from_stage(self.stages[rank], per_rank[rank].snapshot or {}) for rank in ranks]
        for rank in ranks:
            per_rank[rank].snapshot = None  # pulled from here on: nothing to keep
        stall = max(per_rank[rank].snapshot_s or 0.0 for rank in ranks)
        return checkpoint.Snapshot(step + 1, parts, checkpoint_meta(self.plan, step + 1), stall)

    def snapshot_after(self, step: int) -> bool:
        """Whether step `step` ends with a checkpoint."""
        every = self.spec.checkpoint_every
        return step in (self.spec.steps - 1, self.stop_after) or (every is not None and (step + 1) % every == 0)

    # -- evaluation ------------------------------------------------------------------------------------

    def evaluate(self, position: int) -> EvalMetrics:
        """The loss on the eval data after `position` steps, reported to on_eval.

        Each eval batch goes to replica 0's stages as one call per stage (inputs to the first, targets to the
        last), EVAL_AHEAD batches ahead; each stage runs it forward between step position-1 and step position.
        Every wait is bounded by step_timeout_s and names the stage it waited for.
        """
        spec, slots = self.spec, self.slots
        ranks = slots.replica_slots(0)  # replica 0 alone evaluates
        first, last = ranks[0], ranks[-1]
        stream = self.plan.eval_stream()
        n = self.evals.at(position)
        after = f"after step {position}" if position else "before any step"  # counted from 1, as the progress line
        t0 = time.perf_counter()
        sent: dict[int, dict[int, Future]] = {}
        loss_sum, samples, issued = 0.0, 0, 0
        weights: dict[str, torch.Tensor] | None = None
        for b in range(n):
            while issued < n and issued - b < EVAL_AHEAD:
                try:
                    xs, ys, sizes = stream.micro_batches(issued)
                except Exception as e:  # the job's eval data or collate, on a later batch than the plan checked
                    raise JobFailed(f"eval.data: batch {issued}: {first_line(e)}",
                                    error=StageError.of(e, None, position)) from None
                want = self.eval_weights and issued == n - 1
                sent[issued] = {rank: self.stages[rank].run_eval(
                    position, issued, xs if rank == first else None, ys if rank == last else None, sizes, want)
                    for rank in ranks}
                issued += 1
            out = self._wait_all(sent.pop(b), spec.step_timeout_s, f"evaluating {after} (eval batch {b})",
                                 EvalResult)
            loss_sum += out[last].loss_sum or 0.0  # the last stage's: it always has one
            samples += out[last].samples
            if out[first].weights is not None:
                weights = {name: t for rank in ranks for name, t in (out[rank].weights or {}).items()}
        m = EvalMetrics(step=position - 1 if position else None, eval_loss=loss_sum / samples,
                        eval_samples=samples, eval_time_s=time.perf_counter() - t0, attempt=self.attempt_no)
        if self.on_eval is not None:
            self.on_eval(m, weights)
        return m


def save_weights(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file atomically (gpipe.files.atomic_write), with `metadata` in its header."""
    tensors = {k: v.contiguous() for k, v in state.items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def drive(plan: Plan, out: Path, host: str, port: int, devices: list[str], on_step: Callable[[StepMetrics], None],
          on_checkpoint: Callable[[int, Path, int, float, float], None] | None = None,
          resume: checkpoint.Loaded | None = None, attempt_no: int = 1, on_eval: OnEval | None = None,
          eval_weights: bool = False, preempted: Callable[[], bool] = lambda: False) -> int | None:
    """One attempt, start to end: join, build, train (checkpointing), save the weights and the timeline, leave.

    Once `preempted()` is true, it stops at the next step boundary with a checkpoint, leaves, and returns that
    checkpoint's step (the weights are not exported); otherwise None.

    Resumes from `resume` when given. on_checkpoint(step, dir, bytes, write_s,
    stall_s) follows each committed checkpoint, where stall_s is the longest
    any stage spent copying its state out; on_eval each evaluation (with the
    weights when `eval_weights`). Raises JobFailed naming the stage;
    the caller then kills what it started. Snapshots already taken are still
    written when the attempt fails.
    """
    spec = plan.spec

    def committed(snap: checkpoint.Snapshot, d: Path, size: int, seconds: float) -> None:
        if on_checkpoint is not None:
            on_checkpoint(snap.step, d, size, seconds, snap.stall_s)

    writer = checkpoint.Writer(checkpoint.folder(out), spec.keep_checkpoints, committed)
    final: list[checkpoint.Snapshot] = []

    def on_snapshot(snap: checkpoint.Snapshot) -> None:
        if snap.step == spec.steps:
            final.append(snap)
        try:
            writer.submit(snap)
        except OSError as e:
            raise JobFailed(f"checkpoint: {describe_os_error(e)}", cause=disk_cause(e)) from None  # names the path

    def check_writer() -> None:  # a checkpoint that cannot be written fails the attempt at once
        try:
            writer.check()
        except OSError as e:
            raise JobFailed(f"checkpoint: {describe_os_error(e)}", cause=disk_cause(e)) from None

    world = RpcWorld(plan, host, port, devices.__getitem__)
    run = Run(plan, on_step, attempt_no, on_eval, eval_weights)
    run.check, run.preempted = check_writer, preempted
    left = False
    try:
        world.join(run.stage_name)
        first = resume.step if resume is not None else 0
        run.build(world.stages(first), resume)
        run.train(first, on_snapshot)
        try:
            writer.close()
        except OSError as e:
            raise JobFailed(f"checkpoint: {describe_os_error(e)}", cause=disk_cause(e)) from None
        if run.stop_after is not None:  # preempted: the checkpoint is committed; the next attempt goes on from it
            run.stages.clear()
            left = world.leave(graceful=True)
            return run.stop_after + 1
        # The final checkpoint's weights, read back a piece at a time (or a resumed job's, at its last step).
        ck = checkpoint.open_committed(checkpoint.step_dir(writer.root, spec.steps)) if final else resume
        assert ck is not None  # no final snapshot: resumed at the last step
        checkpoint.export_weights(ck, out / "model.safetensors", {"step": str(spec.steps - 1)})
        plan.write_config(out)
        try:
            timeline.write(out, spec.trace_step)
        except SpecError as e:  # no such step logged (a job resumed at its end): the weights are what matter
            print(f"gpipe: no timeline drawn: {e}", file=sys.stderr, flush=True)
        run.stages.clear()  # drop the RRefs, so the stages are released as the world is left
        left = world.leave(graceful=True)
        if not left:
            raise JobFailed("the stages did not leave the RPC world in time", cause=Cause.TIMEOUT)
        return None
    finally:
        # A failed attempt still commits the snapshots it took: a stop request (SIGTERM) waits for that.
        with contextlib.suppress(ValueError):  # not the main thread: nothing to ignore
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with contextlib.suppress(OSError):
            writer.close(timeout=60)
        if not left:
            world.leave(graceful=False, timeout=5)


def drive_eval(plan: Plan, host: str, port: int, devices: list[str]) -> EvalMetrics:
    """The eval verb's attempt: join, build the stages with the plan's weights, evaluate once, leave.

    The plan evaluates before any step (Plan.evaluate_only); nothing is written.
    """
    world = RpcWorld(plan, host, port, devices.__getitem__)
    run = Run(plan, lambda m: None)
    left = False
    try:
        world.join(run.stage_name)
        run.build(world.stages(0))
        m = run.evaluate(0)
        run.stages.clear()
        left = world.leave(graceful=True)
        if not left:
            raise JobFailed("the stages did not leave the RPC world in time", cause=Cause.TIMEOUT)
        return m
    finally:
        if not left:
            world.leave(graceful=False, timeout=5)
