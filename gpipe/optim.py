"""The optimizers a job may name, in one table: for the spec, the memory balance and the stages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

OptimizerName = Literal["sgd", "adam", "adamw"]
NAMES: tuple[str, ...] = get_args(OptimizerName)

# name: (its torch.optim class, the state tensors it keeps per parameter)
_TABLE: dict[str, tuple[str, int]] = {"sgd": ("SGD", 1), "adam": ("Adam", 2), "adamw": ("AdamW", 2)}
assert set(_TABLE) == set(NAMES)


def state_slots(name: str, momentum: float = 0.0) -> int:
    """State tensors per parameter: sgd keeps a momentum buffer only with momentum."""
    return 0 if name == "sgd" and not momentum else _TABLE[name][1]


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The torch.optim class of `name` (torch is imported here, not where the spec is parsed)."""
    import torch

    cls: type[torch.optim.Optimizer] = getattr(torch.optim, _TABLE[name][0])
    return cls
