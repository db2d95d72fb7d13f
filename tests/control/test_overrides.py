"""--set PATH=VALUE and --name applied to a job file's text (gpipe.coordinator.spec.overrides)."""

from __future__ import annotations

import pytest
import yaml

from gpipe.coordinator.spec.job import parse_spec
from gpipe.coordinator.spec.overrides import apply
from gpipe.errors import SpecError
from tests.support.spec import GOOD, job


def over(*sets: str, name: str | None = None) -> dict:
    return yaml.safe_load(apply(GOOD, list(sets), name, "job.yaml"))


def test_no_override_leaves_the_text_as_it_is():
    assert apply(GOOD, [], None, "job.yaml") is GOOD


def test_each_set_replaces_one_value_in_order_and_the_rest_stays():
    got = over("chunks=4", "optimizer.lr=3e-4", "data.args={n: 64}", "balance=[1, 3]", "balance.0=2", "chunks=1",
               name="other")
    assert got == job(name="other", chunks=1, optimizer__lr=3e-4, data__args={"n": 64}, balance=[2, 3])
    assert isinstance(got["optimizer"]["lr"], float)  # YAML 1.1's 3e-4 is text; the schema takes it as a float
    assert parse_spec(apply(GOOD, ["optimizer.lr=3e-4"], None, "job.yaml")).optimizer.lr == 3e-4


def test_a_mapping_missing_on_the_way_is_made_and_null_removes_nothing_but_sets_null():
    assert over("lr_schedule.name=cosine", "lr_schedule.warmup_steps=1")["lr_schedule"] == \
        {"name": "cosine", "warmup_steps": 1}
    assert over("chunks=")["chunks"] is None and over("eval=null")["eval"] is None


@pytest.mark.parametrize("item,line", [
    ("chunks", "--set chunks: expected PATH=VALUE"),
    ("=3", "--set =3: expected PATH=VALUE"),
    ("optimizer..lr=1", "--set optimizer..lr=1: expected PATH=VALUE"),
    ("chunks.n=1", "--set chunks.n=1: chunks is a number, not a mapping with field 'n'"),
    ("loss.x=1", "--set loss.x=1: loss is text, not a mapping with field 'x'"),
    ("data.args.n.m=1", "--set data.args.n.m=1: data.args.n is a number, not a mapping with field 'm'"),
    ("chunks=[1", "--set chunks: not valid YAML"),
    ("chunks=&a [*a]", "--set chunks:"),
])
def test_what_cannot_be_applied_is_one_line_naming_the_item(item, line):
    with pytest.raises(SpecError) as e:
        apply(GOOD, [item], None, "job.yaml")
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_a_list_index_must_be_in_the_list():
    text = GOOD + "balance: [2, 2]\n"
    assert yaml.safe_load(apply(text, ["balance.1=1"], None, "j"))["balance"] == [2, 1]
    with pytest.raises(SpecError, match=r"^--set balance.2=1: balance is a list of 2; '2' is not an index in it$"):
        apply(text, ["balance.2=1"], None, "j")


def test_a_set_through_a_yaml_alias_changes_only_the_path_it_names():
    """data: &d {...} and eval: {data: *d}: --set data.batch_size changes the training data, not the eval data
    (the alias loads as one object; before the fix both changed), and the text written has no alias left."""
    text = ("name: al\nmodel: {factory: mlp}\nstages: 2\n"
            "data: &d {factory: random_regression, batch_size: 4}\neval: {data: *d, every: 2}\n"
            "optimizer: {name: sgd, lr: 0.1}\nsteps: 2\n")
    out = apply(text, ["data.batch_size=64"], None, "job.yaml")
    raw = yaml.safe_load(out)
    assert raw["data"]["batch_size"] == 64 and raw["eval"]["data"]["batch_size"] == 4
    assert "&" not in out and "*" not in out
