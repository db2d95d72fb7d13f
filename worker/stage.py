"""One pipeline stage: its layers, its optimizer, and the step that runs a schedule.

The stage gets everything it needs from the coordinator (the layer range, the
initial weights, each step's inputs or targets and LR), so it can be thrown
away and rebuilt at any time.
"""

from __future__ import annotations

import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout

from gpipe import batchnorm, evaluation, init, schedule, skip, structure
from gpipe import state as layout
from gpipe.contract import EvalResult, StageConfig, StepResult
from gpipe.factory import add_import_paths, resolve
from gpipe.memory import ActivationMeter
from gpipe.net import client_store
from gpipe.optim import optimizer_class
from gpipe.precision import Precision
from gpipe.recompute import Buffers
from gpipe.rng import seeded_forward
from gpipe.state import StageState
from gpipe.topology import Topology
from gpipe.worker.channel import Receiver, Sender, gradient_message, gradients, wants_grad
from gpipe.worker.reducer import GradReducer
from gpipe.worker.skips import Routed, SkipLinks


def build_layers(cfg: StageConfig, state: dict[str, torch.Tensor] | None, device: torch.device) -> nn.Sequential:
    """The stage's slice of the model, holding `state` (the coordinator's weights) when given.

    The factory runs on the meta device, so no full model is materialised here;
    a model that cannot be built there (or keeps plain tensors that are no
    parameters or buffers) is built on the CPU instead. With no `state`, the
    layers are initialised here (init per_layer), or left empty for weights
    sent in pieces (worker.streaming).
    """
    add_import_paths(cfg.import_paths)  # the job's folder: its model's module lives there
    factory = resolve(cfg.model_factory)
    hook = resolve(cfg.init_hook) if cfg.init_hook else None
    per_layer = state is None and cfg.init == "per_layer"

    def sliced(model: nn.Sequential) -> nn.Sequential:
        return nn.Sequential(OrderedDict((str(i), model[i]) for i in range(cfg.start, cfg.end)))

    layers = None
    try:
        with torch.device("meta"):
            layers = sliced(factory(**cfg.model_args))
        if any(isinstance(v, torch.Tensor) and v.is_meta for m in layers.modules() for v in vars(m).values()):
            layers = None
        elif per_layer:  # a layer at a time: on the CPU, initialised, then to the device
            for j, i in enumerate(range(cfg.start, cfg.end)):
                layers[j] = init.materialise(layers[j], i, cfg.seed, device, hook)
        else:
            layers = layers.to_empty(device=device)
    except Exception:
        layers = None
    if layers is None:
        layers = sliced(factory(**cfg.model_args))
        if per_layer:
            for j, i in enumerate(range(cfg.start, cfg.end)):
                init.init_layer(layers[j], i, cfg.seed, hook)
        layers = layers.to(device)
    if state is None:
        return layers
    own = dict(layers.named_parameters()) | dict(layers.named_buffers())
    if set(own) != set(state):
        raise RuntimeError(f"stage {cfg.stage}: the coordinator's weights do not match the model built here")
    with torch.no_grad():
        for name, t in own.items():
            t.copy_(state[name])
    return layers


def backward(y: Any, wants: list[bool], grads: list[torch.Tensor],
             more: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
    """Backward from the tensors of `y` that wanted a gradient, with the next stage's gradients for them,
    and from the (tensor, gradient) pairs of `more` (skip connections), in one pass."""
    outs = [t for t, w in zip(structure.tensors(y), wants, strict=True) if w]
    if len(outs) != len(grads):
        raise RuntimeError(f"{len(grads)} gradients came back for {len(outs)} tensors that wanted one")
    pairs = [(t, g) for t, g in [*zip(outs, grads, strict=True), *more] if t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


class Stage:
    """A stage built and joined to its neighbours; `resume` is a checkpoint's optimizer and RNG state."""

    def __init__(self, cfg: StageConfig, state: dict[str, torch.Tensor] | nn.Sequential,
                 resume: StageState | None = None):
        self.cfg = cfg
        self.topology = Topology(cfg.stages, cfg.replicas)
        self.rank = self.topology.rank(cfg.replica, cfg.stage)
        self.mb_offset = cfg.replica * cfg.chunks  # replica r's micro-batch i is the step's r*chunks+i
        add_import_paths(cfg.import_paths)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.first, self.last = cfg.stage == 0, cfg.stage == cfg.stages - 1
        # The layers built already (their weights sent in pieces: worker.streaming), or built from `state`.
        self.layers = state if isinstance(state, nn.Sequential) else build_layers(cfg, state, self.device)
        if cfg.deferred_batch_norm:
            batchnorm.convert_deferred_batch_norm(self.layers)
        self.buffers = Buffers(self.layers)  # a recomputed forward leaves running statistics be
        self.indexed = [(int(n), m) for n, m in self.layers.named_children()]
        named = [(n, p) for n, p in self.layers.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = params = [p for _, p in named]
        self.optimizer = optimizer_class(cfg.optimizer)(params, **cfg.optimizer_args) if params else None
        self.precision = Precision(cfg.precision, self.device, resume.loss_scale if resume is not None else None,
                                   *cfg.loss_scale)
        if resume is not None:
            self._restore(resume)
        self.loss_fn = resolve(cfg.loss) if self.last else None
        self.meter = ActivationMeter(list(self.layers.parameters()))
        self._activity_lock = threading.Lock()
        self._activity: tuple[str, str, float] = ("idle", "", time.monotonic())
        self._init_data_plane()

    def _doing(self, state: str, what: str = "") -> None:
        """What the stage does now: idle (between steps), computing, or waiting on a neighbour for `what`."""
        with self._activity_lock:
            self._activity = (state, what, time.monotonic())

    def activity(self) -> tuple[str, str, float]:
        """(idle | computing | waiting, what it waits for, seconds since it began): the coordinator tells a
        partition between workers (every stage waiting) from a slow stage (one computing)."""
        with self._activity_lock:
            state, what, since = self._activity
        return state, what, time.monotonic() - since

    def _init_data_plane(self) -> None:
        """Join the data plane's process groups (gpipe.topology): one c10d world of replicas x stages ranks.

        Forming it may take start_timeout_s, each step's waits step_timeout_s. Every rank forms every group,
        in one order, as torch requires; each keeps those it is in.
        """
        cfg, top, me = self.cfg, self.topology, self.rank
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        start, step = timedelta(seconds=cfg.start_timeout_s), timedelta(seconds=cfg.step_timeout_s)
        store = dist.PrefixStore("data", client_store(cfg.store_host, cfg.store_port, cfg.start_timeout_s))
        dist.init_process_group(backend, store=store, rank=me, world_size=top.world, timeout=start)
        _set_pg_timeout(step, None)  # formed: a collective of every rank waits at most a step's timeout

        def per_replica(stages: list[int]) -> dist.ProcessGroup:
            """A group of `stages` in each replica, formed by every rank; this rank's own (GroupMember.NON_GROUP_MEMBER
            when this rank's stage is not among `stages`)."""
            own: dist.ProcessGroup = dist.GroupMember.NON_GROUP_MEMBER  # type: ignore[assignment]  # torch's sentinel
            for r in range(top.replicas):
                ranks = [top.rank(r, k) for k in stages]
                group = dist.new_group(ranks, backend=backend, timeout=start)
                if me in ranks:
                    # The channels pass the step's timeout to each send and receive too, since gloo keeps
                    # its connect timeout for those.
                    _set_pg_timeout(step, group)
                    own = group
            return own

        # One group per direction, so each communicator carries one ordered stream.
        every_stage = list(range(top.stages))
        forward, backward = per_replica(every_stage), per_replica(every_stage)
        # The gradient-clipping norm: over one replica's stages (after the replicas' gradients are summed,
        # they are the same in every replica). The world's default group when there is one replica.
        self.replica_group = per_replica(every_stage) if top.replicas > 1 else None
        # The copies of this stage: they sum their gradients (and deferred BatchNorm's statistics).
        self.reducer: GradReducer | None = None
        self.stage_group: dist.ProcessGroup | None = None
        if top.replicas > 1:
            for k in range(top.stages):
                group = dist.new_group(top.stage_ranks(k), backend=backend, timeout=start)
                if k == cfg.stage:
                    _set_pg_timeout(step, group)
                    self.stage_group = group
            if self.params and self.stage_group is not None:
                self.reducer = GradReducer(self.params, self.stage_group, cfg.step_timeout_s)
        k, t, peer = cfg.stage, cfg.step_timeout_s, self._peer
        self.recv_act = None if self.first else Receiver(peer(k - 1), forward, self.device,
                                                         f"stage {k - 1}'s activation", t)
        self.send_act = None if self.last else Sender(peer(k + 1), forward, self.device,
                                                      f"activation to stage {k + 1}", t)
        self.recv_grad = None if self.last else Receiver(peer(k + 1), backward, self.device,
                                                         f"stage {k + 1}'s gradient", t)
        self.send_grad = None if self.first else Sender(peer(k - 1), backward, self.device,
                                                        f"gradient to stage {k - 1}", t)

        routes = [(n, a, b) for n, a, b in cfg.skip_routes]
        self.skips = SkipLinks(k, routes, self.device, t, per_replica, peer)
        self.channels = [c for c in (self.recv_act, self.send_act, self.recv_grad, self.send_grad) if c] + \
            self.skips.channels()

    def _peer(self, stage: int) -> int:
        """The rank of `stage` in this stage's replica: its neighbours on the data plane."""
        return self.topology.rank(self.cfg.replica, stage)

    def autocast(self) -> Any:
        """The context every forward of this stage runs in (autocast for bf16 and fp16)."""
        return self.precision.autocast()

    def checkpointed(self, mb: int) -> bool:
        mode = self.cfg.activation_checkpoint
        return mode == "always" or (mode == "except_last" and mb != self.cfg.chunks - 1)

    def step(
        self, step: int, lr: float, inputs: list[Any] | None, targets: list[Any] | None, sizes: list[int],
    ) -> StepResult:
        """Run one step of the schedule, then the optimizer; return the step's figures."""
        cfg, dev, timeout = self.cfg, self.device, self.cfg.step_timeout_s
        chunks, batch = len(sizes), cfg.batch_size or sum(sizes)
        t_step, start_unix = time.perf_counter(), time.time()
        loss_scale = self.precision.loss_scale  # fp16: this step's; 1 otherwise
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        batchnorm.discard(self.layers)  # what a failed step tracked
        if self.reducer is not None:
            self.reducer.reset()  # what a failed step reduced
        if self.recv_act:
            self.recv_act.expect(chunks)
        self.skips.expect(chunks)
        bytes_before = [c.bytes for c in self.channels]
        self.meter.reset_peak()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        in_flight: dict[int, tuple[Any, ...]] = {}  # forwarded micro-batches, until their backward
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        timeline: list[tuple[str, int, float, float]] = []
        busy = 0.0

        def forward(mb: int, x: Any, ctx: Routed) -> Any:
            with skip.use(ctx), self.autocast():
                y = seeded_forward(self.indexed, x, cfg.seed, step, self.mb_offset + mb)
            ctx.out = self.precision.cut(ctx.out)  # what leaves the stage travels in the autocast dtype
            if self.last:
                target = structure.to(targets[mb], dev)  # type: ignore[index]  # the last stage gets targets
                y = self.loss_fn(self.precision.for_loss(y), target)  # type: ignore[misc]  # the last stage has a loss
            else:
                y = self.precision.cut(y)
            return y

        self._doing("computing")
        actions = schedule.build(cfg.schedule, cfg.stage, cfg.stages, chunks)
        last_backward = max(i for i, a in enumerate(actions) if a.kind == "B")
        for n, action in enumerate(actions):
            mb = action.micro_batch
            if n == last_backward and self.reducer is not None:
                self.reducer.arm()  # this backward's gradients are final: sum them across replicas as they come
            if action.kind == "F":
                if self.first:
                    x = structure.to(inputs[mb], dev)  # type: ignore[index]  # the first stage gets inputs
                else:
                    self._doing("waiting", f"stage {cfg.stage - 1}'s activation of micro-batch {mb}")
                    # Its tensors that want a gradient back require grad.
                    x = self.recv_act.get(mb, timeout)  # type: ignore[union-attr]  # every stage but the first receives
                    self._doing("computing")
                arrived = {}
                if self.skips.recv:
                    self._doing("waiting", f"the skip connections of micro-batch {mb}")
                    arrived = self.skips.receive(mb, timeout)
                    self._doing("computing")
                t0 = time.perf_counter()
                ckpt = self.checkpointed(mb)
                ctx = self.skips.context(arrived)
                with torch.no_grad() if ckpt else self.meter.hooks(), self.buffers.watch():
                    y = forward(mb, x, ctx)
                skip_wants = self.skips.send_forward(mb, ctx.out, ckpt)
                wants: list[bool] = []
                if self.last:
                    loss_sum += y.detach().double() * sizes[mb]
                else:
                    wants = wants_grad(y, ckpt)
                    self.send_act.send(mb, structure.map_tensors(y, torch.Tensor.detach), wants)  # type: ignore[union-attr]  # every stage but the last sends
                    if any(wants):
                        self.recv_grad.expect(1)  # type: ignore[union-attr]  # every stage but the last gets gradients
                held_x = [self.meter.hold(t) for t in structure.tensors((x, arrived))] if not self.first else None
                in_flight[mb] = (x, held_x, None if ckpt else y, wants, arrived, None if ckpt else ctx.out, skip_wants)
            else:
                x, held_x, y, wants, arrived, stashed, skip_wants = in_flight.pop(mb)
                grads: list[torch.Tensor] = []
                if any(wants):
                    self._doing("waiting", f"stage {cfg.stage + 1}'s gradient of micro-batch {mb}")
                    grads = gradients(self.recv_grad.get(mb, timeout))  # type: ignore[union-attr]  # wants: not the last
                    self._doing("computing")
                if any(map(any, skip_wants.values())):
                    self._doing("waiting", f"the skip gradients of micro-batch {mb}")
                    skip_grads = self.skips.gradients(mb, skip_wants, timeout)
                    self._doing("computing")
                else:
                    skip_grads = {}
                t0 = time.perf_counter()
                if y is None:  # checkpointed: recompute the forward, replaying its randomness
                    ctx = self.skips.context(arrived)
                    with self.meter.hooks(), self.buffers.recompute():
                        y = forward(mb, x, ctx)
                    stashed = ctx.out
                if self.last:
                    self.precision.scaled(y * (sizes[mb] / batch)).backward()  # fp16: times the loss scale
                else:
                    backward(y, wants, grads, self.skips.pairs(stashed, skip_wants, skip_grads))
                del y, held_x, stashed, skip_grads
                if not self.first:
                    inputs_back = [t for t in structure.tensors(x) if t.requires_grad]
                    if inputs_back:  # the ones that wanted a gradient, in order
                        self.send_grad.send(mb, gradient_message(inputs_back))  # type: ignore[union-attr]  # not the first stage
                self.skips.send_gradients(mb, arrived)
            t1 = time.perf_counter()
            busy += t1 - t0
            timeline.append((action.kind, mb, t0 - t_step, t1 - t_step))

        for sender in self.channels:
            if isinstance(sender, Sender):
                self._doing("waiting", f"{sender.name} to be sent")
                sender.flush(timeout)
        reduce_s = self._reduce_replicas()
        t0 = time.perf_counter()
        skipped = self._unscale() if self.precision.scaler else False
        if cfg.clip_grad_norm and not skipped:
            self._doing("waiting", "the other stages' gradient norms")
        grad_norm = self._clip() if cfg.clip_grad_norm and not skipped else None
        self._doing("computing")
        batchnorm.commit(self.layers)  # deferred BatchNorm: the whole batch's running statistics, once a step
        if self.optimizer is not None and not skipped:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        busy += time.perf_counter() - t0
        step_s = time.perf_counter() - t_step
        self._doing("idle")
        return StepResult(
            rank=cfg.rank,
            stage=cfg.stage,
            replica=cfg.replica,
            reduce_s=reduce_s if cfg.replicas > 1 else None,
            loss_sum=float(loss_sum) if self.last else None,
            grad_norm=grad_norm,
            busy_s=busy,
            idle_s=max(0.0, step_s - busy),
            activation_peak_bytes=self.meter.peak,
            peak_memory_bytes=self._peak_memory(),
            start_unix=start_unix,
            timeline=timeline,  # (F or B, micro-batch, start s, end s) from start_unix
            # Tensor bytes each channel carried this step (headers left out), by the channel's name.
            sent_bytes={c.name: c.bytes - b for c, b in zip(self.channels, bytes_before, strict=True)
                        if isinstance(c, Sender)},
            received_bytes={c.name: c.bytes - b for c, b in zip(self.channels, bytes_before, strict=True)
                            if isinstance(c, Receiver)},
            loss_scale=loss_scale if self.precision.scaler else None,
            skipped=skipped if self.precision.scaler else None,
        )

    def _reduce_replicas(self) -> float:
        """With replicas: wait for the sums of this stage's gradients across replicas (started during the last
        backward), and sum what deferred BatchNorm tracked. Returns the seconds it waited (not busy time)."""
        t0 = time.perf_counter()
        if self.reducer is not None:
            self._doing("waiting", "the other replicas' gradients")
            self.reducer.finish()  # the replicas' sum: one device's gradient on the whole batch
        if self.stage_group is not None:
            batchnorm.all_reduce(self.layers, self.stage_group)  # the whole batch's statistics, every replica's
        return time.perf_counter() - t0

    def evaluate(self, batch: int, inputs: list[Any] | None, targets: list[Any] | None,
                 sizes: list[int]) -> EvalResult:
        """Eval batch `batch` through the stage: its micro-batches forward in order (fill-drain, no backward),
        in eval mode, without gradients. The weights, the buffers and the generators are as they were.

        The last stage returns the batch's summed loss (each micro-batch's mean loss times its size).
        """
        cfg, dev, timeout = self.cfg, self.device, self.cfg.step_timeout_s
        chunks = len(sizes)
        if self.recv_act:
            self.recv_act.expect(chunks)
        self.skips.expect(chunks)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        # A module may update a buffer even in eval mode; and a layer's randomness must not move training's.
        buffers = [(b, b.clone()) for b in self.layers.buffers()]
        was_training = self.layers.training
        self.layers.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
                for mb in range(chunks):
                    tag = evaluation.tag(mb)
                    if self.first:
                        x = structure.to(inputs[mb], dev)  # type: ignore[index]  # the first stage gets inputs
                    else:
                        self._doing("waiting", f"stage {cfg.stage - 1}'s activation of eval micro-batch {mb}")
                        x = self.recv_act.get(tag, timeout)  # type: ignore[union-attr]  # not the first stage
                    arrived = {}
                    if self.skips.recv:
                        self._doing("waiting", f"the skip connections of eval micro-batch {mb}")
                        arrived = self.skips.receive(tag, timeout)
                    self._doing("computing")
                    ctx = self.skips.context(arrived)
                    with skip.use(ctx), self.autocast():  # the training forward's precision
                        y = seeded_forward(self.indexed, x, cfg.seed, evaluation.seed_step(batch), mb)
                    # Nothing requires grad, so no gradient comes back.
                    self.skips.send_forward(tag, self.precision.cut(ctx.out), checkpointed=False)
                    if self.last:
                        target = structure.to(targets[mb], dev)  # type: ignore[index]  # the last stage gets targets
                        loss = self.loss_fn(self.precision.for_loss(y), target)  # type: ignore[misc]  # the last stage has a loss
                        loss_sum += loss.double() * sizes[mb]
                    else:
                        self.send_act.send(tag, self.precision.cut(y))  # type: ignore[union-attr]  # not the last stage
            for sender in self.channels:
                if isinstance(sender, Sender):
                    self._doing("waiting", f"{sender.name} to be sent")
                    sender.flush(timeout)
        finally:
            self.layers.train(was_training)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            self._doing("idle")
        return EvalResult(stage=cfg.stage, loss_sum=float(loss_sum) if self.last else None, samples=sum(sizes),
                          eval_s=time.perf_counter() - t0)

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the stage's state dict on the CPU, under the un-partitioned model's names."""
        return {name: t.detach().to("cpu", copy=True) for name, t in self.layers.state_dict().items()}

    def _unscale(self) -> bool:
        """fp16: divide the loss scale out of this stage's gradients; True, on every stage, when any stage's
        held inf or nan (the step is then skipped everywhere and the scale backs off)."""
        scaler = self.precision.scaler
        assert scaler is not None  # called for fp16 only
        found = scaler.unscale([p.grad for p in self.params if p.grad is not None])
        self._doing("waiting", "the other stages' overflow checks")
        flag = torch.tensor(float(found), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one scale for the job: all ranks skip, or none
        overflow = bool(flag.item())
        scaler.update(overflow)
        return overflow

    def _clip(self) -> float:
        """Clip to the global norm: every stage adds its squares, and all stages share the sum."""
        grads = [p.grad for p in self.params if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            sq += g.detach().double().pow(2).sum()
        dist.all_reduce(sq, group=self.replica_group)  # over all stages' parameters, not this stage's
        norm = float(sq.sqrt())
        coef = self.cfg.clip_grad_norm / (norm + 1e-6)  # type: ignore[operator]  # called only when clip_grad_norm is set
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    def _peak_memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def snapshot(self, copy: bool = True) -> StageState:
        """A copy of everything a resumed stage needs, in the checkpoint layout (gpipe.state).

        Weights, the optimizer's tensors by parameter name (so a checkpoint fits
        any balance) and the generator states on the CPU; the optimizer's
        hyper-parameters and non-tensor state as JSON. With `copy` false, the
        weights and optimizer tensors are the live ones, where they live (to be
        written out before the next step changes them: worker.streaming).
        """
        def out(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", copy=True) if copy else t.detach()

        tensors: dict[str, torch.Tensor] = {}
        for name, t in self.layers.state_dict().items():  # non-persistent buffers are rebuilt, not saved
            tensors[layout.model_key(name)] = out(t)
        scalars: dict[str, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        if self.optimizer is not None:
            for name, p in zip(self.param_names, self.params, strict=True):
                for key, v in self.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        tensors[layout.optim_key(name, key)] = out(v)
                    else:
                        scalars.setdefault(name, {})[key] = v
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        tensors[layout.RNG_CPU] = torch.get_rng_state()
        if self.device.type == "cuda":
            tensors[layout.RNG_CUDA] = torch.cuda.get_rng_state(self.device)
        json_state = {"param_groups": groups, "optimizer_state": scalars, "params": self.param_names}
        if self.precision.scaler is not None:
            json_state[layout.LOSS_SCALE] = self.precision.scaler.state()
        return StageState(tensors, json_state)

    def _restore(self, resume: StageState) -> None:
        """Load the optimizer and RNG state of a checkpoint (the weights came with `state`)."""
        if self.optimizer is not None:
            state: dict[int, dict[str, Any]] = {}
            for i, name in enumerate(self.param_names):
                if entry := resume.optimizer_state_of(name):
                    state[i] = entry
            groups = []
            for g, saved in zip(self.optimizer.param_groups, resume.param_groups, strict=True):
                restored = {k: type(g[k])(v) if isinstance(g.get(k), tuple) else v for k, v in saved.items()}
                groups.append({**restored, "params": list(range(len(g["params"])))})
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        rng = resume.rng()
        if layout.RNG_CPU in rng:
            torch.set_rng_state(rng[layout.RNG_CPU])
        if layout.RNG_CUDA in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng[layout.RNG_CUDA], self.device)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
