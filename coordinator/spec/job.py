"""The job spec: `job.yaml` parsed into pydantic models that validate themselves.

Every model forbids unknown fields and describes each field, so that an error
names the field path and `JobSpec.model_json_schema()` documents the format.
Every number has a range that fits the wire format (int64 steps) and the
machine, and floats are finite; an integer field takes integers only (not
`true`, not `2.0`). The text itself is bounded before it is parsed: see
`parse_spec`. Checks that need the model or the data set (balance against the
layer count, say) live in `gpipe.coordinator.plan.job`, and run before any worker is
started.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    StrictInt,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from gpipe import schedule as schedules
from gpipe.coordinator.spec import boundedyaml
from gpipe.errors import SpecError
from gpipe.optim import NAMES, is_import_path
from gpipe.options import Checkpoint, violation
from gpipe.show import one_line, short
from gpipe.text import printable
from gpipe.topology import Topology

FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a job, as the one message every door says it with (the spec, --name, serve's
    API, `delete`); None when it can. A name is a folder's: <state-dir>/<name>/."""
    if NAME_RE.fullmatch(name):
        return None
    return (f"'{printable(name, 80)}' is not a job name: 1-64 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit")

# The spec text (what serve may check before parsing anything).
MAX_SPEC_BYTES = 1 << 20  # UTF-8 bytes
MAX_DEPTH = 64  # collections nested in one another; the top-level mapping is 1
MAX_NODES = 250_000  # scalars and collections, every alias expanded
# The numbers in it.
MAX_STEPS = 10**9  # steps, and every count of steps; well inside int64 on the wire
MAX_STAGES = 64
MAX_VIRTUAL_STAGES = 16  # model chunks per worker (interleaved-1f1b)
MAX_REPLICAS = 64
MAX_WORKERS = 256  # replicas x stages: ranks of one c10d world (and one RPC world, with the coordinator)
MAX_CHUNKS = 4096
MAX_BATCH_SIZE = 1 << 20
MAX_LAYERS_PER_STAGE = 10**6
MAX_SEED = 2**32 - 1  # the shuffle seeds torch with seed * 1_000_003 + epoch, below 2**64
MAX_KEEP_CHECKPOINTS = 1000
MAX_RESTARTS = 100
MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_FACTORY_CHARS = 256
MAX_PATH_CHARS = 4096
MAX_LR = 1000  # lr, min_lr and weight_decay: finite, and a bound no training comes near
MAX_CLIP_GRAD_NORM = 10**6
MAX_LOSS_SCALE = 2.0**24
MAX_GROWTH_INTERVAL = 10**6


@dataclass(frozen=True)
class Range:
    """Annotated metadata: the number lies in [lo, hi] (open at an end when told) and is finite.

    Anything else (out of range, inf, nan, a bool, text or 2.0 for an integer) is
    one line that names both bounds: `must be an integer between 1 and 1000000000,
    got 1e+30`, `must be greater than 0 and at most 604800, got inf`.
    """

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        inner = handler(source)
        what = "an integer " if inner.get("type") == "int" else ""

        def validate(v: Any, as_number: core_schema.ValidatorFunctionWrapHandler) -> Any:
            if isinstance(v, bool):
                raise ValueError(self._refuse(what, v))
            try:
                x = as_number(v)
            except ValidationError:
                raise ValueError(self._refuse(what, v)) from None
            below = x <= self.lo if self.lo_open else x < self.lo
            above = x >= self.hi if self.hi_open else x > self.hi
            if below or above or not math.isfinite(x):
                raise ValueError(self._refuse(what, v))
            return x

        return core_schema.no_info_wrap_validator_function(validate, inner)

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        js = handler(schema)
        js["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        js["exclusiveMaximum" if self.hi_open else "maximum"] = self.hi
        return js

    def _refuse(self, what: str, v: Any) -> str:
        lo, hi = short(self.lo), short(self.hi)
        if self.lo_open or self.hi_open:
            span = (f"greater than {lo}" if self.lo_open else f"at least {lo}") + " and " + (
                f"less than {hi}" if self.hi_open else f"at most {hi}")
        else:
            span = f"between {lo} and {hi}"
        return f"must be {what}{span}, got {short(v)}"


Steps = Annotated[StrictInt, Range(1, MAX_STEPS)]
Seconds = Annotated[float, Range(0, MAX_TIMEOUT_S, lo_open=True)]
Fraction = Annotated[float, Range(0, 1, hi_open=True)]  # [0, 1)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_factory(v: str) -> str:
    if not FACTORY_RE.match(v):
        raise ValueError(f"{v!r} is not 'module:function' or a registered name")
    return v


def _check_collate(v: str | None) -> str | None:
    if v is not None and (":" not in v or not FACTORY_RE.match(v)):
        raise ValueError(f"{v!r} is not 'module:function'")
    return v


MODULE_NAME_RE = re.compile(r"^[A-Za-z_0-9][\w]*(\.[A-Za-z_0-9][\w]*)*$")


def _check_module_name(v: str) -> str:
    if not MODULE_NAME_RE.match(v):
        raise ValueError(f"{v!r} is not a submodule's dotted name (transformer.h.2)")
    return v


ModuleName = Annotated[str, Field(min_length=1, max_length=MAX_FACTORY_CHARS), AfterValidator(_check_module_name)]


MAX_SCHEDULE_NAME = 64
MAX_SCHEDULE_PATH = 4096


def _schedule_file(v: Any) -> Any:
    """`{file: order.csv}`: a table of actions read from that CSV file when the job is planned (its path
    relative to the job's folder), held meanwhile as gpipe.schedule.FILE's name."""
    if not isinstance(v, dict):
        return v
    path = v.get("file")
    if set(v) != {"file"} or not isinstance(path, str) or not path.strip():
        raise ValueError("a schedule's mapping is {file: PATH}: a CSV table of actions (docs/schedules.md)")
    if len(path) > MAX_SCHEDULE_PATH or not path.isprintable():
        raise ValueError(f"file: a path of at most {MAX_SCHEDULE_PATH} printable characters")
    return schedules.FILE + path


def _check_schedule(v: str) -> str:
    """A registered schedule (gpipe.schedule.REGISTRY: the records below, and any registered since); a table of
    actions (gpipe.schedule.table: what `measured` and a CSV file become, as plan.json's spec keeps it),
    checked whole with the job's shape (gpipe.options.violation); or a CSV file's, still to be read."""
    if schedules.is_table(v) or schedules.is_file(v):
        if schedules.is_table(v):
            schedules.parse_table(v)  # ValueError names the first word that is no action
        return v
    if v not in schedules.REGISTRY or len(v) > MAX_SCHEDULE_NAME:
        near = difflib.get_close_matches(v[:MAX_SCHEDULE_NAME].lower(), schedules.names(), n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ValueError(f"{short(v)} is not one of {', '.join(schedules.names())} or {{file: PATH}}{hint}")
    return v


# The schedules a job may name, checked against the registry when the spec is read; the reference lists those
# gpipe ships (schedules.Name), and `{file: PATH}`. A table's name is as long as its actions (measured.MAX_ACTIONS).
ScheduleName = Annotated[
    str, BeforeValidator(_schedule_file), Field(max_length=MAX_SPEC_BYTES), AfterValidator(_check_schedule),
    WithJsonSchema({"anyOf": [{"enum": list(get_args(schedules.Name)), "type": "string"},
                              {"type": "object", "properties": {"file": {"type": "string"}}, "required": ["file"],
                               "additionalProperties": False}]})]


class ModelSpec(_Spec):
    factory: str = Field(
        max_length=MAX_FACTORY_CHARS,
        description="'module:function' returning the model: an nn.Sequential (cut between its layers), or any "
        "nn.Module (captured with torch.export and cut at its repeated blocks or its split_points), or a "
        "registered name (mlp).",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the factory.")
    split_points: Annotated[list[ModuleName], Field(min_length=1, max_length=MAX_STAGES - 1)] | None = Field(
        default=None, description="A model that is not an nn.Sequential: cut before each of these submodules "
        "(transformer.h.2), in order; stages is then their number plus one. None: cut at the model's repeated "
        "blocks, divided by balance.",
    )
    output: ModuleName | None = Field(
        default=None, description="What of the model's output the loss takes: a key or attribute. None: logits "
        "when the output has them, else the output if a tensor, else its first tensor.",
    )
    weights: str | None = Field(
        default=None, min_length=1, max_length=MAX_PATH_CHARS,
        description="Start from pretrained weights: a safetensors file, or a folder holding model.safetensors "
        "or a sharded model.safetensors.index.json (save_pretrained's, or a finished job's output folder), "
        "relative to the job's folder (working_dir, else the job file's; under serve, its copy of the job's code). "
        "Names are the model's own (an nn.Sequential's: its state_dict "
        "names); a tied weight is read once. Each stage is sent its own tensors only. A tensor missing, one "
        "more, or one of another shape or dtype is refused, naming it. A resumed job starts from its "
        "checkpoint instead.",
    )

    _factory = field_validator("factory")(_check_factory)


IDENTIFIER_RE = re.compile(r"^[A-Za-z_]\w*$")


def _check_identifier(v: str) -> str:
    if not IDENTIFIER_RE.match(v):
        raise ValueError(f"{v!r} is not a keyword argument's name (targets, labels)")
    return v


class OwnLoss(_Spec):
    """The model's own loss: the model takes the batch's targets as a keyword argument and returns its loss."""

    from_model: Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_check_identifier)] = Field(
        description="The keyword the model's forward takes the targets by (nanoGPT's targets, Hugging Face's "
        "labels); its output's loss (a 'loss' key or attribute, or the one scalar of a tuple) is backwarded.",
    )


MAX_READ_AHEAD = 16  # data.read_ahead: each step sent ahead holds its inputs and targets in the stages' memory


class DataSpec(_Spec):
    factory: str = Field(
        max_length=MAX_FACTORY_CHARS,
        description="'module:function' returning a map-style Dataset of (input, target) pairs, "
        "or a registered name (random_regression; tokens: token files; hf_dataset: a local Hugging Face dataset; "
        "docs/data.md).",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the factory.")
    batch_size: Annotated[StrictInt, Range(1, MAX_BATCH_SIZE)] = Field(
        description="Samples per step, cut into `chunks` micro-batches."
    )
    shuffle: bool = Field(
        default=False,
        description="Visit the data set in a seeded random order each epoch. With false, step s "
        "uses items s*B ... s*B+B-1, taken modulo the data set's length.",
    )
    collate: str | None = Field(
        default=None, max_length=MAX_FACTORY_CHARS,
        description="'module:function' taking a step's list of items and returning the batch as an "
        "(input, target) pair; none: torch's default_collate, which stacks tensors. Every tensor of "
        "the batch is then cut into micro-batches along dim 0, which must be batch_size long.",
    )

    read_ahead: Annotated[StrictInt, Range(1, MAX_READ_AHEAD)] = Field(
        default=2,
        description="Steps whose batches the coordinator reads, cuts and sends to the stages before the oldest "
        "of them has finished: 1 sends step s+1 once step s is done (the first stage then waits for it); more "
        "keep the stages fed through a slow read, each step ahead holding its inputs and targets in the "
        "stages' memory. The weights do not depend on it.",
    )

    _factory = field_validator("factory")(_check_factory)
    _collate = field_validator("collate")(_check_collate)


OPTIMIZER_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
TYPED_OPTIONS = ("momentum", "dampening", "nesterov", "weight_decay", "betas", "eps")  # sgd's, adam's, adamw's


def _check_optimizer_name(v: str) -> str:
    if v not in NAMES and not OPTIMIZER_RE.match(v):
        raise ValueError(f"{v!r} is neither {', '.join(NAMES)} nor a class's import path 'module:Class' "
                         f"(torch.optim:RMSprop){_hint(v, list(NAMES))}")
    return v


class OptimizerSpec(_Spec):
    name: str = Field(
        max_length=MAX_FACTORY_CHARS,
        description="The optimizer, run on every stage: sgd, adam or adamw (their options are the fields below), "
        "or any torch.optim.Optimizer subclass by import path, 'torch.optim:RMSprop' or 'module:Class' of the "
        "job's own code, its options in `args`.",
    )
    lr: Annotated[float, Range(0, MAX_LR, lo_open=True)] = Field(
        description="Learning rate (the peak, under an LR schedule)."
    )
    momentum: Fraction = Field(default=0.0, description="sgd: momentum.")
    dampening: Annotated[float, Range(0, 1)] = Field(default=0.0, description="sgd: dampening of momentum.")
    nesterov: bool = Field(default=False, description="sgd: Nesterov momentum.")
    weight_decay: Annotated[float, Range(0, MAX_LR)] | None = Field(
        default=None, description="L2 penalty (decoupled for adamw). Default: 0, adamw 0.01."
    )
    betas: tuple[Fraction, Fraction] = Field(default=(0.9, 0.999), description="adam/adamw: betas.")
    eps: Annotated[float, Range(0, 1, lo_open=True)] = Field(default=1e-8, description="adam/adamw: epsilon.")
    shard: bool = Field(
        default=False, description="With replicas: each replica of a stage keeps 1/replicas of the stage's "
        "optimizer state and updates that share of its parameters, then the replicas gather the updated "
        "weights (ZeRO stage 1: the gradients stay whole). The same weights as unsharded; needs replicas > 1. "
        "sgd, adam and adamw only: their updates are element-wise, which updating flat slices needs.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="An optimizer by import path: its keyword arguments but params and lr "
        "({alpha: 0.9, momentum: 0.5}). validate checks them against the class's __init__ and by two steps on "
        "a dummy parameter.",
    )

    _name = field_validator("name")(_check_optimizer_name)

    @field_validator(*TYPED_OPTIONS)
    @classmethod
    def _typed_only_by_name(cls, v: Any, info: ValidationInfo) -> Any:
        if is_import_path(name := info.data.get("name", "")):
            raise ValueError(f"applies to sgd, adam and adamw; {name} takes its options in args "
                             f"(args: {{{info.field_name}: ...}})")
        return v

    @field_validator("args")
    @classmethod
    def _args_by_path(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        name = info.data.get("name")
        if name is not None and v and not is_import_path(name):
            raise ValueError(f"applies to an optimizer by import path (torch.optim:RMSprop); {name}'s options "
                             f"are fields of optimizer ({', '.join(TYPED_OPTIONS)})")
        for key in ("params", "lr"):
            if key in v:
                raise ValueError(f"{key} is no option here: " + ("the LR is optimizer.lr" if key == "lr" else
                                                                 "each stage gives its own parameters"))
        return v

    @field_validator("shard")
    @classmethod
    def _shard_by_name(cls, v: bool, info: ValidationInfo) -> bool:
        if v and is_import_path(name := info.data.get("name", "")):
            raise ValueError(f"shards sgd, adam and adamw only, not {name}: each replica steps flat slices of "
                             "the parameters, which is right only for an update element by element; leave shard "
                             "out")
        return v

    @model_validator(mode="after")
    def _per_optimizer(self) -> OptimizerSpec:
        if self.name == "adam" or self.name == "adamw":
            if self.momentum or self.nesterov or self.dampening:
                raise ValueError(f"momentum, dampening and nesterov apply to sgd only, not {self.name}")
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening 0")
        return self

    @property
    def by_path(self) -> bool:
        """Named by import path (gpipe.optim checks it where the job's code is: gpipe.coordinator.plan.job)."""
        return is_import_path(self.name)

    def torch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the optimizer's class, but `params`."""
        if self.by_path:
            return {"lr": self.lr, **self.args}
        if self.name == "sgd":
            return {
                "lr": self.lr,
                "momentum": self.momentum,
                "dampening": self.dampening,
                "nesterov": self.nesterov,
                "weight_decay": self.weight_decay or 0.0,
            }
        wd = self.weight_decay if self.weight_decay is not None else (0.01 if self.name == "adamw" else 0.0)
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": wd}


class StepLR(_Spec):
    name: Literal["step"] = Field(description="Multiply the LR by `gamma` every `step_size` steps.")
    step_size: Steps = Field(description="Steps between decays.")
    gamma: Annotated[float, Range(0, 1, lo_open=True)] = Field(default=0.1, description="Decay factor.")


class CosineLR(_Spec):
    name: Literal["cosine"] = Field(description="Linear warmup, then cosine decay to `min_lr`.")
    warmup_steps: Annotated[StrictInt, Range(0, MAX_STEPS)] = Field(
        default=0, description="Steps of linear warmup from 0."
    )
    min_lr: Annotated[float, Range(0, MAX_LR)] = Field(default=0.0, description="The LR at the last step.")


class LinearLR(_Spec):
    name: Literal["linear"] = Field(description="Linear warmup, then linear decay to `min_lr` at the last step.")
    warmup_steps: Annotated[StrictInt, Range(0, MAX_STEPS)] = Field(
        default=0, description="Steps of linear warmup from 0; fewer than `steps`."
    )
    min_lr: Annotated[float, Range(0, MAX_LR)] = Field(
        default=0.0, description="The floor: the LR at the last step; at most optimizer.lr."
    )


class WsdLR(_Spec):
    name: Literal["wsd"] = Field(
        description="Warmup-stable-decay: linear warmup, optimizer.lr, then a decay over the last "
        "`decay_fraction` of the steps that reaches the floor at the last step."
    )
    warmup_steps: Annotated[StrictInt, Range(0, MAX_STEPS)] = Field(
        default=0, description="Steps of linear warmup from 0; with the decay's, at most `steps`."
    )
    decay_fraction: Annotated[float, Range(0, 1)] = Field(
        default=0.1, description="The fraction of `steps` that decay, rounded (at least one step unless 0)."
    )
    decay_shape: Literal["linear", "sqrt", "cosine"] = Field(
        default="linear", description="The decay's curve from optimizer.lr to the floor: linear, sqrt or cosine."
    )
    min_lr: Annotated[float, Range(0, MAX_LR)] | None = Field(
        default=None, description="The floor, absolute; at most optimizer.lr. Not with `min_lr_ratio`."
    )
    min_lr_ratio: Annotated[float, Range(0, 1)] | None = Field(
        default=None, description="The floor as a fraction of optimizer.lr. Neither: 0."
    )

    @model_validator(mode="after")
    def _one_floor(self) -> WsdLR:
        if self.min_lr is not None and self.min_lr_ratio is not None:
            raise ValueError("min_lr and min_lr_ratio both set the floor; give one")
        return self

    def decay_steps(self, steps: int) -> int:
        """The steps that decay: the last `decay_fraction` of `steps`, at least one unless the fraction is 0."""
        return max(1, round(steps * self.decay_fraction)) if self.decay_fraction else 0

    def floor(self, lr: float) -> float:
        """The LR at the last step, with optimizer.lr `lr`."""
        return self.min_lr if self.min_lr is not None else lr * (self.min_lr_ratio or 0.0)


LRSchedule = Annotated[StepLR | CosineLR | LinearLR | WsdLR, Field(discriminator="name")]


class EvalDataSpec(_Spec):
    factory: str = Field(
        max_length=MAX_FACTORY_CHARS,
        description="'module:function' returning a map-style Dataset of (input, target) pairs, "
        "or a registered name (random_regression; tokens: token files; hf_dataset: a local Hugging Face dataset; "
        "docs/data.md).",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the factory.")
    batch_size: Annotated[StrictInt, Range(1, MAX_BATCH_SIZE)] = Field(
        description="Samples per evaluation batch, cut into `chunks` micro-batches; the last batch of "
        "the set may be shorter."
    )
    collate: str | None = Field(
        default=None, max_length=MAX_FACTORY_CHARS,
        description="'module:function' collating a batch's items into an (input, target) pair; "
        "none: torch's default_collate.",
    )

    _factory = field_validator("factory")(_check_factory)
    _collate = field_validator("collate")(_check_collate)


class EvalSpec(_Spec):
    data: EvalDataSpec = Field(description="The evaluation data, visited in order, each item once.")
    every: Steps = Field(description="Evaluate after every this many steps, and after the last.")
    batches: Steps | None = Field(
        default=None, description="Evaluation batches per evaluation, from the start of the set; "
        "none: the whole set.",
    )


class ElasticSpec(_Spec):
    min_stages: Annotated[StrictInt, Range(1, MAX_STAGES)] = Field(
        description="The fewest stages the job may re-plan onto (1 ... stages) when a rank stays lost past "
        "restart_timeout_s and no idle worker can take its place.",
    )


class LossScaleSpec(_Spec):
    """fp16's dynamic loss scale: torch.amp.GradScaler's init_scale and growth_interval."""

    init: Annotated[float, Range(1, MAX_LOSS_SCALE)] = Field(
        default=2.0**16, description="The scale of the first step (and of a resume from a checkpoint "
        "without one): a power of two.",
    )
    growth_interval: Annotated[StrictInt, Range(1, MAX_GROWTH_INTERVAL)] = Field(
        default=2000, description="Good steps in a row after which the scale doubles.",
    )

    @field_validator("init")
    @classmethod
    def _power_of_two(cls, v: float) -> float:
        if math.frexp(v)[0] != 0.5:
            raise ValueError(f"must be a power of two (so that dividing it out is exact), got {v:g}")
        return v


AUTO_FIELDS = ("schedule", "chunks", "activation_checkpoint")  # what `auto` may stand for


class JobSpec(_Spec):
    """A training job: what to train, how to cut it into stages, and how long."""

    name: str = Field(description="The job's name; outputs go to <state-dir>/<name>/.")
    seed: Annotated[StrictInt, Range(0, MAX_SEED)] = Field(
        default=0, description="Seeds the initial weights, shuffling and dropout."
    )
    model: ModelSpec = Field(description="The model, as an nn.Sequential factory.")
    stages: Annotated[StrictInt, Range(1, MAX_STAGES)] = Field(
        description="Pipeline stages, one worker each; may be left out with model.split_points (their number "
        "plus one).")
    balance: (
        Annotated[list[Annotated[StrictInt, Range(1, MAX_LAYERS_PER_STAGE)]], Field(max_length=MAX_STAGES)]
        | Literal["by_params", "by_time", "by_memory"]
    ) = Field(
        default="by_params",
        description="Layers per stage, in order; or by_params, by_time (measured on a sample "
        "micro-batch) or by_memory (weights, optimizer state and activations in flight).",
    )
    chunks: Annotated[StrictInt, Range(1, MAX_CHUNKS)] = Field(
        default=1, description="Micro-batches per step; auto: chosen before the job starts (see auto)."
    )
    schedule: ScheduleName = Field(
        default="gpipe",
        description=f"{schedules.reference()} {{file: PATH}}: a table of actions read from that CSV file "
        "(relative to the job's folder) when the job is planned, one row per action (worker,order,kind,"
        "micro_batch,chunk: plan.json's auto.schedule_table of a measured job) or torch.distributed.pipelining's "
        "compute-only CSV, checked whole; it fixes stages, virtual_stages and chunks. auto: chosen before the job "
        "starts (see auto).",
    )
    virtual_stages: Annotated[StrictInt, Range(1, MAX_VIRTUAL_STAGES)] = Field(
        default=1,
        description="Model chunks per worker, for interleaved-1f1b (2 or more: 1 is refused) and zbv (2): the "
        "model is cut into stages x virtual_stages model chunks, and balance lists that many layer counts, in model "
        "order.",
    )
    activation_checkpoint: Checkpoint = Field(
        default="never",
        description="Recompute a stage's forward in its backward instead of keeping its "
        "activations: for every micro-batch, all but the last, or none; auto: chosen before the job starts "
        "(see auto).",
    )
    auto: list[Literal["schedule", "chunks", "activation_checkpoint"]] = Field(
        default_factory=list, max_length=3,
        description="Which of schedule, chunks and activation_checkpoint the job plans before it starts: "
        "written as `schedule: auto` (and so on), not here. run and serve then choose them as "
        "`gpipe-coordinator plan` would, for the workers the job runs on and their memory (docs/plan.md), "
        "and plan.json's `auto` says what was chosen and why.",
    )
    deferred_batch_norm: bool = Field(
        default=False,
        description="BatchNorm updates its running statistics once per step, with the whole "
        "batch's statistics; false: once per micro-batch, as gradient accumulation does.",
    )
    data: DataSpec = Field(description="The training data.")
    probe: bool = Field(
        default=True,
        description="Before anything starts, run one micro-batch of at most a few samples forward and "
        "backward through the model on the CPU, layer by layer, checking what crosses each cut and "
        "finding the skip connections' routes. false: skip it (a model too big for the host that "
        "validates), and give up skip connections between stages. Default: true, but false with init "
        "per_layer (which never builds the whole model the probe runs).",
    )
    loss: Annotated[str, Field(max_length=MAX_FACTORY_CHARS)] | OwnLoss = Field(
        default="cross_entropy",
        description="cross_entropy | mse | 'module:function' taking (output, target) and returning the mean "
        "loss of a micro-batch | model: the model's own loss, the targets given as its `labels` (Hugging "
        "Face's) | {from_model: KEYWORD}: the same under another keyword (nanoGPT's targets). The model's own "
        "loss is a micro-batch's mean (each weighs its share of the batch, as a loss function's does); it "
        "needs a model that is not an nn.Sequential.",
    )
    optimizer: OptimizerSpec = Field(description="The optimizer.")
    lr_schedule: LRSchedule | None = Field(default=None, description="The LR over steps; none: constant.")
    clip_grad_norm: Annotated[float, Range(0, MAX_CLIP_GRAD_NORM, lo_open=True)] | None = Field(
        default=None, description="Clip gradients to this global norm, taken over all stages."
    )
    steps: Steps = Field(description="Optimizer steps to train.")
    device: Literal["cpu", "cuda"] = Field(
        default="cpu", description="Where stages run: cpu, or cuda (one GPU per worker)."
    )
    deterministic: bool = Field(
        default=False,
        description="Deterministic algorithms on the workers (gpipe.determinism): cuBLAS's workspace fixed, "
        "TF32 and cuDNN autotuning off, an op with no deterministic kernel refused by name; on CUDA the "
        "pipeline's weights then equal one GPU's to the bit. false: CUDA kernels may vary in the last bits "
        "(docs/gpu.md gives the figures). A CPU is deterministic either way.",
    )
    log_every: Steps = Field(default=1, description="Write metrics every this many steps.")
    activation_meter_every: Steps | None = Field(
        default=50, description="Count the bytes each stage holds for its backward (metrics.jsonl's "
        "activation_peak_bytes, exact: autograd's saved tensors, by storage) on each attempt's first step, every "
        "this many steps (rounded up to a multiple of log_every) and the last; null on the other steps' lines. It costs a forward some 2-3 us a tensor "
        "it saves (a schedule that splits the backward, zb-h1 or zbv, counts on every step: its B needs the "
        "count's handles anyway). 1: every step; none: each attempt's first step and the last.",
    )
    trace_step: Annotated[StrictInt, Range(1, MAX_STEPS)] | None = Field(
        default=None, description="The step drawn in trace.json and timeline.svg, counted from 1 as the "
        "progress bar counts; none: the last.",
    )
    checkpoint_every: Steps | None = Field(
        default=100, description="Checkpoint every this many steps, and after the last; "
        "none: after the last only. A failed job resumes from its last good checkpoint.",
    )
    keep_checkpoints: Annotated[StrictInt, Range(2, MAX_KEEP_CHECKPOINTS)] = Field(
        default=3, description="Checkpoints kept on disk, newest first (at least 2)."
    )
    max_restarts: Annotated[StrictInt, Range(0, MAX_RESTARTS)] = Field(
        default=3, description="Restarts from the last good checkpoint after a failure (a stage "
        "that raises, a worker lost) before the job fails.",
    )
    restart_timeout_s: Seconds = Field(
        default=600.0, description="serve: how long a restarting job waits for its workers to be "
        "back before it fails.",
    )
    start_timeout_s: Seconds = Field(
        default=120.0, description="How long to wait for workers to join and build their stage."
    )
    step_timeout_s: Seconds = Field(
        default=300.0, description="How long one step may take before the job fails, "
        "naming the stage it waited for.",
    )
    peer_timeout_s: Seconds = Field(
        default=20.0, description="How long every stage may wait on its neighbours at once (none "
        "computing) before the job fails: a network partition between workers, caught before "
        "step_timeout_s.",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32",
        description="The forwards' precision: fp32, or autocast to bf16 or fp16 (weights and optimizer "
        "state stay fp32; values cross the cuts in that dtype). fp16 adds a dynamic loss scale, one "
        "for the job: an inf or nan on any stage skips the step everywhere and halves the scale.",
    )
    loss_scale: LossScaleSpec = Field(
        default_factory=LossScaleSpec, description="precision fp16: the loss scale's start and growth.",
    )
    priority: Annotated[StrictInt, Range(-1000, 1000)] = Field(
        default=0, description="serve's queue: higher first, then in order of submission; a job that cannot "
        "start preempts the fewest running jobs of lower priority that make it fit (they checkpoint at their "
        "next step boundary and resume later). `submit --priority` sets it. docs/service.md.",
    )
    replicas: Annotated[StrictInt, Range(1, MAX_REPLICAS)] = Field(
        default=1, description="Data-parallel copies of the pipeline: replicas x stages workers (at most "
        f"{MAX_WORKERS}). Each step's batch is cut into one contiguous shard per replica, each shard into "
        "`chunks` micro-batches; the replicas sum their gradients stage by stage, so the weights are "
        "those of one device on the whole batch.",
    )

    init: Literal["exact", "per_layer"] = Field(
        default="exact",
        description="exact: torch.manual_seed(seed), then the factory, in the coordinator (a model that "
        "fits its memory), streamed to the stages a piece at a time. per_layer: no process builds the "
        "whole model; each stage builds its own layers and initialises layer i from a generator seeded by "
        "(seed, i), calling each submodule's reset_parameters() or init_hook (gpipe.weight_init.per_layer gives "
        "the same weights on one device); a model that is not an nn.Sequential: each submodule owning parameters "
        "from a generator seeded by (seed, its name), its reset_parameters() or init_hook (gpipe.weight_init.per_module "
        "gives the same weights on one device). per_layer turns the probe off (probe: true is refused) and "
        "needs balance by_params or a list.",
    )
    init_hook: str | None = Field(
        default=None, max_length=MAX_FACTORY_CHARS,
        description="init per_layer: 'module:function' called with (layer index, layer) under the layer's "
        "seeded generator, instead of reset_parameters(); for a model that is not an nn.Sequential, with "
        "(module name, module) for each module owning parameters, which it sets.",
    )
    eval: EvalSpec | None = Field(
        default=None, description="Evaluation: the loss on held-out data, pipelined, in eval mode and "
        "without gradients, every `every` steps and after the last (metrics.jsonl: eval_loss).",
    )
    working_dir: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="The folder of the job's code, relative to the job file's folder: `submit` sends it with "
        "the job (serve keeps it, and its validation and every attempt on every worker import from it); `run` "
        "and `validate` import from it. Every factory of the job runs with it as its working directory (on the "
        "coordinator and every worker), so a relative path it opens is found there. Default: the job file's folder.",
    )
    exclude: Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=256)] = Field(
        default_factory=list,
        description="Patterns (fnmatch: data, *.ckpt, outputs/) of files and folders `submit` leaves out of the "
        "job's code, matched against each path in the folder and each name. Left out always: .git, "
        "virtualenvs, gpipe state dirs, __pycache__ and tool caches.",
    )
    elastic: ElasticSpec | None = Field(
        default=None, description="serve: a rank lost for good (past restart_timeout_s, no idle worker to take "
        "its place) re-plans the job onto the workers that remain, resuming from its last good checkpoint: "
        "fewer replicas first, then fewer stages down to min_stages (balance by_params where a list no longer "
        "fits; with virtual_stages, each worker keeps its model chunks); the same micro-batches, so the same "
        "weights. It grows back to `stages` at the first checkpoint "
        "after enough workers are registered again. none: a lost rank is waited for, then the job fails.",
    )
    keep_best: bool = Field(
        default=False, description="Keep the weights of the lowest eval loss so far in "
        "<state-dir>/<name>/best/model.safetensors, with best.json (needs eval).",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if (why := name_problem(v)) is not None:
            raise ValueError(why)
        return v

    @field_validator("init_hook")
    @classmethod
    def _init_hook(cls, v: str | None) -> str | None:
        if v is not None and (":" not in v or not FACTORY_RE.match(v)):
            raise ValueError(f"{v!r} is not 'module:function'")
        return v

    @field_validator("loss", mode="before")
    @classmethod
    def _loss(cls, v: Any) -> Any:
        """One line for what is wrong: a string of the known forms, or {from_model: KEYWORD}."""
        if isinstance(v, dict):
            if set(v) != {"from_model"}:
                raise ValueError(f"{sorted(v)} is not {{from_model: KEYWORD}} (the model's own loss)")
            keyword = v["from_model"]
            if not isinstance(keyword, str) or not IDENTIFIER_RE.match(keyword) or len(keyword) > 64:
                raise ValueError(f"from_model: {keyword!r} is not a keyword argument's name (targets, labels)")
            return OwnLoss(from_model=keyword)
        if isinstance(v, OwnLoss):
            return v
        if not isinstance(v, str):
            raise ValueError(f"{v!r} is not cross_entropy, mse, model, 'module:function' or {{from_model: KEYWORD}}")
        if len(v) > MAX_FACTORY_CHARS:
            raise ValueError(f"String should have at most {MAX_FACTORY_CHARS} characters")
        if v in ("cross_entropy", "mse", "model"):
            return v
        if ":" not in v or not FACTORY_RE.match(v):
            raise ValueError(f"{v!r} is not cross_entropy, mse, model or 'module:function'")
        return v

    @model_validator(mode="before")
    @classmethod
    def _stages_follow_split_points(cls, data: Any) -> Any:
        """stages may be left out with model.split_points: one more than they are (divided by virtual_stages)."""
        if isinstance(data, dict) and "stages" not in data and isinstance(data.get("model"), dict):
            points, virtual = data["model"].get("split_points"), data.get("virtual_stages", 1)
            if isinstance(points, list) and points and type(virtual) is int and virtual >= 1 \
                    and (len(points) + 1) % virtual == 0:
                return {**data, "stages": (len(points) + 1) // virtual}
        return data

    @model_validator(mode="before")
    @classmethod
    def _auto_values(cls, data: Any) -> Any:
        """`schedule: auto`, `chunks: auto`, `activation_checkpoint: auto`: listed in `auto`, and a value that
        validates meanwhile (the job's plan replaces it before anything starts: gpipe.coordinator.plan.search.resolve)."""
        if not isinstance(data, dict):
            return data
        autos = [k for k in AUTO_FIELDS if data.get(k) == "auto"]
        measured = data.get("schedule") == "measured"  # built from the job's costs before it starts, as auto is
        if not autos and not measured:
            return data
        if data.get("auto"):
            raise ValueError("auto: write `auto` as the value of schedule, chunks or activation_checkpoint, "
                             "not this list")
        if isinstance(data.get("schedule"), dict) and autos:
            raise ValueError(f"{autos[0]}: auto with a schedule from a file: the table fixes the micro-batches; "
                             "give chunks and activation_checkpoint")
        if isinstance(data.get("model"), dict) and data["model"].get("split_points"):
            if measured:
                raise ValueError("schedule: measured measures the model at its blocks: leave model.split_points "
                                 "out, give stages (and a balance, if you want one)")
            raise ValueError(f"{autos[0]}: auto plans the cut too (the balance by measured time): leave "
                             "model.split_points out, give stages")
        stages, virtual = data.get("stages", 1), data.get("virtual_stages", 1)
        meanwhile = {"schedule": "gpipe" if virtual == 1 else "interleaved-1f1b",
                     "chunks": stages if type(stages) is int and stages >= 1 else 1,
                     "activation_checkpoint": "never"}
        if measured:  # `schedule: measured` is planned as an auto schedule is (gpipe.coordinator.plan.search.resolve)
            return {**data, **{k: meanwhile[k] for k in autos}, "auto": ["schedule", *autos]}
        return {**data, **{k: meanwhile[k] for k in autos}, "auto": autos}

    @model_validator(mode="before")
    @classmethod
    def _probe_follows_init(cls, data: Any) -> Any:
        """probe's default is what init can run: off with per_layer, which never builds the whole model."""
        if isinstance(data, dict) and data.get("init") == "per_layer" and "probe" not in data:
            return {**data, "probe": False}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        self._check_virtual_stages()
        self._check_lr_schedule()
        if self.model.split_points is not None:
            if self.model_chunks != len(self.model.split_points) + 1:
                raise ValueError(f"stages: {self.stages} stages x {self.virtual_stages} virtual_stages but "
                                 f"model.split_points cuts the model into {len(self.model.split_points) + 1}")
            if isinstance(self.balance, list):
                raise ValueError("balance: model.split_points cuts the model already; leave balance out")
        if isinstance(self.balance, list) and len(self.balance) != self.model_chunks:
            per_worker = f" x virtual_stages {self.virtual_stages}" if self.virtual_stages > 1 else ""
            raise ValueError(
                f"balance: has {len(self.balance)} entries but stages{per_worker} is {self.model_chunks}"
            )
        if self.trace_step is not None:
            if self.trace_step > self.steps:
                raise ValueError(f"trace_step: step {self.trace_step} is past the last step {self.steps}")
            if (self.trace_step - 1) % self.log_every and self.trace_step != self.steps:
                raise ValueError(f"trace_step: step {self.trace_step} is not logged (log_every {self.log_every})")
        if self.schedule == "measured" and "schedule" in self.auto and not self.probe:
            raise ValueError("schedule: measured measures the model's layers and memory (the probe): leave probe "
                             "on, or name a schedule")
        if self.init_hook is not None and self.init != "per_layer":
            raise ValueError("init_hook: applies to init per_layer only")
        if self.init == "per_layer" and self.probe:
            raise ValueError("probe: init per_layer never builds the whole model, which the probe runs; "
                             "leave probe out (or false)")
        if self.init == "per_layer" and self.balance in ("by_time", "by_memory"):
            raise ValueError(f"balance: {self.balance} runs the whole model, which init per_layer never "
                             "builds; use by_params or a list")
        if "loss_scale" in self.model_fields_set and self.precision != "fp16":
            raise ValueError(f"loss_scale: applies to precision fp16 only, not {self.precision}")
        if self.chunks > self.data.batch_size:
            raise ValueError(
                f"chunks: {self.chunks} micro-batches exceed data.batch_size {self.data.batch_size}"
            )
        if self.replicas > 1:
            self._check_replicas()
        elif self.optimizer.shard:
            raise ValueError("optimizer.shard: shards the optimizer state across replicas, and this job has one "
                             "replica; set replicas > 1 or leave shard out")
        if self.elastic is not None:
            if schedules.is_table(self.schedule) or schedules.is_file(self.schedule):
                raise ValueError("elastic: a schedule given as a table runs on its own stages and micro-batches "
                                 "only; leave elastic out, or use schedule: measured (built again for each shape)")
            if self.elastic.min_stages > self.stages:
                raise ValueError(f"elastic.min_stages: {self.elastic.min_stages} is more than stages "
                                 f"{self.stages}")
            if self.model.split_points is not None:
                raise ValueError("elastic: model.split_points fixes the stage count; cut by balance instead")
        if self.keep_best and self.eval is None:
            raise ValueError("keep_best: needs an eval section (the best is the lowest eval loss)")
        return self

    def _check_lr_schedule(self) -> None:
        sched, lr = self.lr_schedule, self.optimizer.lr
        if isinstance(sched, LinearLR):
            if sched.warmup_steps >= self.steps:
                raise ValueError(f"lr_schedule.linear.warmup_steps: {sched.warmup_steps} leaves no step of the "
                                 f"{self.steps} to decay")
            if sched.min_lr > lr:
                raise ValueError(f"lr_schedule.linear.min_lr: {sched.min_lr:g} is above optimizer.lr {lr:g}")
        if isinstance(sched, WsdLR):
            decay = sched.decay_steps(self.steps)
            if sched.warmup_steps + decay > self.steps:
                raise ValueError(f"lr_schedule.wsd.warmup_steps: {sched.warmup_steps} steps of warmup and {decay} of "
                                 f"decay (decay_fraction {sched.decay_fraction:g}) exceed the {self.steps} steps")
            if sched.floor(lr) > lr:
                raise ValueError(f"lr_schedule.wsd.min_lr: {sched.floor(lr):g} is above optimizer.lr {lr:g}")

    def _check_virtual_stages(self) -> None:
        if why := violation(self.schedule, self.stages, self.virtual_stages, self.chunks, self.activation_checkpoint):
            raise ValueError(why)  # the rules gpipe.Pipeline keeps too (gpipe.options)
        if self.model_chunks > MAX_STAGES:
            raise ValueError(f"virtual_stages: {self.stages} stages x {self.virtual_stages} is {self.model_chunks} "
                             f"model chunks, over the {MAX_STAGES} a job may have")

    def _check_replicas(self) -> None:
        if self.replicas * self.stages > MAX_WORKERS:
            raise ValueError(f"replicas: {self.replicas} replicas x {self.stages} stages is "
                             f"{self.replicas * self.stages} workers, over the {MAX_WORKERS} a job may have")
        if self.replicas * self.chunks > self.data.batch_size:
            raise ValueError(f"replicas: {self.replicas} replicas x {self.chunks} micro-batches exceed "
                             f"data.batch_size {self.data.batch_size}")

    def code_dir(self, spec_path: str | Path) -> Path:
        """The folder of the job's code: working_dir, from the job file's folder; or that folder."""
        here = Path(spec_path).resolve().parent
        return (here / self.working_dir).resolve() if self.working_dir else here

    @property
    def topology(self) -> Topology:
        """Which worker rank serves which stage of which replica (gpipe.topology)."""
        return self.topology_at(self.stages, self.replicas)

    def topology_at(self, stages: int, replicas: int) -> Topology:
        """This job's topology on `replicas` x `stages` workers: each still holds virtual_stages model chunks,
        placed by the schedule (an elastic re-plan's shape)."""
        if self.virtual_stages == 1:  # the schedule places nothing: the shape alone
            return Topology(stages, replicas)
        return Topology(stages, replicas, self.virtual_stages, self.schedule)

    @property
    def loss_function(self) -> str:
        """The loss the last stage applies, by reference (gpipe.factory.resolve): the model's own is "model"
        (gpipe.losses.model_loss, which takes the loss the model returned)."""
        return "model" if isinstance(self.loss, OwnLoss) else self.loss

    @property
    def loss_keyword(self) -> str | None:
        """The keyword the model takes the targets by, with the model's own loss; None otherwise."""
        if isinstance(self.loss, OwnLoss):
            return self.loss.from_model
        return "labels" if self.loss == "model" else None

    @property
    def model_output(self) -> str | None:
        """What of the model's output the last stage gives the loss: model.output, or with the model's own loss
        its loss (gpipe.capture.graph.select_output)."""
        return self.model.output or ("loss" if self.loss_keyword is not None else None)

    @property
    def model_chunks(self) -> int:
        """The pieces the model is cut into: a stage's each, or virtual_stages per worker."""
        return self.stages * self.virtual_stages

    def reshaped(self, stages: int, replicas: int) -> JobSpec:
        """This job on `replicas` x `stages` workers with the same micro-batches (gpipe.coordinator.plan.elastic):
        chunks grow as replicas shrink; an explicit balance that no longer fits becomes by_params."""
        if (stages, replicas) == (self.stages, self.replicas):
            return self
        chunks = self.chunks * self.replicas // replicas
        fits = not isinstance(self.balance, list) or len(self.balance) == stages * self.virtual_stages
        balance = self.balance if fits else "by_params"
        return self.model_copy(update={"stages": stages, "replicas": replicas, "chunks": chunks, "balance": balance})

    def one_replica(self) -> JobSpec:
        """This job with one pipeline: what evaluating a finished job's weights takes."""
        return self if self.replicas == 1 else self.model_copy(update={"replicas": 1})


def format_validation_error(err: ValidationError) -> str:
    """One line: the first error's field path and what is wrong with it.

    An unknown field comes first, with the field of the spec it is closest to: a
    typo (`batch_sise`) also makes its field missing, and the key the user wrote is what to name. A tagged
    union's tag is named as the field it is (lr_schedule.name) with the values it takes, and a value of a fixed
    few (a tag, a Literal) gets the one it is closest to.
    """
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")  # stable otherwise
    e = errors[0]
    # A discriminated union adds the tag to the path (lr_schedule.cosine.min_lr); other unions
    # and validators add their own labels (list[...], literal[...], function-after[...]).
    loc = _loc(e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        msg = "unknown field"
        if isinstance(key := e["loc"][-1], str) and (near := _closest(key, e["loc"][:-1], JobSpec)):
            msg += f" (did you mean {near}?)"
    if e["type"] == "missing":
        msg = "required item is missing" if isinstance(e["loc"][-1], int) else "required field is missing"
    if e["type"] in ("union_tag_invalid", "union_tag_not_found"):
        # A tagged union's tag (lr_schedule's name) is a field: named as one, with the values it takes.
        ctx = e.get("ctx") or {}
        tag = str(ctx.get("discriminator", "")).strip("'")
        tags = _tags(e["loc"], tag, JobSpec)
        loc = f"{loc}.{tag}" if loc else tag
        if e["type"] == "union_tag_not_found":
            msg = f"required field is missing (one of {', '.join(tags)})" if tags else "required field is missing"
        else:
            msg = f"{str(ctx.get('tag'))!r} is not one of {', '.join(tags)}{_hint(str(ctx.get('tag')), tags)}"
    # Each member of a union that refused the value at the same place: balance: a list or 'by_params'.
    for other in errors[1:]:
        if _loc(other["loc"]) == loc and any(map(_is_label, e["loc"])) and e["type"].endswith("_type"):
            msg += " or " + other["msg"].removeprefix("Value error, ").removeprefix("Input should be ")
    # A value of a fixed few (precision: bf61): the one it is closest to.
    for x in errors:
        if x["type"] == "literal_error" and _loc(x["loc"]) == loc and isinstance(x["input"], str):
            msg += _hint(x["input"], re.findall(r"'([^']*)'", str((x.get("ctx") or {}).get("expected", ""))))
            break
    if not loc:
        # A check across fields names its own field at the start of the message.
        return one_line(msg)
    return one_line(f"{loc}: {msg}")  # a message may quote the input: Input tag 'x' ...


# What other tools name a field of the spec, where the spelling does not tell (micro_batches for chunks): the
# spec's name, suggested where that field is.
SYNONYMS = {
    "micro_batches": "chunks", "microbatches": "chunks", "num_microbatches": "chunks", "n_microbatches": "chunks",
    "num_micro_batches": "chunks", "max_grad_norm": "clip_grad_norm", "grad_clip": "clip_grad_norm",
    "gradient_clipping": "clip_grad_norm", "scheduler": "lr_schedule", "lr_scheduler": "lr_schedule",
    "mixed_precision": "precision", "amp": "precision", "dtype": "precision",
    "gradient_checkpointing": "activation_checkpoint", "recompute": "activation_checkpoint",
    "num_stages": "stages", "pipeline_stages": "stages", "max_steps": "steps", "train_steps": "steps",
}


def _closest(key: str, parent: tuple[str | int, ...], model: type[BaseModel]) -> str | None:
    """The field at `parent` (a path into `model`) that `key` was likely meant as (learning_rate: lr, batch_sise:
    batch_size), if one is close; else a field of that very name (or meaning) elsewhere in `model`, by its
    path (batch_size at the top: data.batch_size)."""
    names = sorted({name for m in _models_at(parent, model) for name in m.model_fields})
    if (near := _near(key, names)) is not None:
        return near
    paths: dict[str, str] = {}  # a field's name -> the shortest path to a field of that name
    for path in sorted(_field_paths(model), key=lambda p: (p.count("."), p)):
        paths.setdefault(path.rsplit(".", 1)[-1], path)
    far = _near(key, sorted(paths), loose=False)
    return paths[far] if far is not None else None


def _near(key: str, names: list[str], loose: bool = True) -> str | None:
    """The one of `names` that `key` means: the same but for case and `_`/`-`, a synonym (SYNONYMS), its initials
    (learning_rate: lr; wd: weight_decay); and with `loose`, the closest spelling (difflib)."""
    k = key.lower().replace("-", "_")
    flat = {n.replace("_", ""): n for n in names}
    if (n := flat.get(k.replace("_", ""))) is not None:
        return n
    if (n := SYNONYMS.get(k)) is not None and n in names:
        return n
    for n in names:
        if (len(k.split("_")) > 1 and _initials(k) == n) or (len(n.split("_")) > 1 and _initials(n) == k):
            return n
    near = difflib.get_close_matches(k, names, n=1, cutoff=0.6) if loose else []
    return near[0] if near else None


def _initials(name: str) -> str:
    return "".join(w[0] for w in name.split("_") if w)


def _hint(value: str, choices: list[str]) -> str:
    """' (did you mean cosine?)' for a value close to one of `choices`; '' for none."""
    near = difflib.get_close_matches(value.lower(), choices, n=1, cutoff=0.6)
    return f" (did you mean {near[0]}?)" if near else ""


def _models_at(path: tuple[str | int, ...], model: type[BaseModel]) -> list[type[BaseModel]]:
    """The models a value at `path` (an error's location in `model`) may be: a union's members, all of them."""
    models = _models_in(model)
    for part in path:
        inner = [f.annotation for m in models if isinstance(part, str) and (f := m.model_fields.get(part))]
        if inner:  # a field: the models it holds; an index, a union's label or tag: the same models
            models = [m for a in inner for m in _models_in(a)]
    return models


def _tags(path: tuple[str | int, ...], tag: str, model: type[BaseModel]) -> list[str]:
    """The values of the tag field `tag` of the tagged union at `path`, in the union's order."""
    out: list[str] = []
    for m in _models_at(path, model):
        f = m.model_fields.get(tag)
        out += [v for v in get_args(f.annotation) if isinstance(v, str) and v not in out] if f else []
    return out


def _field_paths(model: type[BaseModel], prefix: str = "", depth: int = 4) -> list[str]:
    """The dotted path of every field of `model` and of the models inside it, `depth` levels deep."""
    out: list[str] = []
    for name, f in model.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        if depth > 1:
            for inner in {m: None for m in _models_in(f.annotation)}:
                out += _field_paths(inner, f"{path}.", depth - 1)
    return out


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds: itself, or inside Optional, list, a union, Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _models_in(a)]


def _loc(loc: tuple[str | int, ...]) -> str:
    return ".".join(_loc_part(p) for p in loc if not _is_label(p))


def _is_label(p: str | int) -> bool:
    return isinstance(p, str) and p.endswith("]") and p.startswith(("function-", "list[", "literal[", "tagged-union["))


def _loc_part(p: str | int) -> str:
    """A field name or index as written; a key the user made up, quoted and cut short."""
    s = str(p)
    if isinstance(p, int) or (s.isprintable() and len(s) <= 64 and " " not in s):
        return s
    r = repr(s)
    return r if len(r) <= 64 else r[:60] + "...'"


def parse_spec(text: str, source: str = "job spec") -> JobSpec:
    """Parse YAML text into a JobSpec, or raise SpecError with one clear line.

    Whatever the input, nothing else is raised, and the work is bounded before it
    is done: the text is at most MAX_SPEC_BYTES of UTF-8, its collections are
    nested at most MAX_DEPTH deep, and it holds at most MAX_NODES values once every
    YAML alias is expanded. So a "billion laughs" of nested aliases is refused
    while it is parsed, and whatever walks a spec (a JSON dump of it, say) meets
    at most MAX_NODES values. Parsing uses libyaml when PyYAML has it; see
    `gpipe.coordinator.spec.boundedyaml`.
    """
    raw = boundedyaml.load(
        text, source=source, max_bytes=MAX_SPEC_BYTES, max_depth=MAX_DEPTH, max_nodes=MAX_NODES
    )
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(raw).__name__}")
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(format_validation_error(e)) from None


def read_spec_text(path: str | Path) -> str:
    """A job file's text: UTF-8, at most MAX_SPEC_BYTES (no more is read), or SpecError."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
            size = max(len(data), os.fstat(f.fileno()).st_size)
    except OSError as e:
        raise SpecError(f"{p}: cannot read job file: {e.strerror}") from None
    if size > MAX_SPEC_BYTES:
        raise SpecError(f"{p}: {size} bytes is over the {MAX_SPEC_BYTES >> 20} MiB limit")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{p}: not UTF-8 text (byte {e.start})") from None


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a job file."""
    return parse_spec(read_spec_text(path), source=str(path))


if __name__ == "__main__":  # python -m gpipe.coordinator.spec.job --markdown > docs/spec.md
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m gpipe.coordinator.spec.job --markdown > docs/spec.md")
    from gpipe.coordinator.spec.doc import markdown

    sys.stdout.write(markdown())
