"""The probes' answers kept for the next plan of an unchanged job (gpipe.coordinator.plan.probe_cache): taken only for
the same spec, code, data and machine; measured again, and kept anew, when any of them changed; never kept when
the probe failed; JSON, and a file that cannot be read back is measured again. With a `run`: tests/service/
test_start_up.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpipe.coordinator.plan import job as plan_job
from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.plan.probe_cache import FILE, Probes
from gpipe.coordinator.spec.job import parse_spec
from gpipe.errors import SpecError
from tests.support.spec import job_yaml

MODELS = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset


def seq(width=8, depth=4):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def rows(path, width=8, targets=8):
    n = len(open(path).read().split())  # a data file: what it holds decides the data
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.randn(16, width, generator=g), torch.randn(16, targets, generator=g))
'''


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "mymodels.py").write_text(MODELS)
    (tmp_path / "rows.txt").write_text("1 2 3")
    (tmp_path / "out").mkdir()
    return tmp_path


@pytest.fixture
def runs(monkeypatch) -> dict[str, int]:
    """How often the plan ran the model: the probe and the footprint, counted."""
    counts = {"probe": 0, "footprint": 0}
    probe, footprint = plan_job.probe, plan_job._footprint

    def counted_probe(*a, **k):
        counts["probe"] += 1
        return probe(*a, **k)

    def counted_footprint(*a, **k):
        counts["footprint"] += 1
        return footprint(*a, **k)

    monkeypatch.setattr(plan_job, "probe", counted_probe)
    monkeypatch.setattr(plan_job, "_footprint", counted_footprint)
    return counts


def spec_of(folder: Path, **changes):
    return parse_spec(job_yaml(model={"factory": "mymodels:seq", "args": {"width": 8, "depth": 4}},
                               data={"factory": "mymodels:rows", "args": {"path": str(folder / "rows.txt")},
                                     "batch_size": 4},
                               balance="by_time", **changes))


def plan(folder: Path, threads: int = 1, **changes):
    """A plan of the job with `changes`, its probes kept in folder/out, as an attempt plans it."""
    spec = spec_of(folder, **changes)
    p = make_plan(spec, folder, threads=threads, probes=Probes.of(folder / "out", spec, folder, threads))
    p.probes.save()
    return p


def test_an_unchanged_job_s_plan_takes_the_kept_answers(folder, runs):
    first = plan(folder)
    assert runs == {"probe": 1, "footprint": 1} and first.probes.reused == []
    again = plan(folder, steps=7, name="renamed", log_every=3)  # fields no probe reads
    assert runs == {"probe": 1, "footprint": 1}, "the model ran again"
    assert again.probes.reused == ["skips", "footprint", "balance"]
    assert again.balance == first.balance and again.balance_costs == first.balance_costs
    assert again.skips == first.skips and again.footprint == first.footprint
    kept = json.loads((folder / "out" / FILE).read_text())  # JSON, one key and its answers
    assert set(kept) == {"key", "answers"} and set(kept["answers"]) == {"skips", "footprint", "balance"}


@pytest.mark.parametrize("change", ["spec", "model", "code", "data", "threads"])
def test_a_changed_spec_code_data_or_machine_measures_again(folder, runs, change):
    plan(folder)
    if change == "code":  # the model's file, the same model: its code is what is hashed
        (folder / "mymodels.py").write_text(MODELS + "\n# edited\n")
    if change == "data":  # a file the data's arguments name
        (folder / "rows.txt").write_text("1 2 3 4")
    changes = {"spec": {"chunks": 4}, "model": {"model__args__depth": 6}}.get(change, {})
    threads = 2 if change == "threads" else 1
    assert plan(folder, threads, **changes).probes.reused == [], change
    assert runs == {"probe": 2, "footprint": 2}, change
    again = plan(folder, threads, **changes)  # the changed job's answers are the kept ones now
    assert again.probes.reused == ["skips", "footprint", "balance"] and runs["probe"] == 2


def test_a_probe_that_fails_keeps_nothing(folder, runs):
    with pytest.raises(SpecError, match="^loss: "):  # the loss cannot take the model's output
        plan(folder, data__args__targets=5)
    assert runs["probe"] == 1 and not (folder / "out" / FILE).exists()


def test_a_file_that_cannot_be_read_back_is_measured_again(folder, runs):
    plan(folder)
    path = folder / "out" / FILE
    held = json.loads(path.read_text())
    held["answers"]["footprint"] = {"not": "a footprint"}
    held["answers"]["balance"] = "garbled"
    path.write_text(json.dumps(held))
    p = plan(folder)
    assert p.probes.reused == ["skips"] and runs == {"probe": 1, "footprint": 2}
    assert json.loads(path.read_text())["answers"]["balance"] != "garbled"  # kept anew
    path.write_text("{ not json")
    assert plan(folder).probes.reused == [] and runs["probe"] == 2


def test_nothing_is_kept_without_a_place_for_it(folder, runs):
    spec = spec_of(folder)
    for _ in range(2):
        p = make_plan(spec, folder)  # validate's plan: measured every time
        p.probes.save()
    assert runs == {"probe": 2, "footprint": 2} and list((folder / "out").iterdir()) == []


def test_the_code_key_is_the_code_archive_s_python_files(tmp_path):
    """What submit would pack of the job's folder: a virtualenv, a state folder or an excluded path inside it
    changes nothing, a Python file of the job does."""
    from gpipe.coordinator.plan.probe_cache import _code

    (tmp_path / "model.py").write_text("x = 1\n")
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "pyvenv.cfg").write_text("home = /usr\n")
    (tmp_path / "env" / "lib.py").write_text("y = 1\n")
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "notes.py").write_text("z = 1\n")
    before = _code(tmp_path, ["scratch"])
    (tmp_path / "env" / "lib.py").write_text("y = 2\n")
    (tmp_path / "scratch" / "notes.py").write_text("z = 2\n")
    assert before is not None and _code(tmp_path, ["scratch"]) == before
    (tmp_path / "model.py").write_text("x = 2\n")
    assert _code(tmp_path, ["scratch"]) != before
