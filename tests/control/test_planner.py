"""gpipe.coordinator.plan.search in process, on a real plan with fake costs: the search, the step-time model, the balance it
picks, the memory filter and the refusal; and gpipe.memory.costs' lines."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gpipe import schedule
from gpipe.coordinator.plan import search as planner
from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.plan.search import Config, Link, Measured
from gpipe.coordinator.spec.job import parse_spec
from gpipe.errors import SpecError
from gpipe.memory.costs import Cost, LayerCosts
from gpipe.memory.costs_together import Collectives
from tests.support.spec import job_yaml

FREE = Link(0.0, float("inf"), 0.0)  # transfers and the engine's own time left out


@pytest.fixture
def free(monkeypatch):
    monkeypatch.setitem(planner.LINKS, "cpu", FREE)


def measured(tmp_path, f: list[float], b: list[float] | None = None, w: list[float] | None = None,
             bw: list[float] | None = None, step: float = 0.0, **changes) -> Measured:
    """A real plan of an MLP of len(f) layers (batch 16), with fake per-sample costs: F, B, W (and a plain
    backward's, BW: else B + W) seconds a sample; `step`: each layer's optimizer step, seconds."""
    depth = len(f) - 1  # tests.support's mlp: depth hidden layers and the output layer
    spec = parse_spec(job_yaml(model__args={"width": 8, "depth": depth}, data__batch_size=16,
                               data__args__n=64, stages=1, chunks=1, **changes))
    plan = make_plan(spec, tmp_path)
    assert len(plan.model) == len(f)
    b, w = b or f, w or f
    layers = [LayerCosts(Cost(0.0, fi), Cost(0.0, bi), Cost(0.0, wi), None if bw is None else Cost(0.0, bw[i]), step)
              for i, (fi, bi, wi) in enumerate(zip(f, b, w, strict=True))]
    out = [plan.footprint.line(lambda m, i=i: m.output_bytes(i + 1)) for i in range(len(plan.model))]
    params = [sum(p.numel() * 4 for p in layer.parameters()) for layer in plan.model]
    return Measured(plan, layers, out, params, "cpu", 0)


def test_a_cost_is_a_line_in_the_micro_batch_size_fitted_through_two_sizes():
    c = Cost.fit(2, 0.003, 10, 0.011)
    assert c.at(2) == pytest.approx(0.003) and c.at(10) == pytest.approx(0.011) and c.at(6) == pytest.approx(0.007)
    assert Cost.fit(4, 0.02, 4, 0.01).per_sample == 0.0  # one size (or times that fall): flat
    assert Cost(-1.0, 0.1).at(1) == 0.0


def test_one_stage_s_step_is_its_work_and_two_stages_with_a_bubble_take_more_than_half(tmp_path, free):
    m = measured(tmp_path, [1e-3] * 4)
    one = Config(1, 1, "gpipe", 1, 4, "never", False, (4,))
    step, bubble = planner.step_time(m, one, m.plan.spec)
    assert step == pytest.approx(16 * 4 * 3e-3) and bubble == pytest.approx(0.0, abs=1e-9)  # 16 samples x 4 layers
    two = Config(2, 1, "gpipe", 1, 4, "never", False, (2, 2))
    step2, bubble2 = planner.step_time(m, two, planner._spec_of(m.plan.spec, two))
    assert step / 2 < step2 < step and bubble2 > 0
    # Recomputing every micro-batch's forward costs one more forward of the work.
    again, _ = planner.step_time(m, dataclasses.replace(one, activation_checkpoint="always"), m.plan.spec)
    assert again == pytest.approx(16 * 4 * 4e-3)


def test_the_balance_is_by_measured_time_and_a_split_backward_shrinks_the_bubble(tmp_path, free):
    m = measured(tmp_path, [1e-3, 1e-3, 1e-3, 6e-3])  # the last layer as costly as the other three together
    c = Config(2, 1, "1f1b", 1, 8, "never", False)
    assert planner.balance_for(m, c, 2) == [3, 1]
    even = measured(tmp_path, [1e-3] * 4, w=[2e-3] * 4)
    base = Config(2, 1, "1f1b", 1, 8, "never", False, (2, 2))
    _, plain = planner.step_time(even, base, planner._spec_of(even.plan.spec, base))
    zb = dataclasses.replace(base, schedule="zb-h1")
    _, split = planner.step_time(even, zb, planner._spec_of(even.plan.spec, zb))
    assert split < plain


def test_transfers_and_the_per_action_cost_lengthen_the_step(tmp_path, free, monkeypatch):
    m = measured(tmp_path, [1e-3] * 4)
    c = Config(2, 1, "1f1b", 1, 4, "never", False, (2, 2))
    spec = planner._spec_of(m.plan.spec, c)
    quiet, _ = planner.step_time(m, c, spec)
    monkeypatch.setitem(planner.LINKS, "cpu", Link(1e-3, float("inf"), 0.0))
    sent, _ = planner.step_time(m, c, spec)
    monkeypatch.setitem(planner.LINKS, "cpu", Link(0.0, float("inf"), 1e-3))
    busy, _ = planner.step_time(m, c, spec)
    assert quiet < sent and quiet < busy


def test_a_plain_backward_takes_its_own_cost_and_a_split_one_b_and_w(tmp_path, free):
    # Fused linears make a plain backward cheaper than B + W of a split one (gpipe.memory.costs measures both).
    m = measured(tmp_path, [1e-3] * 4, b=[1e-3] * 4, w=[1e-3] * 4, bw=[1.5e-3] * 4)
    one = Config(1, 1, "gpipe", 1, 4, "never", False, (4,))
    step, _ = planner.step_time(m, one, m.plan.spec)
    assert step == pytest.approx(16 * 4 * 2.5e-3)  # F + BW a sample, not F + B + W
    c = Config(2, 1, "zb-h1", 1, 4, "never", False, (2, 2))
    split, _ = planner.step_time(m, c, planner._spec_of(m.plan.spec, c))
    assert split >= 16 * 2 * 3e-3  # each stage's F + B + W


def test_the_step_ends_with_the_measured_optimizer_step_and_the_replicas_all_reduce(tmp_path, free, monkeypatch):
    m = measured(tmp_path, [1e-3] * 4, step=2e-3, optimizer={"name": "adam", "lr": 0.01})
    one = Config(1, 1, "gpipe", 1, 4, "never", False, (4,))
    step, _ = planner.step_time(m, one, m.plan.spec)
    assert step == pytest.approx(16 * 4 * 3e-3 + 4 * 2e-3)  # the work, then the 4 layers' optimizer step
    two = Config(1, 2, "gpipe", 1, 4, "never", False, (4,))
    replicas, _ = planner.step_time(m, two, planner._spec_of(m.plan.spec, two))
    assert replicas == pytest.approx(8 * 4 * 3e-3 + 4 * 2e-3)  # half the batch each; all-reduce free here
    sharded = dataclasses.replace(two, shard=True)
    half, _ = planner.step_time(m, sharded, planner._spec_of(m.plan.spec, sharded))
    assert half == pytest.approx(8 * 4 * 3e-3 + 2 * 2e-3)  # each replica steps half the parameters
    # The all-reduce: on the CPU (gloo, on the worker's cores) all of it; on a GPU (NCCL, overlapping the last
    # backward) about its last bucket.
    link, bucket = Link(1e-3, 1e9, 0.0), planner.BUCKET_BYTES
    assert planner.all_reduce(link, "cpu", 0, 2) == 0.0
    assert planner.all_reduce(link, "cpu", 3 * bucket, 2) == pytest.approx(3e-3 + 3 * bucket / 1e9)
    assert planner.all_reduce(link, "cuda", 3 * bucket, 2) == pytest.approx(1e-3 + bucket / 1e9)
    monkeypatch.setitem(planner.LINKS, "cpu", link)
    reduced, _ = planner.step_time(m, two, planner._spec_of(m.plan.spec, two))
    assert reduced == pytest.approx(replicas + planner.all_reduce(link, "cpu", sum(m.param_bytes), 2))
    # Measured among the workers' processes (gpipe.memory.costs_together): each bucket at its measured time, the
    # gather in its rounds.
    timed = Collectives(2, Cost(1e-3, 1e-9), Cost(2e-3, 0.0), 5e-3)
    assert planner.all_reduce(link, "cpu", bucket + 10, 2, timed) == pytest.approx(5e-3 + 1e-3 + 10e-9)
    assert planner.all_reduce(link, "cpu", bucket, 4, timed) == pytest.approx((1e-3 + bucket * 1e-9) * 1.5)
    assert planner.gather(link, 3 * planner.GATHER_BYTES, 2, timed) == pytest.approx(3 * 2e-3)
    both, _ = planner.step_time(dataclasses.replace(m, collectives=timed), sharded,
                                planner._spec_of(m.plan.spec, sharded))
    nbytes = sum(m.param_bytes)
    assert both == pytest.approx(half + planner.all_reduce(link, "cpu", nbytes, 2, timed) +
                                 planner.gather(link, nbytes, 2, timed))


def test_the_search_ranks_what_fits_fastest_first_and_a_budget_leaves_out_the_rest(tmp_path, free):
    m = measured(tmp_path, [1e-3] * 4, optimizer={"name": "adam", "lr": 0.01})
    fits, over = planner.search(m, 2, 1 << 40)
    assert fits and not over
    assert [x.step_s for x in fits] == sorted(x.step_s for x in fits)
    shapes = {(x.config.stages, x.config.replicas) for x in fits}
    assert shapes == {(1, 1), (1, 2), (2, 1)}  # at most 2 workers
    # Every searched schedule, and measured built for the leading shapes (search.with_measured).
    assert {planner.shown(x.config.schedule) for x in fits} == set(schedule.searched()) | {"measured"}
    assert {"v-half", "v-min", "dualpipev"} <= set(schedule.searched())
    assert any(x.config.shard for x in fits) and all(x.config.replicas > 1 for x in fits if x.config.shard)
    assert all(sum(x.config.balance) == 4 and len(x.config.balance) == x.config.stages * x.config.virtual_stages
               for x in fits)
    # A budget between the smallest and the largest peak: exactly those above it are left out.
    peaks = sorted(x.peak for x in fits)
    budget = int(peaks[len(peaks) // 2] / planner.HEADROOM)
    kept, left = planner.search(m, 2, budget)
    limit = budget * planner.HEADROOM  # the prediction's margin
    assert kept and left and all(x.peak <= limit for x in kept) and all(x.peak > limit for x in left)
    fixed = [x for x in fits if x.built is None]  # measured is built for the leading shapes under each budget
    assert len([x for x in kept + left if x.built is None]) == len(fixed)
    assert [x.peak for x in left] == sorted(x.peak for x in left)  # the smallest first, for the refusal


def test_nothing_fits_is_one_line_with_the_smallest_peak_and_what_to_change(tmp_path, free):
    m = measured(tmp_path, [1e-3] * 4)
    fits, over = planner.search(m, 2, 1)
    assert not fits
    line = planner.refusal(over, 1)
    assert "\n" not in line and line.startswith("--memory-gib:")
    assert f"{over[0].peak / 2**30:.2f} GiB" in line and "more memory or workers" in line


def test_why_the_best_wins_names_the_runner_up_of_another_schedule(tmp_path, free):
    m = measured(tmp_path, [1e-3] * 4)
    fits, _ = planner.search(m, 2, 1 << 40)
    line = planner.why_best(fits, 1 << 40)
    other = next(x for x in fits if x.config.schedule != fits[0].config.schedule)
    assert line.startswith(f"{fits[0].config.schedule}:") and f"vs {other.config.schedule}'s" in line


def test_the_written_spec_is_the_job_with_the_configuration_and_reads_back(tmp_path):
    text = job_yaml(model__args={"width": 8, "depth": 3}, data__batch_size=16, optimizer={"name": "adam", "lr": 0.1})
    c = Config(2, 2, "zbv", 2, 4, "except_last", True, (1, 1, 1, 1))
    spec = parse_spec(planner.written(text, "job.yaml", c))
    assert (spec.stages, spec.replicas, spec.schedule, spec.virtual_stages, spec.chunks) == (2, 2, "zbv", 2, 4)
    assert spec.activation_checkpoint == "except_last" and spec.optimizer.shard and spec.balance == [1, 1, 1, 1]
    assert spec.optimizer.lr == 0.1 and spec.data.batch_size == 16  # the rest as it was


def test_a_spec_written_outside_the_job_s_folder_names_that_folder_as_its_working_dir(tmp_path):
    folder = tmp_path / "job"
    assert planner.working_dir_from(folder / "best.yaml", folder) is None  # beside the job: its own folder
    assert planner.working_dir_from(tmp_path / "plans" / "best.yaml", folder) == "../job"
    assert planner.working_dir_from(folder / "plans" / "best.yaml", folder) == ".."
    c = Config(1, 1, "gpipe", 1, 1, "never", False, (4,))
    text = job_yaml(working_dir="code")  # replaced: the folder it named, as the written file finds it
    spec = parse_spec(planner.written(text, "job.yaml", c, "../job/code"))
    assert spec.code_dir(tmp_path / "plans" / "best.yaml") == folder / "code"


def test_the_flags_out_of_range_are_one_line(tmp_path):
    class Args:
        workers, memory_gib, top, job, write, json = 0, 4.0, 10, "job.yaml", None, False

    spec = parse_spec(job_yaml())
    with pytest.raises(SpecError, match="--workers: 0"):
        planner.main(Args(), spec, job_yaml(), tmp_path)
    Args.workers, Args.memory_gib = 2, -1.0
    with pytest.raises(SpecError, match="--memory-gib"):
        planner.main(Args(), spec, job_yaml(), tmp_path)


def test_auto_values_are_listed_and_validate_meanwhile_and_split_points_are_refused():
    spec = parse_spec(job_yaml(schedule="auto", chunks="auto", activation_checkpoint="auto", stages=2))
    assert spec.auto == ["schedule", "chunks", "activation_checkpoint"]
    assert (spec.schedule, spec.chunks, spec.activation_checkpoint) == ("gpipe", 2, "never")  # meanwhile
    assert parse_spec(job_yaml()).auto == []
    with pytest.raises(SpecError, match="chunks: auto plans the cut too"):
        parse_spec(job_yaml(chunks="auto", model={"factory": "tests.support.models:gpt2",
                                                  "split_points": ["transformer.h.2"]}, stages=2))
    with pytest.raises(SpecError, match="auto: write `auto` as the value"):
        parse_spec(job_yaml(chunks="auto", auto=["chunks"]))


def test_resolve_chooses_only_the_auto_fields_and_a_recorded_choice_comes_back(tmp_path, free):
    spec = parse_spec(job_yaml(model__args={"width": 8, "depth": 3}, data__batch_size=16, data__args__n=64,
                               stages=2, replicas=1, chunks="auto", schedule="1f1b", balance=[3, 1]))
    resolved, record = planner.resolve(spec, tmp_path, 2, 1, 1 << 40)
    assert resolved.auto == [] and resolved.schedule == "1f1b" and resolved.balance == [3, 1]  # as given
    assert resolved.chunks in planner.chunk_choices(16, 1, 2) and record["chosen"] == {"chunks": resolved.chunks}
    assert record["predicted_step_s"] > 0 and record["fields"] == ["chunks"] and record["workers"] == 2
    again = planner.chosen(spec, json.loads(json.dumps(record)))  # as plan.json keeps it
    assert again == resolved
    with pytest.raises(SpecError, match="auto: no configuration fits"):
        planner.resolve(spec, tmp_path, 2, 1, 1)


def test_a_schedule_registered_in_one_place_is_searched_checked_and_placed(tmp_path, free, monkeypatch):
    """A new schedule is one record in gpipe.schedule.REGISTRY: `plan`'s search and `auto` take it, the option
    rules and the placement read it; nothing else is edited. Here a toy: 1f1b's actions under another name, on
    2 model chunks a worker in a V."""
    toy = schedule.Record("toy-v", lambda k, p, m, v: schedule.zbv(k, p, m, v), "toy-v: zbv under another name.",
                          model_chunks=(2,), v_shape=True, searched_with=2)
    monkeypatch.setitem(schedule.REGISTRY, "toy-v", toy)
    m = measured(tmp_path, [1e-3] * 4)
    fits, _ = planner.search(m, 2, 1 << 40)
    assert "toy-v" in {x.config.schedule for x in fits}
    assert all(x.config.virtual_stages == 2 for x in fits if x.config.schedule == "toy-v")
    from gpipe.options import violation
    from gpipe.topology import model_chunk, place

    assert violation("toy-v", 2, 1, 4) == "virtual_stages: toy-v holds 2 model chunks per worker (a V), not 1"
    assert violation("toy-v", 2, 2, 4) is None
    assert place("toy-v", 3, 2) == (0, 1) and model_chunk("toy-v", 0, 1, 2) == 3  # the V
    assert "toy-v" in schedule.reference()


def test_measured_is_searched_for_the_leading_shapes_and_never_slower_than_a_fixed_schedule_there(tmp_path, free):
    """plan's search and `schedule: auto` build `measured` for the shapes of the fastest candidates: each built
    order is at most as slow as the fastest fixed schedule of its shape, and it is written back as `measured`."""
    m = measured(tmp_path, [1e-3, 4e-3, 1e-3, 1e-3, 1e-3, 1e-3], w=[2e-4] * 6)  # an uneven stage, cheap W
    fits, _ = planner.search(m, 2, 1 << 40)
    built = [x for x in fits if x.built is not None]
    assert built and all(x.config.stages >= 2 for x in built)
    for x in built:  # its placement's fixed schedules (one model chunk a worker, or the V's), as searched
        c = x.config
        same = {y.config.schedule: y.step_s for y in fits if y.built is None and (
            y.config.stages, y.config.replicas, y.config.chunks, y.config.activation_checkpoint, y.config.shard,
            y.config.virtual_stages) == (c.stages, c.replicas, c.chunks, c.activation_checkpoint, c.shard,
                                         c.virtual_stages) and y.config.schedule in x.built.fixed}
        assert same and x.step_s <= min(same.values()) * 1.0001
        assert x.config.overrides()["schedule"] == "measured"
    assert any(x.config.virtual_stages == 1 for x in built)  # the fastest multi-stage shape: one chunk a worker


def test_a_budget_that_1f1b_exceeds_is_met_by_a_lighter_schedule(tmp_path, free):
    """Under a memory budget that 1f1b's prediction is over, the search keeps what fits below it: a schedule
    that holds fewer micro-batches (or checkpoints), never one predicted over it."""
    m = measured(tmp_path, [1e-3] * 8)
    fits, _ = planner.search(m, 4, 1 << 40)
    one = min(x.peak for x in fits if x.config.schedule == "1f1b" and x.config.stages == 4
              and x.config.activation_checkpoint == "never" and x.config.replicas == 1 and x.config.chunks == 8)
    budget = int(one * 0.97 / planner.HEADROOM)  # 1f1b at 4 stages, 8 chunks, no checkpointing: over
    kept, left = planner.search(m, 4, budget)
    assert kept and all(x.peak <= budget * planner.HEADROOM for x in kept)
    assert any(x.config.schedule == "1f1b" and x.config.stages == 4 and x.config.chunks == 8
               and x.config.activation_checkpoint == "never" and x.config.replicas == 1 for x in left)
