"""Token files: a flat file of token ids read as a language model's (input, target) windows.

`data: {factory: tokens, args: {path: train.bin, seq_len: 1024, dtype: uint16}}`. A token file is the
token ids one after another, uint16 or uint32 in little-endian byte order, no header (what
`gpipe-coordinator tokenize` writes, and nanoGPT's prepare scripts). Item i is the window of seq_len + 1
tokens that starts at token i * seq_len: its first seq_len tokens are the input, the same window moved
on by one token the target (both int64). N tokens make (N - 1) // seq_len items; a last partial window
is left out.

`path` is a file, a glob (its matches in name order) or a list of either: the files are read as one
stream of tokens, in that order, so a window may begin in one file and end in the next. A relative
path is the job folder's (gpipe.factory.enter_job_folder: the factories run there).

The files are read with os.pread, never mapped nor read whole: an item reads its window's bytes (one
call, or one per file it spans) into a buffer of its own, so a set larger than memory costs only what
the steps touch, and no page of the files is resident in the process: the kernel's page cache holds
them, shared and given back under memory pressure. Mapped windows would cost the process their pages,
and more: a read of one window of a mapping can make megabytes around it resident, so mappings kept for
reuse cost megabytes each. The last 16 files read are kept open, so reading in order opens each file
once and a glob of thousands of shards holds 16 descriptors. Nothing is mapped: `validate --memory-mib`
and serve's validation cap, which count mapped files, count none of the set whatever the files' size.
A copy of the set sent to another process carries the paths, not the tokens nor the open files.

`out_of_vocabulary` and `vocabulary` check a batch's ids against the model's token embedding
(gpipe.coordinator.plan.job does, on the first batch): a wrong dtype or too small a vocabulary is then one line
naming the id, not the embedding's IndexError on the first step.
"""

from __future__ import annotations

import glob
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
OPEN = 16  # files kept open, the last read
UINT16_VOCAB = 65535  # vocabularies up to this size are written as uint16


class _File:
    """A file open for reading: its descriptor, closed when the last reference to it goes."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDONLY)  # not inherited by a program the process starts

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:  # bound now: `os` may be gone at exit
        if hasattr(self, "fd"):  # the open succeeded
            _close(self.fd)


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The (input, target) windows of seq_len tokens of one stream of token files (the module's doc)."""

    def __init__(self, files: list[Path], seq_len: int, dtype: str):
        self.files, self.seq_len, self.dtype, self.dtype_name = files, seq_len, DTYPES[dtype], dtype
        self.sizes = [f.stat().st_size // self.dtype.itemsize for f in files]  # tokens per file
        self.starts = np.cumsum([0, *self.sizes])  # token offset of each file in the stream
        self.tokens = int(self.starts[-1])
        self.n = max(0, (self.tokens - 1) // seq_len)
        self._files: OrderedDict[int, _File] | None = None  # opened by the process that reads

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(f"item {i} of {self.n} windows")
        window = torch.from_numpy(self.read(i * self.seq_len, self.seq_len + 1))
        return window[:-1], window[1:]

    def read(self, start: int, count: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Tokens start ... start+count-1 of the stream, as int64, across file boundaries."""
        out = np.empty(count, dtype=np.int64)
        f = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < count:
            at = start + done - int(self.starts[f])  # in file f
            if at >= self.sizes[f]:  # past its end (an empty file holds none)
                f += 1
                continue
            take = min(count - done, self.sizes[f] - at)
            out[done : done + take] = self._pread(f, at, take)
            done += take
        return out

    def _pread(self, f: int, at: int, count: int) -> np.ndarray[Any, Any]:
        """Tokens at ... at+count-1 of file f, in its dtype; OSError where the file is shorter than it was."""
        size = self.dtype.itemsize
        file, want = self._open(f), count * size  # held: a read under way keeps its file open
        data = os.pread(file.fd, want, at * size)
        while len(data) < want:  # short only at a file's end: this one was cut short since the set was made
            more = os.pread(file.fd, want - len(data), at * size + len(data))
            if not more:
                raise OSError(f"{self.files[f]}: ends before token {at + count} (cut short since the job started)")
            data += more
        return np.frombuffer(data, dtype=self.dtype)

    def _open(self, f: int) -> _File:
        """File f, open: the last OPEN files read stay open."""
        if self._files is None:
            self._files = OrderedDict()
        if (file := self._files.get(f)) is not None:
            self._files.move_to_end(f)
            return file
        file = self._files[f] = _File(self.files[f])
        if len(self._files) > OPEN:
            self._files.popitem(last=False)  # closed once no read holds it
        return file

    def out_of_vocabulary(self, items: Iterable[int], vocab: int) -> str | None:
        """The first token id of windows `items` (their inputs and targets) that is not below `vocab`, said in
        words: the id, where it is (its token's number in its file) and the dtype the files were read as; None
        where every id is below `vocab`."""
        for i in items:
            window = self.read(i * self.seq_len, self.seq_len + 1)
            bad = np.flatnonzero(window >= vocab)
            if bad.size:
                at = i * self.seq_len + int(bad[0])  # in the stream
                f = int(np.searchsorted(self.starts, at, side="right")) - 1
                return (f"token id {int(window[bad[0]])} (token {at - int(self.starts[f])} of {self.files[f]}, "
                        f"read as {self.dtype_name}) is outside the model's vocabulary of {vocab} ids")
        return None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": None}  # the paths travel, not the tokens nor the open files


def tokens(path: str | list[str], seq_len: int, dtype: str = "uint16") -> TokenWindows:
    """The token files at `path` (a file, a glob or a list of them) as windows of `seq_len` tokens; ValueError
    (FileNotFoundError for a missing file) in one line naming what is wrong."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not a token file's: expected {' or '.join(DTYPES)}")
    check_seq_len(seq_len)
    files = find_files(path)
    size = DTYPES[dtype].itemsize
    for f in files:
        if (b := f.stat().st_size) % size:
            raise ValueError(f"{f}: {b} bytes is not a whole number of {dtype} tokens ({size} bytes each): "
                             f"wrong dtype for the file's size")
    data = TokenWindows(files, seq_len, dtype)
    if data.tokens < seq_len + 1:
        where = files[0] if len(files) == 1 else f"the {len(files)} files"
        raise ValueError(f"seq_len {seq_len} is longer than the data: a window takes {seq_len + 1} tokens, "
                         f"{where} holds {data.tokens}")
    return data


def vocabulary(model: nn.Module) -> tuple[int, str] | None:
    """The ids the model's token embedding takes, and which embedding that is: a Hugging Face model's
    get_input_embeddings(), else the largest nn.Embedding in it (of several, a token's id below the largest
    may still be out of range of the token embedding, never the other way: no good id is refused); None where
    the model holds no nn.Embedding (its vocabulary cannot be told)."""
    names = {id(m): name for name, m in model.named_modules()}
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            found = get()
        except Exception:  # (a model whose method is not implemented)
            found = None
        if isinstance(found, nn.Embedding) and id(found) in names:
            return found.num_embeddings, f"{names[id(found)]}: {found}"
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return None
    largest = max(embeddings, key=lambda m: m.num_embeddings)
    return largest.num_embeddings, f"{names[id(largest)] or 'the model'}: {largest}"


def check_seq_len(seq_len: object) -> None:
    """ValueError unless `seq_len` is a whole number of tokens, at least 1."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len {seq_len!r} must be a whole number of tokens, at least 1")


def dtype_for(vocab: int) -> str:
    """The token files' dtype of a vocabulary of `vocab` ids: uint16 where they fit, else uint32."""
    return "uint16" if vocab <= UINT16_VOCAB else "uint32"


def find_files(path: str | list[str]) -> list[Path]:
    """The files `path` names, absolute: each entry a file or a glob (its matches in name order)."""
    entries = [path] if isinstance(path, str) else path
    if not isinstance(entries, list) or not entries or not all(isinstance(e, str) for e in entries):
        raise ValueError(f"path {path!r}: expected a file, a glob, or a list of them")
    files: list[Path] = []
    for e in entries:
        if glob.has_magic(e):
            found = sorted(p for p in glob.glob(os.path.expanduser(e)) if os.path.isfile(p))
            if not found:
                raise FileNotFoundError(f"no files match {e!r} (in {os.getcwd()})")
            files += [Path(p).absolute() for p in found]
            continue
        p = Path(e).expanduser().absolute()
        if not p.is_file():
            what = "is a folder, not a token file" if p.is_dir() else "no such file"
            raise FileNotFoundError(f"{e}: {what} ({p})" if str(p) != e else f"{e}: {what}")
        files.append(p)
    return files
