"""A job on token files through `gpipe-coordinator run` equals one device; their bad inputs are one line at
validate, exit 2."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.torch import load_file

from tests.support import reference
from tests.support.cli import ROOT, one_error_line
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


@pytest.mark.multiprocess
@pytest.mark.parametrize(("files", "path", "replicas"), [(["train.bin"], "train.bin", 1),
                                                         (["train-0.bin", "train-1.bin"], "train-*.bin", 2)])
def test_a_token_file_job_equals_one_device(cli, monkeypatch, files, path, replicas):
    # A relative path is the job file's folder's; shuffled, the windows of two files as one stream, and
    # with 2 replicas each its shard of every step's windows.
    _corpus(cli.tmp, files)
    monkeypatch.chdir(cli.tmp)  # where the one-device reference finds the same relative path
    spec = _lm(path, shuffle=True) | {"replicas": replicas}
    r = cli.run("run", str(cli.write(spec)), "--state-dir", "state", "--no-progress")
    assert r.returncode == 0, r.stderr
    got, want = load_file(cli.tmp / "state" / "t" / "model.safetensors"), reference.train(spec)
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-5, f"weights differ from one device by {worst}"


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
