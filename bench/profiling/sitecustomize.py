"""Loaded by every Python process of a `run` that bench/profile_actions.py starts (it puts this folder first on
PYTHONPATH): where GPIPE_BENCH_PROFILE names a file prefix, each stage's actions are timed part by part, on the
wall clock and on the calling thread's CPU clock, and each process writes what it timed to PREFIX.PID as JSON.

The parts are the interpreter's calls, wrapped here (the product's code is left as it is):
- `wait`: Inbound.get, the wait for a neighbour's message (not busy time in the timeline);
- `compute`: Stage._compute, the layers (and the loss on the last stage) under autograd's saved-tensor hooks;
- `autograd`: a backward through the stage's layers (torch.autograd.backward; with the backward split, B's
  inputs' gradients and W's weights');
- `send`: Outbound.send, the message posted (packed, and on gloo written to the socket when the peer waits);
- `hooks`: autograd's saved-tensor hooks that count activations (gpipe.memory.meter), timed by call inside the others;
- `rest`: the action's time outside these.
Each step's CPU outside its actions (`step`: receives posted, the optimizer, the result) is kept too.
"""

from __future__ import annotations

import atexit
import json
import os
import time

PREFIX = os.environ.get("GPIPE_BENCH_PROFILE", "")


def _install() -> None:  # noqa: C901
    import threading

    import torch

    import gpipe.memory.meter as memory
    import gpipe.split_backward as split_backward
    import gpipe.stage as stage_mod
    import gpipe.worker.dataplane.channel as channel

    records: list[list[object]] = []  # [model chunk, kind, wall, cpu, {part: [wall, cpu]}]
    steps: list[list[float]] = []  # [model chunk, wall, cpu, actions' wall, actions' cpu] per step
    # Per thread (a worker's model chunks may run on threads of their own): the action's parts, and the parts
    # being timed now (a part within another of its name is counted once).
    local = threading.local()

    def dump() -> None:
        with open(f"{PREFIX}.{os.getpid()}", "w") as f:
            json.dump({"actions": records, "steps": steps}, f)

    def part(name: str, fn):  # noqa: ANN001, ANN202
        def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            current, inside = getattr(local, "current", None), getattr(local, "inside", set())
            if current is None or name in inside:
                return fn(*args, **kwargs)
            local.inside = inside | {name}
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                local.inside = inside
                got = current.setdefault(name, [0.0, 0.0])
                got[0] += time.perf_counter() - w0
                got[1] += time.thread_time() - c0
        return wrapped

    def action(kind: str, fn):  # noqa: ANN001, ANN202
        def wrapped(self, mb, p):  # noqa: ANN001, ANN202
            local.current = current = {}
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(self, mb, p)
            finally:
                records.append([self.cfg.model_chunk, kind, time.perf_counter() - w0, time.thread_time() - c0,
                                current])
                local.current = None
        return wrapped

    stage_mod.Stage.ACTIONS = {k: action(k, f) for k, f in stage_mod.Stage.ACTIONS.items()}
    stage_mod.Stage._compute = part("compute", stage_mod.Stage._compute)
    torch.autograd.backward = part("autograd", torch.autograd.backward)
    stage_mod.backward_input = part("autograd", stage_mod.backward_input)
    split_backward.WeightGradients.run = part("autograd", split_backward.WeightGradients.run)
    channel.Sender.send = part("send", channel.Sender.send)
    channel.Receiver.get = part("wait", channel.Receiver.get)
    memory.ActivationMeter.hold = part("hooks", memory.ActivationMeter.hold)
    memory._Held.unpack = part("hooks", memory._Held.unpack)

    step_fn = stage_mod.Stage._step

    def step(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        n0, chunk = len(records), self.cfg.model_chunk
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return step_fn(self, *args, **kwargs)
        finally:
            mine = [r for r in records[n0:] if r[0] == chunk]
            steps.append([chunk, time.perf_counter() - w0, time.thread_time() - c0,
                          sum(r[2] for r in mine), sum(r[3] for r in mine)])  # type: ignore[misc]
            if len(steps) % 10 == 0:
                dump()

    stage_mod.Stage._step = step
    atexit.register(dump)


if PREFIX:  # the run's processes only: each imports what the timers wrap now, before it forks or runs a stage
    _install()
