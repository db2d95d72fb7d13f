#!/usr/bin/env python3
"""Build deploy/Dockerfile's CPU image and run the service from it as the manifests say, for real.

    .venv/bin/python deploy/image_check.py --make-base           # every phase, on a base from Debian's packages
    .venv/bin/python deploy/image_check.py --phases build,stop   # the docker stop run again, on a new image

Not part of `make test` (it builds an image: minutes). Phases:

- build: the image `gpipe-ci:<version>`, from PYTHON_IMAGE (--python-image, or --make-base: Debian
  bookworm by `debootstrap` and `docker import`) and package indexes (--pip-index and
  --torch-index, or one made here from this environment's pip configuration: `pip download` of
  torch and gpipe's dependencies, served on 127.0.0.1 to the build alone). Prints the build time
  and the image's size.
- train: on a docker network, `serve`, two workers and the example Job's `submit --follow` as
  containers, each with its manifest's command, args, env, user and group (10001, fsGroup added),
  a read-only root, no capabilities, its CPU and memory limits, and writable volumes only where the
  manifest mounts them (emptyDir: a volume of its own, or tmpfs for medium Memory and /dev/shm; the
  state claim: a volume; the Secret and ConfigMap: read-only binds). The Job's pods are tried
  again as the Job controller does (backoffLimit, podFailurePolicy, its back-off). Trains the
  example to SUCCEEDED, loads its weights from the state volume, asks every pod's gRPC probe port
  and scrapes the coordinator's /metrics.
- stop: the same, with worker 1 stopped by `docker stop -t <terminationGracePeriodSeconds>`
  (SIGTERM, SIGKILL after the grace, as a pod eviction) once the job is past --stop-at-step, then
  started again (the StatefulSet's new pod). Reports the worker's exit code and time to exit, the
  job's states, restarts and the steps that ran twice, and checks the preemption path: exit 0
  within the grace, no step run again, SUCCEEDED.
- stop-serve: the same with serve stopped and started again (the coordinator's pod evicted): the
  same checks, and the example Job must end Complete.

Each run phase makes its own network, volumes and containers (every name starts `gpipe-ci`) and
removes them whatever happens (--keep leaves them for a look). Exit: 0 every phase passed, or no
container engine runs (one line saying why, "skipped"); 1 a phase failed (its lines say what);
2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import html
import http.server
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
PREFIX = "gpipe-ci"
BASE_IMAGE = f"{PREFIX}-debian:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
PORTS = range(45800, 46000)   # the local package index's port on 127.0.0.1
CLIENT_TOKEN = "/etc/gpipe/tokens/client-token"
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
PHASES = ("build", "train", "stop", "stop-serve")

Obj = dict[str, Any]


class Failed(Exception):
    """A phase cannot go on: one line saying what."""


def say(line: str) -> None:
    print(f"image-check: {line}", flush=True)


def docker(*args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None,
           stream: bool = False) -> subprocess.CompletedProcess[str]:
    """`docker ARGS`, within `timeout` seconds; with `check`, a non-zero exit is Failed naming it.
    With `stream`, its output goes to ours as it comes (and is not captured)."""
    what = "docker " + " ".join(args[:3])
    try:
        p = subprocess.run(["docker", *args], text=True, timeout=timeout, env=env,
                           stdout=None if stream else subprocess.PIPE,
                           stderr=subprocess.STDOUT if stream else subprocess.PIPE)
    except subprocess.TimeoutExpired:
        raise Failed(f"{what}: no answer within {timeout:.0f} s") from None
    if check and p.returncode != 0:
        err = (p.stderr or "").strip().splitlines()
        raise Failed(f"{what}: exit {p.returncode}: {err[-1] if err else '(no output)'}")
    return p


def engine_missing() -> str | None:
    """Why no container engine can be used here, or None when one answers."""
    if shutil.which("docker") is None:
        return "no `docker` command on PATH"
    try:
        p = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                           capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "the docker daemon did not answer within 30 s"
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines()
        return f"the docker daemon does not answer: {lines[-1] if lines else 'exit ' + str(p.returncode)}"
    return None


# -- the manifests ------------------------------------------------------------------------------


def manifest(path: str, kind: str) -> Obj:
    """The one object of `kind` in deploy/<path>."""
    found = [d for d in yaml.safe_load_all((DEPLOY / path).read_text()) if d and d["kind"] == kind]
    if len(found) != 1:
        raise Failed(f"deploy/{path}: {len(found)} {kind} objects, expected 1")
    return dict(found[0])


def cpu_count(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    for suffix, scale in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * scale)
    return int(quantity)


@dataclass
class Pod:
    """One pod of a manifest's template, as a `docker run` command line."""

    obj: Obj
    name: str                          # the container's name (gpipe-ci-...)
    hostname: str                      # the pod's name
    ordinal: int = 0                   # the pod index, for a StatefulSet's pods
    aliases: list[str] = field(default_factory=list)   # a Service's name that selects it
    mounts: dict[str, str] = field(default_factory=dict)   # volume name -> a docker volume or host folder
    cores: float | None = None   # the CPUs this host can give it, where fewer than its limit

    @property
    def cpu_limit(self) -> float | None:
        """Its CPU limit: the manifest's, or fewer where this host has not that many for each pod."""
        limit = self.container.get("resources", {}).get("limits", {}).get("cpu")
        if limit is None:
            return self.cores
        return cpu_count(str(limit)) if self.cores is None else min(cpu_count(str(limit)), self.cores)

    @property
    def spec(self) -> Obj:
        return dict(self.obj["spec"]["template"]["spec"])

    @property
    def container(self) -> Obj:
        (c,) = self.spec["containers"]
        return dict(c)

    @property
    def grace_s(self) -> int:
        return int(self.spec.get("terminationGracePeriodSeconds", 30))

    def env(self) -> list[str]:
        out = []
        c = self.container
        for e in c.get("env", []):
            if "value" in e:
                value = str(e["value"])
            elif (ref := e["valueFrom"].get("fieldRef")) is not None:
                if ref["fieldPath"] != "metadata.labels['apps.kubernetes.io/pod-index']":
                    raise Failed(f"{self.hostname}: env {e['name']}: field {ref['fieldPath']} is not known here")
                value = str(self.ordinal)
            elif (res := e["valueFrom"].get("resourceFieldRef")) is not None:
                if res["resource"] != "limits.cpu":
                    raise Failed(f"{self.hostname}: env {e['name']}: resource {res['resource']} is not known here")
                if self.cpu_limit is None:
                    raise Failed(f"{self.hostname}: env {e['name']}: the container has no CPU limit")
                value = str(math.ceil(self.cpu_limit))   # divisor 1, rounded up
            else:
                raise Failed(f"{self.hostname}: env {e['name']}: its source is not known here")
            out += ["-e", f"{e['name']}={value}"]
        return out

    def volumes(self) -> list[str]:
        out = []
        vols = {v["name"]: v for v in self.spec.get("volumes", [])}
        for m in self.container.get("volumeMounts", []):
            path, vol = m["mountPath"], vols.get(m["name"], {})
            ro = ",readonly" if m.get("readOnly") else ""
            empty = vol.get("emptyDir")
            if path == "/dev/shm":
                size = memory_bytes(empty["sizeLimit"]) if empty and "sizeLimit" in empty else 64 * 2**20
                out += ["--shm-size", str(size)]
            elif empty is not None and empty.get("medium") == "Memory":
                size = memory_bytes(empty.get("sizeLimit", "64Mi"))
                out += ["--mount", f"type=tmpfs,dst={path},tmpfs-size={size},tmpfs-mode=1777"]
            elif m["name"] in self.mounts:   # an emptyDir's or a claim's docker volume; a Secret's or
                src = self.mounts[m["name"]]   # a ConfigMap's folder (read-only)
                kind = "bind" if src.startswith("/") else "volume"
                out += ["--mount", f"type={kind},src={src},dst={path}{ro}"]
            else:
                raise Failed(f"{self.hostname}: volume {m['name']} at {path}: nothing given for it")
        return out

    def run_args(self, image: str, network: str) -> list[str]:
        """`docker run` arguments: the manifest's command, args, env, user, limits and mounts."""
        c, pod_sc = self.container, self.spec.get("securityContext", {})
        sc = c.get("securityContext", {})
        args = ["run", "--detach", "--name", self.name, "--hostname", self.hostname,
                "--network", network, "--label", f"{PREFIX}=1"]
        for alias in self.aliases:
            args += ["--network-alias", alias]
        user = sc.get("runAsUser", pod_sc.get("runAsUser"))
        group = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
        if user is not None:
            args += ["--user", f"{user}:{group if group is not None else user}"]
        if (fs_group := pod_sc.get("fsGroup")) is not None:
            args += ["--group-add", str(fs_group)]
        if sc.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        for cap in sc.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", cap]
        if sc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        limits = c.get("resources", {}).get("limits", {})
        if self.cpu_limit is not None:
            args += ["--cpus", f"{self.cpu_limit:g}"]
        if "memory" in limits:
            args += ["--memory", str(memory_bytes(str(limits["memory"])))]
        args += ["--stop-timeout", str(self.grace_s)]
        args += self.env() + self.volumes()
        # The image has no ENTRYPOINT: the manifest's command and args are the whole command line.
        return [*args, image, *c.get("command", []), *c.get("args", [])]


# -- the package index --------------------------------------------------------------------------


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    """What the image installs: torch and gpipe's dependencies, and its build backend."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [*project["build-system"]["requires"], *project["project"]["dependencies"]]


def make_index(root: Path) -> None:
    """A PEP 503 index under root/simple of what this environment's pip resolves (wheels only)."""
    files = root / "files"
    say("package index: pip download of " + ", ".join(r.split(">")[0].split("=")[0] for r in requirements()))
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                        "--dest", str(files), *requirements()],
                       capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines()
        raise Failed(f"pip download: exit {p.returncode}: {lines[-1] if lines else '(no output)'}")
    projects: dict[str, list[str]] = {}
    for f in sorted(files.iterdir()):
        projects.setdefault(normalize(f.name.split("-")[0]), []).append(f.name)
    for name, names in projects.items():
        (root / "simple" / name).mkdir(parents=True)
        links = "".join(f'<a href="../../files/{html.escape(n)}">{html.escape(n)}</a><br>\n' for n in names)
        (root / "simple" / name / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    say(f"package index: {len(projects)} projects, {sum(len(v) for v in projects.values())} files")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def served(root: Path) -> Iterator[str]:
    """root served on 127.0.0.1 (the first free port of PORTS) while inside; yields its /simple URL."""
    handler = functools.partial(_Quiet, directory=str(root))
    for port in PORTS:
        try:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
            break
        except OSError:
            continue
    else:
        raise Failed(f"package index: no free port in {PORTS.start}-{PORTS.stop - 1} on 127.0.0.1")
    thread = threading.Thread(target=server.serve_forever, name="index", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/simple"
    finally:
        server.shutdown()
        server.server_close()


# -- build --------------------------------------------------------------------------------------


def make_base(work: Path) -> str:
    """Debian bookworm with python3 and python3-venv, from Debian's packages: BASE_IMAGE."""
    if docker("image", "inspect", BASE_IMAGE, check=False).returncode == 0:
        say(f"base: {BASE_IMAGE} is there already")
        return BASE_IMAGE
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        raise Failed("--make-base needs debootstrap and root (apt-get install debootstrap)")
    rootfs = work / "rootfs"
    t0 = time.monotonic()
    p = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv",
                        "bookworm", str(rootfs), DEBIAN_MIRROR], capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines() or p.stdout.strip().splitlines()
        raise Failed(f"debootstrap: exit {p.returncode}: {lines[-1] if lines else '(no output)'}")
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):   # the image needs neither
        shutil.rmtree(rootfs / cache, ignore_errors=True)
        (rootfs / cache).mkdir(parents=True, exist_ok=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imp = subprocess.run(["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout, capture_output=True,
                         text=True, timeout=600)
    tar.wait(timeout=600)
    if imp.returncode != 0:
        raise Failed(f"docker import: exit {imp.returncode}: {imp.stderr.strip()}")
    shutil.rmtree(rootfs, ignore_errors=True)
    say(f"base: {BASE_IMAGE} from debootstrap in {time.monotonic() - t0:.0f} s")
    return BASE_IMAGE


def build(image: str, python_image: str, pip_index: str | None, torch_index: str | None, work: Path) -> None:
    with contextlib.ExitStack() as stack:
        indexes = []
        if pip_index is None and torch_index is None:   # one index of this environment's, for both
            root = work / "index"
            make_index(root)
            pip_index = torch_index = stack.enter_context(served(root))
        for arg, url in (("PIP_INDEX_URL", pip_index), ("TORCH_INDEX", torch_index)):
            if url is not None:
                indexes += ["--build-arg", f"{arg}={url}"]
        say(f"build: {image} from {python_image}, packages from {pip_index or 'PyPI'}, "
            f"torch from {torch_index or 'the Dockerfile default index'}")
        t0 = time.monotonic()
        # The legacy builder: it takes --network host (to reach an index on 127.0.0.1) without buildx.
        env = {**os.environ, "DOCKER_BUILDKIT": "0"}
        p = docker("build", "--network", "host", "-f", str(DEPLOY / "Dockerfile"),
                   "--build-arg", f"PYTHON_IMAGE={python_image}",
                   *indexes,
                   "--label", f"{PREFIX}=1", "-t", image, str(REPO),
                   timeout=3600, check=False, env=env)
        took = time.monotonic() - t0
    if p.returncode != 0:
        tail = (p.stdout or "").strip().splitlines()[-15:]
        for line in tail:
            print(f"    {line}")
        raise Failed(f"build: docker build exit {p.returncode} after {took:.0f} s (its last lines above)")
    size = int(docker("image", "inspect", "-f", "{{.Size}}", image).stdout)
    say(f"build: {image} built in {took:.0f} s; image size {size / 2**20:,.0f} MiB")


# -- the service in containers ------------------------------------------------------------------


class Service:
    """serve and the workers of the manifests on a docker network; everything it made goes on exit."""

    def __init__(self, image: str, tag: str, work: Path, keep: bool) -> None:
        self.image, self.tag, self.work, self.keep = image, tag, work / tag, keep
        self.network = f"{PREFIX}-{tag}"
        self.containers: list[str] = []
        self.volumes: list[str] = []
        self.coordinator = manifest("base/coordinator.yaml", "StatefulSet")
        self.workers = manifest("base/workers.yaml", "StatefulSet")
        self.submit = manifest("example/submit.yaml", "Job")
        self.tokens = {"client-token": secrets.token_hex(32), "worker-token": secrets.token_hex(32)}
        self.job_yaml = (DEPLOY / "example" / "job.yaml").read_text()   # the ConfigMap's job.yaml

    def __enter__(self) -> Service:
        self.work.mkdir(parents=True)
        docker("network", "create", "--label", f"{PREFIX}=1", self.network)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.keep:
            say(f"kept: containers {' '.join(self.containers)}; volumes {' '.join(self.volumes)}; "
                f"network {self.network}")
            return
        for c in reversed(self.containers):
            docker("rm", "--force", "--volumes", c, check=False, timeout=120)
        for v in self.volumes:
            docker("volume", "rm", "--force", v, check=False)
        docker("network", "rm", self.network, check=False)

    def _volume(self, name: str) -> str:
        v = f"{PREFIX}-{self.tag}-{name}"
        docker("volume", "create", "--label", f"{PREFIX}=1", v)
        self.volumes.append(v)
        return v

    def _mounts(self, obj: Obj, pod: str) -> dict[str, str]:
        """A docker volume for each emptyDir on disk and claim; a host folder for each Secret and
        ConfigMap, its files with the volume's mode, owned by the pod's fsGroup."""
        spec = obj["spec"]["template"]["spec"]
        fs_group = spec.get("securityContext", {}).get("fsGroup")
        out = {}
        for t in obj["spec"].get("volumeClaimTemplates", []):
            out[t["metadata"]["name"]] = self._volume(f"{t['metadata']['name']}-{pod}")
        for v in spec.get("volumes", []):
            if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory":
                out[v["name"]] = self._volume(f"{pod}-{v['name']}")
            elif "secret" in v or "configMap" in v:
                src = v.get("secret") or v["configMap"]
                folder = self.work / f"{pod}-{v['name']}"
                folder.mkdir()
                for item in src["items"] if "items" in src else [{"key": k, "path": k} for k in self._data(v)]:
                    f = folder / item["path"]
                    f.write_text(self._data(v)[item["key"]])
                    f.chmod(src.get("defaultMode", 0o644))
                    if fs_group is not None and os.geteuid() == 0:
                        os.chown(f, 0, fs_group)
                    elif fs_group is not None:
                        f.chmod(0o444)   # not root: no chown to the group; readable by all instead
                folder.chmod(0o755)
                out[v["name"]] = str(folder)
        return out

    def _data(self, vol: Obj) -> dict[str, str]:
        if "secret" in vol:
            if vol["secret"]["secretName"] != "gpipe-tokens":
                raise Failed(f"volume {vol['name']}: Secret {vol['secret']['secretName']} is not known here")
            return self.tokens
        if vol["configMap"]["name"] != "gpipe-example-job":
            raise Failed(f"volume {vol['name']}: ConfigMap {vol['configMap']['name']} is not known here")
        return {"job.yaml": self.job_yaml}

    def _start(self, pod: Pod) -> None:
        self.containers.append(pod.name)   # first: a container that was made but did not start goes too
        docker(*pod.run_args(self.image, self.network))

    def start_coordinator(self) -> Pod:
        name = self.coordinator["metadata"]["name"]
        pod = Pod(self.coordinator, f"{PREFIX}-{self.tag}-coordinator", f"{name}-0", aliases=[name])
        pod.mounts = self._mounts(self.coordinator, "coordinator")
        self._start(pod)
        return pod

    def start_worker(self, rank: int, cores: float) -> Pod:
        name = self.workers["metadata"]["name"]
        pod = Pod(self.workers, f"{PREFIX}-{self.tag}-worker-{rank}", f"{name}-{rank}", ordinal=rank,
                  cores=cores)
        pod.mounts = self._mounts(self.workers, f"worker-{rank}")
        self._start(pod)
        return pod

    def start_submit(self, job_yaml: str, tries: int = 0) -> Pod:
        """The example Job's pod (its `tries`-th: the Job makes a new pod for each try)."""
        self.job_yaml = job_yaml
        pod = Pod(self.submit, f"{PREFIX}-{self.tag}-submit-{tries}", f"{self.submit['metadata']['name']}-{tries}")
        pod.mounts = self._mounts(self.submit, f"submit-{tries}")
        self._start(pod)
        return pod

    def run_job(self, job_yaml: str, deadline_s: float) -> tuple[int, str]:
        """The example Job to its end, as Kubernetes runs it: a pod that exits non-zero is tried again
        in a new pod after the controller's back-off, up to backoffLimit, unless podFailurePolicy's
        exit codes fail the Job at once. Returns the last pod's exit code and what happened, e.g.
        "Complete (pod exits: 0)"."""
        spec = self.submit["spec"]
        fail_now = {code for r in spec.get("podFailurePolicy", {}).get("rules", [])
                    if r["action"] == "FailJob" for code in r.get("onExitCodes", {}).get("values", [])}
        codes: list[int] = []
        t0 = time.monotonic()
        while True:
            if codes:   # the Job controller's back-off before the next pod: 10 s, doubled each time
                time.sleep(min(360, 10 * 2 ** (len(codes) - 1)))
            pod = self.start_submit(job_yaml, len(codes))
            codes.append(self.wait_exit(pod.name, max(1.0, deadline_s - (time.monotonic() - t0))))
            show(self.logs(pod.name), pod.hostname)
            if codes[-1] == 0 or codes[-1] in fail_now or len(codes) > int(spec.get("backoffLimit", 6)):
                break
        exits = ", ".join(str(c) for c in codes)
        return codes[-1], f"{'Complete' if codes[-1] == 0 else 'Failed'} (pod exits: {exits})"

    def client(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """A client verb run in the coordinator's container, as deploy/README.md shows."""
        return docker("exec", f"{PREFIX}-{self.tag}-coordinator", "gpipe-coordinator", *args,
                      "--auth-token-file", CLIENT_TOKEN, timeout=timeout, check=False)

    def wait_ready(self, deadline_s: float) -> float:
        """Seconds until the coordinator answers its API (the startupProbe's two minutes at most)."""
        t0 = time.monotonic()
        while (p := self.client("list", timeout=30)).returncode != 0:
            if time.monotonic() - t0 > deadline_s:
                raise Failed(f"serve: its API did not answer within {deadline_s:.0f} s: {p.stdout.strip()}"
                             f"{p.stderr.strip()}")
            time.sleep(1)
        return time.monotonic() - t0

    def status(self, job: str) -> tuple[str, int]:
        """The job's state and steps done, from `status` ("", -1 while it cannot say)."""
        out = self.client("status", job, timeout=60).stdout
        state = re.search(r"^state:\s+(\S+)", out, re.M)
        progress = re.search(r"^progress:\s+(\d+)/", out, re.M)
        return (state.group(1) if state else "", int(progress.group(1)) if progress else -1)

    def logs(self, name: str) -> list[str]:
        p = docker("logs", name, check=False, timeout=60)
        return (p.stdout + p.stderr).splitlines()

    def wait_exit(self, name: str, deadline_s: float) -> int:
        p = docker("wait", name, timeout=deadline_s, check=False)
        if p.returncode != 0:
            raise Failed(f"{name}: did not exit within {deadline_s:.0f} s")
        return int(p.stdout.strip())

    def weights(self, job: str) -> str:
        """Load <state>/<job>/model.safetensors from the state volume into the spec's model."""
        state = next(v for v in self.volumes if v.endswith("-state-coordinator"))
        code = ("import safetensors.torch, gpipe.builtins, sys, yaml;"
                "spec = yaml.safe_load(open('/job/job.yaml'));"
                "m = gpipe.builtins.mlp(**spec['model']['args']);"
                f"m.load_state_dict(safetensors.torch.load_file('/var/lib/gpipe/{job}/model.safetensors'));"
                "print(sum(p.numel() for p in m.parameters()), 'parameters loaded')")
        job_dir = self.work / "submit-0-job"
        p = docker("run", "--rm", "--read-only", "--user", "10001:10001", "--network", "none",
                   "--mount", f"type=volume,src={state},dst=/var/lib/gpipe,readonly",
                   "--mount", f"type=bind,src={job_dir},dst=/job,readonly",
                   self.image, "python", "-c", code, check=False)
        if p.returncode != 0:
            raise Failed(f"weights: {job}/model.safetensors does not load: {p.stderr.strip().splitlines()[-1:]}")
        files = docker("run", "--rm", "--read-only", "--user", "10001:10001", "--network", "none",
                       "--mount", f"type=volume,src={state},dst=/var/lib/gpipe,readonly",
                       self.image, "ls", f"/var/lib/gpipe/{job}").stdout.split()
        return f"{p.stdout.strip()}; /var/lib/gpipe/{job}: {' '.join(files)}"


PROBE = """
import sys, urllib.request
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
for target in sys.argv[2:]:
    with grpc.insecure_channel(target) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        print(f"probe {target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}")
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
print(f"scrape {sys.argv[1]}: {sum(1 for ln in text.splitlines() if ln.startswith('gpipe_'))} gpipe_ samples")
for ln in text.splitlines():
    if ln.startswith(("gpipe_jobs{", "gpipe_workers{", "gpipe_job_step{")) and not ln.endswith(" 0.0"):
        print(f"  {ln}")
"""


def probe(svc: Service, coordinator: Pod, workers: list[Pod]) -> None:
    """The manifests' gRPC probes (grpc.health.v1 on each pod's probe port) and a Prometheus scrape
    of the coordinator's --metrics-port, from inside the coordinator's container."""
    def port(pod: Pod) -> int:
        return int(pod.container["startupProbe"]["grpc"]["port"])

    metrics = next(a.split("=", 1)[1] for a in coordinator.container["args"] if a.startswith("--metrics-port="))
    targets = [f"127.0.0.1:{port(coordinator)}", *(f"{w.name}:{port(w)}" for w in workers)]
    p = docker("exec", coordinator.name, "python", "-c", PROBE, f"http://127.0.0.1:{metrics}/metrics",
               *targets, check=False, timeout=60)
    lines = p.stdout.strip().splitlines()
    show(lines, "probe")
    if p.returncode != 0 or sum("SERVING" in ln and "NOT_SERVING" not in ln for ln in lines) != len(targets):
        raise Failed(f"probes: not every pod answers SERVING: {(p.stderr.strip().splitlines() or ['?'])[-1]}")


def bring_up(svc: Service) -> tuple[list[Pod], Pod]:
    coordinator = svc.start_coordinator()
    ready = svc.wait_ready(120)
    ranks = int(svc.workers["spec"]["replicas"])
    # On Kubernetes each worker has its CPU limit to itself (requests = limits). Here the workers
    # share this host's cores: each gets its share, and OMP_NUM_THREADS follows that limit, as the
    # downward API's limits.cpu does. Two threads per worker on 2 shared cores: the example took 162 s, not 38.
    cores = max(1, int(docker("info", "--format", "{{.NCPU}}").stdout) // ranks)
    workers = [svc.start_worker(rank, cores) for rank in range(ranks)]
    limit = workers[0].cpu_limit
    say(f"{svc.tag}: serve answers after {ready:.1f} s; {ranks} workers started, {limit:g} CPUs each "
        f"(the manifest's limit: {workers[0].container['resources']['limits']['cpu']})")
    return workers, coordinator


def show(lines: list[str], prefix: str, keep: int = 40) -> None:
    """The lines (progress bars' carriage returns cut to their last frame); the first and last
    `keep` // 2 when there are more."""
    lines = [ln.rsplit("\r", 1)[-1] for ln in lines if ln.strip()]
    if len(lines) > keep:
        lines = [*lines[: keep // 2], f"... {len(lines) - keep} lines ...", *lines[-keep // 2:]]
    for ln in lines:
        print(f"    {prefix}| {ln}")


def train(svc: Service, deadline_s: float) -> None:
    spec = yaml.safe_load(svc.job_yaml)
    workers, coordinator = bring_up(svc)
    t0 = time.monotonic()
    code, outcome = svc.run_job(svc.job_yaml, deadline_s)
    took = time.monotonic() - t0
    state, steps = svc.status(spec["name"])
    say(f"train: the Job {outcome} after {took:.0f} s; job {spec['name']} {state}, "
        f"{steps}/{spec['steps']} steps")
    if code != 0 or state != "SUCCEEDED":
        for w in workers:
            show(svc.logs(w.name), w.hostname, keep=20)
        raise Failed(f"train: the job ended {state or 'unknown'}, submit exit {code}")
    say("train: weights: " + svc.weights(spec["name"]))
    probe(svc, coordinator, workers)


def stop(svc: Service, target: str, stop_at: int, deadline_s: float) -> list[str]:
    """`target` (the last worker, or serve) stopped by `docker stop` mid-run, then started again as its
    StatefulSet would; returns the checks that failed."""
    spec = yaml.safe_load(svc.job_yaml)
    spec["name"] = f"{spec['name']}-{svc.tag}"
    job, steps = spec["name"], int(spec["steps"])
    if not 0 < stop_at < steps:
        raise Failed(f"--stop-at-step: {stop_at} is not within 1-{steps - 1} (the job's steps)")
    workers, coordinator = bring_up(svc)
    victim = workers[-1] if target == "worker" else coordinator
    outcome: list[tuple[int, str]] = []
    job_yaml = yaml.safe_dump(spec, sort_keys=False)
    def follow() -> None:
        try:
            outcome.append(svc.run_job(job_yaml, deadline_s))
        except Failed as e:
            outcome.append((EXIT_FAILED, f"not ended: {e}"))

    follower = threading.Thread(target=follow, name="job", daemon=True)
    follower.start()
    t0 = time.monotonic()
    done = -1
    while done < stop_at:   # from the progress lines the Job's first pod prints (every 10 steps)
        time.sleep(0.1)
        lines = svc.logs(f"{PREFIX}-{svc.tag}-submit-0")
        done = max([int(m.group(1)) for ln in lines if (m := re.search(r"\bstep (\d+)/", ln))], default=-1)
        if any(f"{job}: {end}" in ln for ln in lines for end in ("SUCCEEDED", "FAILED", "STOPPED")):
            raise Failed(f"{svc.tag}: the job ended before step {stop_at}")
        if time.monotonic() - t0 > deadline_s:
            raise Failed(f"{svc.tag}: the job did not pass step {stop_at} within {deadline_s:.0f} s ({done} done)")
    # What a pod eviction does: SIGTERM, then SIGKILL after terminationGracePeriodSeconds.
    t_stop = time.monotonic()
    docker("stop", "-t", str(victim.grace_s), victim.name, timeout=victim.grace_s + 60)
    exit_s = time.monotonic() - t_stop
    code = int(docker("inspect", "-f", "{{.State.ExitCode}}", victim.name).stdout)
    say(f"{svc.tag}: {victim.hostname} stopped at step {done}/{steps} (docker stop -t {victim.grace_s}): "
        f"exit {code} after {exit_s:.1f} s")
    show(svc.logs(victim.name)[-6:], victim.hostname)
    seen: list[str] = []
    if target == "worker":   # the job without its rank: what `status` says until the worker is back
        t_look = time.monotonic()
        while time.monotonic() - t_look < 5:
            state, done_now = svc.status(job)
            if state and (not seen or seen[-1].split()[0] != state):
                seen.append(f"{state} at {done_now}/{steps}")
            time.sleep(0.5)
        say(f"{svc.tag}: with {victim.hostname} gone, the job was: " + ", then ".join(seen))
    # The StatefulSet's new pod: the same container started again (same name, rank, volumes).
    docker("start", victim.name)
    if target == "serve":
        ready = svc.wait_ready(120)
        state, done_now = svc.status(job)
        say(f"{svc.tag}: serve started again, answering {ready:.1f} s later; the job: {state} at {done_now}/{steps}")
    else:
        say(f"{svc.tag}: {victim.hostname} started again {time.monotonic() - t_stop:.1f} s after the stop")
    follower.join(deadline_s)
    if not outcome:
        raise Failed(f"{svc.tag}: the example Job did not end within {deadline_s:.0f} s")
    rc, how = outcome[0]
    final, done = svc.status(job)
    t_end = time.monotonic()
    while final not in ("SUCCEEDED", "FAILED", "STOPPED"):   # the Job may have ended first
        if time.monotonic() - t_end > deadline_s:
            raise Failed(f"{svc.tag}: the job did not end within {deadline_s:.0f} s ({final} at {done})")
        time.sleep(1)
        final, done = svc.status(job)
    status = svc.client("status", job).stdout
    show(status.splitlines(), "status", keep=60)
    restarts = re.search(r"^attempts:\s+(\d+), restarts (\d+)", status, re.M)
    log = svc.client("logs", job).stdout.splitlines()
    ran = [int(m.group(1)) for ln in log if (m := re.match(r"step (\d+)/", ln))]
    twice = sorted({s for s in ran if ran.count(s) > 1})
    again = f"{len(twice)} steps ran twice ({twice[0]}-{twice[-1]})" if twice else "no step ran twice"
    say(f"{svc.tag}: job {job} {final} {done}/{steps}; the Job {how}; "
        f"attempts {restarts.group(1) if restarts else '?'}, restarts {restarts.group(2) if restarts else '?'}; "
        f"{again}")
    failed = []
    if code != 0 or exit_s > victim.grace_s:
        failed.append(f"{svc.tag}: {victim.hostname} exited {code} after {exit_s:.1f} s "
                      f"(want 0 within the {victim.grace_s} s grace)")
    if twice:
        failed.append(f"{svc.tag}: {again}: SIGTERM did not checkpoint before {victim.hostname} left")
    if final != "SUCCEEDED" or rc != 0:
        failed.append(f"{svc.tag}: the job ended {final or 'unknown'}; the Job {how}")
    if final == "SUCCEEDED":
        say(f"{svc.tag}: weights: " + svc.weights(job))
    return failed


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="deploy/image_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"which of {', '.join(PHASES)}, comma-separated (default: all)")
    p.add_argument("--image", default=None, help=f"the image's name (default {PREFIX}:<version>)")
    p.add_argument("--python-image", default=None,
                   help="PYTHON_IMAGE: the base (default python:3.11-slim-bookworm, or --make-base's)")
    p.add_argument("--make-base", action="store_true",
                   help=f"make the base {BASE_IMAGE} with debootstrap (root) unless it is there")
    p.add_argument("--pip-index", default=None,
                   help="PIP_INDEX_URL: a package index URL the build can reach (default: with no "
                        "--torch-index either, one made from this environment's pip configuration)")
    p.add_argument("--torch-index", default=None,
                   help="TORCH_INDEX: where torch comes from (default: the Dockerfile's, or that made index)")
    p.add_argument("--stop-at-step", type=int, default=60,
                   help="stop a worker once the job has done this many steps (default 60)")
    p.add_argument("--deadline-s", type=float, default=600,
                   help="the longest a job may take in a phase (default 600)")
    p.add_argument("--keep", action="store_true", help="leave the containers, volumes and network")
    args = p.parse_args(argv)
    args.phases = [s.strip() for s in args.phases.split(",") if s.strip()]
    if unknown := set(args.phases) - set(PHASES):
        p.exit(EXIT_BAD_INPUT, f"{p.prog}: error: --phases: {', '.join(sorted(unknown))}: "
                               f"each must be one of {', '.join(PHASES)}\n")
    if not 0 < args.deadline_s <= 7200:
        p.exit(EXIT_BAD_INPUT, f"{p.prog}: error: --deadline-s: {args.deadline_s:g} is not within 0-7200\n")
    if args.python_image and args.make_base:
        p.exit(EXIT_BAD_INPUT, f"{p.prog}: error: give --python-image or --make-base, not both\n")
    return args


def version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (why := engine_missing()) is not None:
        say(f"skipped: no container engine runs here ({why})")
        return EXIT_OK
    image = args.image or f"{PREFIX}:{version()}"
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix=f"{PREFIX}-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)   # the containers' user reads the token and job binds under it
        try:
            if "build" in args.phases:
                base = make_base(work) if args.make_base else args.python_image or "python:3.11-slim-bookworm"
                build(image, base, args.pip_index, args.torch_index, work)
            elif docker("image", "inspect", image, check=False).returncode != 0:
                raise Failed(f"{image}: no such image; run the build phase first")
            if "train" in args.phases:
                with Service(image, "train", work, args.keep) as svc:
                    train(svc, args.deadline_s)
            for phase, target in (("stop", "worker"), ("stop-serve", "serve")):
                if phase in args.phases:
                    with Service(image, phase, work, args.keep) as svc:
                        failed += stop(svc, target, args.stop_at_step, args.deadline_s)
        except Failed as e:
            failed.append(str(e))
    for f in failed:
        say(f"FAILED: {f}")
    if not failed:
        say(f"passed: {', '.join(args.phases)}")
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
