"""An optimizer by import path: each bad one is one line naming the field, in process.

The spec's own checks (parse_spec), then gpipe.optim_check's (the class imported, its options bound, two
dummy steps, its state storable), then make_plan's SpecError as validate prints it. Training with such an
optimizer, its resume and `gpipe-coordinator validate`'s exit code are in tests/service/test_optimizers.py.
"""

from __future__ import annotations

import pytest

from gpipe import optim_check
from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.spec.job import parse_spec
from gpipe.errors import SpecError
from tests.support.spec import job_yaml

RMSPROP = "torch.optim:RMSprop"
OPTS = "tests.support.optimizers"

BAD_SPECS = [
    ({"name": "lbfgs", "lr": 1}, "optimizer.name: 'lbfgs' is neither sgd, adam, adamw nor a class's import path"),
    ({"name": "torch.optim:", "lr": 1}, "optimizer.name: 'torch.optim:' is neither"),
    ({"name": RMSPROP, "lr": 1, "momentum": 0.5}, "optimizer.momentum: applies to sgd, adam and adamw; "
     "torch.optim:RMSprop takes its options in args"),
    ({"name": RMSPROP, "lr": 1, "betas": [0.9, 0.9]}, "optimizer.betas: applies to sgd, adam and adamw"),
    ({"name": "adam", "lr": 1, "args": {"amsgrad": True}}, "optimizer.args: applies to an optimizer by import path"),
    ({"name": RMSPROP, "lr": 1, "args": {"lr": 2}}, "optimizer.args: lr is no option here: the LR is optimizer.lr"),
    ({"name": RMSPROP, "lr": 1, "args": {"params": []}}, "optimizer.args: params is no option here"),
    ({"name": RMSPROP, "lr": 1, "shard": True}, "optimizer.shard: shards sgd, adam and adamw only, not "
     "torch.optim:RMSprop: each replica steps flat slices"),
]


@pytest.mark.parametrize("optimizer,line", BAD_SPECS, ids=[line.split(":")[0] + "-" + str(i)
                                                         for i, (_, line) in enumerate(BAD_SPECS)])
def test_the_spec_refuses_a_bad_optimizer_in_one_line(optimizer, line):
    with pytest.raises(SpecError) as e:
        parse_spec(job_yaml(optimizer=optimizer, replicas=2, chunks=1))
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_the_short_names_and_their_fields_are_as_before():
    spec = parse_spec(job_yaml(optimizer={"name": "adamw", "lr": 0.1, "betas": [0.8, 0.9]}))
    assert spec.optimizer.torch_kwargs() == {"lr": 0.1, "betas": (0.8, 0.9), "eps": 1e-8, "weight_decay": 0.01}
    spec = parse_spec(job_yaml(optimizer={"name": RMSPROP, "lr": 0.1, "args": {"alpha": 0.9, "momentum": 0.5}}))
    assert spec.optimizer.by_path and spec.optimizer.torch_kwargs() == {"lr": 0.1, "alpha": 0.9, "momentum": 0.5}


BAD_CLASSES = [
    ("no_such_module:Opt", {}, "name: cannot import module 'no_such_module'"),
    ("torch.optim:RMSProp", {}, "name: module 'torch.optim' has no attribute 'RMSProp'"),
    (f"{OPTS}:not_an_optimizer", {}, f"name: {OPTS}:not_an_optimizer is not a torch.optim.Optimizer subclass"),
    ("torch.nn:Linear", {}, "name: torch.nn:Linear is not a torch.optim.Optimizer subclass"),
    (RMSPROP, {"alpah": 0.9}, "args.alpah: torch.optim:RMSprop takes no option 'alpah' (it takes lr, alpha, eps,"),
    (f"{OPTS}:NeedsRho", {}, f"args.rho: {OPTS}:NeedsRho needs it (it has no default)"),
    (RMSPROP, {"alpha": -1}, "args.alpha: torch.optim:RMSprop refused its options: ValueError: Invalid alpha value"),
    (RMSPROP, {"momentum": -1}, "args.momentum: torch.optim:RMSprop refused its options: ValueError: Invalid "
     "momentum value"),
    ("torch.optim:LBFGS", {}, "name: torch.optim:LBFGS's step needs closure"),
    ("torch.optim:SparseAdam", {}, "args: torch.optim:SparseAdam failed at a step: RuntimeError: SparseAdam does "
     "not support dense gradients"),
    (f"{OPTS}:ListState", {}, f"name: {OPTS}:ListState keeps its state 'history' as a list; a checkpoint stores "
     "tensors and int, float, bool, str or None"),
    (f"{OPTS}:SlashKey", {}, f"name: {OPTS}:SlashKey keeps state under the key 'a/b'"),
    (f"{OPTS}:SharedState", {}, f"name: {OPTS}:SharedState keeps state that belongs to no parameter"),
    (f"{OPTS}:CallableGroup", {}, f"name: {OPTS}:CallableGroup keeps its hyper-parameter 'rule' as a "
     "builtin_function_or_method"),
    (f"{OPTS}:IntCounter", {}, f"name: {OPTS}:IntCounter's state does not load back as a checkpoint keeps it: "
     "TypeError"),
    (f"{OPTS}:Forgetful", {}, f"name: {OPTS}:Forgetful steps differently once its state has been through a "
     "checkpoint"),
]


@pytest.mark.parametrize("path,args,line", BAD_CLASSES, ids=[f"{p.split(':')[1]}-{i}"
                                                             for i, (p, _, _) in enumerate(BAD_CLASSES)])
def test_check_refuses_in_one_line_naming_the_field(path, args, line):
    with pytest.raises(optim_check.OptimizerError) as e:
        optim_check.check(path, {"lr": 0.01, **args})
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("path,args,slots", [
    (RMSPROP, {"alpha": 0.9}, 1),  # square_avg (and step, a number)
    (RMSPROP, {"alpha": 0.9, "momentum": 0.5}, 2),  # and the momentum buffer
    (RMSPROP, {"momentum": 0.5, "centered": True}, 3),  # and the gradient's average
    ("torch.optim:Adagrad", {}, 1),
    ("torch.optim:NAdam", {"betas": [0.8, 0.9]}, 2),  # YAML's list for a tuple
    (f"{OPTS}:TwoSlots", {}, 2),  # a number tensor is no slot
])
def test_check_measures_the_state_slots(path, args, slots):
    assert optim_check.check(path, {"lr": 0.01, **args}) == slots


def test_the_dummy_steps_leave_the_global_generator_be():
    import torch

    torch.manual_seed(3)
    want = torch.rand(2)
    torch.manual_seed(3)
    optim_check.check(RMSPROP, {"lr": 0.01, "momentum": 0.5})
    assert torch.equal(torch.rand(2), want)


def test_make_plan_names_the_option_and_measures_the_slots(tmp_path):
    bad = parse_spec(job_yaml(optimizer={"name": RMSPROP, "lr": 0.01, "args": {"alpha": 1.5, "eps": -1}}))
    with pytest.raises(SpecError, match=r"^optimizer\.args\.eps: torch\.optim:RMSprop refused its options"):
        make_plan(bad, tmp_path)
    good = parse_spec(job_yaml(optimizer={"name": RMSPROP, "lr": 0.01, "args": {"momentum": 0.5}}))
    assert make_plan(good, tmp_path).state_slots == 2
    assert make_plan(parse_spec(job_yaml()), tmp_path).state_slots == 0  # sgd without momentum, from the table
