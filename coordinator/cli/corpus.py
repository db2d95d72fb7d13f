"""`gpipe-coordinator tokenize`: a text corpus into token files (gpipe.data.tokens reads them).

    gpipe-coordinator tokenize books/*.txt web.jsonl --tokenizer gpt2-tok/ --out data/train.bin --val-fraction 0.01
    gpipe-coordinator tokenize books/*.txt --train-vocab 8192 --tokenizer tok/ --out data/train.bin  # offline

The corpus: .txt files (each file one document), .jsonl (one document a line, its `text` field) and, with
pyarrow installed, .parquet (the `text` column). The tokenizer: a folder with a tokenizer.json that the
`tokenizers` package reads (pip install 'gpipe[data]'; a Hugging Face model's folder has one). Its ids
are written one after another, uint16 when the vocabulary fits in 65535 ids, else uint32, little-endian,
with --eos TOKEN after each document. With --train-vocab N, the tokenizer is first trained on the corpus
itself, nothing downloaded: a byte-level BPE of N ids (GPT-2's kind: the 256 bytes, --eos, merges), written
to --tokenizer DIR as DIR/tokenizer.json. With --val-fraction F the last F of the tokens go to val.bin
beside train.bin (a name with `train` in it has it replaced by `val`), as nanoGPT cuts its corpora.

The output is the same bytes whatever --workers: N processes tokenize the corpus's pieces (a .txt is cut
at line ends into pieces of about 1 MiB), and their tokens are written in the corpus's order. A run
writes to NAME.partial in the output's folder and renames at the end, so a run killed half-way leaves
no half file under the final name, and a rerun starts over.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import queue
import sys
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpipe.errors import SpecError, describe_os_error

KINDS = (".txt", ".jsonl", ".parquet")
PIECE_CHARS = 1 << 20  # text a worker tokenizes at a time

Piece = list[tuple[str, bool]]  # (text, ends a document) in corpus order


def add_parser(sub: Any) -> None:
    """The `tokenize` verb's arguments, on the CLI's subparsers."""
    t = sub.add_parser("tokenize", help="turn .txt/.jsonl/.parquet files into token files (data.factory tokens)",
                       description=(__doc__ or "").split("\n\n")[2])
    t.add_argument("corpus", nargs="+", help="the corpus's files (.txt, .jsonl, .parquet), in order")
    t.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="a folder with a tokenizer.json (with --train-vocab: where to write it)")
    t.add_argument("--train-vocab", type=int, default=None, metavar="N",
                   help="first train a byte-level BPE tokenizer of N ids (the 256 bytes, --eos, then merges) on the "
                        "corpus, offline, and write it to --tokenizer DIR as DIR/tokenizer.json (a new file)")
    t.add_argument("--out", required=True, metavar="FILE", help="the token file to write, e.g. data/train.bin")
    t.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                   help="write the last F of the tokens (0 < F < 1) to val.bin beside --out")
    t.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizing processes (default 1)")
    t.add_argument("--text-field", default="text", help="the text's field of a .jsonl line or .parquet row")
    t.add_argument("--eos", default=None, metavar="TOKEN",
                   help="a token of the tokenizer's (e.g. '<|endoftext|>') written after each document")
    t.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def main(args: argparse.Namespace) -> int:
    if not 0 <= args.val_fraction < 1:
        raise SpecError(f"--val-fraction {args.val_fraction}: expected a fraction below 1")
    if args.workers < 1:
        raise SpecError(f"--workers {args.workers}: expected at least 1")
    files = [_corpus_file(c) for c in args.corpus]
    if args.train_vocab is None:
        return _tokenize(files, _tokenizer_json(Path(args.tokenizer)), args)
    target, partial, made = _train(files, Path(args.tokenizer), args)
    try:
        code = _tokenize(files, partial, args)
    except BaseException:  # no file left behind: the tokenizer goes with the token files
        partial.unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                target.parent.rmdir()
        raise
    os.replace(partial, target)
    return code


def _tokenize(files: list[Path], tok_json: Path, args: argparse.Namespace) -> int:
    """The corpus `files` into token files with the tokenizer at `tok_json` (the module's doc)."""
    out = Path(args.out)
    tokenizer = _load(tok_json)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    # torch's import, paid by this verb alone: the CLI's other verbs import none.
    from gpipe.data.tokens import dtype_for

    dtype = dtype_for(vocab)
    eos = None
    if args.eos is not None and (eos := tokenizer.token_to_id(args.eos)) is None:
        raise SpecError(f"--eos {args.eos!r}: the tokenizer has no such token")
    val = _val_name(out) if args.val_fraction else None
    made = not out.parent.exists()  # made here: gone again if the run fails
    parts = [_partial(p) for p in (out, val) if p is not None]
    try:
        n = _write(files, str(tok_json), eos, dtype, parts[0], args)
        if val is not None:
            k = round(n * args.val_fraction)
            if not 0 < k < n:
                raise SpecError(f"--val-fraction {args.val_fraction} of {n:,} tokens leaves train or val empty")
            _split(parts[0], parts[1], n - k, 2 if dtype == "uint16" else 4)
            os.replace(parts[1], val)
        os.replace(parts[0], out)
    except BaseException:
        for p in parts:
            p.unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                out.parent.rmdir()
        raise
    if val is None:
        print(f"{out}: {n:,} tokens, {dtype} (vocabulary {vocab:,})")
    else:
        print(f"{out}: {n - k:,} tokens, {val}: {k:,} tokens, {dtype} (vocabulary {vocab:,})")
    return 0


def _corpus_file(name: str) -> Path:
    p = Path(name)
    if p.suffix not in KINDS:
        raise SpecError(f"{name}: expected a {', '.join(KINDS)} file")
    if not p.exists():
        raise SpecError(f"{name}: no such corpus file")
    if p.is_dir():
        raise SpecError(f"{name}: a folder, not a corpus file")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise SpecError(f"{name}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    return p


MAX_TRAIN_VOCAB = 1 << 20  # --train-vocab's largest: past any language model's vocabulary (Llama 3: 128,256)


def _train(files: list[Path], folder: Path, args: argparse.Namespace) -> tuple[Path, Path, bool]:
    """--train-vocab N: a byte-level BPE tokenizer (GPT-2's kind: the 256 bytes, --eos as a special token, and
    merges up to N ids) trained on the corpus with the tokenizers package, nothing downloaded. Written to
    `folder`/tokenizer.json's partial name (renamed once the token files are written); returns (tokenizer.json,
    that partial file, whether `folder` was made here). SpecError, one line, for what cannot be done."""
    target = folder if folder.suffix == ".json" else folder / "tokenizer.json"
    specials = [args.eos] if args.eos is not None else []
    if not 256 + len(specials) <= args.train_vocab <= MAX_TRAIN_VOCAB:
        raise SpecError(f"--train-vocab {args.train_vocab}: expected {256 + len(specials)} (the 256 bytes"
                        f"{' and --eos' if specials else ''}) to {MAX_TRAIN_VOCAB:,} ids")
    if target.exists():
        raise SpecError(f"--tokenizer {folder}: {target} exists; --train-vocab writes a new one (remove it, or "
                        "leave out --train-vocab to tokenize with it)")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise SpecError("tokenize needs the tokenizers package: pip install 'gpipe[data]'") from None
    made = not target.parent.exists()
    partial = _partial(target, "--tokenizer")
    try:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=args.train_vocab, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      # (its bars: on a terminal only; elsewhere it writes empty lines)
                                      show_progress=not args.no_progress and sys.stderr.isatty())
        texts = (text for path in files for text, _ in _documents(path, args.text_field))
        tok.train_from_iterator(texts, trainer)
        tok.save(str(partial))
    except BaseException as e:
        partial.unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                target.parent.rmdir()
        if isinstance(e, OSError):
            raise SpecError(f"--tokenizer: {describe_os_error(e)}") from None
        raise
    vocab = tok.get_vocab_size(with_added_tokens=True)
    fewer = f" (of {args.train_vocab:,} asked: the corpus has no more pairs to merge)" if vocab < args.train_vocab \
        else ""
    print(f"{target}: a byte-level BPE tokenizer of {vocab:,} ids{fewer}, trained on {len(files)} corpus file(s)")
    return target, partial, made


def _tokenizer_json(folder: Path) -> Path:
    path = folder if folder.suffix == ".json" else folder / "tokenizer.json"
    if not path.is_file():
        why = "no such folder" if not folder.exists() else f"no {path.name} in it"
        raise SpecError(f"--tokenizer {folder}: {why}")
    return path


def _load(path: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SpecError("tokenize needs the tokenizers package: pip install 'gpipe[data]'") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise SpecError(f"--tokenizer {path}: not a tokenizer: {str(e).splitlines()[0]}") from None


def _val_name(out: Path) -> Path:
    name = out.name.replace("train", "val") if "train" in out.name else f"{out.stem}-val{out.suffix}"
    return out.with_name(name)


def _partial(path: Path, flag: str = "--out") -> Path:
    """The name `path` is written under until it is whole; SpecError naming `flag` when its folder cannot take
    it."""
    part = path.with_name(path.name + ".partial")
    try:
        part.parent.mkdir(parents=True, exist_ok=True)
        part.open("wb").close()
    except OSError as e:
        raise SpecError(f"{flag}: {describe_os_error(e)}") from None
    return part


def _write(files: list[Path], tok_json: str, eos: int | None, dtype: str, part: Path,
           args: argparse.Namespace) -> int:
    """Tokenize `files` into `part`, in corpus order; the number of tokens."""
    import numpy as np

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(unit=" tokens", unit_scale=True, file=sys.stderr, dynamic_ncols=True, desc="tokenize")
    n = 0
    pieces = _pieces(files, args.text_field)
    pool = None
    if args.workers > 1:
        pool = multiprocessing.get_context("spawn").Pool(args.workers, _start_worker, (tok_json, eos))
        encoded: Iterator[list[int]] = _in_pool(pool, pieces, 2 * args.workers)
    else:
        _start_worker(tok_json, eos, parallel=True)
        encoded = map(_encode, pieces)
    try:
        with part.open("wb") as f:
            for ids in encoded:
                np.asarray(ids, dtype="<u2" if dtype == "uint16" else "<u4").tofile(f)
                f.flush()  # what is written is on its way: the rename is the only step that may not be lost
                n += len(ids)
                if bar is not None:
                    bar.update(len(ids))
            os.fsync(f.fileno())
    except OSError as e:
        raise SpecError(f"--out: {describe_os_error(e)}") from None
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    return n


def _in_pool(pool: Any, pieces: Iterator[Piece], ahead: int) -> Iterator[list[int]]:
    """The pieces' ids in order, tokenized in `pool`, with at most `ahead` pieces read but not yet written (a
    corpus larger than memory stays on disk). A thread reads the corpus; what the pool has done is written
    while that thread waits on a file (a slow disk, a pipe)."""
    read: queue.Queue[Piece | BaseException | None] = queue.Queue(ahead)

    def reader() -> None:
        try:
            for piece in pieces:
                read.put(piece)
            read.put(None)
        except BaseException as e:  # SpecError at a bad line: raised where the ids are written
            read.put(e)

    threading.Thread(target=reader, name="tokenize-reader", daemon=True).start()
    pending: deque[Any] = deque()  # multiprocessing's AsyncResult, in corpus order
    while True:
        try:
            item = read.get(timeout=0.05)
        except queue.Empty:
            while pending and pending[0].ready():
                yield pending.popleft().get()
            continue
        if isinstance(item, BaseException):
            raise item
        if item is None:
            break
        pending.append(pool.apply_async(_encode, (item,)))
        while pending and (len(pending) >= ahead or pending[0].ready()):
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _split(train: Path, val: Path, at: int, itemsize: int) -> None:
    """Move the tokens of `train` from token `at` on to `val`."""
    with train.open("r+b") as src, val.open("wb") as dst:
        src.seek(at * itemsize)
        while block := src.read(1 << 24):
            dst.write(block)
        dst.flush()
        os.fsync(dst.fileno())
        src.truncate(at * itemsize)


def _pieces(files: list[Path], field: str) -> Iterator[Piece]:
    """The corpus in pieces of about PIECE_CHARS characters, in order; SpecError at an unreadable line."""
    piece: Piece = []
    size = 0
    for path in files:
        for text, ends in _documents(path, field):
            piece.append((text, ends))
            size += len(text)
            if size >= PIECE_CHARS:
                yield piece
                piece, size = [], 0
        if piece:  # a file's end ends a piece: its tokens are written before the next file is opened
            yield piece
            piece, size = [], 0


def _documents(path: Path, field: str) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) of one corpus file: a .txt's blocks of lines, a .jsonl's or .parquet's rows."""
    try:
        if path.suffix == ".txt":
            yield from _txt(path)
        elif path.suffix == ".jsonl":
            yield from _jsonl(path, field)
        else:
            yield from _parquet(path, field)
    except OSError as e:
        raise SpecError(describe_os_error(e, "reading")) from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _txt(path: Path) -> Iterator[tuple[str, bool]]:
    block: list[str] = []
    size = 0
    with path.open(encoding="utf-8", newline="") as f:
        for line in f:
            block.append(line)
            size += len(line)
            if size >= PIECE_CHARS:
                yield "".join(block), False
                block, size = [], 0
    yield "".join(block), True


def _jsonl(path: Path, field: str) -> Iterator[tuple[str, bool]]:
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise SpecError(f"{path}:{i}: not a JSON line") from None
            text = row.get(field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise SpecError(f"{path}:{i}: no text field {field!r} (--text-field names another)")
            yield text, True


def _parquet(path: Path, field: str) -> Iterator[tuple[str, bool]]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    if field not in f.schema_arrow.names:
        raise SpecError(f"{path}: no column {field!r} (--text-field names another)")
    for batch in f.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            yield text or "", True


_tokenizer: Any = None
_eos: int | None = None


def _start_worker(tok_json: str, eos: int | None, parallel: bool = False) -> None:
    """Load the tokenizer in this process. Several processes: each encodes on one thread."""
    global _tokenizer, _eos
    if not parallel:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _tokenizer, _eos = Tokenizer.from_file(tok_json), eos


def _encode(piece: Piece) -> list[int]:
    ids: list[int] = []
    for (_, ends), enc in zip(piece, _tokenizer.encode_batch([t for t, _ in piece], add_special_tokens=False),
                              strict=True):
        ids += enc.ids
        if ends and _eos is not None:
            ids.append(_eos)
    return ids
