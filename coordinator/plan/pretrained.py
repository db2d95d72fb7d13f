"""Pretrained weights (`model.weights`): a safetensors file, a folder holding model.safetensors, or a sharded
model.safetensors.index.json, as Hugging Face's save_pretrained and our own model.safetensors write them.

Only the files' headers are read here (each file is also opened once with safetensors' safe_open, which checks
its header against its size); a tensor's bytes are read when a stage is sent them, a piece at a time
(gpipe.coordinator.attempt.state_stream), so neither this process nor a stage holds more than its own tensors. Names are the
model's own: a captured model's (gpipe.capture.graph: what `model.safetensors` holds, an HF checkpoint's) or an
nn.Sequential's state_dict names. A tied weight (one parameter under several names) is read once, under
whichever of its names the file has (HF omits lm_head.weight), and fills every holder.

Anything that does not fit the model (a tensor missing, one more, a shape or dtype that differs) or a file
that cannot be read is a SpecError naming the file and the tensor: the job is refused before anything starts.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gpipe import stream
from gpipe.coordinator.outputs.checkpoint import Shard
from gpipe.errors import SpecError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # an index names every tensor once: far below this for any model
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
MAX_FILES = 4096


@dataclass
class Pretrained:
    """The tensors of a pretrained checkpoint: where each lies (file, name there), read as stages need them."""

    path: Path  # as given, for messages
    shards: list[Shard]  # one per file
    where: dict[str, tuple[int, str]]  # tensor name -> (file index, its name there)

    def meta(self, name: str) -> torch.Tensor:
        """Tensor `name` as a meta tensor: its shape and dtype."""
        k, src = self.where[name]
        dtype, shape, _, _ = self.shards[k].entries[src]
        return torch.empty(shape, dtype=dtype, device="meta")

    def file_of(self, name: str) -> str:
        return self.shards[self.where[name][0]].path.name


def open_weights(path: Path, field: str = "model.weights") -> Pretrained:
    """The checkpoint at `path`: a .safetensors file, or a folder with model.safetensors or the sharded index."""
    files: list[Path]
    if path.is_dir():
        if (path / INDEX).is_file():
            files = _index_files(path / INDEX, field)
        elif (path / SINGLE).is_file():
            files = [path / SINGLE]
        else:
            raise SpecError(f"{field}: {path} holds neither {SINGLE} nor {INDEX}")
    elif path.is_file():
        files = _index_files(path, field) if path.name.endswith(".json") else [path]
    else:
        raise SpecError(f"{field}: {path}: no such file or folder")
    shards = [_open_file(f, field) for f in files]
    where: dict[str, tuple[int, str]] = {}
    for k, sh in enumerate(shards):
        for name in sh.entries:
            if name in where:
                raise SpecError(f"{field}: {name} is in both {shards[where[name][0]].path.name} and {sh.path.name}")
            where[name] = (k, name)
    return Pretrained(path, shards, where)


def _index_files(index: Path, field: str) -> list[Path]:
    """The files a sharded index's weight_map names (in the index's folder), in order."""
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise SpecError(f"{field}: {index}: over {MAX_INDEX_BYTES >> 20} MiB, not an index")
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecError(f"{field}: {index}: not a safetensors index ({type(e).__name__}: {e})") from None
    if not names or len(names) > MAX_FILES or not all(isinstance(n, str) for n in names):
        raise SpecError(f"{field}: {index}: weight_map names no files (or more than {MAX_FILES})")
    for n in names:
        if Path(n).name != n or n in (".", ".."):
            raise SpecError(f"{field}: {index}: {n!r} is not a file name in the index's folder")
        if not (index.parent / n).is_file():
            raise SpecError(f"{field}: {index}: names {n}, which is not there")
    return [index.parent / n for n in names]


def _open_file(path: Path, field: str) -> Shard:
    """One safetensors file's header (its tensors' dtypes, shapes and byte ranges), checked by safe_open."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):  # checks the header against the file's size; reads no tensor
            pass
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {n} bytes")
            entries = stream.parse_header(f.read(n))
    except Exception as e:  # safetensors' own errors, OSError, a dtype we do not carry
        what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecError(f"{field}: {path}: not a readable safetensors file ({what[:200]})") from None
    return Shard(path, entries, 8 + n, {})


def match(weights: Pretrained, want: Mapping[str, torch.Tensor], aliases: Mapping[str, Sequence[str]] = {},
          field: str = "model.weights", ignore: Sequence[str] = ()) -> dict[str, tuple[int, str]]:
    """Where each of the model's tensors `want` (name -> tensor or meta tensor) is in `weights`; a tensor
    missing, one the model has no place for, or one of another shape or dtype is a SpecError naming it.
    `aliases`: other names (name -> them) the file may hold a tensor under (a tied weight's); `ignore`: regular
    expressions of names the file may hold that the model has no place for (re.search, as Hugging Face's)."""
    out: dict[str, tuple[int, str]] = {}
    used: set[str] = set()
    for name, t in want.items():
        have = next((n for n in [name, *aliases.get(name, ())] if n in weights.where), None)
        if have is None:
            raise SpecError(f"{field}: {weights.path} has no tensor {name} ({_describe(t)})")
        got = weights.meta(have)
        if got.shape != t.shape or got.dtype != t.dtype:
            raise SpecError(f"{field}: {weights.file_of(have)}: {have} is {_describe(got)}, the model's is "
                            f"{_describe(t)}")
        out[name] = weights.where[have]
        used.update([name, *aliases.get(name, ())])
    if extra := sorted(n for n in set(weights.where) - used if not any(re.search(p, n) for p in ignore)):
        raise SpecError(f"{field}: {weights.file_of(extra[0])}: {extra[0]} is not a tensor of the model"
                        + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return out


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
