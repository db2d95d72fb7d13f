"""A c10d channel between two real processes (gloo over loopback): its waits end with our words, not gloo's."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gpipe.worker.channel import Receiver, Sender

STEP_S = 1.0  # the step's deadline, as StageConfig.step_timeout_s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _end(rank: int, port: int, out: Any) -> None:
    """Rank 0 sends micro-batch 0 only; rank 1 takes it, computes for most of a step, then asks for 1.
    Rank 0 also sends on a lane that rank 1 never receives on, and flushes it."""
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
        group, unread = dist.new_group([0, 1]), dist.new_group([0, 1])
        cpu = torch.device("cpu")
        if rank == 0:
            s = Sender(1, group, cpu, "stage 0's activation", STEP_S)
            s.send(0, torch.ones(3))
            s.flush(STEP_S)
            lost = Sender(1, unread, cpu, "stage 0's skip", STEP_S)
            lost.send(0, torch.ones(3))
            try:
                lost.flush(STEP_S)
                out.send(("sent", "micro-batch 0 of the skip"))
            except BaseException as e:
                out.send((type(e).__name__, str(e)))
            time.sleep(STEP_S * 1.5)  # micro-batch 1 never comes; stay up so that the peer is not gone
            return
        r = Receiver(0, group, cpu, "stage 0's activation", STEP_S)
        r.expect(2)  # the receive of micro-batch 1 is posted as soon as 0 has arrived
        first = r.get(0, STEP_S)
        time.sleep(STEP_S * 0.7)  # the forward of micro-batch 0
        try:
            r.get(1, STEP_S)
            out.send(("got", "micro-batch 1"))
        except BaseException as e:
            out.send((type(e).__name__, f"{first.tolist()} {e}"))
    except BaseException as e:
        out.send(("setup", repr(e)))
    finally:
        import os
        os._exit(0)  # leave the gloo pair as it is: the test only reads the pipe


@pytest.mark.multiprocess
def test_waits_for_a_peer_end_on_the_stages_deadline_in_our_words():
    ctx = mp.get_context("fork")
    port = _free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_end, args=(k, port, pipes[k][1]), daemon=True) for k in range(2)]
    for p in procs:
        p.start()
    try:
        assert pipes[1][0].poll(30), "the receiving end said nothing in 30 s"
        kind, text = pipes[1][0].recv()
        assert pipes[0][0].poll(30), "the sending end said nothing in 30 s"
        sent_kind, sent_text = pipes[0][0].recv()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    # A receive posted early (as soon as micro-batch 0 arrived) still ends on the stage's own deadline.
    assert kind == "TimeoutError", (kind, text)
    assert text.startswith("[1.0, 1.0, 1.0] ") and "waiting for stage 0's activation of micro-batch 1" in text, text
    # A send the peer never takes: flush ends on its deadline, naming the lane.
    assert sent_kind == "TimeoutError", (sent_kind, sent_text)
    assert "sending stage 0's skip" in sent_text, sent_text
