"""Bad specs and bad invocations through the CLI: one line naming the field, exit code 2, nothing started; validate
and its bounds. The parser in process: tests/control/test_spec.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.spec import GOOD, job_yaml


@pytest.mark.multiprocess
def test_cli_rejects_a_bad_spec_and_starts_nothing(cli):
    path = cli.write(__import__("yaml").safe_load(job_yaml(balance=[1, 1])))
    r = cli.run("run", str(path), "--state-dir", str(cli.tmp / "state"), timeout=60)
    assert r.returncode == 2
    line, = r.stderr.strip().splitlines()  # one line, naming the field
    assert line.startswith("error: balance:") and "4 layers" in line, line
    assert not (cli.tmp / "state").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_a_schedule_of_several_model_chunks_without_virtual_stages_is_refused_naming_it(cli, schedule):
    r = cli.run("validate", str(cli.write(__import__("yaml").safe_load(job_yaml(schedule=schedule)))), timeout=60)
    assert r.returncode == 2, r.stderr
    line, = r.stderr.strip().splitlines()
    assert line.startswith("error: virtual_stages:") and schedule in line, line


@pytest.mark.multiprocess
@pytest.mark.parametrize("args,message", [
    (["run", "missing.yaml"], "error: missing.yaml: cannot read job file"),
    (["run"], "error: the following arguments are required: job"),
    (["fly", "job.yaml"], "error: argument command: invalid choice"),
    (["serve", "--heartbeat-timeout", "1"], "error: --heartbeat-timeout: 1.0 is outside 2..3600 seconds"),
    (["serve", "--max-workers", "0"], "error: --max-workers: 0 is outside"),
    (["serve", "--starve-after-s", "nan"], "error: --starve-after-s: nan is outside"),
])
def test_cli_bad_invocations(cli, args, message):
    r = cli.run(*args, timeout=60)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.multiprocess
@pytest.mark.path  # `validate`, end to end (make test)
def test_validate(cli):
    path = cli.write(__import__("yaml").safe_load(GOOD))
    r = cli.run("validate", str(path), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ok (4 layers, balance [2, 2])" in r.stdout
    assert not Path(cli.tmp / "gpipe-state").exists()
    r = cli.run("validate", str(path), "--memory-mib", "1024", timeout=60)  # a small model fits
    assert r.returncode == 0, r.stderr


@pytest.mark.multiprocess
def test_validate_bounds_the_memory_a_model_may_take(cli):
    d = __import__("yaml").safe_load(GOOD)
    d["model"] = {"factory": "mlp", "args": {"width": 16384, "depth": 3}}  # 3 GiB of weights
    r = cli.run("validate", str(cli.write(d)), "--memory-mib", "768", timeout=60)
    assert r.returncode == 2 and "768 MiB" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    # Shared memory counts too (RLIMIT_AS): 2 GiB of MAP_SHARED pages are refused, 64 MiB fit.
    d["model"] = {"factory": "tests.support.models:shared_hog", "args": {"mib": 2048, "width": 8}}
    r = cli.run("validate", str(cli.write(d)), "--memory-mib", "512", timeout=60)
    assert r.returncode == 2 and "512 MiB" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    d["model"]["args"]["mib"] = 64
    r = cli.run("validate", str(cli.write(d)), "--memory-mib", "512", timeout=60)
    assert r.returncode == 0, r.stderr
    r = cli.run("serve", "--validate-memory-mib", "10", timeout=60)
    assert r.returncode == 2 and "--validate-memory-mib" in r.stderr, r.stderr


@pytest.mark.multiprocess
def test_cli_refuses_a_huge_number(cli):
    path = cli.tmp / "job.yaml"
    path.write_text(GOOD.replace("steps: 2", "steps: 1000000000000000000000000000000"))
    r = cli.run("validate", str(path), timeout=60)
    assert r.returncode == 2, r.stderr
    line, = r.stderr.strip().splitlines()
    assert line == "error: steps: must be an integer between 1 and 1000000000, got 1e+30", line
    assert "Traceback" not in r.stderr and not r.stdout
