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

The files are memory-mapped, never read whole: an item reads its window's pages, so a set larger than
memory costs only what the steps touch. They are mapped a segment (2 or 4 MiB) at a time, the last 16
segments read kept mapped: whatever the files' size, the data set takes at most 64 MiB of address space
(`validate --memory-mib` and serve's validation cap count it), and reading in order maps each segment
once. A copy of the set sent to another process carries the paths, not the tokens.
"""

from __future__ import annotations

import glob
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SEGMENT = 1 << 20  # tokens a mapping holds: 2 or 4 MiB of a file
MAPPED = 16  # segments kept mapped, the last read: at most 64 MiB of address space
UINT16_VOCAB = 65535  # vocabularies up to this size are written as uint16


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The (input, target) windows of seq_len tokens of one stream of token files (the module's doc)."""

    def __init__(self, files: list[Path], seq_len: int, dtype: str):
        self.files, self.seq_len, self.dtype = files, seq_len, DTYPES[dtype]
        self.sizes = [f.stat().st_size // self.dtype.itemsize for f in files]  # tokens per file
        self.starts = np.cumsum([0, *self.sizes])  # token offset of each file in the stream
        self.tokens = int(self.starts[-1])
        self.n = max(0, (self.tokens - 1) // seq_len)
        self._maps: OrderedDict[tuple[int, int], np.memmap[Any, Any]] | None = None

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
        """Tokens start ... start+count-1 of the stream, as int64, across file and segment boundaries."""
        out = np.empty(count, dtype=np.int64)
        f = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < count:
            at = start + done - int(self.starts[f])  # in file f
            if at >= self.sizes[f]:  # past its end (an empty file holds none)
                f += 1
                continue
            segment = self._segment(f, at // SEGMENT)
            at %= SEGMENT
            take = min(count - done, len(segment) - at)
            out[done : done + take] = segment[at : at + take]
            done += take
        return out

    def _segment(self, f: int, k: int) -> np.memmap[Any, Any]:
        """Segment k of file f (tokens k*SEGMENT ... on), mapped: the last MAPPED segments read stay mapped."""
        if self._maps is None:
            self._maps = OrderedDict()
        if (m := self._maps.get((f, k))) is not None:
            self._maps.move_to_end((f, k))
            return m
        n = min(SEGMENT, self.sizes[f] - k * SEGMENT)
        m = self._maps[f, k] = np.memmap(self.files[f], dtype=self.dtype, mode="r",
                                         offset=k * SEGMENT * self.dtype.itemsize, shape=(n,))
        if len(self._maps) > MAPPED:
            self._maps.popitem(last=False)  # unmapped once no window holds it
        return m

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}  # the paths travel, not the mapped tokens


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
