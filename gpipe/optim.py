"""The optimizers a job may name: sgd, adam and adamw by name, any other torch.optim.Optimizer by import path.

sgd, adam and adamw are a table here: their torch.optim class and the state tensors each keeps per parameter
(the memory model reads it). Any other torch.optim.Optimizer subclass is named by import path,
`torch.optim:RMSprop` or the job's own `module:Class` (found as the job's factories are: gpipe.factory), with
its options in `optimizer.args`; gpipe.optim_check checks it before any worker starts. A stage loads a
checkpoint's optimizer state here (`restore`), and so does that check, to see that it resumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    import torch

OptimizerName = Literal["sgd", "adam", "adamw"]
NAMES: tuple[str, ...] = get_args(OptimizerName)

# name: (its torch.optim class, the state tensors it keeps per parameter)
_TABLE: dict[str, tuple[str, int]] = {"sgd": ("SGD", 1), "adam": ("Adam", 2), "adamw": ("AdamW", 2)}
assert set(_TABLE) == set(NAMES)


def is_import_path(name: str) -> bool:
    """Whether `name` is 'module:Class' rather than sgd, adam or adamw."""
    return ":" in name


def state_slots(name: str, momentum: float = 0.0) -> int:
    """State tensors per parameter: sgd keeps a momentum buffer only with momentum."""
    return 0 if name == "sgd" and not momentum else _TABLE[name][1]


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class of `name`: sgd, adam, adamw, or an import path (torch is imported here, not where the spec
    is parsed)."""
    if is_import_path(name):
        return load(name)
    import torch

    cls: type[torch.optim.Optimizer] = getattr(torch.optim, _TABLE[name][0])
    return cls


def build(name: str, params: Sequence[torch.Tensor], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer `name` over `params`. On a CPU its every step begins and ends by handing the heaps' free
    memory back (gpipe.memory.meter.give_back, as a sharded step's does: gpipe.memory.zero). Before: what the
    forwards and backwards freed below glibc's mmap threshold, still resident, would sit under the step's
    temporaries, the moment a worker's peak often is. After: what the step freed would stay resident, and the
    next pattern of allocations (an evaluation's, a checkpoint's, the optimizer's first state) would grow the
    heaps past it, the worker's peak with them, step after step (docs/memory.md, a peak that climbs). The price:
    the freed pages are faulted in again by the next step, up to a fifth of a small job's step (charlm 1f1b: 159
    against 130 ms); without it, a GPT-2 token job's first worker climbed 8% in 300 steps (bench/README.md (aj))."""
    opt = optimizer_class(name)(params, **kwargs)
    if params and params[0].device.type == "cpu":
        from gpipe.memory import meter

        opt.register_step_pre_hook(lambda *_: meter.give_back())
        opt.register_step_post_hook(lambda *_: meter.give_back())
    return opt


def saved_groups(live: list[dict[str, Any]], saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A checkpoint's hyper-parameters per group (`saved`), tuples as the optimizer has them (`live`: JSON made
    them lists)."""
    return [{k: type(g[k])(v) if isinstance(g.get(k), tuple) else v for k, v in s.items()}
            for g, s in zip(live, saved, strict=True)]


def restore(opt: torch.optim.Optimizer, state: dict[int, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Load a checkpoint's optimizer state into `opt`: per parameter index its tensors and numbers by key, per
    group its hyper-parameters (saved_groups'), as torch's load_state_dict loads them."""
    opt.load_state_dict({"state": state, "param_groups": [{**g, "params": list(range(len(own["params"])))}
                                                         for g, own in zip(groups, opt.param_groups, strict=True)]})


def load(path: str) -> type[torch.optim.Optimizer]:
    """Import the optimizer class at `path` ('module:Class'): FactoryError unless it is an Optimizer subclass
    (the job's code, missing or wrong where it runs, as for its factories)."""
    import torch

    from gpipe.factory import FactoryError, resolve

    obj: object = resolve(path)
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise FactoryError(f"{path} is not a torch.optim.Optimizer subclass")
    return obj
