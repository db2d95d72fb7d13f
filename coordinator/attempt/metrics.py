"""A step's and an evaluation's figures: out of the stages' answers, into metrics.jsonl and plan.json."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from gpipe import schedule
from gpipe.contract import StepResult, disk_cause
from gpipe.coordinator.attempt.lr import lr_at
from gpipe.coordinator.plan.job import Plan, step_waits
from gpipe.errors import JobFailed, describe_os_error
from gpipe.files import atomic_write_json
from gpipe.memory.model import Prediction
from gpipe.topology import Slots, model_chunk


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

    def values(self) -> dict[str, Any]:
        """metrics.jsonl's line, as a dict: the fields by name, as they are (dataclasses.asdict would copy every
        action of every timeline, once per logged step, on the thread that drives the stages)."""
        return {f.name: getattr(self, f.name) for f in _STEP_FIELDS}


_STEP_FIELDS = fields(StepMetrics)


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


def step_metrics(plan: Plan, step: int, per_rank: dict[int, StepResult], step_time: float,
                 attempt: int) -> StepMetrics:
    """One step's figures out of every stage's answer (by slot: a model chunk of a replica, gpipe.topology.Slots)."""
    spec, slots = plan.spec, plan.spec.topology.model_chunks()
    last = slots.model_chunks - 1
    # Each replica's last stage summed its shard's losses, each weighted by its micro-batch's size.
    loss = sum(per_rank[slots.slot(r, last)].loss_sum or 0.0 for r in range(slots.replicas)) / spec.data.batch_size
    results = [per_rank[slot] for slot in slots.slots()]
    busy, span = busy_and_span(results)
    scaler = per_rank[slots.slot(0, last)]  # fp16: one scale for the job, the same on every rank
    return StepMetrics(
        step=step, loss=loss, lr=lr_at(spec, step), step_time_s=step_time,
        samples_per_s=spec.data.batch_size / step_time if step_time > 0 else 0.0,
        # The global norm, the same on every stage (clipping sums it over a replica's stages).
        grad_norm=per_rank[slots.slot(0, 0)].grad_norm, bubble_fraction=1.0 - busy / span if span > 0 else 0.0,
        attempt=attempt, stages=[s.metrics() for s in results], replicas=replica_figures(slots, results),
        loss_scale=scaler.loss_scale, skipped=scaler.skipped,
    )


def step_span(per_stage: dict[int, StepResult]) -> float:
    """A step's time as its stages measured it: the longest any of them took, from its start to its optimizer
    step (for a step that waited behind an evaluation, which the coordinator's clock cannot tell apart)."""
    return max(s.busy_s + s.idle_s for s in per_stage.values())


def busy_and_span(results: list[StepResult]) -> tuple[float, float]:
    """The stages' busy seconds, and the workers' seconds they were part of: a worker that holds several model
    chunks (virtual stages) counts its step once, its chunks' busy time together, so the bubble is its idle time."""
    spans: dict[int, float] = {}
    busy: dict[int, float] = {}
    for s in results:
        spans[s.rank] = max(spans.get(s.rank, 0.0), s.busy_s + s.idle_s)
        busy[s.rank] = busy.get(s.rank, 0.0) + s.busy_s
    # A chunk's window is its own clock's: an action of it that another chunk's turn ran may fall outside it,
    # so a worker's span is at least its chunks' busy time together (its bubble is never negative).
    return sum(busy.values()), sum(max(spans[r], busy[r]) for r in spans)


def replica_figures(slots: Slots, results: list[StepResult]) -> list[dict[str, Any]]:
    """Per replica, out of its stages' answers (by slot): its step time (its slowest stage's, the optimizer
    step included), its stages' busy seconds, its bubble, and the longest any of its stages waited for the
    gradient sums across replicas after its backward (reduce_s: idle, not busy)."""
    out = []
    for r in range(slots.replicas):
        own = [results[slot] for slot in slots.replica_slots(r)]
        busy, span = busy_and_span(own)
        out.append({"replica": r, "step_time_s": max(s.busy_s + s.idle_s for s in own), "busy_s": busy,
                    "bubble_fraction": 1.0 - busy / span if span > 0 else 0.0,
                    "reduce_s": max(s.reduce_s or 0.0 for s in own)})
    return out


SIMULATED_MAX = 1 << 14  # stages x chunks up to which plan.json lists the actions (a tenth of a second)
STEADY_MAX = SIMULATED_MAX // 8  # and simulates steps in a row (4 of them: as long again)


def schedule_plan(name: str, stages: int, chunks: int, virtual: int = 1,
                  waits: Sequence[Collection[int]] = ()) -> dict[str, Any]:
    """A schedule as plan.json shows it: each worker's actions in order (F forward, B backward, W the weights'
    gradients of a split backward; F3.1: micro-batch 3 on the worker's model chunk 1), the model chunks each
    worker holds (`model_chunks`, with virtual stages), the simulator's bubble of one step and of steps in a row
    (gpipe.schedule.steady: each worker starts its next step once its own is done, or, in each set of `waits`,
    once all of them are: step_waits), and micro-batches in flight. Past SIMULATED_MAX actions, the name only; past STEADY_MAX, no
    steps in a row."""
    if stages * chunks * virtual > SIMULATED_MAX:
        return {"name": name}
    sim = schedule.simulate(name, stages, chunks, virtual)
    out: dict[str, Any] = {"name": name}
    if stages * chunks * virtual <= STEADY_MAX:
        split = [schedule.splits_backward(schedule.build(name, k, stages, chunks, virtual)) for k in range(stages)]
        _, steady = schedule.steady(name, stages, chunks, virtual, lambda k, a: schedule.cost(a.kind, split[k]),
                                    waits=waits)
        out["steady_bubble_fraction"] = round(steady, 4)
    if virtual > 1:
        out |= {"virtual_stages": virtual,
                "model_chunks": [[model_chunk(name, k, c, stages) for c in range(virtual)] for k in range(stages)]}
    return out | {"actions": [" ".join(map(repr, schedule.build(name, k, stages, chunks, virtual)))
                              for k in range(stages)],
                  "simulated_bubble_fraction": round(sim.bubble_fraction, 4), "max_in_flight": sim.max_in_flight}


def write_plan(out: Path, plan: Plan, placement: list[dict[str, Any]],
               predicted: Sequence[Prediction] | None = None, missing: str = "") -> None:
    """plan.json: the balance, what it was chosen by, where each stage (model chunk) runs (replica 0's copy),
    and every worker by rank: its replica, stage, model chunks, placement (`placement`, by rank) and predicted
    peak memory (`predicted`, by rank: gpipe.coordinator.plan.prediction; without it, why: `missing`, else the plan's)."""
    spec, top = plan.spec, plan.spec.topology
    slots = top.model_chunks()
    held: dict[int, list[int]] = {}  # rank -> the model chunks it holds
    for slot in slots.slots():
        held.setdefault(top.worker_of(slot), []).append(slots.model_chunk_of(slot))
    atomic_write_json(out / "plan.json", {
        "balance": plan.balance,
        "balance_by": plan.balance_by,
        "layer_costs": plan.balance_costs,
        "replicas": spec.replicas,
        "schedule": schedule_plan(spec.schedule, spec.stages, spec.chunks, spec.virtual_stages,
                                  step_waits(spec, [held for _, held in plan.tied_stages()])),
        "stages": [
            {"stage": k, "layers": list(b), "parameters": plan.stage_parameters(k), "modules": plan.stage_modules(k),
             **({"receives": cut} if (cut := plan.cut_lines()[k - 1:k] if k else []) else {}),
             **({"rank": top.worker_of(k)} if spec.virtual_stages > 1 else {}), **placement[top.worker_of(k)]}
            for k, b in enumerate(plan.bounds)
        ],
        "workers": [{"rank": n, "replica": top.replica_of(n), "stage": top.stage_of(n),
                     **({"model_chunks": held[n]} if spec.virtual_stages > 1 else {}), **placement[n],
                     **_predicted(predicted[n] if predicted else None, missing or plan.footprint_missing)}
                    for n in top.ranks()],
        "spec": spec.model_dump(mode="json"),
        **({"auto": plan.auto} if plan.auto else {}),
        "predicted_step_s": None if plan.predicted_step_s is None else round(plan.predicted_step_s, 6),
        **({"predicted_step_missing": plan.predicted_step_missing} if plan.predicted_step_missing else {}),
        # the probes' answers kept from an earlier plan of the unchanged job, by name (gpipe.coordinator.plan.probe_cache)
        **({"probes_kept": plan.probes.reused} if plan.probes.reused else {}),
    })


def _predicted(p: Prediction | None, missing: str) -> dict[str, Any]:
    """A worker's predicted peak in plan.json: the bytes, and their parts and moment (docs/memory.md)."""
    if p is None:
        return {"predicted_peak_bytes": None, **({"predicted_missing": missing} if missing else {})}
    return {"predicted_peak_bytes": p.peak, "predicted_memory": {**p.parts, "moment": p.moment}}


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

    def logs(self, step: int) -> bool:
        """Whether step `step` gets its line: every `log_every`-th, and the last."""
        return not step % self.log_every or step == self.steps - 1

    def write(self, values: dict[str, Any]) -> None:
        """A step's line (StepMetrics.values())."""
        self._line(values)

    def write_eval(self, m: EvalMetrics) -> None:
        """Every evaluation gets its line: {"step", "eval_loss", "eval_samples", "eval_time_s", "attempt"}."""
        self._line(asdict(m))

    def _line(self, values: dict[str, Any]) -> None:
        try:
            self.f.write(json.dumps(values) + "\n")
            self.f.flush()
        except OSError as e:  # a full disk: name the file
            raise JobFailed(f"metrics: {describe_os_error(OSError(e.errno, e.strerror, str(self.path)))}",
                            cause=disk_cause(e)) from None

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a write that failed already said so
            self.f.close()
