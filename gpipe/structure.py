"""What a layer may pass to the next: a tensor, or tuples, lists and dicts of them, and plain scalars.

A structure is walked in one fixed order (tuple and list items in order, dict
items in insertion order), so its tensors, the "leaves", can be named by their
position: the wire format (gpipe.worker.dataplane.channel) sends a JSON skeleton and then
the leaves' data, and a gradient message lists the gradients of the leaves that
want one, in that order. Only exact tuple, list and dict containers are taken
(a namedtuple or an OrderedDict would come out as something else); anything
else is refused with its path, `[1]['mask']`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

MAX_DEPTH = 16  # containers nested in one another
MAX_VALUES = 1024  # containers, tensors and scalars in one structure
SCALARS = (bool, int, float, str, type(None))
TENSOR_TAG = "T"  # a tensor's place in a skeleton: {"T": 0}
KINDS: dict[type, str] = {tuple: "t", list: "l", dict: "d"}


class StructureError(ValueError):
    """A value that cannot cross a cut, or a structure past the bounds; the message names its path."""


def _path(path: str) -> str:
    return path or "the value"


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """(skeleton, tensors): the skeleton is JSON-able, with {"T": 0} where each tensor was."""
    tensors: list[torch.Tensor] = []
    count = 0

    def walk(x: Any, path: str, depth: int) -> Any:
        nonlocal count
        count += 1
        if count > MAX_VALUES:
            raise StructureError(f"more than {MAX_VALUES} values in one structure")
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return {TENSOR_TAG: 0}
        if type(x) in SCALARS:
            return x
        kind = KINDS.get(type(x))
        if kind is None:
            raise StructureError(f"{_path(path)}: a {type(x).__name__} cannot cross a cut (a tensor, tuple, "
                                 "list or dict of them, None, bool, int, float or str can)")
        if depth >= MAX_DEPTH:
            raise StructureError(f"{_path(path)}: nested more than {MAX_DEPTH} deep")
        if kind == "d":
            items = []
            for k, v in x.items():
                if type(k) not in (str, int):
                    raise StructureError(f"{_path(path)}: a dict key must be a str or an int, got {type(k).__name__}")
                items.append([k, walk(v, f"{path}[{k!r}]", depth + 1)])
            return {kind: items}
        return {kind: [walk(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x)]}

    return walk(obj, "", 0), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The structure of `flatten`, with `tensors` in the tensors' places, in order."""
    it = iter(tensors)

    def build(s: Any) -> Any:
        if not isinstance(s, dict):
            return s
        (kind, v), = s.items()
        if kind == TENSOR_TAG:
            return next(it)
        if kind == "d":
            return {k: build(x) for k, x in v}
        items = [build(x) for x in v]
        return tuple(items) if kind == "t" else items

    return build(skeleton)


def check_skeleton(skeleton: object) -> int:
    """The number of tensors in a skeleton that came from elsewhere; ValueError if it is not one."""
    count = tensors = 0

    def walk(s: object, depth: int) -> None:
        nonlocal count, tensors
        count += 1
        if count > MAX_VALUES or depth > MAX_DEPTH:
            raise ValueError("a structure past the bounds")
        if type(s) in SCALARS:
            return
        if not (isinstance(s, dict) and len(s) == 1):
            raise ValueError(f"not a skeleton: {type(s).__name__}")
        (kind, v), = s.items()
        if kind == TENSOR_TAG:
            tensors += 1
        elif kind in ("t", "l") and isinstance(v, list):
            for x in v:
                walk(x, depth + 1)
        elif kind == "d" and isinstance(v, list):
            for pair in v:
                if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int)):
                    raise ValueError("not a skeleton: a bad dict item")
                walk(pair[1], depth + 1)
        else:
            raise ValueError(f"not a skeleton: tag {kind!r}")

    walk(skeleton, 0)
    return tensors


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a structure, in the fixed order."""
    if isinstance(obj, torch.Tensor):  # the common case, without the generator
        return [obj]
    return list(_tensors(obj))


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif type(obj) in (tuple, list):
        for x in obj:
            yield from _tensors(x)
    elif type(obj) is dict:
        for x in obj.values():
            yield from _tensors(x)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """The structure with fn(t) for each tensor t; everything else as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) in (tuple, list):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if type(obj) is dict:
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def to(obj: Any, device: torch.device) -> Any:
    """The structure with its tensors on `device`."""
    if isinstance(obj, torch.Tensor):  # (.to would return it as it is, through the dispatcher's argument parsing)
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    return map_tensors(obj, lambda t: t if t.device == device else t.to(device, non_blocking=True))


def describe(obj: Any, limit: int = 200) -> str:
    """A short description for an error message: `tuple(Tensor[4,16] float32, Tensor[4] bool)`."""

    def d(x: Any, depth: int) -> str:
        if isinstance(x, torch.Tensor):
            return f"Tensor[{','.join(map(str, x.shape))}] {str(x.dtype).removeprefix('torch.')}"
        if depth > 3:
            return "..."
        if type(x) in (tuple, list):
            inner = ", ".join(d(v, depth + 1) for v in x[:8]) + (", ..." if len(x) > 8 else "")
            return f"{type(x).__name__}({inner})"
        if type(x) is dict:
            items = list(x.items())
            inner = ", ".join(f"{k!r}: {d(v, depth + 1)}" for k, v in items[:8]) + (", ..." if len(items) > 8 else "")
            return f"dict({inner})"
        if x is None or type(x) in (bool, int, float):
            return repr(x)
        if isinstance(x, str):
            return repr(x) if len(x) <= 20 else repr(x[:16]) + "..."
        return type(x).__name__

    text = d(obj, 0)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def split(obj: Any, chunks: int, batch: int, what: str = "input", sizes: list[int] | None = None) -> list[Any]:
    """The batch `obj` cut into `chunks` micro-batches along dim 0 of every tensor (torch.tensor_split; with
    `sizes`, of those sizes, which must number `chunks` and sum to `batch`).

    Every tensor's dim 0 must be `batch`, else StructureError naming the tensor's
    path; anything that is no tensor is copied into every micro-batch.
    """
    leaves = list(_paths(obj, what))
    if not leaves:
        raise StructureError(f"{what}: holds no tensor to cut into micro-batches")
    for p, t in leaves:
        if t.dim() == 0 or t.size(0) != batch:
            got = "a 0-dim tensor" if t.dim() == 0 else f"dim 0 is {t.size(0)}"
            raise StructureError(f"{p}: {got}, but a tensor of a batch must have the batch size ({batch}) there")
    parts = [torch.tensor_split(t, chunks) if sizes is None else torch.split(t, sizes) for _, t in leaves]
    out = []
    for i in range(chunks):
        it = iter([part[i] for part in parts])
        out.append(map_tensors(obj, lambda _t: next(it)))  # noqa: B023  # used at once, in this iteration
    return out


def _paths(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif type(obj) in (tuple, list):
        for i, x in enumerate(obj):
            yield from _paths(x, f"{path}[{i}]")
    elif type(obj) is dict:
        for k, x in obj.items():
            yield from _paths(x, f"{path}[{k!r}]")
