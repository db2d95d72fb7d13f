"""Bad specs: one line naming the field, exit code 2, nothing started."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpipe.coordinator.plan import make_plan
from gpipe.coordinator.spec import parse_spec
from gpipe.errors import SpecError

GOOD = """
name: ok
model: {factory: mlp, args: {width: 8, depth: 3}}
stages: 2
chunks: 2
data: {factory: random_regression, args: {n: 16, in_features: 8, out_features: 8}, batch_size: 4}
loss: mse
optimizer: {name: sgd, lr: 0.1}
steps: 2
"""


def spec_with(**changes) -> str:
    import yaml

    d = yaml.safe_load(GOOD)
    for path, value in changes.items():
        node = d
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[k]
        if value is DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return yaml.safe_dump(d)


DELETE = object()

BAD = [
    # (changes, the start of the message)
    ({"name": "has space"}, "name: 'has space' must be"),
    ({"name": DELETE}, "name: required field is missing"),
    ({"stages": 0}, "stages: Input should be greater than or equal to 1"),
    ({"stages": "two"}, "stages: Input should be a valid integer"),
    ({"chunks": 0}, "chunks: Input should be greater than or equal to 1"),
    ({"chunks": 5}, "chunks: 5 micro-batches exceed data.batch_size 4"),
    ({"balance": [1, 1, 2]}, "balance: has 3 entries but stages is 2"),
    ({"balance": [0, 4]}, "balance: every stage needs at least one layer"),
    ({"balance": "by_magic"}, "balance"),
    ({"trace_step": 2}, "trace_step: step 2 is past the last step 1"),
    ({"schedule": "zigzag"}, "schedule: Input should be 'gpipe' or '1f1b'"),
    ({"activation_checkpoint": "sometimes"}, "activation_checkpoint: Input should be"),
    ({"optimizer__name": "lbfgs"}, "optimizer.name: Input should be 'sgd', 'adam' or 'adamw'"),
    ({"optimizer__lr": -1}, "optimizer.lr: Input should be greater than 0"),
    ({"optimizer__momentum": 0.9, "optimizer__name": "adam"}, "optimizer: momentum, dampening and nesterov apply to sgd only"),
    ({"optimizer__betas": [0.9, 1.5], "optimizer__name": "adam"}, "optimizer: betas must lie in [0, 1)"),
    ({"data__batch_size": 0}, "data.batch_size: Input should be greater than 0"),
    ({"data__factory": "not a ref!"}, "data.factory: 'not a ref!' is not"),
    ({"model__factory": DELETE}, "model.factory: required field is missing"),
    ({"steps": -3}, "steps: Input should be greater than or equal to 1"),
    ({"loss": "hinge"}, "loss: 'hinge' is not cross_entropy, mse or 'module:function'"),
    ({"lr_schedule": {"name": "cosine", "warmup_steps": -1}}, "lr_schedule.cosine.warmup_steps"),
    ({"lr_schedule": {"name": "exponential"}}, "lr_schedule: Input tag 'exponential'"),
    ({"clip_grad_norm": 0}, "clip_grad_norm: Input should be greater than 0"),
    ({"device": "tpu"}, "device: Input should be 'cpu' or 'cuda'"),
    ({"epochs": 3}, "epochs: unknown field"),
    ({"optimizer__lr_decay": 0.1}, "optimizer.lr_decay: unknown field"),
]


@pytest.mark.parametrize("changes,message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_spec_names_the_field(changes, message):
    with pytest.raises(SpecError) as e:
        parse_spec(spec_with(**changes))
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(message), line


def test_good_spec_parses():
    s = parse_spec(GOOD)
    assert (s.stages, s.chunks, s.balance, s.schedule) == (2, 2, "by_params", "gpipe")


@pytest.mark.parametrize("text,message", [
    ("name: [unclosed", "job spec: not valid YAML (line 1"),
    ("- a\n- b\n", "job spec: expected a mapping of fields, got list"),
    ("", "job spec: expected a mapping of fields, got NoneType"),
])
def test_not_a_spec(text, message):
    with pytest.raises(SpecError, match=None) as e:
        parse_spec(text)
    assert str(e.value).startswith(message), str(e.value)


PLAN_BAD = [
    ({"balance": [1, 1]}, "balance: sums to 2 but the model has 4 layers"),
    ({"stages": 5}, "stages: 5 stages but the model has only 4 layers"),
    ({"model__factory": "nosuchmodule:f"}, "model.factory: cannot import module 'nosuchmodule'"),
    ({"model__factory": "gpipe.builtins:nothing"}, "model.factory: module 'gpipe.builtins' has no attribute 'nothing'"),
    ({"model__args": {"widht": 3}}, "model.args: mlp raised TypeError"),
    ({"model__factory": "tests.models:not_sequential", "model__args": {}}, "model.factory: returned Linear, expected torch.nn.Sequential"),
    ({"data__factory": "tests.models:pid_marker", "data__args": {}}, "data.factory: returned int, expected a map-style Dataset"),
    ({"loss": "nosuchmodule:loss"}, "loss: cannot import module 'nosuchmodule'"),
]


@pytest.mark.parametrize("changes,message", PLAN_BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(PLAN_BAD)])
def test_checks_that_need_the_model(changes, message, tmp_path):
    with pytest.raises(SpecError) as e:
        make_plan(parse_spec(spec_with(**changes)), tmp_path)
    assert str(e.value).startswith(message), str(e.value)


def test_cli_rejects_a_bad_spec_and_starts_nothing(cli):
    path = cli.write(__import__("yaml").safe_load(spec_with(balance=[1, 1])))
    r = cli.run("run", str(path), "--state-dir", str(cli.tmp / "state"), timeout=60)
    assert r.returncode == 2
    line, = r.stderr.strip().splitlines()  # one line, naming the field
    assert line.startswith("error: balance:") and "4 layers" in line, line
    assert not (cli.tmp / "state").exists()


@pytest.mark.parametrize("args,message", [
    (["run", "missing.yaml"], "error: missing.yaml: cannot read job file"),
    (["run"], "error: the following arguments are required: job"),
    (["fly", "job.yaml"], "error: argument command: invalid choice"),
])
def test_cli_bad_invocations(cli, args, message):
    r = cli.run(*args, timeout=60)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_validate(cli):
    path = cli.write(__import__("yaml").safe_load(GOOD))
    r = cli.run("validate", str(path), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ok (4 layers, balance [2, 2])" in r.stdout
    assert not Path(cli.tmp / "gpipe-state").exists()
