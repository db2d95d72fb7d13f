"""Whatever a layer returns crosses a cut, as nn.Sequential passes it: every run still equals one device."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from coordinator.plan import make_plan
from coordinator.spec import parse_spec
from gpipe import structure
from gpipe.errors import SpecError
from gpipe.factory import add_import_paths
from gpipe.wire import MAX_JSON_BYTES, decode, encode
from tests.test_transparency import job, train_and_compare

PAIRS = {"factory": "tests.models:pair_mlp", "args": {"width": 16, "blocks": 4}}
MASKED = {"factory": "tests.models:masked_mlp", "args": {"width": 16, "blocks": 3}}
DICTS = {"factory": "tests.models:dict_items", "args": {"n": 40, "width": 16}}
SEQ = {"factory": "tests.models:seq_model", "args": {}}
SENTENCES = {"factory": "tests.models:sentences", "args": {}, "collate": "gpipe.builtins:pad_collate"}

# The same models through gpipe.Pipeline, under every schedule and checkpointing mode, are in
# tests/test_pipeline.py. Real processes: the dict case here; padded sequences whose length changes step to
# step cross the c10d cut in the masked charlm example's run below.
CASES = {
    # a dict input {"x", "mask"}; bool and int tensors, None and scalars cross every cut
    "dict-mask-1f1b-except_last": job(model=MASKED, stages=2, chunks=4, schedule="1f1b",
                                      activation_checkpoint="except_last", data={**DICTS, "batch_size": 9}),
    # padded sequences whose length changes step to step (a custom collate), 7 = 3+2+2, the mask crossing
    "varlen-1f1b-always": job(model=SEQ, stages=2, balance=[2, 2], chunks=3, schedule="1f1b", steps=5,
                              activation_checkpoint="always", data={**SENTENCES, "batch_size": 7, "shuffle": True},
                              loss="cross_entropy"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["dict-mask-1f1b-except_last"])
def test_structures_cross_cuts_as_on_one_device(cli, name):
    train_and_compare(cli, name, CASES[name])


def test_sequence_lengths_change_step_to_step():
    """The varlen cases above do see batches of several lengths."""
    plan = make_plan(parse_spec(yaml.safe_dump(CASES["varlen-1f1b-always"])), Path("."))
    lengths = {plan.stream().micro_batches(s)[0][0]["tokens"].size(1) for s in range(5)}
    assert len(lengths) > 1, lengths


# -- validate runs the model ------------------------------------------------------------------------


def _plan(**kw) -> None:
    make_plan(parse_spec(yaml.safe_dump(job(**kw))), Path("."))


@pytest.mark.parametrize(("kw", "says"), [
    # a layer that cannot take what the previous one returns: named, with what it got
    ({"model": {"factory": "tests.models:bad_cut", "args": {"kind": "tuple_to_linear"}}},
     "model: layer 1 (Linear) raised TypeError: linear(): argument 'input' (position 1) must be Tensor, not tuple, "
     "given tuple(Tensor[2,16] float32, Tensor[2] bool)"),
    # what cannot travel between stages
    ({"model": {"factory": "tests.models:bad_cut", "args": {"kind": "set"}}},
     "model: layer 0 (Returns) returned set, which cannot cross to layer 1: the value: a set cannot cross a cut"),
    ({"model": {"factory": "tests.models:bad_cut", "args": {"kind": "complex"}}},
     "cannot cross to layer 1: tensor 0 of tuple(Tensor[2,16] complex64, 1): dtype complex64 cannot travel"),
    ({"model": {"factory": "tests.models:bad_cut", "args": {"kind": "deep"}}},
     "which cannot cross to layer 1: [0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0]: nested more than 16 deep"),
    # the loss cannot take the output and target
    ({"loss": "cross_entropy"}, "loss: raised"),
    # a batch whose tensors are not all batch_size long
    ({"data": {**DICTS, "batch_size": 8, "collate": "tests.models:short_mask_collate"}},
     "data: the first batch: StructureError: input['mask']: dim 0 is 3, but a tensor of a batch must have the batch "
     "size (8) there"),
])
def test_validate_names_the_layer_and_what_it_got(kw, says):
    with pytest.raises(SpecError) as e:
        _plan(**kw)
    assert says in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_probe_false_skips_the_probe():
    model = {"factory": "tests.models:bad_cut", "args": {"kind": "tuple_to_linear"}}
    _plan(model=model, probe=False)  # starts nothing: fails only once running
    with pytest.raises(SpecError):
        _plan(model=model)


@pytest.mark.multiprocess
def test_validate_exits_2_in_one_line(cli):
    path = cli.write(job(model={"factory": "tests.models:bad_cut", "args": {"kind": "tuple_to_linear"}}))
    r = cli.run("validate", str(path), timeout=60)
    assert r.returncode == 2, r.stderr
    line, = r.stderr.strip().splitlines()
    assert line.startswith("error: model: layer 1 (Linear) raised TypeError") and "Traceback" not in r.stderr
    good = cli.write(CASES["dict-mask-1f1b-except_last"], "good.yaml")
    r = cli.run("validate", str(good), timeout=60)
    assert r.returncode == 0 and "ok (5 layers" in r.stdout, r.stderr


# -- the wire format --------------------------------------------------------------------------------


def test_a_structure_round_trips_through_its_description():
    value = {"h": torch.randn(3, 4), "m": (torch.ones(3, dtype=torch.bool), None, [1, 2.5, "s", True]),
             7: torch.zeros(0, 5)}
    header, text, leaves = encode(5, value, [True, False, False])
    assert header[:2].tolist() == [5, -1] and text is not None and len(text) == header[2]
    skeleton, metas = decode(text)
    assert [(d, s, g) for d, s, g in metas] == [(torch.float32, [3, 4], True), (torch.bool, [3], False),
                                                 (torch.float32, [0, 5], False)]
    back = structure.unflatten(skeleton, leaves)
    assert back["m"][1:] == (None, [1, 2.5, "s", True]) and back["h"] is leaves[0] and set(back) == {"h", "m", 7}


def test_one_tensor_needs_no_description():
    header, text, leaves = encode(2, torch.randn(4, 8), [True])
    assert text is None and header[:6].tolist() == [2, 0, 2, 1, 4, 8]


@pytest.mark.parametrize(("value", "says"), [
    ([torch.zeros(1)] * 1025, "more than 1024 values"),
    ("x" * (MAX_JSON_BYTES + 1), "over the 64 KiB"),
    (torch.zeros((1,) * 9), "at most 8 dims"),
    ({(1, 2): 3}, "a dict key must be a str or an int"),
])
def test_what_cannot_travel_is_refused_at_once(value, says):
    with pytest.raises(ValueError, match=r".") as e:
        encode(0, value)
    assert says in str(e.value)


@pytest.mark.parametrize("text", [
    b'{"s": {"T": 0}, "t": []}', b'{"s": {"X": 1}, "t": []}', b'{"s": {"T": 0}, "t": [[99, [1], 0]]}',
    b'{"s": {"T": 0}, "t": [[0, [-1], 0]]}', b"[" * 5000, b'{"s": 1}',
])
def test_a_bad_description_is_refused(text):
    with pytest.raises((ValueError, RecursionError)):
        decode(text)


# -- skip connections that jump stages --------------------------------------------------------------

SKIPS = {"factory": "tests.models:skip_mlp", "args": {"width": 16, "skip_width": 24}}
SKIP_CASES = {
    # s and ids go from stage 0 to stage 3, past stages 1 and 2; s2 from stage 1 to 3; local stays in stage 3
    # (3 stages, 1f1b: tests/test_pipeline.py)
    "skip-4stages-gpipe-always": job(model=SKIPS, stages=4, balance=[1, 1, 1, 3], chunks=4,
                                     activation_checkpoint="always"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SKIP_CASES))
def test_skips_jump_stages_as_on_one_device(cli, name):
    spec = SKIP_CASES[name]
    lines = train_and_compare(cli, name, spec)
    batch, stages = spec["data"]["batch_size"], spec["stages"]
    last = stages - 1
    for m in lines:
        st = m["stages"]
        # s (24 floats) and ids (one int64) a sample go straight from stage 0 to the last stage, and s's gradient back
        assert st[0]["sent_bytes"][f"skips to stage {last}"] == batch * (24 * 4 + 8)
        assert st[last]["received_bytes"]["stage 0's skips"] == batch * (24 * 4 + 8)
        assert st[last]["sent_bytes"]["skip gradients to stage 0"] == batch * 24 * 4
        # The stages between carry their neighbours' 16-float activations and gradients, and not a byte more:
        # stage 0's skips reach none of their channels.
        for k in range(1, last):
            neighbours = {f"stage {k - 1}'s activation": st[k]["received_bytes"], f"stage {k + 1}'s gradient":
                          st[k]["received_bytes"], f"activation to stage {k + 1}": st[k]["sent_bytes"],
                          f"gradient to stage {k - 1}": st[k]["sent_bytes"]}
            carried = sum(d[c] for c, d in neighbours.items())
            through = carried - 4 * batch * 16 * 4
            print(f"{name}: step {m['step']}: bytes of stage 0's skips through stage {k}: {through}")
            assert through == 0
            assert not [c for c in [*st[k]["received_bytes"], *st[k]["sent_bytes"]]
                        if c in ("stage 0's skips", "skip gradients to stage 0")]


@pytest.mark.parametrize(("kind", "says"), [
    ("pop", "model: layer 1 pops 'nope', which no earlier layer stashed"),
    ("twice", "model: layers 0 and 1 both stash 'x'"),
])
def test_bad_skips_are_spec_errors_naming_the_layers(kind, says):
    with pytest.raises(SpecError) as e:
        _plan(model={"factory": "tests.models:bad_skips", "args": {"kind": kind}})
    assert says in str(e.value), str(e.value)


def test_the_probe_finds_the_routes():
    plan = make_plan(parse_spec(yaml.safe_dump(SKIP_CASES["skip-4stages-gpipe-always"])), Path("."))
    assert plan.skips == {"s": (0, 3), "ids": (0, 3), "s2": (1, 5), "local": (4, 5)}
    assert plan.skip_routes() == [("ids", 0, 3), ("s", 0, 3), ("s2", 1, 3)]


def test_skips_work_in_plain_pytorch():
    """The same model on one device, no gpipe: each pop meets its forward's stash."""
    from tests.models import skip_mlp

    model = skip_mlp()
    x = torch.randn(5, 16)
    assert model(x).shape == (5, 16)
    model(x).sum().backward()
    assert model[0].proj.weight.grad is not None and model[3].emb.weight.grad is not None


@pytest.mark.multiprocess
def test_the_unet_example_equals_one_device(cli):
    """examples/unet.yaml, small and brief: enc1 goes from stage 0 to stage 2, enc2 from stage 0 to stage 1."""
    examples = Path(__file__).resolve().parent.parent / "examples"
    add_import_paths([str(examples)])
    shutil.copy(examples / "unet.py", cli.tmp / "unet.py")
    spec = yaml.safe_load((examples / "unet.yaml").read_text())
    width, size, batch = 8, 16, 8
    # sgd: adam would magnify the rounding of gradients summed in another order (the skip's and the pool's)
    spec.update(name="t", steps=3, log_every=1, model={**spec["model"], "args": {"width": width}},
                data={**spec["data"], "args": {"n": 24, "size": size}, "batch_size": batch},
                optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9})
    for m in train_and_compare(cli, "unet", spec):
        enc1, enc2 = batch * width * size * size * 4, batch * 2 * width * (size // 2) ** 2 * 4
        assert m["stages"][0]["sent_bytes"] == {"activation to stage 1": batch * 2 * width * (size // 4) ** 2 * 4,
                                                "skips to stage 1": enc2, "skips to stage 2": enc1}
        assert m["stages"][1]["received_bytes"]["stage 0's skips"] == enc2
        assert m["stages"][2]["received_bytes"]["stage 0's skips"] == enc1


@pytest.mark.multiprocess
def test_the_masked_charlm_example_equals_one_device(cli):
    """examples/charlm-masked.yaml, small: padded buckets of lines, the padding mask crossing the cut."""
    examples = Path(__file__).resolve().parent.parent / "examples"
    add_import_paths([str(examples)])
    shutil.copy(examples / "charlm.py", cli.tmp / "charlm.py")
    spec = yaml.safe_load((examples / "charlm-masked.yaml").read_text())
    spec.update(name="t", steps=4, chunks=3, lr_schedule=None, checkpoint_every=None,
                model={**spec["model"], "args": {"d_model": 16, "heads": 2, "ff": 32, "layers": 2}},
                data={**spec["data"], "args": {"max_len": 24, "batch_size": 8, "max_bytes": 20000}, "batch_size": 8},
                # sgd: adamw would magnify the rounding of gradients summed in another order
                optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9}, balance=[2, 2])
    lines = train_and_compare(cli, "charlm-masked", spec)
    masks = [m["stages"][1]["received_bytes"]["stage 0's activation"] for m in lines]
    assert len(set(masks)) > 1, masks  # the lengths, and so the bytes that cross, change step to step
