"""A lane between two workers of one host (gpipe.worker.dataplane.unix_lane): real sockets, real processes where a peer ends."""

from __future__ import annotations

import contextlib
import gc
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

from gpipe.wire import HEADER, STRUCTURE, encode, header_bytes
from gpipe.worker.dataplane import unix_lane
from gpipe.worker.dataplane.unix_lane import (
    Listener,
    Ring,
    UnixReceiver,
    UnixSender,
    connect,
    offer_ring,
    take_ring,
)
from tests.service.test_channel import _messages, _same

pytestmark = pytest.mark.timeout(60)


def _lane() -> tuple[socket.socket, socket.socket]:
    """Two ends of a lane, formed as World._form forms them: a listener, a peer that connects with the token."""
    listener = Listener()
    deadline = time.monotonic() + 10
    sock = connect(listener.name, listener.token, deadline)
    assert sock is not None
    return sock, listener.accept(deadline, "rank 1")


def _ring_lane() -> tuple[socket.socket, socket.socket, Ring, Ring]:
    """A lane with its ring, as World._same_host forms it: the connecting end offers it, the other takes it."""
    a, b = _lane()
    mine = offer_ring(a)
    theirs = take_ring(b, time.monotonic() + 10)
    assert mine is not None and theirs is not None
    return a, b, mine, theirs


@pytest.fixture
def lane() -> Any:
    a, b = _lane()
    yield a, b
    a.close()
    b.close()


def test_every_kind_of_message_arrives_as_sent_in_order_and_out_of_order(lane: Any) -> None:
    a, b = lane
    out, into = UnixSender(a, "activation to stage 1"), UnixReceiver(b, "stage 0's activation")
    messages = _messages()
    for mb, (value, grads) in enumerate(messages):
        out.send(mb, value, grads)
    out.flush(10)
    # Asked for in reverse: each one read ahead waits in the inbox for its turn.
    for mb in reversed(range(len(messages))):
        value, grads = messages[mb]
        assert _same(value, into.get(mb, 10), grads) == ""
    assert into.bytes == out.bytes > 0


def test_a_plain_tensor_goes_as_gpipe_wire_encodes_it_its_header_kept_per_kind(lane: Any) -> None:
    """An activation or a gradient takes the send's short path (its header built once per kind of tensor): the
    bytes on the socket are still exactly gpipe.wire's, for every micro-batch, dtype, shape and gradient flag;
    a dtype the wire has no code for fails that send in our words, and the lane goes on."""
    a, b = lane
    out = UnixSender(a, "activation to stage 1")
    b.settimeout(10)
    cases = [(torch.randn(3, 5), (True,)), (torch.randn(3, 5), ()), (torch.randn(3, 5).bfloat16(), (True,)),
             (torch.zeros(0, 4), (False,)), (torch.arange(6).view(2, 3), ()), (torch.ones(7, dtype=torch.bool), ())]
    for mb in (0, 7, 2**40):
        for t, grads in cases:
            out.send(mb, t, grads)
            h, _, leaves = encode(mb, t, grads, "gloo")
            want = header_bytes(h) + (leaves[0].view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            got = b""
            while len(got) < len(want):
                got += b.recv(len(want) - len(got))
            assert got == want, (mb, t.dtype, tuple(t.shape), grads)
    assert len(out._tails) == len(cases)
    with pytest.raises(ValueError, match=r"complex64 cannot travel"):
        out.send(1, torch.zeros(2, dtype=torch.complex64))
    out.send(2, torch.ones(2))
    assert torch.equal(UnixReceiver(b, "stage 0's activation").get(2, 10), torch.ones(2))


def test_short_path_messages_behind_a_full_socket_keep_their_order_and_memory_and_a_new_kind_past_the_cap(
        lane: Any) -> None:
    """Behind a message the socket cannot take, plain tensors and structures queue in order for the writer, each
    tensor's memory kept alive by the queue when the caller lets go of it; the header cache, emptied when it
    outgrows MAX_KINDS, still gives each kind its own header; a negated view goes as its values."""
    a, b = lane
    out, into = UnixSender(a, "activation to stage 1"), UnixReceiver(b, "stage 0's activation")
    big = torch.randn(4 << 20)  # 16 MiB: more than the socket holds unread
    out.send(0, big)
    kinds = [torch.full((k + 1,), float(k)) for k in range(unix_lane.MAX_KINDS + 1)]  # one kind each, then again
    values: list[Any] = []
    for k, t in enumerate([*kinds, kinds[0], {"h": torch.arange(5), "m": [torch.ones(3, 3)]},
                           torch.tensor([1 + 2j]).conj().imag]):
        values.append(t.clone() if isinstance(t, torch.Tensor) else t)
        out.send(k + 1, t)
    assert out._queue  # the writer has them
    del kinds, t
    gc.collect()
    got = [into.get(k, 30) for k in range(len(values) + 1)]
    for k, want in enumerate([big, *values]):
        assert _same(want, got[k], []) == "", k
    assert torch.equal(got[-1], torch.tensor([-2.0]))  # x.conj().imag: its memory holds 2, its value is -2
    out.flush(10)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_tensor_that_cannot_travel_fails_its_send_in_our_words_and_counts_nothing(lane: Any) -> None:
    a, b = lane
    out = UnixSender(a, "activation to stage 1")
    out.send(0, torch.ones(2, 3))
    before = out.bytes
    for bad, what in [(torch.ones(2, 3).to_sparse_csr(), "sparse_csr"), (torch.ones(2, 3).to_mkldnn(), "mkldnn"),
                      (torch.zeros(2, dtype=torch.complex64), "complex64")]:
        with pytest.raises(ValueError, match=what):
            out.send(1, bad)
        assert out.bytes == before
    out.send(2, torch.ones(2, 3))
    into = UnixReceiver(b, "stage 0's activation")
    assert torch.equal(into.get(2, 10), torch.ones(2, 3)) and torch.equal(into.get(0, 10), torch.ones(2, 3))


def test_messages_larger_than_the_socket_holds_both_ways_at_once_never_wait_for_each_other(lane: Any) -> None:
    """Each end sends 8 messages of 16 MiB before it reads any: the socket takes a few MiB, the writer thread
    the rest, so neither stage blocks on the other's reads (what a pipeline's two directions do)."""
    a, b = lane
    big = [torch.randn(4 << 20) for _ in range(8)]
    got: dict[str, list[torch.Tensor]] = {}

    def end(sock: socket.socket, who: str) -> None:
        out, into = UnixSender(sock, f"to {who}"), UnixReceiver(sock, f"from {who}")
        for mb, t in enumerate(big):
            out.send(mb, t)  # returns at once, whether or not the peer has read
        got[who] = [into.get(mb, 30) for mb in range(len(big))]
        out.flush(30)

    threads = [threading.Thread(target=end, args=(s, w)) for s, w in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert sorted(got) == ["a", "b"]
    for received in got.values():
        assert all(torch.equal(x, y) for x, y in zip(big, received, strict=True))


def test_a_wait_past_its_deadline_names_the_lane_and_micro_batch_and_the_lane_goes_on(lane: Any) -> None:
    a, b = lane
    out, into = UnixSender(a, "gradient to stage 0"), UnixReceiver(b, "stage 1's gradient")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"waiting for stage 1's gradient of micro-batch 3"):
        into.get(3, 0.3)
    assert 0.25 < time.monotonic() - t0 < 5
    out.send(3, torch.ones(2))
    assert torch.equal(into.get(3, 10), torch.ones(2))


def test_a_flush_the_peer_never_reads_ends_at_its_deadline_in_our_words(lane: Any) -> None:
    a, _ = lane
    out = UnixSender(a, "activation to stage 1")
    for mb in range(4):
        out.send(mb, torch.zeros(4 << 20))  # more than the socket holds: the writer waits for room
    with pytest.raises(TimeoutError, match=r"sending activation to stage 1"):
        out.flush(0.5)
    out.close()


@pytest.mark.parametrize("bad", ["huge", "dtype", "dims", "description", "grad-int"])
def test_a_bad_header_fails_the_receive_naming_the_lane_before_allocating(lane: Any, bad: str) -> None:
    a, b = lane
    into = UnixReceiver(b, "stage 0's activation")
    h = [0, 0, 1, 0, 1 << 60] + [0] * (HEADER - 5)  # float32 of 2^60 elements: over this host's memory
    if bad == "dtype":
        h[1] = 99
    elif bad == "dims":
        h[2] = 40
    elif bad == "description":
        h[1], h[2] = STRUCTURE, 1 << 30
    elif bad == "grad-int":  # an int64 tensor that asks for a gradient
        h[1], h[3], h[4] = 4, 1, 2
    a.sendall(header_bytes(h))
    with pytest.raises(ConnectionError, match=r"receiving stage 0's activation failed: .*(bytes|header)") as e:
        into.get(0, 5)
    assert "\n" not in str(e.value)
    with pytest.raises(ConnectionError):  # and every later wait on the lane says so at once
        into.get(1, 5)


def test_a_peer_whose_process_ends_is_seen_at_once_not_after_the_deadline() -> None:
    """The peer connects from a process of its own, sends one message's header and half its data, and exits."""
    listener = Listener()
    code = (
        "import sys, time, torch\n"
        "from gpipe.wire import header_bytes, HEADER\n"
        "from gpipe.worker.dataplane.unix_lane import connect\n"
        f"s = connect({listener.name!r}, bytes.fromhex({listener.token.hex()!r}), time.monotonic() + 10)\n"
        "s.sendall(header_bytes([0, 0, 1, 0, 1024] + [0] * (HEADER - 5)) + bytes(2048))\n"
        "s.close()\n"
    )
    peer = subprocess.Popen([sys.executable, "-c", code])
    try:
        into = UnixReceiver(listener.accept(time.monotonic() + 30, "rank 1"), "stage 0's activation")
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=r"stage 0's activation failed: the peer closed the lane"):
            into.get(0, 30)
        assert time.monotonic() - t0 < 10
    finally:
        peer.kill()
        peer.wait(10)


def test_a_send_to_a_closed_peer_fails_that_send_or_the_flush_naming_the_lane(lane: Any) -> None:
    a, b = lane
    b.close()
    out = UnixSender(a, "activation to stage 1")
    with pytest.raises(ConnectionError, match=r"sending activation to stage 1 of micro-batch \d failed"):
        for mb in range(4):
            out.send(mb, torch.zeros(1 << 20))
        out.flush(5)


def test_a_connection_without_the_token_is_closed_and_the_peer_with_it_is_let_in() -> None:
    listener = Listener()
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect("\0" + listener.name)  # the name is visible in /proc/net/unix; the token is not
    stranger.sendall(b"x" * unix_lane.TOKEN_BYTES)
    peer = connect(listener.name, listener.token, time.monotonic() + 10)
    assert peer is not None
    mine = listener.accept(time.monotonic() + 10, "rank 1")
    stranger.settimeout(5)
    assert stranger.recv(1) == b""  # closed on it
    UnixSender(peer, "to 0").send(7, torch.arange(3))
    assert torch.equal(UnixReceiver(mine, "from 1").get(7, 5), torch.arange(3))
    for s in (stranger, peer, mine):
        s.close()
    # The listening socket is gone once its peer is in: nobody else gets in.
    assert connect(listener.name, listener.token, time.monotonic() + 5) is None


def test_a_silent_stranger_holds_the_lane_up_for_a_second_at_most() -> None:
    listener = Listener()
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stranger.connect("\0" + listener.name)  # sends nothing
    peer = connect(listener.name, listener.token, time.monotonic() + 10)
    assert peer is not None
    t0 = time.monotonic()
    mine = listener.accept(time.monotonic() + 10, "rank 1")
    assert time.monotonic() - t0 < unix_lane.TOKEN_S + 2
    for s in (stranger, peer, mine):
        s.close()


def test_a_closed_sender_says_so_at_its_flush_and_its_writer_keeps_what_it_reads_alive(lane: Any) -> None:
    a, b = lane
    out = UnixSender(a, "activation to stage 1")
    for mb in range(4):
        out.send(mb, torch.full((4 << 20,), float(mb)))  # over what the socket holds: the writer has some
    out.close()
    with pytest.raises(ConnectionError, match=r"sending activation to stage 1 failed: the lane was closed"):
        out.flush(5)


def test_a_listener_nobody_reaches_says_who_it_waited_for() -> None:
    listener = Listener()
    with pytest.raises(TimeoutError, match=r"rank 3 .* did not connect"):
        listener.accept(time.monotonic() + 0.2, "rank 3 (stage 1 of replica 1)")


def test_no_such_socket_here_means_another_host() -> None:
    assert connect("gpipe-lane-" + "0" * 32, b"t" * unix_lane.TOKEN_BYTES, time.monotonic() + 5) is None


def test_the_mode_is_read_from_the_environment_and_a_bad_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(unix_lane.MODE_ENV, raising=False)
    assert unix_lane.mode() == "unix"
    monkeypatch.setenv(unix_lane.MODE_ENV, "c10d")
    assert unix_lane.mode() == "c10d"
    monkeypatch.setenv(unix_lane.MODE_ENV, "shm")
    with pytest.raises(ValueError, match=unix_lane.MODE_ENV):
        unix_lane.mode()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_run_goes_over_unix_sockets_and_gives_the_bits_of_gloo_and_the_weights_of_one_device(cli: Any) -> None:
    """`run` of 2 workers x 3 model chunks with skip connections (structures and skips between workers): every
    lane between its two local workers is a Unix socket, each worker's log says so; with
    GPIPE_SAME_HOST_LANES=c10d every lane is gloo's. The weights are the same to the bit, and one device's."""
    from safetensors.torch import load_file

    from tests.service.test_transparency import VIRTUAL
    from tests.support import reference

    spec = VIRTUAL["interleaved-1f1b-skips-clip"]
    path = cli.write(spec)
    weights, logs = {}, {}
    for lanes in ("unix", "c10d"):
        cli.env[unix_lane.MODE_ENV] = lanes
        r = cli.run("run", str(path), "--state-dir", str(cli.tmp / lanes), "--no-progress", timeout=200)
        assert r.returncode == 0, r.stderr[-3000:]
        weights[lanes] = load_file(cli.tmp / lanes / "t" / "model.safetensors")
        logs[lanes] = [(cli.tmp / lanes / "t" / "logs" / f"stage-{k}.log").read_text() for k in range(2)]
    for log in logs["unix"]:
        line = next(x for x in log.splitlines() if x.startswith("data plane of rank"))
        assert "Unix socket of this host (activation" in line and "skip" in line and line.endswith("gloo (none)")
        assert "with shared memory (activation" in line
        assert f"its writer in {'C' if unix_lane._CWriter is not None else 'Python'}" in line
    for log in logs["c10d"]:
        line = next(x for x in log.splitlines() if x.startswith("data plane of rank"))
        assert "Unix socket of this host (none)" in line
    assert all(torch.equal(weights["unix"][k], weights["c10d"][k]) for k in weights["c10d"])
    want = reference.train(spec)
    assert max((weights["unix"][k] - want[k]).abs().max().item() for k in want) <= 1e-5


# -- the lane's ring of shared memory -----------------------------------------------------------------------


def _writer(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rings made from now on are written by the C writer ("c") or the Python one ("python")."""
    if which == "python":
        monkeypatch.setattr(unix_lane, "_CWriter", None)
    elif unix_lane._CWriter is None:
        pytest.skip("gpipe.worker.dataplane._ring was not built here (no C compiler at install): the Python writer stands in")


def test_the_c_writer_is_built_where_the_install_had_a_compiler() -> None:
    import shutil

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this host: the install keeps the Python writer")
    assert unix_lane._CWriter is not None, "gpipe.worker.dataplane._ring was not built: reinstall (make setup) to build it"
    ring = Ring.create()
    assert type(ring.writer) is unix_lane._CWriter


def test_the_c_and_python_writers_write_the_same_bytes_and_slots_and_take_back_the_same_room(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same sends, posts and reads against a ring written by each: every answer, the table and the bytes
    written are equal, through wrap-arounds, a full ring, every slot used and WARM_BYTES."""
    import os
    import random

    if unix_lane._CWriter is None:
        pytest.skip("gpipe.worker.dataplane._ring was not built here")
    rings = [Ring.create()]
    with monkeypatch.context() as m:
        m.setattr(unix_lane, "_CWriter", None)
        rings.append(Ring.create())
    assert type(rings[0].writer) is not type(rings[1].writer)
    rng = random.Random(7)
    tail = bytes(range(HEADER * 8 - 8))
    sizes = [0, 4, 1000, 64 << 10, 1 << 20, 3 << 20, unix_lane.MAX_RING_MESSAGE - HEADER * 8,
             unix_lane.MAX_RING_MESSAGE]
    src = torch.randint(0, 255, (unix_lane.MAX_RING_MESSAGE,), dtype=torch.uint8)
    for k in range(3000):
        op = rng.random()
        answers = []
        for ring in rings:
            w = ring.writer
            if op < 0.55:
                n = sizes[k % len(sizes)] if k % 7 == 0 else random.Random(k).randrange(0, 200)
                answers.append(w.send(k, tail, src.data_ptr(), n))
            elif op < 0.65:
                n = random.Random(k).randrange(1, 5000)
                at = w.place(n)
                if at is not None:
                    ring.data[at:at + n] = bytes([k % 251]) * n
                    w.post(at, n)
                answers.append(at)
            elif op < 0.95:  # the receiver reads some
                read = random.Random(k).randrange(0, 8)
                if read:
                    os.eventfd_write(ring.freed, read)
                answers.append(read)
            else:
                answers.append(w.unread())
        assert answers[0] == answers[1], (k, answers)
    assert bytes(rings[0].table) == bytes(rings[1].table)
    assert rings[0].data == rings[1].data


@pytest.mark.parametrize("which", ["c", "python"])
def test_a_writer_refuses_a_bad_header_a_message_past_the_ring_and_a_mapping_too_small(
        which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import mmap
    import os

    _writer(which, monkeypatch)
    ring = Ring.create()
    w = ring.writer
    with pytest.raises(ValueError, match="header"):
        w.send(0, b"short", 0, 0)
    with pytest.raises(ValueError, match="past the ring"):
        w.post(unix_lane.RING_BYTES - 8, 64)
    with pytest.raises(ValueError, match="past the ring"):
        w.post(1 << 62, 1 << 62)
    with pytest.raises(ValueError, match="negative"):
        w.place(-1)
    assert w.place(unix_lane.MAX_RING_MESSAGE + 1) is None
    tail = bytes(HEADER * 8 - 8)
    assert w.send(0, tail, 1, (1 << 62)) is False  # more than a ring message: the socket's
    with pytest.raises(ValueError, match="larger than its mapping"):
        type(w)(mmap.mmap(-1, 4096), unix_lane.RING_BYTES, unix_lane.RING_SLOTS, unix_lane.WARM_BYTES,
                unix_lane.MAX_RING_MESSAGE, HEADER * 8, ring.posted, ring.freed)
    gone = os.eventfd(0)
    w2 = type(w)(mmap.mmap(-1, 1 << 16), 1 << 15, 16, 1 << 14, 1 << 14, HEADER * 8, gone, gone)
    os.close(gone)
    with pytest.raises(OSError):  # its eventfd gone: said at once, not a ring that never drains
        w2.send(0, tail, 0, 0)


def test_the_c_writer_is_initialised_once_and_not_used_before() -> None:
    import mmap

    if unix_lane._CWriter is None:
        pytest.skip("gpipe.worker.dataplane._ring was not built here")
    blank = unix_lane._CWriter.__new__(unix_lane._CWriter)
    for call in (lambda: blank.post(0, 0), lambda: blank.place(1), lambda: blank.send(0, b"", 0, 0), blank.unread):
        with pytest.raises(RuntimeError, match="before it was initialised"):
            call()
    ring = Ring.create()
    with pytest.raises(RuntimeError, match="once"):
        ring.writer.__init__(mmap.mmap(-1, 4096), 1, 1, 1, 1, 8, 0, 0)  # type: ignore[misc]
    m = mmap.mmap(-1, 1 << 16)
    held = unix_lane._CWriter(m, 1 << 15, 16, 1 << 14, 1 << 14, HEADER * 8, ring.posted, ring.freed)
    with pytest.raises(BufferError):  # the mapping is held while its writer lives
        m.close()
    del held
    m.close()


@pytest.fixture(params=["c", "python"])
def ring_lane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A lane with its ring, its sending end written by worker/dataplane/_ring.c's Writer or by the Python one."""
    _writer(request.param, monkeypatch)
    a, b, mine, theirs = _ring_lane()
    yield a, b, mine, theirs
    a.close()
    b.close()


def test_through_the_ring_every_kind_of_message_arrives_as_sent_with_no_byte_on_the_socket(ring_lane: Any) -> None:
    a, b, mine, theirs = ring_lane
    out, into = UnixSender(a, "activation to stage 1", mine), UnixReceiver(b, "stage 0's activation", theirs)
    messages = _messages()
    for mb, (value, grads) in enumerate(messages):
        out.send(mb, value, grads)
    out.flush(10)
    assert out.ring_messages == len(messages)
    b.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing went on the socket
        b.recv(1)
    b.setblocking(True)
    for mb in reversed(range(len(messages))):
        value, grads = messages[mb]
        assert _same(value, into.get(mb, 10), grads) == ""
    assert into.bytes == out.bytes > 0


def test_what_the_ring_has_no_room_for_goes_on_the_socket_and_all_arrive_in_any_order(ring_lane: Any) -> None:
    """3 MiB messages: the ring (16 MiB) takes five unread, the rest go on the socket (and its writer). Once all
    are read the ring starts again from its beginning; a message over MAX_RING_MESSAGE always takes the socket."""
    a, b, mine, theirs = ring_lane
    out, into = UnixSender(a, "activation to stage 1", mine), UnixReceiver(b, "stage 0's activation", theirs)
    sent = [torch.full((3 << 18,), float(mb)) for mb in range(9)]
    for mb, t in enumerate(sent):
        out.send(mb, t)
    assert 0 < out.ring_messages < len(sent)
    for mb in [8, 0, 4, 7, 1, 2, 3, 6, 5]:
        assert torch.equal(into.get(mb, 10), sent[mb])
    out.flush(10)
    before = out.ring_messages
    for mb in range(9, 12):
        out.send(mb, sent[mb - 9])
        assert torch.equal(into.get(mb, 10), sent[mb - 9])
    assert out.ring_messages == before + 3
    big = torch.arange(unix_lane.MAX_RING_MESSAGE // 4 + 1, dtype=torch.float32)
    out.send(12, big)
    assert out.ring_messages == before + 3
    assert torch.equal(into.get(12, 10), big)


def test_messages_of_one_tag_arrive_in_the_order_sent_whichever_way_each_goes(ring_lane: Any) -> None:
    """An evaluation's micro-batches repeat their tags batch after batch, and a stage may run a batch ahead of the
    next: batch 0's tag -2 is over MAX_RING_MESSAGE (the socket), batch 1's messages would fit the ring. Each
    batch gets its own, in order; later ones go to the ring again once the peer has read the socket."""
    a, b, mine, theirs = ring_lane
    out, into = UnixSender(a, "activation to stage 1", mine), UnixReceiver(b, "stage 0's activation", theirs)
    big = torch.full((unix_lane.MAX_RING_MESSAGE // 4 + 16,), 1.0)
    batches = [[torch.full((4,), 10.0), big], [torch.full((4,), 20.0), torch.full((4,), 2.0)],
               [big + 1, torch.full((4,), 3.0)]]
    for batch in batches:  # the sender runs every batch ahead of the receiver
        for m, t in enumerate(batch):
            out.send(-1 - m, t)
    for batch in batches:
        for m, t in enumerate(batch):
            assert torch.equal(into.get(-1 - m, 10), t)
    out.flush(10)
    before = out.ring_messages
    out.send(-1, torch.ones(2))  # all read: the ring again
    assert out.ring_messages == before + 1 and torch.equal(into.get(-1, 10), torch.ones(2))


def test_a_ring_with_every_slot_unread_sends_on_the_socket_in_order(ring_lane: Any) -> None:
    a, b, mine, theirs = ring_lane
    out, into = UnixSender(a, "activation to stage 1", mine), UnixReceiver(b, "stage 0's activation", theirs)
    count = unix_lane.RING_SLOTS + 40
    for k in range(count):  # one tag, as an evaluation's: only the order tells them apart
        out.send(-1, torch.tensor([float(k)]))
    assert out.ring_messages == unix_lane.RING_SLOTS
    got = [into.get(-1, 10).item() for _ in range(100)]  # the ring has room again, the socket some unread
    for k in range(count, count + 50):
        out.send(-1, torch.tensor([float(k)]))
    got += [into.get(-1, 10).item() for _ in range(count - 50)]
    assert got == [float(k) for k in range(count + 50)]
    out.flush(10)


def test_a_sender_whose_messages_are_read_keeps_to_the_rings_first_bytes(ring_lane: Any) -> None:
    """Messages read as they come: the sender takes back their room before it would pass WARM_BYTES, and writes
    from the ring's start again; the memory the ring touches stays that of the messages in flight."""
    a, b, mine, theirs = ring_lane
    out, into = UnixSender(a, "activation to stage 1", mine), UnixReceiver(b, "stage 0's activation", theirs)
    sent = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB
    offsets = []
    for mb in range(20):
        out.send(mb, sent + mb)
        offsets.append(mine.table[2 * mb])
        assert torch.equal(into.get(mb, 10), sent + mb)
    assert out.ring_messages == 20
    assert max(offsets) < unix_lane.WARM_BYTES and offsets.count(0) >= 5, offsets


def test_a_receiver_waiting_on_the_ring_wakes_for_a_message_and_its_deadline_names_the_lane(ring_lane: Any) -> None:
    a, b, mine, theirs = ring_lane
    out, into = UnixSender(a, "activation to stage 1", mine), UnixReceiver(b, "stage 0's activation", theirs)
    later = threading.Timer(0.3, lambda: out.send(0, torch.ones(3)))
    later.start()
    t0 = time.monotonic()
    assert torch.equal(into.get(0, 20), torch.ones(3))
    assert time.monotonic() - t0 < 10
    later.join()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"stage 0's activation of micro-batch 1"):
        into.get(1, 0.3)
    assert time.monotonic() - t0 < 5
    out.send(1, torch.zeros(2))  # the lane goes on
    assert torch.equal(into.get(1, 10), torch.zeros(2))


def test_a_slot_out_of_the_rings_bounds_fails_the_receive_in_our_words(ring_lane: Any) -> None:
    a, b, mine, theirs = ring_lane
    out, into = UnixSender(a, "activation to stage 1", mine), UnixReceiver(b, "stage 0's activation", theirs)
    out.send(0, torch.ones(4))
    mine.table[0] = unix_lane.RING_BYTES - 8  # its offset: the message would run past the ring's end
    with pytest.raises(ConnectionError, match=r"receiving stage 0's activation failed: .*out of its bounds"):
        into.get(0, 5)


def test_a_message_shorter_than_its_slot_fails_the_receive_in_our_words(ring_lane: Any) -> None:
    a, b, mine, theirs = ring_lane
    out, into = UnixSender(a, "activation to stage 1", mine), UnixReceiver(b, "stage 0's activation", theirs)
    out.send(0, torch.ones(4))
    mine.table[1] += 64  # its length
    with pytest.raises(ConnectionError, match=r"receiving stage 0's activation failed: .* bytes in"):
        into.get(0, 5)


def test_a_ring_that_is_not_a_lanes_is_refused_and_one_not_offered_is_none() -> None:
    import os

    a, b = _lane()
    try:
        fds = [os.memfd_create("x"), os.eventfd(0), os.eventfd(0)]  # unsealed, and of no size
        socket.send_fds(a, [b"R"], fds)
        for fd in fds:
            os.close(fd)
        with pytest.raises(ValueError, match="wrong size, or not sealed"):
            take_ring(b, time.monotonic() + 5)
        a.sendall(b"-")  # a host without memfd: the lane keeps to its socket
        assert take_ring(b, time.monotonic() + 5) is None
        with pytest.raises(TimeoutError):  # nothing offered
            take_ring(b, time.monotonic() + 0.2)
    finally:
        a.close()
        b.close()


def test_a_host_that_allows_no_memfd_keeps_the_lane_on_its_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    def refused(*args: Any) -> int:
        raise PermissionError(1, "Operation not permitted")

    a, b = _lane()
    try:
        monkeypatch.setattr(os, "memfd_create", refused)  # a sandbox's seccomp policy
        assert offer_ring(a) is None
        assert take_ring(b, time.monotonic() + 5) is None
        out, into = UnixSender(a, "to 1", None), UnixReceiver(b, "from 0", None)
        out.send(0, torch.ones(2))
        assert torch.equal(into.get(0, 5), torch.ones(2)) and out.ring_messages == 0
    finally:
        a.close()
        b.close()


def test_a_peer_that_ends_after_posting_to_the_ring_is_read_out_then_seen_gone() -> None:
    """The peer posts two messages to the ring and exits: both are read, then its end, at once; a sender whose
    peer has closed the lane says so at its flush (a message in the ring cannot find it out)."""
    listener = Listener()
    code = (
        "import time, torch\n"
        "from gpipe.worker.dataplane.unix_lane import UnixSender, connect, offer_ring\n"
        f"s = connect({listener.name!r}, bytes.fromhex({listener.token.hex()!r}), time.monotonic() + 10)\n"
        "out = UnixSender(s, 'to 0', offer_ring(s))\n"
        "out.send(0, torch.ones(5)); out.send(1, torch.zeros(5))\n"
        "assert out.ring_messages == 2\n"
    )
    peer = subprocess.Popen([sys.executable, "-c", code])
    try:
        sock = listener.accept(time.monotonic() + 30, "rank 1")
        into = UnixReceiver(sock, "stage 1's gradient", take_ring(sock, time.monotonic() + 30))
        assert peer.wait(30) == 0
        assert torch.equal(into.get(1, 10), torch.zeros(5)) and torch.equal(into.get(0, 10), torch.ones(5))
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=r"stage 1's gradient failed: the peer closed the lane"):
            into.get(2, 30)
        assert time.monotonic() - t0 < 10
    finally:
        peer.kill()
        peer.wait(10)
    a, b, mine, _ = _ring_lane()
    out = UnixSender(a, "activation to stage 1", mine)
    b.close()
    out.send(0, torch.ones(3))  # into the ring
    with pytest.raises(ConnectionError, match=r"sending activation to stage 1 failed: the peer closed the lane"):
        out.flush(5)
    a.close()
    # A peer that has read everything and then ends loses nothing: the flush is clean.
    a, b, mine, theirs = _ring_lane()
    out, into = UnixSender(a, "activation to stage 1", mine), UnixReceiver(b, "stage 0's activation", theirs)
    out.send(0, torch.ones(3))
    assert torch.equal(into.get(0, 5), torch.ones(3))
    b.close()
    out.flush(5)
    a.close()


def test_a_message_waiting_for_the_ring_to_drain_sees_the_peers_end_at_once() -> None:
    """A message over the ring's size waits behind one unread in the ring; the peer ends without reading: the
    flush fails at once naming the lane, not at its deadline."""
    a, b, mine, theirs = _ring_lane()
    out = UnixSender(a, "activation to stage 1", mine)
    out.send(0, torch.zeros(4))  # the ring
    out.send(1, torch.zeros(unix_lane.MAX_RING_MESSAGE // 4 + 16))  # the socket, once the ring is read
    b.close()
    del theirs
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=r"sending activation to stage 1 of micro-batch 1 failed: the peer"):
        out.flush(30)
    assert time.monotonic() - t0 < 10
    a.close()


def test_a_rings_memory_and_descriptors_are_let_go_with_the_last_end_that_holds_it() -> None:
    import os

    def open_fds() -> int:  # this process's rings' memory and eventfds
        gc.collect()
        links = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sum("memfd:gpipe-lane" in x or "eventfd" in x for x in links)

    before = open_fds()
    a, b, mine, theirs = _ring_lane()
    out, into = UnixSender(a, "to 1", mine), UnixReceiver(b, "from 0", theirs)
    out.send(0, torch.ones(3))
    assert torch.equal(into.get(0, 5), torch.ones(3))
    a.close()
    b.close()
    assert open_fds() == before + 8  # each end: its memfd, the map's own copy of it, two eventfds
    del out, into, mine, theirs
    assert open_fds() == before


def test_a_ring_whose_counters_block_or_are_not_eventfds_is_refused() -> None:
    """A peer's eventfds are checked for O_NONBLOCK (a blocking one waits with no deadline) and for being
    eventfds at all; before the fix either was taken as offered."""
    import fcntl
    import os

    def blocking_eventfd() -> int:
        return os.eventfd(0)

    def non_blocking_file() -> int:
        fd = os.open(os.devnull, os.O_RDONLY)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        return fd

    for make in (blocking_eventfd, non_blocking_file):
        ring = unix_lane.Ring.create()
        a, b = _lane()
        try:
            odd = make()
            socket.send_fds(a, [b"R"], [ring.fds[0], odd, ring.fds[2]])
            os.close(odd)
            with pytest.raises(ValueError, match="not non-blocking eventfds"):
                take_ring(b, time.monotonic() + 5)
        finally:
            a.close()
            b.close()
