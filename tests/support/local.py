"""Stages in this process: one Stage on a store of its own (built, run), and the driver over local stage
servers (drive), with what the tests read of them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from gpipe.coordinator.attempt.driver import Run
from gpipe.coordinator.attempt.handle import local_stages
from gpipe.coordinator.attempt.metrics import EvalMetrics, StepMetrics
from gpipe.coordinator.outputs import checkpoint
from gpipe.coordinator.plan.configs import stage_config
from gpipe.coordinator.plan.data import DataStream
from gpipe.coordinator.plan.job import Plan, make_plan
from gpipe.coordinator.spec.job import parse_spec
from gpipe.service import net
from gpipe.stage import Stage
from gpipe.state import StageState
from gpipe.worker.dataplane.c10d import C10dTransport
from gpipe.worker.stage_server import StageServer
from tests.support.cli import ROOT


@pytest.fixture(autouse=True)
def attempt_secret() -> None:
    net.use_secret(net.new_secret())  # as an attempt process does: its stores live under it


def plan_of(spec: dict) -> Plan:
    return make_plan(parse_spec(yaml.safe_dump(spec)), ROOT)


@contextmanager
def built(plan: Plan, weights: dict[str, torch.Tensor], resume: StageState | None = None) -> Iterator[Stage]:
    """Stage 0 of `plan` on a fresh store; its process group is destroyed on the way out."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stage = None
    try:
        cfg = stage_config(plan, 0, 0, "cpu", "127.0.0.1", store.port)
        stage = Stage(cfg, weights, resume, C10dTransport(cfg, torch.device("cpu")))
        yield stage
    finally:
        if stage is not None:
            stage.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def run(stage: Stage, plan: Plan, steps: range) -> list[float]:
    spec = plan.spec
    stream = DataStream(plan.dataset, spec.data.batch_size, spec.chunks, spec.data.shuffle, spec.seed)
    losses = []
    for s in steps:
        xs, ys, sizes = stream.micro_batches(s)
        out = stage.step(s, spec.optimizer.lr, xs, ys, sizes)
        losses.append(out.loss_sum)
    return losses


def weights_of(stage: Stage) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in stage.layers.state_dict().items()}



@pytest.fixture(autouse=True)
def close_stages():
    yield
    StageServer.close_all()


def drive(plan: Plan, out: Path, resume: checkpoint.Loaded | None = None,
          **kw: object) -> tuple[list[StepMetrics], list[EvalMetrics]]:
    """One attempt of `plan` over local stages, its checkpoints written under `out`; the step and eval metrics."""
    steps: list[StepMetrics] = []
    evals: list[EvalMetrics] = []
    run = Run(plan, steps.append, on_eval=lambda m, w: evals.append(m), **kw)  # type: ignore[arg-type]
    writer = checkpoint.Writer(checkpoint.folder(out), plan.spec.keep_checkpoints, lambda *a: None)
    first = resume.step if resume is not None else 0
    run.build(local_stages(plan, first), resume)
    run.train(first, writer.submit)
    writer.close()
    return steps, evals


def live_copies(name: str) -> list[torch.Tensor]:
    """Each local stage's copy of parameter `name` (a captured model's: its pieces hold it as "i.name")."""
    return [p.detach() for server in StageServer.live if server.stage is not None
            for key, p in server.stage.layers.named_parameters() if key.split(".", 1)[1] == name]


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)

