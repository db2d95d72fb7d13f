"""The data plane between real processes over gloo on loopback: what arrives bit for bit, what validate refuses
for a backend, a start that is warmed and bounded, its failures naming the peer. What each backend carries, in
process: tests/engine/test_backends.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gpipe import structure
from gpipe.contract import StageConfig
from gpipe.service import net
from gpipe.worker.dataplane import unix_lane
from gpipe.worker.dataplane.channel import Receiver, Sender
from tests.support.ports import free_port
from tests.support.spec import TWO_STAGES, job
from tests.support.wire import INT16, _bits

# -- the channel, over gloo, in two processes ---------------------------------------------------------


def _values() -> list[Any]:
    """Messages alike in both processes: int16 extremes alone, a bool alone, and a structure of CPU tensors
    (int16, bool, float32, 0-d int16) with a scalar."""
    g = torch.Generator().manual_seed(1)
    return [
        INT16.reshape(2, 3),
        torch.tensor([[True, False, True]]),
        {"ids": INT16.flip(0), "mask": torch.tensor([False, True]), "h": torch.randn(3, 2, generator=g),
         "n": 5, "one": torch.tensor(-32768, dtype=torch.int16)},
    ]


def _channel_end(rank: int, port: int, out: Any) -> None:
    torch.set_num_threads(1)  # forked: no OpenMP pool (see tests/service/test_channel.py)
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
        gloo, as_nccl = dist.new_group([0, 1]), dist.new_group([0, 1])
        cpu, values, backend = torch.device("cpu"), _values(), dist.get_backend
        ends = []
        for group, kind in ((gloo, "gloo"), (as_nccl, "nccl")):
            dist.get_backend = lambda g, k=kind: k  # this process only: the lane's backend, as it reads it
            ends.append(Sender(1, group, cpu, kind) if rank == 0 else Receiver(0, group, cpu, kind, 30))
            dist.get_backend = backend
        if rank == 0:
            sent: list[str] = []
            isend = dist.isend
            dist.isend = lambda t, *a, **k: sent.append(str(t.dtype)[6:]) or isend(t, *a, **k)
            for lane in ends:
                sent.append(f"{lane.backend}:")
                for mb, v in enumerate(values):
                    lane.send(mb, v)
                lane.flush(30)
            dist.isend = isend
            out.send(("sent", " ".join(sent)))
        else:
            wrong = []
            for lane in ends:
                lane.expect(len(values))
                for mb, v in enumerate(values):
                    got = lane.get(mb, 30)
                    a, b = structure.tensors(v), structure.tensors(got)
                    same = structure.map_tensors(v, lambda t: 0) == structure.map_tensors(got, lambda t: 0) \
                        and all(x.dtype == y.dtype and x.shape == y.shape and _bits(x) == _bits(y)
                                and y.device.type == "cpu" for x, y in zip(a, b, strict=True))
                    if not same:
                        wrong.append(f"{lane.backend} message {mb}: {structure.describe(got)}")
            out.send(("compared", wrong))
    except BaseException as e:
        out.send(("setup", repr(e)))
    finally:
        os._exit(0)


@pytest.mark.multiprocess
def test_int16_bool_and_cpu_tensors_arrive_bit_for_bit_and_int16_goes_as_bytes_where_nccl_would_carry_it():
    ctx = mp.get_context("fork")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_channel_end, args=(k, port, pipes[k][1]), daemon=True) for k in range(2)]
    for p in procs:
        p.start()
    try:
        said = [pipes[k][0].recv() if pipes[k][0].poll(60) else ("silent", "") for k in range(2)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert said[1] == ("compared", []), said
    # What c10d was handed: on gloo each tensor as it is (int16 included; the bool packed after its header, as
    # uint8); on the NCCL lane, int16 as uint8 bytes, bool and float32 as they are. Headers, descriptions: uint8.
    assert said[0] == ("sent", "gloo: uint8 int16 uint8 uint8 uint8 int16 bool float32 int16 "
                               "nccl: uint8 uint8 uint8 bool uint8 uint8 uint8 bool float32 uint8"), said


# -- validate ---------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_validate_refuses_a_dtype_no_backend_carries_in_one_line_naming_it_and_the_backend(cli):
    path = cli.write(job(TWO_STAGES, model={"factory": "tests.support.models:bad_cut", "args": {"kind": "complex"}}))
    r = cli.run("validate", str(path), timeout=60)
    assert r.returncode == 2, r.stderr
    line, = r.stderr.strip().splitlines()
    assert line.startswith("error: model: layer 0 (Returns) returned") and "cannot cross to layer 1" in line, line
    assert "dtype complex64 cannot travel between stages over gloo" in line, line


# -- the data plane's start --------------------------------------------------------------------------


def _cfg(rank: int, port: int, start_s: float) -> StageConfig:
    return StageConfig(model_chunk=rank, model_chunks=2, start=rank, end=rank + 1, model_factory="", model_args={},
                       optimizer="", optimizer_args={}, loss="", schedule="gpipe", chunks=2,
                       activation_checkpoint="never", seed=0, clip_grad_norm=None, device="cpu",
                       step_timeout_s=10, start_timeout_s=start_s, store_host="127.0.0.1", store_port=port)


def _world_end(rank: int, port: int, secret: str, start_s: float, mode: str, out: Any) -> None:
    """Rank `rank` forms its world. mode 'stall': rank 1 joins and forms its groups, then never makes gloo's
    first exchange (every lane on gloo); 'stall-unix': never connects to this host's lanes; 'ok': both form it,
    pass a tensor over a lane, and leave."""
    torch.set_num_threads(1)
    from gpipe.worker.dataplane import c10d

    try:
        net.use_secret(secret)
        if mode == "stall":  # gloo's lanes: rank 1 never makes their first exchange
            os.environ[unix_lane.MODE_ENV] = "c10d"
            if rank == 1:
                c10d.World._warm = lambda self, deadline: time.sleep(start_s + 30)  # type: ignore[method-assign]
        if mode == "stall-unix" and rank == 1:  # this host's lanes: rank 1 never connects
            c10d.World._same_host = lambda self, store, deadline: time.sleep(start_s + 30)  # type: ignore[method-assign]
        t0 = time.monotonic()
        try:
            transport = c10d.C10dTransport(_cfg(rank, port, start_s), torch.device("cpu"))
        except BaseException as e:
            out.send((type(e).__name__, str(e), time.monotonic() - t0))
            return
        if rank == 0:
            s = transport.sender(1, "activation", "stage 0's activation")
            s.send(0, INT16)
            s.flush(10)
            got = None
        else:
            r = transport.receiver(0, "activation", "stage 0's activation")
            r.expect(1)
            got = r.get(0, 10).tolist()
        c10d.World.leave()
        out.send(("formed", got, dist.is_initialized()))
    except BaseException as e:
        out.send(("test", repr(e), 0.0))
    finally:
        os._exit(0)


def _form(ranks: list[int], start_s: float, mode: str) -> list[Any]:
    """What each of `ranks` (of a 2-rank world) says of its start, each its own process."""
    secret = net.new_secret()
    net.use_secret(secret)
    store, port = net.bound_store("127.0.0.1", 60)  # the coordinator's store, in this process
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in ranks]
    procs = [ctx.Process(target=_world_end, args=(k, port, secret, start_s, mode, pipes[i][1]), daemon=True)
             for i, k in enumerate(ranks)]
    for p in procs:
        p.start()
    try:
        return [pipe.recv() if pipe.poll(start_s + 30) else ("silent", "", 0.0) for pipe, _ in pipes]
    finally:
        for p in procs:
            p.kill()
            p.join(10)
        del store


@pytest.mark.multiprocess
def test_a_rank_that_never_joins_fails_the_start_within_its_timeout_naming_the_rank():
    (kind, text, took), = _form([0], 3.0, "missing")
    assert kind == "TimeoutError", (kind, text)
    assert text == "the data plane did not form within 3s: rank 1 (stage 1 of replica 0) never joined it", text
    assert took < 3.0 + 5, took


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["stall", "stall-unix"])
def test_a_peer_that_joins_but_never_exchanges_fails_the_warm_up_naming_it_and_its_address(mode):
    said = _form([0, 1], 3.0, mode)
    kind, text, took = said[0]
    assert kind in ("TimeoutError", "ConnectionError"), said
    waited = "no first exchange with" if mode == "stall" else "no lane on this host with"
    assert text.startswith(f"the data plane did not form within 3s: {waited} rank 1 (stage 1 of "
                           "replica 0, at 127.0.0.1)"), text
    assert "\n" not in text and took < 3.0 + 5, took


@pytest.mark.multiprocess
def test_a_world_forms_warmed_carries_int16_and_leaves():
    said = _form([0, 1], 20.0, "ok")
    assert said == [("formed", None, False), ("formed", INT16.tolist(), False)], said
