"""A job's code through the CLI: submit refuses a folder too large before it calls anyone, validate imports from
the spec's working dir. The archives in process: tests/control/test_code_archive.py.
"""

from __future__ import annotations

import os

import yaml

from tests.support.spec import DELETE, job, job_yaml, regression


def test_submit_refuses_a_folder_too_large_before_it_calls_anyone(cli):
    cli.env.pop("PYTHONPATH")  # the job's folder is its code: nothing set by hand
    (cli.tmp / "big.bin").write_bytes(os.urandom(2 << 20))
    (cli.tmp / "job.yaml").write_text(job_yaml(name="big", model={"factory": "mlp"}, stages=1, chunks=DELETE, steps=1,
                                                data={"factory": "random_regression", "batch_size": 2}))
    r = cli.run("submit", "job.yaml", "--max-code-mib", "1", "--coordinator", "127.0.0.1:9")  # nothing listens
    assert r.returncode == 2
    line, = r.stderr.strip().splitlines()
    assert line.startswith("error: working_dir:") and "limit is 1 MiB" in line, line


def test_validate_imports_from_the_spec_s_working_dir(cli):
    cli.env.pop("PYTHONPATH")
    code_dir, jobs = cli.tmp / "src", cli.tmp / "jobs"
    code_dir.mkdir()
    jobs.mkdir()
    (code_dir / "wd_model.py").write_text("from gpipe.builtins import mlp as build\n")
    spec = job(name="wd", model={"factory": "wd_model:build", "args": {"width": 4, "depth": 2}}, chunks=DELETE, steps=1,
               data=regression(8, 4, 2))
    (jobs / "job.yaml").write_text(yaml.safe_dump(spec))
    r = cli.run("validate", str(jobs / "job.yaml"))
    assert r.returncode == 2 and "cannot import module 'wd_model'" in r.stderr  # not beside the job file
    (jobs / "job.yaml").write_text(yaml.safe_dump({**spec, "working_dir": "../src", "exclude": ["*.ckpt"]}))
    r = cli.run("validate", str(jobs / "job.yaml"))
    assert r.returncode == 0, r.stderr
