"""`run`'s start-up (bench/start_time.py measures it against torch.distributed.pipelining): its own process imports
no torch; the coordinator's attempt forks from a template that imports torch alone and plans while the workers'
template, a fork of it, imports the rest; a job run again unchanged takes its probes' answers from probes.json. In
process: tests/control/test_probe_cache.py."""

from __future__ import annotations

import json

import pytest

from tests.support.spec import TWO_STAGES, job

pytestmark = pytest.mark.multiprocess

# An import hook for every process of a run: torch._dynamo (what the workers' template adds to torch) waits, outside
# the coordinator's attempt process, until the job's model has been built, which the coordinator's plan does; and
# says in GATE.log whether the wait ended so or gave up.
GATE_SITE = '''
import os, sys, time


class Gate:
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo" and not sys.argv[0].endswith("attempt/process.py"):  # (as runpy sets it)
            sys.meta_path.remove(self)
            gate = os.environ["GATE"]
            deadline = time.monotonic() + 60
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.05)
            with open(gate + ".log", "a") as f:
                f.write(("opened" if os.path.exists(gate) else "gave up") + " " + sys.argv[0] + "\\n")
        return None


if os.environ.get("GATE"):
    sys.meta_path.insert(0, Gate())
'''

GATED_MODEL = '''
import os

from gpipe.builtins import mlp


def gated(**args):
    open(os.environ["GATE"], "w").close()  # the coordinator is planning
    return mlp(**args)
'''


def test_run_imports_no_torch_and_an_unchanged_job_keeps_its_probes(cli):
    spec = cli.write(job(TWO_STAGES, name="again", steps=1))
    r, modules = cli.modules_of("run", str(spec), "--state-dir", "st", "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "gpipe.coordinator.cli.run" in modules and "torch" not in modules, "run's own process imported torch"
    plan = cli.tmp / "st" / "again" / "plan.json"
    assert "probes_kept" not in json.loads(plan.read_text())
    kept = json.loads((cli.tmp / "st" / "again" / "probes.json").read_text())
    assert set(kept["answers"]) >= {"skips", "footprint", "balance", "step"}
    # Run again, unchanged but for its steps: the plan runs the model no more.
    r = cli.run("run", str(cli.write(job(TWO_STAGES, name="again", steps=2))), "--state-dir", "st", "--no-progress",
                timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(plan.read_text())["probes_kept"] == ["skips", "footprint", "balance", "step"]
    log = (cli.tmp / "st" / "again" / "logs" / "coordinator.log").read_text()
    assert "the probes as an earlier plan of this model, spec and code measured them" in log
    # Another model: measured afresh.
    r = cli.run("run", str(cli.write(job(TWO_STAGES, name="again", steps=1, model__args__depth=6))), "--state-dir",
                "st", "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "probes_kept" not in json.loads(plan.read_text())


def test_the_coordinator_plans_while_the_workers_template_imports(cli):
    site = cli.tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(GATE_SITE)
    (cli.tmp / "gatedmodels.py").write_text(GATED_MODEL)
    gate = cli.tmp / "gate"
    cli.env.update(PYTHONPATH=f"{site}:{cli.env['PYTHONPATH']}", GATE=str(gate))
    cli.env.pop("GPIPE_TEMPLATE_SOCKET", None)  # the shared template started without this sitecustomize
    spec = job(TWO_STAGES, name="gated", steps=1, model__factory="gatedmodels:gated")
    r = cli.run("run", str(cli.write(spec)), "--state-dir", "st", "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    # torch._dynamo waited for the coordinator's plan in the workers' template, a fork of the coordinator's
    # template: one template importing everything would have waited for a plan that cannot start before it.
    # (The plan's baseline measurement, a fresh process, may import it too, later.)
    lines = (cli.tmp / "gate.log").read_text().splitlines()
    assert lines[0].endswith("gpipe/service/zygote.py") and all(x.startswith("opened") for x in lines), lines
