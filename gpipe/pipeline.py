"""gpipe.Pipeline: the whole pipeline in one process, a thread per stage (torchgpipe's API).

    import gpipe
    pipe = gpipe.Pipeline(model, balance=[3, 2, 3], chunks=4)
    output = pipe(inputs)                        # training: every micro-batch forward, fill then drain
    loss_fn(output, targets).backward()          # every micro-batch backward; .grad on model.parameters()
    optimizer.step(); optimizer.zero_grad()

    pipe = gpipe.Pipeline(model, balance=[3, 2, 3], chunks=4, schedule="1f1b")
    loss = pipe.step(inputs, targets, loss_fn)   # a loss per micro-batch: any schedule
    with torch.no_grad():
        out = pipe(inputs)                       # forward only, in eval mode, without gradients

In training mode with gradients enabled, `pipe(x)` returns the batch's output
joined along dim 0 and connected to autograd (torchgpipe's contract): any loss
of it, a whole-batch one such as `out.var()` too, backwards through every
micro-batch and stage, and `x` gets its gradient if it requires one. The
parameters' gradients land in their `.grad` during that backward, as with a
reentrant checkpoint (torch.autograd.grad of them sees none). One forward's
state is kept until its backward: the next forward or step drops it, as does
freeing the output.

The stages are the service's own (gpipe.stage), the same interpreter of
the same schedules, linked in memory (gpipe.transport.Hub) instead of by c10d.
Each stage holds the model's own layers, moved to its device, so an optimizer
built over `model.parameters()` works unchanged. The math is the service's:
the returned loss is the sum over micro-batches m of loss_fn(out_m, y_m)·|m|/B,
and gradients, weights and outputs equal one device's on the same
micro-batches (dropout included: layer l of micro-batch i of step s draws from
generators seeded by (seed, s, i, l), gpipe.rng).

On CPU the stages share its cores: this is for tests and for seeing a model
pipelined before it runs on the service. With a GPU per stage (`devices`), it
is torchgpipe's mode: each stage's kernels run on its own device.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch import nn

from gpipe import balance as balancing
from gpipe import batchnorm, cuts, determinism, grad_in_place, options, skip, structure
from gpipe.capture import graph as capture
from gpipe.contract import StageConfig, StepResult, blamed, classify
from gpipe.memory.probe import Recorder
from gpipe.precision import DTYPES, LossScaler
from gpipe.rng import SharedGenerators
from gpipe.stage import (
    Pass,
    Stage,  # the service's own stage: one engine
)
from gpipe.topology import place
from gpipe.transport import Hub, HubClosed
from gpipe.turns import Turns

T = TypeVar("T")
PROBE_SAMPLES = 2  # samples of the first micro-batch that find where skip connections cross stages


class Pipeline:
    """`model` cut into stages of `balance` layers; each batch cut into `chunks` micro-batches: with the gpipe
    schedule as torch.chunk cuts it, as torchgpipe does (a batch of 6 in 4: 2, 2, 2; a batch smaller than
    `chunks`: a sample each), with the others into exactly `chunks` as torch.tensor_split does (6 in 4: 2, 2,
    1, 1), as the service does.

    schedule: gpipe (fill-drain), 1f1b, zb-h1 (1f1b with the backward split), interleaved-1f1b or zbv (with
    virtual_stages; gpipe.schedule). activation_checkpoint: always, except_last or never.
    devices: one per stage (default: the CPU for all). precision: fp32, bf16 or fp16 (autocast; fp16 with a
    dynamic loss scale: a step whose gradients overflow leaves every gradient None, so the optimizer skips
    it, and `skipped` says so; `loss_scale` is its initial scale and growth interval, as GradScaler's). deferred_batch_norm: BatchNorm's running statistics from the whole batch, once
    a step. replicas: copies of the pipeline, each on a contiguous shard of the batch, their gradients summed
    (the model's own layers are replica 0's). seed: the layers' randomness. timeout_s: bounds every wait of
    a stage on another.
    deterministic: deterministic algorithms for this process from now on (gpipe.determinism; on CUDA, weights
    then equal one GPU's to the bit). Stages on a GPU each run on a CUDA stream of their own, so stages that share
    a GPU overlap; the caller's current device and streams are left as they were.
    virtual_stages: model chunks per worker, for schedules interleaved-1f1b and zbv (2): `balance` then counts
    model chunks (`stages` still counts workers, as in the job spec), model chunk c runs on worker c mod workers (zbv: worker k holds model chunks k
    and 2*workers-1-k, a V: gpipe.topology.place), `devices` lists the workers', and interleaved-1f1b's
    `chunks` (micro-batches) must be a multiple of the workers (gpipe.turns: a stage per model chunk, the
    worker's model chunks taking turns).
    """

    def __init__(self, model: nn.Module, balance: Sequence[int] | None = None, chunks: int = 1,
                 schedule: str = "gpipe", activation_checkpoint: str = "never",
                 devices: Sequence[str | torch.device] | None = None, precision: str = "fp32",
                 deferred_batch_norm: bool = False, replicas: int = 1, seed: int = 0,
                 loss_scale: tuple[float, int] = (LossScaler.INIT, LossScaler.GROWTH_INTERVAL),
                 timeout_s: float = 300.0, split_points: Sequence[str] | None = None, stages: int | None = None,
                 output: str | None = None, virtual_stages: int = 1, deterministic: bool = False):
        self.original = model
        self.split_points = list(split_points or [])
        self.output = output
        self.captured: capture.Captured | None = None
        self._want: list[int] | None = None  # blocks per stage, for a model captured at the first call
        if isinstance(model, nn.Sequential):
            if split_points or stages is not None or output is not None:
                raise ValueError("split_points, stages, output: for a model that is not an nn.Sequential (an "
                                 "nn.Sequential is cut between its layers by balance)")
            balance = list(balance or [])
            if not balance or any(type(n) is not int or n < 1 for n in balance):
                raise ValueError(f"balance: {balance} must be positive layer counts")
            if why := cuts.misfit(balance, len(model)):
                raise ValueError(why)
        else:
            given = [n for n, v in (("balance", balance), ("split_points", split_points), ("stages", stages))
                     if v is not None]
            if len(given) != 1:
                raise ValueError("a model that is not an nn.Sequential is cut by one of split_points (names of "
                                 "submodules), balance (blocks per stage) or stages (its blocks balanced by "
                                 f"parameters); got {', '.join(given) or 'none'}")
            if stages is not None and (type(stages) is not int or stages < 1):
                raise ValueError(f"stages: must be a positive int, got {stages!r}")
            if balance is not None:
                balance = list(balance)
                if not balance or any(type(n) is not int or n < 1 for n in balance):
                    raise ValueError(f"balance: {balance} must be positive block counts")
            # stages: workers, as in the job spec (with virtual stages, each holds virtual_stages model chunks)
            count = len(balance) if balance is not None \
                else stages * (virtual_stages if type(virtual_stages) is int and virtual_stages > 0 else 1) \
                if stages is not None else len(self.split_points) + 1
            self._want = balance
            balance = [1] * count  # stage count only, until the model is captured at the first call
        assert balance is not None
        workers = len(balance) // virtual_stages if type(virtual_stages) is int and virtual_stages > 0 else 1
        if why := options.violation(schedule, max(workers, 1), virtual_stages, chunks, activation_checkpoint):
            raise ValueError(why)  # the rules the service's spec keeps too
        if len(balance) % virtual_stages:
            raise ValueError(f"balance: {len(balance)} model chunks do not make workers of {virtual_stages} model "
                             "chunks each")
        if precision not in DTYPES:
            raise ValueError(f"precision: {precision!r} is not one of {', '.join(DTYPES)}")
        if type(replicas) is not int or replicas < 1:
            raise ValueError(f"replicas: must be a positive int, got {replicas!r}")
        if replicas > 1 and not deferred_batch_norm and \
                (name := batchnorm.per_replica(model, sync_across_processes=False)) is not None:
            layer = model.get_submodule(name.split(".", 1)[0])
            raise ValueError(f"deferred_batch_norm: layer {name.split('.', 1)[0]} ({type(layer).__name__}) tracks "
                             "running statistics, which with replicas equal one device's only when deferred")
        devs = [torch.device(d) for d in devices] if devices is not None else [torch.device("cpu")] * workers
        if len(devs) != workers:
            raise ValueError(f"devices: {len(devs)} given for {workers} stages")
        self.model: nn.Sequential | None = model if isinstance(model, nn.Sequential) else None
        self.balance, self.chunks, self.replicas = balance, chunks, replicas
        self.devices = devs
        self.skipped: bool | None = None  # fp16: whether the last step overflowed (and left no gradients)
        # The stages' figures of the last step, by replica and stage (model chunk, with virtual stages): each
        # one's timeline says when each of its actions ran.
        self.results: list[StepResult] = []
        if type(deterministic) is not bool:
            raise ValueError(f"deterministic: must be true or false, got {deterministic!r}")
        if deterministic:
            determinism.enable()  # process-wide, from now on: before the stages' first product on a GPU
        self._settings = dict(schedule=schedule, virtual_stages=virtual_stages,
                              activation_checkpoint=activation_checkpoint, precision=precision,
                              deferred_batch_norm=deferred_batch_norm, seed=seed, loss_scale=tuple(loss_scale),
                              deterministic=deterministic)
        self._timeout = timeout_s
        self._pending: weakref.ref[_Forwarded] | None = None  # the training forward awaiting its backward
        self._steps = 0  # steps run: the randomness of the next is seeded with it
        self._evals = 0
        self._stages: list[Stage] = []  # by rank: built at the first call
        self._hub = Hub(len(balance), replicas, timeout_s)
        self._rng = SharedGenerators()
        self._pool = ThreadPoolExecutor(max_workers=len(balance) * replicas, thread_name_prefix="gpipe-stage")
        # With virtual stages, the model chunks of each worker of each replica take turns (gpipe.turns).
        self._turns = [[Turns() for _ in range(workers)] for _ in range(replicas)] if virtual_stages > 1 else []
        self.bounds = cuts.bounds(balance)

    # -- building ---------------------------------------------------------------------------------

    def _capture(self, sample: Any) -> nn.Sequential:
        """A model that is not an nn.Sequential, captured on its first micro-batch and cut into pieces
        (gpipe.capture.graph); the balance then counts pieces."""
        stages = len(self.balance)
        # Traced where the model is (its inputs may be on another device: the stages move them to theirs).
        weight = next(iter([*self.original.parameters(), *self.original.buffers()]), None)
        if weight is not None:
            sample = structure.to(sample, weight.device)
        try:
            c = capture.capture(self.original, sample, self.split_points, self.output)
        except capture.CaptureError as e:
            raise ValueError(str(e)) from None
        if self.split_points:
            self.balance = capture.balance_of_cuts(c.cuts, len(c.pieces))
        elif self._want is not None:
            if why := cuts.misfit(self._want, len(c.pieces), f"blocks ({c.blocks})"):
                raise ValueError(why)
            self.balance = list(self._want)
        else:
            if why := cuts.shortfall(stages, len(c.pieces), f"{stages} stages", f"blocks ({c.blocks})"):
                raise ValueError(why)
            self.balance = balancing.partition(balancing.param_costs(c.pieces), stages)
        self.bounds = cuts.bounds(self.balance)
        for group in c.tied:
            held = {self._device(k) for k in cuts.holders(group, self.balance)}
            if len(held) > 1:
                raise ValueError(f"devices: {capture.model_name(group[0])} is one parameter used on "
                                 f"{len(held)} devices; put its stages on one device")
        self.captured = c
        return c.pieces

    def _device(self, model_chunk: int) -> torch.device:
        """The device of model chunk `model_chunk`: its worker's (the stage's, with one model chunk a worker)."""
        return self.devices[self._worker(model_chunk)]

    def _worker(self, model_chunk: int) -> int:
        """The worker holding model chunk `model_chunk` (gpipe.topology.place)."""
        return place(str(self._settings["schedule"]), model_chunk, len(self.devices))[0]

    def _build(self, sample: Any) -> None:
        """The stages, one per model chunk, at the first call: skip connections that cross a cut are found on
        `sample` first."""
        model_chunks = len(self.balance)
        if self.model is None:
            self.model = self._capture(sample)
            routes: list[cuts.Route] = []
        else:
            for k, (start, end) in enumerate(self.bounds):  # in place: the model's own parameters
                for i in range(start, end):
                    self.model[i].to(self._device(k))
            routes = self._skip_routes(sample)
        model = self.model
        for r in range(self.replicas):
            # Replica 0 is the model's own parameters; a copy of the whole model keeps a tied weight one tensor.
            own = model if r == 0 else copy.deepcopy(model)
            first_holder: dict[int, int] = {}  # a parameter shared by stages: the first finishes its gradient
            for k, (start, end) in enumerate(self.bounds):
                for i in range(start, end):
                    for p in own[i].parameters():
                        first_holder.setdefault(id(p), k)
            # A parameter used by two stages is one tensor here (GPT-2's embedding and head).
            shared = any(first_holder[id(p)] != k for k, (start, end) in enumerate(self.bounds)
                         for i in range(start, end) for p in own[i].parameters())
            for k, (start, end) in enumerate(self.bounds):  # their backwards on two stages' threads
                for i in range(start, end):
                    for p in own[i].parameters():
                        if first_holder[id(p)] != k:
                            grad_in_place.exclude(p)
            for k, (start, end) in enumerate(self.bounds):
                layers = cuts.layers(own, start, end)
                layers = layers.to(self._device(k))  # in place: the model's own parameters, on the stage's device
                capture.to_device(layers, self._device(k))  # a captured piece's graph names the device it was traced on
                grad_in_place.fuse(layers)  # large linears: weight gradients into .grad, deferred to W when split
                elsewhere = frozenset(id(p) for p in layers.parameters() if first_holder[id(p)] != k)
                cfg = StageConfig(
                    model_chunk=k, model_chunks=model_chunks, start=start, end=end, model_factory="", model_args={},
                    optimizer="",
                    optimizer_args={}, loss="", chunks=self.chunks, clip_grad_norm=None,
                    device=str(self._device(k)), step_timeout_s=self._timeout, start_timeout_s=self._timeout,
                    skip_routes=routes, replica=r, replicas=self.replicas, **self._settings)  # type: ignore[arg-type]  # the settings' types are checked above
                transport = self._hub.transport(k, r, self._device(k))
                stage = Stage(cfg, layers, None, transport, optimizer=False, shared_rng=self._rng,
                              finished_elsewhere=elsewhere, shares_tensors=shared)
                if self._turns:
                    stage.turns = self._turns[r][self._worker(k)]
                if stage.device.type == "cuda":  # stages that share a GPU overlap their kernels (torchgpipe)
                    stage.stream = torch.cuda.Stream(stage.device)  # type: ignore[no-untyped-call]
                self._stages.append(stage)

    def _skip_routes(self, sample: Any) -> list[cuts.Route]:
        """(name, stashing stage, popping stage) of each skip connection (gpipe.skip) that leaves its stage:
        found by running the first samples forward in eval mode, without gradients, changing nothing."""
        assert self.model is not None
        x = structure.map_tensors(sample, lambda t: t[:PROBE_SAMPLES])
        rec = Recorder()
        buffers = [(b, b.clone()) for b in self.model.buffers()]
        modes = [(m, m.training) for m in self.model.modules()]  # each module's own (a BatchNorm kept in eval)
        self.model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(), skip.use(rec):
                for k, (start, end) in enumerate(self.bounds):
                    x = structure.to(x, self._device(k))
                    for i in range(start, end):
                        rec.layer = i
                        for s in rec.skips.values():
                            s.sent = s.sent.to(self._device(k))
                        x = self.model[i](x)
                rec.check()  # a stash that no later layer pops: named now
        finally:
            for m, mode in modes:
                m.training = mode
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
        return cuts.routes(rec.routes(), self.balance)

    # -- running ----------------------------------------------------------------------------------

    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of every micro-batch of (inputs, targets); the batch's loss.

        The gradients are added to the parameters' `.grad`, as one backward of the whole batch's mean loss
        would add them. Every tensor in `inputs` and `targets` has the batch on dim 0.
        """
        self._drop_pending()
        batch = self._batch(inputs)
        xs, ys = self._shards(inputs, batch, "inputs"), self._shards(targets, batch, "targets")
        if not self._stages:
            self._build(xs[0][0][0])
        self._sync_replicas()
        last = len(self.balance) - 1
        step = self._steps

        def run(stage: Stage) -> StepResult:
            r, k = stage.cfg.replica, stage.cfg.model_chunk
            (inp, sizes), (tgt, _) = xs[r], ys[r]
            if k == last:
                stage.loss_fn = loss_fn
            return stage.step(step, 0.0, inp if k == 0 else None, tgt if k == last else None, sizes, batch)

        results = self._run(run)
        self._steps += 1
        self._after_step(results)
        loss = sum(res.loss_sum for res in results if res.loss_sum is not None) / batch
        return torch.tensor(loss, dtype=torch.float32)

    def _after_step(self, results: list[StepResult]) -> None:
        """A step's backwards are done: its figures, and fp16's overflow."""
        self.results = results
        scaled = [res.skipped for res in results if res.skipped is not None]
        self.skipped = any(scaled) if scaled else None
        if self.skipped:  # fp16 overflowed: no gradients, so the optimizer's step changes nothing
            for p in self.original.parameters():
                p.grad = None

    def __call__(self, inputs: Any) -> Any:
        """The model's output on `inputs`, every micro-batch forward through the stages.

        In training mode with gradients enabled: the gpipe schedule's forwards, and an output connected to
        autograd (the module's docstring). Under torch.no_grad() or in eval mode: forward only, in eval mode,
        without gradients (the model's buffers and training mode are left as they were)."""
        self._drop_pending()
        if torch.is_grad_enabled() and self.original.training:
            return self._train_forward(inputs)
        with torch.no_grad():
            return self._eval_forward(inputs)

    def _eval_forward(self, inputs: Any) -> Any:
        batch = self._batch(inputs)
        cut = self._cut(batch, "inputs")
        parts = structure.split(inputs, len(cut), batch, "inputs", sizes=cut)
        sizes = [structure.tensors(p)[0].size(0) for p in parts]
        if not self._stages:
            self._build(parts[0])
        self._sync_replicas()
        n = self._evals
        self._evals += 1
        results = self._run(lambda s: s.evaluate(n, parts if s.cfg.model_chunk == 0 else None, None, sizes),
                            replicas=1)
        outputs = next(res.outputs for res in results if res.outputs is not None)
        return _gather(outputs)

    def _train_forward(self, inputs: Any) -> Any:
        """`pipe(x)` in training: the forwards now, the backwards when autograd reaches the output (_Joined)."""
        schedule = self._settings["schedule"]
        if schedule != "gpipe":
            raise ValueError(f"pipe(inputs) in training runs the gpipe schedule (every forward, then every backward); "
                             f"schedule {schedule!r} needs the loss of each micro-batch: use "
                             "pipe.step(inputs, targets, loss_fn)")
        batch = self._batch(inputs)
        # The inputs as leaves of the stages' graphs: their gradients come back to the caller's tensors through
        # _Joined's backward.
        given = structure.tensors(inputs)
        leaves = structure.map_tensors(
            inputs, lambda t: t.detach().requires_grad_(t.requires_grad and (t.is_floating_point() or t.is_complex())))
        xs = self._shards(leaves, batch, "inputs")
        if not self._stages:
            self._build(xs[0][0][0])
        self._sync_replicas()
        step = self._steps
        self._steps += 1
        last = len(self.balance) - 1

        def run(stage: Stage) -> Pass:
            parts, sizes = xs[stage.cfg.replica]
            return stage.forward_pass(step, parts if stage.cfg.model_chunk == 0 else None, sizes, batch)

        forwarded = _Forwarded(self, self._run(run), structure.tensors(leaves), [sizes for _, sizes in xs])
        self._pending = weakref.ref(forwarded)
        outputs = [forwarded.passes[r * (last + 1) + last].outputs[mb]
                   for r in range(self.replicas) for mb in range(len(xs[r][1]))]
        differentiable = [t for t in given if t.requires_grad]
        it = iter(_Joined.apply(forwarded, _anchor(), *differentiable))  # type: ignore[no-untyped-call]  # torch leaves apply unannotated
        return structure.map_tensors(outputs[0], lambda _t: next(it))

    def _drop_pending(self) -> None:
        """A forward's state that no backward took: the next forward or step drops it."""
        pending = self._pending() if self._pending is not None else None
        if pending is not None:
            pending.drop()
        self._pending = None

    def _cut(self, size: int, what: str) -> list[int]:
        """The micro-batch sizes of a (replica's) batch of `size`: the gpipe schedule cuts it as torch.chunk does
        (torchgpipe: ceil(size/chunks) each, fewer micro-batches when they do not fill `chunks`); the others,
        whose order depends on the count, into exactly `chunks` as torch.tensor_split does (as the service)."""
        if self._settings["schedule"] == "gpipe":
            return _sizes(size, self.chunks)
        if size < self.chunks:
            raise ValueError(f"{what}: a batch of {size} cannot be cut into {self.chunks} micro-batches (schedule "
                             f"{self._settings['schedule']} runs exactly `chunks`; the gpipe schedule runs fewer)")
        return [len(r) for r in torch.tensor_split(torch.empty(size, 0), self.chunks)]

    def _batch(self, inputs: Any) -> int:
        tensors = structure.tensors(inputs)
        if not tensors or tensors[0].dim() == 0:
            raise ValueError("inputs: expected a tensor (or a structure of them) with the batch on dim 0")
        batch = tensors[0].size(0)
        if batch < self.replicas:
            raise ValueError(f"inputs: a batch of {batch} cannot be shared by {self.replicas} replicas")
        return batch

    def _shards(self, value: Any, batch: int, what: str) -> list[tuple[list[Any], list[int]]]:
        """Per replica: its contiguous shard of `value` cut into micro-batches as torch.chunk cuts it, and their
        sizes."""
        out = []
        for shard in structure.split(value, self.replicas, batch, what):
            size = structure.tensors(shard)[0].size(0)
            cut = self._cut(size, what)
            parts = structure.split(shard, len(cut), size, what, sizes=cut)
            out.append((parts, [structure.tensors(p)[0].size(0) for p in parts]))
        return out

    def _sync_replicas(self) -> None:
        """The replicas' copies take replica 0's weights and buffers (the optimizer stepped those), and drop
        the gradient sums of the step before."""
        if self.replicas == 1 or not self._stages:
            return
        stages = len(self.balance)
        with torch.no_grad():
            for r in range(1, self.replicas):
                for k in range(stages):
                    own = self._stages[k].layers.state_dict()
                    copy = self._stages[r * stages + k].layers
                    for name, t in copy.state_dict().items():
                        t.copy_(own[name])
                    copy.zero_grad(set_to_none=True)

    def _run(self, work: Callable[[Stage], T], replicas: int | None = None) -> list[T]:
        """`work(stage)` for every stage of the first `replicas` replicas, each on its thread; the first error
        any raised (the others stop waiting on it at once)."""
        hub = self._hub
        hub.reset()
        for turns in (t for per_replica in self._turns for t in per_replica):
            turns.reset()
        stages = self._stages[: len(self.balance) * (replicas or self.replicas)]

        def guarded(stage: Stage) -> T:
            try:
                return work(stage)  # on the stage's device and stream (Stage.placed)
            except BaseException as e:
                hub.fail(e)
                for turns in (t for per_replica in self._turns for t in per_replica):
                    turns.fail()
                raise

        # A stage's stream starts after what the caller queued (its inputs, the optimizer's last step), and the
        # caller's streams go on after the stages' (their gradients and outputs).
        streams = [(s.stream, torch.cuda.current_stream(s.device)) for s in stages if s.stream is not None]
        for own, caller in streams:
            own.wait_stream(caller)
        futures: list[Future[T]] = [self._pool.submit(guarded, s) for s in stages]
        errors = [f.exception() for f in futures]
        for own, caller in streams:
            caller.wait_stream(own)
        # The error to name: not a closed hub's or a chunk's that gave up for another (gpipe.contract.blamed).
        first = next((e for e in errors if e is not None and not isinstance(e, HubClosed) and blamed(classify(e))),
                     None) or \
            next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return [f.result() for f in futures]

    def close(self) -> None:
        """End the stages' threads."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sizes(batch: int, chunks: int) -> list[int]:
    """The micro-batch sizes torch.chunk cuts a batch of `batch` into `chunks` with: ceil(batch/chunks) each, the
    last what remains (fewer micro-batches than `chunks` when they do not fill it)."""
    each = -(-batch // chunks)
    return [min(each, batch - i) for i in range(0, batch, each)]


def _anchor() -> torch.Tensor:
    """A tensor that requires grad, so that the joined output does even when no input does (torchgpipe's phony)."""
    return torch.empty(0, requires_grad=True)


class _Forwarded:
    """One training forward's passes (by stage, in Pipeline._stages' order), kept for its backward."""

    def __init__(self, pipe: Pipeline, passes: list[Pass], leaves: list[torch.Tensor], sizes: list[list[int]]):
        self.pipe, self.passes, self.leaves, self.sizes = pipe, passes, leaves, sizes
        self.dropped = False

    def drop(self) -> None:
        self.dropped = True
        for p in self.passes:
            p.drop()

    def backward(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Every stage's backwards from the joined outputs' gradients `grads`; the leaves' gradients."""
        if self.dropped:
            raise RuntimeError("gpipe.Pipeline: this output's forward state was dropped (another forward or step "
                               "ran before its backward, or its backward ran already): call backward before the "
                               "next pipe(inputs) or pipe.step")
        pipe = self.pipe
        stages = len(pipe.balance)
        # Each gradient cut as the outputs were joined: by replica, then micro-batch, along dim 0 (a 0-dim output
        # per micro-batch was stacked: one entry each).
        per_mb: list[list[torch.Tensor]] = []
        offsets = [0] * len(grads)
        last_outputs = [self.passes[r * stages + stages - 1].outputs for r in range(pipe.replicas)]
        for r, sizes in enumerate(self.sizes):
            for mb in range(len(sizes)):
                own = structure.tensors(last_outputs[r][mb])
                cut = []
                for i, (t, g) in enumerate(zip(own, grads, strict=True)):
                    n = t.size(0) if t.dim() else 1
                    piece = g[offsets[i]: offsets[i] + n]
                    cut.append(piece if t.dim() else piece.reshape(()))
                    offsets[i] += n
                per_mb.append(cut)
        by_replica, start = [], 0
        for sizes in self.sizes:
            by_replica.append(per_mb[start: start + len(sizes)])
            start += len(sizes)
        passes = {id(s): p for s, p in zip(pipe._stages, self.passes, strict=True)}
        self.dropped = True
        try:
            results = pipe._run(lambda s: s.backward_pass(passes[id(s)], by_replica[s.cfg.replica]
                                                          if s.cfg.model_chunk == stages - 1 else None))
        finally:
            self.drop()
        pipe._after_step(results)
        return [t.grad for t in self.leaves if t.requires_grad]


class _Joined(torch.autograd.Function):
    """The micro-batches' outputs joined along dim 0; its backward runs the pipeline's backwards."""

    @staticmethod
    def forward(ctx: Any, forwarded: _Forwarded, anchor: torch.Tensor, *inputs: torch.Tensor) -> Any:
        ctx.forwarded = forwarded
        stages = len(forwarded.pipe.balance)
        outputs = [forwarded.passes[r * stages + stages - 1].outputs[mb]
                   for r, sizes in enumerate(forwarded.sizes) for mb in range(len(sizes))]
        joined = tuple(structure.tensors(_gather(outputs)))
        ctx.mark_non_differentiable(*[t for t in joined if not (t.is_floating_point() or t.is_complex())])
        return joined

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        got = ctx.forwarded.backward(grads)
        return (None, None, *got)


def _gather(parts: list[Any]) -> Any:
    """The micro-batches' outputs put back together along dim 0 (what is not a tensor: the first's)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else torch.stack(parts)
    if type(first) in (tuple, list):
        return type(first)(_gather([p[i] for p in parts]) for i in range(len(first)))
    if type(first) is dict:
        return {k: _gather([p[k] for p in parts]) for k in first}
    return first
