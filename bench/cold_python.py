"""What a line of the engine's Python costs right after an action's blocks: warm, and after their GEMMs.

    python bench/cold_python.py [--rounds 5] [--width 1024] [--calls 300]

One process pinned to one core with one thread (as `run` pins a worker), and a
reader process on the other core draining a Unix socket pair. Each call below
is timed right after the blocks of bench/action_cost.py (4 x (Linear(width)+ReLU)
on a micro-batch of 32: "after the blocks"), and again right after the same
call ("warm"), medians over calls, then over rounds:

- gpipe.wire.encode of a 32 x width activation (a message's header);
- seeding a stage's 4 layers as gpipe.rng.seeded_forward does per forward
  (the micro-batch's key, then per layer a splitmix round and manual_seed);
- gpipe.worker.dataplane.unix_lane.UnixSender.send of that activation to the reader;
- the socket's sendmsg of the same bytes alone (no Python of ours around it);
- UnixSender.send of it into the lane's ring of shared memory (gpipe.worker.dataplane.unix_lane.Ring), the reader taking it
  out as a UnixReceiver does (--no-ring leaves these two rows out);
- the ring's part alone: the copy into the ring and the eventfd's write;
- the ring's writer alone (nobody waiting): worker/dataplane/_ring.c's Writer, and gpipe.worker.dataplane.unix_lane._Writer (the Python
  it stands in for), each writing the activation's message, then the eventfd write a reader would make to give
  its room back (in the call: some 1-4 us, the same for both);
- UnixSender.send into a ring written by the Python writer (a third lane and reader).

What it is for: bench/README.md (ab). At width 1024 the blocks stream some
16 MiB of weights through the core's caches; the engine's Python between two
actions then finds little of its own code and data there, and each line runs
many times its warm cost. At width 16 the two columns are close.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpipe.rng import _micro_batch_key, _mix, generators  # noqa: E402
from gpipe.wire import HEADER_BYTES, encode  # noqa: E402
from gpipe.worker.dataplane import unix_lane  # noqa: E402
from gpipe.worker.dataplane.unix_lane import Ring, UnixReceiver, UnixSender, _view  # noqa: E402

BLOCKS, MICRO_BATCH = 4, 32


def _reader(theirs: socket.socket, ring: Ring | None, core: int, others: list[socket.socket]) -> int:
    """A process on `core` that drains `theirs` (and `ring`, as a UnixReceiver does) until its other end closes;
    `others` closed in it (the other ends: this process holding them open, no end would come)."""
    pid = os.fork()
    if pid:
        return pid
    try:
        for s in others:
            s.close()
        os.sched_setaffinity(0, [core])
        if ring is None:
            buf = bytearray(1 << 20)
            while theirs.recv_into(buf):
                pass
        else:
            into, mb = UnixReceiver(theirs, "the reader's", ring), 0
            while True:
                into.get(mb, 3600)
                mb += 1
    except ConnectionError:
        pass  # the socket's end
    finally:
        os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--no-ring", action="store_true", help="leave out the rows of the lane's ring")
    a = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(1)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    ring = None if a.no_ring else Ring.create()
    c_writer = unix_lane._CWriter
    unix_lane._CWriter = None
    ring_py = None if a.no_ring else Ring.create()  # written by the Python writer
    unix_lane._CWriter = c_writer
    mine_r, theirs_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # a second lane, with the ring
    mine_p, theirs_p = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # a third, the Python writer's ring
    reader = _reader(theirs, None, cores[0], [mine, mine_r, theirs_r, mine_p, theirs_p])
    ring_reader = _reader(theirs_r, ring, cores[0], [mine, mine_r, theirs, mine_p, theirs_p]) \
        if ring is not None else None
    py_reader = _reader(theirs_p, ring_py, cores[0], [mine, mine_r, theirs, theirs_r, mine_p]) \
        if ring_py is not None else None
    theirs.close()
    theirs_r.close()
    theirs_p.close()
    os.sched_setaffinity(0, [cores[-1]])
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.ReLU())
                                   for _ in range(BLOCKS)])
    x = torch.randn(MICRO_BATCH, a.width)
    out = UnixSender(mine, "activation to the reader")
    gens = generators(torch.device("cpu"))

    def seed() -> None:
        key = _micro_batch_key(0, 1, 2)
        for index in range(BLOCKS):
            s = _mix(key ^ index) >> 1
            for g in gens:
                g.manual_seed(s)

    calls: dict[str, Callable[[torch.Tensor], object]] = {
        "gpipe.wire.encode of the activation": lambda y: encode(3, y, (True,), "gloo"),
        f"seeding {BLOCKS} layers (gpipe.rng.seeded_forward's)": lambda y: seed(),
        "UnixSender.send of the activation": lambda y: out.send(3, y, (True,)),
        "the socket's sendmsg of its bytes alone": lambda y: mine.sendmsg([_view(y)]),
    }
    if ring is not None:
        mb = iter(range(1 << 40))  # each message its own micro-batch: the reader takes them in order
        into_ring = UnixSender(mine_r, "activation to the reader's ring", ring)
        calls["UnixSender.send of the activation into the ring"] = lambda y: into_ring.send(next(mb), y, (True,))
        bare = Ring.create()  # nobody reads it: each copy goes to its start, as the lane's does once all are read

        def ring_alone(y: torch.Tensor) -> None:
            bare.data[:y.nbytes] = _view(y)
            os.eventfd_write(bare.posted, 1)

        calls["the ring's copy and eventfd write alone"] = ring_alone
        tail = bytes(HEADER_BYTES - 8)
        c_bare = Ring.create()
        unix_lane._CWriter = None
        py_bare = Ring.create()
        unix_lane._CWriter = c_writer

        def writer_alone(bare: Ring) -> Callable[[torch.Tensor], object]:
            def send(y: torch.Tensor) -> None:
                if not bare.writer.send(3, tail, y.data_ptr(), y.nbytes):
                    raise RuntimeError("the ring is full: what was read is not given back")
                os.eventfd_write(bare.freed, 1)  # (after the timed call: the next call's, as a reader's would)
            return send

        if c_writer is not None:
            calls["the ring's writer alone: worker/dataplane/_ring.c's"] = writer_alone(c_bare)
        calls["the ring's writer alone: the Python one"] = writer_alone(py_bare)
        py_mb = iter(range(1 << 40))
        into_py = UnixSender(mine_p, "activation to the reader's ring (Python writer)", ring_py)
        calls["UnixSender.send of the activation into the ring, the Python writer"] = \
            lambda y: into_py.send(next(py_mb), y, (True,))
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    try:
        with torch.no_grad():
            for _ in range(a.rounds):
                for name, call in calls.items():
                    cold, warm = [], []
                    for _ in range(a.calls):
                        y = blocks(x)
                        t0 = time.perf_counter()
                        call(y)
                        t1 = time.perf_counter()
                        call(y)
                        t2 = time.perf_counter()
                        cold.append(t1 - t0)
                        warm.append(t2 - t1)
                    rows[name].append((statistics.median(cold[20:]), statistics.median(warm[20:])))
                out.flush(60)
    finally:
        out.close()
        mine.close()
        os.waitpid(reader, 0)
        mine_r.close()
        mine_p.close()
        for pid in (ring_reader, py_reader):
            if pid is not None:
                os.waitpid(pid, 0)
    print(f"us a call, medians of {a.rounds} rounds of {a.calls} (width {a.width}, 4 blocks, micro-batch "
          f"{MICRO_BATCH}: a {MICRO_BATCH * a.width * 4 >> 10} KiB activation); load {os.getloadavg()[0]:.1f}")
    print("| call | after the blocks | warm | ratio |\n| --- | ---: | ---: | ---: |")
    for name, got in rows.items():
        cold_us = statistics.median(c for c, _ in got) * 1e6
        warm_us = statistics.median(w for _, w in got) * 1e6
        print(f"| {name} | {cold_us:.1f} | {warm_us:.1f} | {cold_us / warm_us:.1f}x |")


if __name__ == "__main__":
    main()
