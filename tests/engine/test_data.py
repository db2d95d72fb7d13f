"""The data stream: a TensorDataset's batches by one gather per tensor equal torch's default collate of its items."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from gpipe.coordinator.plan.data import DataStream, EvalStream


class ItemByItem(TensorDataset):
    """The same data set, taken item by item (a subclass: the stream's gather is for TensorDataset itself)."""


def _data(cls: type[TensorDataset]) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return cls(torch.randn(13, 3, 2, generator=g), torch.randint(0, 5, (13,), generator=g))


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x if isinstance(x, list) else [x], y if isinstance(y, list) else [y], strict=True):
            assert s.dtype == t.dtype and s.shape == t.shape and torch.equal(s, t) and s.is_contiguous()


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_tensor_data_sets_batches_equal_its_items_collated(shuffle, replicas):
    # Batches of 5 from 13 items wrap around the epochs; 3 micro-batches per replica are uneven.
    fast, slow = (DataStream(_data(c), 5, 3, shuffle, seed=7, replicas=replicas) for c in (TensorDataset, ItemByItem))
    for step in range(7):
        for (xa, ya, na), (xb, yb, nb) in zip(fast.shards(step), slow.shards(step), strict=True):
            _same(xa, xb)
            _same(ya, yb)
            assert na == nb
    evals = [EvalStream(_data(c), 5, 3) for c in (TensorDataset, ItemByItem)]
    for b in range(evals[0].batches):  # the last batch holds 3 items
        (xa, ya, na), (xb, yb, nb) = (e.micro_batches(b) for e in evals)
        _same(xa, xb)
        _same(ya, yb)
        assert na == nb
