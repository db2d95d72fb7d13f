"""Built-in losses. Each returns the mean loss of one micro-batch."""

from typing import Any

import torch
import torch.nn.functional as F


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the last dimension; any leading dims (batch, sequence) are averaged."""
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return F.mse_loss(output, target)


def model_loss(output: Any, target: Any) -> torch.Tensor:
    """The model's own loss (a job's `loss: model`): the model took the targets as a keyword and returned its
    loss, which the last stage selected (gpipe.capture.graph.select_output); `target` is not used again."""
    if not isinstance(output, torch.Tensor) or output.dim() != 0 or not output.is_floating_point():
        from gpipe.structure import describe

        raise TypeError(f"loss: model: the model's loss should be a float scalar, got {describe(output)}")
    return output
