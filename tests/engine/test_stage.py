"""One Stage in this process, a world of one: the step equals one device, and a snapshot resumes bit for bit."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

from gpipe.contract import Cause, StageError
from gpipe.coordinator.plan.configs import stage_config
from gpipe.service import net
from gpipe.state import StageState
from gpipe.topology import Slots, Topology
from gpipe.worker.stage_server import StageServer
from tests.support import reference
from tests.support.local import attempt_secret, built, plan_of, run, weights_of  # noqa: F401  # attempt_secret: autouse
from tests.support.spec import ONE_STAGE, job


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpointing", ["never", "always", "except_last"])
def test_a_stage_trains_as_one_device(schedule, checkpointing):
    spec = job(ONE_STAGE, schedule=schedule, activation_checkpoint=checkpointing)
    plan = plan_of(spec)
    with built(plan, plan.stage_state(0)) as stage:
        losses = run(stage, plan, range(spec["steps"]))
        got = weights_of(stage)
    want = reference.train(spec)
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-6, f"weights differ from one device by {worst}"
    assert all(loss > 0 for loss in losses)


@pytest.mark.parametrize("optimizer", [{"name": "adamw", "lr": 0.01}, {"name": "sgd", "lr": 0.1, "momentum": 0.9}])
def test_a_snapshot_restored_into_a_fresh_stage_takes_the_same_next_step(optimizer):
    plan = plan_of(job(ONE_STAGE, optimizer=optimizer))
    with built(plan, plan.stage_state(0)) as stage:
        run(stage, plan, range(2))
        snap = stage.snapshot()
        [loss] = run(stage, plan, range(2, 3))
        want = weights_of(stage)
    assert snap.optim_tensors_for({"0"}), "the optimizer's state is in the snapshot"
    assert set(snap.json_state["params"]) == set(want)  # mlp_dropout has parameters only

    # What the coordinator hands a resumed stage: the weights, and the rest of the state.
    rest = StageState({k: v for k, v in snap.tensors.items() if not k.startswith("model/")}, snap.json_state)
    with built(plan, snap.model_state(), rest) as fresh:
        [loss_again] = run(fresh, plan, range(2, 3))
        got = weights_of(fresh)
    assert loss_again == loss
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_stage_that_cannot_be_built_says_so_in_one_line():
    # What the coordinator creates remotely: a build error is kept, and answered in one line.
    plan = plan_of(job(ONE_STAGE))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cfg = asdict(stage_config(plan, 0, 0, "cpu", "127.0.0.1", store.port))
    server = StageServer({**cfg, "model_factory": "tests.support.models:no_such_model"}, plan.stage_state(0))
    try:
        error = server.built()
        assert isinstance(error, StageError) and error.cause == Cause.IMPORT and error.stage == 0
        assert "no_such_model" in error.line() and "\n" not in error.line()
        answer = server.run_step(0, 0.1, None, None, [1]).wait()
        assert isinstance(answer, StageError) and "no_such_model" in answer.line()
        assert not dist.is_initialized()
    finally:
        StageServer.close_all()


def test_a_partition_between_workers_is_told_from_a_slow_stage():
    """Every stage waiting on a neighbour for peer_timeout_s is a partition; one computing, or idle, is not."""
    from gpipe.coordinator.attempt.watch import PartitionWatch
    from gpipe.errors import JobFailed

    class Answering:  # a stage handle that answers activity() with `a`, or never
        def __init__(self, a=None):
            self.fut: torch.futures.Future = torch.futures.Future()
            if a is not None:
                self.fut.set_result(a)

        def activity(self, timeout):
            return self.fut

    def watch(*activities):
        return PartitionWatch([Answering(a) for a in activities], Slots(2), 20.0)

    w = watch(("waiting", "stage 1's gradient of micro-batch 0", 25.0), ("waiting", "stage 0's activation of micro-batch 1", 21.0))
    w.look(7)  # asks, and never waits for the answers
    assert w.looking is not None
    with pytest.raises(JobFailed, match="partition between workers") as failed:
        w.look(7)  # the next look judges them
    assert "stage 1 for stage 0's activation of micro-batch 1" in str(failed.value)
    for other in (("computing", "", 60.0), ("idle", "", 60.0), ("waiting", "stage 0's activation", 5.0)):
        w = watch(("waiting", "stage 1's gradient of micro-batch 0", 25.0), other)
        w.look(7)
        w.look(7)  # not a partition: judged, nothing raised, nothing pending
        assert w.looking is None

    # A stage that has not answered yet holds up nothing: the look is kept, and asked again later.
    w = PartitionWatch([Answering(), Answering()], Slots(2), 20.0)
    w.look(7)
    looking = w.looking
    w.look(7)
    assert w.looking is looking


def test_a_world_that_does_not_form_names_the_workers_that_never_reached_it():
    from gpipe.coordinator.attempt.rpcworld import RpcWorld

    store, port = net.bound_store("127.0.0.1", 10)
    world = object.__new__(RpcWorld)
    world.topology, world.store_port, world.master = Topology(2), port, f"127.0.0.1:{port}"

    def name_of(rank: int) -> str:
        return f"stage {rank} (layers {2 * rank}-{2 * rank + 1})"

    net.client_store("127.0.0.1", port, 10).set(f"{net.REACHED_KEY}0", "10.0.0.6")
    why = world._who_did_not_join(name_of)
    assert "stage 1 (layers 2-3) never reached the rendezvous" in why and "stage 0" not in why
    store.set(f"{net.REACHED_KEY}1", "10.0.0.7")
    why = world._who_did_not_join(name_of)
    assert "could not all connect to each other" in why and "stage 0 at 10.0.0.6, stage 1 at 10.0.0.7" in why
