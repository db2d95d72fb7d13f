"""Point-to-point channels between stages (gloo on CPU, NCCL on CUDA): the data plane's lanes between hosts.

(Between two workers of one host, a CPU lane is a Unix socket: gpipe.worker.dataplane.unix_lane.)

A message is written in the wire format of gpipe.wire (a header, a structure's
JSON description, each tensor's bytes).

On gloo, which takes a transfer into a receive
larger than it, a lane packs a single tensor no larger than the largest single
tensor it has carried so far, up to PACK_MAX_BYTES: both ends know that size
(the lane's capacity, `Capacity`), and the receiver posts one receive of the
header plus that many bytes. So once a lane's first message has set its size,
a message is one transfer, not two, and a size that changes from step to step
still travels (a larger one as header and data apart, which raises the
capacity). Above PACK_MAX_BYTES the copy into and out of the packed buffer
costs more than the second transfer saves. NCCL needs the sizes of a send and
its receive equal: there the capacity stays 0 and every message is its header,
then its data.

A channel carries one direction of one pair of stages (activations forward or
gradients backward) on a process group of its own, so the order of operations
on any communicator is the same on both ends: NCCL needs that, gloo is happy
with it.

A send is posted from the stage's own thread: c10d's isend does not wait for
the peer (on gloo, when the peer's receive is already posted, the calling
thread writes the data to the socket itself), and the stage waits for its
sends at the step's end (`Sender.flush`). On CUDA, a header goes to the device
from pinned memory, without waiting for the stage's kernels.
Receives run on a thread per channel (not on the stage's own, as the peer's
do: a wait there would carry the stage's deadline into c10d, and on gloo a
wait that times out closes the process group's connections, its peers' too,
so the stage's late neighbour would read as a lost one; bench/README.md (s)),
on a CUDA stream of its own: reading a
header waits for that stream (the receive), never for the kernels the stage
has queued on its own; the stage's stream waits for a message's receive (an
event) when it takes the message, and a receive is posted as soon as the
previous one finished: the next micro-batch is usually already there when the
stage needs it. The stage's own waits (`Receiver.get`, `Sender.flush`) have
the step's deadline and name what they waited for. A receive is often posted
before the stage asks for it, so the c10d wait under it has a later backstop
(`backstop_s`): that deadline must not fire first and report gloo's words in
place of ours.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpipe import structure
from gpipe.wire import (
    HEADER_BYTES,
    MAX_JSON_BYTES,
    PACK_MAX_BYTES,
    PACKED,
    STRUCTURE,
    asked_bytes,
    decode,
    encode,
    header_bytes,
    message_limit,
    on_wire,
    read_header,
    tensor_header,
)


def backstop_s(timeout: float) -> float:
    """How long a send or receive on the channel's thread may wait: past the stage's deadline of `timeout`
    seconds, counted from a later moment (the receive for the next micro-batch is posted while this one is
    computed), so that the stage's wait always ends first."""
    return 2 * timeout + 10.0


def _recv(t: torch.Tensor, peer: int, group: dist.ProcessGroup, timeout: timedelta) -> None:
    work = dist.irecv(t, peer, group=group)
    assert work is not None
    work.wait(timeout)


class Capacity:
    """The largest single tensor a lane has carried apart from its header, at most PACK_MAX_BYTES: a tensor no
    larger is packed after its header (the module's docstring). Always 0 on NCCL.

    Both ends must hold the same value before every message: the receiver's buffer must be at least as large
    as what the sender packs (gloo ends the process otherwise). They do, as each end updates it from the same
    messages in the same order: the sender as it posts a message apart, the receiver once it has received it;
    packed messages, structures and empty tensors leave it as it is.
    """

    def __init__(self, backend: str):
        self.bytes = 0
        self._grows = backend == "gloo"

    def packs(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.bytes

    def carried(self, nbytes: int) -> None:
        """A single tensor of `nbytes` went as header and data apart."""
        if self._grows and nbytes <= PACK_MAX_BYTES:
            self.bytes = max(self.bytes, nbytes)


def _packed(header: list[int], t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """One transfer of a header and the `nbytes` of the contiguous tensor `t` after it (gloo: in this host's
    memory), written by two memory copies: a tensor operation per part costs more than the copy on a message's
    path (bench/README.md (x))."""
    assert t.device.type == "cpu" and t.is_contiguous()
    packed = torch.empty(HEADER_BYTES + nbytes, dtype=torch.uint8)
    ctypes.memmove(packed.data_ptr(), header_bytes(header), HEADER_BYTES)
    ctypes.memmove(packed.data_ptr() + HEADER_BYTES, t.data_ptr(), nbytes)
    return packed


class Sender:
    """Sends (micro-batch, value) pairs to `peer` in order: each message's transfers are posted at once (c10d's
    isend returns without waiting for the peer), and waited for at the next send (those done) and at flush,
    under the deadline flush is given."""

    def __init__(self, peer: int, group: dist.ProcessGroup, device: torch.device, name: str):
        self.peer, self.group, self.device, self.name = peer, group, device, name
        self.bytes = 0  # tensor data handed to this channel, headers left out
        # Posted transfers not yet seen done: (micro-batch, the work, the tensor it reads, kept alive until then).
        # At most one step's messages: flush empties it.
        self._posted: collections.deque[tuple[int, dist.Work, torch.Tensor]] = collections.deque()
        self._error: BaseException | None = None
        self.backend = str(dist.get_backend(group))
        self._capacity = Capacity(self.backend)

    def send(self, mb: int, obj: Any, grads: Sequence[bool] = ()) -> None:
        """Post `obj` (see the module docstring); `grads` flags the tensors that want a gradient back.

        ValueError, at once, if `obj` cannot travel; ConnectionError if an earlier message failed.
        """
        if self._error is not None:
            raise self._error
        header, text, leaves = encode(mb, obj, grads, self.backend)
        leaves = [self._here(t) for t in leaves]
        self.bytes += sum(t.numel() * t.element_size() for t in leaves)
        if text is None and self._capacity.packs(nbytes := leaves[0].numel() * leaves[0].element_size()):
            header[3] |= PACKED
            parts = [_packed(header, leaves[0], nbytes)]
        else:
            if text is None:
                self._capacity.carried(nbytes)
            parts = [self._staged(torch.frombuffer(bytearray(header_bytes(header)), dtype=torch.uint8))]
            if text is not None:
                parts.append(self._staged(torch.frombuffer(bytearray(text), dtype=torch.uint8)))
            parts += [on_wire(t, self.backend) for t in leaves if t.numel()]
        with self._failing(mb):
            for t in parts:
                work = dist.isend(t, self.peer, group=self.group)
                assert work is not None  # this process is in `group`
                self._posted.append((mb, work, t))
            while self._posted and self._posted[0][1].is_completed():
                self._posted[0][1].wait()  # raises what the transfer met
                self._posted.popleft()

    def _here(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of the value on the channel's device, where c10d can send it (NCCL moves device memory only):
        as it is, or a copy (detached: what travels is its data)."""
        if t.device == self.device:
            return t
        t = t.detach()
        return self._staged(t) if t.device.type == "cpu" else t.to(self.device)

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU tensor on the channel's device. On CUDA from pinned memory, without blocking: a copy from
        pageable memory would wait for every kernel the stage has queued."""
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def flush(self, timeout: float) -> None:
        """Wait until everything posted has been sent, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        if self._error is not None:
            raise self._error
        while self._posted:
            mb, work, _ = self._posted[0]
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                # Whole milliseconds, rounded up: c10d reads a wait of 0 ms as no deadline at all.
                work.wait(timedelta(milliseconds=max(1, math.ceil(left * 1000))))
            except BaseException as e:
                if time.monotonic() >= deadline:  # the peer never took it: our deadline, in our words
                    raise TimeoutError(f"timed out after {timeout:.0f}s sending {self.name}") from None
                self._error = ConnectionError(f"sending {self.name} of micro-batch {mb} failed: {e}")
                raise self._error from None
            self._posted.popleft()

    @contextlib.contextmanager
    def _failing(self, mb: int) -> Iterator[None]:
        """A transfer that fails: the peer is gone; this message and every later one report it."""
        try:
            yield
        except Exception as e:
            self._error = ConnectionError(f"sending {self.name} of micro-batch {mb} failed: {e}")
            raise self._error from None

    def close(self) -> None:
        self._posted.clear()


class Receiver:
    """Receives (micro-batch, value) pairs from `peer`, on a thread, as they arrive."""

    def __init__(self, peer: int, group: dist.ProcessGroup, device: torch.device, name: str, timeout: float):
        self.peer, self.group, self.device, self.name = peer, group, device, name
        self.timeout = timedelta(seconds=backstop_s(timeout))
        self.bytes = 0  # tensor data received, headers left out
        self._todo: queue.Queue[int | None] = queue.Queue()
        # micro-batch -> (its value, on CUDA the event of its receive on the channel's stream)
        self._inbox: dict[int, tuple[Any, torch.cuda.Event | None]] = {}
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self.backend = str(dist.get_backend(group))
        self._capacity = Capacity(self.backend)
        # On CUDA the receives run on a stream of their own (the module's docstring); None on the CPU.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.limit = message_limit(device)  # the most bytes a message may ask for
        self._thread = threading.Thread(target=self._loop, name=f"recv-{name}", daemon=True)
        self._thread.start()

    def expect(self, count: int) -> None:
        """Receive `count` more messages (one step's worth)."""
        self._todo.put(count)

    def get(self, mb: int, timeout: float) -> Any:
        """The value of micro-batch `mb`, waiting up to `timeout` seconds for it."""
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
            value, received = self._inbox.pop(mb)
        if received is not None:
            # The stage's stream waits for the receive; the memory, once freed, for what the stage queued on it.
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(received)
            for t in structure.tensors(value):
                t.record_stream(stream)
        return value

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, received on this channel, in this host's memory. On CUDA a copy on the channel's stream, waited
        for there alone: the receive that produced `t`, not the device or the kernels the stage has queued."""
        if self._stream is None:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        self._stream.synchronize()
        return host

    def _tensor(self, dtype: torch.dtype, shape: list[int], grad: bool,
                packed: torch.Tensor | None = None) -> torch.Tensor:
        """A tensor as it arrives: its own transfer, or copied from `packed` (its bytes, received with the
        header)."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        if t.numel():
            if packed is None:
                _recv(on_wire(t, self.backend), self.peer, self.group, self.timeout)
            elif packed.device.type == "cpu":  # a memory copy, as _packed wrote it
                ctypes.memmove(t.data_ptr(), packed.data_ptr(), t.numel() * t.element_size())
            else:
                t.reshape(-1).view(torch.uint8).copy_(packed)
            self.bytes += t.numel() * t.element_size()
        return t.requires_grad_() if grad else t

    def _receive(self, buffer: torch.Tensor) -> tuple[int, Any]:
        """One message, its first transfer into `buffer` (the header, and a packed tensor's data after it)."""
        _recv(buffer, self.peer, self.group, self.timeout)
        h = read_header(buffer if self._stream is None else self._host(buffer[:HEADER_BYTES]))
        mb, code, n = h[0], h[1], h[2]
        if code != STRUCTURE:
            dtype, shape, grad, packed = tensor_header(h)
            nbytes = asked_bytes([(dtype, shape)], self.limit)
            if not packed:
                t = self._tensor(dtype, shape, grad)
                self._capacity.carried(nbytes)  # once it has arrived (the module's docstring)
                return mb, t
            if not 0 < nbytes <= len(buffer) - HEADER_BYTES:
                raise ValueError(f"a packed tensor of {nbytes} bytes, over the lane's {len(buffer) - HEADER_BYTES}")
            return mb, self._tensor(dtype, shape, grad, buffer[HEADER_BYTES : HEADER_BYTES + nbytes])
        if not 0 < n <= MAX_JSON_BYTES:
            raise ValueError(f"a structure's description of {n} bytes (at most {MAX_JSON_BYTES})")
        text = torch.empty(n, dtype=torch.uint8, device=self.device)
        _recv(text, self.peer, self.group, self.timeout)
        skeleton, metas = decode(self._host(text).numpy().tobytes())
        asked_bytes([(dtype, shape) for dtype, shape, _ in metas], self.limit)
        return mb, structure.unflatten(skeleton, [self._tensor(*m) for m in metas])

    def _loop(self) -> None:
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
            while (count := self._todo.get()) is not None:
                for _ in range(count):
                    if len(buffer) != HEADER_BYTES + self._capacity.bytes:  # the tensor taken out was copied: reuse
                        buffer = torch.empty(HEADER_BYTES + self._capacity.bytes, dtype=torch.uint8,
                                             device=self.device)
                    try:
                        mb, value = self._receive(buffer)
                    except BaseException as e:
                        with self._cv:
                            self._error = ConnectionError(f"receiving {self.name} failed: {e}")
                            self._cv.notify_all()
                        return
                    received = None
                    if self._stream is not None:
                        received = torch.cuda.Event()  # type: ignore[no-untyped-call]
                        received.record(self._stream)
                    with self._cv:
                        self._inbox[mb] = (value, received)
                        self._cv.notify_all()

    def close(self) -> None:
        self._todo.put(None)
