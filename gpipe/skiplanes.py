"""A stage's skip connections (gpipe.skip): its context per micro-batch, and its lanes to the stages it skips to.

The routes come from the probe: (name, the stage that stashes it, the stage
that pops it), for each name that leaves its stage. Every pair of stages a < b
that some name goes between gets two lanes of its own (gpipe.transport):
a's stashes of each micro-batch go straight to b, as one message (a dict of
the names, in sorted order), and b's gradients for them come straight back. The stages between a and b never see them.
A stashed None is a tensor of no elements here (gpipe.skip.NONE): it travels as any, and wants no gradient.
"""

from __future__ import annotations

import torch

from gpipe import skip
from gpipe.cuts import Route  # name, stashing stage, popping stage
from gpipe.transport import Inbound, Outbound, Transport
from gpipe.wire import gradient_message, gradients, wants_grad


class Routed(skip.Context):
    """One micro-batch's forward on a stage: stashes of names that leave the stage are kept for sending,
    pops of names that arrived get the received tensors, the rest stays within the stage."""

    def __init__(self, leaving: dict[str, int], arrived: dict[str, torch.Tensor]):
        self.stashed: dict[str, torch.Tensor] = {}  # (skip.Context's, without the call: one per forward)
        self.leaving, self.arrived = leaving, arrived
        self.out: dict[str, torch.Tensor] = {}

    def stash(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.leaving:
            super().stash(name, tensor)
        elif name in self.out:
            raise skip.SkipError(f"skip.stash({name!r}): stashed twice in one forward")
        else:
            self.out[name] = tensor

    def pop(self, name: str) -> torch.Tensor:
        if name in self.arrived:
            return self.arrived[name]
        if name in self.stashed:
            return super().pop(name)
        raise skip.SkipError(f"skip.pop({name!r}): nothing was stashed under that name on this stage or sent to it "
                             "(the routes between stages are found by the probe: is probe false?)"
                             + skip.namespace_hint(name))


class SkipLinks:
    """The skip lanes of stage `stage`, over its transport."""

    def __init__(self, stage: int, routes: list[Route], transport: Transport):
        self.leaving = {n: b for n, a, b in routes if a == stage}
        self.arriving = {n: a for n, a, b in routes if b == stage}
        self.send: dict[int, Outbound] = {}
        self.recv_grad: dict[int, Inbound] = {}
        self.recv: dict[int, Inbound] = {}
        self.send_grad: dict[int, Outbound] = {}
        for a, b in sorted({(a, b) for _, a, b in routes}):
            if a == stage:
                self.send[b] = transport.sender(b, "skip", f"skips to stage {b}")
                self.recv_grad[b] = transport.receiver(b, "skip-gradient", f"stage {b}'s skip gradients")
            elif b == stage:
                self.recv[a] = transport.receiver(a, "skip", f"stage {a}'s skips")
                self.send_grad[a] = transport.sender(a, "skip-gradient", f"skip gradients to stage {a}")

    def channels(self) -> list[Outbound | Inbound]:
        return [*self.send.values(), *self.recv_grad.values(), *self.recv.values(), *self.send_grad.values()]

    def expect(self, chunks: int) -> None:
        """A step of `chunks` micro-batches begins: every stage that skips here sends one message per micro-batch."""
        for r in self.recv.values():
            r.expect(chunks)

    def receive(self, mb: int, timeout: float) -> dict[str, torch.Tensor]:
        """The tensors sent here for micro-batch `mb`, by name (those that want a gradient require grad)."""
        arrived: dict[str, torch.Tensor] = {}
        for r in self.recv.values():
            arrived.update(r.get(mb, timeout))
        return arrived

    def context(self, arrived: dict[str, torch.Tensor]) -> Routed:
        return Routed(self.leaving, arrived)

    def send_forward(self, mb: int, out: dict[str, torch.Tensor], checkpointed: bool) -> dict[int, list[bool]]:
        """Send micro-batch `mb`'s stashes to the stages that pop them; per stage, which want a gradient."""
        if not self.leaving:  # no skip leaves this stage (most stages of most models)
            return {}
        missing = sorted(set(self.leaving) - set(out))
        if missing:
            raise skip.SkipError(f"skip.stash({missing[0]!r}) did not happen on micro-batch {mb}, though the probe "
                                 "saw it: a skip connection must be stashed on every forward"
                                 + skip.namespace_hint(missing[0]))
        wants: dict[int, list[bool]] = {}
        for b, sender in self.send.items():
            names = self._names_to(b)
            wants[b] = wants_grad([out[n] for n in names], checkpointed)
            sender.send(mb, {n: out[n].detach() for n in names}, wants[b])
            if any(wants[b]):
                self.recv_grad[b].expect(1)
        return wants

    def _names_to(self, b: int) -> list[str]:
        return [n for n in sorted(self.leaving) if self.leaving[n] == b]

    def gradients(self, mb: int, wants: dict[int, list[bool]], timeout: float) -> dict[int, list[torch.Tensor]]:
        """The gradients of micro-batch `mb`'s stashes that wanted one, from the stages that popped them."""
        return {b: gradients(self.recv_grad[b].get(mb, timeout)) for b, flags in wants.items() if any(flags)}

    def pairs(self, out: dict[str, torch.Tensor], wants: dict[int, list[bool]],
              grads: dict[int, list[torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(stashed tensor, its gradient) pairs for the backward."""
        pairs = []
        for b, g in grads.items():
            wanted = [out[n] for n, w in zip(self._names_to(b), wants[b], strict=True) if w]
            if len(wanted) != len(g):
                raise RuntimeError(f"{len(g)} skip gradients came back from stage {b} for {len(wanted)} tensors")
            pairs += list(zip(wanted, g, strict=True))
        return pairs

    def send_gradients(self, mb: int, arrived: dict[str, torch.Tensor]) -> None:
        """Send the gradients of micro-batch `mb`'s arrived tensors back to the stages that stashed them."""
        for a, sender in self.send_grad.items():
            names = [n for n in sorted(self.arriving) if self.arriving[n] == a]
            wanted = [arrived[n] for n in names if arrived[n].requires_grad]
            if wanted:
                sender.send(mb, gradient_message(wanted))

    def close(self) -> None:
        for ch in self.channels():
            ch.close()
