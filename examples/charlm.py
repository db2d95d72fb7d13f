"""A byte-level Transformer language model, shaped like PyTorch's DDP + pipeline tutorial.

The model is an nn.Sequential: an encoder (embedding and positional encoding),
N causal Transformer encoder layers, and a linear decoder, so gpipe can cut it
anywhere between layers. The corpus is text every Python install carries (the
interactive help's topics, pydoc_data/topics.py), or your own text file.

    gpipe-coordinator run examples/charlm.yaml
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB = 256  # bytes


class Encoder(nn.Module):
    """Token embedding, scaled, plus sinusoidal positions, then dropout."""

    def __init__(self, d_model: int, dropout: float, max_len: int = 4096):
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(VOCAB, d_model)
        self.drop = nn.Dropout(dropout)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (batch, seq) -> (batch, seq, d_model)
        x = self.embed(tokens) * math.sqrt(self.d_model)
        return self.drop(x + self.pe[: tokens.size(1)])


class CausalEncoderLayer(nn.TransformerEncoderLayer):
    """A Transformer encoder layer that attends only to earlier positions."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device, dtype=x.dtype)
        return super().forward(x, src_mask=mask, is_causal=True)


class Decoder(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.linear = nn.Linear(d_model, VOCAB)
        nn.init.uniform_(self.linear.weight, -0.1, 0.1)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def transformer_lm(d_model: int = 128, heads: int = 4, ff: int = 256, layers: int = 4,
                   dropout: float = 0.1) -> nn.Sequential:
    """Encoder, `layers` causal encoder layers, decoder: layers + 2 pipeline layers."""
    blocks = [CausalEncoderLayer(d_model, heads, ff, dropout, batch_first=True) for _ in range(layers)]
    return nn.Sequential(Encoder(d_model, dropout), *blocks, Decoder(d_model))


def default_corpus() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"


class ByteCorpus(Dataset):
    """Windows of `seq_len` bytes; the target is the same window shifted by one.

    `split` "train" takes the text but its last `held_out` share, "eval" that
    share alone (held-out text for evaluation), "all" the whole text.
    """

    def __init__(self, path: str | None = None, seq_len: int = 64, max_bytes: int | None = None,
                 split: str = "all", held_out: float = 0.1):
        if split not in ("all", "train", "eval"):
            raise ValueError(f"split: {split!r} is none of all, train, eval")
        if not 0.0 < held_out < 1.0:
            raise ValueError(f"held_out: {held_out} is not between 0 and 1")
        p = Path(path) if path else default_corpus()
        data = p.read_bytes()[:max_bytes]
        cut = len(data) - int(len(data) * held_out)
        data = data[:cut] if split == "train" else data[cut:] if split == "eval" else data
        if len(data) < seq_len + 1:
            raise ValueError(f"{p} has {len(data)} bytes; need at least seq_len+1 = {seq_len + 1}")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.seq_len
        chunk = self.data[s : s + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def corpus(path: str | None = None, seq_len: int = 64, max_bytes: int | None = None, split: str = "all",
           held_out: float = 0.1) -> ByteCorpus:
    return ByteCorpus(path, seq_len, max_bytes, split, held_out)


# -- the same model on lines of text, padded, with the padding mask crossing the cuts -------------------


class MaskedEncoder(Encoder):
    """{"tokens", "mask"} -> (hidden, mask): the mask (True at padding) goes along to every layer."""

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(batch["tokens"]), batch["mask"]


class MaskedCausalEncoderLayer(nn.TransformerEncoderLayer):
    """(hidden, mask) -> (hidden, mask): attends to earlier positions that are not padding."""

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, pad = pair
        causal = torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device).triu(1)
        return super().forward(x, src_mask=causal, src_key_padding_mask=pad, is_causal=True), pad


class MaskedDecoder(Decoder):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(pair[0])


def transformer_lm_masked(d_model: int = 128, heads: int = 4, ff: int = 256, layers: int = 4,
                          dropout: float = 0.1) -> nn.Sequential:
    """transformer_lm on padded batches: (hidden, padding mask) pairs cross every cut."""
    blocks = [MaskedCausalEncoderLayer(d_model, heads, ff, dropout, batch_first=True) for _ in range(layers)]
    return nn.Sequential(MaskedEncoder(d_model, dropout), *blocks, MaskedDecoder(d_model))


class Lines(Dataset):
    """The corpus's non-empty lines (at most `max_len` + 1 bytes each), bucketed by length.

    The lines are sorted by length and cut into buckets of `batch_size`, and the
    buckets are shuffled (seeded): with `shuffle: false`, each step's batch is
    one bucket of lines of about the same length, and the length changes from
    step to step.
    """

    def __init__(self, path: str | None = None, max_len: int = 128, batch_size: int = 32, seed: int = 0,
                 max_bytes: int | None = None):
        p = Path(path) if path else default_corpus()
        lines = [ln[: max_len + 1] for ln in p.read_bytes()[:max_bytes].splitlines() if len(ln.strip()) >= 2]
        lines.sort(key=len)
        buckets = [lines[i : i + batch_size] for i in range(0, len(lines) - batch_size + 1, batch_size)]
        order = torch.randperm(len(buckets), generator=torch.Generator().manual_seed(seed)).tolist()
        self.lines = [torch.tensor(list(ln)) for b in order for ln in buckets[b]]
        if not self.lines:
            raise ValueError(f"{p} has fewer than {batch_size} lines of 2 bytes or more")

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lines[i][:-1], self.lines[i][1:]


def lines(path: str | None = None, max_len: int = 128, batch_size: int = 32, seed: int = 0,
          max_bytes: int | None = None) -> Lines:
    return Lines(path, max_len, batch_size, seed, max_bytes)

