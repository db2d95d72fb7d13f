"""Resuming: what a checkpoint records of the job, and each stage's slice of it under the plan's balance.

The checkpoint's layout on disk is gpipe.coordinator.outputs.checkpoint's; this cuts what it
holds into what each stage of the resuming attempt is sent (gpipe.coordinator.attempt.state_stream).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpipe import stream
from gpipe.coordinator.attempt import state_stream as streaming
from gpipe.coordinator.attempt.lr import lr_at
from gpipe.coordinator.outputs import checkpoint
from gpipe.coordinator.plan.job import Plan
from gpipe.errors import SpecError
from gpipe.precision import LossScaler
from gpipe.state import LOSS_SCALE, OPTIM, RNG, model_key, optim_key


def checkpoint_meta(plan: Plan, step: int) -> dict[str, Any]:
    """The job-level state of a checkpoint taken after `step` steps.

    The data position, the randomness and the LR are functions of the step
    (and the spec), so these record the step and what it means; a resumed job
    checks them against its own plan.
    """
    spec = plan.spec
    batch, n = spec.data.batch_size, len(plan.dataset)  # type: ignore[arg-type]  # torch's Dataset type has no __len__; the plan checked it
    return {
        "job": spec.name, "steps": spec.steps, "stages": spec.stages, "virtual_stages": spec.virtual_stages,
        "schedule": spec.schedule, "balance": plan.balance,
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
    stages (Run.build). The checkpoint names every tensor by the un-partitioned
    model (a captured model's own names: Plan.weight_name; a tied weight once),
    so it fits any balance and any split; each stage is sent its tensors under
    its own names. The RNG states are restored
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
    check_fits(ck.model_shapes(), {plan.weight_name(k): t for k, t in plan.model.state_dict().items()}, where)
    scalars: dict[str, Any] = {}
    optim: dict[str, list[tuple[int, str, str]]] = {}  # parameter -> (shard, key there, the optimizer's key)
    for j, sh in enumerate(ck.shards):
        scalars.update(sh.json_state.get("optimizer_state", {}))
        for key in sh.entries:
            if key.startswith(OPTIM):
                param, _, what = key.removeprefix(OPTIM).rpartition("/")
                optim.setdefault(param, []).append((j, key, what))
    same = len(ck.shards) == plan.spec.model_chunks
    extra = {}
    if plan.spec.precision == "fp16" and (saved := ck.shards[0].json_state.get(LOSS_SCALE)) is not None:
        try:  # the job's one loss scale, the same on every stage: a resumed fp16 job goes on with it
            extra[LOSS_SCALE] = LossScaler.from_state(saved).state()
        except ValueError as e:
            raise SpecError(f"{where}: {e}") from None
    slices = []
    for k in range(plan.spec.model_chunks):
        part = streaming.StageSlice()
        mine: dict[str, Any] = {}
        for name, initial in plan.stage_state(k).items():
            saved_as = plan.weight_name(name)
            if saved_as in weights:
                part.from_disk[model_key(name)] = weights[saved_as]
            elif plan.spec.init == "exact":  # non-persistent buffers are not in a state dict: the model's own
                part.in_memory[model_key(name)] = initial
            for j, key, what in optim.get(saved_as, []):
                part.from_disk[optim_key(name, what)] = (j, key)
                dtype, shape, _, _ = ck.shards[j].entries[key]
                part.declared[optim_key(name, what)] = (stream.DTYPES[dtype], shape)
            if saved_as in scalars:
                mine[name] = scalars[saved_as]
        if same:
            for key in ck.shards[k].entries:
                if key.startswith(RNG):
                    part.from_disk[key] = (k, key)
                    dtype, shape, _, _ = ck.shards[k].entries[key]
                    part.declared[key] = (stream.DTYPES[dtype], shape)
        groups = ck.shards[k if same else 0].json_state.get("param_groups", [])
        part.json_state = {"param_groups": groups, "optimizer_state": mine, **extra}
        slices.append(part)
    return slices


def weight_parts(plan: Plan) -> list[streaming.StageSlice]:
    """Per stage: where its tensors are in model.weights (found by the model's names: Plan.weight_name), and what
    the file does not hold (non-persistent buffers: the plan's own). A tied weight's holders read the same one."""
    slices = []
    for k in range(plan.spec.model_chunks):
        part = streaming.StageSlice(json_state=None)
        for key, initial in plan.stage_state(k).items():
            name = plan.weight_name(key)
            if name in plan.weights_at:
                part.from_disk[model_key(key)] = plan.weights_at[name]
            else:
                part.in_memory[model_key(key)] = initial
        slices.append(part)
    return slices
