"""A stage's state in and out in bounded pieces (gpipe.stream), never in one message.

In: before a stage starts, the coordinator sends its weights (`init: exact`)
or a checkpoint's slice (resume) a piece at a time, straight into the layers
built here, and the checkpoint's optimizer and RNG tensors into buffers
declared first. Out: at a checkpoint the stage writes its state out to a
local file between two steps (the only pause training sees: Outgoing), and
the coordinator's writer pulls it a piece at a time while the next steps
run; the file is dropped once every piece is taken.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from typing import IO, Any

import torch
from torch import nn

from gpipe import state as layout
from gpipe import stream
from gpipe.memory import meter as memory
from gpipe.state import StageState


class Incoming:
    """The tensors a stage is sent before it starts: its layers' (model/<name>) and a checkpoint's others."""

    def __init__(self, layers: nn.Sequential, held: dict[str, tuple[int, int]] | None = None):
        """`held`: with the optimizer sharded (gpipe.memory.zero), the elements [lo, hi) of each parameter (by name) whose
        optimizer state this copy of the stage keeps; only those of a checkpoint's optim/<param>/... tensors are
        held, the rest of each piece let go as it comes."""
        self.layers = layers
        self.held = held
        self.params = dict(layers.named_parameters())
        # every name, a tensor two pieces share too (a tied weight, a captured constant): each is sent under each
        own = dict(layers.named_parameters(remove_duplicate=False)) | dict(layers.named_buffers(remove_duplicate=False))
        self.targets: dict[str, torch.Tensor] = {layout.model_key(n): t for n, t in own.items()}
        self.others: dict[str, torch.Tensor] = {}
        self.windows: dict[str, tuple[int, int]] = {}  # a held slice's tensor: (its first byte, the whole's bytes)
        self.received: dict[str, int] = {}
        self._lock = threading.Lock()  # two messages may be received at once, on two RPC threads

    def expect(self, entries: dict[str, tuple[str, list[int]]]) -> None:
        """Make room for tensors that are not the layers' (optim/..., rng/...): name -> (safetensors dtype, shape)."""
        for name, (dtype, shape) in entries.items():
            if name.startswith(layout.MODEL):
                raise ValueError(f"{name}: weights go into the layers, not into declared tensors")
            if (window := self._window(name, shape)) is not None:
                lo, hi = window
                self.others[name] = torch.empty(hi - lo, dtype=stream.BY_NAME[dtype])
                self.windows[name] = (lo * self.others[name].element_size(), stream.nbytes(
                    torch.empty(shape, dtype=stream.BY_NAME[dtype], device="meta")))
            else:
                self.others[name] = torch.empty(shape, dtype=stream.BY_NAME[dtype])
            self.targets[name] = self.others[name]

    def _window(self, name: str, shape: list[int]) -> tuple[int, int] | None:
        """The elements [lo, hi) of optimizer tensor `name` this copy holds; None: all of it (a number, or the
        optimizer is not sharded)."""
        if self.held is None or not name.startswith(layout.OPTIM) or not shape:
            return None
        param = name.removeprefix(layout.OPTIM).rsplit("/", 1)[0]
        p = self.params.get(param)
        if p is None or p.shape != tuple(shape):
            raise ValueError(f"{name}: shape {list(shape)}, but the stage's parameter {param} is "
                             f"{list(p.shape) if p is not None else 'not here'}")
        return self.held.get(param, (0, 0))

    def receive(self, pieces: list[stream.Piece]) -> None:
        """Copy pieces into their tensors (a held slice: the piece's bytes within it)."""
        for name, offset, data in pieces:
            t = self.targets.get(name)
            if t is None:
                raise ValueError(f"{name}: no such tensor in this stage")
            if name in self.windows:
                start, whole = self.windows[name]
                if offset < 0 or offset + len(data) > whole:
                    raise ValueError(f"a piece of {len(data)} bytes at {offset} overruns a tensor of {whole} bytes")
                lo, hi = max(offset, start), min(offset + len(data), start + stream.nbytes(t))
                if lo < hi:
                    stream.write_piece(t, lo - start, data[lo - offset:hi - offset])
            else:
                stream.write_piece(t, offset, data)
            with self._lock:
                self.received[name] = self.received.get(name, 0) + len(data)

    def finish(self, json_state: dict[str, Any] | None, weights_sent: bool) -> StageState | None:
        """Check that every tensor came whole (the layers' too, when `weights_sent`); the resumed state, if any."""
        for name, t in self.targets.items():
            size = self.windows[name][1] if name in self.windows else stream.nbytes(t)
            if (weights_sent or name in self.others) and self.received.get(name, 0) != size:
                raise ValueError(f"{name}: {self.received.get(name, 0)} of its {size} bytes came")
        # The pieces came into buffers on the RPC threads, each freed into its thread's arena and kept there (some
        # 100-200 MiB in all): give them back before the first step allocates the gradients.
        memory.give_back()
        if json_state is None:
            return None
        return StageState(self.others, json_state)


IN_MEMORY_BYTES = 4 << 20  # a stage's state up to this is copied into memory; more goes to a local file


class Outgoing:
    """One checkpoint's copy of a stage's state, handed out piece by piece.

    Up to IN_MEMORY_BYTES, the copy-out is a copy in memory: the shortest
    pause, for the price of a copy held until the pieces are pulled, while
    the next steps run: it adds to the worker's peak (a GPT-2 token job's
    worker, its 78 MiB state copied so, peaked 33 MiB higher from the first
    checkpoint on, docs/memory.md), so only a few MiB go that way. Past it, the live tensors
    (a GPU's one at a time through the host) are written into a local file
    with no name (it goes with the process), in the page cache: the stage's
    resident memory does not grow by a copy of its state, however long the
    pieces take to be pulled, and the pause is that of the write. A state
    with tensors that come in parts (a sharded optimizer's, gathered from the
    stage's copies: StageState.rounds) goes to the file whatever its size,
    each part written where it goes as it comes: the whole state, or a whole
    tensor of it, is never in this process.
    """

    def __init__(self, step: int, st: StageState):
        self.step, self.json_state = step, st.json_state
        self.header, self.data_bytes = stream.header(st.tensors)
        self.count = -(-self.data_bytes // stream.PIECE_BYTES)
        self.served: set[int] = set()  # pieces taken (two may be pulled at once, and end in any order)
        self.order = sorted(st.tensors)
        self.file: IO[bytes] | None = None
        self.copies: list[torch.Tensor] = []
        deferred = [name for name in self.order if st.deferred(name)]
        if self.data_bytes <= IN_MEMORY_BYTES and not deferred:
            self.copies = [stream.as_bytes(stream.check_against(st.tensors[n], n, st.tensor(n)).detach()
                                           .to("cpu", copy=True).contiguous()) for n in self.order]
            return
        self.file = tempfile.TemporaryFile(prefix="gpipe-checkpoint-")
        fd, at = self.file.fileno(), 0  # where the tensor starts in the data
        for name in self.order:
            declared = st.tensors[name]
            if st.deferred(name):
                _write_parts(fd, at, name, declared, st)
            else:
                t = stream.check_against(declared, name, st.tensor(name)).detach()
                t = (t.cpu() if t.device.type != "cpu" else t).contiguous()
                if t.numel():
                    _pwrite_all(fd, stream.numpy_bytes(t), at)
            at += stream.nbytes(declared)

    def describe(self) -> dict[str, Any]:
        """What the coordinator needs before the pieces: the header, the data's length, the JSON state."""
        return {"step": self.step, "header": self.header, "data_bytes": self.data_bytes,
                "pieces": self.count, "json_state": self.json_state}

    def piece(self, index: int) -> torch.Tensor:
        start = index * stream.PIECE_BYTES
        n = min(stream.PIECE_BYTES, self.data_bytes - start)
        if n <= 0:
            raise ValueError(f"checkpoint step-{self.step} has {self.count} pieces, not {index + 1}")
        # A mapping of its own, unmapped when the answer is sent: not kept in an RPC thread's malloc arena.
        buf = torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)
        if self.file is not None:
            if os.preadv(self.file.fileno(), [stream.numpy_bytes(buf)], start) != n:
                raise OSError(f"checkpoint step-{self.step}: piece {index} was cut short")
            return buf
        at = 0  # the copies' bytes from `start` on, across tensors
        for b in self.copies:
            if start < at + len(b) and at < start + n:
                lo, hi = max(start, at), min(start + n, at + len(b))
                buf[lo - start:hi - start].copy_(b[lo - at:hi - at])
            at += len(b)
        return buf

    def close(self) -> None:
        self.copies = []
        if self.file is not None:
            self.file.close()


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    """os.pwrite until all of `data` is written at byte `at` of the file."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], at + done)


def _write_parts(fd: int, at: int, name: str, declared: torch.Tensor, st: StageState) -> None:
    """Tensor `name`, which comes in parts (StageState.rounds), written part by part where each goes in the file
    (its data from byte `at`); each part checked against the header's dtype, and the parts against its size."""
    assert st.rounds is not None
    size, count = declared.element_size(), 0
    for offset, part in st.rounds(name):
        if part.dtype != declared.dtype or offset < 0 or offset + part.numel() > declared.numel():
            raise ValueError(f"{name}: the header declares {stream.DTYPES.get(declared.dtype, declared.dtype)} "
                             f"{list(declared.shape)}, a part written is {stream.DTYPES.get(part.dtype, part.dtype)} "
                             f"[{part.numel()}] at element {offset}")
        part = (part.cpu() if part.device.type != "cpu" else part).contiguous()
        if part.numel():
            _pwrite_all(fd, stream.numpy_bytes(part.reshape(-1)), at + offset * size)
        count += part.numel()
    if count != declared.numel():
        raise ValueError(f"{name}: {count} of its {declared.numel()} elements came")


class Outbox:
    """The stage's checkpoint copy waiting to be pulled: at most one at a time."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._out: Outgoing | None = None

    def put(self, out: Outgoing, timeout: float) -> None:
        """Hold `out`, waiting (at most `timeout` s) while the previous checkpoint is still being pulled."""
        self.wait_free(timeout)  # the stage's executor is the only thread that puts
        with self._cv:
            self._out = out

    def wait_free(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until no checkpoint copy is held."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._out is None, timeout):
                raise TimeoutError(f"checkpoint step-{self._out.step if self._out else '?'} was not taken "
                                   f"within {timeout:.0f}s")

    def piece(self, step: int, index: int) -> torch.Tensor:
        """Piece `index` of checkpoint `step`; once every piece is taken, the copy is dropped."""
        with self._cv:
            out = self._out
        if out is None or out.step != step:
            raise ValueError(f"no checkpoint copy of step {step} is held")
        data = out.piece(index)
        with self._cv:
            out.served.add(index)
            done = len(out.served) == out.count
        if done:
            self.drop(step)
        return data

    def drop(self, step: int | None = None) -> None:
        """Let go of the copy of checkpoint `step` (any, when None)."""
        with self._cv:
            out = self._out
            if out is None or (step is not None and out.step != step):
                return
            self._out = None
            self._cv.notify_all()
        out.close()
