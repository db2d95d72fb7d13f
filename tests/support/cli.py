"""Run the CLI as users do: real processes, bounded in time, and nothing left behind (the `cli` fixture of
tests/conftest.py hands each test a Cli)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]  # the repository's root
FOLDERS: dict[str, Path] = {}  # a Cli's tag -> its folder, where the processes it starts work


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries GPIPE_TEST_TAG=tag, and the forks of the shared template (whose
    /proc environ is the template's) that work in that Cli's folder."""
    found = []
    needle = f"GPIPE_TEST_TAG={tag}".encode()
    folder = FOLDERS.get(tag)
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0") or (
                        folder is not None and Path(os.readlink(d / "cwd")).is_relative_to(folder)):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


_shared: tuple[subprocess.Popen[bytes], str] | None = None


def shared_template() -> str | None:
    """The socket of this pytest process's shared attempt template (gpipe.service.zygote --listen), started on first
    use: the CLI processes of its tests fork their attempt processes from it instead of each importing torch
    in a template of its own. Off unless GPIPE_TEST_SHARED_TEMPLATE=1: with it, jobs start fast enough that
    service tests which act on a running job (stop, partition, eviction) race it to its end."""
    global _shared
    if os.environ.get("GPIPE_TEST_SHARED_TEMPLATE", "0") != "1":
        return None
    if _shared is None or _shared[0].poll() is not None:
        from gpipe.coordinator.supervisor.launcher import COORDINATOR_PRELOAD
        from gpipe.proc import child_env
        from gpipe.worker.agent import WORKER_PRELOAD

        preload = dict.fromkeys(WORKER_PRELOAD + COORDINATOR_PRELOAD)  # what `run`'s template imports

        folder = tempfile.mkdtemp(prefix="gpipe-tpl-")
        path = os.path.join(folder, "s")
        env = child_env({k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")})
        p = subprocess.Popen([sys.executable, "-m", "gpipe.service.zygote", "--listen", path, *preload], cwd=folder,
                             env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30  # it binds the socket before it imports
        while not os.path.exists(path) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        atexit.register(_end_shared, p, folder)
        _shared = p, path
    return _shared[1]


def _end_shared(p: subprocess.Popen[bytes], folder: str) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)  # its forks die with it
    p.wait()
    shutil.rmtree(folder, ignore_errors=True)


def process_kind(pid: int) -> str | None:
    """'coordinator' or 'worker' for an attempt process, by the name a fork of the template takes
    (gpipe.service.zygote: gpipe:attempt, gpipe:worker) or, started anew, its `python -m MODULE` command line."""
    try:
        comm = (Path("/proc") / str(pid) / "comm").read_text().strip()
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0") + [b"", b""]
    except OSError:
        return None
    if comm.startswith("gpipe:"):
        return {"gpipe:attempt": "coordinator", "gpipe:worker": "worker"}.get(comm)
    if b"-m" not in argv[1:3]:  # python [-P] -m MODULE
        return None
    module = argv[argv.index(b"-m") + 1]
    return {b"gpipe.coordinator.attempt.process": "coordinator", b"gpipe.worker": "worker"}.get(module)


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads in this process set to `n` for a while: a one-device reference computed with
    the stages' thread count sums in their order (MKL and OpenMP split a reduction by the threads they get)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def wait_for(cond, timeout: float, what: str, every: float = 0.05) -> None:
    """Poll `cond` until it holds; fail the test naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(every)
    pytest.fail(f"timed out waiting for {what}")


class Cli:
    def __init__(self, tmp: Path):
        self.tmp, self.tag = tmp, uuid.uuid4().hex
        # GPIPE_OVERSUBSCRIBE: a test's workers (replicas x stages) share this machine's few cores without
        # `run`'s warning line about it.
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), GPIPE_TEST_TAG=self.tag, GPIPE_OVERSUBSCRIBE="1")
        self.env.pop("OMP_NUM_THREADS", None)
        if (socket_path := shared_template()) is not None:
            self.env["GPIPE_TEMPLATE_SOCKET"] = socket_path
        FOLDERS[self.tag] = tmp

    def write(self, spec: dict, name: str = "job.yaml") -> Path:
        path = self.tmp / name
        path.write_text(yaml.safe_dump(spec))
        return path

    def start(self, *args: str, cores: str | None = None) -> subprocess.Popen:
        """The CLI with `args`; with `cores` ('0'), on those cores only, as on a machine that has no others."""
        pin = ["taskset", "-c", cores] if cores is not None else []
        return subprocess.Popen(
            [*pin, sys.executable, "-m", "gpipe.coordinator.cli.main", *args], cwd=self.tmp, env=self.env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )

    @contextlib.contextmanager
    def running(self, *args: str):
        """The CLI in the background; its process group is killed if it outlives the block."""
        p = self.start(*args)
        try:
            yield p
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()

    def run(self, *args: str, timeout: float = 120, cores: str | None = None) -> subprocess.CompletedProcess:
        p = self.start(*args, cores=cores)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            pytest.fail(f"gpipe-coordinator {' '.join(args)} did not finish in {timeout}s:\n{err[-3000:]}")
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def modules_of(self, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, set[str]]:
        """The CLI run with `args` as `run` does, and every module its process had imported when it exited."""
        out = self.tmp / f"modules-{uuid.uuid4().hex}.txt"
        probe = ("import atexit, sys\n"
                 f"atexit.register(lambda: open({str(out)!r}, 'w').write('\\n'.join(sorted(sys.modules))))\n"
                 "from gpipe.coordinator.cli.main import main\n"
                 "sys.argv[0] = 'gpipe-coordinator'\n"
                 "sys.exit(main())\n")
        p = subprocess.run([sys.executable, "-c", probe, *args], cwd=self.tmp, env=self.env, capture_output=True,
                           text=True, timeout=timeout)
        return p, set(out.read_text().split()) if out.exists() else set()

    def leftovers(self) -> list[int]:
        return tagged_pids(self.tag)


def end_leftovers(c: Cli) -> list[int]:
    """Kill what `c` started and left running; return those pids (a test fails on any)."""
    deadline = time.monotonic() + 3  # a killed process takes a moment to go
    while (left := c.leftovers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def one_error_line(stderr: str, starts: str) -> str:
    """The one line of `stderr`, which starts with `starts` (no traceback)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(starts) and "Traceback" not in stderr, stderr
    return lines[0]
