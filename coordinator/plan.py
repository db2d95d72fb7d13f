"""The plan of a job: the model, its cut into stages, and the data, checked before any worker starts.

Everything here that can fail because of the spec raises SpecError naming the
field, so a bad job never reaches a worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from coordinator.spec import JobSpec
from gpipe.errors import SpecError
from gpipe.factory import add_import_paths, resolve


@dataclass
class Plan:
    spec: JobSpec
    model: nn.Sequential  # the initial weights: torch.manual_seed(seed); factory(**args)
    balance: list[int]  # layers per stage
    dataset: Dataset
    import_paths: list[str]

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """[start, end) layer range of each stage."""
        out, start = [], 0
        for n in self.balance:
            out.append((start, start + n))
            start += n
        return out

    def stage_state(self, stage: int) -> dict[str, torch.Tensor]:
        """The stage's initial parameters and buffers, under the full model's names."""
        start, end = self.bounds[stage]
        keep = {str(i) for i in range(start, end)}
        own = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        return {k: v.detach() for k, v in own.items() if k.split(".", 1)[0] in keep}


def _call(field: str, ref: str, args: dict[str, Any]) -> Any:
    try:
        fn = resolve(ref)
    except LookupError as e:
        raise SpecError(f"{field}.factory: {e}") from None
    try:
        return fn(**args)
    except Exception as e:
        raise SpecError(f"{field}.args: {ref} raised {type(e).__name__}: {e}") from None


def balance_by_params(model: nn.Sequential, stages: int) -> list[int]:
    """Contiguous layers per stage minimising the largest stage's parameter count.

    A layer costs its parameters plus one, so parameterless layers still spread out.
    """
    costs = [sum(p.numel() for p in layer.parameters()) + 1 for layer in model]
    n = len(costs)

    def cut(limit: int) -> list[int] | None:
        # Greedy from the left, leaving at least one layer for each later stage.
        out, i = [], 0
        for k in range(stages):
            left_for_rest = stages - k - 1
            j, load = i, 0
            while j < n - left_for_rest and (j == i or load + costs[j] <= limit):
                load += costs[j]
                j += 1
            if k == stages - 1:
                if j < n:
                    return None
            out.append(j - i)
            i = j
        return out

    lo, hi = max(costs), sum(costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    result = cut(lo)
    assert result is not None and sum(result) == n
    return result


def make_plan(spec: JobSpec, job_dir: Path) -> Plan:
    import_paths = [str(job_dir.resolve())]
    add_import_paths(import_paths)
    torch.manual_seed(spec.seed)
    model = _call("model", spec.model.factory, spec.model.args)
    if not isinstance(model, nn.Sequential):
        raise SpecError(f"model.factory: returned {type(model).__name__}, expected torch.nn.Sequential")
    layers = len(model)
    if spec.stages > layers:
        raise SpecError(f"stages: {spec.stages} stages but the model has only {layers} layers")
    if isinstance(spec.balance, list):
        if sum(spec.balance) != layers:
            raise SpecError(f"balance: sums to {sum(spec.balance)} but the model has {layers} layers")
        balance = list(spec.balance)
    else:
        balance = balance_by_params(model, spec.stages)
    shared = _shared_parameters(model, balance)
    if shared:
        raise SpecError(f"model.factory: {shared}; stages cannot share parameters")

    dataset = _call("data", spec.data.factory, spec.data.args)
    try:
        n = len(dataset)
    except TypeError:
        raise SpecError(f"data.factory: returned {type(dataset).__name__}, expected a map-style Dataset") from None
    if n == 0:
        raise SpecError("data.factory: the data set is empty")
    item = dataset[0]
    if not (isinstance(item, tuple | list) and len(item) == 2):
        raise SpecError(f"data.factory: item 0 is a {type(item).__name__}, expected an (input, target) pair")
    if spec.loss not in ("cross_entropy", "mse"):
        try:
            resolve(spec.loss)
        except LookupError as e:
            raise SpecError(f"loss: {e}") from None
    return Plan(spec, model, balance, dataset, import_paths)


def _shared_parameters(model: nn.Sequential, balance: list[int]) -> str | None:
    owner: dict[int, int] = {}
    start = 0
    for stage, n in enumerate(balance):
        for i in range(start, start + n):
            for p in model[i].parameters():
                other = owner.setdefault(id(p), stage)
                if other != stage:
                    return f"a parameter of layer {i} (stage {stage}) is also used by stage {other}"
        start += n
    return None
