"""A stage's tensors as one byte stream in the safetensors layout, cut into bounded pieces.

Checkpoints and the weights a stage starts from travel this way, so that no
message, and no process on the way, holds more than PIECE_BYTES of them:

    header   an 8-byte little-endian length, then JSON naming each tensor's dtype,
             shape and byte range, padded with spaces to a multiple of 8
    data     the tensors' bytes, in the order of their sorted names

A piece is (tensor name, byte offset in the tensor, uint8 tensor of at most
PIECE_BYTES); a checkpoint's data region is sent as consecutive pieces of
PIECE_BYTES (the last one shorter), whatever tensors they span.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping

import torch

PIECE_BYTES = 16 << 20  # the most a piece carries; a stage has at most two in flight

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
BY_NAME = {v: k for k, v in DTYPES.items()}

Piece = tuple[str, int, torch.Tensor]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def header(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[bytes, int]:
    """The safetensors header of `tensors` (they may be on the meta device), and the data region's length."""
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        n = nbytes(t)
        entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def check_against(declared: torch.Tensor, name: str, t: torch.Tensor) -> torch.Tensor:
    """`t`, the tensor written for `name`, if it is what the header declared (`declared`, maybe on the meta
    device): the same dtype and shape. ValueError otherwise, naming both: a tensor of another size would shift
    every later one in the file, and nothing downstream could tell."""
    if t.dtype != declared.dtype or tuple(t.shape) != tuple(declared.shape):
        raise ValueError(f"{name}: the header declares {DTYPES.get(declared.dtype, declared.dtype)} "
                         f"{list(declared.shape)}, the tensor written is {DTYPES.get(t.dtype, t.dtype)} {list(t.shape)}")
    return t


def parse_header(raw: bytes) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """name -> (dtype, shape, start, end) out of a header's JSON (the bytes after its 8-byte length)."""
    out: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
    for name, e in json.loads(raw).items():
        if name == "__metadata__":
            continue
        start, end = e["data_offsets"]
        out[name] = (BY_NAME[e["dtype"]], list(e["shape"]), int(start), int(end))
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat uint8 tensor (no copy; contiguous CPU tensors only)."""
    return t.detach().reshape(-1).view(torch.uint8)


def pieces(tensors: Mapping[str, torch.Tensor]) -> Iterator[Piece]:
    """Each tensor's bytes as pieces of at most PIECE_BYTES, each a copy (a view would carry its whole storage)."""
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        b = as_bytes(t.contiguous())
        for off in range(0, max(len(b), 1), PIECE_BYTES):
            yield name, off, b[off:off + PIECE_BYTES].clone()


def write_all(fd: int, data: memoryview) -> int:
    """os.write until all of `data` is written; its length."""
    written = 0
    while written < len(data):
        written += os.write(fd, data[written:])
    return written


def numpy_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's own memory as a memoryview (no copy)."""
    return as_bytes(t).numpy().data


def write_piece(t: torch.Tensor, offset: int, data: torch.Tensor) -> None:
    """Copy the bytes `data` into tensor `t` (contiguous) at byte `offset`."""
    if offset < 0 or offset + len(data) > nbytes(t):
        raise ValueError(f"a piece of {len(data)} bytes at {offset} overruns a tensor of {nbytes(t)} bytes")
    with torch.no_grad():
        t.reshape(-1).view(torch.uint8)[offset:offset + len(data)].copy_(data)
