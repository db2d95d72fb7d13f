"""Whatever a layer returns crosses a cut, as nn.Sequential passes it: every run still equals one device.

In process; the runs through real processes are in tests/service/test_structures.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from gpipe import structure
from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.spec.job import parse_spec
from gpipe.errors import SpecError
from gpipe.wire import MAX_JSON_BYTES, decode, encode
from tests.support.spec import TWO_STAGES, job
from tests.support.structures import CASES, DICTS, SKIP_CASES


def test_sequence_lengths_change_step_to_step():
    """The varlen cases above do see batches of several lengths."""
    plan = make_plan(parse_spec(yaml.safe_dump(CASES["varlen-1f1b-always"])), Path("."))
    lengths = {plan.stream().micro_batches(s)[0][0]["tokens"].size(1) for s in range(5)}
    assert len(lengths) > 1, lengths


# -- validate runs the model ------------------------------------------------------------------------


def _plan(**kw) -> None:
    make_plan(parse_spec(yaml.safe_dump(job(TWO_STAGES, **kw))), Path("."))


@pytest.mark.parametrize(("kw", "says"), [
    # a layer that cannot take what the previous one returns: named, with what it got
    ({"model": {"factory": "tests.support.models:bad_cut", "args": {"kind": "tuple_to_linear"}}},
     "model: layer 1 (Linear) raised TypeError: linear(): argument 'input' (position 1) must be Tensor, not tuple, "
     "given tuple(Tensor[2,16] float32, Tensor[2] bool)"),
    # what cannot travel between stages
    ({"model": {"factory": "tests.support.models:bad_cut", "args": {"kind": "set"}}},
     "model: layer 0 (Returns) returned set, which cannot cross to layer 1: the value: a set cannot cross a cut"),
    ({"model": {"factory": "tests.support.models:bad_cut", "args": {"kind": "complex"}}},
     "cannot cross to layer 1: tensor 0 of tuple(Tensor[2,16] complex64, 1): dtype complex64 cannot travel"),
    ({"model": {"factory": "tests.support.models:bad_cut", "args": {"kind": "deep"}}},
     "which cannot cross to layer 1: [0][0][0][0][0][0][0][0][0][0][0][0][0][0][0][0]: nested more than 16 deep"),
    # the loss cannot take the output and target
    ({"loss": "cross_entropy"}, "loss: raised"),
    # a batch whose tensors are not all batch_size long
    ({"data": {**DICTS, "batch_size": 8, "collate": "tests.support.models:short_mask_collate"}},
     "data: the first batch: StructureError: input['mask']: dim 0 is 3, but a tensor of a batch must have the batch "
     "size (8) there"),
])
def test_validate_names_the_layer_and_what_it_got(kw, says):
    with pytest.raises(SpecError) as e:
        _plan(**kw)
    assert says in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_probe_false_skips_the_probe():
    model = {"factory": "tests.support.models:bad_cut", "args": {"kind": "tuple_to_linear"}}
    _plan(model=model, probe=False)  # starts nothing: fails only once running
    with pytest.raises(SpecError):
        _plan(model=model)


# -- the wire format --------------------------------------------------------------------------------


def test_a_structure_round_trips_through_its_description():
    value = {"h": torch.randn(3, 4), "m": (torch.ones(3, dtype=torch.bool), None, [1, 2.5, "s", True]),
             7: torch.zeros(0, 5)}
    header, text, leaves = encode(5, value, [True, False, False])
    assert header[:2] == [5, -1] and text is not None and len(text) == header[2]
    skeleton, metas = decode(text)
    assert [(d, s, g) for d, s, g in metas] == [(torch.float32, [3, 4], True), (torch.bool, [3], False),
                                                 (torch.float32, [0, 5], False)]
    back = structure.unflatten(skeleton, leaves)
    assert back["m"][1:] == (None, [1, 2.5, "s", True]) and back["h"] is leaves[0] and set(back) == {"h", "m", 7}


def test_one_tensor_needs_no_description():
    header, text, leaves = encode(2, torch.randn(4, 8), [True])
    assert text is None and header[:6] == [2, 0, 2, 1, 4, 8]


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



@pytest.mark.parametrize(("kind", "says"), [
    ("pop", "model: layer 1 pops 'nope', which no earlier layer stashed"),
    ("twice", "model: layers 0 and 1 both stash 'x'"),
])
def test_bad_skips_are_spec_errors_naming_the_layers(kind, says):
    with pytest.raises(SpecError) as e:
        _plan(model={"factory": "tests.support.models:bad_skips", "args": {"kind": kind}})
    assert says in str(e.value), str(e.value)


def test_the_probe_finds_the_routes():
    plan = make_plan(parse_spec(yaml.safe_dump(SKIP_CASES["skip-4stages-gpipe-always"])), Path("."))
    assert plan.skips == {"s": (0, 3), "ids": (0, 3), "s2": (1, 5), "local": (4, 5)}
    assert plan.skip_routes() == [("ids", 0, 3), ("s", 0, 3), ("s2", 1, 3)]


def test_skips_work_in_plain_pytorch():
    """The same model on one device, no gpipe: each pop meets its forward's stash."""
    from tests.support.models import skip_mlp

    model = skip_mlp()
    x = torch.randn(5, 16)
    assert model(x).shape == (5, 16)
    model(x).sum().backward()
    assert model[0].proj.weight.grad is not None and model[3].emb.weight.grad is not None
