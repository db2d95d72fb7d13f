"""A job on a local Hugging Face dataset (data.factory hf_dataset) through `gpipe-coordinator run` equals one
device; a bad one is one line at validate, exit 2."""

from __future__ import annotations

import pytest

from tests.support.cli import one_error_line
from tests.support.hf import dataset_folder, tokenizer_folder
from tests.support.runs import train_and_compare
from tests.support.spec import TWO_STAGES, job

pytest.importorskip("datasets")
pytest.importorskip("transformers")


def _lm(**args) -> dict:
    return job(TWO_STAGES, model={"factory": "tests.support.models:tiny_lm",
                                  "args": {"vocab": 300, "d_model": 16, "layers": 2}},
               loss="cross_entropy", chunks=2, steps=3,
               data={"factory": "hf_dataset", "batch_size": 4, "shuffle": True,
                     "args": {"path": "wiki", "tokenizer": "tok", "seq_len": 8, "eos": True, "cache": "cache",
                              **args}})


@pytest.mark.multiprocess
def test_a_hf_dataset_job_equals_one_device(cli, monkeypatch):
    # Relative paths are the job file's folder's; the run tokenizes into the cache, the reference reads it.
    dataset_folder(cli.tmp / "wiki")
    tokenizer_folder(cli.tmp / "tok")
    monkeypatch.chdir(cli.tmp)  # where the one-device reference finds the same relative paths
    train_and_compare(cli, "hf_dataset", _lm())
    assert [f.suffixes for f in (cli.tmp / "cache").iterdir()] == [[".uint16", ".bin"]]  # nothing else left


@pytest.mark.multiprocess
def test_a_bad_hf_dataset_is_one_line_exit_2(cli):
    # Every bad input's line: tests/engine/test_hf_dataset.py. Here: validate says it alone on stderr, exit 2,
    # once the dataset and the tokenizer are read (what the libraries print would show).
    dataset_folder(cli.tmp / "wiki")
    tokenizer_folder(cli.tmp / "tok")
    r = cli.run("validate", str(cli.write(_lm(column="body"), "body.yaml")), timeout=60)
    assert r.returncode == 2
    assert one_error_line(r.stderr, "error: data.args: hf_dataset raised ValueError: ").endswith(
        "column 'body' is not in wiki (its columns: text, n)")
    r = cli.run("validate", str(cli.write(_lm(seq_len=4000), "long.yaml")), timeout=60)
    assert r.returncode == 2 and "seq_len 4000 is longer than the data" in one_error_line(r.stderr, "error: data.args: ")
