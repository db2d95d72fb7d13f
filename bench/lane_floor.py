"""What a message between two workers of one host costs at the least: gloo against a slot of shared memory.

    python bench/lane_floor.py [--rounds 5] [--messages 2000] [--kib 128]

Two processes, each pinned to its own core with one thread (as `run` pins its workers), pass a message back
and forth: over gloo (c10d's send and recv, without our header or Python thread),
and through a slot of shared memory (the sender copies the bytes in and wakes the receiver with an eventfd;
the receiver waits on it and copies them out into a new tensor). Each side's CPU time a message (the process's,
all threads: gloo's own included) and the round trip's wall time. Rounds alternate the two; the figures are
medians over rounds, since absolute times on these machines drift twofold between runs.

What it is for: bench/README.md (s) and (x) found the data plane to be what is left of an action's overhead
over its blocks alone, and barely dependent on the message's size; this is the floor a lane that is not a
socket would have on a CPU host (NCCL's SHM and P2P transports are that lane on GPUs).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import mmap
import os
import socket
import statistics
import time
from collections.abc import Callable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pair(body: Callable[[int, int, int], tuple[float, float]], n: int, size: int) -> tuple[float, float]:
    """`body(me, n, size, out)` in two forked processes pinned to cores 0 and 1: (CPU us a message, wall us a
    round trip), the mean of the two sides' CPU."""
    r, w = os.pipe()
    pid = os.fork()
    me = 0 if pid else 1
    os.sched_setaffinity(0, {me % os.cpu_count()})  # type: ignore[operator]
    try:
        cpu, wall = body(me, n, size)
        os.write(w, f"{cpu} {wall}\n".encode())
    finally:
        if not pid:
            os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    lines = os.read(r, 4096).decode().split()
    os.close(r)
    cpus = [float(x) for x in lines[0::2]]
    return statistics.mean(cpus), float(lines[1])


def _timed(trip: Callable[[], None], n: int) -> tuple[float, float]:
    """`trip` 50 times, then `n` times timed: (this process's CPU us a message, wall us a round trip)."""
    for _ in range(50):
        trip()
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        trip()
    c1, w1 = time.process_time(), time.perf_counter()
    return (c1 - c0) / n / 2 * 1e6, (w1 - w0) / n * 1e6


def _gloo(port: int) -> Callable[[int, int, int], tuple[float, float]]:
    def body(me: int, n: int, size: int) -> tuple[float, float]:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=me, world_size=2)
        src, dst = torch.randn(size // 4), torch.empty(size // 4)
        peer = 1 - me

        def trip() -> None:
            if me == 0:
                dist.send(src, peer)
                dist.recv(dst, peer)
            else:
                dist.recv(dst, peer)
                dist.send(src, peer)

        try:
            return _timed(trip, n)
        finally:
            dist.destroy_process_group()
    return body


def _shm(me: int, n: int, size: int, *, shared: mmap.mmap, fds: tuple[int, int]) -> tuple[float, float]:
    import torch

    torch.set_num_threads(1)
    slots = torch.frombuffer(shared, dtype=torch.uint8)
    src = torch.randn(size // 4)
    there, here = (fds[0], fds[1]) if me == 0 else (fds[1], fds[0])

    def send(slot: int) -> None:
        ctypes.memmove(slots[slot * size:].data_ptr(), src.data_ptr(), size)
        os.eventfd_write(there, 1)

    def recv(slot: int) -> torch.Tensor:
        os.eventfd_read(here)
        t = torch.empty(size // 4)
        ctypes.memmove(t.data_ptr(), slots[slot * size:].data_ptr(), size)
        return t

    def trip() -> None:
        if me == 0:
            send(0)
            recv(1)
        else:
            recv(0)
            send(1)

    return _timed(trip, n)


def _unix(me: int, n: int, size: int, *, ends: tuple[socket.socket, socket.socket]) -> tuple[float, float]:
    import torch

    torch.set_num_threads(1)
    sock = ends[me]
    src = torch.randn(size // 4)
    header = bytes(96)
    head = bytearray(96)

    def send() -> None:
        view = memoryview(src.numpy()).cast("B")
        sent = sock.sendmsg([header, view])
        if sent < len(header) + size:
            sock.sendall((header + bytes(view))[sent:])

    def recv() -> torch.Tensor:
        sock.recv_into(head, 96, socket.MSG_WAITALL)
        t = torch.empty(size // 4)
        sock.recv_into(memoryview(t.numpy()).cast("B"), size, socket.MSG_WAITALL)
        return t

    def trip() -> None:
        if me == 0:
            send()
            recv()
        else:
            recv()
            send()

    return _timed(trip, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--kib", type=int, default=128)
    a = ap.parse_args()
    size = a.kib << 10
    got: dict[str, list[tuple[float, float]]] = {"gloo": [], "shared memory": [], "unix socket": []}
    for _ in range(a.rounds):
        got["gloo"].append(_pair(_gloo(_free_port()), a.messages, size))
        shared = mmap.mmap(-1, 2 * size)
        fds = (os.eventfd(0), os.eventfd(0))
        got["shared memory"].append(_pair(functools.partial(_shm, shared=shared, fds=fds), a.messages, size))
        for fd in fds:
            os.close(fd)
        shared.close()
        ends = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for e in ends:
            e.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            e.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        got["unix socket"].append(_pair(functools.partial(_unix, ends=ends), a.messages, size))
        for e in ends:
            e.close()
    print(f"{a.kib} KiB messages, {a.messages} round trips a round, {a.rounds} rounds; load {os.getloadavg()[0]:.1f}")
    print("| lane | CPU us a message (each side) | round trip us |")
    print("| --- | ---: | ---: |")
    for name, runs in got.items():
        print(f"| {name} | {statistics.median(c for c, _ in runs):.1f} | {statistics.median(w for _, w in runs):.1f} |")
    g, s = (statistics.median(c for c, _ in got[k]) for k in ("gloo", "shared memory"))
    print(f"gloo / shared memory, CPU a message: {g / s:.1f}x")


if __name__ == "__main__":
    main()
