"""Stage-to-stage transfer: gpipe's channels against raw gloo send/recv of the same tensors.

    python bench/transfer.py [--rounds 5] [--count 50]

Two processes on loopback, one core each, with the stages' malloc settings. Each round sends `count` tensors of
each size both ways (raw `dist.send`/`dist.recv`, then gpipe's Sender/Receiver,
which add a header per tensor and run on their own threads), interleaved; the
figure is the median over rounds of the receiver's throughput.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = [(64, 256), (32, 1024), (256, 1024), (2048, 1024)]  # float32: 64 KiB, 128 KiB, 1 MiB, 8 MiB


def peer(rank: int, port: int, rounds: int, count: int) -> None:
    import torch
    import torch.distributed as dist

    from gpipe.worker.dataplane.channel import Receiver, Sender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])  # a channel's own group, as a stage has
    dev = torch.device("cpu")
    ch = Sender(1, group, dev, "bench", 300.0) if rank == 0 else Receiver(0, group, dev, "bench", 300.0)
    results: dict[tuple[str, tuple[int, int]], list[float]] = {}
    for _ in range(rounds):
        for shape in SIZES:
            t = torch.randn(shape)
            for kind in ("raw", "channel"):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    for i in range(count):
                        if kind == "raw":
                            dist.send(t, 1, group=group)
                        else:
                            ch.send(i, t)
                    if kind == "channel":
                        ch.flush(60)
                else:
                    if kind == "raw":
                        buf = torch.empty(shape)
                        for _ in range(count):
                            dist.recv(buf, 0, group=group)
                    else:
                        ch.expect(count)
                        for i in range(count):
                            ch.get(i, 60)
                dt = time.perf_counter() - t0
                dist.barrier()
                results.setdefault((kind, shape), []).append(count * t.numel() * 4 / dt)
    if rank == 1:
        print(f"{'tensor':>12} {'MiB':>6} {'raw gloo MB/s':>14} {'gpipe MB/s':>11} {'ratio':>6}")
        for shape in SIZES:
            raw = statistics.median(results[("raw", shape)])
            ours = statistics.median(results[("channel", shape)])
            mib = shape[0] * shape[1] * 4 / 2**20
            print(f"{str(shape):>12} {mib:6.2f} {raw / 1e6:14.0f} {ours / 1e6:11.0f} {ours / raw:6.3f}")
    ch.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--count", type=int, default=50)
    ap.add_argument("--peer", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer is not None:
        peer(a.peer, a.port, a.rounds, a.count)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cores = sorted(os.sched_getaffinity(0))
    from gpipe.worker.agent import MALLOC_ENV  # as the stages run

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **MALLOC_ENV)
    procs = [
        subprocess.Popen(["taskset", "-c", str(cores[r % len(cores)]), sys.executable, __file__,
                          "--peer", str(r), "--port", str(port), "--rounds", str(a.rounds),
                          "--count", str(a.count)], env=env)
        for r in (0, 1)
    ]
    for p in procs:
        if p.wait(timeout=600):
            sys.exit(f"a peer failed with exit code {p.returncode}")


if __name__ == "__main__":
    main()
