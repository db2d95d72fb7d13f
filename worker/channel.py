"""Point-to-point channels between neighbouring stages (gloo on CPU, NCCL on CUDA).

Each tensor goes as a small fixed-size header (micro-batch, dtype, shape), then
its payload, so the receiver can allocate before the data arrives. A channel
carries one direction of one neighbour pair (activations forward or gradients
backward) on a process group of its own, so the order of operations on any
communicator is the same on both ends: NCCL needs that, gloo is happy with it.

Sends and receives run on one thread each, so compute never waits for a send,
and a receive is posted as soon as the previous one finished: the next
micro-batch is usually already there when the stage needs it. Each send and
receive waits at most the channel's timeout (the step's), whatever timeout
the process group was formed with.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]
MAX_DIMS = 8
HEADER = 3 + MAX_DIMS  # micro-batch, dtype code, ndim, dims...


def _header(mb: int, t: torch.Tensor) -> torch.Tensor:
    if t.dim() > MAX_DIMS:
        raise ValueError(f"a tensor between stages may have at most {MAX_DIMS} dims, got {t.dim()}")
    if t.dtype not in DTYPES:
        raise ValueError(f"dtype {t.dtype} cannot travel between stages")
    h = [mb, DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(h + [0] * (HEADER - len(h)), dtype=torch.int64)


def _send(t: torch.Tensor, peer: int, group: dist.ProcessGroup, timeout: timedelta) -> None:
    work = dist.isend(t, peer, group=group)
    assert work is not None  # this process is in `group`
    work.wait(timeout)


def _recv(t: torch.Tensor, peer: int, group: dist.ProcessGroup, timeout: timedelta) -> None:
    work = dist.irecv(t, peer, group=group)
    assert work is not None
    work.wait(timeout)


class Sender:
    """Sends (micro-batch, tensor) pairs to `peer` in order, on a thread."""

    def __init__(self, peer: int, group: dist.ProcessGroup, device: torch.device, name: str, timeout: float):
        self.peer, self.group, self.device, self.name = peer, group, device, name
        self.timeout = timedelta(seconds=timeout)
        self._q: queue.Queue[tuple[int, torch.Tensor] | None] = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"send-{name}", daemon=True)
        self._thread.start()

    def send(self, mb: int, t: torch.Tensor) -> None:
        if self._error is not None:
            raise self._error
        with self._cv:
            self._pending += 1
        self._q.put((mb, t.contiguous()))

    def flush(self, timeout: float) -> None:
        """Wait until everything queued has been sent."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._pending and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout:.0f}s sending {self.name}")
                self._cv.wait(left)
        if self._error is not None:
            raise self._error

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            mb, t = item
            try:
                _send(_header(mb, t).to(self.device), self.peer, self.group, self.timeout)
                _send(t, self.peer, self.group, self.timeout)
            except BaseException as e:  # the peer is gone: report it at the next send or flush
                self._error = ConnectionError(f"sending {self.name} of micro-batch {mb} failed: {e}")
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()
            if self._error is not None:
                return

    def close(self) -> None:
        self._q.put(None)


class Receiver:
    """Receives (micro-batch, tensor) pairs from `peer`, on a thread, as they arrive."""

    def __init__(self, peer: int, group: dist.ProcessGroup, device: torch.device, name: str, timeout: float):
        self.peer, self.group, self.device, self.name = peer, group, device, name
        self.timeout = timedelta(seconds=timeout)
        self._todo: queue.Queue[int | None] = queue.Queue()
        self._inbox: dict[int, torch.Tensor] = {}
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"recv-{name}", daemon=True)
        self._thread.start()

    def expect(self, count: int) -> None:
        """Receive `count` more tensors (one step's worth)."""
        self._todo.put(count)

    def get(self, mb: int, timeout: float) -> torch.Tensor:
        """The tensor of micro-batch `mb`, waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while mb not in self._inbox:
                if self._error is not None:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"timed out after {timeout:.0f}s waiting for {self.name} of micro-batch {mb}"
                    )
                self._cv.wait(left)
            return self._inbox.pop(mb)

    def _loop(self) -> None:
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        while (count := self._todo.get()) is not None:
            for _ in range(count):
                try:
                    _recv(header, self.peer, self.group, self.timeout)
                    h = header.tolist()
                    mb, dtype, ndim = h[0], DTYPES[h[1]], h[2]
                    t = torch.empty(h[3 : 3 + ndim], dtype=dtype, device=self.device)
                    _recv(t, self.peer, self.group, self.timeout)
                except BaseException as e:
                    with self._cv:
                        self._error = ConnectionError(f"receiving {self.name} failed: {e}")
                        self._cv.notify_all()
                    return
                with self._cv:
                    self._inbox[mb] = t
                    self._cv.notify_all()

    def close(self) -> None:
        self._todo.put(None)
