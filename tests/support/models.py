"""Models and data sets for the tests, importable by the workers as tests.support.models:NAME."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from gpipe import skip


def mlp_dropout(width: int = 16, depth: int = 5, p: float = 0.2) -> nn.Sequential:
    """Linear+Dropout layers: the weights depend on every dropout mask."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh(), nn.Dropout(p)]
    return nn.Sequential(*layers, nn.Linear(width, width))


class OwnDropout(nn.Module):
    """A layer that calls F.dropout itself, with no mark: its recomputation must replay its forward's mask."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, self.p, self.training)


def mlp_own_dropout(width: int = 16, depth: int = 3, p: float = 0.2) -> nn.Sequential:
    """mlp_dropout with every other dropout a layer of the model's own (OwnDropout)."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh(), nn.Dropout(p) if i % 2 else OwnDropout(p)]
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


class ShortData(torch.utils.data.Dataset):
    """Says it has `n` items, but item `bad` and after raise IndexError (a data set whose length is wrong)."""

    def __init__(self, n: int = 64, bad: int = 16, width: int = 8):
        self.n, self.bad, self.width = n, bad, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i >= self.bad:
            raise IndexError(f"item {i} of {self.bad}")
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.width, generator=g), torch.randn(self.width, generator=g)


def short_data(n: int = 64, bad: int = 16, width: int = 8) -> ShortData:
    return ShortData(n, bad, width)


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


class Gated(Slow):
    """Slow only while the file `gate` exists: a job a test can hold at a slow pace, then let run."""

    def __init__(self, seconds: float, gate: str):
        super().__init__(seconds)
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if os.path.exists(self.gate) else x


def gated_mlp(gate: str, width: int = 8, seconds: float = 0.05, blocks: int = 2) -> nn.Sequential:
    """slow_mlp's layers, slow while the file `gate` exists (an absolute path)."""
    return nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(width, width), Gated(seconds, gate))])


def slow_mlp(width: int = 8, seconds: float = 0.05, blocks: int = 2) -> nn.Sequential:
    """`blocks` x (Linear, Slow(seconds))."""
    return nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(width, width), Slow(seconds))])


SHARED: list[object] = []  # shared_hog's mappings, held for the life of the process


def shared_hog(mib: int, width: int = 16) -> nn.Sequential:
    """An MLP whose factory first maps `mib` MiB of shared anonymous memory (MAP_SHARED, which RLIMIT_DATA does
    not count): a validation's memory cap must refuse it."""
    import mmap

    SHARED.append(mmap.mmap(-1, mib << 20))
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))


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


# -- structures between stages (tests/*/test_structures.py) ---------------------------------------------


class PairIn(nn.Module):
    """x -> (hidden, skip): the first layer of a model whose layers pass pairs."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.lin(x)), x


class PairBlock(nn.Module):
    """(hidden, skip) -> (hidden', hidden): a residual from the pair's second half."""

    def __init__(self, width: int, p: float = 0.1):
        super().__init__()
        self.lin, self.drop = nn.Linear(width, width), nn.Dropout(p)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, s = pair
        return self.drop(torch.tanh(self.lin(h))) + 0.5 * s, h


class PairOut(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(2 * width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.lin(torch.cat(pair, dim=-1))


def pair_mlp(width: int = 16, blocks: int = 4) -> nn.Sequential:
    """Layers that pass (hidden, skip) tuples across every cut."""
    return nn.Sequential(PairIn(width), *[PairBlock(width) for _ in range(blocks)], PairOut(width))


class MaskedIn(nn.Module):
    """{"x", "mask"} -> a dict with a float hidden state, the bool mask, int ids, None, and scalars."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, batch: dict) -> dict:
        mask = batch["mask"]
        h = torch.tanh(self.lin(batch["x"])) * mask.float()
        ids = mask.long().cumsum(-1)  # int64: crosses with no gradient
        return {"h": h, "mask": mask, "ids": ids, "none": None, "scale": 0.5, "count": 3, "tag": "m", "on": True}


class MaskedBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.pos = nn.Embedding(64, width)

    def forward(self, d: dict) -> dict:
        assert d["none"] is None and d["count"] == 3 and d["tag"] == "m" and d["on"] is True
        assert d["mask"].dtype == torch.bool and d["ids"].dtype == torch.int64
        h = torch.tanh(self.lin(d["h"]) + d["scale"] * self.pos(d["ids"]).mean(-2)) * d["mask"].float()
        return {**d, "h": h}


class MaskedOut(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, d: dict) -> torch.Tensor:
        return self.lin(d["h"])


def masked_mlp(width: int = 16, blocks: int = 3) -> nn.Sequential:
    """A dict input {"x", "mask"}; dicts with bool and int tensors, None and scalars across every cut."""
    return nn.Sequential(MaskedIn(width), *[MaskedBlock(width) for _ in range(blocks)], MaskedOut(width))


class DictItems(torch.utils.data.Dataset):
    """({"x": float[width], "mask": bool[width]}, target float[width])."""

    def __init__(self, n: int = 40, width: int = 16):
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(n, width, generator=g)
        self.mask = torch.rand(n, width, generator=g) > 0.3
        self.y = torch.randn(n, width, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[dict, torch.Tensor]:
        return {"x": self.x[i], "mask": self.mask[i]}, self.y[i]


def dict_items(n: int = 40, width: int = 16) -> DictItems:
    return DictItems(n, width)


class Tokens(nn.Module):
    """{"tokens", "mask"} -> (hidden, mask): an embedding of a padded batch of sequences."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed(batch["tokens"]), batch["mask"]


class SeqBlock(nn.Module):
    """(hidden, mask) -> (hidden, mask): attention over the unpadded positions, then a linear."""

    def __init__(self, width: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.lin = nn.Linear(width, width)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = pair
        a, _ = self.attn(h, h, h, key_padding_mask=mask, need_weights=False)
        return torch.tanh(self.lin(h + a)), mask


class SeqOut(nn.Module):
    def __init__(self, width: int, vocab: int):
        super().__init__()
        self.lin = nn.Linear(width, vocab)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.lin(pair[0])


def seq_model(vocab: int = 11, width: int = 16, blocks: int = 2) -> nn.Sequential:
    return nn.Sequential(Tokens(vocab, width), *[SeqBlock(width) for _ in range(blocks)], SeqOut(width, vocab))


class Sentences(torch.utils.data.Dataset):
    """Token sequences of lengths 2-9; the target is the sequence shifted by one."""

    def __init__(self, n: int = 60, vocab: int = 11):
        g = torch.Generator().manual_seed(4)
        self.items = [torch.randint(1, vocab, (int(torch.randint(3, 11, (), generator=g)),), generator=g)
                      for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.items[i]
        return s[:-1], s[1:]


def sentences(n: int = 60, vocab: int = 11) -> Sentences:
    return Sentences(n, vocab)


class Returns(nn.Module):
    """Returns what `kind` names, which the next layer (or the wire) cannot take."""

    def __init__(self, kind: str, width: int):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> object:
        h = self.lin(x)
        if self.kind == "tuple_to_linear":
            return h, h[:, 0] > 0
        if self.kind == "set":
            return {1, 2}
        if self.kind == "complex":
            return h.to(torch.complex64), 1
        deep: object = h
        for _ in range(17):
            deep = [deep]
        return deep


def bad_cut(kind: str, width: int = 16) -> nn.Sequential:
    return nn.Sequential(Returns(kind, width), nn.Linear(width, width))


def short_mask_collate(items: list) -> tuple[dict, torch.Tensor]:
    """default_collate, but the mask keeps only 3 rows."""
    x, y = torch.utils.data.default_collate(items)
    return {"x": x["x"], "mask": x["mask"][:3]}, y


# -- skip connections between stages ----------------------------------------------------------------


class SkipIn(nn.Module):
    """Stashes "s" (skip_width wide, float) and "ids" (int64) for a later layer."""

    def __init__(self, width: int, skip_width: int, p: float = 0.1):
        super().__init__()
        self.lin, self.proj, self.drop = nn.Linear(width, width), nn.Linear(width, skip_width), nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip.stash("s", self.drop(self.proj(x)))
        skip.stash("ids", (x > 0).long().sum(-1) % 8)
        return torch.tanh(self.lin(x))


class SkipMid(nn.Module):
    def __init__(self, width: int, name: str | None = None, pops: str | None = None):
        super().__init__()
        self.lin, self.name, self.pops = nn.Linear(width, width), name, pops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        if self.name:
            skip.stash(self.name, 2 * h)
        if self.pops:
            h = h + skip.pop(self.pops)
        return h


class SkipPop(nn.Module):
    def __init__(self, width: int, skip_width: int):
        super().__init__()
        self.lin, self.back, self.emb = nn.Linear(width, width), nn.Linear(skip_width, width), nn.Embedding(8, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) + self.back(skip.pop("s")) + self.emb(skip.pop("ids"))


class SkipOut(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h + skip.pop("local") + skip.pop("s2"))


def skip_mlp(width: int = 16, skip_width: int = 24) -> nn.Sequential:
    """Layer 0 stashes s and ids for layer 3, layer 1 stashes s2 for layer 5, layer 4 stashes local for layer 5."""
    return nn.Sequential(SkipIn(width, skip_width), SkipMid(width, "s2"), SkipMid(width), SkipPop(width, skip_width),
                         SkipMid(width, "local"), SkipOut(width))


def bad_skips(kind: str, width: int = 16) -> nn.Sequential:
    """pop: a pop with no stash before it; twice: a name stashed by two layers."""
    if kind == "pop":
        return nn.Sequential(SkipMid(width), SkipMid(width, pops="nope"), nn.Linear(width, width))
    return nn.Sequential(SkipMid(width, "x"), SkipMid(width, "x"), SkipMid(width, pops="x"))


def init_ones_hook(index: int, layer: nn.Module) -> None:
    """An init hook: every weight index/100 plus noise from the layer's seeded generator, every bias zero."""
    for m in layer.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
    for name, p in layer.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        else:
            p.copy_(index / 100 + 0.1 * torch.randn(p.shape))


class NoReset(nn.Module):
    """Holds a parameter but has no reset_parameters(): init per_layer cannot initialise it alone."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def mlp_no_reset(width: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), NoReset(width), nn.Linear(width, width))


def mlp_norm(width: int = 16, depth: int = 4) -> nn.Sequential:
    """Linear, LayerNorm and BatchNorm1d layers: parameters and buffers that reset_parameters() sets."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers.append(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.BatchNorm1d(width), nn.Tanh()))
    return nn.Sequential(*layers, nn.Linear(width, width))


class GradOverflow(nn.Module):
    """x times its weight; on the training forwards numbered in `at` (counted in a buffer, so a resumed
    stage counts on) its weight's gradient is inf, and no other gradient changes."""

    def __init__(self, width: int, at: list[int]):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.at = frozenset(at)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.training:
            if int(self.calls) in self.at:
                w = w * 1.0  # a copy in the graph, whose gradient the hook replaces
                w.register_hook(lambda g: torch.full_like(g, float("inf")))
            self.calls.add_(1)
        return x * w


def overflow_mlp(width: int = 16, at: list[int] | None = None) -> nn.Sequential:
    """Linear, ReLU, GradOverflow, Linear, ReLU, Linear: with balance [3, 3], the overflow is stage 0's alone."""
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), GradOverflow(width, at or []),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


# -- models that are not an nn.Sequential (gpipe.capture.graph) --------------------------------------------------------

def gpt2(vocab: int = 97, width: int = 32, layers: int = 4, heads: int = 4, dropout: float = 0.0) -> nn.Module:
    """A small GPT2LMHeadModel from a config (no download): its embedding and head are one tied weight."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=width, n_layer=layers, n_head=heads,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def llama(vocab: int = 97, width: int = 32, layers: int = 4, heads: int = 4) -> nn.Module:
    """A small LlamaForCausalLM (RoPE, grouped-query attention, RMSNorm), untied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=64,
                      use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h)) * first.sigmoid()


class ResidualNet(nn.Module):
    """A hand-written module: the stem's output is read by every block and by the head, so it crosses every cut."""

    def __init__(self, width: int = 16, blocks: int = 4):
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.stem(x)
        h = first
        for b in self.blocks:
            h = b(h, first)
        return self.head(h) + first


def residual_net(width: int = 16, blocks: int = 4) -> nn.Module:
    return ResidualNet(width, blocks)


class Branchy(nn.Module):
    """A forward that branches on a tensor's value: torch.export cannot capture it."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
            if x.sum() > 0:
                x = -x
        return x


def token_pairs(n: int = 32, length: int = 12, vocab: int = 97, seed: int = 0) -> TensorDataset:
    """Next-token pairs of random token ids: (ids[:-1], ids[1:])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, length + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


class MaskedPairs(torch.utils.data.Dataset):
    """token_pairs as ({"input_ids", "attention_mask"}, targets): every 3rd sample left-padded (masked out)."""

    def __init__(self, n: int = 32, length: int = 12, vocab: int = 97):
        self.pairs = token_pairs(n, length, vocab)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        x, y = self.pairs[i]
        mask = torch.ones_like(x)
        mask[: (i % 3 == 0) * 2] = 0
        return {"input_ids": x, "attention_mask": mask}, y


def masked_pairs(n: int = 32) -> MaskedPairs:
    return MaskedPairs(n)


def hf_init(name: str, module: nn.Module) -> None:
    """init_hook for a captured Hugging Face model (init per_layer): GPT-2's Conv1D has no reset_parameters().
    Its own parameters: biases 0, norms' weights 1, the others normal with std 0.02, as GPT-2's _init_weights."""
    for leaf, p in module.named_parameters(recurse=False):
        if leaf == "bias":
            nn.init.zeros_(p)
        elif p.dim() == 1:
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, std=0.02)


class ScaledBlocks(nn.Module):
    """Keeps a plain tensor (no parameter, no buffer), which a model built on the meta device cannot capture with."""

    def __init__(self, width: int = 16, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.scale = torch.linspace(0.5, 1.5, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x)) * self.scale
        return x


def scaled_blocks(width: int = 16, blocks: int = 3) -> nn.Module:
    return ScaledBlocks(width, blocks)


class _DeterminismCheck(nn.Module):
    """Passes its input on, once it has checked its process's deterministic setting is `expected`."""

    def __init__(self, expected: bool):
        super().__init__()
        self.expected = expected

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        on = torch.are_deterministic_algorithms_enabled() and os.environ.get("CUBLAS_WORKSPACE_CONFIG") is not None
        if on != self.expected:
            raise RuntimeError(f"deterministic algorithms {'on' if on else 'off'} in this stage's process, "
                               f"expected {'on' if self.expected else 'off'}")
        return x


def determinism_mlp(expected: bool, width: int = 16) -> nn.Sequential:
    """An MLP whose stages check their processes' deterministic setting (spec `deterministic`)."""
    return nn.Sequential(nn.Linear(width, width), _DeterminismCheck(expected), nn.Tanh(),
                         nn.Linear(width, width), _DeterminismCheck(expected))


# -- what a cut cannot carry, a data set without targets (validate's refusals) ------------------------------

class _ToComplex(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.polar(torch.ones_like(h), h)


class _FromComplex(_ToComplex):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.view_as_real(z).sum(-1))


class ComplexCrossing(nn.Module):
    """Not an nn.Sequential: block `a` hands block `b` a complex64 tensor."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.b = _ToComplex(width), _FromComplex(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def inputs_only(n: int = 8) -> TensorDataset:
    """A data set without targets: its items are 1-tuples."""
    return TensorDataset(torch.randn(n, 8))


class _NanoBlock(nn.Module):
    """nanoGPT's Block: pre-norm causal self-attention and an MLP, each a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's GPT in its own style: `forward(idx, targets=None)` returns (logits, loss), the loss only when
    targets are given (and then the logits of every position, else of the last one); the token embedding and the
    head are one tied weight."""

    def __init__(self, vocab: int = 97, width: int = 32, layers: int = 4, heads: int = 4, block_size: int = 32):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, width), wpe=nn.Embedding(block_size, width),
            h=nn.ModuleList(_NanoBlock(width, heads) for _ in range(layers)), ln_f=nn.LayerNorm(width)))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's tie

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss


def nano_gpt(vocab: int = 97, width: int = 32, layers: int = 4, heads: int = 4) -> nn.Module:
    return NanoGPT(vocab, width, layers, heads)


# -- torchtitan's Llama in its own style: its blocks in an nn.ModuleDict keyed "0", "1", ... -------------------------

class TitanRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class TitanAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention = TitanAttention(dim, heads)
        self.feed_forward = TitanFeedForward(dim, 2 * dim)
        self.attention_norm = TitanRMSNorm(dim)
        self.ffn_norm = TitanRMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Titan(nn.Module):
    """torchtitan's Transformer, small: tok_embeddings, `layers` an nn.ModuleDict of blocks ("0", "1", ...), norm,
    output; the forward runs `for layer in self.layers.values()`."""

    def __init__(self, vocab: int = 97, dim: int = 32, layers: int = 4, heads: int = 4):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict()
        for i in range(layers):
            self.layers[str(i)] = TitanBlock(dim, heads)
        self.norm = TitanRMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def titan(vocab: int = 97, dim: int = 32, layers: int = 4, heads: int = 4) -> nn.Module:
    return Titan(vocab, dim, layers, heads)
