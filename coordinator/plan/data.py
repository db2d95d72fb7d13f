"""The data stream: which items make step s, and their cut into micro-batches.

With shuffle off, step s takes items s*B ... s*B+B-1 modulo the data set's
length. With shuffle on, epoch e visits the items in the order of a
permutation seeded by (seed, e): torch.randperm's, kept for the epoch as int32
where the length is below 2**31 (4 bytes an item, not 8; randperm draws the
same permutation in either dtype). Either way a step's batch is a function of
the step alone, so a resumed job sees exactly the batches it would have.

An item is an (input, target) pair, each a tensor or a structure of them
(gpipe.structure). The items of a step are collated (torch's default_collate
stacks tensors, or the job's own `data.collate`), then cut into micro-batches
along dim 0 of every tensor; what is no tensor goes to every micro-batch.

With R replicas the batch is first cut into R contiguous shards (as equal as
torch.tensor_split makes them), one per replica, and each shard into `chunks`
micro-batches. Replica r's micro-batch i is the step's micro-batch r*chunks+i:
that index seeds its randomness (gpipe.rng), and one device trains on the
R*chunks micro-batches in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any, cast

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from gpipe import structure


class DataStream:
    """`targets_into`: with the model's own loss, (keyword, first input's name): each batch's input gives the
    model its targets too (`with_targets`)."""

    def __init__(self, dataset: Dataset[Any], batch_size: int, chunks: int, shuffle: bool, seed: int,
                 collate: Callable[[list[Any]], Any] | None = None, replicas: int = 1,
                 targets_into: tuple[str, str] | None = None):
        self.dataset, self.batch_size, self.chunks, self.replicas = dataset, batch_size, chunks, replicas
        self.targets_into = targets_into
        self.collate = collate or default_collate
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
                # int32 where it holds n: the permutation int64 would be (the same draws), half the bytes
                dtype = torch.int32 if self.n < 2**31 else torch.int64
                self._perm = (epoch, torch.randperm(self.n, generator=g, dtype=dtype))
            out.append(int(self._perm[1][p % self.n]))
        return out

    def batch(self, step: int) -> tuple[Any, Any]:
        """The (inputs, targets) of step `step`, collated; ValueError naming what is wrong."""
        return with_targets(*_pair(_collated(self.dataset, self.indices(step), self.collate)), self.targets_into)

    def micro_batches(self, step: int) -> tuple[list[Any], list[Any], list[int]]:
        """The step's inputs and targets cut by torch.tensor_split into `chunks` micro-batches, and their sizes.

        Every tensor's dim 0 must be the batch size; ValueError naming the one whose is not.
        """
        return _cut(*self.batch(step), self.chunks, self.batch_size)

    def shards(self, step: int) -> list[tuple[list[Any], list[Any], list[int]]]:
        """Per replica: its shard's inputs and targets cut into `chunks` micro-batches, and their sizes.

        One replica: micro_batches(step). ValueError as there.
        """
        if self.replicas == 1:
            return [self.micro_batches(step)]
        inputs, targets = self.batch(step)
        xs = structure.split(inputs, self.replicas, self.batch_size, "input")
        ys = structure.split(targets, self.replicas, self.batch_size, "target")
        rows = torch.tensor_split(torch.arange(self.batch_size), self.replicas)
        return [_cut(x, y, self.chunks, len(r)) for x, y, r in zip(xs, ys, rows, strict=True)]


def _collated(dataset: Dataset[Any], indices: list[int], collate: Callable[[list[Any]], Any]) -> Any:
    """The items at `indices`, collated. A plain TensorDataset under torch's default collate takes one gather
    per tensor: the values torch.stack of the items would give, without two Python calls per item (the
    coordinator does this every step, on a core the stages may need)."""
    if type(dataset) is TensorDataset and collate is default_collate:
        at = torch.tensor(indices, dtype=torch.long)
        return [t[at] for t in dataset.tensors]
    return collate([dataset[i] for i in indices])


def with_targets(inputs: Any, targets: Any, into: tuple[str, str] | None) -> tuple[Any, Any]:
    """(inputs, targets), where the model takes its targets itself (`into`: (keyword, first input's name)) the
    inputs as the model's keyword inputs with the targets among them: a dict gains the keyword, one tensor
    becomes {first input: inputs, keyword: targets}. The targets stay beside (the last stage does not use them)."""
    if into is None:
        return inputs, targets
    keyword, first = into
    if isinstance(inputs, dict):
        if keyword in inputs:
            raise ValueError(f"the inputs already hold {keyword!r}, which the model's own loss gives the targets by")
        return {**inputs, keyword: targets}, targets
    if isinstance(inputs, torch.Tensor):
        return {first: inputs, keyword: targets}, targets
    raise ValueError(f"the inputs are {structure.describe(inputs)}: the model's own loss needs a tensor or a dict "
                     "of the model's keyword inputs")


def _pair(batch: Any) -> tuple[Any, Any]:
    if not (type(batch) in (tuple, list) and len(batch) == 2):
        raise ValueError(f"the collated batch is {structure.describe(batch)}, expected an (input, target) pair")
    return batch[0], batch[1]


def _cut(inputs: Any, targets: Any, chunks: int, size: int) -> tuple[list[Any], list[Any], list[int]]:
    """A batch of `size` samples cut by torch.tensor_split into `chunks` micro-batches, and their sizes."""
    xs = structure.split(inputs, chunks, size, "input")
    ys = structure.split(targets, chunks, size, "target")
    return xs, ys, [len(r) for r in torch.tensor_split(torch.arange(size), chunks)]


class EvalStream:
    """The evaluation data: batch b is items b*B ... b*B+B-1 in order, the last batch of the set possibly
    shorter, so an evaluation of every batch sees each item once. `batches` limits it to the first ones."""

    def __init__(self, dataset: Dataset[Any], batch_size: int, chunks: int, batches: int | None = None,
                 collate: Callable[[list[Any]], Any] | None = None, targets_into: tuple[str, str] | None = None):
        self.dataset, self.batch_size, self.chunks = dataset, batch_size, chunks
        self.targets_into = targets_into
        self.collate = collate or default_collate
        self.n = len(cast(Sized, dataset))
        self.batches = batches if batches is not None else -(-self.n // batch_size)

    def micro_batches(self, batch: int) -> tuple[list[Any], list[Any], list[int]]:
        """Eval batch `batch`'s inputs and targets cut into `chunks` micro-batches (fewer for a batch shorter
        than that), and their sizes; ValueError naming what is wrong."""
        start = batch * self.batch_size
        items = list(range(start, min(start + self.batch_size, self.n)))
        inputs, targets = with_targets(*_pair(_collated(self.dataset, items, self.collate)), self.targets_into)
        return _cut(inputs, targets, min(self.chunks, len(items)), len(items))
