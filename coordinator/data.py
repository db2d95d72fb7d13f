"""The data stream: which items make step s, and their cut into micro-batches.

With shuffle off, step s takes items s*B ... s*B+B-1 modulo the data set's
length. With shuffle on, epoch e visits the items in the order of a
permutation seeded by (seed, e). Either way a step's batch is a function of
the step alone, so a resumed job sees exactly the batches it would have.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any, cast

import torch
from torch.utils.data import Dataset, default_collate


class DataStream:
    def __init__(self, dataset: Dataset[Any], batch_size: int, chunks: int, shuffle: bool, seed: int):
        self.dataset, self.batch_size, self.chunks = dataset, batch_size, chunks
        self.shuffle, self.seed = shuffle, seed
        self.n = len(cast(Sized, dataset))  # map-style: torch's Dataset type leaves __len__ out
        self._perm: tuple[int, torch.Tensor] | None = None

    def indices(self, step: int) -> list[int]:
        positions = range(step * self.batch_size, (step + 1) * self.batch_size)
        if not self.shuffle:
            return [p % self.n for p in positions]
        out = []
        for p in positions:
            epoch = p // self.n
            if self._perm is None or self._perm[0] != epoch:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = (epoch, torch.randperm(self.n, generator=g))
            out.append(int(self._perm[1][p % self.n]))
        return out

    def batch(self, step: int) -> tuple[Any, Any]:
        """The (inputs, targets) of step `step`, collated."""
        items = [self.dataset[i] for i in self.indices(step)]
        inputs, targets = default_collate(items)
        return inputs, targets

    def micro_batches(self, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """The step's inputs and targets cut by torch.tensor_split into `chunks` micro-batches."""
        inputs, targets = self.batch(step)
        xs = list(torch.tensor_split(inputs, self.chunks))
        ys = list(torch.tensor_split(targets, self.chunks))
        return xs, ys, [len(x) for x in xs]
