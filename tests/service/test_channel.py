"""A c10d channel between two real processes (gloo over loopback): its waits end with our words, not gloo's."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gpipe import structure
from gpipe.wire import HEADER, PACK_MAX_BYTES
from gpipe.worker.dataplane.channel import Receiver, Sender
from tests.support.ports import free_port

STEP_S = 1.0  # the step's deadline, as StageConfig.step_timeout_s


def _messages() -> list[tuple[Any, list[bool]]]:
    """(value, wants grad) of each message, alike in both processes: shapes that grow, shrink and repeat,
    other dtypes, an empty tensor, a 0-d one, a structure."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return [
        (r(4, 8), [True]),          # apart: the lane's first (capacity 0 -> 128 bytes)
        (r(4, 8), [True]),          # packed
        (r(2, 8), [False]),         # packed, smaller
        (r(8, 8), [True]),          # apart, larger (-> 256)
        (r(8, 8, dtype=torch.bfloat16), [False]),  # packed, another dtype
        (r(0, 8), [False]),         # an empty tensor: a header alone
        ((r(3), {"k": 5, "m": r(2, 2)}), [True, False]),  # a structure: header, description, tensors
        (torch.tensor(True), [False]),             # packed, 0-d
        (r(4, 8, dtype=torch.float64), [True]),    # packed (256 bytes)
        (r(16, 8), [True]),         # apart (-> 512)
        (r(8, 4).t(), [False]),     # packed, a transposed view
        (r(PACK_MAX_BYTES // 4 + 16), [False]),  # apart: over the most a lane packs, the capacity stays
        (r(PACK_MAX_BYTES // 4 + 16), [True]),   # apart again
    ]


def _same(a: Any, b: Any, grads: list[bool]) -> str:
    """'' if `b` (received) is `a` (sent) with the gradient flags asked, else what differs."""
    ta, tb = structure.tensors(a), structure.tensors(b)
    if structure.map_tensors(a, lambda t: 0) != structure.map_tensors(b, lambda t: 0) or len(ta) != len(tb):
        return f"structure {structure.describe(b)}, sent {structure.describe(a)}"
    for i, (x, y) in enumerate(zip(ta, tb, strict=True)):
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return f"tensor {i}: {y.dtype} {list(y.shape)}, sent {x.dtype} {list(x.shape)}"
        if y.requires_grad != (i < len(grads) and grads[i]):
            return f"tensor {i}: requires_grad {y.requires_grad}"
    return ""


def _end(rank: int, port: int, out: Any, done: Any) -> None:
    """First, rank 0 sends _messages() and rank 1 compares what arrives; the first two also on a lane that
    takes itself for NCCL's. Then rank 0 sends a bare header that asks for 4 PiB, and a structure whose
    description asks for as much, which rank 1 refuses. Then
    rank 0 sends micro-batch 0 only; rank 1 takes it, computes for most of a
    step, then asks for 1. Rank 0 also sends on a lane that rank 1 never receives on, and flushes it."""
    # Forked from a process whose OpenMP pool may have run (an earlier test's): a parallel region here would
    # wait for threads that the fork did not copy. One thread, no parallel region.
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
        shapes, nccl, group, unread, hostile, described = (dist.new_group([0, 1]) for _ in range(6))
        cpu = torch.device("cpu")
        messages = _messages()
        backend = dist.get_backend
        if rank == 0:
            lane = Sender(1, shapes, cpu, "messages")
            dist.get_backend = lambda g: dist.Backend.NCCL  # this process only, for the next lane
            apart = Sender(1, nccl, cpu, "messages as on NCCL")
            dist.get_backend = backend
            posted: dict[str, int] = {}
            isend = dist.isend
            for name, ch, some in (("gloo", lane, messages), ("nccl", apart, messages[:2])):
                dist.isend = lambda t, *a, n=name, **k: posted.update({n: posted.get(n, 0) + 1}) or isend(t, *a, **k)
                for mb, (value, grads) in enumerate(some):
                    ch.send(mb, value, grads)
                dist.isend = isend
                ch.flush(30)
            out.send((posted, f"{lane._capacity.bytes} {apart._capacity.bytes}"))
            # micro-batch 0, float32, 2 dims: 2**30 x 2**20 (4 PiB), no flags
            dist.send(torch.tensor([0, 0, 2, 0, 1 << 30, 1 << 20] + [0] * (HEADER - 6)), 1, group=hostile)
            # a structure (a tuple of one float32 tensor) whose description asks for the same
            text = b'{"s":{"t":[{"T":0}]},"t":[[0,[1073741824,1048576],0]]}'
            dist.send(torch.tensor([0, -1, len(text), 0] + [0] * (HEADER - 4)), 1, group=described)
            dist.send(torch.frombuffer(bytearray(text), dtype=torch.uint8), 1, group=described)
            s = Sender(1, group, cpu, "stage 0's activation")
            s.send(0, torch.ones(3))
            s.flush(30)
            lost = Sender(1, unread, cpu, "stage 0's skip")
            lost.send(0, torch.ones(3))
            try:
                lost.flush(STEP_S)
                out.send(("sent", "micro-batch 0 of the skip"))
            except BaseException as e:
                out.send((type(e).__name__, str(e)))
            done.wait(60)  # micro-batch 1 never comes; stay up until the peer's wait for it ended
            return
        into = Receiver(0, shapes, cpu, "messages", 30)
        dist.get_backend = lambda g: dist.Backend.NCCL
        apart_into = Receiver(0, nccl, cpu, "messages as on NCCL", 30)
        dist.get_backend = backend
        into.expect(len(messages))
        apart_into.expect(2)
        wrong = [f"message {mb}: {d}" for mb, (value, grads) in enumerate(messages)
                 if (d := _same(value, into.get(mb, 30), grads))]
        wrong += [f"message {mb} as on NCCL: {d}" for mb, (value, grads) in enumerate(messages[:2])
                  if (d := _same(value, apart_into.get(mb, 30), grads))]
        out.send(("compared", "; ".join(wrong) + f" capacity {into._capacity.bytes} {apart_into._capacity.bytes}"))
        refused = []
        for g in (hostile, described):
            refusing = Receiver(0, g, cpu, "stage 0's activation", 30)
            refusing.expect(1)
            try:
                refusing.get(0, 30)
                refused.append("got 4 PiB")
            except BaseException as e:
                refused.append(f"{type(e).__name__}: {e}")
        out.send(("refused", refused))
        r = Receiver(0, group, cpu, "stage 0's activation", STEP_S)
        r.expect(2)  # the receive of micro-batch 1 is posted as soon as 0 has arrived
        first = r.get(0, 30)
        time.sleep(STEP_S * 0.7)  # the forward of micro-batch 0
        try:
            r.get(1, STEP_S)
            out.send(("got", "micro-batch 1"))
        except BaseException as e:
            out.send((type(e).__name__, f"{first.tolist()} {e}"))
    except BaseException as e:
        out.send(("setup", repr(e)))
    finally:
        done.set()
        import os
        os._exit(0)  # leave the gloo pair as it is: the test only reads the pipe


@pytest.mark.multiprocess
def test_messages_of_any_shape_travel_one_transfer_each_where_they_can_and_waits_end_in_our_words():
    ctx = mp.get_context("fork")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    done = ctx.Event()  # rank 1 is through: rank 0 may go
    procs = [ctx.Process(target=_end, args=(k, port, pipes[k][1], done), daemon=True) for k in range(2)]
    for p in procs:
        p.start()
    try:
        said: list[list[Any]] = [[], []]
        deadline = time.monotonic() + 60
        count = (2, 3)  # what each rank says
        while len(said[0]) + len(said[1]) < sum(count) and time.monotonic() < deadline:
            for k in (0, 1):
                if len(said[k]) < count[k] and pipes[k][0].poll(0.05):
                    said[k].append(pipes[k][0].recv())
                    if said[k][-1][0] == "setup":
                        said[k] += [said[k][-1]] * (count[k] - len(said[k]))  # it says no more
        failed = {k: m[1] for k in (0, 1) for m in said[k] if m[0] == "setup"}
        assert not failed, f"failed: {failed}; said: {said}"
        assert [len(m) for m in said] == list(count), f"exit codes {[p.exitcode for p in procs]}; said: {said}"
        said = said[0] + said[1]
        (transfers, sent_capacity), (sent_kind, sent_text), (compared, wrong), (refused, why), (kind, text) = said
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    # Every message arrived as sent, and both ends agree on the lane's capacity: the largest single tensor that
    # went apart (16 x 8 float32), so that the ones no larger went packed.
    # On the lane that takes itself for NCCL's the capacity stays 0: sizes of a send and its receive match.
    assert compared == "compared" and wrong == " capacity 512 0", (compared, wrong)
    assert sent_capacity == "512 0", sent_capacity
    # One transfer for each packed message (6), a header alone for the empty tensor, a header and the data for
    # the 5 single tensors that went apart (2 over PACK_MAX_BYTES), and 4 for the structure (header,
    # description, 2 tensors). As on NCCL: a header and the data each.
    assert transfers == {"gloo": 6 + 1 + 5 * 2 + 4, "nccl": 2 * 2}, transfers
    # A header or a structure's description that asks for more than the device's memory is refused before
    # anything is allocated.
    assert refused == "refused" and len(why) == 2, (refused, why)
    for said_why in why:
        assert said_why.startswith("ConnectionError: receiving stage 0's activation failed"), said_why
        assert f"a message of {(1 << 50) * 4} bytes" in said_why, said_why
    # A receive posted early (as soon as micro-batch 0 arrived) still ends on the stage's own deadline.
    assert kind == "TimeoutError", (kind, text)
    assert text.startswith("[1.0, 1.0, 1.0] ") and "waiting for stage 0's activation of micro-batch 1" in text, text
    # A send the peer never takes: flush ends on its deadline, naming the lane.
    assert sent_kind == "TimeoutError", (sent_kind, sent_text)
    assert "sending stage 0's skip" in sent_text, sent_text


# -- the channel on a device, over a stand-in for c10d ------------------------------------------------


class _Done:
    """A c10d Work that is done."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        return True


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_message_goes_whole_on_the_channels_device_and_arrives_where_the_stage_reads_it(device, monkeypatch):
    """One process, c10d stood in for by a queue (as NCCL: sizes equal, no packing): each part the sender
    hands over is on its device; a CPU tensor of the value goes there too; int16 goes as bytes. On CUDA each
    transfer lands late (a kernel that sleeps first, on the receive's stream), and the stage still reads what
    was sent: it waits for the receive's event, not for the device."""
    from gpipe.worker.dataplane import channel

    dev = torch.device(device)
    wire: queue.Queue[torch.Tensor] = queue.Queue()
    handed: list[str] = []

    def isend(t: torch.Tensor, peer: int, group: Any = None) -> _Done:
        handed.append(f"{str(t.dtype)[6:]}@{t.device.type}")
        wire.put(t.clone())
        return _Done()

    def recv(t: torch.Tensor, peer: int, group: Any, timeout: Any) -> None:
        src = wire.get(timeout=10)
        if t.device.type == "cuda":
            torch.cuda._sleep(50_000_000)  # the transfer lands late, on the receive's own stream
        t.reshape(-1).copy_(src.reshape(-1), non_blocking=True)

    monkeypatch.setattr(dist, "get_backend", lambda g: "nccl")
    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(channel, "_recv", recv)
    ids = torch.tensor([-32768, -1, 0, 32767], dtype=torch.int16)
    values = [ids.to(dev), {"h": torch.randn(3, 2, device=dev), "cpu": ids, "b": torch.tensor([True, False])}]
    s, r = Sender(1, None, dev, "out"), Receiver(0, None, dev, "in", 30)
    r.expect(len(values))
    for mb, v in enumerate(values):
        s.send(mb, v)
        got = r.get(mb, 30)
        for x, y in zip(structure.tensors(v), structure.tensors(got), strict=True):
            assert y.device.type == dev.type and y.dtype == x.dtype and torch.equal(y.cpu(), x.cpu()), (mb, y)
    s.flush(10)
    r.close()
    where = dev.type
    assert handed == [f"uint8@{where}", f"uint8@{where}",  # the int16: header, bytes
                      f"uint8@{where}", f"uint8@{where}",  # the structure: header, description
                      f"float32@{where}", f"uint8@{where}", f"bool@{where}"], handed  # its CPU int16 as bytes
