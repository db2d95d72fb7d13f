"""Models and data sets for the tests, importable by the workers as tests.models:NAME."""

from __future__ import annotations

import math
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset


def mlp_dropout(width: int = 16, depth: int = 5, p: float = 0.2) -> nn.Sequential:
    """Linear+Dropout layers: the weights depend on every dropout mask."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh(), nn.Dropout(p)]
    return nn.Sequential(*layers, nn.Linear(width, width))


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, max_len: int = 64):
        super().__init__()
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)  # not in state_dict: must still travel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[: x.size(1)]


def tiny_lm(vocab: int = 11, d_model: int = 16, layers: int = 3, dropout: float = 0.1) -> nn.Sequential:
    enc = [nn.TransformerEncoderLayer(d_model, 2, 32, dropout, batch_first=True) for _ in range(layers)]
    return nn.Sequential(nn.Embedding(vocab, d_model), PositionalEncoding(d_model), *enc, nn.Linear(d_model, vocab))


def tokens(n: int = 40, seq: int = 6, vocab: int = 11) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return TensorDataset(x[:, :-1], x[:, 1:])


class FailAfter(nn.Module):
    """Raises ValueError on its `calls`-th forward (counted per process)."""

    def __init__(self, calls: int):
        super().__init__()
        self.calls, self.seen = calls, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        if self.seen >= self.calls:
            raise ValueError(f"boom after {self.seen} forwards")
        return x


def failing_mlp(width: int = 8, calls: int = 5) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, width), FailAfter(calls), nn.Linear(width, width))


class Slow(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.seconds)
        return x


def slow_mlp(width: int = 8, seconds: float = 0.05) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), Slow(seconds), nn.Linear(width, width), Slow(seconds))


def not_sequential() -> nn.Module:
    return nn.Linear(2, 2)


def pid_marker() -> int:
    return os.getpid()


class Calls(nn.Module):
    """Counts its training forwards in a buffer, updated in place: a forward's state that is no BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls.add_(1)
        return x


def bn_net(width: int = 8) -> nn.Sequential:
    """BatchNorm1d and BatchNorm2d (one with a cumulative average, one without affine), with dropout."""
    return nn.Sequential(
        nn.Linear(width, 16), nn.BatchNorm1d(16), nn.Tanh(), Calls(),
        nn.Unflatten(1, (4, 2, 2)), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, momentum=None), nn.Dropout(0.1),
        nn.Flatten(), nn.Linear(16, width), nn.BatchNorm1d(width, momentum=0.3, affine=False), nn.Linear(width, width),
    )
