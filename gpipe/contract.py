"""What crosses between the driver and a stage, typed once: the stage's config, a step's result, a stage's error.

The driver (gpipe.coordinator.attempt.driver) and a stage (gpipe.stage) meet through a
handle (gpipe.coordinator.attempt.handle): over torch RPC for the service and `run`, by a direct
call for `gpipe.Pipeline`. Whatever the handle, these are the types that cross
it; the supervisor's decisions read their fields, never their prose.
"""

from __future__ import annotations

import errno
import traceback as tb
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from gpipe.factory import FactoryError
from gpipe.topology import place


def _loss_scale_defaults() -> tuple[float, int]:
    """gpipe.precision's, imported when needed: the supervisor reads this module without loading torch."""
    from gpipe.precision import LossScaler

    return LossScaler.INIT, LossScaler.GROWTH_INTERVAL


@dataclass
class StageConfig:
    """What a stage is built with (plain types only: it crosses torch RPC).

    A stage runs one model chunk (`model_chunk`, of the replica's `model_chunks`): with one model chunk a worker
    the model chunk is the stage; with `virtual_stages` of them, `worker` holds this one among its others.
    `chunks` is micro-batches, as in the job spec.
    """

    model_chunk: int  # which piece of the model, in model order: 0 .. model_chunks-1
    model_chunks: int  # the pieces a replica's model is cut into: stages x virtual_stages
    start: int  # first layer (global index in the un-partitioned nn.Sequential)
    end: int  # one past the last layer
    model_factory: str
    model_args: dict[str, Any]
    optimizer: str  # sgd, adam, adamw or a class's import path (gpipe.optim)
    optimizer_args: dict[str, Any]
    loss: str
    schedule: str
    chunks: int
    activation_checkpoint: str
    seed: int
    clip_grad_norm: float | None
    device: str
    step_timeout_s: float  # bounds each wait of a step: a receive, a send, the all-reduce
    start_timeout_s: float  # bounds building: the store, the process group and its subgroups
    store_host: str = ""
    store_port: int = 0
    import_paths: list[str] = field(default_factory=list)
    deferred_batch_norm: bool = False  # running statistics of the whole batch, committed at the step's end
    skip_routes: list[tuple[str, int, int]] = field(default_factory=list)  # (name, stashing, popping stage)
    replica: int = 0  # which copy of the pipeline (gpipe.topology): its rank is replica*workers+worker
    # Model chunks per worker (gpipe.schedule: interleaved-1f1b, zbv), on the worker gpipe.topology.place says,
    # taking turns with its others (gpipe.turns).
    virtual_stages: int = 1
    replicas: int = 1
    shard_optimizer: bool = False  # with replicas: this stage's copies each keep 1/replicas of the optimizer state
    batch_size: int = 0  # the whole batch, all replicas' shards: a micro-batch's loss weighs size/batch_size
    init: str = "exact"  # exact: the weights come from the coordinator; per_layer: initialised here (gpipe.weight_init)
    init_hook: str | None = None  # per_layer: 'module:function' given (layer index, layer)
    precision: str = "fp32"  # fp32 | bf16 | fp16: the forward's autocast dtype (gpipe.precision)
    deterministic: bool = False  # deterministic algorithms in the stage's process (gpipe.determinism)
    loss_scale: tuple[float, int] = field(default_factory=_loss_scale_defaults)  # fp16: init, growth interval
    # Evaluation (gpipe.eval_schedule.EvalSchedule): every this many steps and after the last, this many batches.
    eval_every: int | None = None
    eval_batches: int = 0
    steps: int = 0
    # Which steps count the activations (gpipe.memory.meter, StepResult.activation_peak_bytes): each attempt's first,
    # every activation_meter_every-th (None: no others) and last_step; a split backward's, every one.
    activation_meter_every: int | None = 1
    last_step: int = -1
    # A model that is not an nn.Sequential (gpipe.capture.graph): what the stage captures it with (split_points,
    # output, and the first micro-batch's skeleton: gpipe.capture.graph.sample_signature); None for an nn.Sequential.
    capture: dict[str, Any] | None = None
    # Then: the coordinator's capture of this model chunk's pieces, without weights (gpipe.capture.skeleton.pack), which
    # the stage builds from instead of capturing the model again; None: the stage captures it (`capture`).
    pieces: bytes | None = field(default=None, repr=False)
    # Tied weights (gpipe.capture.graph.tied_groups): per group, its parameter keys and the stages that hold a copy.
    tied: list[tuple[list[str], list[int]]] = field(default_factory=list)

    @property
    def sharded(self) -> bool:
        """Whether this stage's copies each keep 1/replicas of its optimizer state (gpipe.memory.zero)."""
        return self.shard_optimizer and self.replicas > 1

    @property
    def workers(self) -> int:
        """Workers per replica (the job's stages): one per model chunk, or one per `virtual_stages` of them."""
        return self.model_chunks // self.virtual_stages

    @property
    def worker(self) -> int:
        """The worker of this replica holding this model chunk (gpipe.topology.place)."""
        return place(self.schedule, self.model_chunk, self.workers)[0]

    @property
    def rank(self) -> int:
        """The worker rank holding this model chunk of this replica (gpipe.topology)."""
        return self.replica * self.workers + self.worker


@dataclass
class StepResult:
    """One stage's answer to one step: its figures, and the last stage's summed loss."""

    rank: int
    stage: int
    replica: int
    loss_sum: float | None  # the last stage: each micro-batch's loss times its size, summed
    grad_norm: float | None  # with clipping: the global norm before clipping
    busy_s: float
    idle_s: float
    activation_peak_bytes: int | None  # None: a step that did not count them (StageConfig.activation_meter_every)
    peak_memory_bytes: int
    start_unix: float
    timeline: list[tuple[str, int, float, float]]  # (action, micro-batch, start s, end s) from start_unix
    sent_bytes: dict[str, int]  # tensor bytes each channel carried this step (headers left out), by name
    received_bytes: dict[str, int]
    reduce_s: float | None = None  # with replicas: the wait for the gradient sums after the backward
    loss_scale: float | None = None  # fp16: the scale this step's loss was multiplied by
    skipped: bool | None = None  # fp16: an inf or nan skipped the optimizer step
    snapshot: dict[str, Any] | None = None  # a checkpoint copy to pull in pieces (gpipe.worker.state_stream)
    snapshot_s: float | None = None  # the copy-out's pause, between this step and the next
    snapshot_wait_s: float | None = None  # the wait for the previous copy to be pulled
    rss_bytes: int | None = None  # the process's resident memory at the step's end (after the optimizer step)

    def metrics(self) -> dict[str, Any]:
        """This stage's entry in a metrics.jsonl line."""
        out: dict[str, Any] = {"stage": self.stage, "replica": self.replica, "rank": self.rank}
        if self.reduce_s is not None:
            out["reduce_s"] = self.reduce_s
        out |= {"busy_s": self.busy_s, "idle_s": self.idle_s,
                "activation_peak_bytes": self.activation_peak_bytes, "peak_memory_bytes": self.peak_memory_bytes,
                **({"rss_bytes": self.rss_bytes} if self.rss_bytes is not None else {}),
                "start_unix": self.start_unix, "timeline": self.timeline,
                "sent_bytes": self.sent_bytes, "received_bytes": self.received_bytes}
        if self.skipped is not None:
            out["skipped"] = self.skipped
        if self.snapshot_s is not None:
            out["snapshot_s"] = self.snapshot_s
            out["snapshot_wait_s"] = self.snapshot_wait_s
        return out


@dataclass
class EvalResult:
    """One stage's answer to one eval batch (the last stage's loss summed as a step's)."""

    stage: int
    loss_sum: float | None
    samples: int
    eval_s: float
    outputs: list[Any] | None = None  # the last stage, when asked: each micro-batch's output
    weights: dict[str, Any] | None = None  # when asked (keep_best): the stage's weights


class Cause(StrEnum):
    """Why a stage failed: what the supervisor decides by."""

    RAISED = "raised"  # the model's code, or ours, raised: a restart may help once, not when it repeats
    IMPORT = "import"  # the job's code cannot be imported on the worker: a restart cannot help
    INPUT = "input"  # the job's input is wrong (a value that cannot cross a cut): a restart cannot help
    TIMEOUT = "timeout"  # a wait on a neighbour ran out
    PEER = "peer"  # a neighbour went away (a send or receive failed)
    MEMORY = "memory"  # the device or host ran out of memory
    DISK = "disk"  # an I/O error writing the job's state or checkpoints: a restart would meet the same disk
    SPACE = "space"  # the disk of the job's state or checkpoints is full (ENOSPC, EDQUOT): room may be made
    # A model chunk that gave up because another chunk of its worker failed (gpipe.turns): that chunk's own
    # error is the cause; this one is never blamed.
    ABORTED = "aborted"


def classify(e: BaseException) -> Cause:
    """The cause of an exception raised in a stage, by its type (never its message)."""
    # Where the stage raised them, torch is loaded: imported here, they cost nothing there, and the supervisor
    # (`run`'s own process, serve) that reads this module never loads torch.
    from gpipe.capture.graph import CaptureError
    from gpipe.structure import StructureError
    from gpipe.turns import TurnAborted

    if isinstance(e, TurnAborted):
        return Cause.ABORTED
    if isinstance(e, ImportError | FactoryError):  # the job's code is missing or broken where it runs
        return Cause.IMPORT
    if isinstance(e, StructureError | CaptureError):  # a value no cut can carry, a model export cannot capture
        return Cause.INPUT
    if isinstance(e, TimeoutError):
        return Cause.TIMEOUT
    if isinstance(e, ConnectionError):
        return Cause.PEER
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return Cause.MEMORY
    return Cause.RAISED


def disk_cause(e: OSError) -> Cause:
    """The cause of an OSError writing the job's files: SPACE for a full disk or quota (room can be made while
    the job waits), DISK for the rest (a read-only or failing disk, a permission)."""
    return Cause.SPACE if e.errno in (errno.ENOSPC, errno.EDQUOT) else Cause.DISK


def blamed(cause: Cause) -> bool:
    """Whether a failure of this cause is one of its own, the one to name: a model chunk that gave up because
    another chunk of its worker failed (ABORTED) only echoes that chunk's error. The restart-or-fail decision
    that follows is the service's (gpipe.coordinator.supervisor.policy)."""
    return cause is not Cause.ABORTED


@dataclass
class StageError:
    """A stage's failure, as it crosses back to the driver."""

    cause: Cause
    type: str  # the exception's class name
    message: str  # its message's first line
    rank: int
    stage: int
    replica: int
    step: int | None = None  # the step it failed in, if in one
    traceback: str = ""

    @classmethod
    def of(cls, e: BaseException, cfg: StageConfig | None, step: int | None = None) -> StageError:
        lines = str(e).strip().splitlines()
        return cls(cause=classify(e), type=type(e).__name__, message=lines[0] if lines else "",
                   rank=cfg.rank if cfg else -1, stage=cfg.model_chunk if cfg else -1,
                   replica=cfg.replica if cfg else -1, step=step,
                   traceback="".join(tb.format_exception(e)))

    def line(self) -> str:
        """'<type>: <first line>': what a user reads."""
        return f"{self.type}: {self.message}" if self.message else self.type

    def same_as(self, other: StageError | None) -> bool:
        """The same failure again: cause, type, rank and step alike (what makes a restart hopeless)."""
        return other is not None and (self.cause, self.type, self.rank, self.step) == \
            (other.cause, other.type, other.rank, other.step)

