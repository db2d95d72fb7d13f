"""Weights back into a model (`gpipe.load_weights`): a job's model.safetensors, any safetensors file, or one of
our checkpoints, read by the model's own names, each tied weight from its one stored copy.

    gpipe.load_weights(model, "gpipe-state/<job>")                        # its model.safetensors
    gpipe.load_weights(model, "gpipe-state/<job>/best")                   # keep_best's
    gpipe.load_weights(model, "path/to/weights.safetensors")
    gpipe.load_weights(model, "gpipe-state/<job>/checkpoints")            # the newest checkpoint
    gpipe.load_weights(model, "gpipe-state/<job>/checkpoints/step-40")    # that checkpoint's weights

A job's files hold a tied weight once (nanoGPT's `lm_head.weight` is `transformer.wte.weight`; GPT-2's
too), as Hugging Face's save_pretrained does, so `model.load_state_dict(load_file(path))` misses the other
names. Here the ties are the model's own: the names under which its state dict holds one tensor object
(named_parameters(remove_duplicate=False) and its buffers'); any one of them in the file fills the tensor.

Every name, shape and dtype is checked before anything is read or changed; a file that does not fit is
refused with one line (ValueError) naming the tensor. Nothing is unpickled, and no library beyond torch is
needed: the files are read as the safetensors layout (gpipe.stream), header and bytes, a tensor at a time,
copied into the model's own tensors (its device, its dtype). A checkpoint's files are checked against its
manifest (sizes and sha256) first, so a damaged one is refused, not loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from gpipe import state as layout
from gpipe import stream

MODEL_FILE = "model.safetensors"  # in a job's output folder (and best/)
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit

M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class Stored:
    """One tensor of a weights file: where its bytes are, and what they are."""

    file: Path
    data_start: int  # the data region's offset in the file
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # its bytes' range in the data region
    end: int

    def read(self) -> torch.Tensor:
        """The tensor, read from disk into a fresh CPU tensor."""
        out = torch.empty(self.shape, dtype=self.dtype)
        if self.end > self.start:
            with open(self.file, "rb", buffering=0) as f:
                f.seek(self.data_start + self.start)
                view = stream.numpy_bytes(out)
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise ValueError(f"{self.file}: cut short (a tensor's bytes run past its end)")
                    got += n
        return out


def load_weights(model: M, path: str | os.PathLike[str]) -> M:
    """Load the weights at `path` into `model`, in place, and return it.

    `path`: a job's output folder (or its best/: the model.safetensors in it), a safetensors file, a job's
    checkpoints/ folder (its newest committed checkpoint) or one step-<N> checkpoint of it. Every parameter and
    persistent buffer of `model` is set; a tied weight (one tensor under several names) from whichever of its
    names the file holds. ValueError, one line naming the tensor, for a file that does not fit the model: a
    tensor missing, one the model has no place for, another shape or dtype; FileNotFoundError for no such path.
    """
    where, stored = _open(Path(path))
    groups = _tensors(model)
    plan: list[tuple[torch.Tensor, str, list[str]]] = []  # (the model's tensor, the name read, its other names)
    known: set[str] = set()
    for names, t in groups:
        known.update(names)
        held = [n for n in names if n in stored]
        if not held:
            also = f" (nor under its tied name{'s' if len(names) > 2 else ''} {', '.join(names[1:])})" \
                if len(names) > 1 else ""
            raise ValueError(f"{where} does not fit the model: it has no {names[0]}{also} "
                             f"({_kind(t.dtype, t.shape)}){_renamed(model, stored)}")
        for n in held:
            s = stored[n]
            if s.dtype != t.dtype or s.shape != tuple(t.shape):
                raise ValueError(f"{where} does not fit the model: it has {_kind(s.dtype, s.shape)} for {n}, "
                                 f"the model's is {_kind(t.dtype, t.shape)}")
        plan.append((t, held[0], held[1:]))
    extra = sorted(set(stored) - known)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(f"{where} does not fit the model: it has {extra[0]}{more}, which the model has no tensor for")
    if any(t.is_meta for t, _, _ in plan):
        name = next(n for t, n, _ in plan if t.is_meta)
        raise ValueError(f"the model's {name} is on the meta device, which holds no values: "
                         f"give it storage first (model.to_empty(device=...))")
    # Everything fits: read each tensor once, and copy it into the model's own (its device and dtype).
    with torch.no_grad():
        for t, name, others in plan:
            value = stored[name].read()
            for other in others:  # a file holding a tie twice: the copies must agree
                if not torch.equal(stored[other].read(), value):
                    raise ValueError(f"{where}: {name} and {other} are one tensor in the model, and the file "
                                     f"holds two different values for them")
            t.copy_(value)
    return model


def _tensors(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The model's own tensors, its parameters and persistent buffers, as (its names, the tensor), one entry per
    tensor object: a tied weight's several names in one entry, in the state dict's order (the first: the name
    our files store it under, as the job's captured pieces name it).

    Read from the module tree, not from state_dict(): a state dict hook may rename a tensor and hand back a copy
    (torchtitan's FusedQKVLinear saves its `wqkv` as fresh `wq`, `wk`, `wv` tensors), and copying a file's
    values into such a copy would change nothing in the model."""
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        if type(m).get_extra_state is not nn.Module.get_extra_state:  # no file of ours holds extra state
            where = f"{prefix}." if prefix else ""
            raise ValueError(f"the model's state dict holds {where}_extra_state ({type(m).__name__}), which is no "
                             f"tensor: load_weights sets tensors only (use load_state_dict)")
        own = [*m._parameters.items(),
               *((n, b) for n, b in m._buffers.items() if n not in m._non_persistent_buffers_set)]
        for n, t in own:
            if t is not None:
                by_id.setdefault(id(t), ([], t))[0].append(f"{prefix}.{n}" if prefix else n)
    return list(by_id.values())


def _renamed(model: nn.Module, stored: dict[str, Stored]) -> str:
    """" (its state_dict() renames them ...)" when the file holds the names the model's state dict hooks give
    (a file saved with model.state_dict(), and load_state_dict's hooks would take it), else ""."""
    try:
        keys = set(model.state_dict().keys())
    except Exception:  # a hook that fails outside its trainer: no advice
        return ""
    own = {n for names, _ in _tensors(model) for n in names}
    if keys != own and keys <= set(stored):
        return " (the file holds the names the model's state_dict() gives through its hooks: load it with " \
               "model.load_state_dict)"
    return ""


def _kind(dtype: torch.dtype, shape: Any) -> str:
    return f"{stream.DTYPES.get(dtype, str(dtype).removeprefix('torch.'))} {list(shape)}"


# -- what `path` is -------------------------------------------------------------------------------


def _open(path: Path) -> tuple[str, dict[str, Stored]]:
    """(How messages name `path`, its tensors by name) for any path load_weights takes."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.is_file():
        return str(path), _read_header(path)
    if (path / layout.MANIFEST).is_file():
        return _checkpoint(path)
    if (path / MODEL_FILE).is_file():
        return str(path / MODEL_FILE), _read_header(path / MODEL_FILE)
    newest = _newest(path)
    if newest is not None:
        return _checkpoint(newest)
    inner = _newest(path / layout.CHECKPOINTS)
    if inner is not None:  # an output folder with checkpoints and no model.safetensors: a job not finished
        raise ValueError(f"{path}: no {MODEL_FILE} (the job has not finished?); its newest checkpoint is "
                         f"{inner}: load that")
    raise ValueError(f"{path}: no {MODEL_FILE}, and no checkpoint of ours (a step-<N> folder with "
                     f"{layout.MANIFEST})")


def _newest(folder: Path) -> Path | None:
    """The newest committed checkpoint (step-<N> with its manifest) in a checkpoints folder; None if none."""
    if not folder.is_dir():
        return None
    steps = [(int(m[1]), d) for d in folder.iterdir() if (m := layout.STEP_RE.match(d.name))
             and (d / layout.MANIFEST).is_file()]
    return max(steps)[1] if steps else None


def _checkpoint(d: Path) -> tuple[str, dict[str, Stored]]:
    """The weights of checkpoint `d` (model/<name> in each stage's file), its files checked against its manifest."""
    where = f"checkpoint {d}"
    try:
        manifest = json.loads((d / layout.MANIFEST).read_text())
        stages, files = manifest["stages"], manifest["files"]
        if manifest.get("format") != layout.CHECKPOINT_FORMAT or not isinstance(stages, int) or stages < 1 \
                or not isinstance(files, dict):
            raise ValueError(f"unknown format {manifest.get('format')!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: {layout.MANIFEST} is not a manifest of ours ({e})") from None
    out: dict[str, Stored] = {}
    for k in range(stages):
        name = layout.shard_files(k)[0]
        _check_file(d / name, files.get(name), where)
        for key, s in _read_header(d / name).items():
            if key.startswith(layout.MODEL):
                weight = key.removeprefix(layout.MODEL)
                if weight in out:
                    raise ValueError(f"{where}: {weight} is held by two stages' files")
                out[weight] = s
    return where, out


def _check_file(path: Path, want: Any, where: str) -> None:
    """ValueError unless `path` has the size and sha256 its manifest entry `want` lists."""
    if not isinstance(want, dict) or not path.is_file():
        raise ValueError(f"{where}: {path.name} is missing")
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    if size != want.get("bytes") or h.hexdigest() != want.get("sha256"):
        raise ValueError(f"{where}: {path.name} does not match the manifest (the file is damaged or cut short)")


def _read_header(path: Path) -> dict[str, Stored]:
    """A safetensors file's tensors (their places and kinds), its header checked against the file's size."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: not a safetensors file ({why})")

    size = path.stat().st_size
    with open(path, "rb") as f:
        first = f.read(8)
        if len(first) < 8:
            raise bad("shorter than a header")
        (n,) = struct.unpack("<Q", first)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise bad(f"a header of {n} bytes")
        raw = f.read(n)
    try:  # the reader every safetensors header of ours goes through (gpipe.stream)
        entries = stream.parse_header(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"its header is not one gpipe reads: {e}") from None
    except (KeyError, TypeError, AttributeError):
        raise bad("its header's entries are not a dtype gpipe reads, a shape and offsets") from None
    data = size - 8 - n
    out: dict[str, Stored] = {}
    for name, (dtype, dims, start, end) in entries.items():
        try:
            shape = tuple(int(d) for d in dims)
        except (TypeError, ValueError):
            raise bad(f"{name}: its shape {dims!r} is not a list of sizes") from None
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or not 0 <= start <= end <= data \
                or end - start != numel * torch.empty(0, dtype=dtype).element_size():
            raise bad(f"{name}: {_kind(dtype, shape)} at bytes {start}..{end} of {data}")
        out[name] = Stored(path, 8 + n, dtype, shape, start, end)
    return out
