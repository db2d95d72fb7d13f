"""BatchNorm against one device: the differences of weights and running statistics, and the counters a job
leaves."""

from __future__ import annotations

import torch


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest difference over weights and running statistics; counters must be equal."""
    assert set(got) == set(want)
    for k in want:
        if not want[k].is_floating_point():
            assert torch.equal(got[k], want[k]), f"{k}: {got[k]} != {want[k]}"
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def figures(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str:
    """The largest difference of the weights, and of the running statistics, for the log."""
    def worst(stats: bool) -> float:
        return max((got[k] - want[k]).abs().max().item() for k in want if ("running_" in k) == stats)
    return f"weights {worst(False):.3g}, running statistics {worst(True):.3g}"


def counts(spec: dict) -> tuple[int, int]:
    """num_batches_tracked and Calls' count after the job: per micro-batch, or per step when deferred."""
    tracked = spec["steps"] * (1 if spec.get("deferred_batch_norm") else spec["chunks"])
    return tracked, spec["steps"] * spec["chunks"]
