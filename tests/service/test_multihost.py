"""serve and three workers on four "hosts" (network namespaces), run as deploy/ says, through cut links.

Each "pod" runs the command, args and env of the rendered cpu overlay
(`kubectl kustomize deploy/overlays/cpu`), with only what Kubernetes would
fill in: the rank (the pod-index label), the CPU limit, the Service's address
(its DNS name), and where the volumes are mounted. No `--host` anywhere: the
workers find their address by the route to the coordinator, and serve's
attempts by the route to their workers. The job is the example job's, with
three stages and a model slow enough to be cut mid-run: one worker's link is
cut until serve has dropped it and the job is RESTARTING, then the coordinator's
until every worker is dropped, and then two workers lose each other while
both still reach the coordinator; the job must end SUCCEEDED on the
uninterrupted weights, with no process touched.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.torch import load_file

from gpipe.coordinator.supervisor.records import COMMIT_GRACE_S
from tests.support import netns, reference
from tests.support.cli import ROOT
from tests.support.spec import slow_mlp

WORKERS = 3
API_PORT = 7000
HEARTBEAT_TIMEOUT_S = 5  # serve's (env GPIPE_HEARTBEAT_TIMEOUT_S; default 10): a cut link is seen sooner
# A lost worker is dropped after HEARTBEAT_TIMEOUT_S; its attempt then has up to COMMIT_GRACE_S to commit
# and exit (a checkpoint it was pulling from the cut stage waits that long) before the job is RESTARTING.
RESTARTING_WITHIN_S = HEARTBEAT_TIMEOUT_S + COMMIT_GRACE_S + 30
MOUNTS_IN_TMP = ("/var/lib/gpipe", "/etc/gpipe/tokens", "/var/log/gpipe", "/tmp", "/job")


def _render(target: str) -> list[dict[str, Any]]:
    from tests.support.deploy import render

    return render(target)


def pod_command(obj: dict[str, Any], root: Path, fill: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """A workload's first container as a process: argv and env, as the kubelet would run it.

    Volume mounts become folders under `root`; `fill` gives the downward API's values (RANK) and the
    Service's address; `$(VAR)` in env and args expands as Kubernetes expands it.
    """
    c = obj["spec"]["template"]["spec"]["containers"][0]

    where = re.compile(r"(^|=)(" + "|".join(map(re.escape, MOUNTS_IN_TMP)) + r")(?=/|$)")

    def mounted(text: str) -> str:
        text = where.sub(lambda m: m[1] + str(root / m[2].strip("/").replace("/", "-")), text)
        return text.replace(f"gpipe-coordinator:{API_PORT}", fill["coordinator"])

    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(root / "tmp"),
           "PYTHONPATH": str(ROOT),  # the image's packages: the model's (tests.support.models) and gpipe's
           "GPIPE_TEST_TAG": fill["tag"]}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = mounted(re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), e["value"]))
        elif "fieldRef" in e.get("valueFrom", {}):
            assert "pod-index" in e["valueFrom"]["fieldRef"]["fieldPath"], e  # the only one the pods use
            env[e["name"]] = fill["rank"]
        elif "resourceFieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = "1"  # limits.cpu, rounded up, as the kubelet gives it
    argv = [mounted(re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), a))
            for a in [*c.get("command", []), *c.get("args", [])]]
    return argv, env


def _steps(out: Path) -> list[tuple[int, int]]:
    """(attempt, step) of every logged step so far."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        rows.append((m["attempt"], m["step"]))
    return rows


def _history(out: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((out / "job.json").read_text())["history"]
    except (OSError, ValueError, KeyError):
        return []


class Cluster:
    def __init__(self, hosts: netns.Hosts, root: Path, tag: str):
        self.hosts, self.root, self.tag = hosts, root, tag
        self.logs: dict[str, Path] = {}
        objs = _render("overlays/cpu")
        self.serve_obj = next(o for o in objs if o["kind"] == "StatefulSet" and "coordinator" in o["metadata"]["name"])
        self.worker_obj = next(o for o in objs if o["kind"] == "StatefulSet" and "worker" in o["metadata"]["name"])
        self.job_obj = next(o for o in _render("example") if o["kind"] == "Job")
        tokens = root / "etc-gpipe-tokens"
        tokens.mkdir(parents=True)
        (tokens / "client-token").write_text("client-" + tag)
        (tokens / "worker-token").write_text("worker-" + tag)
        for m in MOUNTS_IN_TMP:
            (root / m.strip("/").replace("/", "-")).mkdir(parents=True, exist_ok=True)

    def run(self, host: int, obj: dict[str, Any], name: str, rank: str = "", env: dict[str, str] | None = None) -> None:
        """`obj`'s pod as a process on `host`, with `env` added to the manifest's."""
        argv, pod_env = pod_command(obj, self.root, {"rank": rank, "tag": self.tag,
                                                     "coordinator": f"{self.hosts.addr(0)}:{API_PORT}"})
        env = {**pod_env, **(env or {})}
        self.logs[name] = self.root / f"{name}.log"
        self.hosts.spawn(host, argv, env, self.logs[name], cwd=self.root / "tmp")

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace") if name in self.logs else ""

    def wait_for(self, cond: Any, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.1)
        logs = "\n".join(f"--- {k}\n{self.log(k)[-3000:]}" for k in self.logs)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}")


def job_spec() -> dict[str, Any]:
    """The example job's spec, on three stages, with a model slow enough to be cut mid-run."""
    spec = yaml.safe_load((ROOT / "deploy" / "example" / "job.yaml").read_text())
    spec.update(name="multihost", stages=WORKERS, balance=[2, 1, 1], steps=45, checkpoint_every=5,
                max_restarts=5, peer_timeout_s=5,
                model=slow_mlp(16, 0.04),
                data={**spec["data"], "args": {"n": 256, "in_features": 16, "out_features": 16}, "batch_size": 16})
    return spec


@pytest.fixture
def hosts():
    if (why := netns.skip_reason()) is not None:
        print(f"skipped: {why}", file=sys.stderr)
        pytest.skip(why)
    with netns.Hosts(1 + WORKERS) as h:
        yield h


@pytest.mark.multiprocess
@pytest.mark.timeout(600)  # its waits, each bounded by what serve may take under load, add up past 180 s
def test_four_hosts_from_the_manifests_train_through_cut_links_to_the_one_device_weights(cli, tmp_path, hosts):
    c = Cluster(hosts, tmp_path, cli.tag)
    spec = job_spec()
    (tmp_path / "job" / "job.yaml").write_text(yaml.safe_dump(spec))
    c.run(0, c.serve_obj, "serve", env={"GPIPE_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S)})
    c.wait_for(lambda: "coordinator serving on" in c.log("serve"), "serve to start", 60)
    for rank in range(WORKERS):
        c.run(1 + rank, c.worker_obj, f"worker{rank}", rank=str(rank))
    for rank in range(WORKERS):
        c.wait_for(lambda rank=rank: f"worker for rank {rank} registered" in c.log("serve"), f"rank {rank}", 60)
        # No --host: each worker took its own host's address, the one that routes to the coordinator.
        assert f"data-plane address {hosts.addr(1 + rank)}" in c.log(f"worker{rank}")
    c.run(0, c.job_obj, "submit")  # the example Job's pod: submit --follow

    out = tmp_path / "var-lib-gpipe" / "multihost"
    c.wait_for(lambda: len(_steps(out)) >= 10, "10 steps", 120)

    # One worker's link is cut: the coordinator drops it after its heartbeats stop and the attempt
    # fails; once the job is RESTARTING the link is back, the worker registers again and the job resumes.
    cut = time.time()
    hosts.cut(2)
    c.wait_for(lambda: any(h["state"] == "RESTARTING" and h["time_unix"] > cut for h in _history(out)),
               "RESTARTING after the cut", RESTARTING_WITHIN_S)
    first = next(h for h in _history(out) if h["state"] == "RESTARTING")
    # Dropped (its heartbeats stopped, or its command stream was seen to break): mended only now.
    assert re.match(r"stage 1's worker (missed its heartbeats|disconnected)", first["message"]), first
    restarting_s = first["time_unix"] - cut
    hosts.mend(2)
    mended = time.monotonic()
    c.wait_for(lambda: c.log("serve").count("worker for rank 1 registered") >= 2, "rank 1 to register again", 60)
    c.wait_for(lambda: any(a == 2 for a, _ in _steps(out)), "a step of attempt 2", 120)
    first_step_s = time.monotonic() - mended
    c.wait_for(lambda: sum(a == 2 for a, _ in _steps(out)) >= 10, "10 steps of attempt 2", 120)

    # The coordinator's own link is cut: every worker is lost at once, and it says so (serve and its
    # records are on host 0: the history is read there while cut).
    cut2 = time.time()
    hosts.cut(0)
    c.wait_for(lambda: any(h["state"] == "RESTARTING" and h["time_unix"] > cut2 for h in _history(out)),
               "RESTARTING after the coordinator's cut", RESTARTING_WITHIN_S)
    hosts.mend(0)
    c.wait_for(lambda: sum(a == 3 for a, _ in _steps(out)) >= 5, "5 steps of attempt 3", 120)

    # Stages 0 and 1 lose each other while both still reach the coordinator: their heartbeats go on,
    # so the stages' own waits tell (peer_timeout_s, 5 s here), not step_timeout_s (300 s).
    cut3 = time.time()
    hosts.block(1, 2)
    c.wait_for(lambda: any(h["state"] == "RESTARTING" and h["time_unix"] > cut3 for h in _history(out)),
               "RESTARTING after the partition between workers", 90)
    hosts.unblock(1, 2)
    c.wait_for(lambda: "multihost: SUCCEEDED" in c.log("submit"), "the job to succeed", 240)
    history = _history(out)
    assert history[-1]["state"] == "SUCCEEDED", history
    later = [h["message"] for h in history if h["state"] == "RESTARTING" and cut2 < h["time_unix"] < cut3]
    assert later and "all 3 workers missed their heartbeats" in later[0], later
    split = [h for h in history if h["state"] == "RESTARTING" and h["time_unix"] > cut3]
    assert "partition between workers" in split[0]["message"], split
    print(f"\npartition between workers -> RESTARTING {split[0]['time_unix'] - cut3:.1f}s", file=sys.stderr)
    got = load_file(out / "model.safetensors")
    want = reference.train(spec)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6
    print(f"\nlink cut -> RESTARTING {restarting_s:.1f}s; mended -> next trained step {first_step_s:.1f}s",
          file=sys.stderr)
