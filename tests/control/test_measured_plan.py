"""`schedule: measured` and `schedule: {file: ...}` in the plan: the order built from the measured costs within the
memory budget and recorded in plan.json's `auto` as a table of rows (a resumed job gets it back), never slower
than the best fixed schedule in the simulator; a CSV table read when the job is planned, a bad one refused in
one line naming the row."""

from __future__ import annotations

import json

import pytest

from gpipe import measured, schedule
from gpipe.coordinator.plan import search as planner
from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.plan.search import HEADROOM, Config
from gpipe.coordinator.spec.job import parse_spec
from gpipe.errors import SpecError
from tests.control.test_planner import FREE
from tests.control.test_planner import measured as fake_costs
from tests.support.cli import one_error_line
from tests.support.spec import job, job_yaml

# An embedding-like first layer and a head-like last one, each several blocks' work; a W a third of a B.
F = [3e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 4e-3]


@pytest.fixture
def free(monkeypatch):
    monkeypatch.setitem(planner.LINKS, "cpu", FREE)


def spec_of(**changes):
    return parse_spec(job_yaml(model__args={"width": 8, "depth": 7}, data__batch_size=16, data__args__n=64,
                               stages=2, chunks=8, **changes))


@pytest.mark.parametrize("virtual", [1, 2])
def test_measured_is_no_slower_than_any_fixed_schedule_of_its_placement(tmp_path, free, virtual):
    m = fake_costs(tmp_path, F, w=[x / 3 for x in F])
    c = Config(2, 1, "measured", virtual, 8, "never", False)
    fits, _ = planner.evaluate(m, [c], 1 << 40)
    (x,) = fits
    assert schedule.is_table(x.config.schedule) and x.built is not None
    fixed = {n: t for n, t in x.built.fixed.items() if t is not None}
    assert set(fixed) == ({"gpipe", "1f1b", "zb-h1"} if virtual == 1 else {"zbv", "v-half", "v-min", "dualpipev"})
    for name, t in fixed.items():  # as plan would predict each fixed one, balance and all
        step, _ = planner.step_time(m, Config(2, 1, name, virtual, 8, "never", False, x.config.balance),
                                    spec_of(schedule=name, virtual_stages=virtual))
        assert t == pytest.approx(step) and x.step_s <= step * (1 + 1e-9)
    assert planner.shown(x.config.schedule) == "measured" and "measured" in x.config.describe()


def test_resolve_records_the_order_as_rows_and_a_resumed_job_gets_it_back(tmp_path, free, monkeypatch):
    monkeypatch.setattr(planner, "measure", lambda *a, **k: fake_costs(tmp_path, F, w=[x / 3 for x in F]))
    spec = spec_of(schedule="measured", virtual_stages=2)
    assert spec.auto == ["schedule"] and spec.schedule == "measured"
    resolved, record = planner.resolve(spec, tmp_path, 2, 1, 1 << 40)
    assert schedule.is_table(resolved.schedule) and resolved.auto == [] and resolved.virtual_stages == 2
    assert record["chosen"] == {"schedule": "measured", "virtual_stages": 2}
    table = record["schedule_table"]
    assert table["columns"] == ["worker", "order", "kind", "micro_batch", "chunk"]
    assert len(table["rows"]) == 2 * 8 * 2 * 3 and table["from"] in ("measured", "zbv", "v-half", "v-min", "dualpipev")
    assert [list(r) for r in measured.rows(schedule.parse_table(resolved.schedule))] == table["rows"]
    assert record["why"].startswith("measured: ") and "the best fixed schedule within the memory" in record["why"]
    again = planner.chosen(spec, json.loads(json.dumps(record)))  # as plan.json keeps it
    assert again == resolved
    other = parse_spec(job_yaml(model__args={"width": 8, "depth": 7}, data__batch_size=16, data__args__n=64,
                                stages=2, chunks=4, schedule="measured", virtual_stages=2))
    with pytest.raises(ValueError, match="chunks: the table runs 8"):  # another shape: built again
        planner.chosen(other, record)
    with pytest.raises(SpecError, match=r"^schedule: no configuration fits 0.00 GiB a worker .* the smallest "
                                        r"predicted peak is .* measured x2, 8 chunks"):
        planner.resolve(spec, tmp_path, 2, 1, 1)


def test_a_budget_that_binds_gives_an_order_within_it(tmp_path, free):
    """The memory model's peaks of the fixed V schedules spread from v-min's to zbv's: under a budget between
    them, measured's order is predicted within it, and no fixed schedule over it counts."""
    m = fake_costs(tmp_path, F, w=[x / 3 for x in F])
    peaks = {}
    for name in ("zbv", "v-min"):
        c = Config(2, 1, name, 2, 8, "never", False, (2, 2, 2, 2))
        peaks[name] = planner.peaks(m, c, spec_of(schedule=name, virtual_stages=2, balance=list(c.balance)))
    assert max(peaks["v-min"]) < max(peaks["zbv"])
    budget = int((max(peaks["v-min"]) + max(peaks["zbv"])) / 2 / HEADROOM)
    fits, over = planner.evaluate(m, [Config(2, 1, "measured", 2, 8, "never", False)], budget,
                                  balance=[2, 2, 2, 2])
    assert not over
    (x,) = fits
    assert x.peak <= budget * HEADROOM
    assert x.built is not None and x.built.fixed["zbv"] is None  # over the budget: not a candidate


def csv_of(orders) -> str:
    return measured.write_csv(orders)


def test_a_schedule_from_a_file_is_read_when_the_job_is_planned(tmp_path):
    orders = [schedule.build("zb-h1", k, 2, 2) for k in range(2)]
    (tmp_path / "order.csv").write_text(csv_of(orders))
    spec = parse_spec(job_yaml(schedule={"file": "order.csv"}))
    assert spec.schedule == "file:order.csv"
    plan = make_plan(spec, tmp_path)
    assert plan.spec.schedule == schedule.table(orders)
    assert [schedule.build(plan.spec.schedule, k, 2, 2) for k in range(2)] == orders


def test_a_measured_job_s_plan_json_is_a_table_to_run_again(tmp_path, free, monkeypatch):
    """plan.json's auto.schedule_table read back: as the file itself, and as the CSV `python -m gpipe.measured`
    writes of it."""
    monkeypatch.setattr(planner, "measure", lambda *a, **k: fake_costs(tmp_path, F, w=[x / 3 for x in F]))
    resolved, record = planner.resolve(spec_of(schedule="measured"), tmp_path, 2, 1, 1 << 40)
    (tmp_path / "plan.json").write_text(json.dumps({"auto": record, "spec": {}}))
    again = make_plan(spec_of(schedule={"file": "plan.json"}), tmp_path)
    assert again.spec.schedule == resolved.schedule
    (tmp_path / "order.csv").write_text(measured.write_csv(measured.read_table((tmp_path / "plan.json").read_text())))
    assert make_plan(spec_of(schedule={"file": "order.csv"}), tmp_path).spec.schedule == resolved.schedule


@pytest.mark.parametrize(("text", "message"), [
    ("worker,order,kind,micro_batch,chunk\n0,0,F,0,0\n0,1,Q,1,0\n", "schedule: order.csv: row 3: kind 'Q' is not"),
    (None, "schedule: reading /"),
    (csv_of([schedule.build("zb-h1", k, 2, 4) for k in range(2)]), "chunks: the table runs 4 micro-batch(es), not 2"),
    (csv_of([schedule.build("1f1b", k, 3, 2) for k in range(3)]), "stages: the table's schedule is for 3 worker(s)"),
])
def test_a_bad_file_is_refused_in_one_line(tmp_path, text, message):
    if text is not None:
        (tmp_path / "order.csv").write_text(text)
    with pytest.raises(SpecError) as e:
        make_plan(parse_spec(job_yaml(schedule={"file": "order.csv"})), tmp_path)
    assert str(e.value).startswith(message), str(e.value)


def test_validate_refuses_a_bad_table_naming_the_row_exit_2(cli):
    (cli.tmp / "order.csv").write_text("worker,order,kind,micro_batch,chunk\n0,0,F,0,0\n0,1,B,0,0\n0,2,B,0,0\n")
    r = cli.run("validate", str(cli.write(job(schedule={"file": "order.csv"}, chunks=1))))
    assert r.returncode == 2
    one_error_line(r.stderr, "error: schedule: order.csv: row 4: a second B of micro-batch 0 on model chunk 0")
