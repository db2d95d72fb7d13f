"""Other people's models on the first try: torchtitan's style (its blocks in an nn.ModuleDict keyed "0", "1", ...)
cut at its blocks against one device; what validate says it cut; what crosses a cut, in the sample's sizes.

In process, no transformers needed; Hugging Face's models are tests/engine/test_anymodel.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.capture.graph import capture, repeated_blocks
from tests.support import models
from tests.support.lm import fresh, lm_loss
from tests.support.local import plan_of
from tests.support.spec import DELETE, job

TITAN = job(name="titan", seed=0, stages=2, chunks=2, model={"factory": "tests.support.models:titan", "args": {}},
            data={"factory": "tests.support.models:token_pairs", "args": {"n": 16}, "batch_size": 4, "shuffle": False},
            loss="cross_entropy", optimizer={"name": "sgd", "lr": 0.1})


def token_batches(steps: int, batch: int = 4, length: int = 10) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(1, 97, (batch, length + 1), generator=g) for _ in range(steps)]
    return [(i[:, :-1], i[:, 1:]) for i in ids]


def test_blocks_in_a_module_dict_are_found_in_its_order_and_the_pipeline_equals_one_device():
    data, chunks = token_batches(3), 2
    want = fresh(models.titan)
    opt = torch.optim.SGD(want.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:  # one device, micro-batch after micro-batch, as the pipeline cuts each batch
        for xm, ym in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
            (lm_loss(want(xm), ym) * xm.size(0) / x.size(0)).backward()
        opt.step()
        opt.zero_grad()

    got = fresh(models.titan)
    assert repeated_blocks(got) == "layers"
    opt = torch.optim.SGD(got.parameters(), lr=0.1, momentum=0.9)
    with gpipe.Pipeline(got, stages=2, chunks=chunks) as pipe:
        for x, y in data:
            pipe.step(x, y, lm_loss)
            opt.step()
            opt.zero_grad()
        c = pipe.captured
        assert c is not None and (c.blocks, c.block_count, len(c.pieces)) == ("layers", 4, 4)
        # the dict's order: piece i holds block i, the embedding rides with the first, the head with the last
        assert [m for m in c.modules[0] if m.startswith("layers.")] == ["layers.0"]
        assert [[m for m in ms if m.startswith("layers.")] for ms in c.modules[1:]] == \
            [["layers.1"], ["layers.2"], ["layers.3"]]
        assert "tok_embeddings" in c.modules[0] and c.modules[3][-2:] == ["norm", "output"]
    g, w = dict(got.named_parameters()), dict(want.named_parameters())
    assert set(g) == set(w)
    worst = max((g[k] - w[k]).abs().max().item() for k in w)
    assert worst <= 1e-6, f"weights differ from one device by {worst}"


def test_a_module_dict_of_mixed_modules_holds_no_blocks():
    """nanoGPT's `transformer` dict (embeddings, a list, a norm) is no run of blocks: its list is."""
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.ReLU(),
                                        "h": nn.ModuleList(nn.Linear(4, 4) for _ in range(3))})

    assert repeated_blocks(Mixed()) == "parts.h"


@pytest.mark.parametrize(("changes", "counts"), [
    ({}, ["4 blocks in layers (TitanBlock)", "4 pieces", "balance [2, 2]"]),
    ({"model__split_points": ["layers.2"], "stages": DELETE},  # stages: one more than the split points
     ["4 blocks in layers (TitanBlock) and 1 split point", "4 pieces", "balance [2, 2]"]),
    ({"model__args": {"layers": 1}, "model__split_points": ["output"], "stages": DELETE},
     ["no repeated blocks", "1 split point", "2 pieces", "balance [1, 1]"]),
], ids=["blocks", "blocks-and-split-point", "split-point-only"])
def test_validate_counts_the_blocks_it_found_and_the_pieces_it_cut(changes, counts):
    summary = plan_of(job(TITAN, **changes)).summary()
    assert all(c in summary for c in counts), summary
    assert "layers," not in summary  # a captured model is cut into pieces, not layers


def test_validate_counts_an_nn_sequential_s_layers():
    assert plan_of(job()).summary() == "4 layers, balance [2, 2]"


class TitanWithLabels(models.Titan):
    """The model takes its targets and gives its loss (as Hugging Face's do with labels): the labels cross every
    cut, and nothing ties their sizes to the tokens' for torch.export."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.cross_entropy(super().forward(tokens).flatten(0, 1), labels.flatten())


def test_what_crosses_a_cut_is_shown_in_named_dims_or_the_sample_s_sizes_never_export_s_symbols():
    sample = {"tokens": torch.randint(1, 97, (2, 8)), "labels": torch.randint(1, 97, (2, 8))}
    c = capture(fresh(TitanWithLabels), sample, ["layers.2"])
    shapes = [s for cut in c.shapes for s in cut]
    assert not [s for s in shapes if re.search(r"\b[su]\d+\b", s)], shapes
    assert "[B, T, 32] float32 from layers.1" in c.shapes[1]
    assert "[B, 8] int64" in c.shapes[1]  # the labels: a batch dimension (every input's dim 0), the sample's 8
