"""Schedules: the order of actions, no deadlock, in-flight bounds, and the bubble."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, get_args

import pytest

from gpipe.schedule import (
    REGISTRY,
    Action,
    Name,
    build,
    cost,
    simulate,
    splits_backward,
    steady,
    timing,
)
from gpipe.topology import model_chunk, place
from tests.support.spec import job, regression

STAGES = [1, 2, 3, 4, 8, 16, 64]


def test_the_names_the_spec_takes_are_the_schedule_records():
    """JobSpec.schedule is schedule.Name; its values are the registered records, in order."""
    assert list(get_args(Name)) == list(REGISTRY)

CHUNKS = [1, 2, 3, 7, 8, 64, 512]
NAMES = ["gpipe", "1f1b", "zb-h1"]
V_SHAPED = ["zbv", "v-half", "v-min", "dualpipev"]  # worker k holds model chunks k and 2P-1-k
SEVERAL = ["interleaved-1f1b", *V_SHAPED]  # 2 model chunks a worker


@pytest.mark.parametrize("name", NAMES)
def test_every_stage_runs_each_micro_batch_once_forward_before_backward(name):
    for p in STAGES:
        for m in CHUNKS:
            for k in range(p):
                actions = build(name, k, p, m)
                kinds = ["F", "B", "W"] if name == "zb-h1" else ["F", "B"]
                for kind in kinds:
                    assert sorted(a for a in actions if a.kind == kind) == [Action(kind, i) for i in range(m)]
                assert len(actions) == len(kinds) * m
                pos = {a: i for i, a in enumerate(actions)}
                assert all(pos[Action("F", i)] < pos[Action("B", i)] for i in range(m))
                if name == "zb-h1":
                    assert all(pos[Action("B", i)] < pos[Action("W", i)] for i in range(m))
                # Forwards go in micro-batch order on every stage: the channels rely on it.
                assert [a.micro_batch for a in actions if a.kind == "F"] == list(range(m))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", CHUNKS)
def test_no_deadlock_and_the_bubble_is_ideal(name, p, m):
    sim = simulate(name, p, m)  # raises on a deadlock
    # A forward takes a tick and a backward two: both schedules take 3(M+P-1) ticks.
    assert sim.ticks == 3 * (m + p - 1)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", CHUNKS)
def test_zb_h1_cuts_the_bubble_to_about_a_third(p, m):
    sim = simulate("zb-h1", p, m)
    # F, B and W a tick each; with M >= P only the warm-up's P-1 ticks are idle on each stage.
    assert sim.ticks == max(3 * m + p - 1, 2 * (m + p) - 1)
    if m >= p:
        assert sim.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert sim.bubble_fraction <= simulate("1f1b", p, m).bubble_fraction


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", CHUNKS)
def test_in_flight_bounds(p, m):
    assert simulate("gpipe", p, m).max_in_flight == [m] * p
    assert simulate("1f1b", p, m).max_in_flight == [min(p - k, m) for k in range(p)]
    # zb-h1 holds a micro-batch until its W: at most P on every stage, 1f1b's most.
    assert simulate("zb-h1", p, m).max_in_flight == [min(p, m)] * p


def test_the_table_of_zb_h1():
    sim = simulate("zb-h1", 2, 3)
    row = [[str(a) if a else "." for a in r] for r in sim.timeline]
    assert row == [["F0", "F1", ".", "B0", "W0", "F2", "B1", "W1", "B2", "W2"],
                   [".", "F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "W2"]]


def test_simulate_detects_a_deadlock(monkeypatch):
    from gpipe import schedule

    # Backward before forward on the last stage can never run.
    monkeypatch.setitem(schedule.REGISTRY, "broken", schedule.Record(
        "broken", lambda k, p, m, v: [Action("B", 0), Action("F", 0)], "broken: never runs.", searched_with=None))
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate("broken", 2, 1)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rounds", [1, 2, 3, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_1f1b_runs_each_chunk_once_and_divides_the_bubble(p, rounds, v):
    m = rounds * p
    for k in range(p):
        actions = build("interleaved-1f1b", k, p, m, v)
        for kind in "FB":
            assert sorted(a for a in actions if a.kind == kind) == \
                sorted(Action(kind, i, c) for i in range(m) for c in range(v))
        pos = {a: n for n, a in enumerate(actions)}
        assert all(pos[Action("F", i, c)] < pos[Action("B", i, c)] for i in range(m) for c in range(v))
        # Each chunk's forwards go in micro-batch order: the lanes rely on it.
        assert all([a.micro_batch for a in actions if a.kind == "F" and a.worker_chunk == c] == list(range(m))
                   for c in range(v))
    sim = simulate("interleaved-1f1b", p, m, v)
    # A chunk's F a tick, its B two: the bubble is 1f1b's divided by about the chunks per worker.
    assert sim.ticks == 3 * (m * v + p - 1)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m * v + p - 1))


def test_interleaved_1f1b_with_one_chunk_is_1f1b():
    assert all(build("interleaved-1f1b", k, 4, 8, 1) == build("1f1b", k, 4, 8) for k in range(4))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16, 64])
def test_zbv_runs_each_chunk_once_in_a_v_and_all_but_removes_the_bubble(p, m):
    for k in range(p):
        actions = build("zbv", k, p, m, 2)
        for kind in "FBW":
            assert sorted(a for a in actions if a.kind == kind) == \
                sorted(Action(kind, i, c) for i in range(m) for c in range(2))
        pos = {a: n for n, a in enumerate(actions)}
        assert all(pos[Action("F", i, c)] < pos[Action("B", i, c)] < pos[Action("W", i, c)]
                   for i in range(m) for c in range(2))
        assert all([a.micro_batch for a in actions if a.kind == "F" and a.worker_chunk == c] == list(range(m))
                   for c in range(2))
        # The V: worker k's chunks are the model's k and 2P-1-k.
        assert [model_chunk("zbv", k, c, p) for c in (0, 1)] == [k, 2 * p - 1 - k]
        assert place("zbv", 2 * p - 1 - k, p) == (k, 1)
    sim = simulate("zbv", p, m, 2)  # raises on a deadlock
    if m >= 2 * p - 1:
        # F, B and W of a half-stage chunk a tick each: P-1 idle ticks of 6M+P-1 (1f1b's are 3(P-1) of 3(M+P-1)).
        assert sim.ticks == 6 * m + p - 1
        assert sim.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
        # At most 2P chunks' micro-batches in flight: P stages' worth, what 1f1b's stage 0 holds.
        assert sim.max_in_flight == [2 * p] * p
    assert sim.bubble_fraction <= simulate("1f1b", p, m).bubble_fraction


@pytest.mark.parametrize(("name", "virtual"), [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zbv", 2),
                                              ("v-half", 2), ("v-min", 2), ("dualpipev", 2)])
def test_timing_at_the_tick_costs_is_the_simulators_timeline(name, virtual):
    sim = simulate(name, 2, 4, virtual)
    split = splits_backward(build(name, 0, 2, 4, virtual))
    runs = timing(name, 2, 4, virtual, lambda k, a: cost(a.kind, split))
    assert max(end for row in runs for *_, end in row) == sim.ticks
    for k, row in enumerate(runs):
        assert [sim.timeline[k][int(start)] for _, start, _ in row] == [a for a, _, _ in row]


def test_zb_h1_takes_the_least_step_a_bottleneck_stage_allows():
    """bench/README (n): at 2 stages of 4 Linear layers, stage 0 computes no input gradient for its first layer (11
    matmuls a micro-batch: F 4, W 7, an empty B) and stage 1 12 (F 4, B 4, W 4); a step can be no shorter than
    stage 1's 12M after stage 0's first forward, and zb-h1's is that; 1f1b's waits longer in the drain."""
    zb = {(0, "F"): 4, (0, "B"): 0, (0, "W"): 7, (1, "F"): 4, (1, "B"): 4, (1, "W"): 4}
    whole = {(0, "F"): 4, (0, "B"): 7, (1, "F"): 4, (1, "B"): 8}
    for m in (4, 8):
        end = max(e for row in timing("zb-h1", 2, m, 1, lambda k, a: zb[k, a.kind]) for *_, e in row)
        assert end == 12 * m + 4
        end = max(e for row in timing("1f1b", 2, m, 1, lambda k, a: whole[k, a.kind]) for *_, e in row)
        assert end == 12 * m + 4 + 7  # stage 0's last backward after stage 1's


def test_step_after_step_the_bottleneck_stage_waits_only_for_the_first_stage_s_turnaround():
    """As the service runs steps (steady): stage 0 starts the next step once its own is done, so stage 1 waits
    at a step's start only for what stage 0 has left after stage 1's last B (the last W, then the next first
    forward) beyond the W's stage 1 has left itself. zb-h1: 7 + 4 after B, less stage 1's last 2 W's (8): 3 idle.
    1f1b: stage 0's whole last backward and the next forward, 11, with nothing left on stage 1."""
    zb = {(0, "F"): 4, (0, "B"): 0, (0, "W"): 7, (1, "F"): 4, (1, "B"): 4, (1, "W"): 4}
    whole = {(0, "F"): 4, (0, "B"): 7, (1, "F"): 4, (1, "B"): 8}
    for m in (4, 8):
        period, bubble = steady("zb-h1", 2, m, 1, lambda k, a: zb[k, a.kind])
        assert period == 12 * m + 3
        assert bubble == pytest.approx(1 - 23 * m / (2 * period))
        period, _ = steady("1f1b", 2, m, 1, lambda k, a: whole[k, a.kind])
        assert period == 12 * m + 11


@pytest.mark.parametrize(("name", "virtual"), [(n, 1) for n in NAMES] + [(n, 2) for n in SEVERAL])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_steps_in_a_row_take_no_longer_than_one_alone_and_no_less_than_the_busiest_worker(name, virtual, p):
    for m in (p, 2 * p if name == "interleaved-1f1b" else 2 * p + 1):  # interleaved: whole rounds
        if m < REGISTRY[name].min_rounds * p:  # dualpipev: 2P or more
            continue
        def length(k: int, a: Action) -> float:  # uneven stages: the last one the slowest
            return (1.0 + 0.25 * k) * (1 if a.kind != "B" or name not in ("gpipe", "1f1b", "interleaved-1f1b") else 2)
        runs = timing(name, p, m, virtual, length)
        alone = max(e for row in runs for *_, e in row)
        busiest = max(sum(e - s for _, s, e in row) for row in runs)
        period, bubble = steady(name, p, m, virtual, length)
        assert busiest - 1e-9 <= period <= alone + 1e-9, (m, busiest, period, alone)
        assert 0 <= bubble < 1


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zbv_step_after_step_leaves_no_bubble_at_the_tick_costs(p):
    """A step of zbv starts and ends on worker 0 (the V), so the next step's fill overlaps this one's drain:
    steps in a row keep every worker busy, where one step alone idles (P-1) half-ticks of 6M+P-1."""
    for m in (2 * p - 1, 2 * p, 3 * p + 1):
        split = [splits_backward(build("zbv", k, p, m, 2)) for k in range(p)]
        period, bubble = steady("zbv", p, m, 2, lambda k, a, split=split: cost(a.kind, split[k]))
        assert (period, bubble) == (6 * m, 0.0), (m, period)
        assert simulate("zbv", p, m, 2).bubble_fraction > 0


@pytest.mark.parametrize(("name", "virtual"), [(n, 1) for n in NAMES] + [(n, 2) for n in SEVERAL])
def test_workers_that_wait_for_one_another_at_each_step_s_end_overlap_no_further(name, virtual):
    """Clipping or fp16's overflow check (every worker waits): each step as long as one alone. A tied weight's
    holders (the first and last worker): between that and no wait at all."""
    p, m = 3, 6
    def length(k: int, a: Action) -> float:  # uneven stages, micro-batch 0 the slowest
        return (1.0 + 0.5 * k) * (2 if a.micro_batch == 0 else 1)
    alone = max(e for row in timing(name, p, m, virtual, length) for *_, e in row)
    free, _ = steady(name, p, m, virtual, length)
    tied, _ = steady(name, p, m, virtual, length, waits=[{0, p - 1}])
    every, bubble = steady(name, p, m, virtual, length, waits=[set(range(p))])
    assert every == pytest.approx(alone)
    assert free - 1e-9 <= tied <= every + 1e-9
    busy = sum(length(k, a) for k in range(p) for a in build(name, k, p, m, virtual))
    assert bubble == pytest.approx(1 - busy / (p * alone))


def test_plan_json_knows_which_workers_wait_for_one_another_at_a_step_s_end():
    """gpipe.coordinator.plan.job.step_waits: every worker under clipping or fp16; a tied weight's holders when they are
    different workers; none for a weight tied within one worker (zbv's first and last model chunks, worker 0's:
    its gradient is summed in memory)."""
    from gpipe.coordinator.attempt.metrics import schedule_plan
    from gpipe.coordinator.plan.job import step_waits
    from gpipe.coordinator.spec.job import JobSpec

    def spec(schedule: str, stages: int, **kw: Any) -> JobSpec:
        virtual = 2 if schedule in ("zbv", "interleaved-1f1b") else 1
        return JobSpec.model_validate(job(
            name="w", model={"factory": "mlp", "args": {"width": 4, "depth": 2 * stages * virtual}}, stages=stages,
            chunks=2 * stages, schedule=schedule, virtual_stages=virtual, data=regression(8, 4, 8), steps=1, **kw))

    assert step_waits(spec("1f1b", 3, clip_grad_norm=1.0), []) == [{0, 1, 2}]
    assert step_waits(spec("zb-h1", 3, precision="fp16"), [[0, 2]]) == [{0, 1, 2}]
    assert step_waits(spec("1f1b", 3), [[0, 2]]) == [{0, 2}]
    assert step_waits(spec("zbv", 2), [[0, 3]]) == []  # model chunks 0 and 3: both on worker 0
    assert step_waits(spec("interleaved-1f1b", 2), [[0, 3]]) == [{0, 1}]  # chunk 3 is worker 1's
    free = schedule_plan("zbv", 2, 4, 2)["steady_bubble_fraction"]
    assert free == 0 < schedule_plan("zbv", 2, 4, 2, [{0, 1}])["steady_bubble_fraction"]


def _v_schedule_cases() -> list[tuple[str, int, int]]:
    cases = []
    for name in ("v-half", "v-min", "dualpipev"):
        for p in (1, 2, 3, 4, 5, 6, 8):
            for m in (1, 2, 3, 5, 8, 13, 16, 24):
                if m >= REGISTRY[name].min_rounds * p:
                    cases.append((name, p, m))
    return cases


@pytest.mark.parametrize(("name", "p", "m"), _v_schedule_cases())
def test_the_other_v_schedules_run_each_chunk_once_in_the_v_without_deadlock(name, p, m):
    """v-half, v-min and dualpipev: on every worker F, B and W of each micro-batch on each of its two model chunks
    exactly once, F before B before W, each model chunk's forwards and backwards in micro-batch order, worker k
    holding model chunks k and 2P-1-k; and the simulator runs them to the end (it raises on a deadlock: each
    action waits for the one before it in the V, a B for the next model chunk's, a W for its own B)."""
    for k in range(p):
        actions = build(name, k, p, m, 2)
        for kind in "FBW":
            assert sorted(a for a in actions if a.kind == kind) == \
                sorted(Action(kind, i, c) for i in range(m) for c in range(2))
        assert len(actions) == 6 * m
        pos = {a: n for n, a in enumerate(actions)}
        assert all(pos[Action("F", i, c)] < pos[Action("B", i, c)] < pos[Action("W", i, c)]
                   for i in range(m) for c in range(2))
        for c in range(2):  # the lanes rely on the forwards' order; the backwards keep it too
            for kind in "FB":
                assert [a.micro_batch for a in actions if a.kind == kind and a.worker_chunk == c] == list(range(m))
        assert [model_chunk(name, k, c, p) for c in (0, 1)] == [k, 2 * p - 1 - k]
        # Within the worker: model chunk 2P-1-k's forward after model chunk k's on the V's bottom worker; its B
        # first on worker 0 (the last model chunk), model chunk k's B after it on the bottom worker.
        if k == p - 1:
            assert all(pos[Action("F", i, 0)] < pos[Action("F", i, 1)] for i in range(m))
            assert all(pos[Action("B", i, 1)] < pos[Action("B", i, 0)] for i in range(m))
    sim = simulate(name, p, m, 2)  # raises on a deadlock
    assert sim.ticks >= 6 * m and sim.bubble_fraction < 1


def _stages_worth(name: str, p: int, m: int) -> float:
    """The most activations any worker holds, in stages' worth of one micro-batch (a V's model chunk: half)."""
    held = simulate(name, p, m, 2 if name in V_SHAPED else 1).max_in_flight
    return max(held) / (2 if name in V_SHAPED else 1)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 8, 12, 16])
@pytest.mark.parametrize("m", [1, 4, 8, 24])
def test_v_half_and_v_min_hold_the_papers_bounds(p, m):
    """Pipeline Parallelism with Controllable Memory (arXiv 2405.15362): V-Half holds (P+2)//2 stages' worth of a
    micro-batch's activations at most, V-Min (P+4)//3, against 1f1b's P (on its stage 0): about a half and a
    third of 1f1b's once P is large. The reordering of the warm-up and the drain never goes past the repeated
    blocks' peak."""
    assert _stages_worth("v-half", p, m) <= (p + 2) // 2
    assert _stages_worth("v-min", p, m) <= (p + 4) // 3
    if m >= p:
        one = _stages_worth("1f1b", p, m)
        assert one == p
        assert _stages_worth("v-half", p, m) <= one / 2 + 1
        assert _stages_worth("v-min", p, m) <= one / 3 + 4 / 3


@pytest.mark.parametrize("p", [2, 4])
def test_v_half_and_v_min_at_8_micro_batches_against_1f1b_and_zbv(p):
    """At 8 micro-batches (the table in docs/schedules.md): the activation peak (stages' worth) and the bubble.
    On 2 workers both hold what 1f1b and zbv hold, 2 stages' worth ((P+2)//2 = (P+4)//3 = P there); on 4 workers
    v-half holds 3/4 of 1f1b's, v-min half. (Worker 0 holds a micro-batch's first model chunk from its F to its W,
    4P+1 passes of the V at least, and its last model chunk for 3, at zbv's pace of a micro-batch every 6 passes:
    no order of the V holds less than (4P+4)/6 model chunks on average there at that pace, so at least 2 stages'
    worth at its peak on 4 workers.)"""
    peaks = {n: _stages_worth(n, p, 8) for n in ("1f1b", "zbv", "v-half", "v-min", "dualpipev")}
    bubbles = {n: simulate(n, p, 8, 1 if n == "1f1b" else 2).bubble_fraction
               for n in ("1f1b", "zbv", "v-half", "v-min", "dualpipev")}
    assert peaks == {2: {"1f1b": 2, "zbv": 2, "v-half": 2, "v-min": 2, "dualpipev": 2.5},
                     4: {"1f1b": 4, "zbv": 4, "v-half": 3, "v-min": 2, "dualpipev": 4.5}}[p]
    assert bubbles["zbv"] <= bubbles["v-half"] <= bubbles["v-min"] < bubbles["1f1b"]
    assert bubbles["dualpipev"] == pytest.approx(bubbles["zbv"])


@pytest.mark.parametrize("p", range(1, 65))
def test_the_v_building_blocks_give_each_pass_a_slot_of_its_own(p):
    """A worker's four passes of a micro-batch (F and B on each model chunk) fall on different slots of the 6 the
    block repeats over (the W's take the other two), and each comes after what it waits for."""
    from gpipe.vshape import PERIOD, block

    for memory in ("half", "min"):
        blocks = [block(memory, p, k) for k in range(p)]
        for k, b in enumerate(blocks):
            assert len({t % PERIOD for t in b.values()}) == 4, (memory, k)
            assert b[("F", 0)] > (blocks[k - 1][("F", 0)] if k else -1)
            assert b[("F", 1)] > (blocks[k + 1][("F", 1)] if k < p - 1 else b[("F", 0)])
            assert b[("B", 1)] > (blocks[k - 1][("B", 1)] if k else b[("F", 1)])
            assert b[("B", 0)] > (blocks[k + 1][("B", 0)] if k < p - 1 else b[("B", 1)])


def test_dualpipev_is_torchs_order_with_each_pair_run_forward_first():
    """torch.distributed.pipelining's ScheduleDualPipeV, action for action: an overlapped pair as its forward then
    its backward, a whole backward as B then its W."""
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(sched, "ScheduleDualPipeV", None)
    if cls is None:
        pytest.skip("this torch has no ScheduleDualPipeV")

    def theirs(p: int, m: int, k: int) -> list[Action]:
        out: list[Action] = []

        def one(a: Any) -> None:
            c, mb, kind = 0 if a.stage_index == k else 1, a.microbatch_index, a.computation_type
            if kind == sched.FORWARD:
                out.append(Action("F", mb, c))
            elif kind == sched.FULL_BACKWARD:
                out.extend([Action("B", mb, c), Action("W", mb, c)])
            elif kind == sched.BACKWARD_INPUT:
                out.append(Action("B", mb, c))
            else:
                assert kind == sched.BACKWARD_WEIGHT
                out.append(Action("W", mb, c))

        fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m)  # all its order reads
        for a in cls._calculate_single_rank_operations(fake, k):
            if a is not None:
                for sub in (a.sub_actions if a.computation_type == sched.OVERLAP_F_B else (a,)):
                    one(sub)
        return out

    for p in (1, 2, 3, 4, 5, 8):
        for m in sorted({2 * p, 2 * p + 1, 3 * p, 16}):
            for k in range(p):
                assert build("dualpipev", k, p, m, 2) == theirs(p, m, k), (p, m, k)


def test_dualpipev_takes_two_rounds_of_micro_batches():
    from gpipe.options import violation

    assert violation("dualpipev", 3, 2, 6) is None
    assert violation("dualpipev", 3, 2, 5) == \
        "chunks: dualpipev takes at least 2 rounds of the 3 workers' micro-batches: 6 or more, not 5"
    assert violation("v-half", 3, 2, 1) is None and violation("v-min", 3, 2, 1) is None
    assert violation("v-min", 3, 1, 4).startswith("virtual_stages: v-min holds 2 model chunks per worker (a V)")
    with pytest.raises(ValueError, match="^chunks: dualpipev"):
        build("dualpipev", 0, 3, 5, 2)
