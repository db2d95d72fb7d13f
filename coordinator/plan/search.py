"""`gpipe-coordinator plan`: the fastest configuration of a job that fits its workers' memory, from measured costs.

One measurement, then a search over arithmetic:

1. The job's plan (gpipe.coordinator.plan.job.make_plan: the model, captured and cut at
   its blocks when it is no nn.Sequential, its data, the probe's footprint of
   what each layer keeps) and each layer's costs (gpipe.memory.costs: forward, a
   split backward's B and W, a plain backward, as lines in the micro-batch
   size, and the optimizer's step), measured on this host as the workers run
   the layers: with N CPU workers by N processes at once, each pinned to a
   local worker's cores, which also time the replicas' collectives
   (gpipe.memory.costs_together); on CUDA, on the GPU.
2. Every configuration within the job's batch: stages x replicas at most N;
   each schedule (interleaved-1f1b and zbv with 2 virtual stages); chunks
   (powers of two, and the stage count and its multiples, up to a sample a
   micro-batch); activation checkpointing never / except_last / always;
   optimizer.shard with replicas, where the optimizer keeps state; the balance
   by measured time for each. What the spec's validation refuses is skipped.
3. Each configuration's step time: gpipe.schedule.steady (steps in a row, as
   the service runs them) with each action's length from the measured costs
   (a recomputed forward before a checkpointed micro-batch's backward), plus
   a per-action overhead and each transfer (LINKS: latency + bytes /
   bandwidth) on the sender, plus at each worker's step end its layers'
   optimizer step and, with replicas, the gradients' all-reduce (`all_reduce`)
   and the sharded optimizer's gather (`gather`). Its peak per worker:
   gpipe.coordinator.plan.prediction (gpipe.memory.model).
4. Those whose every worker fits the budget, fastest first.

Transfers between stages and the per-action overhead are constants per
device kind, not measured here: bench/plan.py says where they and the machine
disagree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from gpipe import balance as balancing
from gpipe import cuts, measured, optim, schedule
from gpipe.coordinator.plan import baseline, prediction
from gpipe.coordinator.plan.job import Plan, make_plan, optimizer_slots, step_waits
from gpipe.coordinator.spec.job import JobSpec
from gpipe.errors import SpecError, describe_os_error
from gpipe.memory import costs, costs_together
from gpipe.memory.costs import LayerCosts
from gpipe.memory.costs_together import Collectives
from gpipe.memory.footprint import Layers, Line
from gpipe.memory.model import Prediction, checkpointing
from gpipe.memory.zero import BUCKET_BYTES, GATHER_BYTES
from gpipe.options import violation
from gpipe.show import one_line
from gpipe.topology import model_chunk

CHECKPOINTS = ("never", "except_last", "always")
MAX_WORKERS = 64
MAX_CHUNKS = 64
MAX_CANDIDATES = 20_000  # configurations simulated at most: past it, one line saying so
# `measured` is built for the shapes of this many leading candidates (with_measured): by plan, and by a job's
# `schedule: auto` before it starts (each build is 1-1.5 s of CPU, more than the fixed schedules' whole search).
MEASURED_FROM, MEASURED_FROM_AUTO = 2, 1
# A configuration fits when its predicted peak is at most this share of the budget: the memory model ran up to
# 15% under the measured peaks (bench/README.md (u), (w): 0.85-1.02 of them, lowest with 2 model chunks a worker).
HEADROOM = 0.85


@dataclass(frozen=True)
class Link:
    """A transfer's cost: latency + bytes / bandwidth; and the engine's own time per action."""

    latency_s: float
    bytes_per_s: float
    action_s: float  # the engine's per-action work beyond the layers' (receive, send, bookkeeping)

    def transfer(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes else 0.0


# gloo between processes of one host (bench/README.md (b): 0.2-0.3 ms for small messages, 2-4 GB/s at 8 MiB;
# (n): 0.3-1 ms of engine time per action); NCCL between GPUs of one host.
LINKS = {"cpu": Link(3e-4, 3e9, 5e-4), "cuda": Link(3e-5, 2e10, 1e-4)}


@dataclass(frozen=True)
class Config:
    stages: int
    replicas: int
    schedule: str
    virtual_stages: int
    chunks: int
    activation_checkpoint: str
    shard: bool
    balance: tuple[int, ...] = ()

    @property
    def workers(self) -> int:
        return self.stages * self.replicas

    def describe(self) -> str:
        v = f" x{self.virtual_stages}" if self.virtual_stages > 1 else ""
        shard = ", shard" if self.shard else ""
        return (f"{self.stages} stage(s) x {self.replicas} replica(s), {shown(self.schedule)}{v}, {self.chunks} chunks, "
                f"checkpoint {self.activation_checkpoint}{shard}")

    def overrides(self) -> dict[str, Any]:
        """The spec's fields this configuration sets (a built order as `measured`: the job builds it again from
        the costs it measures at its start)."""
        return {"stages": self.stages, "replicas": self.replicas, "schedule": shown(self.schedule),
                "virtual_stages": self.virtual_stages, "chunks": self.chunks,
                "activation_checkpoint": self.activation_checkpoint, "balance": list(self.balance),
                "optimizer.shard": self.shard}


@dataclass
class Candidate:
    config: Config
    step_s: float  # predicted, steps in a row
    bubble: float  # the workers' idle share at that period
    peaks: list[int] = field(default_factory=list)  # predicted peak bytes per worker (rank order)
    built: measured.Built | None = None  # schedule measured: what gpipe.measured chose, against the fixed ones

    @property
    def peak(self) -> int:
        return max(self.peaks, default=0)

    def as_json(self, batch: int) -> dict[str, Any]:
        """plan --json's entry (a built order as `measured`, `measured_from` saying whose order it runs)."""
        c = self.config
        built = {} if self.built is None else {"measured_from": self.built.source}
        return {**built, "stages": c.stages, "replicas": c.replicas, "balance": list(c.balance),
                "schedule": shown(c.schedule),
                "virtual_stages": c.virtual_stages, "chunks": c.chunks,
                "activation_checkpoint": c.activation_checkpoint, "shard": c.shard,
                "predicted_step_s": round(self.step_s, 6), "samples_per_s": round(batch / self.step_s, 2),
                "bubble_fraction": round(self.bubble, 4), "predicted_peak_bytes": self.peak}


@dataclass
class Measured:
    """What the search needs of the job, measured once: per layer, its costs and the bytes it sends on per
    sample; the parameters' bytes per layer; and how the memory model sees the job (`plan`)."""

    plan: Plan
    layers: list[LayerCosts]
    out_bytes: list[Line]  # per layer: its output's bytes by micro-batch size (what crosses a cut after it)
    param_bytes: list[int]  # per layer: its trainable parameters' bytes
    device: str  # "cpu" or "cuda"
    baseline_bytes: int = 0
    collectives: Collectives | None = None  # the replicas' all-reduce and gather as measured here (CPU workers)


def chunk_choices(batch: int, replicas: int, stages: int) -> list[int]:
    """Chunks searched: powers of two and multiples of the stage count, a sample a micro-batch at least."""
    per = batch // replicas
    out = {1 << k for k in range(7)} | {stages * k for k in (1, 2, 4)}
    return sorted(c for c in out if 1 <= c <= min(per, MAX_CHUNKS))


def configurations(layers: int, batch: int, workers: int, has_state: bool) -> Iterator[Config]:
    """Every configuration of the search (balance left for the costs to choose)."""
    for replicas in range(1, workers + 1):
        if batch % replicas:  # each replica takes an equal share of the batch
            continue
        for stages in range(1, workers // replicas + 1):
            for name, virtual in schedule.searched().items():  # every schedule whose record says so
                if stages * virtual > layers or (stages == 1 and name != "gpipe"):
                    continue
                for chunks in chunk_choices(batch, replicas, stages):
                    for ckpt in CHECKPOINTS:
                        if ckpt == "except_last" and chunks == 1:  # its one micro-batch is the last: never
                            continue
                        for shard in ((False, True) if replicas > 1 and has_state else (False,)):
                            yield Config(stages, replicas, name, virtual, chunks, ckpt, shard)


def _spec_of(base: JobSpec, c: Config) -> JobSpec | None:
    """`base` with configuration `c`; None where the spec's validation refuses the combination."""
    data = base.model_dump(mode="json", exclude_unset=True)
    data.update({"stages": c.stages, "replicas": c.replicas, "schedule": c.schedule,
                 "virtual_stages": c.virtual_stages, "chunks": c.chunks,
                 "activation_checkpoint": c.activation_checkpoint, "balance": list(c.balance)})
    data["optimizer"] = {**data["optimizer"], "shard": c.shard}
    data.get("model", {}).pop("split_points", None)
    try:
        return JobSpec.model_validate(data)
    except ValidationError:
        return None


def _sizes(batch: int, replicas: int, chunks: int) -> list[int]:
    """A replica's micro-batch sizes (gpipe.coordinator.plan.data cuts a batch so, the first ones one larger)."""
    per = batch // replicas
    return [per // chunks + (1 if i < per % chunks else 0) for i in range(chunks)]


def _splits(c: Config) -> bool:
    """Whether `c`'s schedule splits the backward (B and W)."""
    return schedule.splits_backward(schedule.build(c.schedule, 0, c.stages, c.chunks, c.virtual_stages))


def balance_for(m: Measured, c: Config, n: int) -> list[int]:
    """The balance by measured time at micro-batch size `n` (a checkpointed forward counted twice)."""
    twice = c.activation_checkpoint != "never"
    split = _splits(c)
    per_layer = [lc.f.at(n) * (2 if twice else 1) + (lc.b.at(n) + lc.w.at(n) if split else lc.backward(n))
                 for lc in m.layers]
    return balancing.partition(per_layer, c.stages * c.virtual_stages)


def step_time(m: Measured, c: Config, spec: JobSpec, tied: Sequence[Sequence[int]] = ()) -> tuple[float, float]:
    """(seconds a step, bubble) of configuration `c` (with its balance; `spec`: the job under it, `tied`: each
    tied weight's holders), steps in a row (the module's doc)."""
    splits = [schedule.splits_backward(schedule.build(c.schedule, k, c.stages, c.chunks, c.virtual_stages))
              for k in range(c.stages)]
    ends = [schedule.build(c.schedule, k, c.stages, c.chunks, c.virtual_stages)[-1] for k in range(c.stages)]
    length = action_lengths(m, c, splits, ends)
    waits = step_waits(spec, tied)
    period, bubble = schedule.steady(c.schedule, c.stages, c.chunks, c.virtual_stages, length, waits=waits)
    return period, max(0.0, bubble)


def action_lengths(m: Measured, c: Config, splits: Sequence[bool],
                   ends: Sequence[schedule.Action | None]) -> Callable[[int, schedule.Action], float]:
    """Each action's seconds under `c` (the module's doc): worker k's backward split or not (`splits[k]`), its
    step's last action `ends[k]` (None: none) carrying its optimizer step and the replicas' collectives."""
    link = LINKS[m.device]
    sizes = _sizes(m.plan.spec.data.batch_size, c.replicas, c.chunks)
    bounds = cuts.bounds(list(c.balance))
    last_chunk = len(bounds) - 1
    ckpt = checkpointing(c.activation_checkpoint, c.chunks)

    def chunk_of(k: int, a: schedule.Action) -> int:
        return model_chunk(c.schedule, k, a.worker_chunk, c.stages)

    end_work = []
    for k in range(c.stages):
        held = [model_chunk(c.schedule, k, j, c.stages) for j in range(c.virtual_stages)]
        nbytes = sum(m.param_bytes[i] for g in held for i in range(*bounds[g]))
        # the optimizer's step, measured per layer; sharded, each replica steps its share
        t = sum(m.layers[i].step for g in held for i in range(*bounds[g])) / (c.replicas if c.shard else 1)
        if c.replicas > 1:
            t += all_reduce(link, m.device, nbytes, c.replicas, m.collectives)
            if c.shard:
                t += gather(link, nbytes, c.replicas, m.collectives)
        end_work.append(t)

    def length(k: int, a: schedule.Action) -> float:
        g = chunk_of(k, a)
        lo, hi = bounds[g]
        n = sizes[a.micro_batch]
        layers = m.layers[lo:hi]
        if a.kind == "F":
            t = sum(lc.f.at(n) for lc in layers)
            if g < last_chunk:
                t += link.transfer(m.out_bytes[hi - 1].at(n))
        elif a.kind == "B":
            if not splits[k]:
                t = sum(lc.backward(n) for lc in layers)
            else:  # the first model chunk's input is the data: its B has no input to compute, its W is all of it
                t = 0.0 if g == 0 else sum(lc.b.at(n) for lc in layers)
            if ckpt(a.micro_batch):
                t += sum(lc.f.at(n) for lc in layers)  # the recomputed forward
            if g > 0:
                t += link.transfer(m.out_bytes[lo - 1].at(n))  # its input's gradient, sent back
        else:
            t = sum(lc.backward(n) if g == 0 else lc.w.at(n) for lc in layers)
        t += link.action_s
        if a == ends[k]:
            t += end_work[k]
        return t

    return length


def _ring(replicas: int) -> float:
    """The bytes a ring all-reduce sends per byte of its tensor."""
    return 2 * (replicas - 1) / replicas


def all_reduce(link: Link, device: str, nbytes: int, replicas: int, measured: Collectives | None = None) -> float:
    """Seconds the replicas' sum of `nbytes` of gradients adds to a worker's step (gpipe.worker.dataplane.reducer: buckets of
    BUCKET_BYTES, each flattened and all-reduced during the step's last backward once its gradients are final).
    On the CPU gloo sums on the worker's own cores: as `measured` (gpipe.memory.costs_together, scaled to `replicas`
    ranks), each bucket but the last at what it adds beside computation, the last whole; else all of it by the
    link. NCCL on a GPU overlaps the backward, and what is left after it is about the last bucket's."""
    if not nbytes or replicas < 2:
        return 0.0
    if device == "cuda":
        return link.transfer(int(_ring(replicas) * min(nbytes, BUCKET_BYTES)))
    full, rest = divmod(nbytes, BUCKET_BYTES)
    if measured is not None:  # the buckets but the last beside the backward, the last after it
        sizes = [BUCKET_BYTES] * full + ([rest] if rest else [])
        t = sum(measured.overlapped * b / BUCKET_BYTES for b in sizes[:-1]) + measured.all_reduce.at(sizes[-1])
        return t * _ring(replicas) / _ring(measured.ranks)
    return (full + (1 if rest else 0)) * link.latency_s + _ring(replicas) * nbytes / link.bytes_per_s


def gather(link: Link, nbytes: int, replicas: int, measured: Collectives | None = None) -> float:
    """Seconds of the sharded optimizer's gather of `nbytes` of weights after its step (gpipe.memory.zero: rounds of an
    all-gather receiving at most GATHER_BYTES): as `measured` on this host's cores, else by the link."""
    if measured is None:
        return link.transfer(int((replicas - 1) / replicas * nbytes))
    rounds = -(-nbytes // GATHER_BYTES)
    return rounds * measured.all_gather.at(GATHER_BYTES // replicas)


def peaks(m: Measured, c: Config, spec: JobSpec) -> list[int] | None:
    """Each worker's predicted peak bytes under `c` (gpipe.coordinator.plan.prediction); None without a footprint."""
    got = _predicted(m, c, spec)
    return None if got is None else [p.peak for p in got]


def _predicted(m: Measured, c: Config, spec: JobSpec) -> list[Prediction] | None:
    """Each worker's prediction under `c`, its parts with it; None without a footprint."""
    plan = dataclasses.replace(m.plan, spec=spec, balance=list(c.balance))
    device = "cuda:0" if m.device == "cuda" else "cpu"
    return prediction.predictions(plan, [device] * spec.topology.world, lambda _d: m.baseline_bytes)


def build_measured(m: Measured, c: Config, spec: JobSpec, budget: int,
                   tied: Sequence[Sequence[int]] = ()) -> Candidate:
    """`schedule: measured` under configuration `c` (`spec`: the job under it): each worker's order built from the
    measured costs (gpipe.measured.build: the actions' lengths as `step_time` counts them, a step's end work
    left to the simulation that scores each order), each worker's activations held within what `budget` leaves
    beside its weights, gradients, optimizer state, buffers and runtime (the memory model's parts, replica 0's
    workers), scored by `step_time`. The memory model then predicts the order's peak; where it is over the
    budget's HEADROOM share, the limits shrink by the excess and the order is built again (three times at most).
    The candidate runs the table (c.schedule its name); `built` says where its order comes from."""
    p, v, n = c.stages, c.virtual_stages, c.chunks
    fixed_spec = _spec_of(spec, dataclasses.replace(c, schedule="zbv" if v == 2 else "1f1b"))
    plan = dataclasses.replace(m.plan, spec=spec, balance=list(c.balance))
    fp = plan.footprint
    assert fp is not None and fixed_spec is not None  # measure() refuses a job without its footprint
    memory = [prediction.chunk_memory(plan, fp, g) for g in range(p * v)]
    sizes = _sizes(spec.data.batch_size, c.replicas, n)
    ckpt = checkpointing(c.activation_checkpoint, n)

    def held(k: int, a: schedule.Action) -> float:
        cm = memory[model_chunk(measured.NAME, k, a.worker_chunk, p)]
        size = sizes[a.micro_batch]
        return float(cm.inputs.at(size) if ckpt(a.micro_batch) else cm.held.at(size))

    beside = [sum(x.parts[part] for part in ("params", "optimizer", "buffers", "allocator", "baseline"))
              + sum(memory[model_chunk(measured.NAME, k, j, p)].trainable for j in range(v))
              for k, x in enumerate((_predicted(m, c, fixed_spec) or [])[:p])]
    limits = [budget * HEADROOM - b for b in beside] if beside else None
    lengths = {split: action_lengths(m, c, [split] * p, [None] * p) for split in (True, False)}

    def score(name: str) -> float:
        return step_time(m, dataclasses.replace(c, schedule=name), spec, tied)[0]

    built = None
    for _ in range(3):
        try:
            built = measured.build(p, n, v, lambda k, a, split: lengths[split](k, a), held, limits, score)
        except ValueError:  # not one micro-batch fits: the order that holds the least, one at a time (over)
            least = [max(sum(held(k, schedule.Action("F", i, j)) for j in range(v)) for i in range(n))
                     for k in range(p)]
            built = measured.build(p, n, v, lambda k, a, split: lengths[split](k, a), held, least, score)
            break
        table_spec = _spec_of(spec, dataclasses.replace(c, schedule=built.name))
        predicted = _predicted(m, dataclasses.replace(c, schedule=built.name), table_spec) if table_spec else None
        over = [x.peak - budget * HEADROOM for x in (predicted or [])[:p]]
        if limits is None or max(over, default=0) <= 0:
            break
        limits = [lim - max(0.0, o) for lim, o in zip(limits, over, strict=True)]
    assert built is not None
    c = dataclasses.replace(c, schedule=built.name)
    step, bubble = step_time(m, c, spec, tied)
    table_spec = _spec_of(spec, c)
    got = peaks(m, c, table_spec) if table_spec is not None else None
    return Candidate(c, step, max(0.0, bubble), got or [], built)


def shown(name: str) -> str:
    """A schedule's name as the plan's lines show it: a table (a measured job's order) as `measured`."""
    return measured.NAME if schedule.is_table(name) else name


def search(m: Measured, workers: int, budget: int) -> tuple[list[Candidate], list[Candidate]]:
    """(the configurations that fit `budget` bytes a worker, fastest first; those that do not, smallest peak
    first): every searched schedule's, then `measured` built for the shapes of the leading ones (with_measured)."""
    spec = m.plan.spec
    has_state = optimizer_slots(spec) > 0 and not spec.optimizer.by_path  # (shard takes the short names only)
    return with_measured(m, *evaluate(m, configurations(len(m.layers), spec.data.batch_size, workers, has_state),
                                      budget), budget)


def with_measured(m: Measured, fits: list[Candidate], over: list[Candidate], budget: int,
                  count: int = MEASURED_FROM) -> tuple[list[Candidate], list[Candidate]]:
    """`fits` and `over` with `schedule: measured` built for the shapes (stages, replicas, chunks, checkpointing,
    sharding; 1 model chunk a worker or 2 in a V) of the `count` fastest that fit, or where none fits
    the `count` smallest: its order is built within the budget, so it may fit where no fixed schedule
    does, and it is never slower in the simulator than the fixed one it starts from. Building it for every
    shape of the search would multiply its time by the builder's policies."""
    shapes: dict[Config, None] = {}
    for x in fits or over:  # in order: the fastest (or smallest) first
        c = x.config
        if schedule.is_table(c.schedule) or c.stages < 2:  # one stage: no order to build
            continue
        v = 2 if c.virtual_stages > 1 and 2 * c.stages <= len(m.layers) else 1
        shapes.setdefault(dataclasses.replace(c, schedule=measured.NAME, virtual_stages=v, balance=()))
        if len(shapes) == count:
            break
    if not shapes:
        return fits, over
    more_fits, more_over = evaluate(m, shapes, budget)
    fits = sorted(fits + more_fits, key=lambda x: (x.step_s, x.peak))
    over = sorted(over + more_over, key=lambda x: (x.peak, x.step_s))
    return fits, over


def evaluate(m: Measured, configs: Iterable[Config], budget: int,
             balance: Sequence[int] | None = None) -> tuple[list[Candidate], list[Candidate]]:
    """`search`'s answer over `configs`: each with `balance`, or the balance by measured time."""
    spec = m.plan.spec
    batch = spec.data.batch_size
    fits: list[Candidate] = []
    over: list[Candidate] = []
    for seen, c in enumerate(configs, 1):
        if seen > MAX_CANDIDATES:
            raise SpecError(f"--workers: more than {MAX_CANDIDATES} configurations to simulate; give fewer workers")
        if violation(c.schedule, c.stages, c.virtual_stages, c.chunks, c.activation_checkpoint) is not None:
            continue  # the spec's own rule (dualpipev's 2 x stages chunks at least): nothing to balance or build
        n = max(_sizes(batch, c.replicas, c.chunks))
        chosen = list(balance) if balance is not None else balance_for(m, c, n)
        c = dataclasses.replace(c, balance=tuple(chosen))
        candidate_spec = _spec_of(spec, c)
        if candidate_spec is None:
            continue
        tied = [stages for _, stages in dataclasses.replace(m.plan, spec=candidate_spec,
                                                            balance=list(c.balance)).tied_stages()]
        if c.schedule == measured.NAME:
            cand = build_measured(m, c, candidate_spec, budget, tied)
        else:
            step, bubble = step_time(m, c, candidate_spec, tied)
            cand = Candidate(c, step, bubble, peaks(m, c, candidate_spec) or [])
        (fits if cand.peak <= budget * HEADROOM else over).append(cand)
    fits.sort(key=lambda x: (x.step_s, x.peak))
    over.sort(key=lambda x: (x.peak, x.step_s))
    return fits, over


def resolve(spec: JobSpec, job_dir: Path, workers: int, threads: int, budget: int,
            on: str = "cpu") -> tuple[JobSpec, dict[str, Any]]:
    """`spec` with its `auto` fields (schedule, chunks, activation_checkpoint) chosen as `plan` would, its other
    fields as they are (the balance by measured time unless the spec gives one that still fits), for `workers`
    workers of `threads` threads and `budget` bytes each, the layers measured `on` that device (the
    coordinator's CPU stands in for the workers' GPUs); and plan.json's record of the choice. SpecError when
    nothing fits (one line, as `plan`'s)."""
    m = measure(spec, job_dir, workers, threads, on)
    auto = set(spec.auto)
    search = schedule.searched()
    built = spec.schedule == measured.NAME  # its order built from the costs (build_measured), as `auto` chooses
    choose = "schedule" in auto and not built  # among the schedules `plan` searches
    names = tuple(search) if choose else (spec.schedule,)
    checkpoints = CHECKPOINTS if "activation_checkpoint" in auto else (spec.activation_checkpoint,)

    def configs() -> Iterator[Config]:
        for name in names:
            virtual = search[name] if choose else spec.virtual_stages
            if spec.stages * virtual > len(m.layers) or (spec.stages == 1 and name != "gpipe" and choose):
                continue
            chunks = chunk_choices(spec.data.batch_size, spec.replicas, spec.stages) if "chunks" in auto \
                else [spec.chunks]
            for n in chunks:
                for ckpt in checkpoints:
                    if ckpt == "except_last" and n == 1 and "activation_checkpoint" in auto:
                        continue
                    yield Config(spec.stages, spec.replicas, name, virtual, n, ckpt, spec.optimizer.shard)

    given = spec.balance if isinstance(spec.balance, list) else None
    fits, over = evaluate(m, configs(), budget, given if given and not choose else None)
    if choose and spec.stages > 1:  # `schedule: auto` chooses among the built orders too
        fits, over = with_measured(m, fits, over, budget, MEASURED_FROM_AUTO)
    if not fits:
        raise SpecError(refusal(over, budget, "schedule" if built and not auto - {"schedule"} else "auto"))
    best = fits[0]
    c = best.config
    data = spec.model_dump(mode="json", exclude_unset=True)
    data.pop("auto", None)
    data.update({"schedule": c.schedule, "virtual_stages": c.virtual_stages, "chunks": c.chunks,
                 "activation_checkpoint": c.activation_checkpoint})
    data["balance"] = list(c.balance)
    resolved = JobSpec.model_validate(data)
    picked: dict[str, Any] = {k: getattr(resolved, k) for k in sorted(auto)}
    if "schedule" in auto:
        picked["virtual_stages"] = resolved.virtual_stages
    record = {"fields": sorted(auto), "chosen": picked,
              "balance": list(c.balance), "predicted_step_s": round(best.step_s, 6),
              "predicted_peak_bytes": best.peak, "budget_bytes": budget, "workers": workers,
              "why": why_best(fits, budget) if len(fits) > 1 else "the one configuration that fits",
              "candidates": len(fits) + len(over)}
    if best.built is not None:  # schedule measured, or auto choosing it
        picked["schedule"] = measured.NAME  # and the order itself, a row per action:
        record["schedule_table"] = {"from": best.built.source, "columns": list(measured.COLUMNS),
                                    "rows": [list(r) for r in measured.rows(best.built.orders)]}
        record["why"] = why_measured(best, budget)
    return resolved, record


def chosen(spec: JobSpec, record: dict[str, Any]) -> JobSpec:
    """`spec` with the choice an earlier attempt recorded (plan.json's `auto`): a restarted or resumed job keeps
    its micro-batches, so its steps stay the same; a measured job, its order (`schedule_table`). ValueError
    where the record does not fit the job (another shape: an elastic re-plan builds its order again)."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    data.pop("auto", None)
    data.update(record["chosen"])
    data["balance"] = record["balance"]
    if "schedule_table" in record:  # schedule measured, or auto that chose it
        data["schedule"] = schedule.table(measured.from_rows(record["schedule_table"]["rows"]))
    return JobSpec.model_validate(data)


def measure(spec: JobSpec, job_dir: Path, workers: int, threads: int | None = None,
            on: str | None = None) -> Measured:
    """The job's plan and its layers' costs on this host, as a worker of `workers` measures them (`threads`:
    a CPU worker's; None: as `workers` local workers split this host's cores)."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    data.pop("auto", None)
    data["model"].pop("split_points", None)  # the search cuts the model itself: at its blocks
    data.update({"stages": 1, "virtual_stages": 1, "replicas": 1, "chunks": 1, "schedule": "gpipe",
                 "balance": "by_params", "activation_checkpoint": "never",
                 "optimizer": {**data["optimizer"], "shard": False}})
    base = JobSpec.model_validate(data)
    plan = make_plan(base, job_dir)
    if plan.footprint is None:
        raise SpecError(f"probe: plan needs each layer's memory, which the probe measures: {plan.footprint_missing}")
    device = "cuda" if spec.device == "cuda" else "cpu"  # the links' and the memory model's kind
    xs, _, _ = plan.stream().shards(0)[0]  # the whole first batch: chunks 1, one replica
    batch = spec.data.batch_size
    sizes = (max(1, batch // (workers * 8)), batch)
    opt = _optimizer(spec)
    collectives = None
    if (on or device) == "cuda":  # (the coordinator's stand-in)
        layers = costs.measure(plan.model, xs[0], torch.device("cuda:0"), torch.get_num_threads(), sizes,
                               optimizer=opt)
    else:
        layers, collectives = _measure_cpu(plan, xs[0], workers, threads, sizes, opt)
    base_bytes = 0 if device == "cuda" else baseline.runtime_bytes(plan)
    return Measured(plan, layers, _out_bytes(plan), _param_bytes(plan), device, base_bytes,
                    collectives if device == "cpu" else None)


def _optimizer(spec: JobSpec) -> costs.Optimizer:
    """The job's optimizer as the workers build it (gpipe.optim), for its step's cost."""
    return optim.optimizer_class(spec.optimizer.name), spec.optimizer.torch_kwargs()


def _measure_cpu(plan: Plan, sample: Any, workers: int, threads: int | None, sizes: tuple[int, int],
                 opt: costs.Optimizer) -> tuple[list[LayerCosts], Collectives | None]:
    """The layers' costs as `workers` local workers see them: measured by as many processes at once, each pinned
    to a worker's cores (gpipe.memory.costs_together; one worker's cores at most once), and the collectives among them.
    Where those processes cannot run (the job's code not importable in a fresh interpreter), the layers
    measured here alone, and said so."""
    from gpipe.worker.cores import split_cores, threads_for

    sets = list({tuple(c): None for c in split_cores(workers)})  # workers that share a core: that core once
    counts = [threads or threads_for(list(c)) for c in sets]
    if len(sets) > 1:
        try:
            return costs_together.measure_together(plan.model, sample, sets, counts, sizes, optimizer=opt)
        except RuntimeError as e:
            print(f"plan: {one_line(str(e))}; the layers measured in one process alone instead (faster than a "
                  "run's workers see them)", file=sys.stderr)
    return costs.measure(plan.model, sample, torch.device("cpu"), counts[0], sizes, optimizer=opt), None


def _out_bytes(plan: Plan) -> list[Line]:
    fp = plan.footprint
    assert fp is not None
    return [fp.line(partial(_output_bytes, i + 1)) for i in range(len(plan.model))]


def _param_bytes(plan: Plan) -> list[int]:
    return [sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad) for layer in plan.model]


def predict_step(plan: Plan, threads: int) -> tuple[float | None, str]:
    """The job's own step time, predicted as `plan` predicts a configuration's, from its layers measured at its
    micro-batch size on this CPU with a worker's `threads`: (seconds, ""), or (None, why not)."""
    spec = plan.spec
    if spec.device != "cpu":
        return None, "device cuda: the coordinator measures on its CPU, no stand-in for a GPU's step time"
    if plan.footprint is None:
        return None, f"no footprint: {plan.footprint_missing}"
    if any(t.is_meta for t in plan.model.parameters()):
        return None, "the model is built on the meta device here (model.weights, init per_layer)"
    xs, _, sizes = plan.stream().shards(0)[0]
    n = max(sizes)
    layers = costs.measure(plan.model, xs[0], torch.device("cpu"), threads, (n, n), repeats=1,
                           optimizer=_optimizer(spec))
    m = Measured(plan, layers, _out_bytes(plan), _param_bytes(plan), "cpu")
    c = Config(spec.stages, spec.replicas, spec.schedule, spec.virtual_stages, spec.chunks,
               spec.activation_checkpoint, spec.optimizer.shard, tuple(plan.balance))
    step, _ = step_time(m, c, spec, [stages for _, stages in plan.tied_stages()])
    return step, ""


def _output_bytes(end: int, m: Layers) -> int:
    return m.output_bytes(end)


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def table(fits: Sequence[Candidate], batch: int, top: int) -> list[str]:
    head = "| # | workers | stages x replicas | schedule | chunks | checkpoint | shard | balance | step ms | " \
           "samples/s | bubble | peak GiB |"
    lines = [head, "| " + " | ".join(["---:"] * 2 + ["---"] * 6 + ["---:"] * 4) + " |"]
    for i, x in enumerate(fits[:top], 1):
        c = x.config
        v = f" x{c.virtual_stages}" if c.virtual_stages > 1 else ""
        lines.append(f"| {i} | {c.workers} | {c.stages} x {c.replicas} | {shown(c.schedule)}{v} | {c.chunks} | "
                     f"{c.activation_checkpoint} | {'yes' if c.shard else 'no'} | {list(c.balance)} | "
                     f"{x.step_s * 1e3:.1f} | {batch / x.step_s:.1f} | {x.bubble:.0%} | {_gib(x.peak)} |")
    return lines


def why_measured(best: Candidate, budget: int) -> str:
    """Why a measured job runs its order: its simulated step against each fixed schedule's that fits the same
    memory (gpipe.measured.build), and the memory it leaves."""
    b = best.built
    assert b is not None
    fits = {n: t for n, t in b.fixed.items() if t is not None}
    line = (f"measured: {b.step * 1e3:.1f} ms a step, bubble {best.bubble:.0%}, "
            + ("its own order" if b.source == measured.NAME else f"{b.source}'s order: no built one was faster"))
    if fits:
        name = min(fits, key=lambda n: fits[n])
        line += f"; the best fixed schedule within the memory, {name}: {fits[name] * 1e3:.1f} ms " \
                f"({fits[name] / b.step:.2f}x)"
    if over := [n for n, t in b.fixed.items() if t is None]:
        line += f"; over the memory: {', '.join(over)}"
    return f"{line}; fits in {_gib(best.peak)} of {_gib(budget)} GiB"


def why_best(fits: Sequence[Candidate], budget: int) -> str:
    """Why the first of `fits` wins: against the fastest of another schedule, and the memory it leaves."""
    best = fits[0]
    other = next((x for x in fits if shown(x.config.schedule) != shown(best.config.schedule)), None)
    line = f"{shown(best.config.schedule)}: {best.step_s * 1e3:.1f} ms a step, bubble {best.bubble:.0%}"
    if other is not None:
        line += (f" vs {shown(other.config.schedule)}'s {other.bubble:.0%} at best ({other.step_s * 1e3:.1f} ms, "
                 f"{other.step_s / best.step_s:.2f}x)")
    return f"{line}; fits in {_gib(best.peak)} of {_gib(budget)} GiB"


def refusal(over: Sequence[Candidate], budget: int, field: str = "--memory-gib") -> str:
    """The one line when nothing fits (`field`: what it names)."""
    if not over:
        return "plan: no configuration of this job could be predicted (no footprint)"
    low = over[0]
    return (f"{field}: no configuration fits {_gib(budget)} GiB a worker (its predicted peak within "
            f"{HEADROOM:.0%} of it); the smallest predicted peak is {_gib(low.peak)} GiB ({low.config.describe()}): give more memory or workers, a smaller "
            "data.batch_size, or a smaller model")


def written(text: str, source: str, c: Config, working_dir: str | None = None) -> str:
    """The job file's text with configuration `c` filled in (gpipe.coordinator.spec.overrides: the rest as it was);
    `working_dir`: the job's folder as the written file finds it, where that is not the written file's own."""
    from gpipe.coordinator.spec.overrides import apply

    sets = [f"{k}={json.dumps(v)}" for k, v in c.overrides().items()]
    if "split_points" in text:
        sets.append("model.split_points=null")
    if working_dir is not None:
        sets.append(f"working_dir={json.dumps(working_dir)}")
    return apply(text, sets, None, source)


def working_dir_from(out: Path, job_dir: Path) -> str | None:
    """working_dir for a job file written at `out` whose code and relative paths are `job_dir`'s (the planned job's
    folder): None where that is `out`'s own folder, else `job_dir` relative to it (absolute where they share
    no folder but the root), so its factories import and its relative paths resolve as the planned job's do,
    wherever it is validated or run from."""
    here, there = out.resolve().parent, job_dir.resolve()
    if here == there:
        return None
    common = Path(os.path.commonpath([here, there]))
    return str(there) if common == Path(common.anchor) else os.path.relpath(there, here)


def main(args: Any, spec: JobSpec, text: str, job_dir: Path) -> int:
    """`gpipe-coordinator plan`: the table (or --json's list as the last line), and --write's file."""
    from gpipe.coordinator.spec.job import parse_spec
    from gpipe.factory import enter_job_folder

    if not 1 <= args.workers <= MAX_WORKERS:
        raise SpecError(f"--workers: {args.workers} is outside 1..{MAX_WORKERS}")
    if not 0 < args.memory_gib <= 1 << 20:
        raise SpecError(f"--memory-gib: {args.memory_gib} is not a positive size in GiB")
    if not 1 <= args.top <= 1000:
        raise SpecError(f"--top: {args.top} is outside 1..1000")
    budget = int(args.memory_gib * 2**30)
    out = Path(args.write).absolute() if args.write else None  # where the command was given, before the chdir
    enter_job_folder(job_dir)
    m = measure(spec, job_dir, args.workers)
    fits, over = search(m, args.workers, budget)
    if not fits:
        raise SpecError(refusal(over, budget))
    batch = spec.data.batch_size
    if out is not None:
        best = fits[0]
        folder = working_dir_from(out, job_dir)
        new = (f"# {args.job} as `gpipe-coordinator plan --workers {args.workers} --memory-gib {args.memory_gib:g}` "
               f"chose: {best.config.describe()}; predicted {best.step_s * 1e3:.1f} ms a step, peak "
               f"{_gib(best.peak)} GiB\n" + ("" if folder is None else
                                              f"# working_dir: its code and relative paths are {job_dir}'s\n")
               + written(text, args.job, best.config, folder))
        parse_spec(new, source=str(out))  # what validate reads back
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        try:
            tmp.write_text(new)
            tmp.replace(out)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise SpecError(f"--write: {describe_os_error(e)}") from None
    if args.json:
        print(json.dumps([x.as_json(batch) for x in fits[:args.top]]))
        return 0
    print(f"{args.job}: {len(fits)} configuration(s) fit {_gib(budget)} GiB a worker on {args.workers} "
          f"worker(s) ({len(over)} do not); predicted from costs measured on this host, fastest first:")
    for line in table(fits, batch, args.top):
        print(line)
    print(why_best(fits, budget))
    if args.write:
        print(f"wrote {args.write}")
    return 0

