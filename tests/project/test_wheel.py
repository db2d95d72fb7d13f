"""The wheel: one top-level package, gpipe, holding gpipe/coordinator and gpipe/worker (pyproject's package-dir),
importable from the wheel alone, with its console scripts pointing into the namespace."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multiprocess

IMPORTS = """
import sys
sys.path.insert(0, sys.argv[1])
import gpipe, gpipe.coordinator.cli.main, gpipe.worker.daemon, gpipe.service.v1.jobs_pb2
print(gpipe.__file__, gpipe.coordinator.cli.main.__file__, gpipe.worker.daemon.__file__)
"""


def test_the_wheel_installs_gpipe_alone(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel, = (tmp_path / "dist").glob("gpipe-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
        scripts = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert {n.split("/")[0] for n in names} == {"gpipe", wheel.name.split("-")[0] + "-" +
                                                wheel.name.split("-")[1] + ".dist-info"}
    assert "gpipe/coordinator/cli/main.py" in names and "gpipe/worker/daemon.py" in names
    assert "gpipe-coordinator = gpipe.coordinator.cli.main:main" in scripts
    assert "gpipe-worker = gpipe.worker.daemon:main" in scripts
    # Imported from the unpacked wheel alone (not from the repository), from a folder that is not the repository.
    r = subprocess.run([sys.executable, "-P", "-c", IMPORTS, str(tmp_path / "site")], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(Path(p).is_relative_to(tmp_path / "site") for p in r.stdout.split()), r.stdout
