"""One pipeline stage: its layers, its optimizer, and the interpreter that runs a schedule's actions.

The stage gets everything it needs from the coordinator (the layer range, the
initial weights, each step's inputs or targets and LR), so it can be thrown
away and rebuilt at any time. A step is: post the receives, interpret the
schedule's actions (`run`: F, B and W, each on one micro-batch), flush the sends,
sum the gradients across replicas, unscale and clip, then the optimizer step.
An eval batch runs the same interpreter, forward only. Whatever links it to
the other stages is its transport (gpipe.transport): c10d between processes,
memory between threads of one process (gpipe.Pipeline).
"""

from __future__ import annotations

import contextlib
import copy
import json
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from gpipe import (
    batchnorm,
    cuts,
    determinism,
    eval_schedule,
    grad_in_place,
    optim,
    schedule,
    skip,
    structure,
    weight_init,
)
from gpipe import state as layout
from gpipe.capture import graph as capture
from gpipe.capture import skeleton
from gpipe.contract import EvalResult, StageConfig, StepResult
from gpipe.factory import add_import_paths, resolve, use_job_code
from gpipe.memory.meter import ActivationMeter, resident_bytes, storage_key
from gpipe.memory.zero import ShardedOptimizer
from gpipe.precision import Precision
from gpipe.recompute import Buffers, checkpointing
from gpipe.rng import SharedGenerators, hooked, seeded_forward, seeding
from gpipe.skiplanes import Routed, SkipLinks
from gpipe.split_backward import WeightGradients, backward_input
from gpipe.state import StageState
from gpipe.topology import place
from gpipe.transport import Inbound, Outbound, Transport
from gpipe.turns import Turns
from gpipe.wire import gradient_message, gradients, wants_grad

# The wall-clock time of perf_counter's zero, read once per process: every stage of a process dates its steps'
# timelines on one clock (reading time.time() beside perf_counter() per step would put each stage's on a clock
# of its own, off by however long a loaded machine paused the thread between the two reads).
_EPOCH_PERF = time.perf_counter()
_NOTHING = contextlib.nullcontext()  # reusable: it keeps no state
_EPOCH_UNIX = time.time()

# A worker builds each of its model chunks (virtual stages) from the same model: a captured model's skeleton is made
# once in a process (or before its join: `warm`); each model chunk's pieces come from the coordinator's capture
# (StageConfig.pieces), or, where it sent none that load, from the process's own (torch.export, seconds for a
# language model), made once and copied by every model chunk. One model at a time: an attempt process serves one job.
_skeletons: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]] = {}  # by the model's factory and arguments
_captures: dict[str, nn.Sequential] = {}  # by those and the capture's arguments
_skeletons_lock = threading.Lock()


def _skeleton_of(model_factory: str, model_args: dict[str, Any],
                 factory: Callable[..., Any]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """(the model on the meta device, its buffers' built values), built once in this process."""
    key = json.dumps([model_factory, model_args], sort_keys=True, default=repr)
    with _skeletons_lock:
        hit = _skeletons.get(key)
        if hit is None:
            hit = skeleton.skeleton(lambda: factory(**model_args))
            _skeletons.clear()
            _captures.clear()
            _skeletons[key] = hit
        return hit


def warm(model_factory: str, model_args: dict[str, Any], code_dir: str) -> None:
    """Build the model's skeleton before the stage's config comes, in the job's folder `code_dir` as the stage
    will (`run`'s attempt processes waiting for their join, while the coordinator plans): the modules its factory
    imports (transformers: seconds) and the skeleton, which build_layers then takes. Whatever fails is left for
    the stage's own build to meet and report."""
    try:
        use_job_code(code_dir)
        _skeleton_of(model_factory, model_args, resolve(model_factory))
    except BaseException:  # noqa: S110 - one that exits (argparse, sys.exit) too: the stage's build says so
        pass


def _captured_skeleton(cfg: StageConfig, factory: Callable[..., Any]) -> tuple[nn.Module, dict[str, torch.Tensor],
                                                                               nn.Sequential]:
    """(the model on the meta device, its buffers' built values, this model chunk's pieces on the meta device,
    under their indices in the whole capture: the stage's own, to build its layers from). The model is built once
    for this process's model, and captured once where the coordinator sent no pieces (StageConfig.pieces), or
    sent pieces that do not load here (each model chunk then copies its own pieces from that capture)."""
    args = cfg.capture
    assert args is not None
    model, buffers = _skeleton_of(cfg.model_factory, cfg.model_args, factory)
    with _skeletons_lock:  # unpickling a graph, as capturing one, patches torch.nn.Module for the process a while
        if (shipped := _shipped(cfg)) is not None:
            return model, buffers, shipped
        key = json.dumps([cfg.model_factory, cfg.model_args, args], sort_keys=True, default=repr)
        pieces = _captures.get(key)
        if pieces is None:
            pieces = _captures[key] = skeleton.capture_pieces(model, args).pieces
    # A copy: a tied weight stays one tensor within it (deepcopy's memo), the cached pieces stay as made.
    return model, buffers, copy.deepcopy(cuts.layers(pieces, cfg.start, cfg.end))


def _shipped(cfg: StageConfig) -> nn.Sequential | None:
    """The pieces the coordinator sent for this model chunk (StageConfig.pieces); None without, or when they do
    not load here (another torch, say: the stage then captures the model itself, and its log says why)."""
    if cfg.pieces is None:
        return None
    try:
        pieces = skeleton.unpack(cfg.pieces)
    except Exception as e:
        print(f"stage {cfg.model_chunk}: the coordinator's capture did not load here ({type(e).__name__}: {e}); "
              "capturing the model here", file=sys.stderr, flush=True)
        return None
    if [name for name, _ in pieces.named_children()] != [str(i) for i in range(cfg.start, cfg.end)]:
        print(f"stage {cfg.model_chunk}: the coordinator's capture is not of pieces {cfg.start}..{cfg.end - 1}; "
              "capturing the model here", file=sys.stderr, flush=True)
        return None
    return pieces


def build_layers(cfg: StageConfig, state: dict[str, torch.Tensor] | None, device: torch.device) -> nn.Sequential:
    """The stage's slice of the model, holding `state` (the coordinator's weights) when given.

    The factory runs on the meta device, so no full model is materialised here
    (a captured model's buffers keep the values it builds them with:
    gpipe.capture.skeleton); a model that cannot be built there (or keeps plain tensors
    that are no parameters or buffers) is built on the CPU instead. With no
    `state`, the layers are initialised here (init per_layer: a layer at a time,
    or a captured model's a module at a time, gpipe.weight_init), or left empty for
    weights sent in pieces (gpipe.worker.state_stream).
    """
    add_import_paths(cfg.import_paths)  # the job's folder: its model's module lives there
    factory = resolve(cfg.model_factory)
    hook = resolve(cfg.init_hook) if cfg.init_hook else None
    per_layer = state is None and cfg.init == "per_layer"

    def sliced(model: nn.Module) -> nn.Sequential:
        if cfg.capture is not None:
            model = skeleton.capture_pieces(model, cfg.capture).pieces
        assert isinstance(model, nn.Sequential)
        return cuts.layers(model, cfg.start, cfg.end)

    layers = None
    try:
        if cfg.capture is not None:  # its buffers' values kept aside (gpipe.capture.skeleton)
            model, buffers, layers = _captured_skeleton(cfg, factory)
        else:
            with torch.device("meta"):
                layers = sliced(factory(**cfg.model_args))
        if skeleton.plain_tensor(layers) is not None:  # no build on the meta device gives its value
            layers = None
        elif per_layer and cfg.capture is not None:  # a module at a time, on the CPU (gpipe.weight_init.per_module)
            layers = layers.to_empty(device="cpu")
            capture.retie(layers, [keys for keys, _ in cfg.tied])
            skeleton.fill_buffers(layers, buffers, capture.model_name)
            weight_init.init_pieces(layers, model, cfg.seed, hook)
            layers = layers.to(device)
            capture.to_device(layers, device)
        elif per_layer:  # a layer at a time: on the CPU, initialised, then to the device
            for j, i in enumerate(range(cfg.start, cfg.end)):
                layers[j] = weight_init.materialise(layers[j], i, cfg.seed, device, hook)
        else:
            layers = layers.to_empty(device=device)
            capture.retie(layers, [keys for keys, _ in cfg.tied])  # to_empty gave each name its own tensor
            capture.to_device(layers, device)
    except Exception:
        layers = None
    if layers is None:
        whole = factory(**cfg.model_args)
        layers = sliced(whole)
        if per_layer and cfg.capture is not None:
            weight_init.init_pieces(layers, whole, cfg.seed, hook)
        elif per_layer:
            for j, i in enumerate(range(cfg.start, cfg.end)):
                weight_init.init_layer(layers[j], i, cfg.seed, hook)
        layers = layers.to(device)
        capture.to_device(layers, device)  # a captured model built on the CPU names the CPU in its graphs
    grad_in_place.fuse(layers)  # large linears' weight gradients computed into .grad, deferred to W when split
    if state is None:
        return layers
    own = dict(layers.named_parameters(remove_duplicate=False)) | dict(layers.named_buffers(remove_duplicate=False))
    if set(own) != set(state):
        raise RuntimeError(f"stage {cfg.model_chunk}: the coordinator's weights do not match the model built here")
    with torch.no_grad():
        for name, t in own.items():
            t.copy_(state[name])
    return layers


def backward(y: Any, wants: list[bool], grads: list[torch.Tensor],
             more: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
    """Backward from the tensors of `y` that wanted a gradient, with the next stage's gradients for them,
    and from the (tensor, gradient) pairs of `more` (skip connections), in one pass."""
    pairs = roots(y, wants, grads, more)
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def roots(y: Any, wants: list[bool], grads: list[torch.Tensor],
          more: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (tensor, gradient) pairs a backward starts from: the tensors of `y` that wanted a gradient, with the
    next stage's gradients for them, and the pairs of `more` (skip connections), those that require grad."""
    outs = [t for t, w in zip(structure.tensors(y), wants, strict=True) if w]
    if len(outs) != len(grads):
        raise RuntimeError(f"{len(grads)} gradients came back for {len(outs)} tensors that wanted one")
    # A gradient arrives on the stage's device; a tensor the stage sent from elsewhere (a CUDA stage's CPU
    # output) takes it back where it is.
    return [(t, g if g.device == t.device else g.to(t.device)) for t, g in [*zip(outs, grads, strict=True), *more]
            if t.requires_grad]


@dataclass
class Pass:
    """One run of a stage's actions: a training step, or an eval batch (forward only, no gradients)."""

    train: bool
    seed_step: int  # the step the layers' randomness is seeded with (gpipe.rng)
    mb_offset: int  # micro-batch i is the step's mb_offset+i (its seed; replica r's start at r*chunks)
    inputs: list[Any] | None  # the first stage's
    targets: list[Any] | None  # the last stage's (none: keep the outputs instead of taking the loss)
    sizes: list[int]
    batch: int  # the whole batch: a micro-batch's loss weighs size/batch
    losses: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # the last stage's: (loss, size) each
    what: str = "micro-batch"  # how waits name a micro-batch
    outputs: dict[int, Any] = field(default_factory=dict)  # the last stage's, when there are no targets
    in_flight: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # forwarded, until their backward
    split: bool = False  # the backward is split: B the inputs' gradients, W the weights' (gpipe.split_backward)
    metered: bool = True  # the forwards' saved tensors are counted (gpipe.memory.meter; always when the backward is split)
    weights: dict[int, WeightGradients] = field(default_factory=dict)  # after B, until W
    # The last stage's checkpointed micro-batches: the loss's gradients of the output, taken in F (the loss runs
    # once per micro-batch; the backward recomputes the layers alone).
    loss_grads: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    # A forward without targets (gpipe.Pipeline's training forward): the last stage's outputs' gradients, per
    # micro-batch, from whoever took a loss of them (None until they come).
    out_grads: list[list[torch.Tensor]] | None = None
    timeline: list[tuple[str, int, float, float]] = field(default_factory=list)
    busy: float = 0.0
    computing_from: float = 0.0  # when the current action's compute began (after its waits)
    t_step: float = 0.0  # when the step began (perf_counter)
    loss_scale: float = 1.0  # fp16: the step's loss scale
    bytes_before: dict[str, int] = field(default_factory=dict)  # the lanes' byte counts when the step began
    done: bool = False  # the step's gradients are final (or its state was dropped)

    def drop(self) -> None:
        """Let go of what the forwards kept for a backward that will not come."""
        self.in_flight.clear()
        self.loss_grads.clear()
        self.weights.clear()
        self.outputs.clear()
        self.done = True

    def loss_sum(self) -> float:
        """The sum over micro-batches of each one's loss times its size, in float64 and in their order: summed once
        the pass is done, not in each F (the peer's schedules collect their losses so too)."""
        if not self.losses:
            return 0.0
        total = torch.zeros((), dtype=torch.float64, device=self.losses[0][0].device)
        for loss, size in self.losses:
            total += loss.double() * size
        return float(total)

    def tag(self, mb: int) -> int:
        """The number micro-batch `mb` travels under: eval batches under negative ones (gpipe.eval_schedule)."""
        return mb if self.train else eval_schedule.tag(mb)


CLIP_SLICE = 1 << 20  # elements of a gradient whose float64 squares clipping makes at once on a CPU (8 MiB)


class Stage:
    """A stage built and joined to its neighbours; `resume` is a checkpoint's optimizer and RNG state.

    `transport` links it to the other stages (gpipe.transport): c10d, formed here, by default. With
    `optimizer` false, the stage steps no optimizer: whoever holds its parameters does (gpipe.Pipeline).
    `shared_rng` when stages are threads of one process (gpipe.rng.SharedGenerators).
    """

    def __init__(self, cfg: StageConfig, state: dict[str, torch.Tensor] | nn.Sequential,
                 resume: StageState | None, transport: Transport, optimizer: bool = True,
                 shared_rng: SharedGenerators | None = None, finished_elsewhere: frozenset[int] = frozenset(),
                 shares_tensors: bool = False):
        """`finished_elsewhere`: ids of parameters this stage shares with an earlier stage of this process (one
        tensor, tied): that stage unscales, clips and sums their gradients once. `shares_tensors`: stages of this
        replica share a parameter tensor (gpipe.Pipeline); they all end their backward before any finishes a
        gradient (a split backward's W may come after the first holder's last backward)."""
        self.cfg = cfg
        self.rank = cfg.rank
        self.mb_offset = cfg.replica * cfg.chunks  # replica r's micro-batch i is the step's r*chunks+i
        add_import_paths(cfg.import_paths)
        self.device = torch.device(cfg.device)
        if cfg.deterministic:
            determinism.enable()  # before the process's first matrix product on the GPU (cuBLAS's workspace)
        # gpipe.Pipeline gives each stage of a GPU its own stream (set after building), as torchgpipe does.
        self.stream: torch.cuda.Stream | None = None
        self.first, self.last = cfg.model_chunk == 0, cfg.model_chunk == cfg.model_chunks - 1
        # The layers built already (their weights sent in pieces: gpipe.worker.state_stream), or built from `state`.
        self.layers = state if isinstance(state, nn.Sequential) else build_layers(cfg, state, self.device)
        if cfg.deferred_batch_norm:
            batchnorm.convert_deferred_batch_norm(self.layers)
        self.buffers = Buffers(self.layers)  # a recomputed forward leaves running statistics be
        self.indexed = [(int(n), m) for n, m in self.layers.named_children()]
        self._shares: dict[tuple[float, torch.device], torch.Tensor] = {}  # the loss's gradients (_loss_root)
        # The layers a forward seeds: those that may draw and, before the loss, the last (empty: none).
        seeded = seeding(self.indexed, loss_follows=self.last)
        self.seeded = seeded if any(seeded) else []
        self._on_cpu = self.device.type == "cpu"
        named = [(n, p) for n, p in self.layers.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = params = [p for _, p in named]
        self.grad_params = [p for p in params if id(p) not in finished_elsewhere]  # whose gradients it finishes
        self.shares_tensors = shares_tensors
        self.optimizer: torch.optim.Optimizer | ShardedOptimizer | None = None
        if params and optimizer and cfg.sharded:
            # transport's gather among this stage's copies (the c10d world is formed by the transport already)
            self.optimizer = ShardedOptimizer(optim.optimizer_class(cfg.optimizer), cfg.optimizer_args, params,
                                              self.param_names, cfg.replicas, cfg.replica, transport.gather_copies)
            self.optimizer.waiting = lambda what: self._doing("waiting", what)
        elif params and optimizer:
            self.optimizer = optim.build(cfg.optimizer, params, cfg.optimizer_args)
        self.precision = Precision(cfg.precision, self.device, resume.loss_scale if resume is not None else None,
                                   *cfg.loss_scale)
        if resume is not None:
            self._restore(resume)
        self.loss_fn: Callable[[Any, Any], torch.Tensor] | None = resolve(cfg.loss) if self.last and cfg.loss \
            else None
        self.meter = ActivationMeter(list(self.layers.parameters()))
        self.meter.exempt |= {storage_key(b) for b in self.layers.buffers()}  # changed in place by forwards
        self.tied = self._tied_here()
        # A tied weight's copies on the stages after its first holder: equal to the first's, saved by it alone.
        self.copies = {k for keys, stages in cfg.tied if stages[0] != cfg.model_chunk for k in keys}
        self.shared_rng = shared_rng
        self._turns: Turns | None = None  # with virtual stages: the turns of this model chunk's worker (gpipe.turns)
        # Replaced whole (one reference: read and written without a lock) on every action.
        self._activity: tuple[str, str, float] = ("idle", "", time.monotonic())
        self._metered_once = False  # whether a step of this stage (of this attempt) has counted the activations
        self.transport = transport
        self._link()

    @property
    def turns(self) -> Turns | None:
        return self._turns

    @turns.setter
    def turns(self, turns: Turns | None) -> None:
        """With virtual stages: this model chunk takes turns with its worker's others, and counts its activations
        with theirs (their meter)."""
        self._turns = turns
        if turns is not None:
            turns.join()
            turns.meter.skip(list(self.layers.parameters()))
            turns.meter.exempt |= self.meter.exempt
            self.meter = turns.meter

    def _link(self) -> None:
        """This stage's lanes to its neighbours (and the stages its skip connections reach), and the reducer of
        its gradients across replicas."""
        t, k = self.transport, self.cfg.model_chunk
        self.recv_act = None if self.first else t.receiver(k - 1, "activation", f"stage {k - 1}'s activation")
        self.send_act = None if self.last else t.sender(k + 1, "activation", f"activation to stage {k + 1}")
        self.recv_grad = None if self.last else t.receiver(k + 1, "gradient", f"stage {k + 1}'s gradient")
        self.send_grad = None if self.first else t.sender(k - 1, "gradient", f"gradient to stage {k - 1}")
        self.skips = SkipLinks(k, [(n, a, b) for n, a, b in self.cfg.skip_routes], t)
        self.senders: list[Outbound] = [c for c in (self.send_act, self.send_grad) if c] + \
            [*self.skips.send.values(), *self.skips.send_grad.values()]
        self.receivers: list[Inbound] = [c for c in (self.recv_act, self.recv_grad) if c] + \
            [*self.skips.recv.values(), *self.skips.recv_grad.values()]
        self.grad_sum = t.grad_sum(self.grad_params)  # with replicas: the copies of this stage sum their gradients

    def _doing(self, state: str, what: str = "") -> None:
        """What the stage does now: idle (between steps), computing, or waiting on a neighbour for `what`."""
        self._activity = (state, what, time.monotonic())

    def activity(self) -> tuple[str, str, float]:
        """(idle | computing | waiting, what it waits for, seconds since it began): the coordinator tells a
        partition between workers (every stage waiting) from a slow stage (one computing)."""
        state, what, since = self._activity
        return state, what, time.monotonic() - since

    @contextlib.contextmanager
    def _waiting(self, p: Pass, what: str) -> Iterator[None]:
        """A wait on another stage: not busy time; the action's compute starts after it."""
        self._doing("waiting", what)
        try:
            yield
        finally:
            self._computing(p)

    def _computing(self, p: Pass) -> None:
        """A wait on another stage is over: the action's compute starts (`_waiting`'s end, without its context)."""
        self._activity = ("computing", "", time.monotonic())
        p.computing_from = time.perf_counter()

    def autocast(self) -> Any:
        """The context every forward of this stage runs in (autocast for bf16 and fp16)."""
        return self.precision.autocast()

    def checkpointed(self, mb: int, chunks: int | None = None) -> bool:
        """Whether micro-batch `mb` of `chunks` (the config's by default) is checkpointed: except_last keeps the
        last one's activations."""
        mode = self.cfg.activation_checkpoint
        last = (self.cfg.chunks if chunks is None else chunks) - 1
        return mode == "always" or (mode == "except_last" and mb != last)

    # -- one step --------------------------------------------------------------------------------------

    def placed(self) -> contextlib.AbstractContextManager[Any]:
        """The stage's GPU as the calling thread's current device (a layer's own `.cuda()` lands there, whatever
        thread runs the stage) and its stream, if it has one; on the CPU, nothing."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        if self.stream is not None:
            stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def step(self, step: int, lr: float, inputs: list[Any] | None, targets: list[Any] | None, sizes: list[int],
             batch: int | None = None) -> StepResult:
        """Run one step of the schedule, then the gradients' reductions and the optimizer; the step's figures.

        `batch` is the whole batch of every replica (a micro-batch's loss weighs size/batch): the config's
        by default, else this stage's micro-batches.
        """
        with self.placed():
            return self._step(step, lr, inputs, targets, sizes, batch)

    def _step(self, step: int, lr: float, inputs: list[Any] | None, targets: list[Any] | None, sizes: list[int],
              batch: int | None) -> StepResult:
        p = self._open(step, inputs, targets, sizes, batch)
        self.run(*self._actions(len(sizes)), p, p.t_step)
        self._flush()
        return self._close(p, lr)

    def _open(self, step: int, inputs: list[Any] | None, targets: list[Any] | None, sizes: list[int],
              batch: int | None) -> Pass:
        """A training step's pass, begun: nothing left of the step before, the counters' starting points."""
        cfg, t_step = self.cfg, time.perf_counter()
        p = Pass(True, step, self.mb_offset, inputs, targets, sizes, batch or cfg.batch_size or sum(sizes),
                 metered=self._meters(step))
        p.t_step, p.loss_scale = t_step, self.precision.loss_scale  # fp16: this step's; 1 otherwise
        self._begin(len(sizes))
        p.bytes_before = {c.name: c.bytes for c in self.senders} | {c.name: c.bytes for c in self.receivers}
        self.meter.reset_peak()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._doing("computing")
        return p

    def forward_pass(self, step: int, inputs: list[Any] | None, sizes: list[int], batch: int) -> Pass:
        """The forwards of a training step with no loss here (gpipe.Pipeline's `pipe(x)` in training): every
        micro-batch forward in order, as the gpipe schedule's fill; the last stage keeps the outputs, with their
        graphs, for `backward_pass`. The deferred BatchNorms commit the batch's statistics now."""
        with self.placed():
            p = self._open(step, inputs, None, sizes, batch)
            self.run([schedule.Action("F", mb) for mb in range(len(sizes))], None, p, p.t_step)
            self._flush()
            if self.cfg.replicas > 1:
                batchnorm.all_reduce(self.layers, lambda t: self.transport.all_reduce(t, "copies"))
            batchnorm.commit(self.layers)
            self._doing("idle")
            return p

    def backward_pass(self, p: Pass, out_grads: list[list[torch.Tensor]] | None) -> StepResult:
        """The backwards of `forward_pass`'s pass, in reverse order (the gpipe schedule's drain), from the outputs'
        gradients `out_grads` (per micro-batch, the last stage's), then the gradients' reductions; no optimizer
        step (the caller holds the parameters)."""
        if p.done:
            raise RuntimeError("this forward's backward has run already, or its state was dropped")
        with self.placed():
            p.out_grads = out_grads
            self._doing("computing")
            self.run([schedule.Action("B", mb) for mb in reversed(range(len(p.sizes)))], None, p, p.t_step)
            self._flush()
            return self._close(p, 0.0)

    def _close(self, p: Pass, lr: float) -> StepResult:
        """The end of a training step, after its last backward: the gradients' sums and checks, the optimizer."""
        cfg, t_step, loss_scale, bytes_before = self.cfg, p.t_step, p.loss_scale, p.bytes_before
        start_unix = _EPOCH_UNIX + (t_step - _EPOCH_PERF)  # one clock for every stage of this process
        p.done = True
        if self.shares_tensors:
            self._doing("waiting", "the other stages' backward into the parameters they share with this one")
            self.transport.all_reduce(torch.zeros((), device=self.device), "pipeline")
        # The replicas' sums first: each writes back the sum of this stage's own share of a tied weight's
        # gradient, which the holders then add up (summed the other way round, the write-back lost the others').
        reduce_s = self._reduce_replicas()
        self._sum_tied()
        t0 = time.perf_counter()
        skipped, grad_norm = self._finish_gradients()
        p.busy += time.perf_counter() - t0

        def update() -> None:  # its own time alone is this model chunk's busy time
            t = time.perf_counter()
            self._update(lr, skipped)
            p.busy += time.perf_counter() - t

        if self.turns is not None and not cfg.sharded:
            # on the thread that ran the worker's actions (gpipe.turns): one glibc arena for all a step allocates
            self._doing("waiting", "the worker's other model chunks' optimizer steps")
            self.turns.run([(cfg.model_chunk, update)], cfg.step_timeout_s,
                           f"model chunk {cfg.model_chunk}'s optimizer step")
        else:
            update()
        step_s = time.perf_counter() - t_step
        self._doing("idle")
        scaled = self.precision.scaler is not None
        return StepResult(
            rank=self.rank, stage=cfg.model_chunk, replica=cfg.replica,
            loss_sum=p.loss_sum() if self.last else None, grad_norm=grad_norm,
            busy_s=p.busy, idle_s=max(0.0, step_s - p.busy),
            activation_peak_bytes=self.meter.peak if p.metered else None, peak_memory_bytes=self._peak_memory(),
            rss_bytes=resident_bytes(), start_unix=start_unix, timeline=p.timeline,
            sent_bytes={c.name: c.bytes - bytes_before[c.name] for c in self.senders},
            received_bytes={c.name: c.bytes - bytes_before[c.name] for c in self.receivers},
            reduce_s=reduce_s if cfg.replicas > 1 else None,
            loss_scale=loss_scale if scaled else None, skipped=skipped if scaled else None,
        )

    def _meters(self, step: int) -> bool:
        """Whether step `step` counts the activations: this stage's first (an attempt's), every
        activation_meter_every-th and the job's last (StageConfig); a split backward's count, every step."""
        every, first = self.cfg.activation_meter_every, not self._metered_once
        metered = first or (every is not None and step % every == 0) or step == self.cfg.last_step
        self._metered_once = self._metered_once or metered
        return metered

    def _begin(self, chunks: int) -> None:
        """Before a step: no gradients, nothing tracked or reduced (what a failed step left), receives posted."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        chunk = self.cfg.model_chunk  # what a failed step's micro-batches saved is held no longer
        self.meter.release_all(keep=lambda key: key[0] != chunk)  # type: ignore[index]  # keys: (chunk, mb)
        batchnorm.discard(self.layers)
        if self.grad_sum is not None:
            self.grad_sum.reset()
        self._expect(chunks)

    def _expect(self, chunks: int) -> None:
        if self.recv_act:
            self.recv_act.expect(chunks)
        self.skips.expect(chunks)

    def _flush(self) -> None:
        for sender in self.senders:
            self._doing("waiting", f"{sender.name} to be sent")
            sender.flush(self.cfg.step_timeout_s)

    # -- the interpreter ------------------------------------------------------------------------------------

    def _actions(self, chunks: int) -> tuple[list[schedule.Action], list[int] | None]:
        """This stage's actions of a step, in order; with virtual stages (a model chunk of a worker that holds
        several: gpipe.turns), also each one's place in the worker's order."""
        cfg = self.cfg
        if cfg.virtual_stages == 1:
            return schedule.build(cfg.schedule, cfg.model_chunk, cfg.model_chunks, chunks), None
        own = place(cfg.schedule, cfg.model_chunk, cfg.workers)[1]
        order = schedule.build(cfg.schedule, cfg.worker, cfg.workers, chunks, cfg.virtual_stages)
        mine = [(n, a) for n, a in enumerate(order) if a.worker_chunk == own]
        return [a for _, a in mine], [n for n, _ in mine]

    def run(self, actions: list[schedule.Action], positions: list[int] | None, p: Pass, t_start: float) -> None:
        """Interpret a schedule's actions in order (gpipe.schedule): F forwards a micro-batch, B backwards it,
        W computes its weights' gradients when the schedule splits the backward (then B only its inputs').

        The receives and sends an action implies run on the transport's lanes; only the waits for what has not
        arrived yet stop the stage (not busy time). Each action's compute goes on the step's timeline.
        `positions`: each action's place in its worker's order: the worker's model chunks' actions then run together,
        in that order, on one thread (gpipe.turns).
        """
        p.split = schedule.splits_backward(actions)
        p.metered = p.metered or p.split  # B lets go of what W will not use through the count's handles
        final = "W" if p.split else "B"  # the action whose gradients are the step's last
        last_backward = max((i for i, a in enumerate(actions) if a.kind == final), default=-1)

        def act(n: int) -> None:
            action = actions[n]
            if n == last_backward and self.grad_sum is not None:
                self.grad_sum.arm()  # this backward's gradients are final: sum them across replicas as they come
            self._doing("computing")
            p.computing_from = time.perf_counter()
            self.ACTIONS[action.kind](self, action.micro_batch, p)
            end = time.perf_counter()
            p.busy += end - p.computing_from
            p.timeline.append((action.kind, action.micro_batch, p.computing_from - t_start, end - t_start))

        if positions is None or self.turns is None:
            for n in range(len(actions)):
                act(n)
            return
        self._doing("waiting", "the worker's other model chunks")
        work = [(at, lambda n=n: act(n)) for n, at in enumerate(positions)]  # n bound per action
        self.turns.run(work, self.cfg.step_timeout_s, f"model chunk {self.cfg.model_chunk}")

    def _forward(self, mb: int, p: Pass) -> None:
        """F: receive micro-batch `mb`'s input (and skips), run the layers, send the output (and skips) on."""
        # Right after the blocks each line of Python costs several times its warm cost (bench/README.md (ab)):
        # a context manager or a call that has nothing to do for this stage is not entered.
        cfg, timeout, tag, skips = self.cfg, self.cfg.step_timeout_s, p.tag(mb), self.skips
        if self.first:
            x = p.inputs[mb]  # type: ignore[index]  # the first stage gets inputs
            if not (self._on_cpu and type(x) is torch.Tensor and x.is_cpu):
                x = structure.to(x, self.device)
        else:
            self._doing("waiting", f"stage {cfg.model_chunk - 1}'s activation of {p.what} {mb}")
            try:  # its tensors that want a gradient back require grad
                x = self.recv_act.get(tag, timeout)  # type: ignore[union-attr]  # every stage but the first receives
            finally:
                self._computing(p)
        arrived: dict[str, torch.Tensor] = {}
        if skips.recv:
            with self._waiting(p, f"the skip connections of {p.what} {mb}"):
                arrived = skips.receive(tag, timeout)
        ckpt = p.train and self.checkpointed(mb, len(p.sizes))
        ctx = Routed(skips.leaving, arrived)
        buffers = self.buffers
        if not p.train or not (ckpt or p.split or p.metered or buffers.updated or buffers.unseen):
            y = self._compute(mb, x, ctx, p)  # (_saving and watch would be nothing)
        elif ckpt:  # checkpointed: no autograd now, the backward recomputes the layers
            with torch.no_grad(), buffers.watch(), checkpointing():
                y = self._compute(mb, x, ctx, p, loss=False)
            if self.last and p.targets is not None:  # the loss once, its gradients kept for the recomputed output
                y = self._loss_now(mb, y, p)
        else:
            with self._saving(mb, p), buffers.watch():
                y = self._compute(mb, x, ctx, p)
        skip_wants = skips.send_forward(tag, ctx.out, ckpt) if skips.leaving else {}
        wants: list[bool] = []
        if self.last:
            if p.targets is None:
                p.outputs[mb] = structure.map_tensors(self.precision.for_loss(y) if p.train else y,
                                                      torch.Tensor.detach)
            else:
                p.losses.append((y.detach(), p.sizes[mb]))
        else:
            wants = wants_grad(y, ckpt)
            self.send_act.send(tag, structure.map_tensors(y, torch.Tensor.detach), wants)  # type: ignore[union-attr]  # every stage but the last sends
            if any(wants):
                self.recv_grad.expect(1)  # type: ignore[union-attr]  # every stage but the last gets gradients
        if p.train:
            held_x = None
            if not self.first and p.metered:  # its input, kept for the backward, is activation memory too
                if p.split:
                    held_x = [self.meter.hold(t) for t in structure.tensors((x, arrived))]
                else:
                    self.meter.add((self.cfg.model_chunk, mb), structure.tensors((x, arrived)))
            p.in_flight[mb] = (x, held_x, None if ckpt else y, wants, arrived, None if ckpt else ctx.out, skip_wants)

    def _saving(self, mb: int, p: Pass) -> contextlib.AbstractContextManager[Any]:
        """The context micro-batch `mb`'s forward saves tensors for its backward in, counted (gpipe.memory.meter): by
        handle when the backward is split (its B lets go of part of the graph W keeps), else until its B ends."""
        if p.split:
            return self.meter.hooks()
        if not p.metered:
            # A module that updates a buffer in place in its forward (BatchNorm's running statistics) bumps the
            # version of a tensor an earlier micro-batch's graph saved: the meter's hooks exempt the stage's
            # buffers from autograd's version check, as counting does (gpipe.memory.meter).
            return self.meter.checking if self.buffers.updated or self.buffers.unseen else _NOTHING
        return self.meter.counting((self.cfg.model_chunk, mb))

    def _compute(self, mb: int, x: Any, ctx: Routed, p: Pass, loss: bool = True) -> Any:
        """The stage's layers on micro-batch `mb` (seeded: gpipe.rng), then the loss on the last stage (unless
        `loss` is false); what leaves the stage travels in the autocast dtype."""
        precision = self.precision
        if precision.dtype is None:  # float32: no autocast, nothing cast at the cut; skip.use's work, inline
            local = skip.local
            before = getattr(local, "ctx", None)
            local.ctx = ctx
            try:
                if self.seeded or self.shared_rng is not None or hooked():
                    y = seeded_forward(self.indexed, x, self.cfg.seed, p.seed_step, p.mb_offset + mb,
                                       self.shared_rng, self.seeded)
                else:  # no layer draws: seeded_forward would seed none (one call fewer, right after the blocks)
                    y = x
                    for _, layer in self.indexed:
                        y = layer(y)
            finally:
                local.ctx = before
        else:
            with skip.use(ctx), precision.autocast():
                y = seeded_forward(self.indexed, x, self.cfg.seed, p.seed_step, p.mb_offset + mb, self.shared_rng,
                                   self.seeded)
            ctx.out = precision.cut(ctx.out)
            if not self.last:
                return precision.cut(y)
        if not self.last or p.targets is None or not loss:
            return y
        target = structure.to(p.targets[mb], self.device)
        return self.loss_fn(precision.for_loss(y), target)  # type: ignore[misc]  # the last stage has a loss

    def _loss_now(self, mb: int, y: Any, p: Pass) -> torch.Tensor:
        """The last stage's checkpointed micro-batch `mb`: the loss of its output `y` (computed without autograd),
        and the loss's gradients of `y`'s tensors, kept in `p.loss_grads` for the backward. The loss function
        runs once per micro-batch: the backward recomputes the layers and starts from these gradients, the same
        values the loss's own backward would hand them."""
        leaves = structure.map_tensors(y, lambda t: t.detach().requires_grad_(t.is_floating_point()))
        target = structure.to(p.targets[mb], self.device)  # type: ignore[index]  # the last stage has targets
        with torch.enable_grad():
            loss = self.loss_fn(self.precision.for_loss(leaves), target)  # type: ignore[misc]  # the last stage has a loss
            root, grad = self._loss_root(loss, p.sizes[mb] / p.batch)
            wanting = [t for t in structure.tensors(leaves) if t.requires_grad]
            got: Sequence[torch.Tensor | None] = [None] * len(wanting)
            if root.requires_grad and wanting:
                got = torch.autograd.grad([root], wanting, [grad] if grad is not None else None, allow_unused=True)
        it = iter(got)
        p.loss_grads[mb] = [next(it) if t.requires_grad else None for t in structure.tensors(leaves)]
        return loss.detach()

    def _backward(self, mb: int, p: Pass) -> None:
        """B: receive micro-batch `mb`'s output gradients (and skips'), recompute its forward if it was
        checkpointed, backward through the layers, send its input's gradients back. When the step's backward is
        split, only the inputs' gradients: the graph is kept for the weights' at the micro-batch's W."""
        cfg, timeout = self.cfg, self.cfg.step_timeout_s
        x, held_x, y, wants, arrived, stashed, skip_wants = p.in_flight.pop(mb)
        grads: list[torch.Tensor] = []
        if any(wants):
            self._doing("waiting", f"stage {cfg.model_chunk + 1}'s gradient of micro-batch {mb}")
            try:
                grads = gradients(self.recv_grad.get(mb, timeout))  # type: ignore[union-attr]  # wants: not the last
            finally:
                self._computing(p)
        skip_grads: dict[int, list[torch.Tensor]] = {}
        if skip_wants and any(map(any, skip_wants.values())):
            with self._waiting(p, f"the skip gradients of micro-batch {mb}"):
                skip_grads = self.skips.gradients(mb, skip_wants, timeout)
        if y is None:  # checkpointed: recompute the forward, replaying its randomness
            ctx = self.skips.context(arrived)
            with self._saving(mb, p), self.buffers.recompute():
                y = self._compute(mb, x, ctx, p, loss=False)
            stashed = ctx.out
        pairs: list[tuple[torch.Tensor, torch.Tensor | None]]
        if self.last and p.targets is None:  # the caller's loss: its gradients of the outputs
            if p.out_grads is None:
                raise RuntimeError("the backward of a forward without targets came with no output gradients")
            out = self.precision.for_loss(y)
            pairs = [(t, self.precision.scaled(g.to(t.device, t.dtype)))
                     for t, g in zip(structure.tensors(out), p.out_grads[mb], strict=True) if t.requires_grad]
        elif self.last and mb in p.loss_grads:  # checkpointed: the loss's gradients, taken in F
            pairs = [(t, g) for t, g in zip(structure.tensors(y), p.loss_grads.pop(mb), strict=True)
                     if g is not None and t.requires_grad]
        elif self.last:
            pairs = [self._loss_root(y, p.sizes[mb] / p.batch)]
        else:
            pairs = list(roots(y, wants, grads, self.skips.pairs(stashed, skip_wants, skip_grads) if skip_grads else ()))
        if p.split:  # the inputs' gradients now, the weights' at this micro-batch's W
            inputs = [t for t in structure.tensors((x, arrived)) if t.requires_grad]
            p.weights[mb] = backward_input([t for t, _ in pairs], [g for _, g in pairs], inputs, self.params,
                                           self.meter.releasing)
        elif pairs:  # (torch.autograd.backward: Tensor.backward is unannotated.)
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        del y, held_x, stashed, skip_grads, pairs
        if p.metered and not p.split:  # the graph is freed: what it saved is no longer held
            self.meter.release((cfg.model_chunk, mb))
        if self.first:
            pass
        elif type(x) is torch.Tensor:  # (nearly every input: no walk, no comprehension)
            if x.requires_grad:
                self.send_grad.send(mb, gradient_message([x]))  # type: ignore[union-attr]  # not the first stage
        else:
            inputs_back = [t for t in structure.tensors(x) if t.requires_grad]
            if inputs_back:  # the ones that wanted a gradient, in order
                self.send_grad.send(mb, gradient_message(inputs_back))  # type: ignore[union-attr]  # not the first stage
        if self.skips.send_grad:
            self.skips.send_gradients(mb, arrived)

    def _loss_root(self, loss: Any, share: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last stage's backward root: (tensor, its gradient; None: one) for a micro-batch's loss weighed by
        its `share` of the batch, and for fp16 times the loss scale.

        A float32 scalar loss of a stage without a loss scale starts from the share itself as its gradient (a
        float32 tensor, one per share and device, kept): the same bits as the product's backward, which
        multiplies a gradient of one by the share cast to float32, with no product in the graph. Right after
        the forward's products each torch operation costs several times its warm cost (bench/README.md (ab)).
        """
        if self.precision.scaler is None and type(loss) is torch.Tensor and loss.dtype is torch.float32 \
                and loss.dim() == 0:
            grad = self._shares.get((share, loss.device))
            if grad is None:
                if len(self._shares) >= 64:  # a share per micro-batch size and device: a few
                    self._shares.clear()
                grad = self._shares[(share, loss.device)] = torch.tensor(share, dtype=torch.float32,
                                                                         device=loss.device)
            return loss, grad
        return self.precision.scaled(loss * share), None  # fp16: times the loss scale; a scalar's gradient is one

    def _weight(self, mb: int, p: Pass) -> None:
        """W: micro-batch `mb`'s weight gradients, added into `.grad`, from what its B kept (the graph is then
        dropped, and with it the activations)."""
        p.weights.pop(mb).run()

    ACTIONS: ClassVar[dict[str, Callable[[Stage, int, Pass], None]]] = {"F": _forward, "B": _backward,
                                                                         "W": _weight}

    # -- after the backward ---------------------------------------------------------------------------

    def _tied_here(self) -> list[tuple[torch.Tensor, list[int], bool]]:
        """Tied weights this stage holds a copy of, with other stages: (parameter, holder stages, whether this
        stage is the first holder, whose copy the clipping norm counts)."""
        own = dict(self.layers.named_parameters(remove_duplicate=False))
        out: list[tuple[torch.Tensor, list[int], bool]] = []
        for keys, stages in self.cfg.tied:
            held = [k for k in keys if k in own]
            if len(stages) > 1 and held:
                out.append((own[held[0]], stages, stages[0] == self.cfg.model_chunk))
        return out

    def _sum_tied(self) -> None:
        """Each tied weight's holders sum its gradient: every copy then has one device's, and takes the same
        update."""
        for p, stages, _ in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self._doing("waiting", f"the tied weight's gradient of stages {stages}")
            self.transport.sum_among(p.grad, stages)

    def _reduce_replicas(self) -> float:
        """With replicas: wait for the sums of this stage's gradients across replicas (started during the last
        backward), and sum what deferred BatchNorm tracked. Returns the seconds it waited (not busy time)."""
        t0 = time.perf_counter()
        if self.grad_sum is not None:
            self._doing("waiting", "the other replicas' gradients")
            self.grad_sum.finish()  # the replicas' sum: one device's gradient on the whole batch
        if self.cfg.replicas > 1:  # the whole batch's statistics, every replica's
            batchnorm.all_reduce(self.layers, lambda t: self.transport.all_reduce(t, "copies"))
        return time.perf_counter() - t0

    def _finish_gradients(self) -> tuple[bool, float | None]:
        """fp16's unscale and the job's inf check, clipping to the global norm, deferred BatchNorm's commit:
        (whether the step is skipped, the norm before clipping)."""
        skipped = self._unscale() if self.precision.scaler else False
        grad_norm = None
        if self.cfg.clip_grad_norm and not skipped:
            self._doing("waiting", "the other stages' gradient norms")
            grad_norm = self._clip(self.cfg.clip_grad_norm)
        self._doing("computing")
        batchnorm.commit(self.layers)  # deferred BatchNorm: the whole batch's running statistics, once a step
        return skipped, grad_norm

    def _update(self, lr: float, skipped: bool) -> None:
        """The optimizer step at `lr` (none for a skipped step, or where the stage holds no optimizer)."""
        # Sharded, every model chunk of a worker takes its turn at the gathers, one with no optimizer or a skipped
        # step too: the turns go round in the same order on every rank.
        with self.transport.in_turn() if self.cfg.sharded else contextlib.nullcontext():
            if self.optimizer is not None and not skipped:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.step()

    # -- evaluation ---------------------------------------------------------------------------------

    def evaluate(self, batch: int, inputs: list[Any] | None, targets: list[Any] | None,
                 sizes: list[int]) -> EvalResult:
        """Eval batch `batch` through the stage: its micro-batches forward in order (fill-drain, no backward),
        in eval mode, without gradients. The weights, the buffers and the generators are as they were.

        The last stage returns the batch's summed loss (each micro-batch's mean loss times its size), or with
        no `targets`, the micro-batches' outputs.
        """
        with self.placed():
            return self._evaluate(batch, inputs, targets, sizes)

    def _evaluate(self, batch: int, inputs: list[Any] | None, targets: list[Any] | None,
                  sizes: list[int]) -> EvalResult:
        dev, chunks = self.device, len(sizes)
        p = Pass(False, eval_schedule.seed_step(batch), 0, inputs, targets, sizes, sum(sizes), what="eval micro-batch")
        self._expect(chunks)
        t0 = time.perf_counter()
        # A module may update a buffer even in eval mode; and a layer's randomness must not move training's.
        buffers = [(b, b.clone()) for b in self.layers.buffers()]
        modes = [(m, m.training) for m in self.layers.modules()]  # each module's own (a layer the user set apart)
        self.layers.eval()
        # Stages that are threads of one process share the generators: none may restore them under another.
        rng = torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []) if self.shared_rng is None \
            else contextlib.nullcontext()
        try:
            with torch.no_grad(), rng:
                self.run([schedule.Action("F", mb) for mb in range(chunks)], None, p, t0)
            self._flush()
        finally:
            for m, mode in modes:
                m.training = mode
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            self._doing("idle")
        last_loss = self.last and targets is not None
        return EvalResult(stage=self.cfg.model_chunk, loss_sum=p.loss_sum() if last_loss else None,
                          samples=sum(sizes), eval_s=time.perf_counter() - t0,
                          outputs=[p.outputs[mb] for mb in range(chunks)] if self.last and targets is None else None)

    def saved_name(self, name: str) -> str | None:
        """The name a parameter or buffer of the stage is saved under: the un-partitioned model's (a captured
        model's own names, so that a checkpoint fits any split: gpipe.capture.graph.model_name); None for a tied
        weight's copy that another stage saves."""
        if self.cfg.capture is None:
            return name
        return None if name in self.copies else capture.model_name(name)

    def weights(self) -> dict[str, torch.Tensor]:
        """A copy of the stage's state dict on the CPU, under the un-partitioned model's names."""
        return {saved: t.detach().to("cpu", copy=True) for name, t in self.layers.state_dict().items()
                if (saved := self.saved_name(name)) is not None}

    def _unscale(self) -> bool:
        """fp16: divide the loss scale out of this stage's gradients; True, on every stage, when any stage's
        held inf or nan (the step is then skipped everywhere and the scale backs off)."""
        scaler = self.precision.scaler
        assert scaler is not None  # called for fp16 only
        found = scaler.unscale([p.grad for p in self.grad_params if p.grad is not None])
        self._doing("waiting", "the other stages' overflow checks")
        flag = torch.tensor(float(found), device=self.device)
        self.transport.all_reduce(flag, "job", "max")  # one scale for the job: all ranks skip, or none
        overflow = bool(flag.item())
        scaler.update(overflow)
        return overflow

    def _clip(self, max_norm: float) -> float:
        """Clip to the global norm: every stage adds its squares, and all stages share the sum."""
        held = [p for p in self.grad_params if p.grad is not None]
        grads = [p.grad for p in held if p.grad is not None]
        copies = {id(p) for p, _, first in self.tied if not first}  # a tied weight counts once, at its first holder
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        # On a CPU, a slice of each gradient at a time: a whole one's float64 squares (twice a language model's 25 MiB
        # embedding, twice over) came from the heap after the optimizer's first step had taken its holes, and
        # stayed: +120 MiB at a GPT-2 worker's second step (docs/memory.md).
        most = CLIP_SLICE if self._on_cpu else None
        for p, g in zip(held, grads, strict=True):
            if id(p) not in copies:
                flat = g.detach().reshape(-1)
                for at in range(0, flat.numel(), most or max(1, flat.numel())):
                    sq += flat[at:at + most if most else None].double().pow_(2).sum()
        self.transport.all_reduce(sq, "pipeline")  # over all stages' parameters, not this stage's
        norm = float(sq.sqrt())
        coef = max_norm / (norm + 1e-6)
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

        Weights, the optimizer's tensors by parameter name (the un-partitioned
        model's: saved_name, so a checkpoint fits any balance and any split)
        and the generator states on the CPU; the optimizer's
        hyper-parameters and non-tensor state as JSON. With `copy` false, the
        weights and optimizer tensors are the live ones, where they live (to be
        written out before the next step changes them: gpipe.worker.state_stream).
        """
        def out(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", copy=True) if copy else t.detach()

        tensors: dict[str, torch.Tensor] = {}
        for name, t in self.layers.state_dict().items():  # non-persistent buffers are rebuilt, not saved
            if (saved := self.saved_name(name)) is not None:
                tensors[layout.model_key(saved)] = out(t)
        scalars: dict[str, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        fetch = rounds = None
        if isinstance(self.optimizer, ShardedOptimizer):  # gathered in rounds as the checkpoint is written
            deferred = self._sharded_entries()
            tensors |= {key: meta for key, (_, _, meta) in deferred.items()}
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
            fetch, rounds = self._fetcher(deferred)
        elif self.optimizer is not None:
            for name, p in zip(self.param_names, self.params, strict=True):
                if (saved := self.saved_name(name)) is None:
                    continue
                for key, v in self.optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        tensors[layout.optim_key(saved, key)] = out(v)
                    else:
                        scalars.setdefault(saved, {})[key] = v
            groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        tensors[layout.RNG_CPU] = torch.get_rng_state()
        if self.device.type == "cuda":
            tensors[layout.RNG_CUDA] = torch.cuda.get_rng_state(self.device)
        json_state = {"param_groups": groups, "optimizer_state": scalars, "params": self.param_names}
        if self.precision.scaler is not None:
            json_state[layout.LOSS_SCALE] = self.precision.scaler.state()
        return StageState(tensors, json_state, fetch, rounds)

    def _sharded_entries(self) -> dict[str, tuple[int, str, torch.Tensor]]:
        """With the optimizer sharded: checkpoint key -> (parameter, state key, the whole tensor on meta), for
        the optimizer tensors a checkpoint holds. Every copy of the stage calls it at the same point."""
        opt = self.optimizer
        assert isinstance(opt, ShardedOptimizer)
        saved = [self.saved_name(n) for n in self.param_names]
        return {layout.optim_key(saved[i] or "", key): (i, key, meta)
                for (i, key), meta in opt.snapshot_entries([s is not None for s in saved]).items()}

    def _fetcher(self, deferred: dict[str, tuple[int, str, torch.Tensor]]) -> tuple[
            Callable[[str], torch.Tensor], Callable[[str], Iterator[tuple[int, torch.Tensor]]]]:
        """A deferred tensor of the checkpoint whole (fetch), or in the gather's rounds (rounds)."""
        opt = self.optimizer
        assert isinstance(opt, ShardedOptimizer)

        def fetch(key: str) -> torch.Tensor:
            i, name, meta = deferred[key]
            whole = opt.fetch(i, name, meta.dim() == 0)
            assert whole is not None  # replica 0 writes the checkpoint
            return whole

        def rounds(key: str) -> Iterator[tuple[int, torch.Tensor]]:
            i, name, meta = deferred[key]
            return opt.rounds(i, name, meta.dim() == 0)
        return fetch, rounds

    def contribute_snapshot(self) -> None:
        """A copy other than replica 0's, at a checkpoint with the optimizer sharded: give replica 0 this copy's
        pieces of every optimizer tensor, in the order its writer takes them (their keys' order)."""
        if not isinstance(self.optimizer, ShardedOptimizer):
            return
        for _key, (i, name, meta) in sorted(self._sharded_entries().items()):
            for _ in self.optimizer.rounds(i, name, meta.dim() == 0):
                pass  # replica 0 takes the parts

    def _restore(self, resume: StageState) -> None:
        """Load the optimizer and RNG state of a checkpoint (the weights came with `state`)."""
        if isinstance(self.optimizer, ShardedOptimizer):
            entries = {i: e for i, name in enumerate(self.param_names) if (e := resume.optimizer_state_of(name))}
            self.optimizer.restore(entries, self._saved_groups(resume))
        elif self.optimizer is not None:
            state: dict[int, dict[str, Any]] = {}
            for i, name in enumerate(self.param_names):
                if entry := resume.optimizer_state_of(name):
                    state[i] = entry
            optim.restore(self.optimizer, state, self._saved_groups(resume))
        rng = resume.rng()
        if layout.RNG_CPU in rng:
            torch.set_rng_state(rng[layout.RNG_CPU])
        if layout.RNG_CUDA in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng[layout.RNG_CUDA], self.device)

    def _saved_groups(self, resume: StageState) -> list[dict[str, Any]]:
        """A checkpoint's hyper-parameters per group, tuples as the optimizer has them (JSON made them lists)."""
        assert self.optimizer is not None
        return optim.saved_groups(self.optimizer.param_groups, resume.param_groups)

    def close(self) -> None:
        for out in self.senders:
            out.close()
        for into in self.receivers:
            into.close()
        self.transport.close()
