"""gpipe on CUDA, against one GPU: gpipe.Pipeline (nn.Sequential and a captured GPT-2; fp32, bf16, fp16;
every schedule), `deterministic` to the bit, the caller's device and streams left as they were, and `run` of a
job on one GPU. Every test here is marked `gpu`: skipped (and shown as skipped) where torch sees no GPU;
`make gpu-check` runs them on a GPU host. The CPU-visible halves of the same features are tested elsewhere
(test_determinism.py, test_anymodel.py, test_devices.py).

Stages that share one GPU are threads of one process here (gpipe.Pipeline); two NCCL ranks cannot share a GPU,
so the service's multi-stage CUDA paths need as many GPUs as workers (tests marked gpu(2)).

In process; the runs through real processes are in tests/service/test_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.support import models, reference
from tests.support.cuda import DEV, worst
from tests.support.spec import GPU, job

# cuBLAS reads its workspace setting when its first handle is made: before any test here runs a product.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = pytest.mark.gpu






SCHEDULES = [
    ("gpipe", [10, 9], {}),
    ("1f1b", [10, 9], {"activation_checkpoint": "always"}),
    ("zb-h1", [10, 9], {"activation_checkpoint": "except_last"}),
    ("interleaved-1f1b", [5, 5, 5, 4], {"virtual_stages": 2}),
    ("zbv", [5, 5, 5, 4], {"virtual_stages": 2}),
]


@pytest.mark.parametrize(("schedule", "cuts", "extra"), SCHEDULES, ids=[s for s, _, _ in SCHEDULES])
def test_pipeline_of_two_stages_on_one_gpu_equals_one_gpu(schedule, cuts, extra):
    """An nn.Sequential with dropout, its two stages on one GPU (each on its own stream): the weights of one
    GPU's micro-batch after micro-batch training, to float rounding."""
    spec = job(GPU, schedule=schedule, **extra)
    want = reference.train(spec, device=DEV, as_chunk=spec.get("schedule", "gpipe") == "gpipe")
    got = reference.train(spec, device=DEV, cuts=cuts, pipelined=True)
    assert worst(got, want) <= 1e-5


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pipeline_in_half_precision_on_one_gpu_equals_one_gpu_autocast(precision):
    """bf16 and fp16 (its loss scale) on the GPU: one GPU's autocast, rounded where the stages meet."""
    spec = job(GPU, schedule="1f1b", precision=precision)
    want = reference.train(spec, device=DEV, cuts=[10, 9], as_chunk=spec.get("schedule", "gpipe") == "gpipe")
    got = reference.train(spec, device=DEV, cuts=[10, 9], pipelined=True)
    assert worst(got, want) <= 1e-3


def test_deterministic_pipeline_equals_one_gpu_to_the_bit():
    """A Transformer (attention, dropout, an embedding) with `deterministic`: pipelined on one GPU, bit for bit
    the one-GPU reference, which is itself bit for bit the same when run again."""
    from gpipe import determinism

    spec = job(GPU, model={"factory": "tests.support.models:tiny_lm", "args": {"vocab": 11, "d_model": 64, "layers": 3}},
               data={"factory": "tests.support.models:tokens", "args": {"n": 64, "seq": 32, "vocab": 11}, "batch_size": 16},
               loss="cross_entropy", schedule="1f1b", deterministic=True)
    determinism.enable()
    want = reference.train(spec, device=DEV, as_chunk=spec.get("schedule", "gpipe") == "gpipe")
    again = reference.train(spec, device=DEV, as_chunk=spec.get("schedule", "gpipe") == "gpipe")
    got = reference.train(spec, device=DEV, cuts=[3, 3], pipelined=True)
    assert all(torch.equal(again[k], want[k]) for k in want)
    assert all(torch.equal(got[k], want[k]) for k in want), worst(got, want)
    assert torch.are_deterministic_algorithms_enabled()


def lm_loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def gpt2_batches(steps: int = 3, batch: int = 8, length: int = 16):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, 97, (batch, length + 1), generator=g)
        out.append(({"input_ids": ids[:, :-1].contiguous()}, ids[:, 1:].contiguous()))
    return out


def gpt2_one_gpu(model, data, chunks: int = 4) -> dict:
    from gpipe import structure
    from gpipe.capture.graph import select_output

    model = model.to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        x, y = structure.to(x, torch.device(DEV)), y.to(DEV)
        batch = y.size(0)
        for xs, ys in zip(structure.split(x, chunks, batch), structure.split(y, chunks, batch), strict=True):
            (lm_loss(select_output(model(**xs), None), ys) * ys.size(0) / batch).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("where", ["cpu", "gpu"], ids=["model-on-cpu", "model-on-gpu"])
def test_captured_gpt2_on_one_gpu_equals_one_gpu(where):
    """docs/pipeline.md's use: a GPT-2 built on the CPU (or moved to the GPU first), captured with torch.export,
    its stages on the GPU; its tied embedding stays one tensor, and its eval output is the model's."""
    import gpipe

    def fresh():
        torch.manual_seed(0)
        return models.gpt2(width=64, layers=4, heads=4)

    data = gpt2_batches()
    want = gpt2_one_gpu(fresh(), data)
    model = fresh() if where == "cpu" else fresh().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gpipe.Pipeline(model, split_points=["transformer.h.2"], chunks=4, schedule="1f1b",
                        devices=[DEV, DEV], timeout_s=120) as pipe:
        for x, y in data:
            pipe.step(x, y, lm_loss)
            opt.step()
            opt.zero_grad()
        x = gpt2_batches(1)[0][0]
        with torch.no_grad():  # forward only, in eval mode
            out = pipe(x)
    got = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    assert worst(got, want) <= 1e-5
    assert model.transformer.wte.weight is model.lm_head.weight
    model.eval()
    with torch.no_grad():
        direct = model(**{k: v.to(model.lm_head.weight.device) for k, v in x.items()}).logits
    assert (out.float().cpu() - direct.float().cpu()).abs().max().item() <= 1e-5


def test_pipeline_leaves_the_callers_device_and_stream_as_they_were():
    """The caller's current device and stream are its own before and after; each stage ran on a stream of its
    own, not the caller's; the gradients are ready on the caller's stream when step returns."""
    import gpipe

    torch.manual_seed(0)
    model = models.mlp_dropout(width=32, depth=4)
    mine = torch.cuda.Stream(DEV)
    x, y = torch.randn(16, 32, device=DEV), torch.randn(16, 32, device=DEV)
    before = torch.cuda.current_device()
    with torch.cuda.stream(mine), gpipe.Pipeline(model, balance=[7, 6], chunks=4, devices=[DEV, DEV]) as pipe:
        pipe.step(x, y, torch.nn.functional.mse_loss)
        assert torch.cuda.current_stream(DEV) == mine
        grads = [p.grad.clone() for p in model.parameters()]  # on the caller's stream, after the stages'
        streams = [s.stream for s in pipe._stages]
    assert torch.cuda.current_device() == before
    assert len({id(s) for s in streams}) == 2 and all(s is not None and s != mine for s in streams)
    torch.cuda.synchronize()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))


class _WhereCuda(torch.nn.Module):
    """A layer whose forward makes a tensor with `.cuda()`: where the thread's current device is."""

    def forward(self, x):
        made = torch.zeros(1).cuda()
        assert made.device == x.device, f"a stage on {x.device} made a tensor on {made.device}"
        return x


@pytest.mark.gpu(2)
def test_a_stages_own_cuda_calls_land_on_its_gpu():
    """User code calling `.cuda()` inside stage 1 (on cuda:1) lands on cuda:1, though the caller's current
    device is cuda:0."""
    import gpipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _WhereCuda(), torch.nn.Linear(8, 8), _WhereCuda())
    with gpipe.Pipeline(model, balance=[2, 2], chunks=2, devices=["cuda:0", "cuda:1"]) as pipe:
        loss = pipe.step(torch.randn(4, 8), torch.randn(4, 8, device="cuda:1"), torch.nn.functional.mse_loss)
    assert torch.isfinite(loss)
