"""Elastic stages: placement on spare workers, re-planning onto fewer workers, growing back.

The decisions are checked in process (the supervisor with a fake clock and
scripted attempts, as in test_supervisor); the service end to end (serve and
gpipe-worker daemons, weights against one device) in the multiprocess tests
below.

In process; the runs through real processes are in tests/service/test_elastic.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from gpipe.coordinator.attempt import report
from gpipe.coordinator.plan import elastic
from gpipe.coordinator.spec.job import parse_spec
from gpipe.errors import SpecError
from gpipe.service.job_records import JobRecord, JobState, Join, StateChange
from gpipe.topology import Topology
from tests.support import reference
from tests.support.harness import Harness
from tests.support.spec import SERVICE, job


def spec_text(**kw: object) -> str:
    fields = {"stages": 3, "chunks": 2, "restart_timeout_s": 30} | kw
    return ("name: j\nmodel: {factory: mlp, args: {depth: 4}}\n"
            "data: {factory: random_regression, batch_size: 8}\noptimizer: {name: sgd, lr: 0.1}\nsteps: 4\n"
            + "".join(f"{k}: {v}\n" for k, v in fields.items()))


def test_shapes_drop_replicas_before_stages_and_keep_the_micro_batches():
    spec = parse_spec(spec_text(replicas=2, elastic="{min_stages: 2}"))
    assert list(elastic.shapes(spec)) == [Topology(3, 2), Topology(3, 1), Topology(2, 1)]
    assert elastic.shape_for(spec, 5) == Topology(3, 1) and elastic.shape_for(spec, 1) is None
    one = spec.reshaped(3, 1)
    assert (one.replicas, one.chunks) == (1, 4)
    assert elastic.micro_batch_sizes(8, 2, 2) == elastic.micro_batch_sizes(8, 1, 4) == [2, 2, 2, 2]
    # 10 samples cut 2 x 2 ([3, 2, 3, 2]) are not 1 x 4 ([3, 3, 2, 2]): that shape is passed over.
    odd = parse_spec(spec_text(replicas=2, elastic="{min_stages: 3}").replace("batch_size: 8", "batch_size: 10"))
    assert list(elastic.shapes(odd)) == [Topology(3, 2)]
    assert list(elastic.shapes(parse_spec(spec_text()))) == [Topology(3, 1)]  # not elastic: the spec's only


def test_shapes_keep_each_worker_s_model_chunks_and_interleaved_rounds():
    """With virtual_stages, every shape still holds V chunks a worker, placed by the schedule; interleaved-1f1b
    passes over a shape whose micro-batches per replica are not a multiple of its stages."""
    mlp = "model: {factory: mlp, args: {depth: 4}}"
    six = "model: {factory: mlp, args: {depth: 8}}"  # 9 layers: 3 stages x 2 chunks
    zbv = parse_spec(spec_text(replicas=2, schedule="zbv", virtual_stages=2, elastic="{min_stages: 2}",
                               balance=[2, 1, 1, 2, 1, 2]).replace(mlp, six))
    assert list(elastic.shapes(zbv)) == [Topology(3, 2, 2, "zbv"), Topology(3, 1, 2, "zbv"), Topology(2, 1, 2, "zbv")]
    assert elastic.shape_for(zbv, 2) == Topology(2, 1, 2, "zbv")
    assert zbv.reshaped(2, 1).topology == Topology(2, 1, 2, "zbv")
    assert zbv.reshaped(2, 1).balance == "by_params" and zbv.reshaped(3, 1).balance == [2, 1, 1, 2, 1, 2]
    # 2 replicas x 3 micro-batches: one replica runs 6, in rounds of 3 stages or of 2; 3 alone do not split in 2s
    interleaved = spec_text(replicas=2, chunks=3, schedule="interleaved-1f1b", virtual_stages=2,
                            elastic="{min_stages: 2}").replace(mlp, six).replace("batch_size: 8", "batch_size: 12")
    assert [(t.replicas, t.stages) for t in elastic.shapes(parse_spec(interleaved))] == [(2, 3), (1, 3), (1, 2)]
    alone = parse_spec(interleaved.replace("replicas: 2", "replicas: 1"))
    assert [(t.replicas, t.stages) for t in elastic.shapes(alone)] == [(1, 3)]


def test_fewer_replicas_train_the_same_micro_batches_to_the_same_weights():
    """The math of a re-plan: replicas 2 x chunks 2 on one device equals replicas 1 x chunks 4 bit for bit
    (dropout seeded by each micro-batch's index), and so does a 2-stage pipeline of that shape, to rounding;
    a batch that splits unevenly cuts other micro-batches, which is why shapes() passes that one over."""
    def as_dict(batch: int) -> dict[str, Any]:
        return job(SERVICE, name="math", model={"factory": "tests.support.models:mlp_dropout", "args": {"width": 16, "depth": 2}},
                   stages=2, balance=[3, 4], replicas=2, chunks=2, steps=3, elastic={"min_stages": 1},
                   data={"factory": "random_regression", "args": {"n": 40, "in_features": 16, "out_features": 16},
                         "batch_size": batch})

    spec = as_dict(8)
    one = parse_spec(yaml.safe_dump(spec)).reshaped(2, 1)
    assert (one.replicas, one.chunks) == (1, 4) and Topology(2, 1) in elastic.shapes(parse_spec(yaml.safe_dump(spec)))
    shrunk = {**spec, "replicas": 1, "chunks": 4}
    want = reference.train(spec)
    assert all(torch.equal(want[k], w) for k, w in reference.train(shrunk).items())
    piped = reference.train(shrunk, cuts=[3, 4], pipelined=True)
    assert max((want[k] - piped[k]).abs().max().item() for k in want) <= 1e-5
    odd = as_dict(10)
    assert list(elastic.shapes(parse_spec(yaml.safe_dump(odd)))) == [Topology(2, 2)]
    other = reference.train({**odd, "replicas": 1, "chunks": 4})
    assert not all(torch.equal(v, other[k]) for k, v in reference.train(odd).items())


def test_an_explicit_balance_that_no_longer_fits_becomes_by_params():
    spec = parse_spec(spec_text(balance="[2, 1, 1]", elastic="{min_stages: 1}"))
    assert spec.reshaped(2, 1).balance == "by_params" and spec.reshaped(3, 1).balance == [2, 1, 1]


@pytest.mark.parametrize("bad, field", [("{min_stages: 4}", "elastic.min_stages"), ("{min_stages: 0}", "min_stages"),
                                        ("{min_stage: 1}", "min_stage"), ("{}", "min_stages")])
def test_a_bad_elastic_section_is_one_line_naming_the_field(bad, field):
    with pytest.raises(SpecError) as e:
        parse_spec(spec_text(elastic=bad))
    assert field in str(e.value) and "\n" not in str(e.value).strip()


async def lose_rank_1(h: Harness, **kw: object) -> JobRecord:
    """A 3-stage job running on ranks 0-2, then rank 1's worker gone: RESTARTING."""
    text = spec_text(**kw)
    job = JobRecord(name="j", spec_yaml=text, steps=4, output_dir="/nonexistent/j")
    h.sup.add(job, parse_spec(text), Path("job.yaml"), Path("."))
    await h.settle()
    assert h.attempts[-1].launch.topology is None
    h.sup.drop(h.workers[1], "stage 1's worker disconnected")
    await h.settle()
    assert job.state == JobState.RESTARTING
    return job


async def test_a_spare_worker_takes_a_lost_rank_s_slot(h):
    h.register(0, 1, 2, 3)
    job = await lose_rank_1(h)
    h.clock.advance(1)
    h.beat(0, 2, 3)  # heard from since the failure
    await h.settle()
    assert len(h.attempts) == 2 and h.attempts[-1].launch.topology is None
    h.attempts[-1].queue.put_nowait(report.Master("127.0.0.1:1", "secret"))
    await h.settle()
    join = [c for c in h.commands(3) if isinstance(c, Join)][-1]
    assert (join.rank, join.world) == (1, 3)  # rank 3 serves stage 1
    assert "on ranks [0, 3, 2]" in job.history[-1].message


async def test_a_rank_lost_past_restart_timeout_re_plans_onto_fewer_stages_and_grows_back(h):
    h.register(0, 1, 2)
    job = await lose_rank_1(h, elastic="{min_stages: 2}")
    assert len(h.attempts) == 1  # no spare: it waits for rank 1
    h.clock.advance(31)
    h.beat(0, 2)
    h.sup.tick()
    await h.settle()
    replan = next(c.message for c in job.history if "stage count" in c.message)
    assert replan.startswith("stage count 3 -> 2: rank 1 lost for 31 s, no spare worker"), replan
    assert job.state == JobState.RUNNING and h.attempts[-1].launch.topology == Topology(2, 1)
    assert "2 stages of the spec's 3 stages" in job.history[-1].message and job.restarts == 1
    h.attempts[-1].queue.put_nowait(report.Master("127.0.0.1:1", "secret"))
    await h.settle()
    assert [c.rank for c in h.commands(2) if isinstance(c, Join)] == [1]  # rank 2 serves stage 1 of 2

    # Rank 1 is back; at the next checkpoint the attempt ends and the job runs on 3 stages again.
    h.register(1)
    h.attempts[-1].queue.put_nowait(report.Checkpoint(2, "/nonexistent", 1, 0.0, 0.0))
    await h.settle()
    assert h.attempts[-2].killed and h.attempts[-1].launch.topology is None
    grow = next(c.message for c in job.history if "stage count 2 -> 3" in c.message)
    assert "enough workers are back" in grow and job.restarts == 1  # growing back is no failure
    assert job.state == JobState.RUNNING and job.checkpoint_step == 2


async def test_a_restarted_serve_s_job_whose_rank_stays_away_is_re_planned_naming_it(h):
    text = spec_text(elastic="{min_stages: 1}")
    job = JobRecord(name="j", spec_yaml=text, steps=4, output_dir="/nonexistent/j")
    job.history.append(StateChange(JobState.RUNNING, h.clock.time(), "attempt 1"))
    job.state = JobState.RUNNING
    h.sup.add(job, parse_spec(text), Path("job.yaml"), Path("."))  # as a restarted serve reads it back
    h.register(0, 2)
    h.clock.advance(31)
    h.beat(0, 2)
    h.sup.tick()
    await h.settle()
    replan = next(c.message for c in job.history if "stage count" in c.message)
    assert replan.startswith("stage count 3 -> 2: rank 1 lost for 31 s"), replan
    assert job.state == JobState.RUNNING and h.attempts[-1].launch.topology == Topology(2, 1)


async def test_not_elastic_or_below_min_stages_still_fails(h):
    h.register(0, 1, 2)
    job = await lose_rank_1(h, elastic="{min_stages: 3}")
    h.clock.advance(31)
    h.beat(0, 2)
    h.sup.tick()
    assert job.state == JobState.FAILED and "rank(s) 1 did not come back" in job.history[-1].message




async def test_growing_back_never_takes_a_worker_the_round_gave_another_job(h):
    """A shrunk job restarts (and would grow back) in the same round as another waiting job starts: the pool
    gives the idle rank 1 to the other job, so growing takes only what the round left free. Before the fix it
    grew onto rank 1 too: one worker in two attempts, and the other attempt waited for a rank that never
    joined."""
    h.register(0, 1, 2)
    job = await lose_rank_1(h, elastic="{min_stages: 2}")
    h.clock.advance(31)
    h.beat(0, 2)
    h.sup.tick()
    await h.settle()
    assert h.attempts[-1].launch.topology == Topology(2, 1)  # running on ranks 0 and 2
    other = h.submit("other", stages=1)
    h.sup.jobs["other"].failed_at = h.clock.monotonic() + 1000  # no worker is one it may take, for now
    h.register(1)  # back: `j` will want it to grow, `other` cannot have it yet
    await h.settle()
    assert other.state != JobState.RUNNING
    h.attempts[-1].end(1, report.Failed("boom", 1, None, rank=0, stage=0, replica=0, step=1, error_type="OSError"))
    await h.settle()
    assert job.state == JobState.RESTARTING and h.attempts[-1].code.done()
    # In one round both wait: `j` on its shrunk shape (and grows where it can), `other` now able to take rank 1.
    h.clock.advance(120)
    h.beat(0, 1, 2)
    h.sup.jobs["other"].failed_at = 0.0
    await h.settle()
    running = [[p.rank for p in a.launch.placement] for a in h.attempts if not a.code.done()]
    ranks = [r for placed in running for r in placed]
    assert len(ranks) == len(set(ranks)), f"a worker in two attempts: {running}"
    assert other.state == JobState.RUNNING and job.state == JobState.RUNNING
