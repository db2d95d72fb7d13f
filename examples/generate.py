"""Text from a GPT-2 that `gpipe-coordinator run` trained on token files (examples/gpt2-tokens.yaml).

    python examples/generate.py gpipe-state/gpt2-tokens --tokenizer examples/gpt2-tokenizer \
        --prompt "The pipeline" --tokens 20

The run's folder (<state-dir>/<job>) holds model.safetensors under the Hugging Face model's own names and,
beside it, the model's config.json (the job's model args as GPT2Config: examples/hf.py), so
GPT2LMHeadModel.from_pretrained reads the folder as it is. The prompt is encoded, and the continuation
decoded, by the tokenizer.json that `gpipe-coordinator tokenize` wrote the token files with (the
tokenizers package). Greedy decoding: the same weights give the same text. Needs the hf and data extras:
pip install -e '.[hf,data]'. A missing file or a prompt the model cannot take is one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("run", help="the run's folder: <state-dir>/<job>, with model.safetensors and config.json")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="the folder with tokenize's tokenizer.json")
    p.add_argument("--prompt", default="The", help="the text to continue")
    p.add_argument("--tokens", type=int, default=20, metavar="N", help="tokens to generate (default 20)")
    args = p.parse_args(argv)
    try:
        print(generate(Path(args.run), Path(args.tokenizer), args.prompt, args.tokens))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def generate(run: Path, tokenizer: Path, prompt: str, tokens: int) -> str:
    """`prompt` and its greedy continuation by `tokens` tokens; ValueError in one line naming what is wrong."""
    tok_json = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    for f in (run / "model.safetensors", run / "config.json", tok_json):
        if not f.is_file():
            raise ValueError(f"{f}: no such file")
    import torch
    from tokenizers import Tokenizer
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.disable_progress_bar()  # the text alone on stdout, nothing on stderr
    tok = Tokenizer.from_file(str(tok_json))
    model = GPT2LMHeadModel.from_pretrained(run).eval()
    ids = tok.encode(prompt, add_special_tokens=False).ids
    cfg = model.config
    if not ids or not 0 < tokens <= cfg.n_positions - len(ids):
        raise ValueError(f"a prompt of {len(ids)} tokens and {tokens} more: the model takes 1 to "
                         f"{cfg.n_positions} tokens in all")
    if max(ids) >= cfg.vocab_size:
        raise ValueError(f"{tok_json} gives id {max(ids)}, the model's vocabulary has {cfg.vocab_size}: not the "
                         f"tokenizer of its token files")
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False,
                             pad_token_id=cfg.eos_token_id, use_cache=True)
    return prompt + str(tok.decode(out[0, len(ids):].tolist()))


if __name__ == "__main__":
    sys.exit(main())
