"""The driver of one job attempt (a Run): the coordinator's side of the RPC world.

The coordinator is RPC rank 0; worker rank N (stage N mod P of replica N div
P: gpipe.topology) is RPC rank N+1. It creates each stage on its worker
(rpc.remote of worker.stage_server.StageServer) and holds their RRefs, by
rank. Per step it sends one RPC through each RRef (to each replica's first
stage the inputs of its shard, to its last stage the targets, the LR to all)
and gets one answer back from each, so control costs O(workers) messages per
step, and activations never pass through here. Step s+1 is sent while step s
runs, so the first stage never waits for its inputs.

Every wait has a deadline and names what it waited for. Watching the worker
processes is the supervisor's part: it kills this attempt when one dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed.rpc as rpc
from safetensors.torch import save_file

from gpipe import net, stream
from gpipe.contract import Cause, EvalResult, StageConfig, StageError, StepResult
from gpipe.coordinator import checkpoint, streaming, timeline
from gpipe.coordinator.lr import lr_at
from gpipe.coordinator.plan import Plan
from gpipe.errors import JobFailed, SpecError, describe_os_error
from gpipe.files import atomic_write, atomic_write_json
from gpipe.precision import LossScaler
from gpipe.show import first_line
from gpipe.state import LOSS_SCALE, OPTIM, RNG, layer_of, model_key
from gpipe.topology import Topology
from gpipe.worker.stage_server import StageServer

T = TypeVar("T")
Future = torch.futures.Future[Any]  # an RPC's answer (a StepResult, an EvalResult, a StageError ...)
LOOK_EVERY_S = 2.0  # while no step finishes, how often the stages are asked what they are doing
LOOK_TIMEOUT_S = 5.0
CHECK_EVERY_S = 1.0  # while no step finishes, how often the attempt checks its checkpoint writer


@dataclass
class Looking:
    """The stages' answers to "what are you doing?", asked at `since`."""

    answers: list[Future]
    since: float


def _put_when_done(q: queue.Queue[T], key: T) -> Callable[[Any], None]:
    """A future's done-callback that puts `key` on `q` (the waits below take whichever finishes first)."""

    def done(_fut: Any) -> None:
        q.put(key)

    return done


STEPS_AHEAD = 2  # steps sent to the stages before the oldest one finished
EVAL_AHEAD = 2  # eval batches sent to the stages before the oldest one finished


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    step_time_s: float
    samples_per_s: float
    grad_norm: float | None
    bubble_fraction: float  # the share of the stages' step time spent waiting
    attempt: int = 1  # which attempt of the job ran this step (a resumed job runs some steps again)
    loss_scale: float | None = None  # fp16: the scale this step's loss was multiplied by; null otherwise
    skipped: bool | None = None  # fp16: an inf or nan in some stage's gradients skipped the optimizer step
    stages: list[dict[str, Any]] = field(default_factory=list)  # every worker's, by rank
    replicas: list[dict[str, Any]] = field(default_factory=list)  # per replica: its time, bubble and reduction wait


@dataclass
class EvalMetrics:
    """An evaluation: the mean loss over its samples, after step `step` (None: weights of an unknown step)."""

    step: int | None
    eval_loss: float
    eval_samples: int
    eval_time_s: float
    attempt: int = 1


# An evaluation's metrics, and the model's weights it was taken with when asked for (keep_best).
OnEval = Callable[[EvalMetrics, dict[str, torch.Tensor] | None], None]


class Run:
    """Drives one attempt of `plan`: the stages that join the RPC world at `master`, from building to the
    last step (an attempt is a job's try, numbered; this is the driving of one)."""

    def __init__(self, plan: Plan, store_host: str, store_port: int, device_of: Callable[[int], str],
                 on_step: Callable[[StepMetrics], None], attempt_no: int = 1, on_eval: OnEval | None = None,
                 eval_weights: bool = False):
        self.plan, self.spec = plan, plan.spec
        self.evals = plan.eval_schedule()
        self.on_eval, self.eval_weights = on_eval, eval_weights
        # One store serves the RPC rendezvous and the stages' data-plane process group.
        self.store_host, self.store_port = store_host, store_port
        self.master = f"{store_host}:{store_port}"
        self.device_of = device_of
        self.on_step = on_step
        self.attempt_no = attempt_no
        # StageServer of worker rank N, by rank: the first `stages` are replica 0's stages, in order.
        self.stages: list[rpc.RRef[StageServer]] = []
        # Called at least every CHECK_EVERY_S while training waits: raises what must end the attempt now
        # (the checkpoint writer's failure).
        self.check: Callable[[], None] = lambda: None

    @property
    def topology(self) -> Topology:
        """Which rank serves which stage of which replica."""
        return self.spec.topology

    # -- waiting -------------------------------------------------------------

    def _stage_name(self, rank: int) -> str:
        """'stage 1 (layers 2-3)', with 'of replica R' when there are replicas."""
        start, end = self.plan.bounds[self.topology.stage_of(rank)]
        layers = f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"
        return f"{self.topology.name(rank)} ({layers})"

    def _blame(self, rank: int, cause: Cause, message: str, step: int | None = None,
               type_: str = "") -> StageError:
        """A failure of worker `rank` seen from here (lost contact, a wait that ran out)."""
        top = self.topology
        return StageError(cause=cause, type=type_, message=message, rank=rank, stage=top.stage_of(rank),
                          replica=top.replica_of(rank), step=step)

    def _result(self, what: str, rank: int, fut: Future, kind: type[T], step: int | None = None) -> T:
        """Worker `rank`'s answer, of type `kind`; JobFailed naming its stage if it failed or was lost."""
        try:
            value = fut.wait()
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise JobFailed(f"lost contact with {self._stage_name(rank)} {what}: {first}",
                            error=self._blame(rank, Cause.PEER, first, step, type(e).__name__)) from None
        if isinstance(value, StageError):
            raise JobFailed(f"{self._stage_name(rank)} failed {what}: {value.line()}", error=value)
        if not isinstance(value, kind):  # a stage of another version: its answers cannot be read
            raise JobFailed(f"{self._stage_name(rank)} answered {what} with a {type(value).__name__}, not a "
                            f"{kind.__name__}", error=self._blame(rank, Cause.RAISED, "", step, "TypeError"))
        return value

    def _wait_all(self, futs: dict[int, Future], timeout: float, what: str, kind: type[T],
                  step: int | None = None) -> dict[int, T]:
        """Every worker's answer in `futs` (by rank), within `timeout`; JobFailed naming those it waited for."""
        q: queue.Queue[int] = queue.Queue()
        for k, f in futs.items():
            f.add_done_callback(_put_when_done(q, k))
        out: dict[int, T] = {}
        deadline = time.monotonic() + timeout
        while len(out) < len(futs):
            try:
                k = q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                late = [k for k in futs if k not in out]
                pending = ", ".join(self._stage_name(k) for k in late)
                message = f"timed out after {timeout:.0f}s {what}, waiting for {pending}"
                raise JobFailed(message, error=self._blame(late[0], Cause.TIMEOUT, message, step)) from None
            out[k] = self._result(what, k, futs[k], kind, step)
        return out

    # -- the attempt ---------------------------------------------------------

    def join(self) -> None:
        """Start this end of the RPC world, within start_timeout_s."""
        spec = self.spec
        opts = net.rpc_options(self.master, spec.start_timeout_s)
        err: list[BaseException] = []

        def init() -> None:
            try:
                rpc.init_rpc(  # type: ignore[no-untyped-call]  # torch.distributed.rpc has no annotations
                    "coordinator", rank=0, world_size=self.topology.world + 1, rpc_backend_options=opts)
            except BaseException as e:
                err.append(e)

        t = threading.Thread(target=init, name="rpc-init", daemon=True)
        t.start()
        t.join(spec.start_timeout_s)
        if t.is_alive():
            raise JobFailed(f"timed out after {spec.start_timeout_s:.0f}s waiting for the workers to join: "
                            f"{self._who_did_not_join()}", cause=Cause.TIMEOUT)
        if err:
            raise JobFailed(f"the RPC world could not start: {str(err[0]).splitlines()[0]}", cause=Cause.PEER)

    def _who_did_not_join(self) -> str:
        """Which workers never reached the rendezvous, or else where the ones that did listen."""
        store = net.master_store(self.store_port)
        if store is None:
            return "no rendezvous store"
        reached: dict[int, str] = {}
        for k in self.topology.ranks():
            key = f"{net.REACHED_KEY}{k}"
            with contextlib.suppress(Exception):
                if store.check([key]):
                    reached[k] = store.get(key).decode(errors="replace")
        missing = [k for k in self.topology.ranks() if k not in reached]
        if missing:
            return (f"{', '.join(self._stage_name(k) for k in missing)} never reached the rendezvous at "
                    f"{self.master}: check that its worker can reach this address (serve --host sets it)")
        where = ", ".join(f"{self.topology.name(k)} at {a}" for k, a in sorted(reached.items()))
        return (f"every worker reached the rendezvous, but they could not all connect to each other ({where}): "
                "check that these addresses reach one another (gpipe-worker --host sets a worker's)")

    def build(self, resume: checkpoint.Loaded | None = None) -> dict[int, dict[str, Any]]:
        """Create every stage on its worker, then send each its weights (init exact) or, resuming, its slice of
        the checkpoint, in pieces (coordinator.streaming), and start them all.

        Every replica's copy of stage k starts from the same state. Returns each worker's figures (parameters,
        pid, threads), by rank, once all are built.
        """
        spec, top = self.spec, self.topology
        slices = resume_parts(self.plan, resume) if resume is not None else None
        for rank in top.ranks():
            cfg = StageConfig.of(self.plan, top.stage_of(rank), top.replica_of(rank), self.device_of(rank),
                                 self.store_host, self.store_port)
            args = (asdict(cfg), None, resume.step if resume is not None else 0)
            self.stages.append(rpc.remote(top.rpc_name(rank), StageServer, args=args, timeout=spec.start_timeout_s))
        for rank in top.ranks():  # each replica's copy of stage k gets stage k's state
            self._send_state(rank, slices[top.stage_of(rank)] if slices is not None else None, resume)
        exact = spec.init == "exact"
        futs = {rank: self.stages[rank].rpc_async(timeout=spec.start_timeout_s).start(
                    slices[top.stage_of(rank)].json_state if slices is not None else None, exact)
                for rank in top.ranks()}
        return self._wait_all(futs, spec.start_timeout_s, "while building its stage", dict)

    def _send_state(self, rank: int, part: streaming.StageSlice | None, resume: checkpoint.Loaded | None) -> None:
        """Worker `rank`'s initial tensors, a piece at a time: its stage's weights from the plan (init exact), a
        checkpoint's slice, or nothing (init per_layer: the stage made its own)."""
        spec, rref = self.spec, self.stages[rank]

        def check(fut: Future) -> None:
            self._result("while receiving its state", rank, fut, type(None))

        if part is None:
            if spec.init == "exact":
                weights = {model_key(n): t for n, t in self.plan.stage_state(self.topology.stage_of(rank)).items()}
                streaming.send_pieces(rref, stream.pieces(weights), spec.start_timeout_s, check)
            return
        assert resume is not None  # a slice is of a checkpoint
        check(rref.rpc_async(timeout=spec.start_timeout_s).expect(part.declared))
        streaming.send_pieces(rref, part.pieces(resume), spec.start_timeout_s, check)

    def train(self, first_step: int = 0, on_snapshot: Callable[[checkpoint.Snapshot], None] | None = None) -> None:
        """Run steps first_step .. steps-1, STEPS_AHEAD at a time, reporting each as it ends.

        After every checkpoint_every-th step and the last, the stages also hand
        back a copy of their state, which goes to `on_snapshot`.
        """
        spec, top = self.spec, self.topology
        stream = self.plan.stream()
        last = spec.stages - 1
        pending: dict[int, dict[int, Future]] = {}  # by step, by rank
        results: dict[int, dict[int, StepResult]] = {}
        q: queue.Queue[tuple[int, int]] = queue.Queue()
        issued, finished = first_step, first_step
        t_prev: float | None = time.perf_counter()  # when the previous step ended; None: an evaluation followed it
        deadline = time.monotonic() + spec.step_timeout_s + 10.0
        last_news = time.monotonic()  # when a stage last finished a step
        next_look = last_news + min(spec.peer_timeout_s, spec.step_timeout_s)
        looking: Looking | None = None  # the stages asked what they are doing, answers pending

        if self.evals.at(first_step):  # resumed where an evaluation is due: the stages wait for it
            self.evaluate(first_step)
        while finished < spec.steps:
            while issued < spec.steps and issued - finished < STEPS_AHEAD:
                try:
                    shards = stream.shards(issued)  # per replica: (inputs, targets, sizes) of its micro-batches
                except Exception as e:  # the job's data set or collate, on a later batch than the plan checked
                    raise JobFailed(f"data: step {issued}: {first_line(e)}",
                                    error=StageError.of(e, None, issued)) from None
                lr = lr_at(spec, issued)
                futs: dict[int, Future] = {}
                want_snapshot = on_snapshot is not None and self.snapshot_after(issued)
                for rank in top.ranks():
                    (xs, ys, sizes), k = shards[top.replica_of(rank)], top.stage_of(rank)
                    # One copy of each stage's state goes into a checkpoint: replica 0's.
                    keep = want_snapshot and top.replica_of(rank) == 0
                    f = self.stages[rank].rpc_async(timeout=0).run_step(
                        issued, lr, xs if k == 0 else None, ys if k == last else None, sizes, keep)
                    f.add_done_callback(_put_when_done(q, (issued, rank)))
                    futs[rank] = f
                pending[issued], results[issued] = futs, {}
                issued += 1
            self.check()
            try:
                wake = min(deadline, next_look, time.monotonic() + CHECK_EVERY_S)
                s, k = q.get(timeout=max(0.0, wake - time.monotonic()))
            except queue.Empty:
                if time.monotonic() < min(deadline, next_look):
                    continue  # only a check: see above
                if time.monotonic() < deadline:
                    looking = self._look_for_a_partition(finished, looking)
                    next_look = time.monotonic() + LOOK_EVERY_S
                    continue
                late = [k for k in pending[finished] if k not in results[finished]]
                waiting = ", ".join(self._stage_name(k) for k in late)
                message = f"step {finished} timed out after {spec.step_timeout_s:.0f}s waiting for {waiting}"
                raise JobFailed(message, error=self._blame(late[0], Cause.TIMEOUT, message, finished)) from None
            last_news, looking = time.monotonic(), None
            next_look = last_news + min(spec.peer_timeout_s, spec.step_timeout_s)
            results[s][k] = self._result(f"at step {s}", k, pending[s][k], StepResult, s)
            while finished in results and len(results[finished]) == top.world:
                per_stage = results.pop(finished)
                if per_stage[0].snapshot is not None:
                    # Replica 0's: ranks 0 .. stages-1 are its stages, in order.
                    parts = [streaming.from_stage(self.stages[k], per_stage[k].snapshot or {}, spec.step_timeout_s)
                             for k in range(spec.stages)]
                    for k in range(spec.stages):
                        per_stage[k].snapshot = None  # pulled from here on: nothing to keep
                    stall = max(per_stage[k].snapshot_s or 0.0 for k in range(spec.stages))
                    snap = checkpoint.Snapshot(finished + 1, parts, checkpoint_meta(self.plan, finished + 1), stall)
                    assert on_snapshot is not None  # asked for only when there is one
                    on_snapshot(snap)
                now = time.perf_counter()
                self._report(finished, per_stage, now - t_prev if t_prev is not None else _span(per_stage))
                del pending[finished]
                t_prev = now
                finished += 1
                if self.evals.at(finished):  # after this step, before the next (queued behind it on the stages)
                    self.evaluate(finished)
                    t_prev = None  # the next step ran behind it on the stages: its time is theirs
                deadline = time.monotonic() + spec.step_timeout_s + 10.0

    def evaluate(self, position: int) -> EvalMetrics:
        """The loss on the eval data after `position` steps, reported to on_eval.

        Each eval batch goes to the stages as one RPC per stage (inputs to the
        first, targets to the last), EVAL_AHEAD batches ahead; each stage runs
        it forward between step position-1 and step position. Every wait is
        bounded by step_timeout_s and names the stage it waited for.
        """
        spec = self.spec
        stream = self.plan.eval_stream()
        last, n = spec.stages - 1, self.evals.at(position)
        after = f"after step {position - 1}" if position else "before any step"
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
                sent[issued] = {k: self.stages[k].rpc_async(timeout=0).run_eval(
                    position, issued, xs if k == 0 else None, ys if k == last else None, sizes, want)
                    for k in range(spec.stages)}
                issued += 1
            out = self._wait_all(sent.pop(b), spec.step_timeout_s, f"evaluating {after} (eval batch {b})",
                                 EvalResult)
            loss_sum += out[last].loss_sum or 0.0  # the last stage's: it always has one
            samples += out[last].samples
            if out[0].weights is not None:
                weights = {name: t for k in range(spec.stages) for name, t in (out[k].weights or {}).items()}
        m = EvalMetrics(step=position - 1 if position else None, eval_loss=loss_sum / samples,
                        eval_samples=samples, eval_time_s=time.perf_counter() - t0, attempt=self.attempt_no)
        if self.on_eval is not None:
            self.on_eval(m, weights)
        return m

    def _look_for_a_partition(self, step: int, looking: Looking | None) -> Looking | None:
        """No stage has finished a step for a while: ask each stage what it is doing, and judge the answers
        at the next look. This never waits: a stage cut off must not hold up the attempt (nor a SIGTERM).

        If every stage is waiting on a neighbour, and has been for peer_timeout_s, none computing, the data
        between them is not arriving (a partition between workers that still reach the coordinator, which
        heartbeats cannot see): fail now, not at step_timeout_s. A stage that is computing, or idle, or
        does not answer in time proves nothing.
        """
        spec, top = self.spec, self.topology
        if looking is not None and all(f.done() for f in looking.answers):
            seen = []
            for k, f in enumerate(looking.answers):
                try:
                    state, what, seconds = f.value()
                except Exception:  # no answer: the heartbeats and step_timeout_s judge that
                    return None
                if state != "waiting" or seconds < spec.peer_timeout_s:
                    return None
                seen.append(f"{top.name(k)} for {what}")
            raise JobFailed(f"step {step}: every stage has waited on its neighbours for {spec.peer_timeout_s:.0f}s "
                            f"or more, none computing (a network partition between workers?): {'; '.join(seen)}",
                            cause=Cause.PEER)
        if looking is not None and time.monotonic() < looking.since + LOOK_TIMEOUT_S:
            return looking  # answers still to come
        return Looking([self.stages[k].rpc_async(timeout=LOOK_TIMEOUT_S).activity() for k in top.ranks()],
                       time.monotonic())

    def snapshot_after(self, step: int) -> bool:
        """Whether step `step` ends with a checkpoint."""
        every = self.spec.checkpoint_every
        return step == self.spec.steps - 1 or (every is not None and (step + 1) % every == 0)

    def _report(self, step: int, per_stage: dict[int, StepResult], step_time: float) -> None:
        """One step's metrics out of every worker's answer (per_stage: by rank)."""
        spec, top = self.spec, self.topology
        # Each replica's last stage summed its shard's losses, each weighted by its micro-batch's size.
        loss = sum(per_stage[top.rank(r, spec.stages - 1)].loss_sum or 0.0 for r in range(top.replicas))
        loss /= spec.data.batch_size
        results = [per_stage[rank] for rank in top.ranks()]
        busy = sum(s.busy_s for s in results)
        span = sum(s.busy_s + s.idle_s for s in results)
        last = per_stage[spec.stages - 1]  # fp16: one scale for the job, the same on every rank; replica 0's says
        self.on_step(StepMetrics(
            step=step, loss=loss, lr=lr_at(spec, step), step_time_s=step_time,
            samples_per_s=spec.data.batch_size / step_time if step_time > 0 else 0.0,
            grad_norm=per_stage[0].grad_norm, bubble_fraction=1.0 - busy / span if span > 0 else 0.0,
            attempt=self.attempt_no, stages=[s.metrics() for s in results], replicas=replica_figures(top, results),
            loss_scale=last.loss_scale, skipped=last.skipped,
        ))



def _span(per_stage: dict[int, StepResult]) -> float:
    """A step's time as its stages measured it: the longest any of them took, from its start to its optimizer
    step (for a step that waited behind an evaluation, which the coordinator's clock cannot tell apart)."""
    return max(s.busy_s + s.idle_s for s in per_stage.values())


def replica_figures(top: Topology, results: list[StepResult]) -> list[dict[str, Any]]:
    """Per replica, out of its stages' answers (by rank): its step time (its slowest stage's, the optimizer
    step included), its stages' busy seconds, its bubble, and the longest any of its stages waited for the
    gradient sums across replicas after its backward (reduce_s: idle, not busy)."""
    out = []
    for r in range(top.replicas):
        own = [results[rank] for rank in top.replica_ranks(r)]
        busy, span = sum(s.busy_s for s in own), sum(s.busy_s + s.idle_s for s in own)
        out.append({"replica": r, "step_time_s": max(s.busy_s + s.idle_s for s in own), "busy_s": busy,
                    "bubble_fraction": 1.0 - busy / span if span > 0 else 0.0,
                    "reduce_s": max(s.reduce_s or 0.0 for s in own)})
    return out


def stage_config(plan: Plan, k: int, device: str, store_host: str, store_port: int,
                 replica: int = 0) -> StageConfig:
    """StageConfig.of, in the argument order callers outside the driver use."""
    return StageConfig.of(plan, k, replica, device, store_host, store_port)


def save_weights(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file atomically (gpipe.files.atomic_write), with `metadata` in its header."""
    tensors = {k: v.contiguous() for k, v in state.items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def shutdown(graceful: bool, timeout: float = 30.0) -> bool:
    """Leave the RPC world; True if it was left within `timeout`."""
    def leave() -> None:
        try:
            rpc.shutdown(graceful=graceful)
        except RuntimeError:  # never joined: nothing to leave
            pass

    t = threading.Thread(target=leave, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def checkpoint_meta(plan: Plan, step: int) -> dict[str, Any]:
    """The job-level state of a checkpoint taken after `step` steps.

    The data position, the randomness and the LR are functions of the step
    (and the spec), so these record the step and what it means; a resumed job
    checks them against its own plan.
    """
    spec = plan.spec
    batch, n = spec.data.batch_size, len(plan.dataset)  # type: ignore[arg-type]  # torch's Dataset type has no __len__; the plan checked it
    return {
        "job": spec.name, "steps": spec.steps, "stages": spec.stages, "balance": plan.balance,
        "replicas": spec.replicas,  # taken from replica 0: one copy of each stage; it resumes with any count
        "data": {"next_step": step, "samples_seen": step * batch, "epoch": step * batch // n,
                 "offset": step * batch % n, "dataset_len": n, "batch_size": batch, "shuffle": spec.data.shuffle},
        "rng": {"seed": spec.seed, "next_step": step,
                "scheme": "layer l on micro-batch i of step s draws from generators seeded by (seed, s, i, l); "
                          "each stage's generator states are in its shard (rng/...)"},
        "lr_schedule": {"spec": spec.lr_schedule.model_dump(mode="json") if spec.lr_schedule else None,
                        "base_lr": spec.optimizer.lr, "next_lr": lr_at(spec, step) if step < spec.steps else None},
        "time_unix": time.time(),
    }


def check_fits(weights: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    """SpecError unless `weights` has exactly the names, shapes and dtypes of the model's state dict `want`."""
    for name, t in want.items():
        got = weights.get(name)
        if got is None or got.shape != t.shape or got.dtype != t.dtype:
            what = "has no" if got is None else f"has {tuple(got.shape)} {got.dtype} for"
            raise SpecError(f"{where} does not fit the model: it {what} {name} ({tuple(t.shape)} {t.dtype})")
    if set(weights) - set(want):
        raise SpecError(f"{where} does not fit the model: {sorted(set(weights) - set(want))[0]} is not in it")


def resume_parts(plan: Plan, ck: checkpoint.Loaded) -> list[streaming.StageSlice]:
    """Per stage: where its weights, optimizer and RNG state are in checkpoint `ck`, cut by the plan's balance.

    Only the checkpoint's headers are read here; the tensors go from disk to the
    stages (Run.build). The checkpoint names every tensor by the
    un-partitioned model, so it fits any balance; the RNG states are restored
    only when the stage count is the same. A checkpoint that does not fit the
    job (another model or data set) is bad input: SpecError, and no restart would help.
    """
    where = f"checkpoint {ck.path.name}"
    n = len(plan.dataset)  # type: ignore[arg-type]  # torch's Dataset type has no __len__; the plan checked it
    if ck.meta.get("data", {}).get("dataset_len") != n:
        raise SpecError(f"{where} was taken with a data set of {ck.meta.get('data', {}).get('dataset_len')} "
                        f"items; this job's has {n}")
    if ck.step > plan.spec.steps:
        raise SpecError(f"{where} is past the job's last step ({plan.spec.steps})")
    weights = ck.model_entries()
    check_fits(ck.model_shapes(), plan.model.state_dict(), where)
    scalars: dict[str, Any] = {}
    for sh in ck.shards:
        scalars.update(sh.json_state.get("optimizer_state", {}))
    same = len(ck.shards) == plan.spec.stages
    extra = {}
    if plan.spec.precision == "fp16" and (saved := ck.shards[0].json_state.get(LOSS_SCALE)) is not None:
        try:  # the job's one loss scale, the same on every stage: a resumed fp16 job goes on with it
            extra[LOSS_SCALE] = LossScaler.from_state(saved).state()
        except ValueError as e:
            raise SpecError(f"{where}: {e}") from None
    slices = []
    for k in range(plan.spec.stages):
        part = streaming.StageSlice()
        layers = set()
        for name, initial in plan.stage_state(k).items():
            layers.add(layer_of(name))
            if name in weights:
                part.from_disk[model_key(name)] = weights[name]
            elif plan.spec.init == "exact":  # non-persistent buffers are not in a state dict: the model's own
                part.in_memory[model_key(name)] = initial
        for j, sh in enumerate(ck.shards):
            for key in sh.entries:
                optim = key.startswith(OPTIM) and layer_of(key.removeprefix(OPTIM)) in layers
                if optim or (same and j == k and key.startswith(RNG)):
                    part.from_disk[key] = (j, key)
                    dtype, shape, _, _ = sh.entries[key]
                    part.declared[key] = (stream.DTYPES[dtype], shape)
        groups = ck.shards[k if same else 0].json_state.get("param_groups", [])
        part.json_state = {"param_groups": groups, "optimizer_state": scalars, **extra}
        slices.append(part)
    return slices


def write_plan(out: Path, plan: Plan, placement: list[dict[str, Any]]) -> None:
    """plan.json: the balance, what it was chosen by, where each stage runs (replica 0's copy), and every
    worker by rank: its replica, stage and placement (`placement`, by rank)."""
    spec, top = plan.spec, plan.spec.topology
    atomic_write_json(out / "plan.json", {
        "balance": plan.balance,
        "balance_by": plan.balance_by,
        "layer_costs": plan.balance_costs,
        "replicas": spec.replicas,
        "stages": [
            {"stage": k, "layers": list(b), "params": sum(v.numel() for v in plan.stage_state(k).values()),
             **placement[k]}
            for k, b in enumerate(plan.bounds)
        ],
        "workers": [{"rank": n, "replica": top.replica_of(n), "stage": top.stage_of(n), **placement[n]}
                    for n in top.ranks()],
        "spec": spec.model_dump(mode="json"),
    })


class MetricsLog:
    """Appends every `log_every`-th step (and the last) to metrics.jsonl, a line at a time."""

    def __init__(self, out: Path, log_every: int, steps: int):
        self.path = out / "metrics.jsonl"
        self.f = open(self.path, "a+")
        self.f.seek(0, os.SEEK_END)
        if self.f.tell():
            self.f.seek(self.f.tell() - 1)
            if self.f.read(1) != "\n":  # a line cut short by a killed attempt: end it
                self.f.write("\n")
        self.log_every, self.steps = log_every, steps

    def write(self, m: StepMetrics) -> bool:
        if m.step % self.log_every and m.step != self.steps - 1:
            return False
        self._line(asdict(m))
        return True

    def write_eval(self, m: EvalMetrics) -> None:
        """Every evaluation gets its line: {"step", "eval_loss", "eval_samples", "eval_time_s", "attempt"}."""
        self._line(asdict(m))

    def _line(self, values: dict[str, Any]) -> None:
        try:
            self.f.write(json.dumps(values) + "\n")
            self.f.flush()
        except OSError as e:  # a full disk: name the file
            raise JobFailed(f"metrics: {describe_os_error(OSError(e.errno, e.strerror, str(self.path)))}",
                            cause=Cause.DISK) from None

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a write that failed already said so
            self.f.close()


def drive(plan: Plan, out: Path, host: str, port: int, devices: list[str], on_step: Callable[[StepMetrics], None],
          on_checkpoint: Callable[[int, Path, int, float, float], None] | None = None,
          resume: checkpoint.Loaded | None = None, attempt_no: int = 1, on_eval: OnEval | None = None,
          eval_weights: bool = False) -> None:
    """One attempt, start to end: join, build, train (checkpointing), save the weights and the timeline, leave.

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
            raise JobFailed(f"checkpoint: {describe_os_error(e)}", cause=Cause.DISK) from None  # names the path

    run = Run(plan, host, port, devices.__getitem__, on_step, attempt_no, on_eval, eval_weights)

    def check_writer() -> None:  # a checkpoint that cannot be written fails the attempt at once
        try:
            writer.check()
        except OSError as e:
            raise JobFailed(f"checkpoint: {describe_os_error(e)}", cause=Cause.DISK) from None

    run.check = check_writer
    left = False
    try:
        run.join()
        run.build(resume)
        first = resume.step if resume is not None else 0
        run.train(first, on_snapshot)
        try:
            writer.close()
        except OSError as e:
            raise JobFailed(f"checkpoint: {describe_os_error(e)}", cause=Cause.DISK) from None
        # The final checkpoint's weights, read back a piece at a time (or a resumed job's, at its last step).
        ck = checkpoint.open_committed(checkpoint.step_dir(writer.root, spec.steps)) if final else resume
        assert ck is not None  # no final snapshot: resumed at the last step
        checkpoint.export_weights(ck, out / "model.safetensors", {"step": str(spec.steps - 1)})
        try:
            timeline.write(out, spec.trace_step)
        except SpecError as e:  # no such step logged (a job resumed at its end): the weights are what matter
            print(f"gpipe: no timeline drawn: {e}", file=sys.stderr, flush=True)
        run.stages.clear()  # drop the RRefs, so the stages are released as the world is left
        left = shutdown(graceful=True)
        if not left:
            raise JobFailed("the stages did not leave the RPC world in time", cause=Cause.TIMEOUT)
    finally:
        # A failed attempt still commits the snapshots it took: a stop request (SIGTERM) waits for that.
        with contextlib.suppress(ValueError):  # not the main thread: nothing to ignore
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with contextlib.suppress(OSError):
            writer.close(timeout=60)
        if not left:
            shutdown(graceful=False, timeout=5)


def drive_eval(plan: Plan, host: str, port: int, devices: list[str]) -> EvalMetrics:
    """The eval verb's attempt: join, build the stages with the plan's weights, evaluate once, leave.

    The plan evaluates before any step (Plan.evaluate_only); nothing is written.
    """
    run = Run(plan, host, port, devices.__getitem__, lambda m: None)
    left = False
    try:
        run.join()
        run.build()
        m = run.evaluate(0)
        run.stages.clear()
        left = shutdown(graceful=True)
        if not left:
            raise JobFailed("the stages did not leave the RPC world in time", cause=Cause.TIMEOUT)
        return m
    finally:
        if not left:
            shutdown(graceful=False, timeout=5)
