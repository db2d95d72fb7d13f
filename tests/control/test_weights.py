"""model.weights (gpipe.coordinator.plan.pretrained): training starts from a safetensors checkpoint, read by the model's
names, each stage sent its own tensors; against one device started from the same weights. A file that does
not fit the model is refused before anything starts, naming the file and the tensor.

The training runs through the driver over stages on threads of this process (tests/control/test_driver.py's), whose
stages are sent their tensors in pieces as a worker's are; the refusal goes through `validate`.

In process; the runs through real processes are in tests/service/test_weights.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpipe.coordinator.outputs import checkpoint
from gpipe.coordinator.plan.pretrained import INDEX
from gpipe.errors import SpecError
from tests.support import models, reference
from tests.support.lm import _drop, _edit, one_device_job, pretrained_gpt2
from tests.support.local import close_stages, drive, live_copies, plan_of, worst  # noqa: F401  # close_stages: a fixture
from tests.support.spec import GPT2, THREE_STAGES, job

pytest.importorskip("transformers")




def test_gpt2_from_sharded_pretrained_weights_equals_one_device_from_them(tmp_path):
    from transformers import AutoModelForCausalLM

    pretrained_gpt2(tmp_path / "pre", shard="60KB")
    weight_map = json.loads((tmp_path / "pre" / INDEX).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1 and "lm_head.weight" not in weight_map  # sharded; the tied weight once
    spec = job(GPT2, model__weights=str(tmp_path / "pre"), steps=2, checkpoint_every=None,
               eval={"data": {"factory": "tests.support.models:token_pairs", "args": {"n": 8, "seed": 3}, "batch_size": 8},
                     "every": 2})
    plan = plan_of(spec)  # its probes (training's, evaluation's) run on the meta device
    assert plan.on_meta and all(p.is_meta for p in plan.model.parameters())  # no weights made but the file's
    _, evals = drive(plan, tmp_path / "out")
    assert len(evals) == 1 and evals[0].eval_loss > 0
    got = checkpoint.load(checkpoint.step_dir(checkpoint.folder(tmp_path / "out"), 2)).model_state()

    want = one_device_job(2, AutoModelForCausalLM.from_pretrained(tmp_path / "pre"))
    copies = live_copies("transformer.wte.weight")
    assert len(copies) == 2 and torch.equal(copies[0], copies[1])  # both holders read the one tensor
    assert worst(got, {k: v for k, v in want.items() if k != "lm_head.weight"}) <= 1e-5  # the tied weight once


def test_an_nn_sequential_starts_from_its_state_dicts_names(tmp_path):
    torch.manual_seed(9)
    save_file(models.mlp_dropout(width=16, depth=2).state_dict(), tmp_path / "w.safetensors")
    spec = job(THREE_STAGES, model={"factory": "tests.support.models:mlp_dropout", "args": {"width": 16, "depth": 2},
                      "weights": str(tmp_path / "w.safetensors")})
    drive(plan_of(spec), tmp_path / "out")
    got = checkpoint.load(checkpoint.step_dir(checkpoint.folder(tmp_path / "out"), 4)).model_state()
    want = reference.train(spec)
    assert worst(got, want) <= 1e-5
    seeded = reference.train({**spec, "model": {**spec["model"], "weights": None}})
    assert worst(got, seeded) > 1e-3  # the file's weights, not the seed's


def test_a_hugging_face_checkpoint_without_the_base_models_prefix_and_with_ignored_names_fits(tmp_path):
    pretrained_gpt2(tmp_path / "pre")
    own = load_file(tmp_path / "pre" / "model.safetensors")
    old = {k.removeprefix("transformer."): v for k, v in own.items()}  # as openai-community/gpt2 names them
    old["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)  # a causal mask old checkpoints hold, which GPT-2 ignores
    save_file(old, tmp_path / "old.safetensors")
    plan = plan_of(job(GPT2, model__weights=str(tmp_path / "old.safetensors")))
    assert plan.weights_at["transformer.h.1.mlp.c_fc.weight"] == (0, "h.1.mlp.c_fc.weight")
    assert plan.weights_at["transformer.wte.weight"] == (0, "wte.weight")


def test_a_model_the_meta_device_cannot_capture_is_built_whole_and_still_starts_from_the_file(tmp_path):
    torch.manual_seed(7)
    start = models.scaled_blocks()
    save_file(start.state_dict(), tmp_path / "w.safetensors")
    spec = job(THREE_STAGES, model={"factory": "tests.support.models:scaled_blocks", "weights": str(tmp_path / "w.safetensors")},
               stages=3, balance=[1, 1, 1], optimizer={"name": "sgd", "lr": 0.1}, clip_grad_norm=None,
               activation_checkpoint="never")
    plan = plan_of(spec)
    assert not plan.on_meta  # its plain tensor cannot meet meta weights in the capture: built whole, once
    drive(plan, tmp_path / "out")
    got = checkpoint.load(checkpoint.step_dir(checkpoint.folder(tmp_path / "out"), 4)).model_state()
    data = reference.resolve(spec["data"]["factory"])(**spec["data"]["args"])
    opt = torch.optim.SGD(start.parameters(), lr=0.1)
    for step in range(4):
        x, y = data[step * 9:(step + 1) * 9]
        for xm, ym in zip(x.chunk(3), y.chunk(3), strict=True):
            (torch.nn.functional.mse_loss(start(xm), ym) * xm.size(0) / 9).backward()
        opt.step()
        opt.zero_grad()
    assert worst(got, start.state_dict()) <= 1e-5






def _reshape(t: dict) -> None:
    t["transformer.h.1.mlp.c_fc.weight"] = t["transformer.h.1.mlp.c_fc.weight"][:, :8].contiguous()


def _half(t: dict) -> None:
    t["transformer.h.1.mlp.c_fc.weight"] = t["transformer.h.1.mlp.c_fc.weight"].half()


def _extra(t: dict) -> None:
    t["transformer.h.1.mlp.c_gate.weight"] = torch.zeros(3)


@pytest.mark.parametrize(("change", "says"), [
    (_drop, r"has no tensor transformer\.h\.1\.mlp\.c_fc\.weight \(\[32, 128\] float32\)"),
    (_reshape, r"bad\.safetensors: transformer\.h\.1\.mlp\.c_fc\.weight is \[32, 8\] float32, the model's is "
               r"\[32, 128\] float32"),
    (_half, r"transformer\.h\.1\.mlp\.c_fc\.weight is \[32, 128\] float16"),
    (_extra, r"bad\.safetensors: transformer\.h\.1\.mlp\.c_gate\.weight is not a tensor of the model"),
])
def test_a_file_that_does_not_fit_the_model_is_refused_naming_the_tensor(tmp_path, change, says):
    pretrained_gpt2(tmp_path / "pre")
    bad = _edit(tmp_path / "pre" / "model.safetensors", tmp_path / "bad.safetensors", change)
    with pytest.raises(SpecError, match=r"^model\.weights: .*" + says):
        plan_of(job(GPT2, model__weights=str(bad)))


def test_an_unreadable_file_or_folder_is_refused_naming_it(tmp_path):
    pretrained_gpt2(tmp_path / "pre")
    whole = (tmp_path / "pre" / "model.safetensors").read_bytes()
    cases = {
        "cut.safetensors": (whole[: len(whole) // 2], "cut.safetensors: not a readable safetensors file"),
        "junk.safetensors": (b"\xff" * 64, "junk.safetensors: not a readable safetensors file"),
        "empty": (None, "holds neither model.safetensors nor model.safetensors.index.json"),
        "nothing-here": (False, "nothing-here: no such file or folder"),
    }
    for name, (data, says) in cases.items():
        path = tmp_path / name
        if data is None:
            path.mkdir()
        elif data is not False:
            path.write_bytes(data)
        with pytest.raises(SpecError, match=f"^model.weights: .*{says}"):
            plan_of(job(GPT2, model__weights=str(path)))
    index = tmp_path / "ix"
    index.mkdir()
    (index / INDEX).write_text('{"weight_map": {"a": "../model-00001.safetensors"}}')
    with pytest.raises(SpecError, match="is not a file name in the index's folder"):
        plan_of(job(GPT2, model__weights=str(index)))
