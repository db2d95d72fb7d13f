"""What crosses a cut between stages, and how it is written: the wire format of a stage's messages.

A message is one micro-batch's value: a tensor, or a structure of tensors and
scalars (gpipe.structure). It goes as a small fixed-size int64 header, then,
for a structure, a JSON description of it (its skeleton, scalars inline, and
each tensor's dtype and shape), then each tensor's payload, so the receiver
allocates each tensor exactly as it arrives, whatever shape it had last step.
A single tensor, the common case, needs no JSON: its dtype and shape are in the
header. Nothing is pickled. Each tensor also carries whether it wants a
gradient back, and the receiver's copy requires grad exactly then. A header or
description that asks for more bytes than the receiving device has
(`message_limit`) fails the receive in our words, before any allocation.

    header  [micro-batch, dtype code (or -1: a structure), ndim (or the JSON's bytes), flags, dims...]
    JSON    {"s": skeleton, "t": [[dtype code, shape, wants grad], ...]}      (structures only)
    data    each tensor's bytes, in the skeleton's order (none for an empty tensor)

flags: 1, the tensor wants a gradient back; 2, its data follows the header in
the same transfer (packed: gpipe.worker.dataplane.channel).

Which dtypes each backend carries (`CARRIES`) is here too: the plan's probe
checks a job's cuts against it at validate, the channel when it sends. The
engine's stages, the probe and the data plane share this module; it imports
nothing of theirs.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from array import array
from collections.abc import Sequence
from typing import Any

import torch

from gpipe import structure

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
# What each backend carries natively between stages, by dtype. gloo's send and receive move bytes; NCCL maps
# each dtype to one of its own and refuses the rest (an H100, NCCL 2.28.9: int16 refused, these carried).
CARRIES: dict[str, frozenset[torch.dtype]] = {
    "gloo": frozenset(DTYPES),
    "nccl": frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                       torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool}),
}
MAX_DIMS = 8
HEADER = 4 + MAX_DIMS  # micro-batch, dtype code, ndim, flags, dims...
HEADER_BYTES = HEADER * 8
WANTS_GRAD, PACKED = 1, 2  # the header's flags
PACK_MAX_BYTES = 256 << 10  # the largest tensor packed after its header (bench/README.md (o))
STRUCTURE = -1  # the dtype code of a message that is a structure
MAX_JSON_BYTES = 64 << 10  # a structure's description


def backend_of(device: str | torch.device) -> str:
    """The backend of a stage's data plane on `device`: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def travels(dtype: torch.dtype, backend: str) -> bool:
    """Whether a tensor of `dtype` can go between stages over `backend`: the wire format has a code for it, and
    the backend carries it, as it is or as its bytes (`on_wire`)."""
    return dtype in DTYPE_CODE and (dtype in CARRIES[backend] or torch.uint8 in CARRIES[backend])


def on_wire(t: torch.Tensor, backend: str) -> torch.Tensor:
    """What c10d moves for the contiguous tensor `t` over `backend`: `t` itself, or, for a dtype the backend
    lacks, a flat uint8 view of its bytes (the same memory: a receive into it fills `t`; nothing converted)."""
    if t.dtype in CARRIES[backend]:
        return t
    return t.reshape(-1).view(torch.uint8)


def message_limit(device: torch.device) -> int:
    """The most bytes one message may ask a receiver to allocate: its device's memory (a GPU's, or this host's
    RAM). A header that asks for more is refused before anything is allocated."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def asked_bytes(metas: Sequence[tuple[torch.dtype, Sequence[int]]], limit: int) -> int:
    """The bytes of the tensors a header or description announces; ValueError if over `limit`."""
    nbytes = sum(math.prod(shape) * dtype.itemsize for dtype, shape in metas)
    if nbytes > limit:
        raise ValueError(f"a message of {nbytes} bytes, more than this device's {limit} bytes of memory")
    return nbytes


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_meta(t: torch.Tensor, where: str, backend: str) -> tuple[int, list[int]]:
    if not travels(t.dtype, backend):
        raise ValueError(f"{where}: dtype {_name(t.dtype)} cannot travel between stages over {backend} "
                         f"(supported: {', '.join(_name(d) for d in DTYPES if travels(d, backend))})")
    if t.dim() > MAX_DIMS:
        raise ValueError(f"{where}: a tensor between stages may have at most {MAX_DIMS} dims, got {t.dim()}")
    if t.layout != torch.strided:
        raise ValueError(f"{where}: a {t.layout} tensor cannot travel between stages (dense tensors can)")
    return DTYPE_CODE[t.dtype], list(t.shape)


def _memory(t: torch.Tensor) -> torch.Tensor:
    """`t` as memory that holds its values: contiguous, with no negation left lazy (the real part of a
    conjugate's imaginary view, `x.conj().imag`, is its memory negated on read)."""
    return t.resolve_neg().contiguous()


def header_bytes(header: Sequence[int]) -> bytes:
    """A header (HEADER int64s, as `encode` gives it) as its bytes on the wire (this host's byte order, as the
    receiver's int64 view reads them)."""
    return array("q", header).tobytes()


def read_header(buffer: torch.Tensor) -> list[int]:
    """The HEADER int64s at the start of `buffer`, a received uint8 tensor in this host's memory (read
    directly: no tensor operations, which cost more than the read on a message's path)."""
    assert buffer.device.type == "cpu" and buffer.is_contiguous() and buffer.numel() >= HEADER_BYTES
    h = array("q")
    h.frombytes(ctypes.string_at(buffer.data_ptr(), HEADER_BYTES))
    return h.tolist()


def tensor_header(h: list[int]) -> tuple[torch.dtype, list[int], bool, bool]:
    """(dtype, shape, wants grad, packed) of a received header of a single tensor; ValueError if it is not one."""
    code, n, flags = h[1], h[2], h[3]
    if not (0 <= code < len(DTYPES) and 0 <= n <= MAX_DIMS and 0 <= flags <= WANTS_GRAD | PACKED
            and all(d >= 0 for d in h[4 : 4 + n])):
        raise ValueError(f"a bad header: {h}")
    if flags & WANTS_GRAD and not DTYPES[code].is_floating_point:
        raise ValueError(f"a bad header: a {DTYPES[code]} tensor that wants a gradient: {h}")
    return DTYPES[code], h[4 : 4 + n], bool(flags & WANTS_GRAD), bool(flags & PACKED)


def encode(mb: int, obj: Any, grads: Sequence[bool] = (),
           backend: str = "gloo") -> tuple[list[int], bytes | None, list[torch.Tensor]]:
    """(header, JSON or None, tensors to send) of one message; ValueError if `obj` cannot travel over `backend`.

    `grads[i]` says whether the i-th tensor (in gpipe.structure order) wants a gradient back.
    """
    if isinstance(obj, torch.Tensor):
        code, shape = _tensor_meta(obj, "the value", backend)
        h = [mb, code, len(shape), int(bool(grads and grads[0])), *shape]
        return h + [0] * (HEADER - len(h)), None, [_memory(obj)]
    try:
        skeleton, leaves = structure.flatten(obj)
    except structure.StructureError as e:
        raise ValueError(str(e)) from None
    metas = []
    for i, t in enumerate(leaves):
        code, shape = _tensor_meta(t, f"tensor {i} of {structure.describe(obj)}", backend)
        metas.append([code, shape, int(i < len(grads) and bool(grads[i]))])
    text = json.dumps({"s": skeleton, "t": metas}, separators=(",", ":")).encode()
    if len(text) > MAX_JSON_BYTES:
        raise ValueError(f"{structure.describe(obj)}: its description is {len(text)} bytes, over the "
                         f"{MAX_JSON_BYTES >> 10} KiB a structure between stages may take")
    h = [mb, STRUCTURE, len(text), 0]
    return h + [0] * (HEADER - len(h)), text, [_memory(t) for t in leaves]


def decode(text: bytes) -> tuple[Any, list[tuple[torch.dtype, list[int], bool]]]:
    """(skeleton, [(dtype, shape, wants grad)]) of a structure's JSON; ValueError if it is not one."""
    d = json.loads(text)
    if not (isinstance(d, dict) and set(d) == {"s", "t"} and isinstance(d["t"], list)):
        raise ValueError("not a structure's description")
    if structure.check_skeleton(d["s"]) != len(d["t"]):
        raise ValueError("the description's tensors do not match its skeleton")
    metas = []
    for m in d["t"]:
        ok = (isinstance(m, list) and len(m) == 3 and type(m[0]) is int and 0 <= m[0] < len(DTYPES)
              and isinstance(m[1], list) and len(m[1]) <= MAX_DIMS
              and all(type(n) is int and n >= 0 for n in m[1]) and m[2] in (0, 1)
              and (m[2] == 0 or DTYPES[m[0]].is_floating_point))
        if not ok:
            raise ValueError(f"not a tensor's description: {str(m)[:80]}")
        metas.append((DTYPES[m[0]], m[1], bool(m[2])))
    return d["s"], metas


def wants_grad(value: Any, checkpointed: bool) -> list[bool]:
    """Which tensors of a stage's output want a gradient back: the floating-point ones that require grad.

    A checkpointed forward ran without autograd, so it cannot tell: every
    floating-point tensor asks, and the backward drops those that turn out not to need one.
    """
    if type(value) is torch.Tensor:  # (nearly every activation: no walk, no comprehension)
        return [value.is_floating_point() and (checkpointed or value.requires_grad)]
    return [t.is_floating_point() and (checkpointed or t.requires_grad) for t in structure.tensors(value)]


def gradient_message(wanted: Sequence[torch.Tensor]) -> Any:
    """What goes back for tensors that wanted a gradient: their gradients (zeros for one unused) in order;
    a single tensor needs no description."""
    if len(wanted) == 1:  # (nearly every message: no comprehension)
        g = wanted[0].grad
        return g if g is not None else torch.zeros_like(wanted[0])
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in wanted]


def gradients(message: Any) -> list[torch.Tensor]:
    """The gradients of a `gradient_message`, as a list."""
    return [message] if isinstance(message, torch.Tensor) else list(message)
