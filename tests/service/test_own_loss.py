"""A model that computes its own loss (`loss: model`, `loss: {from_model: KEYWORD}`) trains as it is: the data
stream hands it the targets by its keyword, the last stage backwards the loss it returns, and the weights equal
one device computing the same loss on the same micro-batches."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from gpipe.factory import resolve
from tests.support.models import NanoGPT, token_pairs

DATA = {"factory": "tests.support.models:token_pairs", "args": {"n": 16, "length": 8}, "batch_size": 4}


def job(**changes) -> dict:
    return {"name": "own", "model": {"factory": "tests.support.models:nano_gpt", "args": {"layers": 4}},
            "loss": {"from_model": "targets"}, "data": DATA, "optimizer": {"name": "sgd", "lr": 0.1},
            "stages": 2, "chunks": 2, "steps": 2} | changes


def one_device(steps: int, chunks: int) -> dict[str, torch.Tensor]:
    """nanoGPT on one device: each micro-batch's own loss times its share of the batch, backwarded; SGD."""
    torch.manual_seed(0)
    model = NanoGPT(layers=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = token_pairs(16, 8)
    for step in range(steps):
        x, y = (t.contiguous() for t in data[step * 4: step * 4 + 4])  # as collated
        for xm, ym in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks), strict=True):
            _, loss = model(xm, ym)
            (loss * len(xm) / 4).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.multiprocess
def test_a_model_that_returns_its_own_loss_trains_under_run_as_one_device(cli):
    r = cli.run("run", str(cli.write(job(schedule="1f1b"))), "--state-dir", str(cli.tmp / "state"), "--no-progress",
                timeout=240)
    assert r.returncode == 0, r.stderr
    got = load_file(cli.tmp / "state" / "own" / "model.safetensors")
    want = one_device(2, 2)
    assert set(got) <= set(want) and len(got) == len(want) - 1  # the tied weight once
    worst = max((got[k] - want[k]).abs().max().item() for k in got)
    assert worst <= 1e-6, f"weights differ from one device by {worst}"


@pytest.mark.multiprocess
def test_the_model_s_own_loss_is_refused_where_it_cannot_be_given(cli):
    sequential = job(model={"factory": "mlp", "args": {"width": 8, "depth": 2}}, loss="model")
    r = cli.run("validate", str(cli.write(sequential, "seq.yaml")))
    assert r.returncode == 2 and "loss:" in r.stderr and "nn.Sequential" in r.stderr and "Traceback" not in r.stderr
    wrong = job(loss={"from_model": "labels"})  # nanoGPT takes its targets as `targets`
    r = cli.run("validate", str(cli.write(wrong, "wrong.yaml")))
    assert r.returncode == 2 and "'labels'" in r.stderr and "targets" in r.stderr
    bad = job(loss={"from_model": "not a name"})
    r = cli.run("validate", str(cli.write(bad, "bad.yaml")))
    assert r.returncode == 2 and "loss" in r.stderr


def test_the_model_s_own_loss_through_the_stages_in_process_equals_one_device():
    """The same stages in this process (gpipe.Pipeline): the targets in the inputs under `targets`, the output's
    loss selected, gpipe.losses.model_loss as the loss: make test's check of the mechanism the run test drives."""
    import gpipe
    from gpipe.losses import model_loss

    torch.manual_seed(0)
    model = NanoGPT(layers=4)
    want = one_device(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = token_pairs(16, 8)
    with gpipe.Pipeline(model, stages=2, chunks=2, schedule="1f1b", output="loss") as pipe:
        for step in range(2):
            x, y = (t.contiguous() for t in data[step * 4: step * 4 + 4])
            pipe.step({"idx": x, "targets": y}, y, model_loss)
            opt.step()
            opt.zero_grad()
    got = model.state_dict()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-6, f"weights differ from one device by {worst}"


def test_the_spec_reads_the_model_s_own_loss():
    from gpipe.coordinator.spec.job import JobSpec

    spec = JobSpec.model_validate(job())
    assert (spec.loss_function, spec.loss_keyword, spec.model_output) == ("model", "targets", "loss")
    spec = JobSpec.model_validate(job(loss="model"))
    assert (spec.loss_function, spec.loss_keyword) == ("model", "labels")
    spec = JobSpec.model_validate(job(loss="cross_entropy"))
    assert (spec.loss_function, spec.loss_keyword, spec.model_output) == ("cross_entropy", None, None)
    assert resolve("model")(torch.tensor(2.0), None) == 2.0


@pytest.mark.multiprocess
def test_a_hugging_face_model_s_own_loss_from_labels_under_zbv_equals_one_device(cli):
    """`loss: model`: the targets go in as `labels`, and the ModelOutput's loss is backwarded, under zbv."""
    pytest.importorskip("transformers")
    from tests.support.models import gpt2

    spec = job(model={"factory": "tests.support.models:gpt2", "args": {}}, loss="model", schedule="zbv",
               virtual_stages=2)
    r = cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr
    got = load_file(cli.tmp / "state" / "own" / "model.safetensors")
    torch.manual_seed(0)
    model = gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = token_pairs(16, 8)
    for step in range(2):
        x, y = (t.contiguous() for t in data[step * 4: step * 4 + 4])
        for xm, ym in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2), strict=True):
            (model(input_ids=xm, labels=ym).loss * len(xm) / 4).backward()
        opt.step()
        opt.zero_grad()
    want = model.state_dict()
    worst = max((got[k] - want[k]).abs().max().item() for k in got)
    assert worst <= 1e-6, f"weights differ from one device by {worst}"
