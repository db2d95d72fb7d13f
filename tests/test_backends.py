"""What each backend carries between stages (gloo, NCCL), and the data plane's start: warmed, bounded, its
failures naming the peer.

The CPU tests run real processes over gloo on loopback; a lane that takes itself for NCCL's (its backend
read as nccl) carries what NCCL lacks as it would there. The `gpu` tests run NCCL itself.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml
from torch import nn

from gpipe import net, structure
from gpipe.contract import StageConfig
from gpipe.wire import CARRIES, DTYPES, backend_of, encode, on_wire, travels
from tests.ports import free_port
from tests.test_transparency import job
from worker.channel import Receiver, Sender

INT16 = torch.tensor([-32768, -1, 0, 1, 32767, -12345], dtype=torch.int16)


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# -- the table -------------------------------------------------------------------------------------


def test_the_table_says_what_each_backend_carries_and_every_channel_dtype_travels_on_both():
    assert backend_of("cuda") == backend_of("cuda:3") == "nccl" and backend_of("cpu") == "gloo"
    assert torch.int16 not in CARRIES["nccl"] and CARRIES["gloo"] == frozenset(DTYPES)
    assert CARRIES["nccl"] < CARRIES["gloo"]
    for backend in ("gloo", "nccl"):
        assert all(travels(d, backend) for d in DTYPES), backend
        for d in (torch.complex64, torch.complex128, torch.float8_e4m3fn):
            assert not travels(d, backend), (d, backend)
            with pytest.raises(ValueError, match=f"dtype {str(d)[6:]} cannot travel between stages over {backend}"):
                encode(0, torch.zeros(2, dtype=d), (), backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_a_dtype_nccl_lacks_goes_as_its_bytes_in_the_same_memory_and_comes_back_bit_for_bit(dtype):
    t = INT16.to(dtype) if dtype != torch.int16 else INT16.clone()
    if dtype.is_floating_point:
        t = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan"), 1e-3, -65504.0]).to(dtype)
    wire = on_wire(t, "nccl")
    assert on_wire(t, "gloo") is t
    if dtype in CARRIES["nccl"]:
        assert wire is t
        return
    # The bytes of the same memory: nothing converted, and a receive into the view fills the tensor.
    assert wire.dtype == torch.uint8 and wire.data_ptr() == t.data_ptr()
    assert wire.numel() == t.numel() * t.element_size()
    back = wire.view(dtype).reshape(t.shape)
    assert back.dtype == dtype and _bits(back) == _bits(t) and torch.equal(back, t)
    assert back.tolist() == [-32768, -1, 0, 1, 32767, -12345]
    into = torch.empty_like(t)
    on_wire(into, "nccl").copy_(wire)
    assert torch.equal(into, t)
    zero_d = torch.tensor(-7, dtype=dtype)  # a 0-d tensor has a byte view too
    assert on_wire(zero_d, "nccl").view(dtype).reshape(()).item() == -7


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
    torch.set_num_threads(1)  # forked: no OpenMP pool (see tests/test_channel.py)
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
    path = cli.write(job(model={"factory": "tests.models:bad_cut", "args": {"kind": "complex"}}))
    r = cli.run("validate", str(path), timeout=60)
    assert r.returncode == 2, r.stderr
    line, = r.stderr.strip().splitlines()
    assert line.startswith("error: model: layer 0 (Returns) returned") and "cannot cross to layer 1" in line, line
    assert "dtype complex64 cannot travel between stages over gloo" in line, line


def test_the_probe_checks_the_cuts_against_the_jobs_backend():
    from gpipe.errors import SpecError
    from gpipe.probe import probe
    from tests.models import bad_cut

    x, y = torch.randn(4, 16), torch.randn(4, 16)
    with pytest.raises(SpecError, match="dtype complex64 cannot travel between stages over nccl") as e:
        probe(bad_cut("complex"), x, y, torch.nn.functional.mse_loss, "nccl")
    assert "\n" not in str(e.value)


class _ToComplex(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.polar(torch.ones_like(h), h)


class _FromComplex(_ToComplex):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.view_as_real(z).sum(-1))


class ComplexCrossing(nn.Module):
    """Not an nn.Sequential: block `a` hands block `b` a complex64 tensor."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.b = _ToComplex(width), _FromComplex(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_validate_refuses_a_captured_model_whose_cut_would_carry_complex64():
    from coordinator.plan import make_plan
    from coordinator.spec import parse_spec
    from gpipe.errors import SpecError

    spec = job(model={"factory": "tests.test_backends:ComplexCrossing", "split_points": ["b"]},
               data={"factory": "random_regression", "args": {"n": 16, "in_features": 8, "out_features": 8},
                     "batch_size": 8})
    with pytest.raises(SpecError) as e:
        make_plan(parse_spec(yaml.safe_dump(spec)), Path("."))
    assert str(e.value) == (
        "model: the cut before b (piece 1) would carry tuple(Tensor[2,8] complex64): tensor 0 of "
        "tuple(Tensor[2,8] complex64): dtype complex64 cannot travel between stages over gloo (supported: "
        "float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8, bool)")


# -- the data plane's start --------------------------------------------------------------------------


def _cfg(rank: int, port: int, start_s: float) -> StageConfig:
    return StageConfig(model_chunk=rank, model_chunks=2, start=rank, end=rank + 1, model_factory="", model_args={},
                       optimizer="", optimizer_args={}, loss="", schedule="gpipe", chunks=2,
                       activation_checkpoint="never", seed=0, clip_grad_norm=None, device="cpu",
                       step_timeout_s=10, start_timeout_s=start_s, store_host="127.0.0.1", store_port=port)


def _world_end(rank: int, port: int, secret: str, start_s: float, mode: str, out: Any) -> None:
    """Rank `rank` forms its world. mode 'stall': rank 1 joins and forms its groups, then never makes the
    first exchange; 'ok': both form it, pass a tensor over a lane, and leave."""
    torch.set_num_threads(1)
    from worker import c10d

    try:
        net.use_secret(secret)
        if mode == "stall" and rank == 1:
            c10d.World._warm = lambda self, deadline: time.sleep(start_s + 30)  # type: ignore[method-assign]
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
def test_a_peer_that_joins_but_never_exchanges_fails_the_warm_up_naming_it_and_its_address():
    said = _form([0, 1], 3.0, "stall")
    kind, text, took = said[0]
    assert kind in ("TimeoutError", "ConnectionError"), said
    assert text.startswith("the data plane did not form within 3s: no first exchange with rank 1 (stage 1 of "
                           "replica 0, at 127.0.0.1)"), text
    assert "\n" not in text and took < 3.0 + 5, took


@pytest.mark.multiprocess
def test_a_world_forms_warmed_carries_int16_and_leaves():
    said = _form([0, 1], 20.0, "ok")
    assert said == [("formed", None, False), ("formed", INT16.tolist(), False)], said


# -- NCCL itself ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_nccl_refuses_int16_and_carries_its_bytes_exactly(tmp_path):
    """One rank: a broadcast (NCCL's own transfer) of each channel dtype, as the channel hands it over."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        with pytest.raises(Exception, match="not supported"):
            dist.broadcast(INT16.cuda(), 0)
            torch.cuda.synchronize()
        for dtype in DTYPES:
            t = INT16.to(dtype).cuda()
            before = _bits(t)
            dist.broadcast(on_wire(t, "nccl"), 0)
            torch.cuda.synchronize()
            assert _bits(t) == before, dtype
    finally:
        dist.destroy_process_group()


def _nccl_end(rank: int, port: int, out: Any) -> None:
    try:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("nccl", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
        group = dist.new_group([0, 1])
        values = [INT16.to(d) for d in DTYPES] + [{"cpu": INT16, "dev": INT16.to(device), "b": torch.tensor(True)}]
        if rank == 0:
            s = Sender(1, group, device, "all dtypes")
            for mb, v in enumerate(values):
                s.send(mb, v)
            s.flush(60)
            out.send(("sent", ""))
        else:
            r = Receiver(0, group, device, "all dtypes", 60)
            r.expect(len(values))
            wrong = []
            for mb, v in enumerate(values):
                got = r.get(mb, 60)
                for x, y in zip(structure.tensors(v), structure.tensors(got), strict=True):
                    if y.device != device or x.dtype != y.dtype or _bits(x) != _bits(y):
                        wrong.append(f"{mb}: {y.dtype} on {y.device}")
            out.send(("compared", wrong))
        dist.destroy_process_group()
    except BaseException as e:
        out.send(("setup", repr(e)))
    finally:
        os._exit(0)


@pytest.mark.gpu(2)
def test_every_channel_dtype_and_a_cpu_tensor_cross_nccl_bit_for_bit():
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_nccl_end, args=(k, port, pipes[k][1]), daemon=True) for k in range(2)]
    for p in procs:
        p.start()
    try:
        said = [pipes[k][0].recv() if pipes[k][0].poll(120) else ("silent", "") for k in range(2)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert said == [("sent", ""), ("compared", [])], said
