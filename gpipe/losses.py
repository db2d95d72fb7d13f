"""Built-in losses. Each returns the mean loss of one micro-batch."""

import torch
import torch.nn.functional as F


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the last dimension; any leading dims (batch, sequence) are averaged."""
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return F.mse_loss(output, target)
