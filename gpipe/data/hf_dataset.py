"""Local Hugging Face datasets: a text column, tokenized, as a language model's (input, target) windows.

`data: {factory: hf_dataset, args: {path: data/wiki, tokenizer: tok/, seq_len: 1024}}` (pip install
'gpipe[data]': the datasets and transformers packages). `path` is a folder that `save_to_disk` wrote (of
a DatasetDict, its `split`, default train), or local .parquet or .jsonl files: a file, a glob (its
matches in name order) or a list of them. The `column` (default text) is tokenized row by row in the
dataset's order with the tokenizer folder's AutoTokenizer, without its special tokens (`eos: true`
appends the tokenizer's eos id after each row), and the ids make one stream, cut into windows exactly as
token files are (gpipe.data.tokens: item i is tokens i*seq_len ... i*seq_len+seq_len, the input its first
seq_len, the target moved on by one). The order is the dataset's, fixed, so a job equals one device.

Nothing is fetched: the datasets library runs offline and the tokenizer is read with local_files_only.
A relative path is the job folder's (gpipe.factory.enter_job_folder: the factories run there).

Why a token file: the stream is tokenized once, written to a cache file, and read from then on as token
files are (gpipe.data.tokens.TokenWindows: a window at a time, nothing mapped, a copy sent to another
process carries the path). Tokenizing in datasets' own `map` cache instead would keep a table of
id lists per row, still to be concatenated and cut at every start, and would import datasets and
transformers (seconds) at every start too. The cache file is named by a hash of the source's and the
tokenizer's files (path, size, modification time), the split, the column and eos: a hit costs a few
stat calls and imports neither library, and a changed file (a dataset saved again, a new tokenizer) makes
another name. seq_len is not in it: every seq_len reads the same stream. The file is written under a
temporary name and renamed, so a build killed half-way leaves no file under the final name, and
processes that build at once each write the same bytes. The cache folder is `cache` (default
$XDG_CACHE_HOME/gpipe/hf_dataset, else ~/.cache/gpipe/hf_dataset); its files can be deleted at any time.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpipe.data.tokens import DTYPES, TokenWindows, check_seq_len, dtype_for, find_files

KINDS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}  # data files: datasets' loader of each
SAVED = ("state.json", "dataset_dict.json")  # what save_to_disk writes in a Dataset's / a DatasetDict's folder
ROWS = 1000  # rows tokenized at a time
VERSION = 1  # of the cache file's contents: a change of how the stream is made changes every name


@dataclass(frozen=True)
class Source:
    """Where the rows are: a save_to_disk folder, or data files of one kind (parquet or json)."""

    name: str  # the path as given, for messages
    folder: Path | None  # a save_to_disk folder
    files: list[Path]  # or data files
    kind: str  # "disk", "parquet" or "json"


def hf_dataset(path: str | list[str], tokenizer: str, seq_len: int, column: str = "text",
               split: str = "train", eos: bool = False, cache: str | None = None) -> TokenWindows:
    """The `column` of the local dataset at `path`, tokenized by the `tokenizer` folder, as windows of `seq_len`
    tokens (the module's doc); ValueError (FileNotFoundError for a missing path) in one line naming what is
    wrong."""
    check_seq_len(seq_len)
    if not isinstance(column, str) or not isinstance(split, str) or not isinstance(eos, bool):
        raise ValueError("column and split are names (strings), eos is true or false")
    source = _source(path, split)
    tok = _tokenizer_folder(tokenizer)
    folder = _cache_folder(cache)
    key = _key(source, tok, split, column, eos, folder)
    file = next((f for d in DTYPES if (f := folder / f"{key}.{d}.bin").is_file()), None)
    if file is None:
        file = _build(source, tok, split, column, eos, folder, key)
    data = TokenWindows([file], seq_len, file.suffixes[-2][1:])
    if data.tokens < seq_len + 1:
        raise ValueError(f"seq_len {seq_len} is longer than the data: a window takes {seq_len + 1} tokens, "
                         f"{source.name}'s column {column!r} makes {data.tokens}")
    return data


def _source(path: str | list[str], split: str) -> Source:
    if isinstance(path, str) and not glob.has_magic(path):
        p = Path(path).expanduser().absolute()
        if p.is_dir():
            if not any((p / s).is_file() for s in SAVED):
                raise FileNotFoundError(f"{path}: not a folder that save_to_disk wrote (no {' or '.join(SAVED)} "
                                        f"in it): give its .parquet or .jsonl files instead, e.g. {path}/*.parquet")
            return Source(path, p, [], "disk")
        if not p.exists():
            raise FileNotFoundError(f"{path}: no such dataset folder or file ({p})")
    files = find_files(path)
    kinds = {KINDS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) > 1:
        raise ValueError(f"path {path!r}: expected a save_to_disk folder, or .parquet files, or .jsonl files "
                         f"(one kind), not {', '.join(sorted({f.suffix or f.name for f in files}))}")
    if split != "train":
        raise ValueError(f"split {split!r}: data files are one split (train); a split names one of a "
                         f"DatasetDict's save_to_disk folder")
    return Source(str(path), None, files, kinds.pop() or "")


def _tokenizer_folder(tokenizer: str) -> Path:
    if not isinstance(tokenizer, str):
        raise ValueError(f"tokenizer {tokenizer!r}: expected a folder (what save_pretrained writes)")
    p = Path(tokenizer).expanduser().absolute()
    if not p.is_dir():
        why = "a file, not a folder (what save_pretrained writes)" if p.exists() else "no such folder"
        raise FileNotFoundError(f"tokenizer {tokenizer}: {why} ({p})")
    return p


def _cache_folder(cache: str | None) -> Path:
    if cache is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        return Path(base).expanduser().absolute() / "gpipe" / "hf_dataset"
    if not isinstance(cache, str):
        raise ValueError(f"cache {cache!r}: expected a folder")
    return Path(cache).expanduser().absolute()


def _stats(files: list[Path]) -> list[tuple[str, int, int]]:
    return [(str(f), (s := f.stat()).st_size, s.st_mtime_ns) for f in files]


def _key(source: Source, tok: Path, split: str, column: str, eos: bool, cache: Path) -> str:
    """The cache file's name: a hash of what makes the stream (the module's doc); a cache folder inside the
    dataset's is not the dataset's."""
    files = source.files if source.folder is None else sorted(
        f for f in source.folder.rglob("*") if f.is_file() and cache not in f.parents)
    what = {"version": VERSION, "kind": source.kind, "files": _stats(files), "split": split, "column": column,
            "eos": eos, "tokenizer": _stats(sorted(f for f in tok.iterdir() if f.is_file()))}
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]


def _build(source: Source, tok: Path, split: str, column: str, eos: bool, folder: Path, key: str) -> Path:
    """Tokenize the source's column into the cache file `key` (written under a temporary name, then renamed)."""
    partial = folder / f"{key}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial"  # this process's own
    try:
        folder.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"{key}.", suffix=".datasets", dir=folder))
    except OSError as e:
        raise ValueError(f"cache {folder}: cannot write there ({e.strerror or e})") from None
    try:
        rows = _rows(source, split, column, scratch)
        tokenizer = _tokenizer(tok)
        eos_id = tokenizer.eos_token_id if eos else None
        if eos and eos_id is None:
            raise ValueError(f"eos: the tokenizer {tok} has no eos token")
        dtype = dtype_for(len(tokenizer))
        with open(partial, "xb") as out:
            for start in range(0, len(rows), ROWS):
                texts = rows[start : start + ROWS][column]
                for k, t in enumerate(texts):
                    if not isinstance(t, str):
                        raise ValueError(f"{source.name}: row {start + k} of column {column!r} is "
                                         f"{type(t).__name__}, not text")
                batch = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
                if eos:
                    batch = [[*ids, eos_id] for ids in batch]
                np.fromiter(itertools.chain.from_iterable(batch), dtype=DTYPES[dtype]).tofile(out)
        file = folder / f"{key}.{dtype}.bin"
        os.replace(partial, file)
        return file
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(scratch, ignore_errors=True)


def _libraries() -> tuple[Any, Any]:
    """datasets and transformers, offline: nothing here may reach the network."""
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        import datasets
        import transformers
    except ImportError as e:
        raise ValueError(f"hf_dataset needs the {e.name or 'datasets'} package: pip install 'gpipe[data]'") from None
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True  # if imported before
    datasets.disable_progress_bars()
    return datasets, transformers


def _rows(source: Source, split: str, column: str, scratch: Path) -> Any:
    """The source's rows as a datasets.Dataset with `column` among its columns, read from local files only
    (the data files' Arrow copy in `scratch`)."""
    datasets, _ = _libraries()
    try:
        if source.folder is not None:
            rows = datasets.load_from_disk(str(source.folder))
        else:
            rows = datasets.load_dataset(source.kind, data_files=[str(f) for f in source.files], split="train",
                                         cache_dir=str(scratch))
    except Exception as e:
        raise ValueError(f"{source.name}: datasets cannot read it: {_one_line(e)}") from None
    if isinstance(rows, datasets.DatasetDict):
        if split not in rows:
            raise ValueError(f"split {split!r} is not in {source.name} (its splits: {', '.join(rows)})")
        rows = rows[split]
    if column not in rows.column_names:
        raise ValueError(f"column {column!r} is not in {source.name} (its columns: {', '.join(rows.column_names)})")
    feature = rows.features[column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ValueError(f"column {column!r} of {source.name} holds {getattr(feature, 'dtype', feature)}, not text")
    return rows.select_columns([column])  # the other columns are never read


def _tokenizer(folder: Path) -> Any:
    _, transformers = _libraries()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise ValueError(f"tokenizer {folder}: transformers cannot load a tokenizer from it: "
                         f"{_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    """A library's error, its lines joined into one (at most 300 characters)."""
    said = " ".join(str(e).split())
    return f"{type(e).__name__}: {said if len(said) <= 300 else said[:297] + '...'}"
