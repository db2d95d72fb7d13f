"""The boundaries `run` keeps on this machine: another local user who squats run's private folder (issue: a
folder created first, mode 0777, whose spec file they swap for one that runs their code) changes nothing.
In process: tests/control/test_run_folder.py."""

from __future__ import annotations

import os

import pytest

from tests.support.spec import SERVICE, job

pytestmark = pytest.mark.multiprocess


@pytest.mark.skipif(os.geteuid() != 0, reason="a folder owned by another user takes root to make")
def test_run_refuses_a_private_folder_another_user_made(cli, tmp_path):
    tmp = tmp_path / "machine-tmp"
    tmp.mkdir()
    squatted = tmp / f"gpipe-run-{os.getuid()}"
    squatted.mkdir()
    squatted.chmod(0o777)
    os.chown(squatted, 65534, 65534)  # nobody's, as if they made it first
    cli.env["TMPDIR"] = str(tmp)
    path = cli.write(job(SERVICE, name="sq", steps=2))
    r = cli.run("run", str(path), "--set", "steps=3", "--state-dir", str(tmp_path / "state"), "--no-progress")
    assert r.returncode == 2, r.stderr[-2000:]
    line, = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and str(squatted) in line and "belongs to uid 65534" in line
    assert list(squatted.iterdir()) == []  # nothing written where the other user can change it
    assert not (tmp_path / "state" / "sq" / "metrics.jsonl").exists() or \
        (tmp_path / "state" / "sq" / "metrics.jsonl").read_text() == ""
