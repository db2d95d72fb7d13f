"""Local Hugging Face data built from text here (no download): a tiny byte-level BPE tokenizer folder and
datasets saved with save_to_disk or as files, for data.factory hf_dataset."""

from __future__ import annotations

import json
from pathlib import Path

EOS = "<|endoftext|>"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "",  # an empty row: no tokens (but its eos with eos: true)
    "How vexingly quick daft zebras jump;\nthe five boxing wizards jump quickly.",
    "Sphinx of black quartz, judge my vow. Über naïve café.",
    "A pipeline cuts the model into stages and each batch into micro-batches.",
    "Jackdaws love my big sphinx of quartz, said the fox to the dog.",
    "Mr. Jock, TV quiz PhD, bags few lynx.",
] * 3


def tokenizer_folder(folder: Path, vocab: int = 300, eos: bool = True) -> Path:
    """A byte-level BPE of about `vocab` ids trained on TEXTS, saved as transformers' save_pretrained does
    (AutoTokenizer reads it back with local_files_only), with EOS as its eos token unless `eos` is false."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, **({"eos_token": EOS} if eos else {})).save_pretrained(folder)
    return folder


def dataset_folder(folder: Path, texts: list[str] = TEXTS, column: str = "text") -> Path:
    """`texts` as one column of a datasets.Dataset, written by save_to_disk."""
    import datasets

    datasets.Dataset.from_dict({column: texts, "n": list(range(len(texts)))}).save_to_disk(folder)
    return folder


def jsonl_files(folder: Path, texts: list[str] = TEXTS, files: int = 2) -> list[Path]:
    """`texts` cut into `files` .jsonl files in order (part-0.jsonl, part-1.jsonl, ...), one row a line."""
    folder.mkdir(parents=True, exist_ok=True)
    cut = [round(len(texts) * k / files) for k in range(files + 1)]
    paths = []
    for k in range(files):
        p = folder / f"part-{k}.jsonl"
        p.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts[cut[k]:cut[k + 1]])))
        paths.append(p)
    return paths
