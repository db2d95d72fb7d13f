"""gpipe.coordinator.plan.prediction on a plan, in process: per rank, the parts by device, and plan.json's workers."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from gpipe.coordinator.attempt.metrics import write_plan
from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.plan.prediction import CPU_HEAP_SLACK, predictions
from gpipe.coordinator.spec.job import parse_spec
from tests.support.spec import job_yaml


def test_each_rank_gets_its_stages_parts_and_cuda_has_no_baseline_or_heap(tmp_path):
    spec = parse_spec(job_yaml(model__args__width=64, data__args__in_features=64, data__args__out_features=64,
                               optimizer={"name": "adam", "lr": 0.01}, replicas=2, chunks=2,
                               data__batch_size=8))
    plan = make_plan(spec, tmp_path)
    cpu = predictions(plan, ["cpu"] * 4, lambda device: 1000)
    cuda = predictions(plan, [f"cuda:{n}" for n in range(4)], lambda device: 0)
    assert cpu is not None and cuda is not None and len(cpu) == len(cuda) == 4
    for n in range(4):
        stage = n % 2
        weights = sum(p.numel() * 4 for i in range(*plan.bounds[stage]) for p in plan.model[i].parameters())
        assert cpu[n].parts["params"] == weights and cpu[n].parts["optimizer"] == 2 * weights
        assert cpu[n].parts["baseline"] == 1000 and cpu[n].parts["allocator"] == round(CPU_HEAP_SLACK * weights)
        assert cuda[n].parts["baseline"] == cuda[n].parts["allocator"] == 0
    assert cpu[0].parts == cpu[2].parts  # the replicas of a stage alike
    write_plan(tmp_path, plan, [{"device": "cpu"}] * 4, cpu)
    workers = json.loads((tmp_path / "plan.json").read_text())["workers"]
    assert [w["predicted_peak_bytes"] for w in workers] == [p.peak for p in cpu]
    assert set(workers[0]["predicted_memory"]) == {*cpu[0].parts, "moment"}


def test_each_step_read_ahead_holds_its_data_on_the_first_and_last_stage_of_the_cpu(tmp_path):
    # 8 samples of 16 float32 inputs (the first stage) and as many targets (the last), per step sent ahead.
    def buffers(ahead: int) -> list[int]:
        spec = parse_spec(job_yaml(model__args__width=16, data__args__in_features=16, data__args__out_features=16,
                                   data__batch_size=8, data__read_ahead=ahead))
        got = predictions(make_plan(spec, tmp_path), ["cpu"] * 2, lambda device: 0)
        assert got is not None
        return [p.parts["buffers"] for p in got]

    one, five = buffers(1), buffers(5)
    assert [b - a for a, b in zip(one, five, strict=True)] == [4 * 8 * 16 * 4] * 2


def test_without_the_probe_there_is_no_prediction_and_plan_json_says_why(tmp_path):
    plan = make_plan(parse_spec(job_yaml(probe=False)), tmp_path)
    assert predictions(plan, ["cpu", "cpu"], lambda device: 0) is None
    write_plan(tmp_path, plan, [{"device": "cpu"}] * 2)
    w = json.loads((tmp_path / "plan.json").read_text())["workers"][0]
    assert w["predicted_peak_bytes"] is None and w["predicted_missing"] == "probe: false"


def test_an_unknown_baseline_is_measured_beside_the_job_and_plan_json_written_again(tmp_path, monkeypatch):
    from gpipe.coordinator.plan import baseline, prediction

    plan = make_plan(parse_spec(job_yaml()), tmp_path)
    measured = threading.Event()

    def measure(plan, device):
        measured.wait(10)  # the job goes on meanwhile
        return 1234

    monkeypatch.setattr(baseline, "known", lambda plan, device: None)  # never measured on this host
    monkeypatch.setattr(baseline, "runtime_bytes", measure)
    writes, logs = [], []
    announced = prediction.Announced(plan, ["cpu", "cpu"], lambda p, why: writes.append((p, why)), logs.append)
    assert writes == [(None, "measuring this host's baseline (gpipe.coordinator.plan.baseline)")] and not logs
    measured.set()
    announced.finish()
    (predicted, why), = writes[1:]
    assert why == "" and [p.parts["baseline"] for p in predicted] == [1234, 1234]
    assert logs[0].startswith("predicted peak memory: rank 0 ")


def test_the_heap_slack_leaves_out_the_gradients_computed_into_grad(tmp_path):
    # A captured GPT-2 whose tied embedding/head and MLP weights reach grad_in_place.IN_PLACE_BYTES: their
    # gradients are added into .grad, never made anew in the heap, so the allocator part counts the others only.
    pytest.importorskip("transformers")
    from gpipe import grad_in_place
    from tests.support.spec import GPT2, job

    spec = parse_spec(json.dumps(job(GPT2, model__args={"vocab": 4096, "width": 1024, "layers": 2, "heads": 4},
                                     model__split_points=["transformer.h.1"])))
    plan = make_plan(spec, tmp_path)
    cpu = predictions(plan, ["cpu"] * 2, lambda device: 0)
    assert cpu is not None
    for stage, p in enumerate(cpu):
        layers = torch.nn.ModuleList(plan.model[i] for i in range(*plan.bounds[stage]))
        params = list(layers.parameters())
        in_place = grad_in_place.in_place_params(layers)
        large = [q for q in params if id(q) in in_place]
        assert large and all(grad_in_place.is_large(q) for q in large)  # the tied weight, c_fc, the MLP's c_proj
        heaped = sum(q.numel() * 4 for q in params if id(q) not in in_place)
        assert p.parts["allocator"] == round(CPU_HEAP_SLACK * heaped)
        assert p.parts["grads"] == sum(q.numel() * 4 for q in params) > heaped


def test_the_baseline_process_builds_the_model_and_loads_the_plans_pieces(tmp_path):
    """The measuring process gets as far as a worker does (its modules, the model on the meta device, the plan's
    captured pieces) and says nothing went wrong: a failure there would leave the figure at the imports alone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from gpipe.coordinator.plan import baseline
    from tests.support.spec import GPT2, job

    pytest.importorskip("transformers")
    plan = make_plan(parse_spec(job_yaml(job(GPT2, stages=2))), tmp_path)
    req = baseline._with_pieces(baseline._request(plan), plan)
    assert req["pieces"] and req["capture"] is not None
    r = subprocess.run([sys.executable, "-P", "-c", baseline._CHILD + "\nprint('transformers' in sys.modules)"],
                       input=json.dumps(req), capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))  # tests.support
    assert r.returncode == 0 and r.stderr == "", r.stderr
    peak, imported = r.stdout.split()
    assert int(peak) > 100 << 20 and imported == "True"
