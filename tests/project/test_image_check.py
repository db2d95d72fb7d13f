"""deploy/image_check.py: its containers are the manifests' pods (command, env, user, read-only root,
writable mounts only where the manifests mount), and it skips, saying why, where no engine runs.

The image's build and run themselves are not tested here (minutes, and a container engine): run
`.venv/bin/python deploy/image_check.py` (deploy/README.md has its latest output)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.cli import ROOT

SCRIPT = ROOT / "deploy" / "image_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("image_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ic = _load()


def docker_run(pod) -> tuple[dict[str, list[str]], list[str]]:
    """`docker run`'s options (each with its values, in order) and the command after the image."""
    args = pod.run_args("IMAGE", "NET")
    assert args[0] == "run"
    at = args.index("IMAGE")
    opts: dict[str, list[str]] = {}
    i = 1
    while i < at:
        if i + 1 < at and not args[i + 1].startswith("--"):
            opts.setdefault(args[i], []).append(args[i + 1])
            i += 2
        else:
            opts.setdefault(args[i], []).append("")
            i += 1
    return opts, args[at + 1:]


def mounts(opts: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """--mount's by their destination: {dst: {type, src, readonly, ...}}."""
    out = {}
    for m in opts.get("--mount", []):
        fields = dict(f.partition("=")[::2] for f in m.split(","))
        out[fields["dst"]] = fields
    return out


def test_a_worker_container_is_the_manifests_pod():
    sts = ic.manifest("base/workers.yaml", "StatefulSet")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    pod = ic.Pod(sts, "gpipe-ci-w1", "gpipe-worker-1", ordinal=1, cores=1,
                 mounts={"tokens": "/srv/tokens", "logs": "gpipe-ci-logs", "tmp": "gpipe-ci-tmp"})
    opts, command = docker_run(pod)
    assert command == [*c["command"], *c["args"]]
    env = dict(e.partition("=")[::2] for e in opts["-e"])
    # RANK from the pod index; OMP_NUM_THREADS from the CPU limit, here this host's share of it.
    assert env == {"RANK": "1", "GPIPE_COORDINATOR": "gpipe-coordinator:7000", "OMP_NUM_THREADS": "1"}
    assert opts["--cpus"] == ["1"]
    assert opts["--user"] == ["10001:10001"] and opts["--group-add"] == ["10001"]
    assert "--read-only" in opts and opts["--cap-drop"] == ["ALL"]
    assert opts["--security-opt"] == ["no-new-privileges"]
    assert opts["--stop-timeout"] == [str(sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])]
    assert opts["--memory"] == [str(4 * 2**30)] and opts["--shm-size"] == [str(2**30)]
    # Writable: exactly the manifest's mounts that are not read-only (besides /dev/shm); the token
    # folder read-only.
    m = mounts(opts)
    writable = {x["mountPath"] for x in c["volumeMounts"] if not x.get("readOnly")} - {"/dev/shm"}
    assert {dst for dst, f in m.items() if "readonly" not in f} == writable
    assert m["/etc/gpipe/tokens"] == {"type": "bind", "src": "/srv/tokens", "dst": "/etc/gpipe/tokens",
                                      "readonly": ""}


def test_the_coordinator_keeps_its_limit_and_state_on_a_volume():
    sts = ic.manifest("base/coordinator.yaml", "StatefulSet")
    pod = ic.Pod(sts, "gpipe-ci-c", "gpipe-coordinator-0", aliases=["gpipe-coordinator"],
                 mounts={"state": "gpipe-ci-state", "tokens": "/srv/t", "tmp": "gpipe-ci-tmp"})
    opts, command = docker_run(pod)
    assert command[:2] == ["gpipe-coordinator", "serve"] and "--state-dir=/var/lib/gpipe" in command
    assert opts["--cpus"] == ["2"] and "OMP_NUM_THREADS=2" in opts["-e"]
    assert opts["--network-alias"] == ["gpipe-coordinator"]   # the Service's name the others use
    assert mounts(opts)["/var/lib/gpipe"]["type"] == "volume"


def test_a_mount_with_nothing_given_for_it_is_an_error_not_a_writable_path():
    sts = ic.manifest("base/workers.yaml", "StatefulSet")
    pod = ic.Pod(sts, "gpipe-ci-w0", "gpipe-worker-0", mounts={"tokens": "/srv/tokens", "tmp": "v"})
    with pytest.raises(ic.Failed, match="volume logs at /var/log/gpipe"):
        pod.run_args("IMAGE", "NET")


def _script(path: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=60)


@pytest.mark.multiprocess
def test_it_skips_naming_why_where_no_engine_runs(tmp_path: Path):
    p = _script(str(tmp_path))   # no docker on PATH
    assert p.returncode == 0 and "skipped" in p.stdout and "docker" in p.stdout, p.stdout + p.stderr
    fake = tmp_path / "docker"   # a docker whose daemon does not answer
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon at unix:///x.sock' >&2\nexit 1\n")
    fake.chmod(0o755)
    p = _script(str(tmp_path))
    assert p.returncode == 0 and "skipped" in p.stdout and "Cannot connect" in p.stdout, p.stdout + p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.multiprocess
def test_a_bad_phase_is_one_line_and_exit_2(tmp_path: Path):
    p = _script(str(tmp_path), "--phases", "build,deploy")
    assert p.returncode == 2 and "--phases" in p.stderr and "deploy" in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
