"""The README and docs/ say what is true: the spec reference is the schema's, the links lead somewhere, and
the README's job and service walkthrough work as written."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

from gpipe.coordinator.spec.doc import markdown
from gpipe.coordinator.spec.job import parse_spec
from tests.support.cli import ROOT
from tests.support.ports import free_port

README = ROOT / "README.md"


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_docs_spec_md_is_the_schema_s():
    assert (ROOT / "docs" / "spec.md").read_text() == markdown(), (
        "docs/spec.md is stale: python -m gpipe.coordinator.spec.job --markdown > docs/spec.md")


def test_the_readme_is_a_front_door_whose_links_lead_somewhere():
    text = README.read_text()
    assert len(text.encode()) <= 10 * 1024
    assert "PYTHONPATH" not in text and "make demo" in text and "make test" in text
    for page in (ROOT / "docs").glob("*.md"):
        assert "PYTHONPATH" not in page.read_text(), page
    pages = [README, *(ROOT / "docs").glob("*.md")]
    for page in pages:
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / link).exists(), f"{page.name}: {link} does not exist"


def test_the_readme_s_job_is_a_valid_spec():
    job, = blocks(README.read_text(), "yaml")
    assert len(job.strip().splitlines()) <= 10
    spec = parse_spec(job)
    assert (spec.stages, spec.chunks, spec.schedule) == (2, 4, "1f1b")


@pytest.mark.multiprocess
def test_the_readme_s_service_walkthrough_works_as_written_after_make_demo(cli):
    """The README's service block, each line as written (its port substituted), in a folder like a checkout
    after `make demo`: this checkout's .venv, examples/ and the demo's gpipe-state/charlm. To keep the test
    short, the copy of examples/charlm.yaml trains 10 steps, not 200, and checkpoints every 5."""
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("the walkthrough pins its workers to cores 0 and 1")
    block, = (b for b in blocks(README.read_text(), "sh") if "gpipe-coordinator serve" in b)
    port = str(free_port())
    lines = [x.replace("7000", port) for x in block.splitlines() if x.strip() and not x.startswith("#")]
    here = cli.tmp / "checkout"
    here.mkdir()
    (here / ".venv").symlink_to(ROOT / ".venv")
    shutil.copytree(ROOT / "examples", here / "examples")
    charlm = here / "examples" / "charlm.yaml"
    text = charlm.read_text()
    assert "\nsteps: 200\n" in text and "\ncheckpoint_every: 50 " in text
    charlm.write_text(text.replace("\nsteps: 200\n", "\nsteps: 10\n").replace("\ncheckpoint_every: 50 ", "\ncheckpoint_every: 5 "))
    demo = here / "gpipe-state" / "charlm"
    demo.mkdir(parents=True)
    (demo / "metrics.jsonl").write_text('{"step": 0}\n')  # what make demo left
    env = {k: v for k, v in cli.env.items() if k != "PYTHONPATH"}
    background = [x for x in lines if " serve " in x or "gpipe-worker" in x]
    terminal4 = [x for x in lines if x not in background]
    procs = []
    try:
        for line in background:
            log = open(cli.tmp / f"bg{len(procs)}.log", "wb")
            procs.append(subprocess.Popen(["bash", "-c", line], cwd=here, env=env, stdout=log, stderr=log,
                                          start_new_session=True))
            if " serve " in line:
                deadline = time.monotonic() + 60
                while "coordinator serving on" not in (cli.tmp / "bg0.log").read_text():
                    assert time.monotonic() < deadline, "timed out waiting for serve to start"
                    time.sleep(0.1)
        r = subprocess.run(["bash", "-ec", "\n".join(terminal4)], cwd=here, env=env, capture_output=True,
                           text=True, timeout=300)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
    assert r.returncode == 0, r.stderr[-3000:] + (cli.tmp / "bg0.log").read_text()[-3000:]
    assert re.search(r"charlm: SUCCEEDED: 10/10 steps, final loss \d+\.\d{4}; weights in ", r.stderr), r.stderr
    steps = re.findall(r"^step (\d+)/10  loss ", r.stdout, re.M)
    assert steps == [str(n) for n in range(1, 11)], r.stdout[-2000:]
    assert re.search(r"^checkpoint step-5: ", r.stdout, re.M) and r.stdout.splitlines()[-1].startswith("SUCCEEDED")
    assert (here / "gpipe-service" / "charlm" / "model.safetensors").exists()
    assert (demo / "metrics.jsonl").read_text() == '{"step": 0}\n'  # the demo's outputs untouched


def test_pipeline_md_s_hugging_face_example_runs_as_written_and_gives_the_logits():
    """docs/pipeline.md's Hugging Face block, its names given: loss_fn gets the logits tensor, pipe(x) returns
    the batch's logits, as the model's own `.logits`; `output=` picks another of the output's tensors."""
    pytest.importorskip("transformers")
    import torch
    import transformers
    from torch.nn import functional as F

    import gpipe
    from tests.support import models

    block, = (b for b in blocks((ROOT / "docs" / "pipeline.md").read_text(), "python") if "transformers" in b)
    torch.manual_seed(0)
    model = models.gpt2()
    seen: list = []

    def cross_entropy(logits, y):
        seen.append(logits)
        return F.cross_entropy(logits, y)

    names = {"transformers": transformers, "gpipe": gpipe, "torch": torch, "F": SimpleNamespace(cross_entropy=cross_entropy),
             "config": model.config, "ids": torch.randint(0, 97, (4, 8)), "mask": torch.ones(4, 8, dtype=torch.long)}
    exec(block, names)
    assert [t.shape for t in seen] == [(7, 97)] * 4  # 4 micro-batches of 1: its logits, shifted by the block
    pipe, x = names["pipe"], names["x"]
    pipe.step(x, names["ids"], lambda out, y: seen.append(out) or out.sum())
    assert isinstance(seen[-1], torch.Tensor) and seen[-1].shape == (1, 8, 97)  # what loss_fn receives
    pipe.close()
    built = names["model"]
    built.eval()
    assert torch.equal(names["logits"], built(**x).logits)
    pipe = gpipe.Pipeline(built, stages=2, chunks=2, output="no_such")
    with pytest.raises(KeyError, match="has no 'no_such'.*logits"):
        pipe(x)
    pipe.close()


def test_the_readmes_in_process_example_trains_as_written():
    """The README's torchgpipe block: `output = pipe(inputs)`, a loss of it backwarded, an optimizer's step."""
    import torch

    import gpipe

    block, = (b for b in blocks(README.read_text(), "python") if "gpipe.Pipeline" in b)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(8)])
    before = [p.detach().clone() for p in model.parameters()]
    names = {"gpipe": gpipe, "model": model, "inputs": torch.randn(8, 4), "targets": torch.randn(8, 4),
             "loss_fn": torch.nn.functional.mse_loss, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    exec(block, names)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # every layer trained
    names["pipe"].close()


def test_running_md_s_loading_block_loads_a_job_s_tied_weights_as_written(tmp_path, monkeypatch):
    """docs/running.md's gpipe.load_weights block, run in a folder holding a job's outputs as `run` leaves them
    (gpipe-state/mine: model.safetensors exported from a checkpoint, and checkpoints/step-500), `mymodel:build`
    a model whose last layer's weight is its first's: each load fills both names, the tie stays one tensor."""
    import sys
    import types

    import torch

    import gpipe
    import gpipe.weights
    from gpipe.coordinator.outputs import checkpoint
    from gpipe.state import StageState

    def build(layers: int) -> torch.nn.Sequential:
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
        model[-1].weight = model[0].weight
        return model

    out = tmp_path / "gpipe-state" / "mine"
    saved = {}
    for step in (400, 500):
        torch.manual_seed(step)
        saved[step] = {k: v.clone() for k, v in build(8).state_dict().items() if k != "7.weight"}  # the tie once
        snap = checkpoint.Snapshot(step, [StageState({f"model/{k}": v for k, v in saved[step].items()}, {})], {})
        checkpoint.write(checkpoint.folder(out), snap)
    checkpoint.export_weights(checkpoint.load(checkpoint.step_dir(checkpoint.folder(out), 400)),
                              out / "model.safetensors")
    mymodel = types.ModuleType("mymodel")
    mymodel.build = build  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mymodel", mymodel)
    monkeypatch.chdir(tmp_path)
    block, = (b for b in blocks((ROOT / "docs" / "running.md").read_text(), "python") if "load_weights" in b)
    loaded = []  # what each load left in the model

    def load_weights(model, path):
        gpipe.weights.load_weights(model, path)
        loaded.append({k: v.clone() for k, v in model.state_dict().items()})
        return model

    monkeypatch.setattr(gpipe, "load_weights", load_weights, raising=False)
    names: dict = {}
    exec(block, names)
    model = names["model"]
    assert model[7].weight is model[0].weight and len(loaded) == 2
    for got, step in zip(loaded, (400, 500), strict=True):  # model.safetensors (step-400's), then step-500's
        assert all(torch.equal(got[k], saved[step][k.replace("7.weight", "0.weight")]) for k in got)
