"""Job specs for the tests: one builder, `job`, over one small valid spec, and the presets the tests share.

    job()                                     # BASE: 2 stages of a small mlp, 2 steps of sgd
    job(TWO_STAGES, steps=6)                  # a preset, then fields
    job(SERVICE, name="svc", data__batch_size=16, balance=DELETE)

A preset is a mapping of changes like the keyword arguments: each replaces its field whole, a name with `__`
reaches inside (data__batch_size changes the batch size and keeps the rest of data), and DELETE removes a
field. A test module's own preset sits in that module; the presets here are those several modules use.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml

DELETE: Any = object()  # a change's value that removes the field

# The smallest job the tests train: every field the schema requires, two stages, a few seconds on one core.
BASE: dict[str, Any] = {
    "name": "ok", "model": {"factory": "mlp", "args": {"width": 8, "depth": 3}}, "stages": 2, "chunks": 2,
    "data": {"factory": "random_regression", "args": {"n": 16, "in_features": 8, "out_features": 8},
             "batch_size": 4},
    "loss": "mse", "optimizer": {"name": "sgd", "lr": 0.1}, "steps": 2,
}

# BASE as a job file: for the tests of what the parser makes of text (GOOD.replace(...), text appended).
GOOD = """
name: ok
model: {factory: mlp, args: {width: 8, depth: 3}}
stages: 2
chunks: 2
data: {factory: random_regression, args: {n: 16, in_features: 8, out_features: 8}, batch_size: 4}
loss: mse
optimizer: {name: sgd, lr: 0.1}
steps: 2
"""


def job(*presets: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    """A job spec: BASE, then each preset's changes, then `changes`, in that order (a new dict each call)."""
    spec = copy.deepcopy(BASE)
    for each in (*presets, changes):
        for path, value in each.items():
            put(spec, path.split("__"), value)
    return spec


def job_yaml(*presets: Mapping[str, Any], **changes: Any) -> str:
    """job(*presets, **changes) as a job file's text."""
    return yaml.safe_dump(job(*presets, **changes))


def put(d: dict[str, Any], keys: list[str], value: Any) -> None:
    """Set d[k0][k1]...[kn] to (a copy of) value, or with DELETE remove it."""
    for k in keys[:-1]:
        d = d[k]
    if value is DELETE:
        del d[keys[-1]]
    else:
        d[keys[-1]] = copy.deepcopy(value)


def regression(n: int, width: int, batch_size: int, **more: Any) -> dict[str, Any]:
    """The `data` of `n` random (x, y) pairs, both `width` wide (gpipe.builtins.random_regression)."""
    return {"factory": "random_regression", "args": {"n": n, "in_features": width, "out_features": width},
            "batch_size": batch_size, **more}


def slow_mlp(width: int, seconds: float) -> dict[str, Any]:
    """The `model` of tests.support.models:slow_mlp: steps held slow enough to act on a running job."""
    return {"factory": "tests.support.models:slow_mlp", "args": {"width": width, "seconds": seconds}}


# The service tests' job: 2 stages, 2 + 2 layers, 5 steps of sgd with momentum.
SERVICE: dict[str, Any] = {
    "name": "job", "seed": 1, "model": {"factory": "mlp", "args": {"width": 16, "depth": 3}}, "balance": [2, 2],
    "data": regression(40, 16, 8), "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "steps": 5,
}

# Pipelined against one device: an mlp of 7 layers on 2 stages, 4 steps (the transparency tests and theirs).
TWO_STAGES: dict[str, Any] = {
    "name": "t", "seed": 3, "model": {"factory": "mlp", "args": {"width": 16, "depth": 5}},
    "data": regression(50, 16, 8), "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "steps": 4,
}

# One Stage in this process, a world of one: dropout, adamw, clipping (tests.support.local).
ONE_STAGE: dict[str, Any] = {
    "name": "s", "seed": 5, "stages": 1, "chunks": 3,
    "model": {"factory": "tests.support.models:mlp_dropout", "args": {"width": 8, "depth": 2}},
    "data": regression(20, 8, 7), "optimizer": {"name": "adamw", "lr": 0.01}, "clip_grad_norm": 0.5, "steps": 3,
    "start_timeout_s": 30, "step_timeout_s": 30,
}

# ONE_STAGE on BatchNorm layers (tests.support.models:bn_net), sgd: running statistics against one device.
BATCHNORM: dict[str, Any] = {
    "model": {"factory": "tests.support.models:bn_net", "args": {"width": 8}}, "data": regression(40, 8, 10),
    "chunks": 3, "optimizer": {"name": "sgd", "lr": 0.1},
}

# The driver over three local stages: dropout, adam, clipping, 1f1b, recomputed activations.
THREE_STAGES: dict[str, Any] = {
    "name": "d", "seed": 3, "stages": 3, "balance": [2, 3, 2], "chunks": 3,
    "model": {"factory": "tests.support.models:mlp_dropout", "args": {"width": 16, "depth": 2}},
    "data": regression(40, 16, 9), "optimizer": {"name": "adam", "lr": 0.01}, "clip_grad_norm": 0.5, "steps": 4,
    "schedule": "1f1b", "activation_checkpoint": "except_last", "start_timeout_s": 30, "step_timeout_s": 30,
}

# A small GPT-2 (Hugging Face, from a config), cut at its third block, on stages by the spec's default.
GPT2: dict[str, Any] = {
    "name": "t", "seed": 0, "stages": DELETE,
    "model": {"factory": "tests.support.models:gpt2", "args": {}, "split_points": ["transformer.h.2"]},
    "chunks": 4, "schedule": "1f1b", "activation_checkpoint": "except_last",
    "data": {"factory": "tests.support.models:token_pairs", "args": {"n": 32}, "batch_size": 8, "shuffle": False},
    "loss": "cross_entropy", "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "clip_grad_norm": 0.5,
    "steps": 4, "checkpoint_every": 2,
}

# TWO_STAGES in bf16 (the mixed precision tests).
PRECISION: dict[str, Any] = {"optimizer__lr": 0.1, "precision": "bf16"}

# Models bigger than one process: per-layer init of LayerNorm'd layers.
SCALE: dict[str, Any] = {
    "name": "s", "seed": 5, "model": {"factory": "tests.support.models:mlp_norm", "args": {"width": 16, "depth": 4}},
    "init": "per_layer", "data": regression(48, 16, 8), "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "steps": 3,
}

# On one GPU: a wider mlp with dropout, 4 micro-batches.
GPU: dict[str, Any] = {
    "name": "g", "seed": 5, "model": {"factory": "tests.support.models:mlp_dropout", "args": {"width": 64, "depth": 6}},
    "chunks": 4, "data": regression(64, 64, 32), "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "steps": 3,
}

# BASE on CUDA devices, not restarted.
CUDA: dict[str, Any] = {"name": "gpus", "device": "cuda", "max_restarts": 0}



# Evaluation: BatchNorm, dropout, and an LR that trains for three steps, then diverges (the best eval loss is
# at step 2, not the last); the held-out set, 30 items in batches of 8: the last batch has 6, so a short batch
# is cut into micro-batches too.
EVAL: dict[str, Any] = {
    "name": "e", "seed": 3, "model": {"factory": "tests.support.models:bn_net", "args": {"width": 8}}, "chunks": 3,
    "schedule": "1f1b", "activation_checkpoint": "except_last", "data": regression(40, 8, 8),
    "optimizer": {"name": "sgd", "lr": 0.7, "momentum": 0.9}, "steps": 5, "checkpoint_every": 2,
    "eval": {"data": {"factory": "random_regression", "args": {"n": 30, "in_features": 8, "out_features": 8,
                                                               "seed": 1}, "batch_size": 8}, "every": 1},
    "keep_best": True,
}
