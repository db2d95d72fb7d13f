"""deploy/: the Kubernetes manifests render with kustomize, validate offline against the Kubernetes
schemas, and say what the service needs: ranks, probes, GPUs, tokens, and who may connect."""

from __future__ import annotations

import copy
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpipe.coordinator.spec.job import parse_spec
from tests.support.deploy import DEPLOY, Obj, render

OVERLAYS = ("overlays/cpu", "overlays/gpu")
TARGETS = (*OVERLAYS, "example")
# The oldest Kubernetes the manifests are for (the pod-index label is set from 1.28; the 1.28
# schema still wrongly requires onPodConditions in a Job's podFailurePolicy), and the newest whose
# schemas the pinned kubernetes-validate bundles.
K8S_VERSIONS = ("1.29.0", "1.37.0")
CLIENT_LABELS = {"gpipe.dev/client": "true"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}  # the Prometheus Operator's and chart's pods
SERVICE_MONITOR = "monitoring/servicemonitor.yaml"
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"







def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def container(obj: Obj, name: str) -> Obj:
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def workload(objs: list[Obj], kind: str, name: str, cname: str) -> tuple[Obj, Obj, Obj, dict[str, str | None]]:
    """The object, its pod spec, its container `cname` and that container's --flags."""
    obj = one(objs, kind, name)
    c = container(obj, cname)
    return obj, obj["spec"]["template"]["spec"], c, flags(c)


def assert_on_pod_address(c: Obj, f: dict[str, str | None]) -> None:
    """No --host: serve and the workers take the pod's own address by default (no downward API needed)."""
    assert "--host" not in f and not any(e["name"] == "POD_IP" for e in c.get("env", []))


def flags(c: Obj) -> dict[str, str | None]:
    """The container's --flags (as --flag=value or --flag value) and their values."""
    args = [*c.get("command", [])[1:], *c.get("args", [])]
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            key, eq, value = a.partition("=")
            if eq:
                out[key] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[key], i = args[i + 1], i + 1
            else:
                out[key] = None
        i += 1
    return out


def positionals(c: Obj) -> list[str]:
    """The container's command line without its --flags and their values."""
    words = [*c.get("command", []), *c.get("args", [])]
    values = {v for v in flags(c).values() if v is not None}
    return [w for w in words if not w.startswith("--") and w not in values]


def env(c: Obj, name: str) -> Obj:
    found = [e for e in c.get("env", []) if e["name"] == name]
    assert len(found) == 1, f"container {c['name']}: {len(found)} env entries named {name}"
    return found[0]


def field_ref(c: Obj, name: str) -> str:
    return env(c, name)["valueFrom"]["fieldRef"]["fieldPath"]


def volume_at(pod: Obj, c: Obj, path: str) -> tuple[Obj, str]:
    """The volume that holds `path` in container `c`, and the path inside it."""
    mounts = [m for m in c.get("volumeMounts", [])
              if PurePosixPath(path).is_relative_to(m["mountPath"])]
    assert mounts, f"container {c['name']}: nothing is mounted at {path}"
    m = max(mounts, key=lambda m: len(m["mountPath"]))
    # A name with no volume in the pod: one of the StatefulSet's volumeClaimTemplates.
    vol = next((v for v in pod.get("volumes", []) if v["name"] == m["name"]), {"name": m["name"]})
    return vol, str(PurePosixPath(path).relative_to(m["mountPath"]))


def source_of(pod: Obj, c: Obj, path: str) -> tuple[str, str, str]:
    """(kind, name, key) of the Secret or ConfigMap key that file `path` in container `c` shows."""
    vol, rel = volume_at(pod, c, path)
    kind = "secret" if "secret" in vol else "configMap"
    assert kind in vol, f"{path}: volume {vol['name']} is neither a secret nor a configMap"
    src = vol[kind]
    items = src.get("items")
    key = next((i["key"] for i in items if i["path"] == rel), None) if items else rel
    assert key is not None, f"{path}: volume {vol['name']} does not project it"
    return kind, src["secretName" if kind == "secret" else "name"], key


def keys_exposed(pod: Obj, secret: str) -> set[str]:
    """Every key of Secret `secret` that some volume of the pod shows (None: all of them)."""
    keys: set[str] = set()
    for v in pod.get("volumes", []):
        if v.get("secret", {}).get("secretName") == secret:
            items = v["secret"].get("items")
            assert items, f"volume {v['name']} shows every key of {secret}"
            keys |= {i["key"] for i in items}
    return keys


def pod_templates(objs: list[Obj]) -> list[tuple[Obj, Obj]]:
    return [(o, o["spec"]["template"]) for o in objs if o["kind"] in ("StatefulSet", "Job")]


def walk(x: Any):
    """Every mapping key anywhere in x."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield from walk(v)
    elif isinstance(x, list):
        for v in x:
            yield from walk(v)


def example_spec():
    cm = one(render("example"), "ConfigMap", "gpipe-example-job")
    return parse_spec(cm["data"]["job.yaml"], source="ConfigMap gpipe-example-job")


# -- rendering and schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates_against_the_kubernetes_schemas(target):
    objs = render(target)
    kinds = {o["kind"] for o in objs}
    expected = {"ConfigMap", "Job"} if target == "example" else {"StatefulSet", "Service", "NetworkPolicy"}
    assert kinds == expected
    for o in objs:
        for version in K8S_VERSIONS:
            # strict: a field the schema does not know (a typo) is an error too.
            kubernetes_validate.validate(o, version, strict=True)


def test_the_schema_check_rejects_a_wrong_manifest():
    sts = one(render("overlays/cpu"), "StatefulSet", "gpipe-worker")
    misspelt = copy.deepcopy(sts)
    misspelt["spec"]["podManagmentPolicy"] = misspelt["spec"].pop("podManagementPolicy")
    wrong_type = copy.deepcopy(sts)
    wrong_type["spec"]["replicas"] = "two"
    for bad in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


# -- the coordinator and the workers -----------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_coordinator_is_one_pod_with_its_state_on_a_volume_claim(overlay):
    objs = render(overlay)
    sts, pod, c, f = workload(objs, "StatefulSet", "gpipe-coordinator", "coordinator")
    assert sts["spec"]["replicas"] == 1
    assert positionals(c) == ["gpipe-coordinator", "serve"]
    # The state dir is on the StatefulSet's PersistentVolumeClaim, not on the pod's scratch.
    vol, _ = volume_at(pod, c, f["--state-dir"])
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    assert vol["name"] in claims and set(vol) == {"name"}
    # It listens on the pod's address and port 7000, which the API Service exposes.
    assert_on_pod_address(c, f)
    port = int(f["--port"])
    assert port == 7000
    assert any(p["containerPort"] == port for p in c["ports"])
    svc = one(objs, "Service", "gpipe-coordinator")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert [p["port"] for p in svc["spec"]["ports"]] == [port, int(f["--metrics-port"])]  # the API, /metrics
    assert svc["spec"]["ports"][0]["targetPort"] in (port, *(p["name"] for p in c["ports"]))
    assert one(objs, "Service", sts["spec"]["serviceName"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_take_their_rank_from_the_pod_index(overlay):
    objs = render(overlay)
    sts, pod, c, f = workload(objs, "StatefulSet", "gpipe-worker", "worker")
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["replicas"] == example_spec().topology.world == 2  # a worker per stage of each replica
    # The governing Service is headless and selects these pods.
    svc = one(objs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    # Rank: no --rank, so gpipe-worker reads RANK, the pod's ordinal.
    assert positionals(c) == ["gpipe-worker"] and "--rank" not in f
    assert field_ref(c, "RANK") == POD_INDEX
    assert_on_pod_address(c, f)
    # The coordinator: the API Service's name and port.
    api = one(objs, "Service", "gpipe-coordinator")
    assert "--coordinator" not in f
    assert env(c, "GPIPE_COORDINATOR")["value"] == f"gpipe-coordinator:{api['spec']['ports'][0]['port']}"
    # Health served on --health-port, on every interface, and probed there over gRPC.
    health = int(f["--health-port"])
    assert f.get("--health-host", "0.0.0.0") == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == health, probe
    # A memory-backed /dev/shm.
    vol, rel = volume_at(pod, c, "/dev/shm")
    assert rel == "." and vol["emptyDir"]["medium"] == "Memory"
    # Threads: the CPU limit.
    assert env(c, "OMP_NUM_THREADS")["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    assert c["resources"]["limits"]["cpu"]


def test_gpus_are_asked_for_in_the_gpu_overlay_only():
    gpu = render("overlays/gpu")
    w = container(one(gpu, "StatefulSet", "gpipe-worker"), "worker")
    assert int(w["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert flags(w)["--device"] == "cuda:0"
    assert w["image"].endswith("-cuda")
    coord = container(one(gpu, "StatefulSet", "gpipe-coordinator"), "coordinator")
    assert "nvidia.com/gpu" not in set(walk(coord))
    cpu = render("overlays/cpu")
    assert "nvidia.com/gpu" not in set(walk(cpu))
    w = container(one(cpu, "StatefulSet", "gpipe-worker"), "worker")
    assert flags(w).get("--device", "cpu") == "cpu"
    assert "cuda" not in w["image"]


# -- security ----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_every_pod_runs_unprivileged_with_bounded_resources(target):
    templates = pod_templates(render(target))
    assert templates
    for obj, tpl in templates:
        where = f"{obj['kind']} {obj['metadata']['name']}"
        pod = tpl["spec"]
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, where
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
        assert pod["automountServiceAccountToken"] is False, where
        claims = {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
        for c in pod["containers"]:
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, where
            assert csc["readOnlyRootFilesystem"] is True, where
            assert "ALL" in csc["capabilities"]["drop"] and not csc.get("privileged"), where
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= c["resources"][bound].keys(), where
            # The root is read-only: /tmp and every other writable path are scratch or the claim.
            assert "emptyDir" in volume_at(pod, c, "/tmp")[0], where
            for m in c["volumeMounts"]:
                if not m.get("readOnly"):
                    vol, _ = volume_at(pod, c, m["mountPath"])
                    assert "emptyDir" in vol or vol["name"] in claims, f"{where}: {m['mountPath']}"


def test_tokens_come_from_a_secret_the_user_creates():
    cpu, example = render("overlays/cpu"), render("example")
    # No token ships: nothing rendered is a Secret.
    assert not [o for o in cpu + render("overlays/gpu") + example if o["kind"] == "Secret"]
    coord = one(cpu, "StatefulSet", "gpipe-coordinator")
    workers = one(cpu, "StatefulSet", "gpipe-worker")
    job = one(example, "Job", "gpipe-example")
    uses = [
        (coord, "coordinator", "--auth-token-file", "client-token"),
        (coord, "coordinator", "--worker-token-file", "worker-token"),
        (workers, "worker", "--worker-token-file", "worker-token"),
        (job, "submit", "--auth-token-file", "client-token"),
    ]
    for obj, name, flag, key in uses:
        pod, c = obj["spec"]["template"]["spec"], container(obj, name)
        assert source_of(pod, c, flags(c)[flag]) == ("secret", "gpipe-tokens", key), f"{name} {flag}"
    # Each pod sees only the keys it needs: a worker cannot call the job API, a client cannot
    # register as a worker.
    assert keys_exposed(coord["spec"]["template"]["spec"], "gpipe-tokens") == {"client-token", "worker-token"}
    assert keys_exposed(workers["spec"]["template"]["spec"], "gpipe-tokens") == {"worker-token"}
    assert keys_exposed(job["spec"]["template"]["spec"], "gpipe-tokens") == {"client-token"}


def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector {selector}: only matchLabels is understood here"
    return selector.get("matchLabels", {}).items() <= labels.items()


def allowed(policies: list[Obj], src: dict[str, str], dst: dict[str, str], port: int) -> bool:
    """Whether NetworkPolicies let a pod labelled `src` open TCP `port` on a pod labelled `dst`
    (both in the policies' namespace)."""
    selecting = [p["spec"] for p in policies
                 if "Ingress" in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    for spec in selecting:
        for rule in spec.get("ingress", []):
            peers = rule.get("from", [])
            for peer in peers:
                # namespaceSelector {}: the pods of every namespace that the podSelector selects.
                assert set(peer) - {"namespaceSelector"} == {"podSelector"} and not peer.get("namespaceSelector"), \
                    f"peer {peer}: only podSelector (in any namespace at most) is understood here"
            ports = rule.get("ports", [])
            if (not peers or any(_selects(p["podSelector"], src) for p in peers)) and (
                    not ports or any(p.get("protocol", "TCP") == "TCP" and p.get("port", port) == port
                                     for p in ports)):
                return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_opens_the_data_plane_to_the_deployment_and_the_api_to_clients(overlay):
    objs = render(overlay)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    coordinator = one(objs, "StatefulSet", "gpipe-coordinator")["spec"]["template"]["metadata"]["labels"]
    worker = one(objs, "StatefulSet", "gpipe-worker")["spec"]["template"]["metadata"]["labels"]
    client = one(render("example"), "Job", "gpipe-example")["spec"]["template"]["metadata"]["labels"]
    stranger = {"app": "something-else"}
    assert client.items() >= CLIENT_LABELS.items()
    api, health, data, metrics = 7000, 8081, 45123, 9100   # data: any of the per-attempt ephemeral ports
    # Within the deployment, every TCP port: the data plane's ports are chosen per attempt.
    for src, dst in [(worker, worker), (worker, coordinator), (coordinator, worker)]:
        assert allowed(policies, src, dst, data) and allowed(policies, src, dst, api)
    # Clients: the API port of the coordinator, nothing else.
    assert allowed(policies, client, coordinator, api)
    assert not allowed(policies, client, coordinator, data)
    assert not allowed(policies, client, worker, data)
    assert not allowed(policies, client, worker, health)
    # Prometheus: the coordinator's metrics port, nothing else.
    assert allowed(policies, PROMETHEUS, coordinator, metrics)
    for port in (api, data, health):
        assert not allowed(policies, PROMETHEUS, coordinator, port)
        assert not allowed(policies, PROMETHEUS, worker, port)
    # Anyone else: nothing.
    for port in (api, data, health, metrics):
        assert not allowed(policies, stranger, coordinator, port)
        assert not allowed(policies, stranger, worker, port)
    assert not allowed(policies, client, coordinator, metrics)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_coordinators_metrics_port_is_exposed_for_prometheus(overlay):
    objs = render(overlay)
    sts, pod, c, f = workload(objs, "StatefulSet", "gpipe-coordinator", "coordinator")
    port = int(f["--metrics-port"])
    assert "--metrics-host" not in f  # the API's address: every interface of the pod
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"]
    svc = one(objs, "Service", "gpipe-coordinator")
    assert {"name": "metrics", "port": port, "targetPort": "metrics", "protocol": "TCP"} in svc["spec"]["ports"]
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
    for annotated in (sts["spec"]["template"], svc):
        assert annotated["metadata"]["annotations"].items() >= scrape.items()
    # The optional ServiceMonitor selects that Service's metrics port, and no kustomization applies it.
    monitor = yaml.safe_load((DEPLOY / SERVICE_MONITOR).read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "ServiceMonitor"
    assert _selects(monitor["spec"]["selector"], svc["metadata"]["labels"])
    assert not any(_selects(monitor["spec"]["selector"], o["metadata"].get("labels", {}))
                   for o in objs if o["kind"] == "Service" and o is not svc)
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [("metrics", "/metrics")]
    assert all(o["kind"] != "ServiceMonitor" for t in TARGETS for o in render(t))


# -- the example job ---------------------------------------------------------------------------


def test_example_job_submits_the_configmap_spec_and_follows_it(tmp_path: Path):
    _, pod, c, f = workload(render("example"), "Job", "gpipe-example", "submit")
    assert pod["restartPolicy"] == "Never"
    assert positionals(c)[:2] == ["gpipe-coordinator", "submit"] and "--follow" in f
    # A retried pod (the first lost serve mid-follow: exit 1) follows the job the first one submitted,
    # rather than exit 2 (a job of that name exists), which podFailurePolicy makes final.
    assert "--attach" in f and f["--attach"] is None
    path = positionals(c)[2]
    assert source_of(pod, c, path) == ("configMap", "gpipe-example-job", "job.yaml")
    api = one(render("overlays/cpu"), "Service", "gpipe-coordinator")
    assert f["--coordinator"] == f"gpipe-coordinator:{api['spec']['ports'][0]['port']}"
    # The spec is one the service takes: its model and data build, its balance fits.
    from gpipe.coordinator.plan.job import make_plan

    spec = example_spec()
    plan = make_plan(spec, tmp_path)
    assert plan.balance == [2, 2] and len(plan.model) == 4
    assert spec.topology.world == one(render("overlays/gpu"), "StatefulSet", "gpipe-worker")["spec"]["replicas"]
