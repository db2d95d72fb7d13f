"""Regressions, each quoting what it fixed."""

from __future__ import annotations

import threading

import torch

from gpipe.worker.stage_server import StepQueue


def test_steps_run_in_step_order_whatever_order_their_rpcs_arrive():
    # "1stage-1chunk: largest weight difference 0.00146": TensorPipe serves RPCs on a
    # thread pool, so run_step(s+1) was sometimes queued, and run, before run_step(s).
    q = StepQueue(5)
    futs = {s: torch.futures.Future() for s in (5, 6, 7)}
    for s in (7, 6, 5):
        q.put(s, futs[s], (s,))
    assert [q.take()[1][0] for _ in range(3)] == [5, 6, 7]

    taken = []
    t = threading.Thread(target=lambda: taken.append(q.take()))
    t.start()
    q.close()  # a waiting executor wakes up and ends
    t.join(5)
    assert not t.is_alive() and taken == [None]
