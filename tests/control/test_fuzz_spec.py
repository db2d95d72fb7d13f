"""Property-based fuzzing of the spec parser and of job records read back from disk.

Whatever the input, parse_spec gives a JobSpec or a SpecError of one line, and a
JobSpec it gives fits the wire; JobRecord.from_json gives a record that fits the
wire or a ValueError of one line. Bounded and reproducible for CI: 200 examples
per property, derandomized, no example database.
"""

from __future__ import annotations

import json
import math
import os

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpipe.coordinator.spec import boundedyaml
from gpipe.coordinator.spec.job import JobSpec, parse_spec
from gpipe.errors import SpecError
from gpipe.service import serde
from gpipe.service.job_records import INT32, INT64, JobRecord
from tests.support.records import on_disk
from tests.support.spec import DELETE, GOOD, put

# GPIPE_FUZZ_EXAMPLES=5000 searches longer, with fresh random examples each run.
EXAMPLES = int(os.environ.get("GPIPE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="GPIPE_FUZZ_EXAMPLES" not in os.environ,
                database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = (st.none() | st.booleans() | st.integers() | st.floats()
           | st.sampled_from([0, 1, -1, 2**31, 2**63, 10**30, 10**400, 1e308, float("inf"), float("nan"), ""])
           | st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = sorted(JobSpec.model_fields) + ["model.factory", "data.batch_size", "optimizer.lr"]


def outcome(text: object) -> JobSpec | None:
    """parse_spec's answer: the spec, or None after checking the error is one line."""
    try:
        spec = parse_spec(text)  # type: ignore[arg-type]  # any input at all
    except SpecError as e:
        line = str(e)
        assert line and len(line.splitlines()) == 1 and len(line) < 1000, repr(line)
        return None
    assert isinstance(spec, JobSpec)
    job = JobRecord(name=spec.name, spec_yaml=text, steps=spec.steps, restarts=spec.max_restarts,  # type: ignore[arg-type]
                    checkpoint_step=spec.steps, steps_done=spec.steps)
    serde.job_to_pb(job)  # fits the wire
    assert JobRecord.from_json(json.loads(json.dumps(job.to_json()))) == job
    return spec


@FUZZ
@given(st.text(max_size=300))
def test_any_text(text):
    outcome(text)


@FUZZ
@given(st.text(alphabet="{}[]:,-&*!|>'\"#?% \n\tab1.e", max_size=120))
def test_yaml_punctuation(text):
    outcome(text)


@FUZZ
@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), values, max_size=8))
def test_any_structure(d):
    outcome(yaml.safe_dump(d))


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


VALID = yaml.safe_load(GOOD)
VALID["lr_schedule"] = {"name": "cosine", "warmup_steps": 1, "min_lr": 0.01}
VALID["balance"] = [2, 2]
PATHS = [p for p in _paths(VALID) if p]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(PATHS), values | st.just(DELETE)), min_size=1, max_size=3))
def test_a_valid_spec_with_fields_replaced(changes):
    d = json.loads(json.dumps(VALID))
    for path, value in changes:
        try:
            put(d, path, value)
        except (KeyError, IndexError, TypeError):  # an earlier change took the path away
            pass
    spec = outcome(yaml.safe_dump(d))
    if spec is not None:
        assert 1 <= spec.steps <= INT64[1] and 0 <= spec.max_restarts <= INT32[1]
        assert all(math.isfinite(x) for x in (spec.optimizer.lr, spec.start_timeout_s, spec.step_timeout_s))


@FUZZ
@given(st.lists(st.sampled_from(["&a ", "*a ", "[", "]", "{", "}", ", ", "x: ", "- ", "\n", "  ", "<<: ", "1"]),
                max_size=60))
def test_anchors_aliases_and_nesting(parts):
    outcome(ARGS_LAST + "".join(parts))


# GOOD with the model last, in block style, so that text appended is a model argument's value.
MODEL = "model: {factory: mlp, args: {width: 8, depth: 3}}\n"
ARGS_LAST = GOOD.replace(MODEL, "") + "model:\n  factory: mlp\n  args:\n    width: 8\n    depth: 3\n    x: "
assert MODEL in GOOD


def bounded_load(text: str) -> object:
    return boundedyaml.load(text, source="s", max_bytes=1 << 20, max_depth=64, max_nodes=10**6)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16)


@FUZZ
@given(json_values)
def test_the_bounded_loader_reads_what_safe_load_reads(value):
    text = yaml.safe_dump(value)
    assert bounded_load(text) == yaml.load(text, Loader=boundedyaml.Loader)


def job_record_outcome(d: object) -> None:
    try:
        job = JobRecord.from_json(d)
    except ValueError as e:
        assert type(e) is ValueError and len(str(e).splitlines()) == 1, repr(str(e))
        return
    serde.job_to_pb(job)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(on_disk())) | st.text(max_size=6), values, max_size=16) | values)
def test_any_job_record(d):
    job_record_outcome(d)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(sorted(on_disk())), values | st.just(DELETE)), min_size=1, max_size=3),
       st.lists(st.dictionaries(st.sampled_from(["state", "time_unix", "message", "x"]), values), max_size=3))
def test_a_valid_job_record_with_fields_replaced(changes, history):
    d = on_disk()
    for k, v in changes:
        if v is DELETE:
            d.pop(k, None)
        else:
            d[k] = v
    if history:
        d["history"] = history
    job_record_outcome(d)


def _read(load, text: str) -> str:
    try:
        return repr(load(text))
    except (yaml.YAMLError, SpecError, ValueError):
        return "refused"


@FUZZ
@given(st.text(alphabet="0123456789+-._eE:~ntrueflsaoyNTFYO<=!&*'\" ", max_size=10))
def test_scalars_read_as_safe_load_reads_them(scalar):
    text = f"a: {scalar}\n"
    bounded = _read(bounded_load, text)
    assert bounded == _read(lambda t: yaml.load(t, Loader=boundedyaml.Loader), text)  # the same parser
