"""The optimizer state sharded across a stage's replicas (ZeRO stage 1: `optimizer.shard`).

With R replicas, every copy of a stage holds the same weights and, once the
replicas have summed them (gpipe.worker.dataplane.reducer), the same whole gradients. Unsharded,
each copy then runs the same optimizer step on all of them, and keeps all of the
optimizer's state (adam's two moments: 8 bytes a parameter). Sharded, copy r
keeps the state of, and updates, 1/R of the stage's elements only; then the
copies gather each other's updated elements, so every copy again holds the
whole, same, weights.

The cut (`Cut`): the stage's parameters, in order, go into buckets of at most
BUCKET_BYTES of one dtype (a larger parameter is a bucket of its own), and each
bucket's elements, laid end to end, are cut into R ranges as equal as whole
elements allow (copy r's: [r·M//R, (r+1)·M//R)). A parameter may so be cut
between copies, at an element; a one-element parameter falls to one copy. The
optimizer is built over the pieces, flat views of the parameters' own storage
(on a CPU each in slices of at most SLICE_BYTES, so that its step's temporaries
are a slice's), so its step writes the weights in place; each piece's gradient is the same
view of the whole gradient. sgd, adam and adamw are element-wise, so each
element takes the update it takes unsharded.

The gather after the step goes bucket by bucket, each in rounds of an
all-gather among the copies of at most GATHER_BYTES received (each copy's
range padded to the longest), so it holds little besides the weights.
Only the optimizer state is sharded: the gradients stay whole,
as DeepSpeed keeps them under a pipeline (they accumulate over micro-batches),
so clipping, fp16's unscale and inf check and tied weights' sums are as
unsharded.

A checkpoint holds the state unsharded, under the model's names (gpipe.state):
`snapshot_entries` says which tensors it will have (on the meta device) and
`rounds` gathers one of them on replica 0, a round of GATHER_BYTES at a time,
when its writer reaches it (gpipe.worker.state_stream.Outgoing writes each
round where it goes in the file), so no copy ever holds the whole stage's
state, nor a whole tensor of it; the other copies `contribute` the same
tensors in the same order. `restore` takes each piece's slice of the whole
tensors a checkpoint holds, so a job resumes sharded or not, on any replica
count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpipe.memory import meter

BUCKET_BYTES = 25 << 20  # as DistributedDataParallel's bucket_cap_mb: the gradient reducer's too (gpipe.worker.dataplane.reducer)
GATHER_BYTES = 4 << 20  # the most a gather receives at once on a CPU (what glibc's arenas keep)
GATHER_BYTES_CUDA = 64 << 20  # on a GPU (the caching allocator reuses it; NCCL's rounds are latency-bound)
# On a CPU, the most bytes of one parameter of the inner optimizer: a piece is stepped in slices of at most this,
# so the step's temporaries (adam's denominator: two at once) are a slice's, not a piece's (see ShardedOptimizer).
SLICE_BYTES = 4 << 20


def _gather_bytes(device: torch.device) -> int:
    return GATHER_BYTES_CUDA if device.type == "cuda" else GATHER_BYTES


def _slice_elements(t: torch.Tensor) -> int | None:
    """The most elements a slice of the inner optimizer holds (None: a piece whole, on a GPU)."""
    return None if t.device.type == "cuda" else max(1, SLICE_BYTES // t.element_size())

# Gathers the copies' tensors (the same shape on each), in replica order: on every copy with `everyone`, else on
# replica 0 only (None on the others). gpipe.transport.Transport.gather_copies.
Gather = Callable[[torch.Tensor, bool], "list[torch.Tensor] | None"]


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of parameter `param` (flat), held by one copy."""

    param: int
    lo: int
    hi: int


class Cut:
    """Which elements of a stage's parameters each of R copies updates (see the module's docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], replicas: int, bucket_bytes: int = BUCKET_BYTES):
        self.replicas = replicas
        self.numel = [p.numel() for p in params]
        # buckets: (first param, one past the last) of consecutive parameters of one dtype
        self.buckets: list[tuple[int, int]] = []
        size = 0
        for i, p in enumerate(params):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or size + nbytes > bucket_bytes or params[self.buckets[-1][0]].dtype != p.dtype:
                self.buckets.append((i, i))
                size = 0
            self.buckets[-1] = (self.buckets[-1][0], i + 1)
            size += nbytes

    def bounds(self, b: int) -> list[int]:
        """Bucket `b`'s R+1 cut points, in its elements laid end to end."""
        first, end = self.buckets[b]
        total = sum(self.numel[first:end])
        return [r * total // self.replicas for r in range(self.replicas + 1)]

    def pieces(self, b: int, replica: int) -> Iterator[Piece]:
        """Copy `replica`'s pieces of bucket `b`, in order."""
        first, end = self.buckets[b]
        bounds = self.bounds(b)
        lo, hi = bounds[replica], bounds[replica + 1]
        at = 0
        for i in range(first, end):
            n = self.numel[i]
            a, z = max(lo, at), min(hi, at + n)
            if a < z:
                yield Piece(i, a - at, z - at)
            at += n

    def mine(self, replica: int) -> list[Piece]:
        return [pc for b in range(len(self.buckets)) for pc in self.pieces(b, replica)]

    def sizes(self) -> list[int]:
        """Each copy's elements in all: as equal as whole elements allow (at most one apart per bucket)."""
        return [sum(pc.hi - pc.lo for pc in self.mine(r)) for r in range(self.replicas)]


def held(layers: torch.nn.Module, replicas: int, replica: int) -> dict[str, tuple[int, int]]:
    """Per parameter of a stage's layers (by name, as the stage names them), the elements [lo, hi) whose optimizer
    state copy `replica` keeps ((0, 0): none): what it takes of a checkpoint's state when it resumes."""
    named = [(n, p) for n, p in layers.named_parameters() if p.requires_grad]  # the stage's own order
    out = {n: (0, 0) for n, _ in named}
    for pc in Cut([p for _, p in named], replicas).mine(replica):
        out[named[pc.param][0]] = (pc.lo, pc.hi)
    return out


def _flat(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"optimizer.shard: parameter {name} is not contiguous in memory; it cannot be cut "
                         "into flat pieces")
    return t.detach().view(-1)


def _scalar_dtype() -> torch.dtype:
    """The dtype torch.optim keeps adam's step in (float32, or float64 under a float64 default)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def state_layout(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> dict[str, bool]:
    """The tensors `cls` keeps per parameter once it has stepped: key -> whether it is one number (adam's step)
    rather than a tensor of the parameter's shape. Found by stepping it once on a throwaway parameter."""
    p = torch.zeros(2, requires_grad=True)
    p.grad = torch.zeros(2)
    opt = cls([p], **kwargs)
    opt.step()
    return {k: v.dim() == 0 for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}


class ShardedOptimizer:
    """Copy `replica` of R's share of a stage's optimizer (see the module's docstring); `names` name the
    parameters in errors."""

    def __init__(self, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], params: Sequence[torch.Tensor],
                 names: Sequence[str], replicas: int, replica: int, gather: Gather):
        self.params, self.replica, self.gather = list(params), replica, gather
        self.cut = Cut(self.params, replicas)
        self.mine = self.cut.mine(replica)
        # per parameter, each copy's range of it ((0, 0): none; one range, a parameter being in one bucket)
        self.spans = [[(0, 0)] * replicas for _ in self.params]
        for r in range(replicas):
            for pc in self.cut.mine(r):
                self.spans[pc.param][r] = (pc.lo, pc.hi)
        flats = [_flat(p, n) for p, n in zip(self.params, names, strict=True)]
        self.views = [flats[pc.param][pc.lo:pc.hi] for pc in self.mine]
        # The inner optimizer's parameters: each piece in slices of at most SLICE_BYTES on a CPU (a piece whole on
        # a GPU). A half parameter's temporaries fell below glibc's mmap threshold where the whole parameter's
        # (unsharded) were mapped and unmapped: kept in the heap, they grew the peak step after step.
        # (piece index, offset in the piece) per slice.
        self.slices: list[torch.Tensor] = []
        self.place: list[tuple[int, int]] = []
        for n, v in enumerate(self.views):
            most = _slice_elements(v) or v.numel()
            for at in range(0, v.numel(), most):
                self.slices.append(v[at:at + most])
                self.place.append((n, at))
        self.layout = state_layout(cls, kwargs)
        # A copy may hold no piece (fewer elements than copies): a throwaway parameter keeps its param_groups
        # (the LR is set through them) and is never stepped.
        self.inner = cls(self.slices or [torch.zeros(0)], **kwargs)
        self.prefilled = self._prefill()
        self.waiting: Callable[[str], None] = lambda what: None  # told before each wait on the other copies

    def _prefill(self) -> bool:
        """adam and adamw begin each parameter's state as zeros and step 0, made at its first gradient: made here
        instead, once, each kind laid end to end in one tensor of this copy's elements. The state is then one
        block made before any step's passing tensors (on a CPU, glibc otherwise places the pieces' state among
        them, and a process's peak grows by what it cannot reuse), and the math is that of the lazy start."""
        views = self.slices
        if not views or not isinstance(self.inner, torch.optim.Adam | torch.optim.AdamW) or \
                len({(v.dtype, v.device) for v in views}) != 1:
            return False
        total = sum(v.numel() for v in views)
        blocks = {key: views[0].new_zeros(total) for key, scalar in self.layout.items() if not scalar}
        at = 0
        for v in views:
            state = {key: block[at:at + v.numel()] for key, block in blocks.items()}
            # adam's step where it keeps it (capturable and fused off, as a job's optimizer runs): a number on the CPU
            state |= {key: torch.tensor(0.0, dtype=_scalar_dtype()) for key, scalar in self.layout.items() if scalar}
            self.inner.state[v] = state
            at += v.numel()
        return True

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No gradients, on the whole parameters (the pieces hold theirs only during a step)."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """This copy's share of the step, from the whole gradients; then every copy gathers the others' weights."""
        for piece, (n, at) in zip(self.slices, self.place, strict=True):
            pc = self.mine[n]
            g = self.params[pc.param].grad
            piece.grad = None if g is None else g.detach().view(-1)[pc.lo + at:pc.lo + at + piece.numel()]
        if self.slices:
            if self.slices[0].device.type == "cpu":  # what the backwards freed, not under the step's temporaries
                meter.give_back()
            self.inner.step()
        for piece in self.slices:
            piece.grad = None
        self.waiting("the other replicas' updated weights")
        self._gather_weights()
        if self.params and self.params[0].device.type == "cpu":
            # The slices' temporaries and the gather's rounds, below glibc's mmap threshold, are freed into the
            # heap after the backward has taken what it needs there: kept, they grew the worker's peak step
            # after step (+110 MiB in 30 steps, docs/memory.md). Handed back, the next step's backward finds
            # the heap as it was (some 10 ms a step for 60 MiB; an unsharded step maps its whole-parameter
            # temporaries on their own instead).
            meter.give_back()

    def _gather_weights(self) -> None:
        """Every copy's updated elements to every copy, a bucket at a time, each in rounds of at most GATHER_BYTES
        (on a GPU, GATHER_BYTES_CUDA) received (what the gather holds besides the weights: a bucket's copy, R times over, would cost more than
        the sharded state saves on a stage of small parameters)."""
        cut = self.cut
        for b in range(len(cut.buckets)):
            bounds = cut.bounds(b)
            lens = [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)]
            first = self.params[cut.buckets[b][0]]
            step = max(1, _gather_bytes(first.device) // (cut.replicas * first.element_size()))
            for j in range(0, max(lens), step):
                n = min(step, max(lens) - j)
                send = first.new_empty(n)
                mine = bounds[self.replica] + j, bounds[self.replica] + min(j + n, lens[self.replica])
                for i, lo, hi, at in self._segments(b, *mine):
                    send[at:at + hi - lo].copy_(self.params[i].detach().view(-1)[lo:hi])
                got = self.gather(send, True)
                assert got is not None  # everyone
                with torch.no_grad():
                    for r, part in enumerate(got):
                        if r != self.replica:
                            theirs = bounds[r] + j, bounds[r] + min(j + n, lens[r])
                            for i, lo, hi, at in self._segments(b, *theirs):
                                self.params[i].view(-1)[lo:hi].copy_(part[at:at + hi - lo])

    def _segments(self, b: int, lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
        """Elements [lo, hi) of bucket `b` laid end to end, by parameter: (parameter, its lo, its hi, the offset
        from `lo`)."""
        first, end = self.cut.buckets[b]
        at = 0
        for i in range(first, end):
            n = self.cut.numel[i]
            a, z = max(lo, at), min(hi, at + n)
            if a < z:
                yield i, a - at, z - at, a - lo
            at += n

    # -- checkpoints -----------------------------------------------------------------------------------

    def _stepped(self) -> list[bool]:
        """Whether the optimizer keeps state for each parameter: the copies that hold its pieces know, the others
        are told (one all-gather of a flag per parameter)."""
        self.waiting("the other replicas' list of the optimizer's state, for a checkpoint")
        flags = torch.zeros(len(self.params), dtype=torch.uint8,
                            device=self.params[0].device if self.params else "cpu")
        for piece, (n, _) in zip(self.slices, self.place, strict=True):
            state = self.inner.state.get(piece)
            if state and not (self.prefilled and float(state["step"]) == 0):  # prefilled: stepped once at least
                flags[self.mine[n].param] = 1
        got = self.gather(flags, True)
        assert got is not None
        return [bool(v) for v in torch.stack(got).amax(0).tolist()]

    def snapshot_entries(self, saved: Sequence[bool]) -> dict[tuple[int, str], torch.Tensor]:
        """(parameter, key) -> the whole tensor the checkpoint will hold, on the meta device, for every parameter
        the optimizer keeps state for and the stage saves (`saved`, per parameter: not a tied weight's copy that
        another stage saves). Every copy calls it at the same point."""
        out: dict[tuple[int, str], torch.Tensor] = {}
        for i, stepped in enumerate(self._stepped()):
            if not stepped or not saved[i]:
                continue
            p = self.params[i]
            for key, scalar in self.layout.items():
                dtype = _scalar_dtype() if scalar else p.dtype  # what fetch() returns: one source
                out[i, key] = torch.empty(() if scalar else p.shape, dtype=dtype, device="meta")
        return out

    def fetch(self, i: int, key: str, scalar: bool) -> torch.Tensor | None:
        """The whole tensor `key` of parameter `i`, on the CPU on replica 0 (None on the others, which take part
        all the same), put together out of `rounds`. Every copy calls it for the same tensors in the same order."""
        p = self.params[i]
        whole = None if scalar or self.replica != 0 else torch.empty(p.numel(), dtype=p.dtype)
        for at, part in self.rounds(i, key, scalar):
            if whole is None:
                return part  # a number: one round
            whole[at:at + part.numel()].copy_(part)
        return whole.view(p.shape) if whole is not None else None

    def rounds(self, i: int, key: str, scalar: bool) -> Iterator[tuple[int, torch.Tensor]]:
        """Tensor `key` of parameter `i` gathered to replica 0 in rounds of at most GATHER_BYTES received: on replica
        0, each round's parts as (element offset in the flat tensor, its elements on the CPU), no part repeated, every
        element in one (a number: (0, it), once); on the others, nothing, their parts sent. Every copy iterates it
        to its end, for the same tensors in the same order. A checkpoint so never holds more of a tensor at once
        (gpipe.worker.state_stream.Outgoing writes each part where it goes)."""
        p = self.params[i]
        self.waiting(f"replica 0's checkpoint of the optimizer's {key} of parameter {i}")
        own = next((n for n, pc in enumerate(self.mine) if pc.param == i), None)
        # this copy's slices of parameter i that hold `key`: (offset in its piece, the state tensor)
        held = [(at, st[key]) for piece, (n, at) in zip(self.slices, self.place, strict=True)
                if n == own and key in (st := self.inner.state.get(piece, {}))]
        if scalar:
            value = held[0][1] if held else None
            send = torch.tensor([float(value) if value is not None else 0.0, float(value is not None)],
                                dtype=torch.float64, device=p.device)
            got = self.gather(send, False)
            if got is not None:
                yield 0, torch.tensor(next(float(g[0]) for g in got if float(g[1])), dtype=_scalar_dtype())
            return
        spans = self.spans[i]
        width = max(hi - lo for lo, hi in spans)
        step = max(1, _gather_bytes(p.device) // (self.cut.replicas * p.element_size()))
        for j in range(0, width, step):
            n = min(step, width - j)
            send = p.new_zeros(n)
            for at, t in held:  # the slices' elements within [j, j + n) of this copy's piece
                lo, hi = max(j, at), min(j + n, at + t.numel())
                if lo < hi:
                    send[lo - j:hi - j].copy_(t[lo - at:hi - at])
            got = self.gather(send, False)
            del send
            if got is None:
                continue
            for r, (lo, hi) in enumerate(spans):
                k = max(0, min(n, hi - lo - j))
                if k:
                    yield lo + j, got[r][:k].cpu()
            del got

    def _slice(self, v: Any, pc: Piece) -> Any:
        """A piece's own copy of a checkpoint's state value: a number as it is; of a tensor, the piece's slice (the
        whole tensor, or the slice alone, as a resumed worker keeps it: zero.held); each piece its own tensors
        (adam counts its step in place: a shared one would count twice)."""
        if not isinstance(v, torch.Tensor):
            return v
        if v.dim() == 0:
            return v.clone()
        flat = v.reshape(-1)
        if flat.numel() == self.cut.numel[pc.param]:
            flat = flat[pc.lo:pc.hi]
        if flat.numel() != pc.hi - pc.lo:
            raise ValueError(f"a checkpoint's optimizer tensor of {v.numel()} elements for a parameter of "
                             f"{self.cut.numel[pc.param]}")
        return flat.clone()

    def restore(self, entries: dict[int, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        """Load a checkpoint's optimizer state: per parameter index, its whole tensors (and numbers) by key; each
        piece takes its slice."""
        pieces: dict[int, dict[str, Any]] = {}
        for n, pc in enumerate(self.mine):
            entry = entries.get(pc.param)
            if entry:
                pieces[n] = {k: self._slice(v, pc) for k, v in entry.items()}
        # per slice, its part of its piece's values (a number its own copy: adam counts its step in place)
        state: dict[int, dict[str, Any]] = {}
        for k, (piece, (n, at)) in enumerate(zip(self.slices, self.place, strict=True)):
            if n in pieces:
                state[k] = {key: v[at:at + piece.numel()] if isinstance(v, torch.Tensor) and v.dim() else
                            v.clone() if isinstance(v, torch.Tensor) else v for key, v in pieces[n].items()}
        if self.prefilled:  # into the blocks made already
            for k, values in state.items():
                own = self.inner.state[self.slices[k]]
                if set(values) != set(own):
                    raise ValueError(f"a checkpoint's optimizer state has {sorted(values)}, not {sorted(own)}")
                for key, v in values.items():
                    own[key].copy_(v)
            for g, saved in zip(self.inner.param_groups, groups, strict=True):
                g.update({k: v for k, v in saved.items() if k != "params"})
            return
        count = len(self.inner.param_groups[0]["params"])
        self.inner.load_state_dict({"state": state if self.slices else {},
                                    "param_groups": [{**g, "params": list(range(count))} for g in groups]})
