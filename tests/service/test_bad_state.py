"""Bad state on disk and full disks, end to end: real processes, a real tmpfs, real job records.

- A full disk fails the job at once (no restart could help), naming the path
  and the errno; the workers are freed; once there is room, `submit --resume`
  carries on to the one-device weights.
- A job record that cannot be read is skipped at start with one line naming
  its file, listed, and its name (and files) are never taken by a new job.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.support import reference
from tests.support.service import Service
from tests.support.spec import SERVICE, job, slow_mlp


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A small tmpfs at `path`, unmounted after the block, whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """Write a file under `path` until the disk is full; return it (delete it to free the room)."""
    filler = path / "filler"
    with contextlib.suppress(OSError), filler.open("wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    return filler


@pytest.mark.multiprocess
def test_run_on_a_full_disk_fails_naming_the_path_and_errno_once_its_restarts_are_spent(cli):
    with tmpfs(cli.tmp / "small", "1m") as state:
        spec = job(SERVICE, name="full", model={"factory": "mlp", "args": {"width": 256, "depth": 4}},
                   data={"factory": "random_regression", "args": {"n": 16, "in_features": 256, "out_features": 256},
                         "batch_size": 8},
                   steps=3, checkpoint_every=1, max_restarts=1, balance="by_params")
        r = cli.run("run", str(cli.write(spec)), "--state-dir", str(state), "--no-progress")
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    # A full disk may be given room while the job waits (policy.SPACE_WAIT_S): restarted, then failed.
    assert "ENOSPC" in last and str(state) in last and "gave up after 1 restart" in last, r.stderr
    assert "restart 1 of 1" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.multiprocess
def test_serve_on_a_full_disk_restarts_the_job_which_resumes_by_itself_once_there_is_room(cli):
    s = Service(cli)
    with tmpfs(s.state, "16m"):
        try:
            s.start_serve()
            s.start_worker(0)
            s.start_worker(1)
            spec = job(SERVICE, name="full", model=slow_mlp(16, 0.03),
                       steps=40, checkpoint_every=5, max_restarts=10)
            assert s.client("submit", str(cli.write(spec))).returncode == 0
            ck = s.state / "full" / "checkpoints" / "step-5" / "MANIFEST.json"
            s.wait_for(ck.exists, "checkpoint step-5", 90)
            filler = fill(s.state)
            s.wait_for(lambda: "ENOSPC" in s.client("status", "full").stdout, "the job to meet the full disk", 90)
            status = s.client("status", "full").stdout
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line and line[0] != " ")
            assert fields["state"].strip() in ("RESTARTING", "RUNNING"), status  # never FAILED: room may be made
            assert "ENOSPC" in fields["error"] and str(s.state / "full") in fields["error"], status
            # Nothing half-written is taken as good: with room again, it resumes by itself.
            filler.unlink()
            r = s.client("logs", "full", "--follow", timeout=180)
            assert r.returncode == 0, r.stderr
            got = load_file(s.state / "full" / "model.safetensors")
            want = reference.train(spec)
            assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6
        finally:
            s.stop_all()


@pytest.mark.multiprocess
def test_an_unreadable_record_is_listed_skipped_and_its_name_and_files_are_kept(cli):
    s = Service(cli)
    bad = s.state / "old"
    (bad / "checkpoints" / "step-5").mkdir(parents=True)
    (bad / "checkpoints" / "step-5" / "stage-0.safetensors").write_bytes(b"weights")
    (bad / "job.json").write_text(json.dumps({"name": "old", "spec_yaml": "", "steps": "twenty"}))
    (s.state / "notjson").mkdir()
    (s.state / "notjson" / "job.json").write_text("{ this is not json")
    try:
        s.start_serve()
        assert f"skipping unreadable job record {bad / 'job.json'}" in s.log("serve")
        assert str(s.state / "notjson" / "job.json") in s.log("serve")
        r = s.client("list")
        assert r.returncode == 0 and "old" in r.stdout and "notjson" in r.stdout, r.stderr
        r = s.client("submit", str(cli.write(job(SERVICE, name="old"))))
        assert r.returncode == 2 and "exists" in r.stderr
        r = s.client("submit", "--resume", "old")
        assert r.returncode == 2 and "record" in r.stderr, r.stderr
        (s.state / "orphan").mkdir()  # a job's files whose job.json is gone
        (s.state / "orphan" / "metrics.jsonl").write_text("{}\n")
        r = s.client("submit", str(cli.write(job(SERVICE, name="orphan"))))
        assert r.returncode == 2 and "holds the files" in r.stderr, r.stderr
        assert (s.state / "orphan" / "metrics.jsonl").read_text() == "{}\n"
        assert (bad / "checkpoints" / "step-5" / "stage-0.safetensors").read_bytes() == b"weights"
        assert json.loads((bad / "job.json").read_text())["steps"] == "twenty"  # nothing on disk changed
        # Other jobs run as ever.
        s.start_worker(0)
        s.start_worker(1)
        assert s.client("submit", str(cli.write(job(SERVICE, name="fine"))), "--follow").returncode == 0
    finally:
        s.stop_all()


async def test_health_goes_not_serving_if_the_scheduler_dies(tmp_path, monkeypatch):
    import asyncio
    import signal

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gpipe.coordinator.server import serve as server
    from gpipe.coordinator.supervisor import core as supervisor
    from gpipe.service import net
    from tests.support.ports import free_port
    async def broken(self):
        await asyncio.sleep(0.2)
        raise RuntimeError("a bug in the scheduler")

    monkeypatch.setattr(supervisor.Supervisor, "serve_forever", broken)
    monkeypatch.setattr(net, "bind_to", lambda host: None)  # the test process keeps its interfaces
    port, ready = free_port(), asyncio.Event()
    task = asyncio.create_task(server.serve("127.0.0.1", port, tmp_path / "state", ready=ready))
    await asyncio.wait_for(ready.wait(), 30)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            seen = []
            for _ in range(100):
                seen.append((await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status)
                if seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.05)
            assert seen[0] == health_pb2.HealthCheckResponse.SERVING
            assert seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, seen
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # serve's own handler: it stops as it would in production
        await asyncio.wait_for(task, 30)
