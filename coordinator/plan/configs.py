"""The StageConfig each stage is built with, derived from the plan: the one place a JobSpec field becomes a
stage's setting (or is declared the coordinator's alone)."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from gpipe.contract import StageConfig
from gpipe.coordinator.plan.job import Plan

# Every JobSpec field is one of three kinds (stage_config checks, so that a new one cannot be forgotten):
# copied to the StageConfig field of the same name,
SAME_AS_SPEC = ("virtual_stages", "schedule", "chunks", "activation_checkpoint", "seed", "clip_grad_norm",
                "step_timeout_s", "start_timeout_s", "deferred_batch_norm", "replicas", "init", "init_hook",
                "precision", "deterministic")
# read into StageConfig fields of other names (stage_config),
DERIVED_FROM_SPEC = ("stages", "model", "loss", "optimizer", "data", "loss_scale", "eval", "steps", "activation_meter_every")
# or the coordinator's alone: the stages never see it.
COORDINATOR_ONLY = ("name", "balance", "probe", "lr_schedule", "device", "log_every", "trace_step",
                    "checkpoint_every", "keep_checkpoints", "max_restarts", "restart_timeout_s", "peer_timeout_s",
                    "keep_best", "working_dir", "exclude", "elastic", "auto", "priority")


def stage_config(plan: Plan, model_chunk: int, replica: int, device: str, store_host: str,
                 store_port: int) -> StageConfig:
    """The stage running model chunk `model_chunk` of `replica` (the job's stage, with one model chunk a worker),
    derived from the plan's job spec: its layers, the spec's training
    settings, its device and the data-plane store.

    Every field is set here, none left to its default, and every spec field is accounted for
    (SAME_AS_SPEC, DERIVED_FROM_SPEC, COORDINATOR_ONLY): TypeError names one that is not.
    """
    spec = plan.spec
    unknown = set(type(spec).model_fields) - {*SAME_AS_SPEC, *DERIVED_FROM_SPEC, *COORDINATOR_ONLY}
    if unknown:
        raise TypeError(f"JobSpec.{sorted(unknown)[0]}: say in gpipe.coordinator.plan.configs whether a stage needs it")
    start, end = plan.bounds[model_chunk]
    evals = plan.eval_schedule()
    first = replica == 0  # replica 0 alone evaluates: the other replicas' stages queue no eval batches
    values: dict[str, Any] = {name: getattr(spec, name) for name in SAME_AS_SPEC}
    values |= {
        "model_chunk": model_chunk, "start": start, "end": end, "replica": replica, "device": device,
        "store_host": store_host, "store_port": store_port,
        "model_factory": spec.model.factory, "model_args": spec.model.args, "loss": spec.loss_function,
        "optimizer": spec.optimizer.name, "optimizer_args": spec.optimizer.torch_kwargs(),
        "shard_optimizer": spec.optimizer.shard,
        "import_paths": plan.import_paths, "skip_routes": plan.skip_routes(),
        "batch_size": spec.data.batch_size,
        "loss_scale": (spec.loss_scale.init, spec.loss_scale.growth_interval),
        # Evaluation (gpipe.eval_schedule.EvalSchedule): spec.eval and spec.steps, as the plan schedules them.
        "eval_every": evals.every if first else None, "eval_batches": evals.batches if first else 0,
        "steps": evals.steps if first else 0,
        "last_step": spec.steps - 1,  # metered (activation_meter_every), as each attempt's first step is
        # on logged steps only: every activation_meter_every-th rounded up to a multiple of log_every
        "activation_meter_every": None if spec.activation_meter_every is None
        else math.lcm(spec.activation_meter_every, spec.log_every),
        "capture": plan.capture_args(), "pieces": plan.stage_pieces(model_chunk), "tied": plan.tied_stages(),
        "model_chunks": spec.model_chunks,  # a Stage per model chunk; virtual_stages of them on each worker
    }
    if unset := {f.name for f in fields(StageConfig)} - set(values):
        raise TypeError(f"StageConfig.{sorted(unset)[0]}: configs.stage_config does not set it")
    return StageConfig(**values)


