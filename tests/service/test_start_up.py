"""`run`'s start-up (bench/start_time.py measures it against torch.distributed.pipelining): its own process imports
no torch; the coordinator's attempt forks from a template that imports torch alone and plans while the workers'
template, a fork of it, imports the rest; a job run again unchanged takes its probes' answers from probes.json. In
process: tests/control/test_probe_cache.py."""

from __future__ import annotations

import json

import pytest

from tests.support.ports import free_port
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


WARM_MODEL = '''
import os, sys

from torch import nn


class Net(nn.Module):  # no nn.Sequential: captured, its blocks a ModuleList
    def __init__(self, width, depth):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = b(x).tanh()
        return x


def noted(**args):
    print("building the model", file=sys.stderr)
    with open(os.path.join(os.environ["NOTES"], str(os.getpid())), "a") as f:
        f.write("built\\n")
    return Net(**args)
'''


def test_an_attempt_process_builds_the_run_s_model_before_its_join_and_logs_what_it_said(cli):
    """WARM_ENV (`run`'s): the waiting attempt process builds the model in the job's folder before any join line
    comes, once; its join then logs what the build printed. A job's whole run builds it once in each worker."""
    import os
    import subprocess
    import sys
    import time

    from gpipe.worker.agent import WARM_ENV

    folder, notes = cli.tmp / "job", cli.tmp / "notes"
    folder.mkdir()
    notes.mkdir()
    (folder / "warmmodels.py").write_text(WARM_MODEL)
    env = dict(cli.env, NOTES=str(notes), **{WARM_ENV: json.dumps({
        "model_factory": "warmmodels:noted", "model_args": {"width": 16, "depth": 5}, "code_dir": str(folder)})})
    p = subprocess.Popen([sys.executable, "-P", "-m", "gpipe.worker"], stdin=subprocess.PIPE, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (notes / str(p.pid)).exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert (notes / str(p.pid)).exists(), "the model was not built before the join"
        log = cli.tmp / "rank0.log"
        # A join to a rendezvous nobody holds: the process fails and leaves.
        p.stdin.write(json.dumps({"rank": 0, "world": 1, "master": f"127.0.0.1:{free_port()}", "host": "127.0.0.1",
                                  "start_timeout_s": 1, "log": str(log), "secret": "s" * 32,
                                  "code_dir": str(folder)}) + "\n")
        p.stdin.flush()
        p.wait(timeout=60)
        assert p.returncode != 0 and "building the model" in log.read_text()
        assert p.stderr.read() == ""  # nothing the build said went elsewhere
    finally:
        p.kill()
        p.wait()
    # Under run: each worker built it once (the coordinator's plan once more, and the spare attempt process started
    # for a next attempt once).
    spec = job(TWO_STAGES, name="warm", steps=1, model__factory="warmmodels:noted")
    cli.env.update(NOTES=str(notes))
    r = cli.run("run", str(cli.write(spec, "job/warm.yaml")), "--state-dir", "st", "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    built = {pid: (notes / pid).read_text().count("built") for pid in os.listdir(notes) if pid != str(p.pid)}
    assert set(built.values()) == {1} and len(built) >= 3, built
    for rank in range(2):
        assert "building the model" in (cli.tmp / "st" / "warm" / "logs" / f"stage-{rank}.log").read_text()
