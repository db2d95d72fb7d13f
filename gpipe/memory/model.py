"""A worker's peak memory, predicted before it runs: the sum of what it holds at its fullest moment.

    params       its model chunks' parameters and buffers
    grads        the gradients alive at that moment (none before the step's first backward: the optimizer's
                 zero_grad frees them at every step's start)
    optimizer    the optimizer's state: state_slots (gpipe.optim) tensors per parameter (by import path: those
                 shaped like their parameter after validate's dummy steps), 1/R of them on each of R replicas
                 with optimizer.shard
    activations  the micro-batches in flight at that moment, each as its schedule and checkpointing hold it
    buffers      what moves through the worker: the next micro-batch's input and gradient received ahead of
                 their action, two steps' inputs (first stage) and targets (last), and the transient buffers of
                 the last backward (a weight's gradient), the replicas' gradient sum (a bucket), the sharded
                 optimizer's weight gather (a round) and the optimizer's step (its temporaries)
    allocator    what the CPU's heap keeps beyond the bytes alive (`Setting.heap_slack` times the gradients
                 made anew each micro-batch there, ChunkMemory.heaped; 0 on CUDA, whose max_memory_allocated
                 counts the tensors alive)
    baseline     the process before any of it: torch, the runtime and the model's own modules (measured on the
                 host: gpipe.coordinator.plan.baseline); 0 on CUDA, whose allocator counts tensors only

The moment is found by walking the worker's actions of a step, in its
schedule's order (gpipe.schedule), after the first step (the optimizer's state
exists from then on). Per micro-batch, a model chunk holds (gpipe.memory.footprint):
from F to B, its input, what its layers saved and its output (`held`); with
activation checkpointing, from F to B, its input alone, and during B the whole
recomputed forward; with a split backward (zb-h1, zbv), from B to W what W
needs (`kept`; everything on the first stage, whose B does nothing). The
gradients of a model chunk appear at its first backward that reaches its
weights (B, or W when split). The last stage's loss adds moments of its own
(ChunkMemory.loss, measured by gpipe.memory.footprint): during its F, the
output beside what the loss's forward makes (the logits and their
log-softmax); during its B, the gradients the loss's backward makes (the
log-softmax's and the logits'); a checkpointed micro-batch takes the loss and
its backward in F, then keeps the output's gradient until its B. The other
moments are the optimizer step (every gradient, no activation) and an
evaluation between steps (every gradient of the step before, one micro-batch
forward at a time without autograd: its input, its output, the loss's
forward). Between two actions nothing else is alive, so the peak is the
largest of those sums; the work of a layer itself (its temporaries, the
gradient flowing back) is left out, but for what the CPU's heap keeps of it
(`allocator`).

Pure arithmetic over numbers: the footprints come from gpipe.memory.footprint, the
spec's choices from the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpipe.memory import zero
from gpipe.memory.footprint import Line, LossLines
from gpipe.schedule import Action

PARTS = ("params", "grads", "optimizer", "activations", "buffers", "allocator", "baseline")  # a prediction's sum


@dataclass(frozen=True)
class ChunkMemory:
    """One model chunk (a stage) of a worker: its weights, and what it holds per micro-batch (lines in the
    micro-batch's size, gpipe.memory.footprint.Line)."""

    params: int  # bytes of parameters and buffers
    trainable: int  # bytes of the parameters that get a gradient
    largest: int  # bytes of its largest parameter that gets a gradient
    held: Line  # from F to B: input, saved tensors, output
    kept: Line  # from B to W, with a split backward
    inputs: Line  # its input: all a checkpointed micro-batch keeps from F to B
    outputs: Line  # what it sends on per micro-batch (the gradient it gets back is as large)
    # bytes of the gradients its backward makes anew at every micro-batch in the CPU's heaps (the `allocator`
    # part): not those computed into .grad (gpipe.grad_in_place), nor blocks glibc maps on their own
    heaped: int = 0
    loss: LossLines = LossLines()  # the last stage's: what its loss makes for a while (0 on any other)


@dataclass(frozen=True)
class Setting:
    """The spec's choices that decide a worker's memory."""

    split: bool  # the schedule splits the backward into B and W
    checkpointed: Callable[[int], bool]  # whether micro-batch i's forward is recomputed at its backward
    sizes: Sequence[int]  # samples per micro-batch (this replica's)
    state_slots: int = 0  # optimizer state tensors per parameter (gpipe.optim.state_slots)
    replicas: int = 1
    shard: bool = False  # optimizer.shard: each replica keeps 1/replicas of the state
    foreach: bool = False  # the optimizer steps all parameters at once (on CUDA): its temporaries are a full set
    bucket: int = 25 << 20  # the replicas' gradient bucket (gpipe.worker.dataplane.reducer); the sharded gather goes in rounds
    data: int = 0  # bytes of one step's inputs (on the first stage) and targets (on the last) it holds
    steps_ahead: int = 2  # steps whose data a stage holds (the job's data.read_ahead)
    baseline: int = 0  # the process's own bytes before the job (gpipe.coordinator.plan.baseline)
    # Bytes the heap keeps beyond those alive, per byte of gradient, counted once per model chunk of the worker
    # (measured when each chunk's thread could run a step; gpipe.turns now runs a worker's step on one thread,
    # and bench/README.md (w)'s last addendum still measured two-chunk workers at 0.87-1.00 of the prediction).
    heap_slack: float = 0.0
    eval_sizes: Sequence[int] = ()  # samples per micro-batch of an evaluation batch (none: the job does not evaluate)


@dataclass
class Prediction:
    """A worker's predicted peak, by part (PARTS), and the moment it is at."""

    parts: dict[str, int] = field(default_factory=dict)
    moment: str = ""  # "after F3" / "during B2.1" / "the optimizer step" / "an evaluation"

    @property
    def peak(self) -> int:
        return sum(self.parts.values())


@dataclass
class _Moment:
    activations: int
    grads: int
    what: str


def checkpointing(mode: str, chunks: int) -> Callable[[int], bool]:
    """Which micro-batches of `chunks` activation_checkpoint `mode` recomputes (gpipe.stage.Stage.checkpointed):
    every one (always), all but the last (except_last), none (never)."""
    return lambda mb: mode == "always" or (mode == "except_last" and mb != chunks - 1)


def walk(actions: Sequence[Action], chunks: Sequence[ChunkMemory], s: Setting) -> _Moment:
    """The moment of a step's actions at which activations and gradients together are the most (see the
    module's docstring)."""
    held: dict[tuple[int, int], int] = {}  # (worker chunk, micro-batch) -> bytes held now
    grads: set[int] = set()  # the worker chunks whose gradients exist
    best = _Moment(0, 0, "the step's start")

    def note(what: str) -> None:
        nonlocal best
        now = _Moment(sum(held.values()), sum(chunks[c].trainable for c in grads), what)
        if now.activations + now.grads > best.activations + best.grads:
            best = now

    for a in actions:
        c, mb = a.worker_chunk, a.micro_batch
        chunk, n, loss = chunks[c], s.sizes[mb], chunks[c].loss
        ckpt = s.checkpointed(mb)
        if a.kind == "F":
            if ckpt:  # the input alone; on the last stage the output's gradient too, taken in F (gpipe.stage)
                during, after = chunk.inputs.at(n) + loss.alone.at(n), chunk.inputs.at(n) + loss.grad.at(n)
            else:
                during, after = chunk.held.at(n) + loss.forward.at(n), chunk.held.at(n)
            if during > after:  # the last stage's loss: its output and what the loss makes, for a while
                held[(c, mb)] = during
                note(f"during {a!r}")
            held[(c, mb)] = after
            note(f"after {a!r}")
        elif a.kind == "B":
            if ckpt:  # the forward recomputed: its activations, whole, for the backward (and the loss's gradient)
                held[(c, mb)] = chunk.held.at(n) + loss.grad.at(n)
                note(f"during {a!r}")
            elif loss.backward.at(n):  # the last stage's loss: the gradients its backward makes
                held[(c, mb)] += loss.backward.at(n)
                note(f"during {a!r}")
            if s.split:
                held[(c, mb)] = chunk.kept.at(n)
            else:
                del held[(c, mb)]
                grads.add(c)
            note(f"after {a!r}")
        else:  # W
            del held[(c, mb)]
            grads.add(c)
            note(f"after {a!r}")
    return best


def in_flight(actions: Sequence[Action], split: bool) -> int:
    """The most micro-batches the actions hold at once (each a unit of `walk`'s bytes)."""
    unit = ChunkMemory(0, 0, 0, Line(1), Line(1), Line(1), Line(0))
    chunks = [unit] * (1 + max((a.worker_chunk for a in actions), default=0))
    sizes = [0] * (1 + max((a.micro_batch for a in actions), default=0))
    return walk(actions, chunks, Setting(split, lambda _: False, sizes, 0)).activations


def predict(actions: Sequence[Action], chunks: Sequence[ChunkMemory], s: Setting) -> Prediction:
    """A worker's peak: its `actions` of a step (gpipe.schedule.build) over its model `chunks`, in the order of
    its worker chunks."""
    params = sum(c.params for c in chunks)
    trainable = sum(c.trainable for c in chunks)
    share = s.replicas if s.shard and s.replicas > 1 else 1
    optimizer = s.state_slots * trainable // share
    moment = walk(actions, chunks, s)
    n = max(s.sizes, default=0)
    # The next micro-batch's input and output gradient, received ahead of the actions that take them.
    ahead = max((c.inputs.at(n) for c in chunks), default=0) + max((c.outputs.at(n) for c in chunks), default=0)
    data = s.data * s.steps_ahead
    step = _step_buffers(chunks, s, share)
    kept = round(s.heap_slack * sum(c.heaped for c in chunks) * len(chunks))
    # An evaluation between steps: every gradient of the step before (freed at the next step's start), and one
    # micro-batch's forward at a time, without autograd: its input and output, on the last stage the loss's.
    e = max(s.eval_sizes, default=0)
    evaluating = max((c.inputs.at(e) + max(c.outputs.at(e), c.loss.eval.at(e)) for c in chunks), default=0) \
        if e else 0
    if e and trainable + evaluating > max(trainable + step, moment.activations + moment.grads):
        return Prediction({"params": params, "grads": trainable, "optimizer": optimizer,
                           "activations": evaluating, "buffers": ahead + data, "allocator": kept,
                           "baseline": s.baseline}, "an evaluation")
    if trainable + step > moment.activations + moment.grads:  # the optimizer step is the fullest moment
        return Prediction({"params": params, "grads": trainable, "optimizer": optimizer, "activations": 0,
                           "buffers": ahead + data + step, "allocator": kept, "baseline": s.baseline},
                          "the optimizer step")
    return Prediction({"params": params, "grads": moment.grads, "optimizer": optimizer,
                       "activations": moment.activations, "buffers": ahead + data, "allocator": kept,
                       "baseline": s.baseline}, moment.what)


def _step_buffers(chunks: Sequence[ChunkMemory], s: Setting, share: int) -> int:
    """The most that the end of a step adds for a while, one thing after another: the last backward's weight
    gradient, made before it is added into .grad (with more than one micro-batch; an upper bound where it is
    computed in place, gpipe.grad_in_place), the replicas' gradient sum (a bucket's gradients copied as it is
    flattened), the optimizer's temporaries (a full set of its parameters' when it steps them all at once, on
    CUDA; else one parameter at a time, adam's two at once (its denominator), sgd's one: the largest parameter's,
    or sharded on a CPU a slice's, gpipe.memory.zero.SLICE_BYTES), the sharded optimizer's weight gather (a
    round: what it sends, what it receives and c10d's flat copy of it)."""
    trainable = sum(c.trainable for c in chunks)
    largest = max((c.largest for c in chunks), default=0)
    bucket = min(max(s.bucket, largest), trainable)
    made = largest if len(s.sizes) > 1 else 0
    summed = bucket if s.replicas > 1 else 0
    at_once = min(2, s.state_slots)
    if s.foreach:
        temporaries = trainable // share if s.state_slots else 0
    else:
        temporaries = at_once * (min(largest, zero.SLICE_BYTES) if share > 1 else largest)
    # foreach: on CUDA, whose gather rounds are larger
    rounds = min(zero.GATHER_BYTES_CUDA if s.foreach else zero.GATHER_BYTES, bucket)
    gathered = 2 * rounds + rounds // share if share > 1 else 0
    return max(made, summed, temporaries, gathered)
