"""Schedules: the order of actions, no deadlock, in-flight bounds, and the bubble."""

from __future__ import annotations

import pytest

from gpipe.schedule import Action, build, simulate

STAGES = [1, 2, 3, 4, 8, 16, 64]
CHUNKS = [1, 2, 3, 7, 8, 64, 512]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_every_stage_runs_each_micro_batch_once_forward_before_backward(name):
    for p in STAGES:
        for m in CHUNKS:
            for k in range(p):
                actions = build(name, k, p, m)
                assert sorted(a for a in actions if a.kind == "F") == [Action("F", i) for i in range(m)]
                assert sorted(a for a in actions if a.kind == "B") == [Action("B", i) for i in range(m)]
                pos = {a: i for i, a in enumerate(actions)}
                assert all(pos[Action("F", i)] < pos[Action("B", i)] for i in range(m))
                # Forwards go in micro-batch order on every stage: the channels rely on it.
                assert [a.micro_batch for a in actions if a.kind == "F"] == list(range(m))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", CHUNKS)
def test_no_deadlock_and_the_bubble_is_ideal(name, p, m):
    sim = simulate(name, p, m)  # raises on a deadlock
    # With equal forward and backward times both schedules take 2(M+P-1) ticks.
    assert sim.ticks == 2 * (m + p - 1)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", CHUNKS)
def test_in_flight_bounds(p, m):
    assert simulate("gpipe", p, m).max_in_flight == [m] * p
    assert simulate("1f1b", p, m).max_in_flight == [min(p - k, m) for k in range(p)]


def test_simulate_detects_a_deadlock(monkeypatch):
    from gpipe import schedule

    # Backward before forward on the last stage can never run.
    monkeypatch.setitem(schedule.SCHEDULES, "broken", lambda k, p, m: [Action("B", 0), Action("F", 0)])
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate("broken", 2, 1)
