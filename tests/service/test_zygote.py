"""Attempt processes forked from a template (gpipe.service.zygote): what `python -m MODULE` would have been, killed as
before, and ended with the template."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from gpipe.proc import child_env
from gpipe.service.zygote import EXIT_REPORT_S, Forked, Template
from tests.support.cli import tagged_pids, wait_for
from tests.support.spec import job, regression, slow_mlp

pytestmark = pytest.mark.multiprocess

PROBE = '''
import json, os, sys, numpy, torch
line = sys.stdin.readline()
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
                  "parent": os.environ.get("GPIPE_PARENT_PID"), "threads": torch.get_num_threads(),
                  "cores": sorted(os.sched_getaffinity(0)), "leader": os.getpgid(0) == os.getpid(),
                  "line": line.strip(), "main": __name__, "draw": numpy.random.rand()}), flush=True)
sys.exit(int(sys.argv[1]))
'''


def _probe(tmp: Path) -> dict[str, str]:
    (tmp / "mods").mkdir()
    (tmp / "mods" / "zprobe.py").write_text(PROBE)
    return dict(os.environ, PYTHONPATH=str(tmp / "mods"), PROBE_VALUE="seen", OMP_NUM_THREADS="1")


def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


async def test_a_fork_is_what_python_m_would_have_been(tmp_path: Path):
    env = _probe(tmp_path)
    t = Template(dict(os.environ, GPIPE_TOKEN="hush"), preload=["torch"], hidden=["GPIPE_TOKEN"])
    try:
        await t.start()
        core = sorted(os.sched_getaffinity(0))[-1]
        c = await t.spawn("zprobe", ["3", "--flag"], child_env(env, [core]), stdin=True, stdout=True)
        assert isinstance(c, Forked)
        assert c.stdin is not None and c.stdout is not None
        c.stdin.write(b"hello\n")
        await c.stdin.drain()
        c.stdin.close()
        out = json.loads(await c.stdout.readline())
        assert await asyncio.wait_for(c.wait(), 60) == 3 and c.returncode == 3
        other = await t.spawn("zprobe", ["0"], env, stdin=True, stdout=True)
        assert isinstance(other, Forked) and other.stdin is not None and other.stdout is not None
        other.stdin.close()
        assert json.loads(await other.stdout.readline())["draw"] != out.pop("draw")  # numpy reseeded in each
        assert await asyncio.wait_for(other.wait(), 60) == 0
        assert out == {"argv": ["3", "--flag"], "cwd": os.getcwd(), "env": "seen", "parent": None, "threads": 1,
                       "cores": [core], "leader": True, "line": "hello", "main": "__main__"}
        assert not any(e.startswith(b"GPIPE_TOKEN=") for e in _environ(t.proc.pid))  # type: ignore[union-attr]
    finally:
        await t.close()


async def test_a_fork_is_killed_by_process_group_and_ends_with_the_template(tmp_path: Path):
    env = _probe(tmp_path)
    t = Template(os.environ, preload=["torch"])
    try:
        c = await t.spawn("zprobe", ["0"], env, stdin=True)  # waits on its stdin
        assert (Path(f"/proc/{c.pid}/comm").read_text().strip()) == "gpipe:zprobe"
        os.killpg(c.pid, signal.SIGKILL)
        assert await asyncio.wait_for(c.wait(), 60) == -signal.SIGKILL
        spare = await t.spawn("zprobe", ["0"], env, stdin=True)
        t.kill_now()  # the template dies: what it forked dies with it, and says so
        assert await asyncio.wait_for(spare.wait(), 60) == -signal.SIGKILL
        for _ in range(200):
            if not Path(f"/proc/{spare.pid}").exists() or "Z" in Path(f"/proc/{spare.pid}/stat").read_text().split()[2]:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"process {spare.pid} outlived its template")
        again = await t.spawn("zprobe", ["5"], env)  # a template that died is started anew
        assert await asyncio.wait_for(again.wait(), 60) == 5
    finally:
        await t.close()


async def test_templates_closed_together_end_at_once(tmp_path: Path):
    """run closes its two templates at once (the workers' is a fork of the planner's): the fork, killed by its
    owner, ends as soon as it is gone, not after the wait for an exit code its dead parent cannot report
    (zygote.EXIT_REPORT_S, 2 s on every `run` before)."""
    env = _probe(tmp_path)
    parent = Template(os.environ, preload=["torch"])
    child = Template(os.environ, preload=["json"], parent=parent)
    try:
        c = await child.spawn("zprobe", ["0"], env, stdin=True)  # the child template is ready
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(parent.close(), 60)  # as it may come first in run's gather
        await asyncio.wait_for(child.close(), 60)
        assert loop.time() - t0 < EXIT_REPORT_S
        assert await asyncio.wait_for(c.wait(), 10) == -signal.SIGKILL
    finally:
        await asyncio.gather(child.close(), parent.close())


async def test_without_a_template_processes_start_as_before(tmp_path: Path):
    env = _probe(tmp_path)
    t = Template(os.environ, preload=["gpipe_no_such_module"])  # the template dies importing it
    try:
        c = await t.spawn("zprobe", ["4"], env, stdout=True)
        assert not isinstance(c, Forked)
        assert c.stdout is not None and json.loads(await c.stdout.readline())["env"] == "seen"
        assert await asyncio.wait_for(c.wait(), 60) == 4
    finally:
        await t.close()


def test_a_run_forks_its_attempt_processes(cli):
    """`run`: the coordinator's attempt process comes from its template, both workers' from the workers' template,
    a fork of it; all end with the run."""
    path = cli.write(job(name="z", model=slow_mlp(8, 0.05), balance=[2, 2], steps=40, checkpoint_every=20,
                         data=regression(8, 8, 4)))

    def forked() -> list[str]:
        names = []
        for pid in tagged_pids(cli.tag):
            with contextlib.suppress(OSError):
                names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        return sorted(n for n in names if n.startswith("gpipe:"))

    template = [] if "GPIPE_TEMPLATE_SOCKET" in cli.env else ["gpipe:template"]  # a shared one forks it none
    with cli.running("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress") as p:
        wait_for(lambda: forked() == ["gpipe:attempt", *template, "gpipe:worker", "gpipe:worker"], 120,
                 "the attempt processes, forked")
        _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    assert not cli.leftovers()


async def test_a_shared_template_serves_several_owners_and_kills_the_forks_of_one_that_goes(tmp_path: Path):
    """`--listen`: each owner hears of its own forks only, and the forks of an owner that goes away die with
    its connection while another's run on; the forks die with the template too."""
    env = _probe(tmp_path)
    path = str(tmp_path / "template.sock")
    shared = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpipe.service.zygote", "--listen", path, "torch", start_new_session=True,
        env=child_env(dict(os.environ)))
    owners = [Template(dict(os.environ, GPIPE_TEMPLATE_SOCKET=path), preload=["no_such_module"]) for _ in range(2)]
    try:
        wait_for(lambda: os.path.exists(path), 60, "the shared template's socket")
        a, b = owners
        ca = await a.spawn("zprobe", ["3"], env, stdin=True)
        cb = await b.spawn("zprobe", ["0"], env, stdin=True)  # waits on its stdin
        assert isinstance(ca, Forked) and isinstance(cb, Forked) and a.proc is None and b.proc is None
        assert ca.stdin is not None
        ca.stdin.close()
        assert await asyncio.wait_for(ca.wait(), 60) == 3 and not a.children  # its exit came to `a` only
        assert cb.returncode is None and cb.pid in b.children
        kept = await a.spawn("zprobe", ["0"], env, stdin=True)
        await b.close()  # `b` goes: its fork is killed, `a`'s runs on
        assert await asyncio.wait_for(cb.wait(), 60) == -signal.SIGKILL
        wait_for(lambda: not Path(f"/proc/{cb.pid}").exists(), 10, "the fork of the owner that went to end")
        assert kept.returncode is None and Path(f"/proc/{kept.pid}").exists()
        os.killpg(shared.pid, signal.SIGKILL)  # the template dies: so do the forks left
        assert await asyncio.wait_for(kept.wait(), 60) == -signal.SIGKILL
        wait_for(lambda: not Path(f"/proc/{kept.pid}").exists(), 10, "the fork to die with the template")
    finally:
        for t in owners:
            await t.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shared.pid, signal.SIGKILL)
        await shared.wait()
