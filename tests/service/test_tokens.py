"""A job on token files equals one device: through `gpipe-coordinator run` and through serve and its workers,
resumed on other stage and replica counts, whatever its read-ahead; their bad inputs are one line at validate,
exit 2."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.torch import load_file

from tests.support import reference
from tests.support.cli import ROOT, end_leftovers, one_error_line
from tests.support.service import Service
from tests.support.spec import TWO_STAGES, job

VOCAB = 32
EXAMPLES = ROOT / "examples"


def _corpus(folder, names: list[str], tokens: int = 400) -> None:
    """`tokens` random token ids below VOCAB, cut into the files `names` (uint16)."""
    ids = np.random.default_rng(5).integers(0, VOCAB, tokens).astype("<u2")
    for name, part in zip(names, np.array_split(ids, len(names)), strict=True):
        part.tofile(folder / name)


def _lm(path, **data) -> dict:
    return job(TWO_STAGES, model={"factory": "tests.support.models:tiny_lm",
                                  "args": {"vocab": VOCAB, "d_model": 16, "layers": 2}},
               loss="cross_entropy", chunks=2, steps=3,
               data={"factory": "tokens", "args": {"path": path, "seq_len": 8}, "batch_size": 4, **data})


def _worst(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _run(cli, spec: dict, *flags: str):
    return cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress", *flags,
                   timeout=180)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("files", "path", "replicas"), [(["train.bin"], "train.bin", 1),
                                                         (["train-0.bin", "train-1.bin"], "train-*.bin", 2)])
def test_a_token_file_job_equals_one_device(cli, monkeypatch, files, path, replicas):
    # A relative path is the job file's folder's; shuffled, the windows of two files as one stream, and
    # with 2 replicas each its shard of every step's windows.
    _corpus(cli.tmp, files)
    monkeypatch.chdir(cli.tmp)  # where the one-device reference finds the same relative path
    spec = _lm(path, shuffle=True) | {"replicas": replicas}
    r = _run(cli, spec)
    assert r.returncode == 0, r.stderr
    worst = _worst(load_file(cli.tmp / "state" / "t" / "model.safetensors"), reference.train(spec))
    assert worst <= 1e-5, f"weights differ from one device by {worst}"


@pytest.mark.multiprocess
def test_a_token_file_job_through_serve_equals_one_device(cli):
    # The recipe of docs/data.md under serve: the token file stays on serve's machine (an absolute path), its
    # folder left out of what submit packs; serve's coordinator reads the windows and streams them to 2 workers.
    (cli.tmp / "data").mkdir()
    _corpus(cli.tmp / "data", ["train.bin"])
    spec = _lm(str(cli.tmp / "data" / "train.bin"), shuffle=True) | {"name": "lm", "exclude": ["data"]}
    s = Service(cli)
    try:
        s.start_serve()
        s.start_worker(0)
        s.start_worker(1)
        r = s.client("submit", str(cli.write(spec)), "--follow", "--no-progress", timeout=180)
        assert r.returncode == 0, r.stderr + s.log("serve")[-3000:]
        assert "lm: SUCCEEDED: 3/3 steps" in r.stderr, r.stderr
        worst = _worst(load_file(s.state / "lm" / "model.safetensors"), reference.train(spec))
        assert worst <= 1e-5, f"weights differ from one device by {worst}"
    finally:
        s.stop_all()
        assert not end_leftovers(cli)


@pytest.mark.multiprocess
def test_a_shuffled_token_file_job_resumes_on_other_stage_and_replica_counts(cli):
    # 2 steps on 2 stages, 2 more resumed on 3 stages, the last 2 on 2 stages x 2 replicas (run --resume with
    # --set): a step's windows are a function of the step alone, so the weights are 6 uninterrupted steps'.
    # Each replica cuts its shard into 1 micro-batch: the step's 2 micro-batches stay those of one replica of 2.
    _corpus(cli.tmp, ["train.bin"], tokens=600)  # 74 windows: the 6 steps of 4 shuffled ones stay in epoch 0
    spec = _lm(str(cli.tmp / "train.bin"), shuffle=True) | {"steps": 6, "checkpoint_every": 2}
    path = str(cli.write(spec))
    legs = [(2, [], (1, 2)), (4, ["--set", "stages=3", "--set", "balance=[2, 2, 1]"], (1, 3)),
            (6, ["--set", "replicas=2", "--set", "chunks=1"], (2, 2))]
    out = cli.tmp / "state" / "t"
    for steps, sets, (replicas, stages) in legs:
        r = cli.run("run", path, "--set", f"steps={steps}", *sets, "--state-dir", str(cli.tmp / "state"),
                    "--no-progress", *(["--resume"] if steps > 2 else []), timeout=180)
        assert r.returncode == 0, r.stderr
        assert steps == 2 or f"t: resuming from checkpoint step-{steps - 2} " in r.stderr, r.stderr
        last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        assert last["step"] == steps - 1 and len(last["stages"]) == replicas * stages, last["stages"]
    worst = _worst(load_file(cli.tmp / "state" / "t" / "model.safetensors"), reference.train(spec))
    assert worst <= 1e-5, f"weights differ from one device by {worst}"


@pytest.mark.multiprocess
def test_the_read_ahead_changes_no_weight_and_is_bounded(cli):
    # 1: each step's batch is read once the step before it is done; 6: more steps than the job has.
    _corpus(cli.tmp, ["train.bin"])
    spec = _lm(str(cli.tmp / "train.bin"), shuffle=True) | {"steps": 4}
    weights = []
    for ahead in (1, 6):
        r = _run(cli, spec | {"name": f"ahead{ahead}"}, "--set", f"data.read_ahead={ahead}")
        assert r.returncode == 0, r.stderr
        weights.append(load_file(cli.tmp / "state" / f"ahead{ahead}" / "model.safetensors"))
    assert _worst(*weights) == 0  # bit for bit
    for bad in (0, 17):
        r = cli.run("validate", str(cli.write(spec)), "--set", f"data.read_ahead={bad}", timeout=60)
        assert r.returncode == 2
        one_error_line(r.stderr, f"error: data.read_ahead: must be an integer between 1 and 16, got {bad}")


@pytest.mark.multiprocess
def test_bad_token_files_are_one_line_exit_2(cli):
    # Every bad input's line: tests/engine/test_tokens.py. Here: validate and run say it in one line, exit 2.
    (cli.tmp / "odd.bin").write_bytes(b"\0" * 1001)
    r = cli.run("validate", str(cli.write(_lm("missing.bin"), "missing.yaml")), timeout=60)
    assert r.returncode == 2 and "missing.bin: no such file" in one_error_line(r.stderr, "error: data.args: tokens")
    r = cli.run("run", str(cli.write(_lm("odd.bin"), "odd.yaml")), "--state-dir", str(cli.tmp / "state"),
                "--no-progress", timeout=60)
    assert r.returncode == 2 and "wrong dtype for the file's size" in one_error_line(r.stderr, "error: data.args: ")
    assert not (cli.tmp / "state" / "t").exists()  # nothing written
    _corpus(cli.tmp, ["train.bin"])
    spec = _lm("train.bin") | {"eval": {"data": _lm("val.bin")["data"], "every": 2}}  # the same source
    r = cli.run("validate", str(cli.write(spec, "eval.yaml")), timeout=60)
    assert r.returncode == 2 and "val.bin: no such file" in one_error_line(r.stderr, "error: eval.data.args: ")


@pytest.mark.multiprocess
def test_the_gpt2_tokens_example_validates_on_its_token_files(cli):
    """examples/gpt2-tokens.yaml as written, beside token files of GPT-2's vocabulary (random ids here)."""
    pytest.importorskip("transformers")
    for name in ("gpt2-tokens.yaml", "hf.py", "charlm.py"):
        shutil.copy(EXAMPLES / name, cli.tmp / name)
    (cli.tmp / "data").mkdir()
    ids = np.random.default_rng(0).integers(0, 50257, 40_000).astype("<u2")
    ids[:25_000].tofile(cli.tmp / "data" / "train.bin")
    ids[25_000:].tofile(cli.tmp / "data" / "val.bin")
    r = cli.run("validate", str(cli.tmp / "gpt2-tokens.yaml"), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{cli.tmp / 'gpt2-tokens.yaml'}: ok")
