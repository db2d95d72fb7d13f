"""torchgpipe's skip connections: `@skippable` modules that `yield stash(...)` and `yield pop(...)`.

    from gpipe.torchgpipe.skip import Namespace, pop, skippable, stash

    @skippable(stash=["1to3"])
    class Layer1(nn.Module):
        def forward(self, x):
            yield stash("1to3", x)
            return self.conv(x)

    @skippable(pop=["1to3"])
    class Layer3(nn.Module):
        def forward(self, x):
            skip = yield pop("1to3")
            return self.conv(x) + skip

    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(Layer1().isolate(ns1), Layer1().isolate(ns2), Layer2(), Layer3().isolate(ns2),
                          Layer3().isolate(ns1))

A skippable's forward is gpipe's skips (gpipe.skip) underneath: each declared
name popped with `skip.pop` before the wrapped forward runs, each stashed
with `skip.stash` after it, so under GPipe a skip that crosses a cut travels
straight between the two stages (gpipe.Pipeline routes it), and outside GPipe
(the same nn.Sequential on one device) the thread's default context pairs
them. A name in a namespace is its own str, "name@<the namespace's id>"; a
name in no namespace is the name itself, so a skippable and a plain layer
calling gpipe.skip.pop("name") meet. `verify_skippables` makes torchgpipe's
static checks of the declarations (GPipe runs it when built).
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from gpipe import skip

__all__ = ["skippable", "stash", "pop", "verify_skippables", "Namespace"]

S = TypeVar("S", bound="Skippable")


class Namespace(metaclass=abc.ABCMeta):  # noqa: B024  # an ABC for register(type(None)), no abstract method
    """A namespace that isolates skip names (`Skippable.isolate`): each instance is its own, a copy equals it.

    None is the default namespace: `isinstance(None, Namespace)` is true, as in torchgpipe."""

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __lt__(self, other: object) -> bool:  # an order, any: torchgpipe's namespaces sort
        return isinstance(other, Namespace) and self.id < other.id


Namespace.register(type(None))


def skip_name(ns: Namespace | None, name: str) -> str:
    """The gpipe.skip name of `name` in namespace `ns`: the name itself in the default namespace."""
    return name if ns is None else f"{name}@{ns.id.hex}"


class stash:  # noqa: N801  # torchgpipe's command names
    """`yield stash(name, tensor)` in a skippable's forward: keep `tensor` (or None) for the layer that pops
    `name`."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: torch.Tensor | None) -> None:
        self.name = name
        self.tensor = tensor


class pop:  # noqa: N801
    """`tensor = yield pop(name)` in a skippable's forward: what an earlier layer stashed under `name`."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """A module made by `@skippable`: it holds the decorated class's instance as `.module` and turns the
    stash and pop commands its forward yields into gpipe's skips. Made by `skippable`, never directly."""

    module_cls: ClassVar[type[nn.Module]]
    stashable_names: ClassVar[frozenset[str]]
    poppable_names: ClassVar[frozenset[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> tuple[Namespace | None, str]:
        """(the namespace `name` is isolated in, or None, `name`)."""
        return self.namespaces.get(name), name

    def stashable(self) -> Iterator[tuple[Namespace | None, str]]:
        """The names this module stashes, each with its namespace."""
        return (self.namespaced(n) for n in sorted(self.stashable_names))

    def poppable(self) -> Iterator[tuple[Namespace | None, str]]:
        """The names this module pops, each with its namespace."""
        return (self.namespaced(n) for n in sorted(self.poppable_names))

    def isolate(self: S, ns: Namespace, *, only: Iterable[str] | None = None) -> S:
        """Put this module's skip names (or the names in `only`) in namespace `ns`; returns the module.

        Two uses of one skippable class in a model stash the same names: each pair of a stashing and a popping
        use isolated in a namespace of its own no longer clashes with the others."""
        names = self.stashable_names | self.poppable_names if only is None else set(only)
        for name in names:
            self.namespaces[name] = ns
        return self

    def dispatch(self, input: Any, handle_stash: Callable[[str, torch.Tensor | None], None],
                 handle_pop: Callable[[str], torch.Tensor | None]) -> Any:
        """Run the wrapped module on `input`, handing each command its forward yields to `handle_stash` or
        `handle_pop`; its output. A forward that yields nothing is a plain one."""
        run = self.module(input)
        if not isinstance(run, Generator):
            return run
        try:
            command = next(run)
            while True:
                if isinstance(command, stash):
                    handle_stash(command.name, command.tensor)
                    command = next(run)
                elif isinstance(command, pop):
                    command = run.send(handle_pop(command.name))
                else:
                    raise TypeError(f"{command!r} is not a command from @skippable (stash or pop)")
        except StopIteration as done:
            return done.value

    def forward(self, input: Any) -> Any:
        """The wrapped forward, its pops and stashes through gpipe.skip. RuntimeError for a name not declared,
        one declared and not stashed or not popped, or one to pop that nothing stashed."""
        popped: dict[str, torch.Tensor | None] = {}
        for ns, name in self.poppable():
            try:
                popped[name] = skip.pop(skip_name(ns, name))
            except LookupError:  # gpipe.skip.SkipError
                raise RuntimeError(f"'{name}' has not been stashed") from None
        stashed: dict[str, torch.Tensor | None] = {}

        def handle_stash(name: str, tensor: torch.Tensor | None) -> None:
            if name not in self.stashable_names:
                raise RuntimeError(f"'{name}' has not been declared as stashable")
            stashed[name] = tensor

        def handle_pop(name: str) -> torch.Tensor | None:
            if name not in self.poppable_names:
                raise RuntimeError(f"'{name}' has not been declared as poppable")
            if name not in popped:
                raise RuntimeError(f"'{name}' has been popped already")
            return popped.pop(name)

        output = self.dispatch(input, handle_stash, handle_pop)
        if unstashed := sorted(self.stashable_names - stashed.keys()):
            raise RuntimeError(f"{_quoted(unstashed)} must be stashed but have not")
        if unpopped := sorted(popped):
            raise RuntimeError(f"{_quoted(unpopped)} must be popped but have not")
        for ns, name in self.stashable():
            skip.stash(skip_name(ns, name), stashed[name])
        return output


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[type[nn.Module]], type[Skippable]]:
    """A class decorator: the decorated nn.Module class becomes a `Skippable` class of the same name whose
    forward may `yield stash(name, tensor)` for each name in `stash` and `tensor = yield pop(name)` for each
    name in `pop`. Its instances hold an instance of the original class as `.module`. Each name must be
    stashed by one layer and popped by one later layer (`verify_skippables`)."""
    stashable_names, poppable_names = frozenset(stash), frozenset(pop)

    def make(module_cls: type[nn.Module]) -> type[Skippable]:
        attrs = {"module_cls": module_cls, "stashable_names": stashable_names, "poppable_names": poppable_names,
                 "__module__": module_cls.__module__, "__qualname__": module_cls.__qualname__,
                 "__doc__": module_cls.__doc__}
        return type(module_cls.__name__, (Skippable,), attrs)

    return make


def verify_skippables(module: nn.Sequential) -> None:
    """TypeError listing every stash and pop of `module`'s skippable children that do not pair up: a name
    both stashed and popped by one layer, stashed or popped twice in one namespace, popped before (or
    without) its stash, or stashed and never popped."""
    stashed: set[tuple[Namespace | None, str]] = set()
    popped: set[tuple[Namespace | None, str]] = set()
    problems: list[str] = []
    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        both = layer.stashable_names & layer.poppable_names
        problems += [f"'{layer_name}' declared '{name}' both as stashable and as poppable" for name in sorted(both)]
        for ns, name in layer.stashable():
            if name in both:
                continue
            if (ns, name) in stashed:
                problems.append(f"'{layer_name}' redeclared '{name}' as stashable but not isolated by namespace")
            else:
                stashed.add((ns, name))
        for ns, name in layer.poppable():
            if name in both:
                continue
            if (ns, name) in popped:
                problems.append(f"'{layer_name}' redeclared '{name}' as poppable but not isolated by namespace")
            elif (ns, name) not in stashed:
                problems.append(f"'{layer_name}' declared '{name}' as poppable but it was not stashed")
            else:
                popped.add((ns, name))
    problems += [f"no module declared '{name}' as poppable but stashed"
                 for name in sorted(name for _, name in stashed - popped)]
    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n" +
                        "\n".join(f"* {p}" for p in problems))
