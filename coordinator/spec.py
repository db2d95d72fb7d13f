"""The job spec: `job.yaml` parsed into pydantic models that validate themselves.

Every model forbids unknown fields and describes each field, so that an error
names the field path and `JobSpec.model_json_schema()` documents the format.
Checks that need the model or the data set (balance against the layer count,
say) live in `coordinator.plan`, and run before any worker is started.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpipe.errors import SpecError
from gpipe.optim import OptimizerName

FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_factory(v: str) -> str:
    if not FACTORY_RE.match(v):
        raise ValueError(f"{v!r} is not 'module:function' or a registered name")
    return v


class ModelSpec(_Spec):
    factory: str = Field(
        description="'module:function' returning an nn.Sequential, or a registered name (mlp)."
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the factory.")

    _factory = field_validator("factory")(_check_factory)


class DataSpec(_Spec):
    factory: str = Field(
        description="'module:function' returning a map-style Dataset of (input, target) pairs, "
        "or a registered name (random_regression)."
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the factory.")
    batch_size: int = Field(gt=0, description="Samples per step, cut into `chunks` micro-batches.")
    shuffle: bool = Field(
        default=False,
        description="Visit the data set in a seeded random order each epoch. With false, step s "
        "uses items s*B ... s*B+B-1, taken modulo the data set's length.",
    )

    _factory = field_validator("factory")(_check_factory)


class OptimizerSpec(_Spec):
    name: OptimizerName = Field(description="The optimizer, run on every stage.")
    lr: float = Field(gt=0, description="Learning rate (the peak, under an LR schedule).")
    momentum: float = Field(default=0.0, ge=0, lt=1, description="sgd: momentum.")
    dampening: float = Field(default=0.0, ge=0, le=1, description="sgd: dampening of momentum.")
    nesterov: bool = Field(default=False, description="sgd: Nesterov momentum.")
    weight_decay: float | None = Field(
        default=None, ge=0, description="L2 penalty (decoupled for adamw). Default: 0, adamw 0.01."
    )
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="adam/adamw: betas.")
    eps: float = Field(default=1e-8, gt=0, description="adam/adamw: epsilon.")

    @model_validator(mode="after")
    def _per_optimizer(self) -> OptimizerSpec:
        if self.name != "sgd" and (self.momentum or self.nesterov or self.dampening):
            raise ValueError(f"momentum, dampening and nesterov apply to sgd only, not {self.name}")
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening 0")
        for b in self.betas:
            if not 0 <= b < 1:
                raise ValueError(f"betas must lie in [0, 1), got {list(self.betas)}")
        return self

    def torch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the torch.optim class, but `params`."""
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
    step_size: int = Field(gt=0, description="Steps between decays.")
    gamma: float = Field(default=0.1, gt=0, description="Decay factor.")


class CosineLR(_Spec):
    name: Literal["cosine"] = Field(description="Linear warmup, then cosine decay to `min_lr`.")
    warmup_steps: int = Field(default=0, ge=0, description="Steps of linear warmup from 0.")
    min_lr: float = Field(default=0.0, ge=0, description="The LR at the last step.")


LRSchedule = Annotated[StepLR | CosineLR, Field(discriminator="name")]


class JobSpec(_Spec):
    """A training job: what to train, how to cut it into stages, and how long."""

    name: str = Field(description="The job's name; outputs go to <state-dir>/<name>/.")
    seed: int = Field(default=0, ge=0, description="Seeds the initial weights, shuffling and dropout.")
    model: ModelSpec = Field(description="The model, as an nn.Sequential factory.")
    stages: int = Field(ge=1, le=64, description="Pipeline stages, one worker each.")
    balance: list[int] | Literal["by_params", "by_time", "by_memory"] = Field(
        default="by_params",
        description="Layers per stage, in order; or by_params, by_time (measured on a sample "
        "micro-batch) or by_memory (weights, optimizer state and activations in flight).",
    )
    chunks: int = Field(default=1, ge=1, description="Micro-batches per step.")
    schedule: Literal["gpipe", "1f1b"] = Field(
        default="gpipe",
        description="gpipe: all forwards, then all backwards. 1f1b: one forward, one backward; "
        "stage k keeps at most stages-k micro-batches in flight.",
    )
    activation_checkpoint: Literal["always", "except_last", "never"] = Field(
        default="never",
        description="Recompute a stage's forward in its backward instead of keeping its "
        "activations: for every micro-batch, all but the last, or none.",
    )
    data: DataSpec = Field(description="The training data.")
    loss: str = Field(
        default="cross_entropy",
        description="cross_entropy | mse | 'module:function' taking (output, target) and "
        "returning the mean loss of a micro-batch.",
    )
    optimizer: OptimizerSpec = Field(description="The optimizer.")
    lr_schedule: LRSchedule | None = Field(default=None, description="The LR over steps; none: constant.")
    clip_grad_norm: float | None = Field(
        default=None, gt=0, description="Clip gradients to this global norm, taken over all stages."
    )
    steps: int = Field(ge=1, description="Optimizer steps to train.")
    device: Literal["cpu", "cuda"] = Field(
        default="cpu", description="Where stages run: cpu, or cuda (one GPU per worker)."
    )
    log_every: int = Field(default=1, ge=1, description="Write metrics every this many steps.")
    trace_step: int | None = Field(
        default=None, ge=0, description="The step drawn in trace.json and timeline.png; none: the last.",
    )
    checkpoint_every: int | None = Field(
        default=100, ge=1, description="Checkpoint every this many steps, and after the last; "
        "none: after the last only. A failed job resumes from its last good checkpoint.",
    )
    keep_checkpoints: int = Field(default=3, ge=2, description="Checkpoints kept on disk, newest first (at least 2).")
    max_restarts: int = Field(
        default=3, ge=0, description="Restarts from the last good checkpoint after a failure (a stage "
        "that raises, a worker lost) before the job fails.",
    )
    restart_timeout_s: float = Field(
        default=600.0, gt=0, description="serve: how long a restarting job waits for its workers to be "
        "back before it fails.",
    )
    start_timeout_s: float = Field(
        default=120.0, gt=0, description="How long to wait for workers to join and build their stage."
    )
    step_timeout_s: float = Field(
        default=300.0, gt=0, description="How long one step may take before the job fails, "
        "naming the stage it waited for.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(
                f"{v!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return v

    @field_validator("loss")
    @classmethod
    def _loss(cls, v: str) -> str:
        if v in ("cross_entropy", "mse"):
            return v
        if ":" not in v or not FACTORY_RE.match(v):
            raise ValueError(f"{v!r} is not cross_entropy, mse or 'module:function'")
        return v

    @field_validator("balance")
    @classmethod
    def _balance(cls, v: list[int] | str) -> list[int] | str:
        if isinstance(v, list) and any(n < 1 for n in v):
            raise ValueError(f"every stage needs at least one layer, got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if isinstance(self.balance, list) and len(self.balance) != self.stages:
            raise ValueError(
                f"balance: has {len(self.balance)} entries but stages is {self.stages}"
            )
        if self.trace_step is not None:
            if self.trace_step >= self.steps:
                raise ValueError(f"trace_step: step {self.trace_step} is past the last step {self.steps - 1}")
            if self.trace_step % self.log_every and self.trace_step != self.steps - 1:
                raise ValueError(f"trace_step: step {self.trace_step} is not logged (log_every {self.log_every})")
        if self.chunks > self.data.batch_size:
            raise ValueError(
                f"chunks: {self.chunks} micro-batches exceed data.batch_size {self.data.batch_size}"
            )
        return self


def format_validation_error(err: ValidationError) -> str:
    """One line: the first error's field path and what is wrong with it."""
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
    # A discriminated union adds the tag to the path: lr_schedule.cosine.min_lr.
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        msg = "unknown field"
    if e["type"] == "missing":
        msg = "required field is missing"
    if not loc:
        # A check across fields names its own field at the start of the message.
        return msg
    return f"{loc}: {msg}"


def parse_spec(text: str, source: str = "job spec") -> JobSpec:
    """Parse YAML text into a JobSpec, or raise SpecError with one clear line."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"{source}: not valid YAML{where}: {problem}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(raw).__name__}")
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(format_validation_error(e)) from None


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a job file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"{p}: cannot read job file: {e.strerror}") from None
    return parse_spec(text, source=str(p))
