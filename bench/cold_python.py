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
- worker.unix_lane.UnixSender.send of that activation to the reader;
- the socket's sendmsg of the same bytes alone (no Python of ours around it);
- UnixSender.send of it into the lane's ring of shared memory (worker.unix_lane.Ring), the reader taking it
  out as a UnixReceiver does (--no-ring leaves these two rows out);
- the ring's part alone: the copy into the ring and the eventfd's write.

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
from gpipe.wire import encode  # noqa: E402
from worker.unix_lane import Ring, UnixReceiver, UnixSender, _view  # noqa: E402

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
    mine_r, theirs_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # a second lane, with the ring
    reader = _reader(theirs, None, cores[0], [mine, mine_r, theirs_r])
    ring_reader = _reader(theirs_r, ring, cores[0], [mine, mine_r, theirs]) if ring is not None else None
    theirs.close()
    theirs_r.close()
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
        if ring_reader is not None:
            os.waitpid(ring_reader, 0)
    print(f"us a call, medians of {a.rounds} rounds of {a.calls} (width {a.width}, 4 blocks, micro-batch "
          f"{MICRO_BATCH}: a {MICRO_BATCH * a.width * 4 >> 10} KiB activation); load {os.getloadavg()[0]:.1f}")
    print("| call | after the blocks | warm | ratio |\n| --- | ---: | ---: | ---: |")
    for name, got in rows.items():
        cold_us = statistics.median(c for c, _ in got) * 1e6
        warm_us = statistics.median(w for _, w in got) * 1e6
        print(f"| {name} | {cold_us:.1f} | {warm_us:.1f} | {cold_us / warm_us:.1f}x |")


if __name__ == "__main__":
    main()
