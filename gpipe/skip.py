"""Skip connections: a layer stashes a tensor under a name, a later layer pops it.

    from gpipe import skip

    class Down(nn.Module):
        def forward(self, x):
            h = self.conv(x)
            skip.stash("down1", h)
            return self.pool(h)

    class Up(nn.Module):
        def forward(self, x):
            return self.conv(torch.cat([self.up(x), skip.pop("down1")], dim=1))

Under gpipe each micro-batch's forward on a stage runs in a context of its
own. A tensor stashed on one stage and popped on another travels straight
between those two stages, on a channel of their own (never through the stages
between), and its gradient comes back the same way. The routes, which layer
stashes and which pops each name, are found by the probe when the job is
validated (gpipe.memory.probe): a pop with nothing stashed before it, or
a name stashed twice, is a spec error naming the layers.

Outside gpipe (the same model on one device: `model(x)`) stash and pop use a
default context of the calling thread: a pop takes what the latest stash of
that name in the same thread left, and removes it. So one forward of the
nn.Sequential pairs them as gpipe does, and the one-device reference needs no
change.
"""

from __future__ import annotations

import threading

import torch


class SkipError(LookupError):
    """A pop with nothing stashed under its name, or a name stashed twice."""


class Context:
    """Where stash and pop go: a tensor stashed here waits for the pop of its name."""

    def __init__(self) -> None:
        self.stashed: dict[str, torch.Tensor] = {}

    def stash(self, name: str, tensor: torch.Tensor) -> None:
        self.stashed[name] = tensor

    def pop(self, name: str) -> torch.Tensor:
        try:
            return self.stashed.pop(name)
        except KeyError:
            raise SkipError(f"skip.pop({name!r}): nothing was stashed under that name") from None


_local = threading.local()
local = _local  # its `ctx`: the context `use` set (gpipe.stage sets and restores it as `use` does, inline)


def current() -> Context:
    """The calling thread's context: the one `use` set, or else the thread's default."""
    ctx: Context | None = getattr(_local, "ctx", None)
    if ctx is None:
        ctx = _local.default = getattr(_local, "default", None) or Context()
    return ctx


class use:  # noqa: N801  # a context manager, named as the function it replaced (a class: entered every forward)
    """Send this thread's stashes and pops to `ctx` within the block: `with skip.use(ctx):`."""

    __slots__ = ("ctx", "before")

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.before: Context | None = None

    def __enter__(self) -> Context:
        self.before = getattr(_local, "ctx", None)
        _local.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        _local.ctx = self.before


def stash(name: str, tensor: torch.Tensor) -> None:
    """Keep `tensor` for the later layer that pops `name`."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"skip.stash: the name must be a non-empty str, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"skip.stash({name!r}): takes a tensor, got {type(tensor).__name__}")
    current().stash(name, tensor)


def pop(name: str) -> torch.Tensor:
    """The tensor an earlier layer stashed under `name`."""
    return current().pop(name)
