"""A small U-Net that segments generated shapes: its skip connections jump stages.

The encoder's layers stash their feature maps (gpipe.skip), the decoder's pop
them; cut into three stages, the first map goes from stage 0 straight to
stage 2, past stage 1. The images are drawn here, from a seed: a few discs and
squares on a noisy background, and the target says which pixel is which.
The same model trains unchanged with plain PyTorch on one device.

    gpipe-coordinator run examples/unet.yaml
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from gpipe import skip

CLASSES = 3  # background, disc, square


def conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(4, c_out), nn.ReLU())


class Down(nn.Module):
    """conv, stash the map for the decoder, then halve the resolution."""

    def __init__(self, c_in: int, c_out: int, name: str):
        super().__init__()
        self.conv, self.name, self.pool = conv(c_in, c_out), name, nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        skip.stash(self.name, h)
        return self.pool(h)


class Up(nn.Module):
    """Double the resolution, join the encoder's map of that resolution, conv."""

    def __init__(self, c_in: int, c_out: int, name: str):
        super().__init__()
        self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.conv, self.name = conv(2 * c_out, c_out), name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([self.up(x), skip.pop(self.name)], dim=1))


class Head(nn.Module):
    """Per-pixel class scores, classes last: (batch, height, width, classes), as cross_entropy takes them."""

    def __init__(self, c_in: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).permute(0, 2, 3, 1)


def unet(width: int = 16) -> nn.Sequential:
    """6 pipeline layers: two Downs, the bottleneck, two Ups, the head."""
    w = width
    return nn.Sequential(
        Down(3, w, "enc1"), Down(w, 2 * w, "enc2"), nn.Sequential(conv(2 * w, 4 * w), conv(4 * w, 4 * w)),
        Up(4 * w, 2 * w, "enc2"), Up(2 * w, w, "enc1"), Head(w),
    )


class Shapes(Dataset):
    """`n` RGB images of `size` x `size` pixels with 1-4 discs and squares; the target is each pixel's class."""

    def __init__(self, n: int = 512, size: int = 32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
        self.images = 0.2 * torch.randn(n, 3, size, size, generator=g)
        self.masks = torch.zeros(n, size, size, dtype=torch.long)
        for i in range(n):
            for _ in range(int(torch.randint(1, 5, (), generator=g))):
                cls = int(torch.randint(1, CLASSES, (), generator=g))
                cy, cx = torch.randint(0, size, (2,), generator=g).tolist()
                r = int(torch.randint(size // 10, size // 4, (), generator=g))
                inside = ((yy - cy) ** 2 + (xx - cx) ** 2 <= r * r) if cls == 1 else \
                    ((yy - cy).abs() <= r) & ((xx - cx).abs() <= r)
                color = torch.rand(3, generator=g)
                self.images[i][:, inside] += color[:, None]
                self.masks[i][inside] = cls

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.masks[i]


def shapes(n: int = 512, size: int = 32, seed: int = 0) -> Shapes:
    return Shapes(n, size, seed)
