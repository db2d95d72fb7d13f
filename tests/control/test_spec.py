"""Bad specs: one line naming the field, exit code 2, nothing started.

In process; the runs through real processes are in tests/service/test_spec.py.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.spec import boundedyaml
from gpipe.coordinator.spec.job import MAX_DEPTH, MAX_NODES, MAX_SPEC_BYTES, load_spec, parse_spec
from gpipe.errors import SpecError
from gpipe.service import job_records, serde
from tests.support.spec import DELETE, GOOD, job_yaml

BAD = [
    # (changes, the start of the message)
    ({"name": "has space"}, "name: 'has space' is not a job name: 1-64 letters"),
    ({"name": DELETE}, "name: required field is missing"),
    ({"stages": 0}, "stages: must be an integer between 1 and 64, got 0"),
    ({"stages": "two"}, "stages: must be an integer between 1 and 64, got 'two'"),
    ({"chunks": 0}, "chunks: must be an integer between 1 and 4096, got 0"),
    ({"chunks": 5}, "chunks: 5 micro-batches exceed data.batch_size 4"),
    ({"balance": [1, 1, 2]}, "balance: has 3 entries but stages is 2"),
    ({"balance": [0, 4]}, "balance.0: must be an integer between 1 and 1000000, got 0"),
    ({"balance": "by_magic"}, "balance: Input should be a valid list or 'by_params', 'by_time' or 'by_memory'"),
    ({"balance": [1] * 65}, "balance: List should have at most 64 items"),
    ({"trace_step": 3}, "trace_step: step 3 is past the last step 2"),
    ({"schedule": "zigzag"}, "schedule: 'zigzag' is not one of gpipe, 1f1b, zb-h1, interleaved-1f1b, zbv"),
    ({"schedule": "1f1c"}, "schedule: '1f1c' is not one of gpipe, 1f1b, zb-h1, interleaved-1f1b, zbv, v-half, v-min, dualpipev, measured or {file: PATH} (did you mean 1f1b?)"),
    ({"schedule": "dualpipev", "virtual_stages": 2, "chunks": 3},
     "chunks: dualpipev takes at least 2 rounds of the 2 workers' micro-batches: 4 or more, not 3"),
    # several model chunks per worker: the schedules that hold them, and the balance over all of them
    ({"virtual_stages": 2}, "virtual_stages: 2 model chunks per worker need schedule interleaved-1f1b or zbv"),
    ({"schedule": "zbv"}, "virtual_stages: zbv holds 2 model chunks per worker (a V), not 1"),
    ({"schedule": "interleaved-1f1b"}, "virtual_stages: interleaved-1f1b interleaves several model chunks"),
    ({"schedule": "zbv", "virtual_stages": 3}, "virtual_stages: zbv holds 2 model chunks per worker (a V), not 3"),
    ({"schedule": "interleaved-1f1b", "virtual_stages": 0}, "virtual_stages: must be an integer between 1 and 16, got 0"),
    ({"schedule": "interleaved-1f1b", "virtual_stages": 2, "chunks": 3},
     "chunks: interleaved-1f1b runs the micro-batches in rounds of the 2 workers: 3 is not a multiple of 2"),
    ({"schedule": "interleaved-1f1b", "virtual_stages": 2, "balance": [1, 1]},
     "balance: has 2 entries but stages x virtual_stages 2 is 4"),
    ({"activation_checkpoint": "sometimes"}, "activation_checkpoint: Input should be"),
    ({"optimizer__name": "lbfgs"}, "optimizer.name: 'lbfgs' is neither sgd, adam, adamw nor a class's import path"),
    ({"optimizer__lr": -1}, "optimizer.lr: must be greater than 0 and at most 1000, got -1"),
    ({"optimizer__momentum": 0.9, "optimizer__name": "adam"}, "optimizer: momentum, dampening and nesterov apply to sgd only"),
    ({"optimizer__betas": [0.9, 1.5], "optimizer__name": "adam"}, "optimizer.betas.1: must be at least 0 and less than 1, got 1.5"),
    ({"optimizer__betas": [0.9], "optimizer__name": "adam"}, "optimizer.betas.1: required item is missing"),
    ({"data__batch_size": 0}, "data.batch_size: must be an integer between 1 and 1048576, got 0"),
    ({"data__factory": "not a ref!"}, "data.factory: 'not a ref!' is not"),
    ({"model__factory": DELETE}, "model.factory: required field is missing"),
    ({"steps": -3}, "steps: must be an integer between 1 and 1000000000, got -3"),
    ({"model__factory": "m" * 257}, "model.factory: String should have at most 256 characters"),
    ({"loss": "m:" + "f" * 255}, "loss: String should have at most 256 characters"),
    ({"model__args": {5: 1}}, "model.args.5.[key]: Input should be a valid string"),
    ({"bad\nkey": 1}, "'bad\\nkey': unknown field"),
    ({"loss": "hinge"}, "loss: 'hinge' is not cross_entropy, mse, model or 'module:function'"),
    ({"lr_schedule": {"name": "cosine", "warmup_steps": -1}}, "lr_schedule.cosine.warmup_steps"),
    ({"lr_schedule": {"name": "exponential"}}, "lr_schedule.name: 'exponential' is not one of step, cosine, linear, wsd"),
    ({"clip_grad_norm": 0}, "clip_grad_norm: must be greater than 0 and at most 1000000, got 0"),
    ({"device": "tpu"}, "device: Input should be 'cpu' or 'cuda'"),
    ({"epochs": 3}, "epochs: unknown field"),
    ({"optimizer__lr_decay": 0.1}, "optimizer.lr_decay: unknown field"),
    # A typo names the key as written, before the field it left missing, and the field it was meant as.
    ({"data__batch_sise": 4, "data__batch_size": DELETE}, "data.batch_sise: unknown field (did you mean batch_size?)"),
    ({"chunk": 4}, "chunk: unknown field (did you mean chunks?)"),
    ({"stage": 2, "stages": DELETE}, "stage: unknown field (did you mean stages?)"),
    ({"lr_schedule": {"name": "cosine", "warmup_step": 2}}, "lr_schedule.cosine.warmup_step: unknown field (did you mean warmup_steps?)"),
    ({"zzz": 1}, "zzz: unknown field"),
    # Did you mean: a field's common name elsewhere, its initials, a field of that name at another place, a value
    # of a fixed few, a tagged union's tag.
    ({"optimizer__learning_rate": 0.1}, "optimizer.learning_rate: unknown field (did you mean lr?)"),
    ({"optimizer__wd": 0.1}, "optimizer.wd: unknown field (did you mean weight_decay?)"),
    ({"micro_batches": 4}, "micro_batches: unknown field (did you mean chunks?)"),
    ({"batch_size": 4}, "batch_size: unknown field (did you mean data.batch_size?)"),
    ({"lr_schedule": {"name": "cosin"}}, "lr_schedule.name: 'cosin' is not one of step, cosine, linear, wsd (did you mean cosine?)"),
    ({"lr_schedule": {"warmup_steps": 2}}, "lr_schedule.name: required field is missing (one of step, cosine, linear, wsd)"),
    ({"precision": "bf61"}, "precision: Input should be 'fp32', 'bf16' or 'fp16' (did you mean bf16?)"),
    ({"optimizer__name": "adamx"}, "optimizer.name: 'adamx' is neither sgd, adam, adamw nor a class's import path 'module:Class' (torch.optim:RMSprop) (did you mean adam?)"),
]


@pytest.mark.parametrize("changes,message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_spec_names_the_field(changes, message):
    with pytest.raises(SpecError) as e:
        parse_spec(job_yaml(**changes))
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(message), line


def test_an_unknown_field_far_from_every_field_suggests_none():
    with pytest.raises(SpecError) as e:
        parse_spec(job_yaml(zzz=1))
    assert str(e.value) == "zzz: unknown field"


def test_good_spec_parses():
    s = parse_spec(GOOD)
    assert (s.stages, s.chunks, s.balance, s.schedule) == (2, 2, "by_params", "gpipe")


@pytest.mark.parametrize("text,message", [
    ("name: [unclosed", "job spec: not valid YAML (line "),
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
    ({"model__factory": "tests.support.models:not_sequential", "model__args": {}}, "model: Linear has no repeated blocks"),
    ({"data__factory": "tests.support.models:pid_marker", "data__args": {}}, "data.factory: returned int, expected a map-style Dataset"),
    ({"loss": "nosuchmodule:loss"}, "loss: cannot import module 'nosuchmodule'"),
]


@pytest.mark.parametrize("changes,message", PLAN_BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(PLAN_BAD)])
def test_checks_that_need_the_model(changes, message, tmp_path):
    with pytest.raises(SpecError) as e:
        make_plan(parse_spec(job_yaml(**changes)), tmp_path)
    assert str(e.value).startswith(message), str(e.value)


def test_per_layer_turns_the_probe_off_unless_told_and_probe_true_is_refused():
    assert parse_spec(GOOD).probe is True  # init exact: the probe runs by default
    assert parse_spec(job_yaml(init="per_layer")).probe is False  # it could not run: off, not refused
    assert parse_spec(job_yaml(init="per_layer", probe=False)).probe is False
    with pytest.raises(SpecError) as e:
        parse_spec(job_yaml(init="per_layer", probe=True))
    assert str(e.value).startswith("probe: init per_layer never builds the whole model"), e.value


def test_more_workers_than_cores_share_them_with_a_warning_that_oversubscribe_silences(capsys, monkeypatch):
    from gpipe.coordinator.cli import run

    monkeypatch.setattr(run.os, "sched_getaffinity", lambda pid: {0, 1})
    three = parse_spec(job_yaml(stages=3, chunks=2, balance=[2, 1, 1]))
    assert run.worker_cores(three) == [[0], [1], [0]]
    warned = capsys.readouterr().err.splitlines()
    assert len(warned) == 1 and warned[0].startswith("warning: 3 workers (1 replica(s) x 3 stage(s)) share "
                                                     "this machine's 2 CPU core(s)"), warned
    assert run.worker_cores(three, oversubscribe=True) == [[0], [1], [0]]
    assert run.worker_cores(parse_spec(GOOD)) == [[0], [1]]  # enough cores: each its own, no line
    assert capsys.readouterr().err == ""


# Every number's range: (the field's path in messages, where to set it, what else it needs,
# values at its bounds that parse, values just outside them, the range as the message says it).
SGD, ADAM = {"optimizer__name": "sgd"}, {"optimizer__name": "adam"}
STEP_LR = {"lr_schedule": {"name": "step", "step_size": 10}}
COSINE_LR = {"lr_schedule": {"name": "cosine"}}
LINEAR_LR = {"lr_schedule": {"name": "linear"}, "optimizer__lr": 1000, "steps": 10**9}
WSD_LR = {"lr_schedule": {"name": "wsd", "decay_fraction": 0}, "optimizer__lr": 1000, "steps": 10**9}
BIG_BATCH = {"data__batch_size": 4096}
RANGES = [
    ("seed", "seed", {}, [0, 2**32 - 1], [-1, 2**32], "an integer between 0 and 4294967295"),
    ("stages", "stages", {}, [1, 64], [0, 65], "an integer between 1 and 64"),
    ("balance.1", "balance", {}, [1, 10**6], [0, 10**6 + 1], "an integer between 1 and 1000000"),
    ("chunks", "chunks", BIG_BATCH, [1, 4096], [0, 4097], "an integer between 1 and 4096"),
    ("steps", "steps", {}, [1, 10**9], [0, 10**9 + 1], "an integer between 1 and 1000000000"),
    ("data.batch_size", "data__batch_size", {"chunks": 1}, [1, 2**20], [0, 2**20 + 1], "an integer between 1 and 1048576"),
    ("log_every", "log_every", {}, [1, 10**9], [0, 10**9 + 1], "an integer between 1 and 1000000000"),
    ("checkpoint_every", "checkpoint_every", {}, [1, 10**9, None], [0, 10**9 + 1], "an integer between 1 and 1000000000"),
    ("trace_step", "trace_step", {"steps": 10**9}, [1, 10**9, None], [0, 10**9 + 1], "an integer between 1 and 1000000000"),
    ("keep_checkpoints", "keep_checkpoints", {}, [2, 1000], [1, 1001], "an integer between 2 and 1000"),
    ("max_restarts", "max_restarts", {}, [0, 100], [-1, 101], "an integer between 0 and 100"),
    ("restart_timeout_s", "restart_timeout_s", {}, [1e-3, 604800], [0, 604800.5], "greater than 0 and at most 604800"),
    ("start_timeout_s", "start_timeout_s", {}, [1e-3, 604800], [0, -1], "greater than 0 and at most 604800"),
    ("step_timeout_s", "step_timeout_s", {}, [0.5, 604800.0], [0.0, 10**6], "greater than 0 and at most 604800"),
    ("optimizer.lr", "optimizer__lr", {}, [1e-9, 1000], [0, 1000.5], "greater than 0 and at most 1000"),
    ("optimizer.momentum", "optimizer__momentum", SGD, [0, 0.99], [-0.1, 1], "at least 0 and less than 1"),
    ("optimizer.dampening", "optimizer__dampening", SGD, [0, 1], [-0.1, 1.1], "between 0 and 1"),
    ("optimizer.weight_decay", "optimizer__weight_decay", {}, [0, 1000, None], [-1, 1001], "between 0 and 1000"),
    ("optimizer.eps", "optimizer__eps", ADAM, [1e-12, 1], [0, 2], "greater than 0 and at most 1"),
    ("optimizer.betas.0", "optimizer__betas", ADAM, [0, 0.999], [-0.1, 1], "at least 0 and less than 1"),
    ("lr_schedule.step.step_size", "lr_schedule__step_size", STEP_LR, [1, 10**9], [0, 10**9 + 1], "an integer between 1 and 1000000000"),
    ("lr_schedule.step.gamma", "lr_schedule__gamma", STEP_LR, [1e-6, 1], [0, 1.5], "greater than 0 and at most 1"),
    ("lr_schedule.cosine.warmup_steps", "lr_schedule__warmup_steps", COSINE_LR, [0, 10**9], [-1, 10**9 + 1], "an integer between 0 and 1000000000"),
    ("lr_schedule.cosine.min_lr", "lr_schedule__min_lr", COSINE_LR, [0, 1000], [-1e-9, 1000.5], "between 0 and 1000"),
    ("lr_schedule.linear.warmup_steps", "lr_schedule__warmup_steps", LINEAR_LR, [0, 10**9 - 1], [-1, 10**9 + 1], "an integer between 0 and 1000000000"),
    ("lr_schedule.linear.min_lr", "lr_schedule__min_lr", LINEAR_LR, [0, 1000], [-1e-9, 1000.5], "between 0 and 1000"),
    ("lr_schedule.wsd.warmup_steps", "lr_schedule__warmup_steps", WSD_LR, [0, 10**9], [-1, 10**9 + 1], "an integer between 0 and 1000000000"),
    ("lr_schedule.wsd.decay_fraction", "lr_schedule__decay_fraction", WSD_LR, [0, 1], [-1e-9, 1.5], "between 0 and 1"),
    ("lr_schedule.wsd.min_lr", "lr_schedule__min_lr", WSD_LR, [0, 1000, None], [-1e-9, 1000.5], "between 0 and 1000"),
    ("lr_schedule.wsd.min_lr_ratio", "lr_schedule__min_lr_ratio", WSD_LR, [0, 1, None], [-1e-9, 1.5], "between 0 and 1"),
    ("clip_grad_norm", "clip_grad_norm", {}, [1e-9, 10**6, None], [0, 10**6 + 1], "greater than 0 and at most 1000000"),
]
# What no number field takes: each is refused with the same line, naming the range.
NOT_NUMBERS = [float("inf"), float("-inf"), float("nan"), True, False, 10**30, -(10**30), 10**400, "twenty", [1]]


def _set(path: str, context: dict, value) -> str:
    changes = copy.deepcopy(context)
    if path == "balance":  # the second of two stages
        changes["stages"], value = 2, [1, value]
    if path == "optimizer__betas":  # the first beta
        value = [value, 0.9]
    changes[path] = value
    return job_yaml(**changes)


@pytest.mark.parametrize("loc,path,context,good,bad,span", RANGES, ids=[r[0] for r in RANGES])
def test_every_number_has_a_range(loc, path, context, good, bad, span):
    for value in good:
        parse_spec(_set(path, context, value))
    for value in bad + NOT_NUMBERS:
        with pytest.raises(SpecError) as e:
            parse_spec(_set(path, context, value))
        line = str(e.value)
        assert line.startswith(f"{loc}: must be {span}, got "), (value, line)
        assert "\n" not in line and len(line) < 200, line


def test_an_integer_field_takes_integers_only():
    assert parse_spec(job_yaml(steps=1_000)).steps == 1000
    for value in (2.0, "2", True):
        with pytest.raises(SpecError, match=r"^steps: must be an integer between 1 and 1000000000"):
            parse_spec(job_yaml(steps=value))
    # Numbers written as YAML 1.1 strings still reach float fields: lr: 1e-3 is text to PyYAML.
    assert parse_spec(GOOD.replace("lr: 0.1", "lr: 1e-3")).optimizer.lr == 1e-3


def test_the_wire_takes_every_spec_that_parses():
    s = parse_spec(job_yaml(steps=10**9, seed=2**32 - 1, max_restarts=100))
    job = job_records.JobRecord(name=s.name, spec_yaml="", steps=s.steps, restarts=s.max_restarts)
    assert serde.job_from_pb(serde.job_to_pb(job)) == job


@pytest.fixture(params=["libyaml", "python"])
def loader(request, monkeypatch):
    """Both YAML parsers: libyaml's where PyYAML has it (the default), and PyYAML's own."""
    if request.param == "libyaml":
        if not yaml.__with_libyaml__:
            pytest.skip("PyYAML was built without libyaml")
        monkeypatch.setattr(boundedyaml, "Loader", yaml.CSafeLoader)
    else:
        monkeypatch.setattr(boundedyaml, "Loader", yaml.SafeLoader)


def _refused(text) -> str:
    with pytest.raises(SpecError) as e:
        parse_spec(text)
    line = str(e.value)
    assert "\n" not in line, line
    return line


def _with_args(args_yaml: str) -> str:
    return GOOD.replace("args: {width: 8, depth: 3}", f"args: {args_yaml}")


def nested(levels: int) -> str:
    """A spec whose model.args hold lists nested so that the document is `levels` deep."""
    inner = levels - 3  # the top-level mapping, model and args
    return _with_args("{deep: " + "[" * inner + "]" * inner + "}")


def test_size_limit(loader):
    padded = GOOD + "#" * (MAX_SPEC_BYTES - len(GOOD.encode()))
    assert len(padded.encode()) == MAX_SPEC_BYTES
    parse_spec(padded)
    assert _refused(padded + "#") == f"job spec: {MAX_SPEC_BYTES + 1} bytes is over the 1 MiB limit"
    # Counted in UTF-8 bytes, not characters: 600k characters of two bytes each.
    assert _refused(GOOD + "#" + "é" * 600_000).startswith("job spec: 1200")
    assert _refused("x" * 50 * MAX_SPEC_BYTES).endswith("bytes is over the 1 MiB limit")


def test_depth_limit(loader):
    deep, levels = parse_spec(nested(MAX_DEPTH)).model.args["deep"], 3
    while isinstance(deep, list):
        deep, levels = deep[0] if deep else None, levels + 1
    assert levels == MAX_DEPTH
    assert _refused(nested(MAX_DEPTH + 1)) == f"job spec: nested deeper than {MAX_DEPTH} levels"
    # As deep as 1 MiB allows: once a RecursionError (or a crash in libyaml), now one line.
    n = MAX_SPEC_BYTES // 2 - 200
    assert _refused(_with_args("{deep: " + "[" * n + "]" * n + "}")) == "job spec: nested deeper than 64 levels"
    block = "".join(" " * i + f"k{i}:\n" for i in range(200))
    assert _refused(block) == "job spec: nested deeper than 64 levels"
    # An alias counts at the depth it is used: 40 levels under 40 levels is 80.
    forty = "[" * 37 + "]" * 37
    assert _refused(_with_args(f"{{a: &a {forty}, b: {'[' * 40}*a{']' * 40}}}")).endswith("deeper than 64 levels")


def test_alias_bombs_are_refused_while_parsing(loader):
    lol = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lol += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    text = _with_args("{" + ", ".join(lol) + "}")
    assert len(text) < 1000  # 10**10 values once expanded
    assert _refused(text) == f"job spec: more than {MAX_NODES} values once aliases are expanded"
    # Values written out count the same: 1 MiB of one-digit integers is some 340k of them.
    ones = _with_args("{ones: [" + ", ".join(["1"] * ((MAX_SPEC_BYTES - len(GOOD)) // 3 - 10)) + "]}")
    assert _refused(ones) == f"job spec: more than {MAX_NODES} values once aliases are expanded"


def test_aliases_and_merge_keys_that_fit_are_fine(loader):
    shared = GOOD.replace("args: {width: 8, depth: 3}", "args: {width: &w 8, depth: 3}").replace(
        "in_features: 8, out_features: 8", "in_features: *w, out_features: *w")
    assert shared != GOOD and parse_spec(shared) == parse_spec(GOOD)
    merged = _with_args("{<<: [{width: 4, depth: 3}, {depth: 9, bias: true}], width: 8}")
    assert parse_spec(merged).model.args == {"width": 8, "depth": 3, "bias": True}


@pytest.mark.parametrize("text,message", [
    (b"name: x", "job spec: expected YAML text, got bytes"),
    (None, "job spec: expected YAML text, got NoneType"),
    (GOOD + "x: \x00\n", "job spec: not valid YAML"),
    (GOOD + "x: '\ud800'\n", "job spec: not valid text: a lone surrogate at character"),
    (GOOD + "steps: 3\n", "job spec: not valid YAML (line 10, column 1): duplicate key 'steps'"),
    (GOOD + "---\nname: other\n", "job spec: not valid YAML (line 10, column 1): expected a single document"),
    (GOOD + "x: &x [*x]\n", "job spec: not valid YAML (line 10, column 8): alias 'x' refers to a collection"),
    (GOOD + "x: *nowhere\n", "job spec: not valid YAML (line 10, column 4): found undefined alias 'nowhere'"),
    (GOOD + "x: !!python/object:os.system ls\n", "job spec: not valid YAML (line 10, column 4): unsupported tag"),
    (GOOD + "x: !!set {a}\n", "job spec: not valid YAML (line 10, column 4): unsupported tag"),
    (GOOD + "? [1]\n: 2\n", "job spec: not valid YAML (line 10, column 3): a mapping key must be a scalar"),
    (GOOD + "x: 2020-13-01\n", "job spec: not valid YAML (line 10, column 4): cannot read '2020-13-01' as timestamp"),
    (GOOD.replace("steps: 2", "steps: " + "9" * 5000), "job spec: not valid YAML (line 9, column 8): cannot read"),
    (GOOD.replace("steps: 2", "steps: " + "9" * 4000), "steps: must be an integer between 1 and 1000000000, got an integer of 13288 bits"),
])
def test_text_that_is_no_spec(loader, text, message):
    assert _refused(text).startswith(message)


def test_a_1_mib_spec_parses(loader):
    """The largest spec there may be, a model argument of 130k integers."""
    ints = ", ".join(str(100_000 + i) for i in range((MAX_SPEC_BYTES - len(GOOD) - 100) // 8))
    text = _with_args(f"{{width: 8, depth: 3, sizes: [{ints}]}}")
    assert MAX_SPEC_BYTES - 200 < len(text.encode()) <= MAX_SPEC_BYTES
    assert len(parse_spec(text).model.args["sizes"]) > 130_000


def test_load_spec_reads_at_most_the_limit(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(GOOD.encode() + b"#" * (3 * MAX_SPEC_BYTES))
    with pytest.raises(SpecError, match=rf"^{big}: {3 * MAX_SPEC_BYTES + len(GOOD)} bytes is over the 1 MiB limit$"):
        load_spec(big)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(GOOD.encode() + "x: café\n".encode("latin-1"))
    with pytest.raises(SpecError, match=rf"^{latin1}: not UTF-8 text \(byte \d+\)$"):
        load_spec(latin1)
