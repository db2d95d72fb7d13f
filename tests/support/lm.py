"""Causal language models (Hugging Face's, built from configs) against one device: the loss, the batches, and
training on one device micro-batch after micro-batch, as the pipeline cuts each batch."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from gpipe.capture.graph import select_output
from tests.support import models
from tests.support.cli import torch_threads


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def batches(steps: int, batch: int, length: int, vary: bool = False, mask: bool = False, seed: int = 1):
    """(inputs, targets) per step: token ids (and an attention mask with left padding), lengths varying."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        n = length + (s % 3 if vary else 0)
        ids = torch.randint(1, 97, (batch, n + 1), generator=g)
        x = {"input_ids": ids[:, :-1]}
        if mask:
            m = torch.ones(batch, n, dtype=torch.long)
            m[0, :2] = 0
            m[-1, :1] = 0
            x["attention_mask"] = m
        out.append((x, ids[:, 1:]))
    return out


def one_device(model, data, chunks: int, loss_fn=lm_loss, lr: float = 0.1, replicas: int = 1) -> list[float]:
    """Train `model` on one device, micro-batch after micro-batch, as the pipeline cuts each batch."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in data:
        batch = y.size(0)
        total = 0.0
        for xs, ys in zip(_cut(x, batch, replicas, chunks), _cut(y, batch, replicas, chunks), strict=True):
            out = select_output(model(**xs), None)
            loss = loss_fn(out, ys) * ys.size(0) / batch
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _cut(v, batch: int, replicas: int, chunks: int) -> list:
    from gpipe import structure

    parts = []
    for shard in structure.split(v, replicas, batch, "v"):
        size = structure.tensors(shard)[0].size(0)
        parts += structure.split(shard, chunks, size, "v")
    return parts


def fresh(factory, **args):
    torch.manual_seed(0)
    return factory(**args)


def one_device_job(steps: int, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The GPT2 job (tests.support.spec.GPT2) on one device: the same micro-batches, torch.optim and clip_grad_norm_, the model's own names.
    `model`: the initial model (default: the job's, seeded)."""


    with torch_threads(1):
        if model is None:
            torch.manual_seed(0)
            model = models.gpt2()
        data = models.token_pairs(n=32)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(steps):
            x, y = data[step * 8:(step + 1) * 8]
            for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
                (lm_loss(model(xm).logits, ym) * xm.size(0) / 8).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}



def pretrained_gpt2(out: Path, shard: str | None = None) -> torch.nn.Module:
    """A GPT-2 of other weights than the job's seed gives, saved as from_pretrained loads it (sharded: `shard`)."""
    torch.manual_seed(5)
    model = models.gpt2()
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    return model


def _edit(src: Path, dst: Path, change) -> Path:
    tensors = load_file(src)
    change(tensors)
    save_file(tensors, dst)
    return dst


def _drop(t: dict) -> None:
    del t["transformer.h.1.mlp.c_fc.weight"]


# A small English corpus's lines: what tests train a tokenizer on and tokenize.
LINES = ["the quick brown fox jumps over the lazy dog", "a pipeline cuts a model into stages",
         "each stage sends its activations to the next", "and the gradients come back"]


def bpe_tokenizer(folder: Path, lines: list[str] = LINES, vocab: int = 300):
    """A byte-level BPE tokenizer (GPT-2's kind, with <|endoftext|>) trained here on `lines`, no download, saved
    as folder/tokenizer.json; the tokenizers package's Tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(lines * 5, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return tok
