"""A stage's state as checkpoints hold it: the one definition of its layout.

The stages write it (gpipe/stage.py: snapshot, restore), the coordinator
stores it (coordinator/outputs/checkpoint.py) and cuts it for another balance
(coordinator/attempt/resume.py). Tensors are named by the un-partitioned model (a
captured model's by its own names, a tied weight once: gpipe.stage.Stage.saved_name),
so a checkpoint fits any balance and any split:

    model/<name>            the stage's state dict (parameters and persistent buffers)
    optim/<param>/<key>     the optimizer's tensor state of parameter <param> (exp_avg, momentum_buffer, ...)
    rng/cpu, rng/cuda       the stage's generator states

and its JSON state is

    {"param_groups": [hyper-parameters, per group], "optimizer_state": {param: {key: non-tensor value}},
     "params": [the stage's parameter names, in order],
     "loss_scale": {"scale": float, "growth_tracker": int}}      (fp16 only: the job's one loss scale)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

MODEL = "model/"
OPTIM = "optim/"
RNG = "rng/"
RNG_CPU = "rng/cpu"
RNG_CUDA = "rng/cuda"
LOSS_SCALE = "loss_scale"

# A checkpoint's names on disk, <state-dir>/<name>/checkpoints/step-<N>/ (coordinator/outputs/checkpoint.py writes
# and reads it; gpipe.weights, below the coordinator, reads its weights back by the same names).
CHECKPOINT_FORMAT = 1
CHECKPOINTS = "checkpoints"  # in a job's output folder
MANIFEST = "MANIFEST.json"  # each file's size and sha256, written last: the checkpoint's commit
STEP_RE = re.compile(r"^step-(\d+)$")


def shard_files(k: int) -> tuple[str, str]:
    """Stage k's two files in a step directory: its tensors (safetensors) and its JSON state."""
    return f"stage-{k}.safetensors", f"stage-{k}.json"


def model_key(name: str) -> str:
    return MODEL + name


def optim_key(param: str, key: str) -> str:
    return f"{OPTIM}{param}/{key}"


def layer_of(name: str) -> str:
    """The layer a parameter or buffer belongs to: its index in the un-partitioned nn.Sequential."""
    return name.split(".", 1)[0]


@dataclass
class StageState:
    """One stage's state: tensors on the CPU under the keys above, and its JSON state."""

    tensors: dict[str, torch.Tensor]
    json_state: dict[str, Any] = field(default_factory=dict)
    # A tensor on the meta device is not here yet: fetch(name) makes it, when its turn to be written comes (in
    # the names' order; the optimizer's state sharded across replicas: gpipe.memory.zero).
    fetch: Callable[[str], torch.Tensor] | None = None
    # Or rounds(name): such a tensor's elements a part at a time, (element offset in the flat tensor, the part's
    # elements), so that it is never whole in this process (gpipe.memory.zero.ShardedOptimizer.rounds).
    rounds: Callable[[str], Iterator[tuple[int, torch.Tensor]]] | None = None

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name`, fetched if it is not here yet."""
        t = self.tensors[name]
        if t.is_meta:
            if self.fetch is None:
                raise ValueError(f"{name}: on the meta device, with nothing to fetch it")
            return self.fetch(name)
        return t

    def deferred(self, name: str) -> bool:
        """Whether tensor `name` comes in parts (`rounds`) rather than whole."""
        return self.tensors[name].is_meta and self.rounds is not None

    def model_state(self) -> dict[str, torch.Tensor]:
        """The weights under the un-partitioned model's names (model/ stripped)."""
        return {k.removeprefix(MODEL): v for k, v in self.tensors.items() if k.startswith(MODEL)}

    def optim_tensors_for(self, layers: Collection[str]) -> dict[str, torch.Tensor]:
        """The optimizer tensors (optim/... keys kept) of the parameters in `layers`."""
        return {k: v for k, v in self.tensors.items()
                if k.startswith(OPTIM) and layer_of(k.removeprefix(OPTIM)) in layers}

    def rng(self) -> dict[str, torch.Tensor]:
        """The generator states (rng/... keys kept)."""
        return {k: v for k, v in self.tensors.items() if k.startswith(RNG)}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self.json_state.get("param_groups", [])
        return groups

    @property
    def optimizer_scalars(self) -> dict[str, dict[str, Any]]:
        """Per parameter name, the optimizer's non-tensor state (such as adam's step, when it is a number)."""
        scalars: dict[str, dict[str, Any]] = self.json_state.get("optimizer_state", {})
        return scalars

    @property
    def loss_scale(self) -> object:
        """fp16's loss scaler state (gpipe.precision.LossScaler.state), or None when the checkpoint has none."""
        return self.json_state.get(LOSS_SCALE)

    def optimizer_state_of(self, param: str) -> dict[str, Any]:
        """Everything the optimizer keeps for parameter `param`: its scalars and its tensors, by key."""
        prefix = optim_key(param, "")
        entry = dict(self.optimizer_scalars.get(param, {}))
        entry.update({k.removeprefix(prefix): v for k, v in self.tensors.items() if k.startswith(prefix)})
        return entry


def model_state(stages: Iterable[StageState]) -> dict[str, torch.Tensor]:
    """The whole model's weights out of every stage's state."""
    out: dict[str, torch.Tensor] = {}
    for st in stages:
        out.update(st.model_state())
    return out
