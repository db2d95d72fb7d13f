"""The examples as a user runs them: from a folder that is not the job's, with the job's code next to its spec."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.multiprocess
def test_charlm_ddp_trains_evaluates_keeps_the_best_and_the_eval_verb_scores_it(cli):
    """examples/charlm-ddp.yaml, small: 2 replicas x 2 stages, bf16, evaluation and keep_best. The job's
    module (charlm.py) is found next to its spec only, not in the folder the command runs from."""
    job = cli.tmp / "job"
    job.mkdir()
    shutil.copy(EXAMPLES / "charlm.py", job / "charlm.py")
    spec = yaml.safe_load((EXAMPLES / "charlm-ddp.yaml").read_text())
    spec.update(name="ddp", steps=4, checkpoint_every=2, balance=[2, 2],
                model={**spec["model"], "args": {"d_model": 16, "heads": 2, "ff": 32, "layers": 2}},
                data={**spec["data"], "args": {"seq_len": 16, "split": "train", "max_bytes": 8000}, "batch_size": 8},
                eval={**spec["eval"], "every": 2, "batches": 2,
                      "data": {**spec["eval"]["data"], "args": {"seq_len": 16, "split": "eval", "max_bytes": 8000},
                               "batch_size": 4}})
    path = job / "ddp.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = cli.run("run", "--no-progress", "--state-dir", "state", str(path), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = cli.tmp / "state" / "ddp"
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in lines if "eval_loss" in m]
    steps = [m for m in lines if "eval_loss" not in m]
    assert [m["step"] for m in steps] == [0, 1, 2, 3] and all(len(m["replicas"]) == 2 for m in steps)
    assert len(evals) == 2 and all(m["eval_loss"] > 0 for m in evals)
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["eval_loss"] == min(m["eval_loss"] for m in evals)
    r = cli.run("eval", str(path), "--state-dir", "state", "--weights", str(out / "best" / "model.safetensors"),
                "--json", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    scored = json.loads(r.stdout.strip().splitlines()[-1])
    assert scored["loss"] == pytest.approx(best["eval_loss"], rel=1e-5)


@pytest.mark.multiprocess
def test_the_demo_runs_on_one_core_with_one_warning_line(cli):
    """`make demo` (examples/charlm.yaml: 2 stages), small, on a machine with one core: its 2 workers share
    the core, and `run` says so in one warning line (tests.test_spec: --oversubscribe silences it)."""
    job = cli.tmp / "job"
    job.mkdir()
    shutil.copy(EXAMPLES / "charlm.py", job / "charlm.py")
    spec = yaml.safe_load((EXAMPLES / "charlm.yaml").read_text())
    spec.update(steps=2, checkpoint_every=None,
                model={**spec["model"], "args": {"d_model": 16, "heads": 2, "ff": 32, "layers": 4, "dropout": 0.1}},
                data={**spec["data"], "args": {"seq_len": 16, "max_bytes": 4000}, "batch_size": 8})
    path = job / "charlm.yaml"
    path.write_text(yaml.safe_dump(spec))
    cli.env = {k: v for k, v in cli.env.items() if k != "GPIPE_OVERSUBSCRIBE"}  # as a user's shell has it
    r = cli.run("run", "--no-progress", "--state-dir", "state", str(path), cores="0", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "2 workers" in warned[0] and "1 CPU core" in warned[0], r.stderr
    assert "Traceback" not in r.stderr and (cli.tmp / "state" / "charlm" / "model.safetensors").exists()
    # The last line gives the final loss; a fresh run says nothing of resuming.
    assert re.match(r"charlm: done in [\d.]+s: 2/2 steps, final loss \d+\.\d{4}; weights in ", r.stderr.splitlines()[-1])
    assert "resum" not in r.stderr


@pytest.mark.multiprocess
def test_the_gpt2_tokens_recipe_tokenizes_trains_and_generates(cli):
    """docs/data.md's end to end on examples/gpt2-tokens.yaml, small and offline: a corpus, `tokenize
    --train-vocab` (a byte-level BPE tokenizer trained on it, no download), `run` (4 steps of a narrower model on
    shorter windows), then examples/generate.py continues a prompt with the run's model.safetensors, read by
    from_pretrained, and the trained tokenizer.json."""
    pytest.importorskip("transformers")
    from tests.support.lm import LINES

    job = cli.tmp / "job"
    job.mkdir()
    for name in ("gpt2-tokens.yaml", "hf.py", "charlm.py"):
        shutil.copy(EXAMPLES / name, job / name)
    (cli.tmp / "corpus").mkdir()
    for k in range(2):
        (cli.tmp / "corpus" / f"{k}.txt").write_text("".join(f"{line}, {k} {i}.\n" for i in range(30) for line in LINES))
    r = cli.run("tokenize", "corpus/0.txt", "corpus/1.txt", "--train-vocab", "300", "--tokenizer", "tok", "--out",
                "job/data/train.bin", "--val-fraction", "0.1", "--eos", "<|endoftext|>", "--no-progress", timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("tok/tokenizer.json: a byte-level BPE tokenizer of "), r.stdout
    assert 256 < int(r.stdout.strip().rsplit("(vocabulary ", 1)[1].rstrip(")")) <= 300, r.stdout  # the model's 300
    small = {"steps": 4, "model.args": {"vocab": 300, "width": 32, "layers": 4, "heads": 2, "positions": 64},
             "data.args.seq_len": 32, "eval.data.args.seq_len": 32, "eval.every": 2, "eval.batches": 1,
             "lr_schedule.warmup_steps": 1, "checkpoint_every": 2}
    sets = [x for k, v in small.items() for x in ("--set", f"{k}={json.dumps(v)}")]
    r = cli.run("run", "job/gpt2-tokens.yaml", *sets, "--state-dir", "state", "--no-progress", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = cli.tmp / "state" / "gpt2-tokens"
    assert {"model.safetensors", "config.json"} <= {p.name for p in out.iterdir()}
    g = subprocess.run([sys.executable, str(EXAMPLES / "generate.py"), str(out), "--tokenizer", "tok",
                        "--prompt", "a pipeline", "--tokens", "8"], cwd=cli.tmp, env=cli.env, capture_output=True,
                       text=True, timeout=120)
    assert g.returncode == 0, g.stderr[-3000:]
    text = g.stdout.rstrip("\n")  # 4 steps in, the continuation may be spaces
    assert text.startswith("a pipeline") and len(text) > len("a pipeline"), g.stdout
    g = subprocess.run([sys.executable, str(EXAMPLES / "generate.py"), str(cli.tmp / "state"), "--tokenizer", "tok"],
                       cwd=cli.tmp, env=cli.env, capture_output=True, text=True, timeout=120)
    assert g.returncode == 2 and g.stderr == f"error: {cli.tmp / 'state' / 'model.safetensors'}: no such file\n"

