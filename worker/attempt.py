"""A job attempt's worker process: joins the RPC world, serves its stage, leaves.

The coordinator creates the stage here remotely (gpipe.worker.stage_server.StageServer,
through rpc.remote) and drives it through its RRef, one call per step; tensors
between stages go over the stage's own channels. The process lives for one
attempt only: a failed attempt's processes are killed, never reused, since an
RPC world or a communicator that saw a failure cannot be trusted again.

    GPIPE_ATTEMPT_SECRET=... python -m worker --rank N --world W --master HOST:PORT --host HOST

where N is the worker's rank and W the attempt's workers (replicas x stages:
which stage of which replica rank N serves is gpipe.topology's, told to the
stage when the coordinator builds it).

The attempt's secret (every key of its store lives under it: gpipe.service.net) comes
from the agent's join line, or from the environment, never from the command
line, which any user of the machine can read.
"""

from __future__ import annotations

import argparse
import importlib
import os
import threading
import warnings

import torch
import torch.distributed.rpc as rpc

from gpipe.service import net
from gpipe.topology import rpc_name
from gpipe.worker.dataplane.c10d import World
from gpipe.worker.stage_server import StageServer

SECRET_ENV = "GPIPE_ATTEMPT_SECRET"


def main(argv: list[str] | None = None, secret: str | None = None) -> int:
    """Join the attempt, serve the stage, leave; `secret` is the attempt's (default: env GPIPE_ATTEMPT_SECRET)."""
    p = argparse.ArgumentParser(prog="python -m worker")
    p.add_argument("--rank", type=int, required=True, help="this worker's rank in the attempt")
    p.add_argument("--world", type=int, required=True, help="the attempt's workers (replicas x stages)")
    p.add_argument("--master", required=True, help="the coordinator's rendezvous HOST:PORT")
    p.add_argument("--host", required=True, help="the address this process listens on")
    p.add_argument("--start-timeout", type=float, default=120.0)
    a = p.parse_args(argv)
    try:
        net.use_secret(secret if secret is not None else os.environ.get(SECRET_ENV, ""))
    except ValueError as e:
        p.error(f"{e} (env {SECRET_ENV})")
    warnings.filterwarnings("ignore", message="You are using a Backend")
    net.bind_to(a.host)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    # Building the optimizer imports torch._dynamo (1.5 s on a CPU build): import it while the RPC world forms.
    threading.Thread(target=importlib.import_module, args=("torch._dynamo",), daemon=True).start()
    # Say that this worker reached the rendezvous, and from where: if the RPC world does not form, the
    # coordinator can tell a worker that never got here from workers that cannot reach each other.
    host, _, port = a.master.rpartition(":")
    net.client_store(host, int(port), a.start_timeout).set(f"{net.REACHED_KEY}{a.rank}", a.host)
    opts = net.rpc_options(a.master, a.start_timeout)
    rpc.init_rpc(  # type: ignore[no-untyped-call]  # unannotated in torch
        rpc_name(a.rank), rank=a.rank + 1, world_size=a.world + 1, rpc_backend_options=opts)
    rpc.shutdown()  # waits until the coordinator is done with every stage
    StageServer.close_all()
    World.leave()  # the data plane's groups and communicators (NCCL's) end with the attempt
    return 0
