"""Any nn.Module through the CLI and the service (real processes over gloo): torch.export's refusals as one
line naming the model's file and line, GPT-2 trained, loaded with from_pretrained and fine-tuned from its weights,
Llama with a mask on two replicas, each against one device. In process: tests/engine/test_anymodel.py.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from tests.support import models
from tests.support.lm import fresh, lm_loss, one_device, one_device_job
from tests.support.spec import GPT2, job

pytest.importorskip("transformers")












BRANCHY = job(name="br", model={"factory": "tests.support.models:Branchy", "split_points": ["blocks.1"]})


def line_of(code: str) -> int:
    """The line of Branchy.forward in tests/support/models.py that holds `code`."""
    lines, start = inspect.getsourcelines(models.Branchy.forward)
    return start + next(i for i, x in enumerate(lines) if code in x)


@pytest.mark.multiprocess
@pytest.mark.parametrize("verb", ["validate", "run"])
def test_a_forward_torch_export_refuses_is_one_line_naming_the_model_s_file_and_line(cli, verb):
    flags = ["--state-dir", "st", "--no-progress"] if verb == "run" else []
    r = cli.run(verb, str(cli.write(BRANCHY)), *flags, timeout=180)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()  # torch's warnings and partial graphs are not shown
    assert f"tests/support/models.py, line {line_of('if x.sum() > 0')}" in line, line
    assert "cannot capture Branchy" in line and "torch.cond" in line, line


@pytest.mark.multiprocess
def test_a_forward_that_fails_on_the_data_gets_no_advice_for_torch_export(cli):
    spec = {**BRANCHY, "data": {**BRANCHY["data"], "args": {**BRANCHY["data"]["args"], "in_features": 7}}}
    r = cli.run("validate", str(cli.write(spec)))
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "Branchy.forward failed on a micro-batch of the data" in line, line
    assert f"tests/support/models.py, line {line_of('x = b(x)')}" in line, line
    assert "torch.cond" not in line and "nn.Sequential" not in line, line


# -- the service's path: real processes over gloo ----------------------------------------------------------------





@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # three runs of GPT-2 (train, fine-tune, eval), each bounded by its own 240 s
def test_gpt2_through_the_service_equals_one_device_loads_with_from_pretrained_and_fine_tunes_from_it(cli):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from gpipe.coordinator.outputs import checkpoint

    r = cli.run("run", str(cli.write(job(GPT2))), "--state-dir", str(cli.tmp / "state"), "--no-progress",
                timeout=240)
    assert r.returncode == 0, r.stderr
    out = cli.tmp / "state" / "t"
    got = load_file(out / "model.safetensors")
    want = one_device_job(4)
    assert "lm_head.weight" not in got and "transformer.wte.weight" in got  # the tied weight once, as HF saves it
    assert set(got) == set(want) - {"lm_head.weight"}
    worst = max((got[k] - want[k]).abs().max().item() for k in got)
    assert worst <= 1e-5, f"weights differ from one device by {worst}"

    # The last checkpoint holds the weights under the model's names, the tied weight once (its first holder's).
    held = checkpoint.load(checkpoint.step_dir(out / "checkpoints", 4)).model_state()
    assert set(held) == set(got) and all(torch.equal(held[k], got[k]) for k in got)

    plan = json.loads((out / "plan.json").read_text())
    assert plan["balance"] == [2, 2]

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.transformer.wte.weight is loaded.lm_head.weight
    assert torch.equal(loaded.transformer.wte.weight, want["transformer.wte.weight"].to(loaded.dtype)) or \
        (loaded.transformer.wte.weight - want["transformer.wte.weight"]).abs().max() <= 1e-5

    # Fine-tuning: another job starts from this one's output folder (model.weights), split elsewhere.
    held_out = {"factory": "tests.support.models:token_pairs", "args": {"n": 8, "seed": 3}, "batch_size": 8}
    tuned = job(GPT2, name="tuned", steps=2, model__weights=str(out), model__split_points=["transformer.h.1"],
                eval={"data": held_out, "every": 2})
    r = cli.run("run", str(cli.write(tuned, "tuned.yaml")), "--state-dir", str(cli.tmp / "state"), "--no-progress",
                timeout=240)
    assert r.returncode == 0, r.stderr
    got = load_file(cli.tmp / "state" / "tuned" / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(out)
    want = one_device_job(2, model)
    worst = max((got[k] - want[k]).abs().max().item() for k in got)
    assert worst <= 1e-5, f"weights trained from model.weights differ from one device by {worst}"

    # The eval verb on the fine-tuned model.safetensors (the model's names, the tied weight once).
    r = cli.run("eval", str(cli.tmp / "tuned.yaml"), "--state-dir", str(cli.tmp / "state"), "--json", timeout=240)
    assert r.returncode == 0, r.stderr
    x, y = models.token_pairs(n=8, seed=3)[:]
    with torch.no_grad():
        model.eval()
        loss = sum(lm_loss(model(xm).logits, ym).item() * xm.size(0) for xm, ym in
                   zip(x.chunk(4), y.chunk(4), strict=True)) / 8
    assert json.loads(r.stdout)["loss"] == pytest.approx(loss, abs=1e-5)


@pytest.mark.multiprocess
def test_llama_with_a_mask_and_two_replicas_through_the_service_equals_one_device(cli):
    from safetensors.torch import load_file
    from torch.utils.data import default_collate

    from tests.support.cli import torch_threads

    spec = job(GPT2, model={"factory": "tests.support.models:llama", "args": {}}, stages=2, replicas=2, chunks=2,
               data={"factory": "tests.support.models:masked_pairs", "args": {}, "batch_size": 8, "shuffle": False},
               steps=2, clip_grad_norm=None)
    r = cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr
    got = load_file(cli.tmp / "state" / "t" / "model.safetensors")
    with torch_threads(1):
        want = fresh(models.llama)
        pairs = models.masked_pairs()
        data = [default_collate([pairs[i] for i in range(s * 8, (s + 1) * 8)]) for s in range(2)]
        one_device(want, data, chunks=2, replicas=2)
    assert set(got) == set(want.state_dict())
    worst = max((got[k] - v).abs().max().item() for k, v in want.state_dict().items())
    assert worst <= 1e-5, f"weights differ from one device by {worst}"
