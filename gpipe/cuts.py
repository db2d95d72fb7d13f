"""Where the cuts fall: each stage's layer range from a balance, the stage of a layer, and what crosses a cut.

The coordinator's plan (gpipe.coordinator.plan.job) and gpipe.Pipeline both cut a model
(an nn.Sequential's layers, or a captured model's pieces) by a balance, the
layer count of each stage (each model chunk, with virtual stages), and ask
here where each layer lands: the skip connections that leave their stage, and
the stages holding a copy of a tied weight, follow from that.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a model is cut: the supervisor and the client read this module too
    from torch import nn

Route = tuple[str, int, int]  # a skip connection between stages: name, stashing stage, popping stage


def bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers."""
    out, start = [], 0
    for n in balance:
        out.append((start, start + n))
        start += n
    return out


def layers(model: nn.Sequential, start: int, end: int) -> nn.Sequential:
    """Layers [start, end) of `model` (a captured model's pieces too), under their indices in the whole ("3", "4",
    ...): the names their parameters have in checkpoints and in the coordinator's weights."""
    from collections import OrderedDict

    from torch import nn

    return nn.Sequential(OrderedDict((str(i), model[i]) for i in range(start, end)))


def stage_of(balance: Sequence[int], layer: int) -> int:
    """The stage holding layer `layer`."""
    return next(k for k, (start, end) in enumerate(bounds(balance)) if start <= layer < end)


def routes(skips: Mapping[str, tuple[int, int]], balance: Sequence[int]) -> list[Route]:
    """(name, stashing stage, popping stage) of each skip connection that leaves its stage, by name, out of
    `skips`: name -> (the layer that stashes it, the layer that pops it) (gpipe.memory.probe.Recorder.routes)."""
    out = [(n, stage_of(balance, a), stage_of(balance, b)) for n, (a, b) in sorted(skips.items())]
    return [r for r in out if r[1] != r[2]]


def holders(keys: Iterable[str], balance: Sequence[int]) -> list[int]:
    """The stages holding a copy of a tied weight, given its keys in the pieces ("<piece>.<name>")."""
    return sorted({stage_of(balance, int(k.split(".", 1)[0])) for k in keys})


def misfit(balance: Sequence[int], layers: int, what: str = "layers") -> str | None:
    """Why `balance` does not cut a model of `layers` layers (`what` they are), as "balance: why"; None when
    it does."""
    if sum(balance) != layers:
        return f"balance: sums to {sum(balance)} but the model has {layers} {what}"
    return None


def shortfall(model_chunks: int, layers: int, cut: str, what: str = "layers") -> str | None:
    """Why a model of `layers` layers (`what` they are) cannot be cut into `model_chunks` non-empty parts (`cut`
    says how the user asked for them: "4 stages"), as "stages: why"; None when it can."""
    if model_chunks > layers:
        return f"stages: {cut} but the model has only {layers} {what}"
    return None
