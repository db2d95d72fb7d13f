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

None may be stashed: `skip.stash("mask", None)`, and the pop of that name
returns None, on the same stage or a later one (it travels as a tensor of no
elements, `NONE`, and never wants a gradient). Every name stashed must be
popped by a later layer: the probe refuses a stash that none pops, naming the
layer and the name, as it refuses a pop with no stash.

Namespaces, for a block class used more than once whose forward stashes and
pops the same names every time: each instance of `skip.Namespace` is its own
namespace, and `ns(name)` is `name` in it, a distinct str ("down1@1f3a9c0e"),
used for stash and pop as any name:

    class Down(nn.Module):
        def __init__(self, ns: skip.Namespace):
            super().__init__()
            self.ns, self.conv, self.pool = ns, conv(...), nn.MaxPool2d(2)

        def forward(self, x):
            h = self.conv(x)
            skip.stash(self.ns("down"), h)
            return self.pool(h)

    a, b = skip.Namespace(), skip.Namespace()
    model = nn.Sequential(Down(a), Down(b), ..., Up(b), Up(a))   # Up pops self.ns("down")

A copy of a module (copy.deepcopy, pickle) keeps its namespaces: equal
namespaces give equal names. A namespace without a label draws its id at
random, so every process that builds the model has other ids: a job of the
service, whose workers each build the model from its factory, gives its
namespaces labels, unique within the model: `skip.Namespace("enc")`
("down@enc"), the same in every build.
"""

from __future__ import annotations

import threading
import uuid

import torch


class SkipError(LookupError):
    """A pop with nothing stashed under its name, a name stashed twice, or a stash that no later layer pops."""


# None as stashed: a tensor of no elements, so every context and both transports carry it as they carry any
# tensor, and no gradient is ever wanted for it (uint8). A pop that gets a tensor of exactly this dtype and shape
# returns None (a stashed tensor of that dtype and shape, (0, 26480) uint8, would too).
NONE = torch.empty((0, 0x6770), dtype=torch.uint8)
_NONE_SHAPE = NONE.shape


def is_none(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a stashed None (`NONE`, or a copy of it moved or received elsewhere)."""
    return tensor.dtype is torch.uint8 and tensor.shape == _NONE_SHAPE


class Namespace:
    """A namespace of skip names: `ns(name)` is `name` in it, a str of its own ("name@id").

    Each instance is its own namespace; a copy (copy.deepcopy, pickle) is equal to it and gives the same names.
    `label`, when given, is the id instead of a random one: the same in every process that builds the model
    (the service's workers each build it), and namespaces with equal labels are one namespace.
    """

    __slots__ = ("id",)

    def __init__(self, label: str | None = None) -> None:
        if label is None:
            label = _fresh_id()
        elif not isinstance(label, str) or not label or "@" in label:
            raise TypeError(f"skip.Namespace: a label is a non-empty str without '@', got {label!r}")
        self.id = label

    def __call__(self, name: str) -> str:
        if not isinstance(name, str) or not name:
            raise TypeError(f"skip.Namespace: the name must be a non-empty str, got {name!r}")
        return f"{name}@{self.id}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("skip.Namespace", self.id))

    def __repr__(self) -> str:
        return f"skip.Namespace({self.id!r})"


_ids: set[str] = set()  # the random ids drawn in this process: none twice
_ids_lock = threading.Lock()


def _fresh_id() -> str:
    with _ids_lock:
        while True:
            new = uuid.uuid4().hex[:8]  # (os.urandom: no generator of torch's or the model's is drawn from)
            if new not in _ids:
                _ids.add(new)
                return new


def namespace_hint(name: str) -> str:
    """For an error about `name` on a stage of the service: a hint when it may be a namespace's name."""
    if "@" not in name:
        return ""
    return (f" ({name!r} is a skip.Namespace's name: one without a label has another id in every process that "
            "builds the model; give it a label, skip.Namespace(\"...\"))")


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


def stash(name: str, tensor: torch.Tensor | None) -> None:
    """Keep `tensor` (or None) for the later layer that pops `name`."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"skip.stash: the name must be a non-empty str, got {name!r}")
    if tensor is None:
        tensor = NONE
    elif not isinstance(tensor, torch.Tensor):
        raise TypeError(f"skip.stash({name!r}): takes a tensor or None, got {type(tensor).__name__}")
    current().stash(name, tensor)


def pop(name: str) -> torch.Tensor | None:
    """The tensor an earlier layer stashed under `name`, or None if it stashed None."""
    tensor = current().pop(name)
    return None if is_none(tensor) else tensor
