"""A client verb starts at once: `--help`, a flag's error and the verbs that only talk to serve import no
torch (bench/client_start measures their start beside torch's import). With a real serve:
tests/service/test_service.py::test_the_client_verbs_import_no_torch_against_a_real_serve."""

from __future__ import annotations

import pytest
import yaml

from tests.support.spec import SERVICE, job

pytestmark = pytest.mark.multiprocess

HEAVY = ("torch", "numpy", "matplotlib")


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


@pytest.mark.parametrize("args, code", [
    (["--help"], 0),
    (["submit", "--help"], 0),
    (["status", "nosuchjob", "--coordinator", "127.0.0.1:9"], 1),  # nothing listens there
    (["list", "--coordinator", "127.0.0.1:9"], 1),
    (["logs", "nosuchjob", "--coordinator", "127.0.0.1:9"], 1),
    (["stop", "nosuchjob", "--coordinator", "127.0.0.1:9"], 1),
    (["submit", "job.yaml", "--coordinator", "127.0.0.1:9"], 1),  # parsed, packed, then refused
    (["run", "job.yaml", "--chunks", "4"], 2),  # a flag's error
    (["timeline", "no-such-run"], 2),
])
def test_a_client_verb_imports_no_torch(cli, args, code):
    (cli.tmp / "job.yaml").write_text(yaml.safe_dump(job(SERVICE, name="light")))
    r, modules = cli.modules_of(*args)
    assert r.returncode == code, r.stderr[-2000:]
    assert modules, "the probe saw no modules"
    assert "gpipe.coordinator.cli.main" in modules
    assert heavy(modules) == [], f"gpipe-coordinator {' '.join(args)} imported {heavy(modules)[:5]}"
