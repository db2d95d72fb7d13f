"""What crosses between stages, byte for byte: a tensor's bits, and an int16 tensor of its extremes."""

from __future__ import annotations

import torch

INT16 = torch.tensor([-32768, -1, 0, 1, 32767, -12345], dtype=torch.int16)


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
