"""Activation memory: the bytes a stage holds for its backward, counted exactly.

Autograd's saved-tensor hooks see every tensor kept for backward; the stage
adds what it stashes itself (a micro-batch's input and output). Storages are
counted once however many tensors view them, and parameters not at all, so the
figure is the activation memory the schedule and checkpointing decide, on any
device, without sampling.

Two ways to count, one tally: `hooks()` wraps each saved tensor in a handle
that stops counting it when autograd lets it go (so a split backward can let
go of part of a graph it keeps: `releasing`); `counting(key)` counts a
micro-batch's saved tensors, with no handle, until `release(key)` at the end of
the backward that frees its graph whole, some 3 us a tensor less, the stage's
path when its backward is not split. The two agree but for a tensor saved by a
branch the forward itself lets go of (a statistic computed and dropped):
`counting` holds it until the backward, an upper bound.

`counting` and `checking` (no count) keep autograd's version check, which any
saved-tensor hook turns off: a saved tensor changed in place before its
backward fails it, as on one device, but for `exempt` storages (the stage's
buffers: BatchNorm's running statistics, which the next micro-batch's forward
updates under an earlier one's graph, and which its backward does not read).

What an action makes for a while and lets go of (a loss's copies of its
logits, the gradients its backward makes) is not saved for a backward: `Made`
counts every storage torch makes while it is on, until it is freed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class ActivationMeter:
    """Counts the activations of a stage, or of the model chunks of a worker (gpipe.turns), which share one: a
    lock keeps their counts apart from one another's threads."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self._skip = {storage_key(p) for p in params}
        self._live: dict[int, list[int]] = {}  # storage ptr -> [bytes, references]
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0
        self._releasing = False
        # counting(): each key's storages (one entry per saved tensor), and the key now counted under
        self._records: dict[Hashable, list[int]] = {}
        self._open: list[int] = []
        self.exempt: set[int] = set()  # storages changed in place between a forward and its backward, rightly
        self._counting = torch.autograd.graph.saved_tensors_hooks(self._pack, _checked)
        # Saved tensors uncounted, with the version check (a stage with buffers, on a step that does not count).
        self.checking = torch.autograd.graph.saved_tensors_hooks(self._pack_checked, _checked)

    def skip(self, params: Sequence[torch.Tensor]) -> None:
        """Count `params` not (the weights of another model chunk that shares this meter)."""
        self._skip |= {storage_key(p) for p in params}

    @contextlib.contextmanager
    def releasing(self) -> Iterator[None]:
        """A context under which a saved tensor that is unpacked is dropped: its storage is freed, and no longer
        counted, once nothing else holds it (gpipe.split_backward: what W will not unpack, after B)."""
        self._releasing = True
        try:
            yield
        finally:
            self._releasing = False

    def reset_peak(self) -> None:
        self.peak = self.current

    def held(self) -> dict[int, int]:
        """What is counted now: storage (storage_key) -> its bytes."""
        with self._lock:
            return {ptr: entry[0] for ptr, entry in self._live.items()}

    def hold(self, t: torch.Tensor) -> _Held:
        """Count `t` until the returned handle is dropped."""
        return _Held(self, t)

    def _add(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            entry = self._live.get(ptr)
            if entry is None:
                self._live[ptr] = [nbytes, 1]
                self.current += nbytes
                self.peak = max(self.peak, self.current)
            else:
                entry[1] += 1

    def _drop(self, ptr: int) -> None:
        with self._lock:
            entry = self._live[ptr]
            entry[1] -= 1
            if entry[1] == 0:
                del self._live[ptr]
                self.current -= entry[0]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A context under which autograd's saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self.hold, _Held.unpack)

    def counting(self, key: Hashable) -> torch.autograd.graph.saved_tensors_hooks:
        """A context under which autograd's saved tensors are counted under `key` until `release(key)`: for a
        graph freed whole by its backward (not kept, as a split backward's B keeps it), which then releases it."""
        self._open = self._records.setdefault(key, [])
        return self._counting

    def add(self, key: Hashable, tensors: Iterable[torch.Tensor]) -> None:
        """Count `tensors` under `key` too (what the stage stashes itself for the backward)."""
        self._open = self._records.setdefault(key, [])
        for t in tensors:
            self._pack(t)

    def release(self, key: Hashable) -> None:
        """What was counted under `key` is let go."""
        ptrs = self._records.pop(key, None)
        if ptrs:
            for ptr in ptrs:
                self._drop(ptr)

    def release_all(self, keep: Callable[[Hashable], bool] = lambda key: False) -> None:
        """Everything counted under keys `keep` does not keep is let go (a failed step's micro-batches)."""
        for key in [k for k in list(self._records) if not keep(k)]:  # (list(): another chunk may release its own)
            self.release(key)

    def _pack(self, t: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, int]:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self._skip:  # not a parameter (or a view of one), not empty or on the meta device
            with self._lock:  # _add's, inline: this runs for every tensor a forward saves
                entry = self._live.get(ptr)
                if entry is None:
                    self._live[ptr] = [storage.nbytes(), 1]
                    self.current += storage.nbytes()
                    if self.current > self.peak:
                        self.peak = self.current
                else:
                    entry[1] += 1
            self._open.append(ptr)
        return self._saved(t, ptr)

    def _pack_checked(self, t: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, int]:
        return self._saved(t, t.untyped_storage().data_ptr())

    def _saved(self, t: torch.Tensor, ptr: int) -> torch.Tensor | tuple[torch.Tensor, int]:
        """What autograd keeps of `t` (storage `ptr`) for `_checked`: detached, since a saved output (ReLU's) would
        otherwise hold its own grad_fn, which holds it, a cycle through autograd's nodes never freed; with its
        version (the detached view shares the counter) but for a parameter and an exempt storage."""
        if ptr in self._skip:
            return t if t.is_leaf else t.detach()
        return t.detach() if not ptr or ptr in self.exempt else (t.detach(), t._version)


def _checked(saved: torch.Tensor | tuple[torch.Tensor, int]) -> torch.Tensor:
    """A saved tensor back for the backward, failing it as autograd does if it was changed in place since."""
    if type(saved) is not tuple:
        return saved  # type: ignore[return-value]  # a tensor: a parameter's, an exempt one
    t, version = saved
    if t._version != version:
        raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
                           f"{version} instead (saved by the stage's forward, changed in place before its backward)")
    return t


class _Held:
    __slots__ = ("tensor", "_meter", "_ptr", "_owner", "_version")

    def __init__(self, meter: ActivationMeter, t: torch.Tensor):
        # Detached: a saved output (ReLU's) would otherwise hold its own grad_fn, which holds this handle: a
        # cycle through autograd's nodes that nothing frees once a backward keeps the graph (retain_graph, as
        # the split backward's B does: gpipe.split_backward).
        self.tensor: torch.Tensor | None = t.detach()
        self._meter: ActivationMeter | None = None
        self._owner = meter
        ptr = storage_key(t)
        # autograd's version check, which the hook turns off (the module's docstring), but for exempt storages
        self._version = None if ptr in meter._skip or ptr in meter.exempt else t._version
        if ptr and ptr not in meter._skip:
            self._meter, self._ptr = meter, ptr
            meter._add(ptr, t.untyped_storage().nbytes())

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t is None:
            raise RuntimeError("a saved tensor released after the split backward's B was needed again")
        if self._version is not None and t._version != self._version:
            _checked((t, self._version))  # raises
        if self._owner._releasing:  # unpacked to be let go (ActivationMeter.releasing)
            self.tensor = None
            self._del()
        return t

    def _del(self) -> None:
        if self._meter is not None:
            self._meter._drop(self._ptr)
            self._meter = None

    def __del__(self) -> None:
        if self._meter is not None:
            self._meter._drop(self._ptr)


def storage_key(t: torch.Tensor) -> int:
    """Which storage `t` views, as a number: its address (0 for an empty one); on the meta device, which holds no
    data, the storage object's own (so a model built there is counted as one in memory would be)."""
    storage = t.untyped_storage()
    ptr: int = storage.data_ptr()
    return ptr if ptr or t.device.type != "meta" else int(storage._cdata)


class Made(TorchDispatchMode):  # type: ignore[no-untyped-call]  # (torch's mode is unannotated)
    """What torch makes while it is on, on this thread, counted by storage until it is freed: `now`, the bytes
    made and still alive, and `peak`, the most at once. A storage an op returns is made there unless an input
    has it (a view, an operation in place); what exists before counts not at all. So the work of an action (a
    loss's log-softmax and the gradients its backward makes, on any device, the meta device too) is torch's own
    tensors, not a process's resident memory. An op's temporaries inside its kernel are not seen. `meta`: whether
    tensors on the meta device count (a model measured there: gpipe.memory.footprint), or not (they hold no
    memory: a checkpoint's shapes)."""

    def __init__(self, meta: bool = True) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._live: dict[int, int] = {}
        self.now = 0
        self.peak = 0
        self.meta = meta

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and (self.meta or not t.is_meta)]
        if made:
            given = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in made:
                key = storage_key(t)
                if key and key not in given and key not in self._live:
                    storage = t.untyped_storage()
                    self._live[key] = n = storage.nbytes()
                    self.now += n
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key: int) -> None:
        self.now -= self._live.pop(key, 0)


def resident_peak_bytes(pid: int | str = "self") -> int:
    """A process's peak resident memory (VmHWM in /proc/<pid>/status); 0 where there is no such file."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes() -> int:
    """This process's resident memory now (the second field of /proc/self/statm, in pages: one read of a short
    file, some microseconds); 0 where there is no such file."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def map_apart(threshold: int = 1 << 20) -> None:
    """Have glibc map each allocation of `threshold` bytes or more on its own, so that freeing it gives it
    back to the system. A process that passes many pieces of state along (on many threads, each with its
    own arena) otherwise keeps what the pieces took, arena after arena. No effect elsewhere than glibc."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def give_back() -> None:
    """Hand the free memory of every malloc arena back to the system (glibc's malloc_trim): the stages' heaps
    are never trimmed on their own (gpipe.worker.agent's MALLOC_TRIM_THRESHOLD_). No effect elsewhere than glibc."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, looked up once (a worker trims a few times a step); None elsewhere than glibc."""
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
