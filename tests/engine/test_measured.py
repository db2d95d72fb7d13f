"""`schedule: measured` (gpipe.measured): orders built from cost tables honour every dependency and the memory
limits, never lose to the best fixed schedule within the same limits in the simulator, and tables go out and
come back as CSV, a bad one refused in one line naming its row."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpipe import measured, schedule
from gpipe.measured import Costs, TableError
from gpipe.options import violation
from gpipe.schedule import Action
from gpipe.topology import model_chunk, place

SHAPES = [(1, 1, 1), (2, 1, 1), (2, 4, 1), (3, 5, 1), (4, 8, 1), (2, 4, 2), (3, 3, 2), (4, 8, 2)]


def costs(rng: random.Random, p: int, v: int) -> Costs:
    g = p * v
    def draw(lo: float, hi: float) -> list[float]:
        return [rng.uniform(lo, hi) for _ in range(g)]
    return Costs(draw(0.2, 3.0), draw(0.2, 3.0), draw(0.05, 2.0), draw(0.0, 0.5), draw(1.0, 5.0))


def fixed_steps(built: measured.Built) -> dict[str, float]:
    return {n: t for n, t in built.fixed.items() if t is not None}


@st.composite
def tables(draw: st.DrawFn) -> tuple[int, int, int, Costs, list[float] | None]:
    p = draw(st.integers(1, 3))
    v = draw(st.sampled_from([1, 2]))
    m = draw(st.integers(1, 6))
    g = p * v
    times = st.floats(0.01, 5.0)
    c = Costs(draw(st.lists(times, min_size=g, max_size=g)), draw(st.lists(times, min_size=g, max_size=g)),
              draw(st.lists(st.floats(0.0, 5.0), min_size=g, max_size=g)),
              draw(st.lists(st.floats(0.0, 1.0), min_size=g, max_size=g)),
              draw(st.lists(st.floats(1.0, 10.0), min_size=g, max_size=g)))
    # a limit a worker's way: none, or from one micro-batch's bytes (its model chunks') up to all of them
    limits = draw(st.one_of(st.none(), st.lists(st.floats(1.0, float(m)), min_size=p, max_size=p)))
    if limits is not None:
        one = [sum(c.held[gg] for gg in range(g) if place(measured.NAME, gg, p)[0] == k) for k in range(p)]
        limits = [x * o for x, o in zip(limits, one, strict=True)]
    return p, m, v, c, limits


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables())
def test_the_order_honours_every_dependency_and_the_limits_and_never_loses_to_a_fixed_one(table):
    p, m, v, c, limits = table
    built = measured.build(p, m, v, c.length(p), c.held_by(p), limits)
    orders = built.orders
    measured.check(orders)  # each F, B (and W) once, in order on its worker, no deadlock
    assert schedule.table_shape(orders) == (p, m, v)
    assert violation(built.name, p, v, m) is None
    if limits is not None:
        assert all(h <= lim * (1 + 1e-9) for h, lim in zip(measured.held_peaks(orders, c.held_by(p)), limits,
                                                              strict=True))
    score = measured.steady_score(p, m, v, c.length(p))
    assert built.step == pytest.approx(score(built.name))
    assert all(built.step <= t * (1 + 1e-12) for t in fixed_steps(built).values()), (built.step, built.fixed)
    if built.source != measured.NAME:  # a fixed one's order, when nothing built was faster
        assert built.step == pytest.approx(built.fixed[built.source])


@pytest.mark.parametrize(("p", "m", "v"), SHAPES)
def test_at_the_cost_model_measured_is_at_least_the_best_fixed_schedule(p, m, v):
    built = measured.build(p, m, v, lambda k, a, split: schedule.cost(a.kind, split))
    assert built.step <= min(fixed_steps(built).values()) + 1e-9
    assert [list(row) for row in built.orders] == [schedule.build("measured", k, p, m, v) for k in range(p)]


@pytest.mark.parametrize("v", [1, 2])
def test_unequal_stages_measured_beats_every_fixed_schedule_or_reaches_the_busiest_worker(v):
    """An embedding first and a vocabulary head last (three and four times a block), a W a third of a B: the
    fixed tables assume equal stages; on one model chunk a worker the built order does better than all of them.
    On the V worker 0 holds both (the first and the last model chunk): steps in a row take its work, no less,
    and the built order takes no more."""
    p, m = 4, 8
    g = p * v
    f = [1.0] * g
    f[0], f[-1] = 3.0, 4.0
    c = Costs(f, [2 * x for x in f], [x / 1.5 for x in f], [0.05] * g)
    length = c.length(p)
    built = measured.build(p, m, v, length)
    if v == 1:
        assert built.source == measured.NAME
        assert built.step < min(fixed_steps(built).values())
    else:
        busiest = max(sum(length(k, a, True) for a in row) for k, row in enumerate(built.orders))
        assert built.step == pytest.approx(busiest)


def test_of_two_orders_as_fast_the_one_holding_less_wins():
    """At the cost model, no limit: measured on the V is as fast as zbv steps in a row, and holds no more."""
    built = measured.build(4, 8, 2, lambda k, a, split: schedule.cost(a.kind, split))
    assert built.step == built.fixed["zbv"]
    one = lambda k, a: 1.0  # noqa: E731
    zbv = [schedule.build("zbv", k, 4, 8, 2) for k in range(4)]
    assert max(measured.held_peaks(built.orders, one)) <= max(measured.held_peaks(zbv, one))


def test_a_limit_below_one_micro_batch_is_refused_and_a_tight_one_is_kept():
    c = Costs([1.0] * 4, [1.0] * 4, [1.0] * 4, held=[10.0] * 4)
    with pytest.raises(ValueError, match="not even one micro-batch fits"):
        measured.build(4, 8, 1, c.length(4), c.held_by(4), [5.0] * 4)
    built = measured.build(4, 8, 1, c.length(4), c.held_by(4), [20.0] * 4)  # two micro-batches a worker
    assert max(measured.held_peaks(built.orders, c.held_by(4))) <= 20.0
    assert built.fixed["gpipe"] is None and built.fixed["zb-h1"] is None  # they hold more


def test_a_table_s_name_builds_places_and_simulates_as_its_rows_say():
    orders = [[Action("F", 0), Action("F", 1), Action("B", 0), Action("W", 0), Action("B", 1), Action("W", 1)],
              [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1), Action("W", 0), Action("W", 1)]]
    name = schedule.table(orders)
    assert name == "table:F0 F1 B0 W0 B1 W1 / F0 B0 F1 B1 W0 W1"
    assert [schedule.build(name, k, 2, 2) for k in range(2)] == orders
    assert name in schedule.REGISTRY and schedule.REGISTRY[name].v_shape
    assert orders == [schedule.build("zb-h1", k, 2, 2) for k in range(2)]  # zb-h1's, as a table
    assert schedule.simulate(name, 2, 2) == schedule.simulate("zb-h1", 2, 2)
    with pytest.raises(ValueError, match="the table is of 2 worker"):
        schedule.build(name, 0, 2, 3)
    assert violation(name, 2, 1, 3) == "chunks: the table runs 2 micro-batch(es), not 3"
    assert violation(name, 3, 1, 2) == "stages: the table's schedule is for 2 worker(s), not 3"


@pytest.mark.parametrize(("p", "m", "v"), SHAPES)
def test_a_table_round_trips_through_csv(p, m, v):
    c = costs(random.Random(p * 100 + m * 10 + v), p, v)
    orders = [list(row) for row in measured.build(p, m, v, c.length(p)).orders]
    text = measured.write_csv(orders)
    assert text.splitlines()[0] == "worker,order,kind,micro_batch,chunk"
    assert len(text.splitlines()) == 1 + sum(map(len, orders))
    assert measured.read_csv(text) == orders
    assert measured.from_rows([list(r) for r in measured.rows(orders)]) == orders
    shuffled = [text.splitlines()[0], *random.Random(0).sample(text.splitlines()[1:], k=len(text.splitlines()) - 1)]
    assert measured.read_csv("\n".join(shuffled)) == orders  # rows in any order: each worker's by `order`


def test_torch_s_compute_only_csv_is_read_on_the_v():
    """torch.distributed.pipelining's _dump_csv: a row per rank, cells 'stage kind micro-batch' (I: a split
    backward's input part), the V's stages 0 and 3 on rank 0, 1 and 2 on rank 1."""
    zbv = [schedule.zbv(k, 2, 3, 2) for k in range(2)]
    torch_kind = {"F": "F", "B": "I", "W": "W"}
    cells = [[f"{model_chunk(measured.NAME, k, a.worker_chunk, 2)}{torch_kind[a.kind]}{a.micro_batch}"
              for a in row] for k, row in enumerate(zbv)]
    text = "\n".join(",".join(row[:3] + [""] + row[3:]) for row in cells)  # an idle cell too
    assert measured.read_csv(text) == zbv
    whole = "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    assert measured.read_csv(whole) == [[Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)],
                                        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]]


GOOD = ["worker,order,kind,micro_batch,chunk", "0,0,F,0,0", "0,1,F,1,0", "0,2,B,0,0", "0,3,B,1,0",
        "1,0,F,0,1", "1,1,B,0,1", "1,2,F,1,1", "1,3,B,1,1"]


def bad(row: int, line: str | None) -> str:
    """GOOD with its row `row` (1: the header) replaced by `line` (None: left out)."""
    rows = list(GOOD)
    if line is None:
        del rows[row - 1]
    else:
        rows[row - 1] = line
    return "\n".join(rows) + "\n"


@pytest.mark.parametrize(("text", "message"), [
    (bad(3, "0,1,X,1,0"), "row 3: kind 'X' is not F, B or W"),
    (bad(3, "0,1,F,one,0"), "row 3: worker, order, micro_batch and chunk are whole numbers"),
    (bad(3, "0,1,F,1"), "row 3: 4 field(s), not the 5 of worker,order,kind,micro_batch,chunk"),
    (bad(3, "0,1,F,0,0"), "row 3: a second F of micro-batch 0 on model chunk 0 (row 2 is the first)"),
    (bad(3, "0,4,F,1,0"), "row 5: B of micro-batch 1 on model chunk 0 comes before its F"),
    (bad(3, None), "row 4: micro-batch 1 is past the table's 1 (worker 0's forwards on its first model chunk)"),
    (bad(5, None).replace("0,2,B,0,0", "0,2,B,1,0"), "worker 0 has no B of micro-batch 0 on model chunk 0"),
    (bad(9, None), "worker 1 has no B of micro-batch 1 on model chunk 1"),
    (bad(3, "0,1,F,1,1"), "row 3: model chunk 1 is worker 1's"),
    (bad(3, "0,3,F,1,0"), "row 5: worker 0's order 3 is given twice (row 3 too)"),
    (bad(3, "0,1,F,7,0"), "row 3: micro-batch 7 is past the table's 2"),
    (bad(3, "0,1,F,1,5"), "2 worker(s) hold 2 model chunks (one each) or 4 (a V), not 6"),
    # worker 0 waits for micro-batch 0's gradient before forwarding micro-batch 1, which worker 1 forwards first
    ("\n".join([GOOD[0], "0,0,F,0,0", "0,1,B,0,0", "0,2,F,1,0", "0,3,B,1,0", *GOOD[5:6], "1,1,F,1,1", "1,2,B,0,1",
                "1,3,B,1,1"]),
     "row 3: waits for B of micro-batch 0 on model chunk 1 (worker 1), which waits in turn: the table deadlocks"),
    ("1F0,1B0\n0F0,0B0\n", "row 1, column 1: model chunk 1 is worker 1's"),
    ("0F0,0I0,0W0,0B1\n", "row 1, column 4: a whole backward (B) in a table that splits them"),
    ("0F0,0X0\n", "row 1, column 2: '0X0' is not a compute action of torch's CSV"),
    ("", "the file has no rows"),
    ("worker,order,kind,micro_batch,chunk\n", "the file has a header and no rows"),
])
def test_a_bad_csv_is_refused_in_one_line_naming_the_row(text, message):
    with pytest.raises(TableError) as e:
        measured.read_csv(text)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_a_table_is_bounded():
    rows = ["worker,order,kind,micro_batch,chunk"] + [f"0,{i},F,{i},0" for i in range(measured.MAX_ACTIONS + 1)]
    with pytest.raises(TableError, match=f"row {measured.MAX_ACTIONS + 2}: over the {measured.MAX_ACTIONS} actions"):
        measured.read_csv("\n".join(rows))
    with pytest.raises(TableError, match="over the 4 MiB"):
        measured.read_csv("x" * (measured.MAX_CSV_BYTES + 1))
    with pytest.raises(TableError, match="row 2: a number out of range"):
        measured.read_csv("\n".join(["worker,order,kind,micro_batch,chunk", "70,0,F,0,70"]))
