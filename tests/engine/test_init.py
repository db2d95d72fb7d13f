"""init: per_layer for a model that is not an nn.Sequential (gpipe.weight_init.per_module): each stage sets its own
pieces' parameters a module at a time, and nothing builds the whole model; against one device given
per_module's weights, on the same micro-batches. And the skeleton (gpipe.capture.skeleton) every process builds such a
model as: no weights, its buffers' values kept."""

from __future__ import annotations

import pytest
import torch

from gpipe import weight_init
from gpipe.capture import graph as capture
from gpipe.capture import skeleton
from gpipe.coordinator.outputs import checkpoint
from gpipe.errors import SpecError
from tests.support import models
from tests.support.lm import one_device_job
from tests.support.local import close_stages, drive, live_copies, plan_of, worst  # noqa: F401  # close_stages: a fixture
from tests.support.spec import GPT2, job

pytest.importorskip("transformers")


def test_a_captured_models_pieces_on_the_meta_device_get_per_modules_weights():
    want = weight_init.per_module(models.residual_net(), seed=4)
    model, buffers = skeleton.skeleton(models.residual_net)
    pieces = capture.capture(model, torch.zeros(2, 16, device="meta"), ["blocks.2"]).pieces
    tail = torch.nn.Sequential(*[pieces[i] for i in range(1, len(pieces))]).to_empty(device="cpu")
    weight_init.init_pieces(tail, model, seed=4)
    got = {capture.model_name(k): v for k, v in tail.state_dict().items()}
    assert got and all(torch.equal(v, want.state_dict()[k]) for k, v in got.items())
    assert "blocks.3.fc.weight" in got and "stem.weight" not in got  # its own pieces only
    other = weight_init.per_module(models.residual_net(), seed=5)
    assert not torch.equal(other.head.weight, want.head.weight)


@pytest.mark.parametrize(("factory", "points"), [
    ("gpt2", ["transformer.h.1", "transformer.h.3"]),  # the tied weight on the first and last stages
    ("llama", ["model.layers.2"]),  # RoPE's inv_freq: a buffer the model builds, no file holds
])
def test_per_layer_with_an_init_hook_equals_one_device(tmp_path, factory, points):
    spec = job(GPT2, init="per_layer", init_hook="tests.support.models:hf_init", steps=2, checkpoint_every=None,
               model__factory=f"tests.support.models:{factory}", model__split_points=points)
    plan = plan_of(spec)
    assert plan.on_meta and all(p.is_meta for p in plan.model.parameters())  # no weights made here
    drive(plan, tmp_path)
    got = checkpoint.load(checkpoint.step_dir(checkpoint.folder(tmp_path), 2)).model_state()
    want = one_device_job(2, weight_init.per_module(getattr(models, factory)(), seed=0, hook=models.hf_init))
    assert worst(got, {k: v for k, v in want.items() if k in got}) <= 1e-5
    assert set(want) - set(got) <= {"lm_head.weight"}
    if factory == "gpt2":
        copies = live_copies("transformer.wte.weight")
        assert len(copies) == 2 and torch.equal(copies[0], copies[1])


def test_per_layer_without_a_hook_names_the_module_with_no_reset_parameters():
    spec = job(GPT2, init="per_layer")
    with pytest.raises(SpecError, match=r"^init: transformer\.h\.0\.attn\.c_attn \(Conv1D\) has parameters but no "
                                        r"reset_parameters\(\); give init_hook"):
        plan_of(spec)


def test_a_skeleton_holds_no_weights_and_keeps_its_buffers_values_and_other_threads_build_as_usual():
    import threading

    seen: list[bool] = []
    built = threading.Event()

    def factory() -> torch.nn.Module:
        def other() -> None:  # a thread building its own model meanwhile: its parameters stay real
            seen.append(torch.nn.Linear(2, 2).weight.is_meta)
            built.set()
        t = threading.Thread(target=other)
        t.start()
        t.join()
        return models.llama()

    model, buffers = skeleton.skeleton(factory)
    assert built.is_set() and seen == [False]
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    want = models.llama().model.rotary_emb.inv_freq
    assert torch.equal(buffers["model.rotary_emb.inv_freq"], want)  # as the model builds it
    assert not torch.nn.Linear(2, 2).weight.is_meta  # nothing left patched


def test_per_layer_on_a_model_built_whole_sends_no_pieces_and_its_stages_build_as_one_device(tmp_path):
    """A model the meta device cannot stand for (a plain tensor) is planned whole: its stages get no pieces of the
    plan's capture, whose constants no stage would receive under per_layer, and capture it themselves; what they
    build is per_module's init of the model."""
    from gpipe.coordinator.plan.configs import stage_config
    from gpipe.coordinator.plan.job import make_plan
    from gpipe.coordinator.spec.job import JobSpec
    from gpipe.stage import build_layers
    from gpipe.weight_init import per_module
    from tests.support.spec import THREE_STAGES

    spec = job(THREE_STAGES, model={"factory": "tests.support.models:scaled_blocks", "args": {}}, stages=3,
               balance=[1, 1, 1], init="per_layer")
    plan = make_plan(JobSpec.model_validate(spec), tmp_path)
    assert not plan.on_meta and all(plan.stage_pieces(k) is None for k in range(3))
    stages = [build_layers(stage_config(plan, k, 0, "cpu", "", 0), None, torch.device("cpu")) for k in range(3)]
    model = per_module(models.scaled_blocks(), plan.spec.seed, None)
    x = torch.randn(4, 16)
    y = x
    for layers in stages:
        y = layers(y)
    assert torch.equal(y, model(x))  # its weights, and the constant its forward multiplies by
