"""What each backend carries between stages (gloo, NCCL), and the data plane's start: warmed, bounded, its
failures naming the peer.

The CPU tests run real processes over gloo on loopback; a lane that takes itself for NCCL's (its backend
read as nccl) carries what NCCL lacks as it would there. The `gpu` tests run NCCL itself.

In process; the runs through real processes are in tests/service/test_backends.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml

from gpipe import structure
from gpipe.wire import CARRIES, DTYPES, backend_of, encode, on_wire, travels
from gpipe.worker.dataplane.channel import Receiver, Sender
from tests.support.ports import free_port
from tests.support.spec import TWO_STAGES, job
from tests.support.wire import INT16, _bits

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


def test_the_probe_checks_the_cuts_against_the_jobs_backend():
    from gpipe.errors import SpecError
    from gpipe.memory.probe import probe
    from tests.support.models import bad_cut

    x, y = torch.randn(4, 16), torch.randn(4, 16)
    with pytest.raises(SpecError, match="dtype complex64 cannot travel between stages over nccl") as e:
        probe(bad_cut("complex"), x, y, torch.nn.functional.mse_loss, "nccl")
    assert "\n" not in str(e.value)








def test_validate_refuses_a_captured_model_whose_cut_would_carry_complex64():
    from gpipe.coordinator.plan.job import make_plan
    from gpipe.coordinator.spec.job import parse_spec
    from gpipe.errors import SpecError

    spec = job(TWO_STAGES, model={"factory": "tests.support.models:ComplexCrossing", "split_points": ["b"]},
               data={"factory": "random_regression", "args": {"n": 16, "in_features": 8, "out_features": 8},
                     "batch_size": 8})
    with pytest.raises(SpecError) as e:
        make_plan(parse_spec(yaml.safe_dump(spec)), Path("."))
    assert str(e.value) == (
        "model: the cut before b (piece 1) would carry tuple(Tensor[2,8] complex64): tensor 0 of "
        "tuple(Tensor[2,8] complex64): dtype complex64 cannot travel between stages over gloo (supported: "
        "float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8, bool)")


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
