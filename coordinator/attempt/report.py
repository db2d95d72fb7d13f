"""What an attempt process tells its supervisor: one typed message set, a JSON object per line.

The attempt writes these to a pipe of their own (the fd that was its stdout
when it started; the model's prints go to its log), and the supervisor reads
them back into the same types. A line that is not one of them is a `Log` of
what it said, never an error: a report cut short by a killed process must
not take the supervisor down.

    Log(line)                        a line for the user
    Resumed(step)                    training starts at `step` (0: the beginning)
    Master(address, secret)          the workers may join the rendezvous at HOST:PORT now, under the
                                     attempt's secret (every store key lives under it: gpipe.service.net)
    Metrics(values)                  a logged step (also in metrics.jsonl)
    Eval(values)                     an evaluation: step, eval_loss, eval_samples ... (also in metrics.jsonl)
    Checkpoint(step, path, ...)      a checkpoint was committed
    Failed(message, exit_code, cause, rank, stage, replica, step, error_type)
                                     the attempt failed: the user's line, and the fields the supervisor
                                     decides by (rank None: no worker to blame)
    Done()                           trained; model.safetensors is written
    Preempted(step)                  asked to stop (SIGUSR1): checkpointed after `step` steps, and ended
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field, fields
from typing import IO, Any

from gpipe.contract import Cause, StageError
from gpipe.errors import GpipeError, JobFailed


@dataclass(frozen=True)
class Log:
    line: str


@dataclass(frozen=True)
class Resumed:
    step: int


@dataclass(frozen=True)
class Master:
    address: str
    secret: str = field(repr=False)  # never in a log line


@dataclass(frozen=True)
class Metrics:
    values: dict[str, Any]


@dataclass(frozen=True)
class Eval:
    values: dict[str, Any]


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: str
    bytes: int
    write_s: float
    stall_s: float


@dataclass(frozen=True)
class Failed:
    message: str  # the one line the user reads
    exit_code: int
    cause: Cause | None = None  # why (gpipe.contract.Cause); None: not known
    rank: int | None = None  # the worker rank to blame; None: none
    stage: int | None = None  # its stage and replica (gpipe.topology)
    replica: int | None = None
    step: int | None = None  # the step it failed at, when it failed in one
    error_type: str = ""  # the exception's class name, when one was raised

    @classmethod
    def of(cls, e: GpipeError) -> Failed:
        """The report of an error that ends the attempt: a JobFailed's fields, or only the exit code."""
        if not isinstance(e, JobFailed):
            return cls(str(e), e.exit_code)
        err = e.error
        blamed = err if err is not None and e.rank is not None else None  # a stage's: its stage and replica
        return cls(str(e), e.exit_code, e.cause, e.rank, blamed.stage if blamed else None,
                   blamed.replica if blamed else None, err.step if err else None, err.type if err else "")

    def error(self) -> StageError | None:
        """The failure as a StageError, to tell whether it repeats (StageError.same_as); None without a cause."""
        if self.cause is None:
            return None
        return StageError(cause=self.cause, type=self.error_type, message=self.message,
                          rank=-1 if self.rank is None else self.rank, stage=-1 if self.stage is None else self.stage,
                          replica=-1 if self.replica is None else self.replica, step=self.step)


@dataclass(frozen=True)
class Done:
    pass


@dataclass(frozen=True)
class Preempted:
    """Asked to stop (SIGUSR1), the attempt checkpointed at its next step boundary and ended: `step` is that
    checkpoint's (the steps done)."""

    step: int


Report = Log | Resumed | Master | Metrics | Eval | Checkpoint | Failed | Done | Preempted
_TYPES: dict[str, type[Report]] = {t.__name__: t for t in (Log, Resumed, Master, Metrics, Eval, Checkpoint, Failed,
                                                           Done, Preempted)}
_FIELD_TYPES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float),
                                             "int | None": (int, type(None)), "dict[str, Any]": (dict,),
                                             "Cause | None": (str, type(None))}


def encode(r: Report) -> str:
    # The fields as they are (json.dumps walks what they hold): dataclasses.asdict would deep-copy a Metrics'
    # whole step first, timelines and all, once a step.
    return json.dumps({"type": type(r).__name__, **{f.name: getattr(r, f.name) for f in fields(r)}}) + "\n"


def decode(line: str | bytes) -> Report:
    """The report on `line`; anything else comes back as a Log of the line itself."""
    text = line.decode(errors="replace") if isinstance(line, bytes) else line
    try:
        obj = json.loads(text)
        cls = _TYPES[obj.pop("type")]
        values: dict[str, Any] = {}
        for f in fields(cls):
            v = obj[f.name]
            if isinstance(v, bool) or not isinstance(v, _FIELD_TYPES[str(f.type)]):
                raise TypeError(f.name)
            values[f.name] = Cause(v) if f.type == "Cause | None" and isinstance(v, str) else v  # ValueError: unknown
        return cls(**values)
    except (ValueError, KeyError, TypeError, AttributeError):
        return Log(text.rstrip("\n"))


class Reporter:
    """Writes reports to one stream; the driver and the checkpoint writer report from their own threads."""

    def __init__(self, stream: IO[str]):
        self._stream = stream
        self._lock = threading.Lock()

    def __call__(self, r: Report) -> None:
        line = encode(r)
        with self._lock:
            self._stream.write(line)
            self._stream.flush()


@dataclass(frozen=True)
class Placement:
    """Where one stage of an attempt runs: its worker's address, device, cores and threads, and its rank."""

    host: str
    device: str
    cores: list[int]
    threads: int
    rank: int | None = None  # the worker's own; None: the slot
    memory_bytes: int = 0  # its GPU's memory as the worker registered it; 0: a CPU's (the host's, not known here)
