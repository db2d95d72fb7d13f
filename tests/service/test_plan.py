"""`gpipe-coordinator plan` through the CLI: the table, --json's last line, --write's file read back by validate and
run with the configuration the plan chose; nothing that fits is one line, exit 2. The search and its models in
process: tests/control/test_planner.py."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import yaml
from safetensors.torch import load_file

from gpipe.coordinator.plan.search import shown
from tests.support import reference
from tests.support.cli import end_leftovers, one_error_line
from tests.support.ports import free_port_in
from tests.support.service import Service
from tests.support.spec import job

SPEC = job(name="planned", model__args={"width": 16, "depth": 5}, data__batch_size=16,
           data__args={"n": 64, "in_features": 16, "out_features": 16}, optimizer={"name": "adam", "lr": 0.01},
           steps=3)


@pytest.mark.multiprocess
@pytest.mark.path  # plan, then run what it wrote (make test)
def test_plan_prints_what_fits_fastest_first_and_writes_a_spec_that_runs_as_chosen(cli):
    path = cli.write(SPEC)
    r = cli.run("plan", str(path), "--workers", "2", "--memory-gib", "8", "--json", "--top", "5",
                "--write", str(cli.tmp / "best.yaml"), timeout=180)
    assert r.returncode == 0, r.stderr
    picks = json.loads(r.stdout.strip().splitlines()[-1])
    assert 1 <= len(picks) <= 5
    assert [p["predicted_step_s"] for p in picks] == sorted(p["predicted_step_s"] for p in picks)
    best = picks[0]
    assert best["stages"] * best["replicas"] <= 2 and best["predicted_peak_bytes"] <= 8 << 30
    assert set(best) >= {"stages", "replicas", "balance", "schedule", "virtual_stages", "chunks",
                         "activation_checkpoint", "shard", "predicted_step_s", "predicted_peak_bytes"}
    written = yaml.safe_load((cli.tmp / "best.yaml").read_text())
    for key in ("stages", "replicas", "balance", "schedule", "virtual_stages", "chunks", "activation_checkpoint"):
        assert written[key] == best[key], key
    assert written["optimizer"]["shard"] == best["shard"] and written["optimizer"]["lr"] == 0.01
    r = cli.run("validate", str(cli.tmp / "best.yaml"), timeout=120)
    assert r.returncode == 0, r.stderr
    r = cli.run("run", str(cli.tmp / "best.yaml"), "--state-dir", str(cli.tmp / "state"), "--no-progress",
                "--oversubscribe", timeout=180)
    assert r.returncode == 0, r.stderr
    plan = json.loads((cli.tmp / "state" / "planned" / "plan.json").read_text())
    # (a measured pick runs the order it builds at its start: plan.json names that table)
    assert plan["balance"] == best["balance"] and shown(plan["schedule"]["name"]) == best["schedule"]
    assert len(plan["workers"]) == best["stages"] * best["replicas"]
    # Every job predicts its step time, and its log says the measured one beside it.
    assert plan["predicted_step_s"] > 0
    (said,) = [x for x in r.stderr.splitlines() if "ms, the median of 3 (predicted " in x]
    predicted = float(said.rsplit("(predicted ", 1)[1].rstrip(")"))
    assert abs(predicted - plan["predicted_step_s"] * 1e3) <= 0.051, said  # each rounded to 0.1 ms on its own

    # The table: a header, a row per configuration, and why the first wins.
    r = cli.run("plan", str(path), "--workers", "2", "--memory-gib", "8", "--top", "3", timeout=180)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "configuration(s) fit" in lines[0] and lines[1].startswith("| # |") and lines[-1].split(":")[0] in \
        {"gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv"}
    assert [x.split("|")[1].strip() for x in lines[3:6]] == ["1", "2", "3"]


@pytest.mark.multiprocess
def test_nothing_that_fits_and_bad_flags_are_one_line_exit_2_and_write_nothing(cli):
    path = cli.write(SPEC)
    out = cli.tmp / "best.yaml"
    r = cli.run("plan", str(path), "--workers", "2", "--memory-gib", "0.01", "--write", str(out), timeout=180)
    assert r.returncode == 2
    assert "smallest predicted peak" in one_error_line(r.stderr, "error: --memory-gib:")
    assert not out.exists()
    r = cli.run("plan", str(path), "--workers", "0", "--memory-gib", "8", timeout=60)
    assert r.returncode == 2 and "--workers" in one_error_line(r.stderr, "error: --workers")
    r = cli.run("plan", str(path), "--memory-gib", "8", timeout=60)  # --workers is required
    assert r.returncode == 2 and "--workers" in r.stderr


@pytest.mark.multiprocess
def test_a_job_written_outside_its_folder_finds_its_code_and_data_from_anywhere(cli):
    # The job's own module and a relative token file, in job/; the plan written to plans/ and validated from a
    # third folder: the written job's working_dir is job/ as seen from plans/.
    folder, plans, elsewhere = (cli.tmp / d for d in ("job", "plans", "elsewhere"))
    for d in (folder / "data", plans, elsewhere):
        d.mkdir(parents=True)
    (folder / "mylm.py").write_text("from torch import nn\n\n\ndef lm(vocab: int = 32):\n"
                                    "    return nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, 8), nn.Linear(8, vocab))\n")
    np.random.default_rng(0).integers(0, 32, 400).astype("<u2").tofile(folder / "data" / "train.bin")
    spec = job(name="lm", model={"factory": "mylm:lm", "args": {}}, loss="cross_entropy", stages=1, steps=2,
               data={"factory": "tokens", "args": {"path": "data/train.bin", "seq_len": 8}, "batch_size": 8})
    path = cli.write(spec, "job/lm.yaml")
    r = cli.run("plan", str(path), "--workers", "1", "--memory-gib", "4", "--write", "plans/best.yaml", timeout=180)
    assert r.returncode == 0, r.stderr
    written = yaml.safe_load((plans / "best.yaml").read_text())
    assert written["working_dir"] == "../job"
    r = subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "validate", str(plans / "best.yaml")],
                       cwd=elsewhere, env=cli.env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


AUTO = job(SPEC, name="auto", stages=2, chunks="auto", schedule="auto", activation_checkpoint="auto")


@pytest.mark.multiprocess
def test_auto_values_are_chosen_at_start_recorded_in_plan_json_and_train_as_one_device(cli):
    r = cli.run("run", str(cli.write(AUTO)), "--state-dir", str(cli.tmp / "state"), "--no-progress",
                "--oversubscribe", timeout=180)
    assert r.returncode == 0, r.stderr
    assert "auto: " in r.stderr and "predicted" in r.stderr  # the choice, said
    plan = json.loads((cli.tmp / "state" / "auto" / "plan.json").read_text())
    auto, spec = plan["auto"], plan["spec"]
    assert auto["fields"] == ["activation_checkpoint", "chunks", "schedule"] and spec["auto"] == []
    for key, value in auto["chosen"].items():  # a measured choice: the table of the order it built
        assert (shown(spec[key]) if key == "schedule" else spec[key]) == value, key
    assert ("schedule_table" in auto) == (auto["chosen"]["schedule"] == "measured")
    assert plan["schedule"]["name"] == spec["schedule"] and plan["balance"] == auto["balance"]
    assert auto["predicted_step_s"] > 0 and 0 < auto["predicted_peak_bytes"] <= auto["budget_bytes"]
    chosen = job(SPEC, name="auto", stages=2, balance=auto["balance"],
                 **{k: v for k, v in auto["chosen"].items()})
    got, want = load_file(cli.tmp / "state" / "auto" / "model.safetensors"), reference.train(chosen)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5


@pytest.mark.multiprocess
def test_auto_values_under_serve(cli):
    s = Service(cli)
    s.port = free_port_in(range(33000, 34000))
    s.address = f"127.0.0.1:{s.port}"
    try:
        s.start_serve()
        s.start_worker(0)
        s.start_worker(1)
        r = s.client("submit", str(cli.write(AUTO)), "--follow", "--no-progress", timeout=240)
        assert r.returncode == 0, r.stderr + s.log("serve")
        plan = json.loads((s.state / "auto" / "plan.json").read_text())
        assert plan["auto"]["chosen"]["chunks"] == plan["spec"]["chunks"] and plan["spec"]["auto"] == []
    finally:
        s.stop_all()
        assert not end_leftovers(cli)
