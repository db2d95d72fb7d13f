"""What a stage sends to and receives from the other stages, and the sums it takes with them: one interface.

A stage never calls torch.distributed itself. It asks its transport for

- a sender or receiver per lane to another stage of its pipeline (replica):
  activations forward, their gradients back, skip connections and theirs;
- an all-reduce among the ranks of the whole job (fp16's inf check), of its
  pipeline (the clipping norm) or of its copies in the other replicas
  (deferred BatchNorm's statistics);
- a gradient reducer for its copies (the replicas' gradient sum).

Two implementations: c10d between processes (gpipe.worker.dataplane.c10d: gloo on CPU,
NCCL on CUDA), and `Hub` here, between threads of one process (gpipe.Pipeline
and the fast tests). The same stage code runs over either.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch

from gpipe import structure

Lane = Literal["activation", "gradient", "skip", "skip-gradient"]
Among = Literal["job", "pipeline", "copies"]  # every rank; this replica's stages; this stage's replicas
Op = Literal["sum", "max"]


class Outbound(Protocol):
    """Sends (micro-batch, value) to one stage, in order, without waiting for it to receive."""

    name: str
    bytes: int  # tensor data handed over, headers left out

    def send(self, mb: int, obj: Any, grads: Sequence[bool] = ()) -> None:
        """Send `obj` on (posted, not waited for); `grads` flags (in gpipe.structure order) the tensors that want a
        gradient back."""

    def flush(self, timeout: float) -> None:
        """Wait until everything sent has been taken, at most `timeout` seconds."""

    def close(self) -> None: ...


class Inbound(Protocol):
    """Receives (micro-batch, value) from one stage, as they arrive."""

    name: str
    bytes: int

    def expect(self, count: int) -> None:
        """`count` more messages are coming (one step's worth)."""

    def get(self, mb: int, timeout: float) -> Any:
        """The value of micro-batch `mb`; its tensors that want a gradient back require grad."""

    def close(self) -> None: ...


class GradSum(Protocol):
    """Sums a stage's gradients with its copies in the other replicas (gpipe.worker.dataplane.reducer for c10d)."""

    def arm(self) -> None:
        """The step's last backward is next."""

    def finish(self) -> None:
        """Every copy's gradients are now the sum over the replicas."""

    def reset(self) -> None:
        """Forget a failed step's progress."""


class Transport(Protocol):
    """A stage's links to the other stages (by stage number, within its replica) and to its copies."""

    def sender(self, peer: int, lane: Lane, name: str) -> Outbound: ...

    def receiver(self, peer: int, lane: Lane, name: str) -> Inbound: ...

    def all_reduce(self, t: torch.Tensor, among: Among, op: Op = "sum") -> None:
        """Reduce `t` in place with the same tensor on every rank of `among`."""

    def grad_sum(self, params: Sequence[torch.Tensor]) -> GradSum | None:
        """A reducer for `params` across the replicas; None with one replica."""

    def sum_among(self, t: torch.Tensor, stages: Sequence[int]) -> None:
        """Sum `t` in place with the same tensor on `stages` of this replica (a tied weight's holders)."""

    def gather_copies(self, t: torch.Tensor, everyone: bool) -> list[torch.Tensor] | None:
        """This stage's copies' `t` (of one shape on every copy), in replica order: on every copy with
        `everyone`, else on replica 0 alone (None on the others). gpipe.memory.zero's gathers."""

    def in_turn(self) -> contextlib.AbstractContextManager[None]:
        """Around a stage's gathers with its copies (gpipe.memory.zero): the stages of one process take their turns in
        one order."""

    def close(self) -> None: ...


# -- in memory: threads of one process ---------------------------------------------------------------------


class HubClosed(ConnectionError):
    """Another stage of the pipeline failed: a wait gave up."""


class Hub:
    """The shared state of a pipeline's stages that run as threads of one process.

    Messages are copied as they are received, onto the receiver's device, so a
    stage never shares storage with another's autograd graph. All waits share
    one condition, so `fail` wakes every stage at once; each wait is bounded
    by `timeout` and names what it waited for.
    """

    def __init__(self, stages: int, replicas: int = 1, timeout: float = 300.0):
        self.stages, self.replicas, self.timeout = stages, replicas, timeout
        self._cv = threading.Condition()
        # Per lane, per micro-batch: its messages in order (the next step's may come before this one's is taken).
        self._boxes: dict[tuple[str, int, int], dict[int, deque[Any]]] = {}
        self._rounds: dict[tuple[str, int], _Round] = {}
        self._error: BaseException | None = None

    def transport(self, stage: int, replica: int, device: torch.device) -> MemoryTransport:
        return MemoryTransport(self, stage, replica, device)

    def fail(self, error: BaseException) -> None:
        """A stage failed: every wait of every other stage ends now."""
        with self._cv:
            if self._error is None:
                self._error = error
            self._cv.notify_all()

    def reset(self) -> None:
        """Between steps, every stage joined: forget a failed step's messages and sums."""
        with self._cv:
            self._boxes.clear()
            self._rounds.clear()
            self._error = None

    def _wait(self, ready: Any, what: str, timeout: float) -> None:
        """Wait (holding the condition) until `ready()`; TimeoutError or HubClosed naming `what`."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self._error is not None:
                raise HubClosed(f"gave up waiting for {what}: another stage failed ({self._error})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            self._cv.wait(left)

    def _put(self, key: tuple[str, int, int], mb: int, value: Any) -> None:
        with self._cv:
            if self._error is not None:  # another stage failed: stop here, as a wait would
                raise HubClosed(f"stopped sending micro-batch {mb}: another stage failed ({self._error})")
            self._boxes.setdefault(key, {}).setdefault(mb, deque()).append(value)
            self._cv.notify_all()

    def _take(self, key: tuple[str, int, int], mb: int, what: str, timeout: float) -> Any:
        with self._cv:
            if self._error is not None:  # another stage failed: what arrived before is not computed on
                raise HubClosed(f"stopped before {what}: another stage failed ({self._error})")
            self._wait(lambda: bool(self._boxes.get(key, {}).get(mb)), what, timeout)
            return self._boxes[key][mb].popleft()

    def _reduce(self, group: tuple[Any, ...], members: int, who: int, values: list[torch.Tensor | None],
                op: Op, what: str) -> list[torch.Tensor | None]:
        """Every member's `values`, reduced element-wise in member order (None: no value from that member;
        None out when no member had one). Blocks until all `members` called."""
        _settled([v for v in values if v is not None])  # made, on whatever stream made them
        with self._cv:
            self._wait(lambda: group not in self._rounds or not self._rounds[group].done, what, self.timeout)
            r = self._rounds.setdefault(group, _Round(members))
            r.given[who] = values
            if len(r.given) == members:
                r.finish(op)
                _settled([t for t in r.out if t is not None])
                self._cv.notify_all()
            else:
                self._wait(lambda: r.done, what, self.timeout)
            out = r.out
            r.taken += 1
            if r.taken == members:
                del self._rounds[group]
                self._cv.notify_all()
        for t in out:
            if t is not None:
                _used_here(t)
        return out


def _made(tensors: Sequence[torch.Tensor]) -> torch.cuda.Event | None:
    """An event on the current stream of the GPU `tensors` are on (once it has passed, they are made); None
    for tensors on the CPU."""
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if cuda is None:
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(cuda))
    return event


def _settled(tensors: Sequence[torch.Tensor]) -> None:
    """Wait until the current streams of the GPUs `tensors` are on have made them: a sum among threads reads
    them on another thread's stream (rare: once a step)."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


def _used_here(t: torch.Tensor) -> None:
    """`t`, made on another stage's stream, is read on this thread's: its memory is not reused before that."""
    if t.device.type == "cuda":
        t.record_stream(torch.cuda.current_stream(t.device))


class _Round:
    """One all-reduce among `members` threads."""

    def __init__(self, members: int):
        self.members = members
        self.given: dict[int, list[torch.Tensor | None]] = {}
        self.out: list[torch.Tensor | None] = []
        self.done = False
        self.taken = 0

    def finish(self, op: Op) -> None:
        columns = zip(*(self.given[i] for i in sorted(self.given)), strict=True)
        for column in columns:
            present = [t for t in column if t is not None]
            if not present:
                self.out.append(None)
                continue
            acc = present[0].detach().clone()
            for t in present[1:]:
                t = t.detach().to(acc.device)
                if op == "sum":
                    acc.add_(t)
                else:
                    torch.maximum(acc, t, out=acc)
            self.out.append(acc)
        self.done = True


class _Sender:
    def __init__(self, hub: Hub, key: tuple[str, int, int], name: str):
        self.hub, self.key, self.name = hub, key, name
        self.bytes = 0

    def send(self, mb: int, obj: Any, grads: Sequence[bool] = ()) -> None:
        leaves = structure.tensors(obj)
        self.bytes += sum(t.numel() * t.element_size() for t in leaves)
        flags = [i < len(grads) and bool(grads[i]) for i in range(len(leaves))]
        # Detached now (the sender's graph stays the sender's); copied by the receiver onto its device, once
        # the sender's stream has made them (a stage of a GPU runs on its own stream: gpipe.Pipeline).
        made = _made(leaves)
        self.hub._put(self.key, mb, (structure.map_tensors(obj, torch.Tensor.detach), flags, made))

    def flush(self, timeout: float) -> None:
        pass  # a message is delivered as it is sent

    def close(self) -> None:
        pass


class _Receiver:
    def __init__(self, hub: Hub, key: tuple[str, int, int], device: torch.device, name: str):
        self.hub, self.key, self.device, self.name = hub, key, device, name
        self.bytes = 0

    def expect(self, count: int) -> None:
        pass  # messages wait in the hub until taken

    def get(self, mb: int, timeout: float) -> Any:
        value, flags, made = self.hub._take(self.key, mb, f"{self.name} of micro-batch {mb}", timeout)
        wants = iter(flags)
        if made is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(made)

        def receive(t: torch.Tensor) -> torch.Tensor:
            copy = t.to(self.device, copy=True)
            _used_here(t)
            self.bytes += copy.numel() * copy.element_size()
            return copy.requires_grad_() if next(wants) else copy

        return structure.map_tensors(value, receive)

    def close(self) -> None:
        pass


class _MemoryGradSum:
    """The replicas' gradient sum, between threads: at the step's end, each parameter's gradients summed in
    replica order (a parameter no replica's step reached keeps no gradient, as on one device)."""

    def __init__(self, transport: MemoryTransport, params: Sequence[torch.Tensor]):
        self.transport, self.params = transport, list(params)

    def arm(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def finish(self) -> None:
        t = self.transport
        sums = t.hub._reduce(("copies", t.stage), t.hub.replicas, t.replica, [p.grad for p in self.params],
                             "sum", f"the other replicas' gradients of stage {t.stage}")
        for p, g in zip(self.params, sums, strict=True):
            p.grad = None if g is None else g.to(p.device, copy=True)  # each copy its own


class MemoryTransport:
    """A stage's transport between threads of one process (see Hub)."""

    def __init__(self, hub: Hub, stage: int, replica: int, device: torch.device):
        self.hub, self.stage, self.replica, self.device = hub, stage, replica, device

    def _key(self, lane: Lane, src: int, dst: int) -> tuple[str, int, int]:
        base = self.replica * self.hub.stages
        return lane, base + src, base + dst

    def sender(self, peer: int, lane: Lane, name: str) -> Outbound:
        return _Sender(self.hub, self._key(lane, self.stage, peer), name)

    def receiver(self, peer: int, lane: Lane, name: str) -> Inbound:
        return _Receiver(self.hub, self._key(lane, peer, self.stage), self.device, name)

    def all_reduce(self, t: torch.Tensor, among: Among, op: Op = "sum") -> None:
        hub = self.hub
        if among == "job":
            group, members, who = ("job", 0), hub.stages * hub.replicas, self.replica * hub.stages + self.stage
        elif among == "pipeline":
            group, members, who = ("pipeline", self.replica), hub.stages, self.stage
        else:
            group, members, who = ("copies", self.stage), hub.replicas, self.replica
        (out,) = hub._reduce(group, members, who, [t], op, f"the {among} all-reduce of stage {self.stage}")
        assert out is not None  # every member gave a tensor
        t.copy_(out)

    def grad_sum(self, params: Sequence[torch.Tensor]) -> GradSum | None:
        return _MemoryGradSum(self, params) if self.hub.replicas > 1 and params else None

    def in_turn(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # threads of one process: no communicator to keep in order

    def gather_copies(self, t: torch.Tensor, everyone: bool) -> list[torch.Tensor] | None:
        hub = self.hub
        values: list[torch.Tensor | None] = [None] * hub.replicas
        values[self.replica] = t  # a sum of one per column: each copy's own
        out = hub._reduce(("gather", self.stage), hub.replicas, self.replica, values, "sum",
                          f"the gather of stage {self.stage}'s copies")
        if not everyone and self.replica != 0:
            return None
        return [v.to(self.device, copy=True) for v in out if v is not None]

    def sum_among(self, t: torch.Tensor, stages: Sequence[int]) -> None:
        group = ("tied", self.replica, *stages)
        (out,) = self.hub._reduce(group, len(stages), list(stages).index(self.stage), [t], "sum",
                                  f"the tied weight's sum of stage {self.stage} with stages {list(stages)}")
        assert out is not None
        t.copy_(out)

    def close(self) -> None:
        pass
