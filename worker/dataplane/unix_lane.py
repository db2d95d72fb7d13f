"""Lanes between two workers of one host: a Unix domain socket, written and read on the stage's own thread.

A lane between two worker processes of one host (`gpipe-coordinator run`'s
local workers; workers in one pod) need not go through gloo: gloo's per
message cost (its own loop thread, a hand-off to our receive thread, a TCP
connection through loopback) was most of what an action costs over its blocks
alone (bench/README.md (s), (y), (z)). Here a message is one `sendmsg` of its
header, its description and its tensors' memory (no copy on our side), and
the receiver reads the header, then each tensor straight into the memory of
the tensor it returns, on the thread that asked for it: no thread of ours is
on the path of a message the socket takes at once, and nothing waits on a
hand-off. A plain tensor (an activation, a gradient) takes a shorter path: its
header is built and checked once per kind of tensor, and only the micro-batch
is written per message; right after an action's GEMMs each line of Python
costs several times its warm cost (bench/README.md (ab)).

Beside its socket a lane has a ring of shared memory (`Ring`: a sealed memfd
and two eventfds, made by the connecting end and handed over the socket once
the token is in): a message of up to MAX_RING_MESSAGE goes there when the ring
has room, with one copy and an eventfd's write, no socket call. Right after an
action's GEMMs a 128 KiB `sendmsg` took 62-105 us here, its copy into the ring
and the eventfd's write 27-50 (bench/README.md (ad)). A tensor's message is
written by one call of C (worker/dataplane/_ring.c's Writer, built at install where a C
compiler is at hand; `_Writer`, the same bookkeeping in Python, stands in
elsewhere): the send of an activation went from 0.07 to 0.03 ms of its action
(bench/README.md (ae)). The socket still
carries what the ring has no room for, in the lane's order (`Ring`), and says
when the peer's process has ended.

The wire format is gpipe.wire's, checked as gpipe.worker.dataplane.channel checks it: a
header that asks for more than this host's memory, a bad dtype code or a bad
description fails the receive in our words before anything is allocated.

Sends never block the stage: a send writes what the socket takes at once
(MSG_DONTWAIT); what it does not take (the peer has not read yet: its send
buffer, SO_SNDBUF, is full) goes to a writer thread of the lane, in order, and
every later message goes behind it until the writer has caught up. Two stages
that send to each other at once therefore never wait for each other's reads.
`flush` waits for the writer under the step's deadline. The tensors a queued
message reads are kept alive until written, as c10d's isend keeps them.

Every wait has a deadline and names what it waited for. A peer whose process
ends closes its end: the read sees end of file at once and says so, rather
than waiting out a timeout.

Forming a lane (`World._same_host` in gpipe.worker.dataplane.c10d): the worker holding the lane's
lower model chunk listens on an abstract socket of a random name and writes the
name and a random token to the data plane's store; its peer connects and sends
the token, or answers that it reached no such socket, and the lane goes over
c10d instead. An abstract socket is visible only within its network namespace,
so reaching it means the two processes share a kernel: the same host, and the
same pod. A process of that namespace that is not the peer may see the name
(/proc/net/unix) but not the token (the store, behind the NetworkPolicy like
c10d's ports): another user's connection is closed at once (SO_PEERCRED), one
without the token within TOKEN_S. The listening socket closes as soon as its
peer is in, within the attempt's start.

GPIPE_SAME_HOST_LANES=c10d (or `gpipe-worker --same-host-lanes c10d`) keeps every lane on c10d.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import hmac
import math
import mmap
import os
import select
import socket
import struct
import sys
import termios
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gpipe import structure
from gpipe.wire import (
    HEADER,
    HEADER_BYTES,
    MAX_JSON_BYTES,
    STRUCTURE,
    asked_bytes,
    decode,
    encode,
    header_bytes,
    message_limit,
    tensor_header,
)

if TYPE_CHECKING:
    from gpipe.worker.dataplane._ring import Writer as _CWriterType  # (worker/dataplane/_ring.pyi)

_CWriter: type[_CWriterType] | None
try:  # the C writer of a lane's ring (worker/dataplane/_ring.c), where the install could build it
    from gpipe.worker.dataplane._ring import Writer as _CWriter
except ImportError:  # (no C compiler where gpipe was installed: the Python writer, the same bookkeeping)
    _CWriter = None

MODES = ("unix", "c10d")
MODE_ENV = "GPIPE_SAME_HOST_LANES"
SEND_BUFFER = 4 << 20  # what a lane's socket holds unread before the writer thread takes over (capped by the host)
MAX_QUEUED = 4096  # messages a sender may have waiting for the writer: one step's worth is far fewer
MAX_PARTS = 256  # buffers a sendmsg call is given at most (IOV_MAX is 1024 on Linux)
TOKEN_BYTES = 32
TOKEN_S = 1.0  # how long a connection to a forming lane may take to send its token
BACKLOG = 64
SLICE_S = 0.05  # how often a writer waiting for room checks that its lane is still open
MAX_KINDS = 64  # the kinds of tensor (dtype, shape, wants a gradient) a sender keeps a header of
_NO_WAIT = int(socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)  # (an int: an enum's `|` runs Python on every send)
RING_BYTES = 16 << 20  # a lane's shared memory (pages are taken as messages first reach them)
MAX_RING_MESSAGE = 4 << 20  # a larger message goes on the socket: its copies cost more than the socket's calls
RING_SLOTS = 1024  # messages a ring holds unread at most
WARM_BYTES = 2 << 20  # a sender takes back what was read before it writes past this much of its ring
_TABLE_BYTES = RING_SLOTS * 16  # each slot's (offset, length) in the data, ahead of it
_ALIGN = 64
_MFD_NOEXEC_SEAL = 0x0008  # (os has no name for it before Python 3.12)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_HEADER = struct.Struct(f"={HEADER}q")  # a message's header (gpipe.wire's)
_MB = struct.Struct("=q")  # a header's first int64, the micro-batch (this host's byte order, as gpipe.wire's)


def mode() -> str:
    """How lanes between workers of one host go: `unix` (a socket of this module) or `c10d`."""
    value = os.environ.get(MODE_ENV, "unix") or "unix"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


def _view(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor `t` (any dtype), without a copy."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    sock.setblocking(True)


# -- forming a lane ------------------------------------------------------------------------------------------


class Listener:
    """The listening end of a lane being formed: an abstract socket of a random name, and the token its peer must
    send. OSError if this host allows no such socket (the lane stays on c10d)."""

    def __init__(self) -> None:
        self.name = "gpipe-lane-" + os.urandom(16).hex()
        self.token = os.urandom(TOKEN_BYTES)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind("\0" + self.name)
            self._sock.listen(BACKLOG)
        except BaseException:
            self._sock.close()
            raise

    def accept(self, deadline: float, who: str) -> socket.socket:
        """The peer's connection, the first of this user's to send the token, by `deadline` (TimeoutError naming
        `who`). Any other is closed: another user's at once (SO_PEERCRED), one without the token once it has
        sent TOKEN_BYTES or stayed silent for TOKEN_S. The listening socket is closed either way."""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{who} did not connect to its lane on this host")
                self._sock.settimeout(left)
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    raise TimeoutError(f"{who} did not connect to its lane on this host") from None
                if self._admitted(conn, deadline):
                    _tune(conn)
                    return conn
                conn.close()
        finally:
            self._sock.close()

    def _admitted(self, conn: socket.socket, deadline: float) -> bool:
        try:
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                return False
            conn.settimeout(max(0.001, min(TOKEN_S, deadline - time.monotonic())))
            got = b""
            while len(got) < TOKEN_BYTES and (part := conn.recv(TOKEN_BYTES - len(got))):
                got += part
        except OSError:
            return False
        return hmac.compare_digest(got, self.token)

    def close(self) -> None:
        self._sock.close()


def connect(name: str, token: bytes, deadline: float) -> socket.socket | None:
    """A lane to the listener `name` of this network namespace, `token` sent; None when there is no such socket
    here (the peer is on another host, or another pod) or this host allows none (a sandbox's policy)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect("\0" + name)
        except (ConnectionRefusedError, FileNotFoundError, PermissionError):
            sock.close()
            return None
        sock.sendall(token)
        _tune(sock)
        return sock
    except BaseException:
        sock.close()
        raise


# -- a lane's shared memory ----------------------------------------------------------------------------------


class Ring:
    """A lane's shared memory: messages of up to MAX_RING_MESSAGE bytes, written by the lane's sender and read by
    its receiver, each once, in order, with no socket call but an eventfd's.

    A memfd of RING_BYTES (sealed: neither end can shrink it under the other's reads) holds a table of RING_SLOTS
    (offset, length) pairs, then the messages' bytes (gpipe.wire's, as on the socket). The sender writes a
    message where the ring has room (from the start whenever every message has been read: the memory it
    touches stays what it has in flight), its slot's pair, then adds one to `posted` (an eventfd); the receiver
    takes `posted`'s count, reads that many slots in order, copying each message out, and adds what it read to
    `freed`, which the sender takes when a message would not fit or would pass WARM_BYTES (the sender's side is
    `writer`: worker/dataplane/_ring.c's Writer, or `_Writer`). Both counts go through the kernel's
    eventfd, whose lock orders each side's writes before the other's reads on any architecture.

    A message the ring has no room for, or too large for it, goes on the lane's socket. A lane's messages arrive
    in the order they were sent (an evaluation's micro-batches repeat their tags batch after batch): the ring
    takes a message only once the peer has read every byte sent on the socket (SIOCOUTQ), and the socket only
    once the ring has none unread (else the lane's writer thread waits for that), so the receiver, which waits
    on both, finds unread messages on one of them at a time. The socket still says when the peer has ended.
    The memory and eventfds are let go when neither end's sender or receiver holds the ring any longer.
    """

    def __init__(self, mem: int, posted: int, freed: int):
        if os.fstat(mem).st_size != _TABLE_BYTES + RING_BYTES or \
                fcntl.fcntl(mem, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
            raise ValueError("a lane's shared memory of the wrong size, or not sealed")
        for fd in (posted, freed):  # a blocking one would wait with no deadline: refused, as a stranger's fd is
            if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK or \
                    os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:[eventfd]":
                raise ValueError("a lane's counters that are not non-blocking eventfds")
        self._map = mmap.mmap(mem, _TABLE_BYTES + RING_BYTES)
        self.fds = (mem, posted, freed)
        self.posted, self.freed = posted, freed
        weakref.finalize(self, _close_fds, self.fds)  # (not at close: a descriptor number may be reused at once)
        whole = memoryview(self._map)
        self.table = whole[:_TABLE_BYTES].cast("q")
        self.data = whole[_TABLE_BYTES:]
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map, _TABLE_BYTES))  # self.data's address
        self.size = RING_BYTES
        self._seq = 0  # the receiver's: messages read
        self._ready = 0  # the receiver's: posted and not yet read
        # The sender's bookkeeping and writes (place, post, send, unread): in C where it was built.
        self.writer: _Writer | _CWriterType = (_CWriter or _Writer)(
            self._map, RING_BYTES, RING_SLOTS, WARM_BYTES, MAX_RING_MESSAGE, HEADER_BYTES, posted, freed)

    @classmethod
    def create(cls) -> Ring:
        """A new ring (OSError where this host allows no memfd or eventfd: the lane keeps to its socket)."""
        fds: list[int] = []
        try:
            flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
            try:  # not executable: kernels since 6.3 ask for it (vm.memfd_noexec)
                fds.append(os.memfd_create("gpipe-lane", flags | _MFD_NOEXEC_SEAL))
            except OSError as e:
                if e.errno != errno.EINVAL:  # (an older kernel: no such flag)
                    raise
                fds.append(os.memfd_create("gpipe-lane", flags))
            os.ftruncate(fds[0], _TABLE_BYTES + RING_BYTES)
            fcntl.fcntl(fds[0], fcntl.F_ADD_SEALS, _SEALS)
            for _ in range(2):
                fds.append(os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK))
            return cls(*fds)
        except BaseException:
            _close_fds(fds)
            raise

    # the receiver's side

    def take(self) -> tuple[int, int] | None:
        """(offset, length) in `data` of the next message, or None when none is posted; `done` once it is copied
        out. ValueError for a slot out of the ring's bounds."""
        if not self._ready:
            try:
                self._ready = os.eventfd_read(self.posted)
            except BlockingIOError:
                return None
        i = 2 * (self._seq % RING_SLOTS)
        at, n = self.table[i], self.table[i + 1]
        if not (0 <= at and HEADER_BYTES <= n <= MAX_RING_MESSAGE and at + n <= self.size) or \
                self._ready > RING_SLOTS:
            raise ValueError(f"a message of the lane's shared memory out of its bounds ({n} bytes at {at})")
        self._seq += 1
        self._ready -= 1
        return at, n

    def done(self) -> None:
        """The message `take` gave is copied out: its room is the sender's again."""
        os.eventfd_write(self.freed, 1)


class _Writer:
    """The sending end of a ring: where each message goes, its slot, the eventfd writes (worker/dataplane/_ring.c's Writer
    does the same in C, one call a tensor's message; this one stands in where it was not built)."""

    def __init__(self, mapping: mmap.mmap, size: int, slots: int, warm: int, max_message: int, header: int,
                 posted: int, freed: int):
        """`mapping` holds the table of `slots` (offset, length) pairs, then `size` bytes of messages."""
        whole = memoryview(mapping)
        if len(whole) < slots * 16 + size:
            raise ValueError("a ring larger than its mapping")
        self.table = whole[:slots * 16].cast("q")
        self.data = whole[slots * 16:]
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(mapping, slots * 16))
        self.size, self.slots, self.warm, self.max_message, self.header = size, slots, warm, max_message, header
        self.posted, self.freed = posted, freed
        self._seq = 0  # messages posted
        self._spans: collections.deque[tuple[int, int]] = collections.deque()  # unread: (offset, end)

    def place(self, n: int) -> int | None:
        """Where a message of `n` bytes can go now; None when the ring has no room for it. What the receiver has
        read is taken back (an eventfd's read) only when the message would not fit, or would go past the ring's
        first `warm` bytes: most sends make no call for it, and the memory the ring touches stays small."""
        if n < 0:
            raise ValueError("a message of a negative length")
        if n > self.max_message:
            return None
        at = self._fit(n)
        if at is None or at + n > self.warm:
            self._reclaim()
            at = self._fit(n)
        return at

    def post(self, at: int, n: int) -> None:
        """The message of `n` bytes written at `at` is the receiver's."""
        if at < 0 or n < 0 or at + n > self.size:
            raise ValueError("a message past the ring's end")
        i = 2 * (self._seq % self.slots)
        self.table[i] = at
        self.table[i + 1] = n
        self._seq += 1
        self._spans.append((at, at + (n + _ALIGN - 1) // _ALIGN * _ALIGN))
        os.eventfd_write(self.posted, 1)

    def send(self, mb: int, tail: bytes, address: int, n: int) -> bool:
        """Write and post the message of a tensor of `n` bytes at `address`: micro-batch `mb`, the rest of its
        header `tail`; False when the ring has no room for it."""
        if _MB.size + len(tail) != self.header or n < 0 or (n and not address):
            raise ValueError("a header of the wrong length, or no tensor memory")
        at = self.place(self.header + n)
        if at is None:
            return False
        _MB.pack_into(self.data, at, mb)
        self.data[at + _MB.size:at + self.header] = tail
        if n:
            ctypes.memmove(self.address + at + self.header, address, n)
        self.post(at, self.header + n)
        return True

    def unread(self) -> int:
        """How many of the messages posted the receiver has not read yet."""
        if self._spans:
            self._reclaim()
        return len(self._spans)

    def _reclaim(self) -> None:
        spans = self._spans
        try:
            for _ in range(min(os.eventfd_read(self.freed), len(spans))):
                spans.popleft()
        except BlockingIOError:
            pass  # none read since

    def _fit(self, n: int) -> int | None:
        spans = self._spans
        if not spans:
            return 0
        if len(spans) >= self.slots:
            return None
        first, (last, end) = spans[0][0], spans[-1]
        if last >= first:  # in use: [first, end)
            if end + n <= self.size:
                return end
            return 0 if n <= first else None
        return end if end + n <= first else None  # in use: [first, size) and [0, end)


def _unread(sock: socket.socket) -> int:
    """The bytes sent on `sock` that its peer has not read yet (SIOCOUTQ)."""
    buf = bytearray(4)
    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)
    return int.from_bytes(buf, sys.byteorder)


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def offer_ring(sock: socket.socket) -> Ring | None:
    """The connecting end of a lane: make its ring and send the peer its three descriptors (SCM_RIGHTS); None, and
    the peer told so, where this host allows none."""
    try:
        ring = Ring.create()
    except OSError:
        sock.sendall(b"-")
        return None
    socket.send_fds(sock, [b"R"], list(ring.fds))
    return ring


def take_ring(sock: socket.socket, deadline: float, who: str = "the lane's peer") -> Ring | None:
    """The accepting end of a lane: the ring its peer (`who`) offers, by `deadline` (TimeoutError naming it); None
    when it offers none. ValueError naming it for one that is not a lane's ring (the wrong size, unsealed)."""
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 1, 3, socket.MSG_CMSG_CLOEXEC)
    except TimeoutError:
        raise TimeoutError(f"{who} did not offer its lane's shared memory in time") from None
    finally:
        sock.setblocking(True)
    if msg != b"R" or len(fds) != 3:
        _close_fds(fds)
        if msg == b"-":
            return None
        raise ValueError(f"{who} sent {msg!r} and {len(fds)} descriptors for its lane's shared memory")
    try:
        return Ring(*fds)
    except ValueError as e:
        _close_fds(fds)
        raise ValueError(f"{who}: {e}") from None
    except BaseException:
        _close_fds(fds)
        raise


_Fill = Callable[[memoryview, bool], None]  # read exactly len(view) bytes of a message into `view` (begun: not its first)


class _Broken(Exception):
    """A lane that cannot go on: its peer closed it, or stopped in the middle of a message."""


class _Ended(_Broken):
    """The lane's socket ended between two messages."""


# -- a lane's two ends ---------------------------------------------------------------------------------------


def _after(parts: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of `parts` once their first `sent` bytes are written."""
    for i, p in enumerate(parts):
        if sent < len(p):
            return [p[sent:], *parts[i + 1:]]
        sent -= len(p)
    return []


class UnixSender:
    """Sends (micro-batch, value) pairs to one stage over a lane of this module (gpipe.worker.dataplane.channel.Sender's
    contract)."""

    def __init__(self, sock: socket.socket, name: str, ring: Ring | None = None):
        self.name = name
        self.bytes = 0
        self.ring_messages = 0  # of those sent, through the lane's shared memory
        self._sock = sock
        self._ring = ring
        # A message went on the socket that the peer may not have read yet: the ring waits for it (`_ring_may`).
        self._on_socket = False
        self._poll = select.poll()
        self._poll.register(sock, select.POLLOUT)
        self._ring_poll = select.poll()  # the writer's, while the ring has messages unread before its first
        if ring is not None:  # the ring's reads, or the peer's end
            self._ring_poll.register(ring.freed, select.POLLIN)
            self._ring_poll.register(sock, select.POLLIN)
        self._cv = threading.Condition()
        # Messages the socket did not take at once, in order: (micro-batch, what is left, the tensors it reads).
        self._queue: collections.deque[tuple[int, list[memoryview], list[torch.Tensor]]] = collections.deque()
        self._error: BaseException | None = None
        self._closed = False
        self._writer: threading.Thread | None = None
        self._tails: dict[tuple[torch.dtype, torch.Size, bool], bytes] = {}  # a header after its micro-batch, by kind

    def send(self, mb: int, obj: Any, grads: Sequence[bool] = ()) -> None:
        """Write `obj` (gpipe.transport.Outbound.send); ValueError at once if it cannot travel, ConnectionError if
        an earlier message failed or the peer is gone."""
        if self._error is not None:
            raise self._error
        if (type(obj) is torch.Tensor and obj.layout is torch.strided and obj.is_cpu and obj.is_contiguous()
                and not obj.is_neg()):
            # An activation or a gradient, as nearly every message is: the header of its kind of tensor built and
            # checked once (gpipe.wire.encode), only the micro-batch written per message. Each line of Python on
            # this path costs several times its warm cost after an action's GEMMs have taken the caches.
            want = bool(grads and grads[0])
            tail = self._tails.get((obj.dtype, obj.shape, want))
            if tail is None:
                tail = self._tail(obj, want)
            n = obj.nbytes
            self.bytes += n
            ring = self._ring
            if ring is not None and n <= MAX_RING_MESSAGE - HEADER_BYTES and self._ring_may() and \
                    ring.writer.send(mb, tail, obj.data_ptr(), n):
                self.ring_messages += 1
                return
            parts = [memoryview(_MB.pack(mb) + tail)]
            if n:
                parts.append(_view(obj))
            self._out(mb, parts, [obj])
            return
        header, text, leaves = encode(mb, obj, grads, "gloo")
        self.bytes += sum(t.numel() * t.element_size() for t in leaves)
        parts = [memoryview(header_bytes(header))]
        if text is not None:
            parts.append(memoryview(text))
        leaves = [t if t.device.type == "cpu" else t.detach().cpu() for t in leaves]  # (a CPU stage's: as it is)
        parts += [_view(t) for t in leaves if t.numel()]
        if self._ring is None or not self._ring_may() or not self._post(parts, sum(map(len, parts))):
            self._out(mb, parts, leaves)

    def _ring_may(self) -> bool:
        """Whether a message may go to the ring now: the lane's messages arrive in the order they were sent (an
        evaluation's micro-batches repeat their tags batch after batch), so only once the peer has read every
        byte sent on the socket; and the socket takes a message only once the ring has none unread (`_out`)."""
        if self._queue or self._closed:  # (only this thread adds to the queue; the writer takes a message off
            return False                 # once it is written, and is done with the ring once the queue is empty)
        if self._on_socket:
            if _unread(self._sock):
                return False
            self._on_socket = False
        return True

    def _post(self, parts: list[memoryview], n: int) -> bool:
        """Write a message of `n` bytes (`parts`) to the lane's shared memory; False when it has no room for it."""
        ring = self._ring
        at = ring.writer.place(n)  # type: ignore[union-attr]  # a ring's lane
        if at is None:
            return False
        data, i = ring.data, at  # type: ignore[union-attr]
        for p in parts:
            data[i:i + len(p)] = p
            i += len(p)
        ring.writer.post(at, n)  # type: ignore[union-attr]
        self.ring_messages += 1
        return True

    def _tail(self, t: torch.Tensor, want: bool) -> bytes:
        """The header of a message of one tensor like `t` after its micro-batch, checked as gpipe.wire.encode
        checks it (ValueError if it cannot travel), and kept for the next of its kind."""
        header, _, _ = encode(0, t, (want,), "gloo")
        if len(self._tails) >= MAX_KINDS:
            self._tails.clear()
        tail = self._tails[(t.dtype, t.shape, want)] = header_bytes(header)[_MB.size:]
        return tail

    def _out(self, mb: int, parts: list[memoryview], leaves: list[torch.Tensor]) -> None:
        """Write a message's `parts` (reading `leaves`' memory): what the socket takes now, and the rest queued for
        the writer thread; behind any earlier message the writer still has."""
        self._on_socket = True
        with self._cv:
            if not self._queue and not (self._ring is not None and self._ring.writer.unread()):
                parts = self._push(mb, parts)
                if not parts:
                    return
            if len(self._queue) >= MAX_QUEUED:
                raise self._fail(mb, f"over {MAX_QUEUED} messages wait for the peer to read")
            self._queue.append((mb, parts, leaves))
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name=f"send-{self.name}", daemon=True)
                self._writer.start()
            self._cv.notify_all()

    def _push(self, mb: int, parts: list[memoryview]) -> list[memoryview]:
        """Write what the socket takes now of `parts`; what is left."""
        while parts:
            try:
                sent = self._sock.sendmsg(parts[:MAX_PARTS], (), _NO_WAIT)
            except (BlockingIOError, InterruptedError):
                return parts
            except OSError as e:
                raise self._fail(mb, e.strerror or str(e)) from None
            parts = _after(parts, sent)
        return parts

    def _fail(self, mb: int | None, why: str) -> ConnectionError:
        with self._cv:
            if self._error is None:
                of = "" if mb is None else f" of micro-batch {mb}"
                self._error = ConnectionError(f"sending {self.name}{of} failed: {why}")
            self._cv.notify_all()
            return self._error  # type: ignore[return-value]  # set just now, or earlier

    def _write(self) -> None:
        """The writer thread: the queue's messages, in order, as the peer makes room."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed or self._error is not None)
                if self._closed or self._error is not None:
                    return
                mb, parts, leaves = self._queue[0]  # `leaves` keeps the memory `parts` reads alive
            try:
                while self._ring is not None and self._ring.writer.unread():  # what went before it, first
                    if self._closed:
                        return
                    if self._ring_poll.poll(int(SLICE_S * 1000)) and self._peer_gone():
                        raise self._fail(mb, "the peer closed the lane")
                while parts:
                    if self._closed:
                        return
                    self._poll.poll(int(SLICE_S * 1000))
                    parts = self._push(mb, parts)
            except ConnectionError:
                return
            del leaves
            with self._cv:
                if self._closed:  # close emptied the queue
                    return
                self._queue.popleft()
                self._cv.notify_all()

    def flush(self, timeout: float) -> None:
        """Wait until every message is in the socket or the ring, at most `timeout` seconds; ConnectionError if the
        peer has closed the lane with messages of the ring unread (a message in the ring does not find it out)."""
        with self._cv:
            if self._closed:
                raise ConnectionError(f"sending {self.name} failed: the lane was closed")
            if not self._cv.wait_for(lambda: not self._queue or self._error is not None, timeout):
                raise TimeoutError(f"timed out after {timeout:.0f}s sending {self.name}")
            if self._error is not None:
                raise self._error
        if self._ring is not None and self._ring.writer.unread() and self._peer_gone():  # (all read: nothing is lost)
            raise self._fail(None, "the peer closed the lane before reading what was sent")

    def _peer_gone(self) -> bool:
        """Whether the peer has closed the lane: it writes nothing on a lane it reads, so an end of file is its
        end (a message in the ring does not find it out, as a socket's send does)."""
        try:
            return self._sock.recv(1, socket.MSG_PEEK | _NO_WAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()


class UnixReceiver:
    """Receives (micro-batch, value) pairs from one stage over a lane of this module, on the thread that asks
    (gpipe.worker.dataplane.channel.Receiver's contract): from the lane's socket, and from its ring when it has one."""

    def __init__(self, sock: socket.socket, name: str, ring: Ring | None = None):
        self.name = name
        self.bytes = 0
        self._sock = sock
        self._ring = ring
        self._poll = select.poll()  # the socket, within a message
        self._poll.register(sock, select.POLLIN)
        self._either = select.poll()  # the socket or the ring, between messages
        self._either.register(sock, select.POLLIN)
        if ring is not None:
            self._either.register(ring.posted, select.POLLIN)
        self._inbox: dict[int, Any] = {}  # read ahead of the micro-batch asked for
        self._error: BaseException | None = None
        self.limit = message_limit(torch.device("cpu"))
        self._head = memoryview(bytearray(HEADER_BYTES))

    def expect(self, count: int) -> None:
        """Nothing to post: a message is read when the stage asks for it."""

    def get(self, mb: int, timeout: float) -> Any:
        """The value of micro-batch `mb`, waiting up to `timeout` seconds for it."""
        deadline = time.monotonic() + timeout
        while mb not in self._inbox:
            if self._error is not None:
                raise self._error
            if len(self._inbox) >= MAX_QUEUED:
                raise self._broken(f"over {MAX_QUEUED} messages came before micro-batch {mb}")
            try:
                got, value = self._next(deadline)
            except TimeoutError:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {self.name} of micro-batch {mb}") \
                    from None
            except Exception as e:  # a bad message, a peer gone, a tensor this host cannot allocate
                raise self._broken(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
            if got in self._inbox:
                raise self._broken(f"micro-batch {got} came twice")
            self._inbox[got] = value
        return self._inbox.pop(mb)

    def _broken(self, why: str) -> ConnectionError:
        self._error = ConnectionError(f"receiving {self.name} failed: {why}")
        return self._error

    def _next(self, deadline: float) -> tuple[int, Any]:
        """The next message, from the ring (first: what the peer posted there before it ended is still read) or
        the socket, by `deadline` (TimeoutError with nothing read: the lane is as it was)."""
        ring = self._ring
        if ring is None:
            return self._message(lambda view, begun: self._fill(view, deadline, begun))
        while True:
            slot = ring.take()
            if slot is not None:
                return self._record(ring, *slot)
            if self._poll.poll(0):  # the socket has bytes, or its end
                try:
                    return self._message(lambda view, begun: self._fill(view, deadline, begun))
                except _Ended:  # what the peer posted to the ring just before it ended is still read
                    slot = ring.take()
                    if slot is None:
                        raise
                    return self._record(ring, *slot)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self._either.poll(max(1, math.ceil(left * 1000)))

    def _record(self, ring: Ring, at: int, n: int) -> tuple[int, Any]:
        """The message of `n` bytes at `at` in `ring`'s data, copied out; its room is then the sender's again."""
        try:
            return self._copied(ring, at, n)
        finally:
            ring.done()

    def _copied(self, ring: Ring, at: int, n: int) -> tuple[int, Any]:
        h = list(_HEADER.unpack_from(ring.data, at))
        if h[1] != STRUCTURE:  # a tensor, as nearly every message is: its memory copied straight to the new one
            dtype, shape, grad, packed = tensor_header(h)
            if packed:
                raise ValueError(f"a packed tensor on a lane that packs none: {h}")
            nbytes = asked_bytes([(dtype, shape)], self.limit)
            if HEADER_BYTES + nbytes != n:
                raise ValueError(f"a message of the lane's shared memory of {HEADER_BYTES + nbytes} bytes in {n}")
            t = torch.empty(shape, dtype=dtype)
            if nbytes:
                ctypes.memmove(t.data_ptr(), ring.address + at + HEADER_BYTES, nbytes)
                self.bytes += nbytes
            return h[0], t.requires_grad_() if grad else t
        record, done = ring.data[at:at + n], 0

        def fill(view: memoryview, begun: bool) -> None:
            nonlocal done
            k = len(view)
            if done + k > n:
                raise ValueError(f"a message of the lane's shared memory longer than its {n} bytes")
            view[:] = record[done:done + k]
            done += k

        got = self._message(fill)
        if done != n:
            raise ValueError(f"a message of the lane's shared memory of {done} bytes in {n}")
        return got

    def _fill(self, view: memoryview, deadline: float, begun: bool) -> None:
        """Read exactly len(view) bytes into `view` by `deadline`. Past it, a TimeoutError when none of the
        message had come (`begun` false and nothing read: the lane is as it was); else the lane is broken."""
        got, n = 0, len(view)
        while got < n:
            try:
                k = self._sock.recv_into(view[got:], n - got, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                left = deadline - time.monotonic()
                if left <= 0:
                    if begun or got:
                        raise _Broken("the peer stopped in the middle of a message") from None
                    raise TimeoutError from None
                self._poll.poll(max(1, math.ceil(left * 1000)))
                continue
            if k == 0:
                raise (_Broken if begun or got else _Ended)("the peer closed the lane (its process ended)")
            got += k

    def _tensor(self, dtype: torch.dtype, shape: list[int], grad: bool, fill: _Fill) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            fill(_view(t), True)
            self.bytes += t.numel() * t.element_size()
        return t.requires_grad_() if grad else t

    def _message(self, fill: _Fill) -> tuple[int, Any]:
        fill(self._head, False)
        h = self._head.cast("q").tolist()  # this host's byte order, as header_bytes writes it
        mb, code, n = h[0], h[1], h[2]
        if code != STRUCTURE:
            dtype, shape, grad, packed = tensor_header(h)
            if packed:
                raise ValueError(f"a packed tensor on a lane that packs none: {h}")
            asked_bytes([(dtype, shape)], self.limit)
            return mb, self._tensor(dtype, shape, grad, fill)
        if not 0 < n <= MAX_JSON_BYTES:
            raise ValueError(f"a structure's description of {n} bytes (at most {MAX_JSON_BYTES})")
        text = bytearray(n)
        fill(memoryview(text), True)
        skeleton, metas = decode(bytes(text))
        asked_bytes([(dtype, shape) for dtype, shape, _ in metas], self.limit)
        return mb, structure.unflatten(skeleton, [self._tensor(*m, fill) for m in metas])

    def close(self) -> None:
        pass  # the socket and the ring are the world's: they close with the attempt (gpipe.worker.dataplane.c10d.World.leave)
