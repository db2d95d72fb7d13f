"""The package's layers, each importing only the ones below it:

    gpipe/          the engine (the stage interpreter, schedules, transport interface and in-memory hub,
                    capture, balance, probe, wire format, precision, ...) and the helpers both sides share
    worker/         the data plane (c10d.py, channel.py, unix_lane.py, reducer.py), then the worker daemon above it
    coordinator/    spec, plan, driver, supervisor, API, CLI

`gpipe.Pipeline` is the engine alone: importing it loads no gRPC, no protobuf, no service module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA_PLANE = {"c10d", "channel", "reducer", "unix_lane"}


def imported(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (a function's own imports too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def offending(folder: str, banned: tuple[str, ...], only: set[str] | None = None) -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / folder).glob("*.py")):
        if only is not None and path.stem not in only:
            continue
        bad = sorted(m for m in imported(path) if m.startswith(banned))
        if bad:
            found[f"{folder}/{path.name}"] = bad
    return found


def test_the_engine_imports_nothing_of_the_worker_or_the_coordinator():
    assert offending("gpipe", ("gpipe.coordinator", "gpipe.worker")) == {}


def test_the_worker_imports_nothing_of_the_coordinator_and_the_data_plane_nothing_of_the_daemon():
    assert offending("worker", ("gpipe.coordinator",)) == {}
    daemon = tuple(f"gpipe.worker.{p.stem}" for p in (ROOT / "worker").glob("*.py")
                   if p.stem not in DATA_PLANE | {"__init__"})
    assert offending("worker", daemon, only=DATA_PLANE) == {}


LOADED = """
import sys
import gpipe
gpipe.Pipeline
print("\\n".join(sorted(sys.modules)))
"""


def test_gpipe_pipeline_loads_the_engine_alone():
    r = subprocess.run([sys.executable, "-c", LOADED], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    service = ("grpc", "google.protobuf", "gpipe.v1", "gpipe.coordinator", "gpipe.worker", "gpipe.serde", "gpipe.job_records",
               "gpipe.grpcutil", "gpipe.zygote", "gpipe.net", "gpipe.code_archive")
    loaded = [m for m in r.stdout.split() if m == "gpipe.stage" or m.startswith(service)]
    assert loaded == ["gpipe.stage"], loaded
