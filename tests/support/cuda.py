"""On one GPU: the device the gpu tests use, and the largest difference of two state dicts wherever they are."""

from __future__ import annotations

DEV = "cuda:0"


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in a)
