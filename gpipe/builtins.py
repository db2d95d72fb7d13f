"""Models and data sets that ship with gpipe, for smoke tests and benchmarks."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def mlp(width: int = 64, depth: int = 4, in_features: int | None = None, out_features: int | None = None,
        dropout: float = 0.0, head: bool = True) -> nn.Sequential:
    """`depth` blocks of Linear+ReLU (one layer each), then a Linear head (unless head is false)."""
    layers: list[nn.Module] = []
    d_in = in_features or width
    for _ in range(depth):
        block: list[nn.Module] = [nn.Linear(d_in, width), nn.ReLU()]
        if dropout:
            block.append(nn.Dropout(dropout))
        layers.append(nn.Sequential(*block))
        d_in = width
    if head:
        layers.append(nn.Linear(d_in, out_features or width))
    return nn.Sequential(*layers)


def random_regression(n: int = 1024, in_features: int = 64, out_features: int = 64,
                      seed: int = 0) -> TensorDataset:
    """A fixed random regression set: y = tanh(x W) + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    w = torch.randn(in_features, out_features, generator=g) / in_features**0.5
    y = torch.tanh(x @ w) + 0.01 * torch.randn(n, out_features, generator=g)
    return TensorDataset(x, y)


def pad_collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A collate for sequences of different lengths: `data.collate: gpipe.builtins:pad_collate`.

    Items are (tokens, targets) pairs of 1-d int64 tensors; the batch is padded to its longest:
    ({"tokens": zeros at padding, "mask": True at padding}, targets with -100 at padding, which
    cross_entropy leaves out).
    """
    longest = max(len(x) for x, _ in items)
    tokens = torch.zeros(len(items), longest, dtype=torch.long)
    targets = torch.full((len(items), longest), -100, dtype=torch.long)
    for i, (x, y) in enumerate(items):
        tokens[i, : len(x)], targets[i, : len(y)] = x, y
    return {"tokens": tokens, "mask": targets == -100}, targets
