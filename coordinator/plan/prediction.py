"""Each worker's predicted peak memory: the plan's footprint (gpipe.memory.footprint) through gpipe.memory.model.

plan.json's `workers` carry it (`predicted_peak_bytes`, and `predicted_memory`: its parts), `validate` prints
it, and every step's metrics show the peak measured beside it (`peak_memory_bytes`). docs/memory.md says how
to read it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from gpipe import grad_in_place, schedule, structure
from gpipe.coordinator.plan import baseline
from gpipe.coordinator.plan.elastic import micro_batch_sizes
from gpipe.coordinator.plan.job import Plan
from gpipe.memory.footprint import Footprint, Line, LossLines
from gpipe.memory.model import ChunkMemory, Prediction, Setting, checkpointing, predict
from gpipe.topology import model_chunk
from gpipe.worker.agent import MALLOC_ENV

# On the CPU a worker's peak is its process's resident peak, and glibc's heaps keep what a step frees (a worker
# trims them only around its optimizer step: gpipe.worker.agent's MALLOC_ENV); each micro-batch's backward makes its weights'
# gradients before adding them into .grad, and those blocks, freed between the activations' smaller ones, leave
# the heap larger than what is alive. bench/memory_model.py measured it at 2 to 4 times the gradients' bytes
# on the one thread that runs a worker's actions (gpipe.turns; the same in a plain torch loop); this is the middle.
# It counts the gradients made that way: not the large weights' (gpipe.grad_in_place computes
# them into .grad), nor blocks of at least glibc's mmap threshold (mapped on their own, unmapped when freed).
CPU_HEAP_SLACK = 3.0
MMAP_THRESHOLD = int(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"])


def chunk_memory(plan: Plan, fp: Footprint, chunk: int) -> ChunkMemory:
    """What model chunk `chunk` (a stage) holds: its weights, and per micro-batch its activations."""
    start, end = plan.bounds[chunk]
    layers = nn.ModuleList(plan.model[i] for i in range(start, end))
    params = list(layers.parameters())  # a tied weight once
    trainable = [p.numel() * p.element_size() for p in params if p.requires_grad]
    # (under autocast the weights are cast on the way: autograd's own gradients)
    in_place = grad_in_place.in_place_params(layers) if plan.spec.precision == "fp32" else set()
    heaped = sum(p.numel() * p.element_size() for p in params
                 if p.requires_grad and id(p) not in in_place and p.numel() * p.element_size() < MMAP_THRESHOLD)
    return ChunkMemory(
        params=sum(p.numel() * p.element_size() for p in params) +
        sum(b.numel() * b.element_size() for b in layers.buffers()),
        trainable=sum(trainable), largest=max(trainable, default=0),
        held=fp.line(lambda m: m.held(start, end)),
        kept=fp.line(lambda m: m.kept_for_weights(start, end)),
        inputs=fp.line(lambda m: m.input_bytes(start)) if start else Line(),  # the first's: the data's (buffers)
        outputs=fp.line(lambda m: m.output_bytes(end)) if end < len(plan.model) else Line(),
        heaped=heaped, loss=fp.loss() if end == len(plan.model) else LossLines(),
    )


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in structure.tensors(value))


def predictions(plan: Plan, devices: Sequence[str], runtime: Callable[[str], int]) -> list[Prediction] | None:
    """Per rank, its predicted peak (gpipe.memory.model); None without a footprint (probe: false).
    `devices`: each rank's device; `runtime(device)`: the runtime's own bytes there (gpipe.coordinator.plan.baseline)."""
    fp = plan.footprint
    if fp is None:
        return None
    spec, top = plan.spec, plan.spec.topology
    chunks = [chunk_memory(plan, fp, g) for g in range(len(plan.bounds))]
    shards = plan.stream().shards(0)  # per replica: its micro-batches, their sizes
    last_chunk = spec.model_chunks - 1
    e = spec.eval.data.batch_size if spec.eval is not None else 0  # an eval batch's micro-batches, the largest
    eval_sizes = [max(micro_batch_sizes(e, 1, min(spec.chunks, e)))] if e else []  # as EvalStream cuts it
    out = []
    for rank in top.ranks():
        k, replica = top.stage_of(rank), top.replica_of(rank)
        xs, ys, sizes = shards[replica]
        cuda = devices[rank].startswith("cuda")
        actions = schedule.build(spec.schedule, k, spec.stages, len(sizes), spec.virtual_stages)
        held = [model_chunk(spec.schedule, k, c, spec.stages) for c in range(spec.virtual_stages)]
        first, last = 0 in held, last_chunk in held
        setting = Setting(
            split=schedule.splits_backward(actions),
            checkpointed=checkpointing(spec.activation_checkpoint, len(sizes)),
            sizes=sizes, state_slots=plan.state_slots,
            replicas=spec.replicas, shard=spec.optimizer.shard, foreach=cuda,
            # The steps' data waits in the host's memory (a micro-batch goes to the GPU at its forward).
            data=0 if cuda else (_bytes(xs) if first else 0) + (_bytes(ys) if last else 0),
            steps_ahead=spec.data.read_ahead,
            baseline=runtime(devices[rank]), heap_slack=0.0 if cuda else CPU_HEAP_SLACK, eval_sizes=eval_sizes,
        )
        out.append(predict(actions, [chunks[g] for g in held], setting))
    return out


class Announced:
    """An attempt's predictions, written (`write`: plan.json's workers, with why none when none) and logged
    (`log`): at once where this host's baseline is known (gpipe.coordinator.plan.baseline's cache), else once a thread has
    measured it, a few seconds on, the job running meanwhile. `finish` waits for that thread."""

    def __init__(self, plan: Plan, devices: Sequence[str],
                 write: Callable[[list[Prediction] | None, str], None], log: Callable[[str], None]):
        self.plan, self.devices, self.write, self.log = plan, devices, write, log
        self._thread: threading.Thread | None = None
        unknown = {d for d in devices if baseline.known(plan, d) is None}
        try:  # here, not on the thread: the plan's data is the driver's once the thread runs
            self.predicted = predictions(plan, devices, lambda d: baseline.known(plan, d) or 0)
        except Exception as e:  # a prediction that fails stops nothing
            log(f"predicted peak memory: not predicted: {type(e).__name__}: {e}")
            write(None, f"{type(e).__name__}: {e}")
            return
        if self.predicted is None or not unknown:
            self._announce()
            return
        write(None, "measuring this host's baseline (gpipe.coordinator.plan.baseline)")
        self._thread = threading.Thread(target=self._measure, args=(unknown,), name="baseline", daemon=True)
        self._thread.start()

    def _measure(self, unknown: set[str]) -> None:
        assert self.predicted is not None
        for p, device in zip(self.predicted, self.devices, strict=True):
            if device in unknown:
                p.parts["baseline"] = baseline.runtime_bytes(self.plan, device)
        self._announce()

    def _announce(self) -> None:
        if self.predicted is not None:
            self.log("predicted peak memory: " + ", ".join(f"rank {n} {human(p.peak)}"
                                                            for n, p in enumerate(self.predicted)))
        self.write(self.predicted, "")

    def finish(self) -> None:
        """Wait for the baseline's measurement, if one runs (bounded by its own timeout)."""
        if self._thread is not None:
            self._thread.join(baseline.TIMEOUT_S + 10)


def describe(p: Prediction) -> str:
    """'321.6 MiB (params 2.0 MiB, grads 2.0 MiB, ..., baseline 298.5 MiB; at its fullest after F2)'."""
    parts = ", ".join(f"{name} {human(v)}" for name, v in p.parts.items())
    return f"{human(p.peak)} ({parts}; at its fullest {p.moment})"


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable
