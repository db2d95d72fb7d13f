"""Hugging Face causal LMs for examples/gpt2.yaml and examples/llama.yaml, built from small configs (no download).

Needs the hf extra: pip install -e '.[hf]'. gpipe captures these models with torch.export and cuts them by
name (model.split_points); GPT-2's embedding and head stay one tied weight.
"""

from __future__ import annotations

from typing import Any

import torch
from charlm import ByteCorpus  # examples/charlm.py: the `make demo` text, as bytes
from torch import nn
from torch.utils.data import Dataset


def gpt2(vocab: int = 256, width: int = 128, layers: int = 4, heads: int = 4, positions: int = 128,
         dropout: float = 0.0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    return GPT2LMHeadModel(cfg)


def llama(vocab: int = 256, width: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
          positions: int = 128) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
                      use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


class MaskedBytes(Dataset[Any]):
    """The byte corpus as {"input_ids", "attention_mask"}: every 4th sample left-padded by a few positions
    (masked out), as batches of lines of different lengths are."""

    def __init__(self, seq_len: int = 64, path: str | None = None):
        self.corpus = ByteCorpus(path, seq_len, None, "all", 0.1)

    def __len__(self) -> int:
        return len(self.corpus)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        x, y = self.corpus[i]
        mask = torch.ones_like(x)
        pad = (i % 4 == 0) * (1 + i % 5)
        mask[:pad] = 0
        return {"input_ids": x, "attention_mask": mask}, y


def masked_corpus(seq_len: int = 64, path: str | None = None) -> MaskedBytes:
    return MaskedBytes(seq_len, path)
