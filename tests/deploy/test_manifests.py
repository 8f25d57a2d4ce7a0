"""The Kubernetes manifests under deploy/k8s, rendered and checked offline.

Each variant (the CPU default base and the overlays) is rendered with `kubectl kustomize`
(kustomize built into kubectl; no cluster needed) and its objects are checked for what the
deployment must get right: the daemon is a native sidecar after its arena keeper, its cache
directory is its own per pod, memory and /dev/shm cover every pool, probes hit /healthz and
/readyz on the metrics port, the grace period covers drain and persist, the security context
is tight (the engine's too), and the GPU, tokens, events, monitoring (alerts included),
network policy, disruption budget and placement parts are wired together. The other two
deployments are rendered and checked the same way: kvtier added to the engine pods of other
charts (deploy/k8s/examples: llm-d's model service, KServe, the vLLM production stack, each
from a checked-in copy of the chart's rendered engine workload) and the node-wide daemon
(deploy/k8s/node, with the engine of deploy/k8s/examples/node-engine). `kubectl create --dry-run=client`
needs an API server even for client-side dry runs, so object schemas are checked here by
hand: the fields each kind requires and the references between them.

Without kubectl the rendered variants are skipped; the base is then assembled from its own
files (its StatefulSet, Service and the ConfigMap its kustomization generates) and checked
the same way.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvtier.units import parse_size

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VARIANTS = {
    "cpu": K8S / "base",
    "gpu": K8S / "overlays" / "gpu",
    "tokens": K8S / "overlays" / "tokens",
    "monitoring": K8S / "overlays" / "monitoring",
    "hostpath": K8S / "overlays" / "hostpath",
    "production": K8S / "overlays" / "production",  # gpu + tokens + monitoring, resized
}
#: The Helm chart with value sets like the overlays (release name "llm").
HELM_CHART = ROOT / "deploy" / "helm" / "kvtier"
HELM_VALUES = {
    "helm-cpu": {},
    "helm-gpu": {"gpu": {"enabled": True}},
    "helm-tokens": {"tokens": {"enabled": True}},
    "helm-monitoring": {"metrics": {"podMonitor": {"enabled": True}}},
    "helm-hostpath": {"cache": {"mode": "hostPath"}},
    "helm-production": {"replicas": 2, "gpu": {"enabled": True, "deviceSizeGiB": 8},
                        "tokens": {"enabled": True}, "metrics": {"podMonitor": {"enabled": True}},
                        "kvtier": {"hostSizeGiB": 48, "diskSizeGiB": 1024, "maxPools": 2,
                                   "drainTimeoutSeconds": 60}, "config": {"policy": "lru"}},
}
ALL_VARIANTS = list(VARIANTS) + list(HELM_VALUES)
#: kvtier added by components/sidecar(-kserve) to another chart's engine workload: (the
#: example, the rendered copy of the chart's workload it takes, the engine container's name).
CHARTS = {
    "llm-d": (K8S / "examples" / "llm-d", "modelservice-decode.yaml", "vllm"),
    "kserve": (K8S / "examples" / "kserve", "inferenceservice.yaml", "kserve-container"),
    "production-stack": (K8S / "examples" / "production-stack", "vllm-deployment.yaml", "vllm"),
}
#: The node-wide daemon and an engine that uses it.
NODE = {"node": K8S / "node", "node-engine": K8S / "examples" / "node-engine"}
GPU = {"gpu", "production", "helm-gpu", "helm-production"}
TOKENS = {"tokens", "production", "helm-tokens", "helm-production"}
MONITORING = {"monitoring", "production", "helm-monitoring", "helm-production"}
KUBECTL = shutil.which("kubectl")

DAEMON_OVERHEAD = parse_size("1GiB")  # memory beyond the host arenas: at least this
ENGINE_STOP_S = 30  # what the grace period leaves the engine before the daemon's turn
GPU_TOTAL = parse_size("80GiB")  # the GPU the examples are sized for (H100 80 GB)
CUDA_CONTEXT = parse_size("1.5GiB")
NON_ROOT_UID = 10001  # the images' kvtier user
SHARED_GID = 2000


# -- rendering ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def render(variant: str) -> tuple[dict, ...]:
    if variant in HELM_VALUES:
        return render_helm(variant)
    if KUBECTL is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    path = VARIANTS.get(variant) or NODE.get(variant) or CHARTS[variant][0]
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc is not None)


def render_helm(variant: str) -> tuple[dict, ...]:
    """`helm template` through Helm's own Go SDK (the helm-python-sdk package: libhelm_c),
    offline; NOTES.txt is not a manifest."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's SDK) is not installed")
    chart = helm.Chart.load(str(HELM_CHART))
    out = chart.render(HELM_VALUES[variant], name="llm", namespace="default", is_install=True)
    return tuple(doc for path, text in sorted(out.items()) if path.endswith(".yaml")
                 for doc in yaml.safe_load_all(text) if doc is not None)


def assemble_base() -> tuple[dict, ...]:
    """The base without kustomize: its resources with its labels (selectors included) and
    images applied, and the ConfigMap its generator makes."""
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    labels = {k: v for entry in kustomization.get("labels", []) for k, v in entry["pairs"].items()}
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization.get("images", [])}
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / "base" / name).read_text()) if d]
    for d in docs:
        d["metadata"].setdefault("labels", {}).update(labels)
        if d["kind"] == "Service":
            d["spec"]["selector"] = {**(d["spec"].get("selector") or {}), **labels}
        if d["kind"] == "StatefulSet":
            d["spec"]["selector"]["matchLabels"] = {**(d["spec"]["selector"].get("matchLabels") or {}), **labels}
            d["spec"]["template"]["metadata"]["labels"] = {**(d["spec"]["template"]["metadata"].get("labels") or {}), **labels}
            pod = d["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                c["image"] = images.get(c["image"], c["image"])
    for gen in kustomization.get("configMapGenerator", []):
        data = dict(lit.split("=", 1) for lit in gen.get("literals", []))
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]},
                     "data": data})
    return tuple(docs)


def one(docs, kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_of(obj: dict) -> dict:
    """The pod spec of a workload, or of an InferenceService's predictor."""
    return obj["spec"]["predictor"] if obj["kind"] == "InferenceService" else obj["spec"]["template"]["spec"]


def has_container(obj: dict, name: str) -> bool:
    if obj["kind"] not in ("StatefulSet", "Deployment", "DaemonSet", "InferenceService"):
        return False
    return any(c["name"] == name for c in all_containers(pod_of(obj)))


def kvtier_workload(docs) -> dict:
    """The one object whose pods run the kvtier daemon."""
    found = [d for d in docs if has_container(d, "kvtier")]
    assert len(found) == 1, f"expected one workload with a kvtier container, found {len(found)}"
    return found[0]


def pod_spec(docs) -> dict:
    return pod_of(kvtier_workload(docs))


def all_containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec.get("containers", [])


def container(spec: dict, name: str) -> dict:
    for c in all_containers(spec):
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name!r}")


def daemon_config(docs) -> dict[str, str]:
    """What `kvtier serve` in the sidecar reads: KVTIER_* from its envFrom ConfigMaps, then
    its env, then --flags in its args (docs/configuration.md: later wins)."""
    spec = pod_spec(docs)
    c = container(spec, "kvtier")
    config: dict[str, str] = {}
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for src in c.get("envFrom", []):
        ref = src["configMapRef"]["name"]
        assert ref in maps, f"envFrom names ConfigMap {ref!r}, which is not rendered"
        config.update({k: str(v) for k, v in maps[ref]["data"].items() if k.startswith("KVTIER_")})
    config.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    args = c.get("args", [])
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            if not value and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
            config[f"KVTIER_{key.replace('-', '_').upper()}"] = value
    return config


_QUANTITY = re.compile(r"^([0-9.]+)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P|m)?$")
_FACTORS = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "m": 1e-3}


def quantity(value) -> float:
    """A Kubernetes resource quantity (`10Gi`, `500m`, `2`) as a number."""
    m = _QUANTITY.match(str(value))
    assert m, f"not a Kubernetes quantity: {value!r}"
    return float(m.group(1)) * _FACTORS[m.group(2)]


def seconds(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(ms|s|m|h)?", text.strip())
    assert m, f"not a duration: {text!r}"
    return float(m.group(1)) * {"ms": 1e-3, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]


def pools_bytes(config: dict[str, str], key: str) -> int:
    return parse_size(config[key]) * int(config.get("KVTIER_MAX_POOLS", "4"))


def mount_for(c: dict, path: str) -> dict | None:
    """The volume mount of container `c` under which `path` lies (the deepest one)."""
    best = None
    for m in c.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best["mountPath"].rstrip("/")):
                best = m
    return best


def volume(docs, name: str) -> dict:
    for v in pod_spec(docs).get("volumes", []):
        if v["name"] == name:
            return v
    for t in kvtier_workload(docs)["spec"].get("volumeClaimTemplates", []):
        if t["metadata"]["name"] == name:
            return {"name": name, "claimTemplate": t}
    raise AssertionError(f"no volume {name!r}")


def kv_transfer_config(engine: dict) -> dict:
    for arg in engine.get("args", []):
        if arg.startswith("--kv-transfer-config="):
            return json.loads(arg.split("=", 1)[1])
    raise AssertionError("the engine has no --kv-transfer-config")


# -- the checks, for any rendering --------------------------------------------------------
def check_objects(docs) -> None:
    """Valid objects: every one has apiVersion, kind and a name; the kinds we ship."""
    for d in docs:
        assert isinstance(d, dict) and d.get("apiVersion") and d.get("kind"), d
        assert d.get("metadata", {}).get("name"), f"{d['kind']} without metadata.name"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", d["metadata"]["name"]), d["metadata"]["name"]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("StatefulSet") == 1 and kinds.count("Service") == 1
    assert kinds.count("ConfigMap") == 1 and kinds.count("PodDisruptionBudget") <= 1
    assert "Pod" not in kinds and "Deployment" not in kinds


def check_native_sidecar(docs) -> None:
    spec = pod_spec(docs)
    inits = {c["name"]: c for c in spec.get("initContainers", [])}
    mains = {c["name"]: c for c in spec.get("containers", [])}
    assert "kvtier" in inits and "kvtier" not in mains, "kvtier must be an init container"
    assert inits["kvtier"].get("restartPolicy") == "Always", "a native sidecar has restartPolicy Always"
    assert "engine" in mains
    names = [c["name"] for c in all_containers(spec)]
    assert len(names) == len(set(names)), "container names must be unique in a pod"
    if "kvtier-keeper" in inits:  # started before the daemon, stopped after it
        assert names.index("kvtier-keeper") < names.index("kvtier"), names


def check_args(docs) -> None:
    c = container(pod_spec(docs), "kvtier")
    assert "command" not in c, "keep the image's ENTRYPOINT (kvtier)"
    args = c.get("args", [])
    assert args and args[0] == "serve", f"args must start with the subcommand: {args}"
    assert not args[0].startswith("kvtier"), "the image's ENTRYPOINT is kvtier already"


def check_cache_per_pod(docs) -> None:
    config = daemon_config(docs)
    spec = pod_spec(docs)
    c = container(spec, "kvtier")
    cache_dir = config["KVTIER_CACHE_DIR"]
    m = mount_for(c, cache_dir)
    assert m is not None and m["mountPath"] == cache_dir, f"nothing is mounted at the cache dir {cache_dir}"
    assert not m.get("readOnly")
    vol = volume(docs, m["name"])
    if "claimTemplate" in vol:
        # A StatefulSet's claim template: one claim per pod, named after the pod.
        claim = vol["claimTemplate"]["spec"]
        assert claim["accessModes"] == ["ReadWriteOnce"]
        storage = quantity(claim["resources"]["requests"]["storage"])
        assert storage >= pools_bytes(config, "KVTIER_DISK_SIZE"), "the claim must hold disk_size x max_pools"
        assert "subPath" not in m and "subPathExpr" not in m
    else:
        # A node directory shared by every pod there: each pod must get its own subdirectory.
        assert "hostPath" in vol or "persistentVolumeClaim" in vol, vol
        var = re.fullmatch(r"\$\((\w+)\)", m.get("subPathExpr", ""))
        assert var, "the cache path must include the pod's name"
        env = {e["name"]: e for e in c.get("env", [])}
        assert env[var.group(1)]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # No other pod-shared volume is mounted anywhere under the cache directory.
    for other in c.get("volumeMounts", []):
        if other is not m and other["mountPath"].startswith(cache_dir.rstrip("/") + "/"):
            raise AssertionError(f"{other['mountPath']} is mounted inside the cache directory")


def check_memory(docs) -> None:
    config = daemon_config(docs)
    spec = pod_spec(docs)
    arenas = pools_bytes(config, "KVTIER_HOST_SIZE")
    shm = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm and shm[0]["emptyDir"].get("medium") == "Memory"
    assert quantity(shm[0]["emptyDir"]["sizeLimit"]) >= arenas, "/dev/shm smaller than host_size x max_pools"
    for name in ("kvtier", "engine"):
        m = mount_for(container(spec, name), "/dev/shm")
        assert m is not None and m["name"] == "dshm" and m["mountPath"] == "/dev/shm", name
    res = container(spec, "kvtier")["resources"]
    limit = quantity(res["limits"]["memory"])
    assert limit >= arenas + DAEMON_OVERHEAD, (
        f"kvtier memory limit {res['limits']['memory']} does not hold host_size x max_pools "
        f"({arenas / 2**30:g} GiB) + {DAEMON_OVERHEAD / 2**30:g} GiB: memfd pages count against it")
    assert quantity(res["requests"]["memory"]) == limit, "memory request = limit: never overcommitted"


def check_resources(docs) -> None:
    """Not BestEffort: every container requests CPU and memory, limits >= requests."""
    spec = pod_spec(docs)
    for c in spec.get("initContainers", []) + spec["containers"]:
        res = c.get("resources", {})
        for kind in ("cpu", "memory"):
            assert kind in res.get("requests", {}), f"{c['name']} requests no {kind}"
        assert "memory" in res.get("limits", {}), f"{c['name']} has no memory limit"
        for kind, lim in res.get("limits", {}).items():
            if kind in res.get("requests", {}):
                assert quantity(lim) >= quantity(res["requests"][kind]), (c["name"], kind)


def check_probes(docs) -> None:
    config = daemon_config(docs)
    c = container(pod_spec(docs), "kvtier")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports.get("metrics") == int(config["KVTIER_METRICS_PORT"])
    assert config["KVTIER_METRICS_HOST"] == "0.0.0.0", "the kubelet probes the pod's IP"
    want = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/readyz"}
    for probe, path in want.items():
        get = c[probe]["httpGet"]
        assert get["path"] == path, (probe, get)
        port = get["port"]
        assert (ports.get(port) if isinstance(port, str) else port) == int(config["KVTIER_METRICS_PORT"])
    # Liveness must not kill a daemon that is draining or slow to answer once.
    assert c["livenessProbe"].get("failureThreshold", 3) * c["livenessProbe"].get("periodSeconds", 10) >= 30


def check_grace(docs) -> None:
    config = daemon_config(docs)
    drain = seconds(config.get("KVTIER_DRAIN_TIMEOUT", "10s"))
    grace = pod_spec(docs)["terminationGracePeriodSeconds"]
    # drain_timeout for leases, as long again for copying host pages to disk, after the
    # engine's own stop (the native sidecar gets SIGTERM only once the engine has exited).
    assert grace >= ENGINE_STOP_S + 2 * drain, f"grace {grace} s < {ENGINE_STOP_S} + 2 x {drain:g} s"


def check_security(docs) -> None:
    spec = pod_spec(docs)
    pod_sc = spec.get("securityContext", {})
    c = container(spec, "kvtier")
    sc = c["securityContext"]
    assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", NON_ROOT_UID) != 0
    assert sc.get("runAsUser") == NON_ROOT_UID and sc.get("runAsGroup") == SHARED_GID
    assert sc.get("readOnlyRootFilesystem") is True
    assert sc.get("allowPrivilegeEscalation") is False
    assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add")
    assert sc.get("privileged") is not True
    # The engine shares gid 2000 with the daemon: the 0660 socket and the arenas.
    assert SHARED_GID in pod_sc.get("supplementalGroups", []) or pod_sc.get("fsGroup") == SHARED_GID
    assert pod_sc.get("fsGroup") == SHARED_GID
    # A read-only root: everything the daemon writes is a volume.
    config = daemon_config(docs)
    for path in (os.path.dirname(config["KVTIER_SOCKET"]), config["KVTIER_CACHE_DIR"], "/tmp"):
        assert mount_for(c, path) is not None, f"{path} is not writable with a read-only root"
    for other in spec["containers"] + spec.get("initContainers", []):
        assert not other.get("securityContext", {}).get("privileged"), other["name"]


def check_socket_shared(docs) -> None:
    config = daemon_config(docs)
    spec = pod_spec(docs)
    sock_dir = os.path.dirname(config["KVTIER_SOCKET"])
    daemon_mount = mount_for(container(spec, "kvtier"), sock_dir)
    engine = container(spec, "engine")
    engine_mount = mount_for(engine, sock_dir)
    assert daemon_mount and engine_mount and daemon_mount["name"] == engine_mount["name"]
    assert "emptyDir" in volume(docs, daemon_mount["name"])
    target = kv_transfer_config(engine)["kv_connector_extra_config"]["target"]
    assert target == "unix://" + config["KVTIER_SOCKET"]


def check_schema(docs) -> None:
    """What the API server would refuse, checked by hand (no server here)."""
    spec = one(docs, "StatefulSet")["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"] and spec["selector"]["matchLabels"].items() <= labels.items()
    svc = one(docs, "Service")
    assert spec["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"] and svc["spec"]["selector"].items() <= labels.items()
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    templates = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
    assert len(volumes) == len(pod.get("volumes", [])), "duplicate volume names"
    assert not (set(volumes) & templates), "a volume and a claim template share a name"
    sources = {"emptyDir", "hostPath", "secret", "configMap", "persistentVolumeClaim", "projected",
               "ephemeral", "csi", "downwardAPI"}
    for v in volumes.values():
        assert len(set(v) & sources) == 1 and set(v) <= sources | {"name"}, f"volume {v['name']}: {v}"
    all_ports = set()
    for c in pod.get("initContainers", []) + pod["containers"]:
        assert c.get("name") and c.get("image"), c
        assert "/" in c["image"] and ":" in c["image"].rsplit("/", 1)[-1], f"{c['name']}: unpinned image {c['image']}"
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes or m["name"] in templates, f"{c['name']} mounts unknown {m['name']}"
            assert m["mountPath"].startswith("/")
            assert not ("subPath" in m and "subPathExpr" in m)
        for p in c.get("ports", []):
            assert isinstance(p["containerPort"], int) and 0 < p["containerPort"] < 65536
            assert re.fullmatch(r"[a-z0-9-]{1,15}", p["name"]) and p["name"] not in all_ports
            all_ports.add(p["name"])
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe in c:
                handlers = {"httpGet", "exec", "tcpSocket", "grpc"} & set(c[probe])
                assert len(handlers) == 1, (c["name"], probe)
                port = c[probe].get("httpGet", {}).get("port")
                if isinstance(port, str):
                    assert port in {p["name"] for p in c.get("ports", [])}, (c["name"], probe, port)
        assert c.get("restartPolicy") in (None, "Always")
        if c.get("restartPolicy") == "Always":
            assert c in pod.get("initContainers", []), "restartPolicy on a main container"
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in all_ports, f"Service targets unknown port {p['targetPort']}"
    for c in pod.get("initContainers", []) + pod["containers"]:
        for claim in c.get("resources", {}).get("claims", []):
            assert claim["name"] in {r["name"] for r in pod.get("resourceClaims", [])}
    # Every envFrom/volume reference to a ConfigMap is rendered; Secrets are made by the user.
    maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    for c in pod.get("initContainers", []) + pod["containers"]:
        for src in c.get("envFrom", []):
            if "configMapRef" in src:
                assert src["configMapRef"]["name"] in maps
    for v in volumes.values():
        if "secret" in v:
            assert v["secret"]["secretName"] == "kvtier-tokens", v


ALL_CHECKS = [check_objects, check_native_sidecar, check_args, check_cache_per_pod, check_memory,
              check_resources, check_probes, check_grace, check_security, check_socket_shared,
              check_schema]


# -- the tests ----------------------------------------------------------------------------
@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda f: f.__name__[6:])
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_rendered(variant, check):
    check(render(variant))


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda f: f.__name__[6:])
def test_base_without_kustomize(check):
    """The base's own files pass the same checks (runs without kubectl)."""
    check(assemble_base())


def test_variants_differ_as_intended():
    base = daemon_config(render("cpu"))
    assert "KVTIER_DEVICE_SIZE" not in base and "KVTIER_TOKENS_FILE" not in base
    prod = daemon_config(render("production"))
    assert (prod["KVTIER_HOST_SIZE"], prod["KVTIER_MAX_POOLS"], prod["KVTIER_POLICY"]) == ("48GiB", "2", "frecency")
    # A changed option changes the generated ConfigMap's name, so the pods roll.
    maps = {v: one(render(v), "ConfigMap") for v in VARIANTS}
    for a in VARIANTS:
        assert maps[a]["metadata"]["name"].startswith("kvtier-config-")
        for b in VARIANTS:
            same_data = maps[a]["data"] == maps[b]["data"]
            assert (maps[a]["metadata"]["name"] == maps[b]["metadata"]["name"]) == same_data, (a, b)
    assert maps["gpu"]["data"] != maps["cpu"]["data"] != maps["tokens"]["data"]


@pytest.mark.parametrize("variant", sorted(GPU))
def test_gpu(variant):
    docs = render(variant)
    spec = pod_spec(docs)
    config = daemon_config(docs)
    device = pools_bytes(config, "KVTIER_DEVICE_SIZE")
    assert device > 0
    # One DRA claim per pod, named by both containers: they see the same GPU.
    template = one(docs, "ResourceClaimTemplate")
    assert template["apiVersion"].startswith("resource.k8s.io/")
    request = template["spec"]["spec"]["devices"]["requests"][0]
    assert request.get("exactly", request)["deviceClassName"] == "gpu.nvidia.com"  # v1 nests it under exactly
    (claim,) = spec["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    for name in ("kvtier", "engine"):
        res = container(spec, name)["resources"]
        assert res.get("claims") == [{"name": claim["name"]}], name
        assert "nvidia.com/gpu" not in res.get("limits", {}), "a device-plugin GPU is one container's only"
    assert spec.get("shareProcessNamespace") is True
    assert container(spec, "kvtier")["image"].endswith("-cuda")
    # The engine leaves room on the GPU for the device tier and a CUDA context.
    utils = [a for a in container(spec, "engine")["args"] if a.startswith("--gpu-memory-utilization=")]
    assert len(utils) == 1
    util = float(utils[0].split("=", 1)[1])
    assert util * GPU_TOTAL <= GPU_TOTAL - device - CUDA_CONTEXT, (
        f"--gpu-memory-utilization {util} leaves less than device_size x max_pools "
        f"({device / 2**30:g} GiB) + a CUDA context on an 80 GiB GPU")


@pytest.mark.parametrize("variant", sorted(TOKENS))
def test_tokens(variant):
    docs = render(variant)
    spec = pod_spec(docs)
    config = daemon_config(docs)
    assert config["KVTIER_AUTH"] == "tokens"
    m = mount_for(container(spec, "kvtier"), config["KVTIER_TOKENS_FILE"])
    assert m is not None and m.get("readOnly") and "subPath" not in m, "SIGHUP reloads need a directory mount"
    secret = volume(docs, m["name"])["secret"]
    assert secret["secretName"] == "kvtier-tokens"
    assert os.path.basename(config["KVTIER_TOKENS_FILE"]) in {i["path"] for i in secret["items"]}
    engine = container(spec, "engine")
    token_file = kv_transfer_config(engine)["kv_connector_extra_config"]["token_file"]
    em = mount_for(engine, token_file)
    assert em is not None and volume(docs, em["name"])["secret"]["secretName"] == "kvtier-tokens"
    assert em["name"] != m["name"], "the engine sees its token, not the daemon's token table"


@pytest.mark.parametrize("variant", sorted(MONITORING))
def test_podmonitor(variant):
    docs = render(variant)
    pm = one(docs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    labels = one(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert "metrics" in {p["name"] for p in container(pod_spec(docs), "kvtier")["ports"]}


def test_without_monitoring_no_crd_objects():
    for variant in set(ALL_VARIANTS) - MONITORING - GPU:
        kinds = {d["kind"] for d in render(variant)}
        assert not kinds & {"PodMonitor", "ServiceMonitor", "ResourceClaimTemplate"}, variant


def test_old_manifest_gone_and_docs_point_at_real_paths():
    assert not (ROOT / "deploy" / "k8s-sidecar.yaml").exists()
    ops = (ROOT / "docs" / "operations.md").read_text()
    mentioned = set(re.findall(r"deploy/k8s/[A-Za-z0-9_./-]*[A-Za-z0-9_]", ops))
    assert mentioned, "docs/operations.md should walk through deploy/k8s"
    for path in mentioned:
        assert (ROOT / path).exists(), f"docs/operations.md names {path}, which does not exist"


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_daemon_accepts_its_config(variant):
    """The daemon's own configuration reader takes every KVTIER_* the pod sets (an unknown
    or misspelt key would be silently ignored by the environment reader: refuse it here)."""
    from kvtier.server.config import BY_KEY, load_config

    config = daemon_config(render(variant))
    unknown = [k for k in config if k[len("KVTIER_"):].lower() not in BY_KEY]
    assert not unknown, f"not daemon options: {unknown}"
    cfg = load_config(None, config, {})
    assert cfg.metrics.port == int(config["KVTIER_METRICS_PORT"])


def test_helm_chart_lints_and_derives_sizes():
    """`helm lint` passes, and the chart derives every partner of a size from the size."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's SDK) is not installed")
    report = helm.lint(str(HELM_CHART))
    assert not report["errors"], report
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]  # info only
    docs = render("helm-production")
    config = daemon_config(docs)
    assert (config["KVTIER_HOST_SIZE"], config["KVTIER_MAX_POOLS"], config["KVTIER_POLICY"]) == ("48GiB", "2", "lru")
    spec = pod_spec(docs)
    assert quantity(container(spec, "kvtier")["resources"]["limits"]["memory"]) == parse_size("98GiB")
    assert spec["terminationGracePeriodSeconds"] == 30 + 2 * 60 + 15
    a, b = (one(render(v), "StatefulSet")["spec"]["template"]["metadata"]["annotations"]["checksum/kvtier-config"]
            for v in ("helm-cpu", "helm-tokens"))
    assert a != b, "a changed option must roll the pods"
    from helm_python.errors import HelmError

    with pytest.raises(HelmError, match="cache.mode"):
        helm.Chart.load(str(HELM_CHART)).render({"cache": {"mode": "nfs"}}, name="llm")


# -- every kvtier pod: keeper, identity, hardening -------------------------------------------
KUSTOMIZE_KVTIER_PODS = [*VARIANTS, *CHARTS, "node"]
KEEPER_SOCKET = "/run/kvtier-keeper/keeper.sock"
DAEMON_SC = {"runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": SHARED_GID,
             "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def check_hardened(c: dict, pod: dict) -> None:
    """Non-root, read-only root, no privilege escalation, no capabilities, RuntimeDefault."""
    sc = c.get("securityContext", {})
    for key, want in DAEMON_SC.items():
        if key != "runAsUser":
            assert sc.get(key) == want, (c["name"], key, sc.get(key))
    assert sc.get("runAsUser", 0) != 0 and not sc.get("privileged")
    seccomp = sc.get("seccompProfile") or pod.get("securityContext", {}).get("seccompProfile")
    assert seccomp == {"type": "RuntimeDefault"}, c["name"]


@pytest.mark.parametrize("variant", KUSTOMIZE_KVTIER_PODS)
def test_keeper_container(variant):
    """Warm restart in a pod: the arena keeper is a native sidecar of its own, before the
    daemon, as the daemon's uid and hardened as it is, sharing only the keeper emptyDir."""
    docs = render(variant)
    pod = pod_spec(docs)
    names = [c["name"] for c in all_containers(pod)]
    keeper, daemon = container(pod, "kvtier-keeper"), container(pod, "kvtier")
    assert keeper in pod["initContainers"] and keeper.get("restartPolicy") == "Always"
    assert names.index("kvtier-keeper") < names.index("kvtier"), names
    assert keeper["image"] == daemon["image"] and "command" not in keeper
    assert keeper["args"] == ["keeper", "--socket", KEEPER_SOCKET, "--window", "5m"]
    assert keeper["startupProbe"]["exec"]["command"] == ["kvtier", "keeper", "--check", "--socket", KEEPER_SOCKET]
    check_hardened(keeper, pod)
    assert {k: keeper["securityContext"].get(k) for k in DAEMON_SC} == {k: daemon["securityContext"].get(k) for k in DAEMON_SC}
    res = keeper["resources"]
    assert quantity(res["limits"]["memory"]) == quantity(res["requests"]["memory"]) == parse_size("64MiB")
    assert quantity(res["requests"]["cpu"]) == 0.05
    km, dm = mount_for(keeper, KEEPER_SOCKET), mount_for(daemon, KEEPER_SOCKET)
    assert km and dm and km["name"] == dm["name"] == "keeper" and km["mountPath"] == "/run/kvtier-keeper"
    vol = {v["name"]: v for v in pod["volumes"]}["keeper"]
    assert "emptyDir" in vol
    assert [c["name"] for c in all_containers(pod) if mount_for(c, KEEPER_SOCKET)] == ["kvtier-keeper", "kvtier"]
    assert env_of(daemon)["KVTIER_KEEPER_SOCKET"]["value"] == KEEPER_SOCKET
    assert daemon_config(docs)["KVTIER_KEEPER_SOCKET"] == KEEPER_SOCKET


@pytest.mark.parametrize("variant", KUSTOMIZE_KVTIER_PODS)
def test_identity_and_policy(variant):
    """The daemon knows its pod IP, node and pod name (events, logs); the policy is the
    daemon's default, frecency."""
    docs = render(variant)
    env = env_of(container(pod_spec(docs), "kvtier"))
    for name, path in (("KVTIER_POD_IP", "status.podIP"), ("KVTIER_NODE_NAME", "spec.nodeName"),
                       ("KVTIER_POD_NAME", "metadata.name")):
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == path, name
    assert daemon_config(docs).get("KVTIER_POLICY", "frecency") == "frecency"


@pytest.mark.parametrize("variant", [*VARIANTS, "node-engine"])
def test_engine_hardened(variant):
    """The engine container is hardened as the daemon's, under a uid of its own, with
    emptyDirs for what vLLM writes (its home with the caches, /tmp)."""
    docs = render(variant)
    workload = next(d for d in docs if has_container(d, "engine"))
    pod = pod_of(workload)
    engine = container(pod, "engine")
    check_hardened(engine, pod)
    assert engine["securityContext"]["runAsUser"] not in (0, NON_ROOT_UID), "not the daemon's uid"
    home = env_of(engine)["HOME"]["value"]
    for path in (home, "/tmp", env_of(engine)["HF_HOME"]["value"]):
        m = mount_for(engine, path)
        assert m is not None, f"{path} is not writable with a read-only root"
        assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[m["name"]], path


# -- PDB, placement, events, network policy, alerts ------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_pdb(variant):
    docs = render(variant)
    pdb = one(docs, "PodDisruptionBudget")
    labels = one(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] and pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_production_placement():
    docs = render("production")
    pod = pod_spec(docs)
    labels = one(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert pod["priorityClassName"] == one(docs, "PriorityClass")["metadata"]["name"]
    assert pod["nodeSelector"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    keys = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for c in pod["topologySpreadConstraints"]:
        assert c["labelSelector"]["matchLabels"].items() <= labels.items() and c["maxSkew"] == 1


def test_events_on_in_production():
    docs = render("production")
    config = daemon_config(docs)
    assert config["KVTIER_EVENTS"] == "tcp://*:5557" and config["KVTIER_EVENTS_NAMESPACES"]
    ports = {p["name"]: p["containerPort"] for p in container(pod_spec(docs), "kvtier")["ports"]}
    assert ports["kv-events"] == 5557
    assert {"name": "kv-events", "port": 5557, "targetPort": "kv-events"} in one(docs, "Service")["spec"]["ports"]


def check_network_policy(docs, pod_labels: dict, pod: dict) -> None:
    """The policy selects the kvtier pods (and only pods with their labels), and lets the
    metrics and events ports be reached only from named peers."""
    policy = one(docs, "NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector and selector.items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    ports = {p["name"] for c in all_containers(pod) for p in c.get("ports", [])}
    by_port = {}
    for rule in policy["spec"]["ingress"]:
        for p in rule["ports"]:
            assert p["port"] in ports, f"the policy names port {p['port']}, which no container has"
            by_port[p["port"]] = rule
    for port in ("metrics", "kv-events"):
        peers = by_port[port].get("from")
        assert peers, f"{port} is open to every pod"
        for peer in peers:
            # kustomize must not have added the pods' own labels to the peers' selectors
            assert not (peer["podSelector"]["matchLabels"].items() & pod_labels.items()), peer


def test_network_policy_production():
    docs = render("production")
    check_network_policy(docs, one(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"], pod_spec(docs))


def documented_metrics() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"`(kvtier_[a-z_]+)", text))


@pytest.mark.parametrize("variant", sorted(MONITORING - {v for v in MONITORING if v.startswith("helm")}))
def test_prometheus_rule(variant):
    rule = one(render(variant), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"KvtierDown", "KvtierNotReady", "KvtierCorruptPages", "KvtierEventsDropped", "KvtierDiskErrors",
            "KvtierDiskBacklog", "KvtierEvictingRecentPages", "KvtierLeasesHeld"} <= set(alerts)
    known = documented_metrics()
    for name, r in alerts.items():
        expr = r["expr"]
        assert expr.count("(") == expr.count(")"), name
        used = set(re.findall(r"\b(kvtier_[a-z_]+)\b", re.sub(r"\b(?:by|on|ignoring)\s*\([^)]*\)", "", expr)))
        assert used <= known, f"{name} uses metrics docs/metrics.md does not list: {used - known}"
        assert "kvtier_namespace=" not in expr and not re.search(r"[{,]\s*namespace=", expr), name
        assert r["labels"]["severity"] in {"critical", "warning", "info"}
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        if "for" in r:
            seconds(r["for"])


# -- kvtier added to other charts' engine pods -----------------------------------------------
def chart_input(chart: str) -> list[dict]:
    path, name, _ = CHARTS[chart]
    return [d for d in yaml.safe_load_all((path / name).read_text()) if d]


def engine_command(c: dict) -> list[str]:
    return c.get("command", []) + c.get("args", [])


@pytest.mark.parametrize("chart", list(CHARTS))
def test_sidecar_added_to_chart(chart):
    docs = render(chart)
    _, _, engine_name = CHARTS[chart]
    workload = kvtier_workload(docs)
    pod = pod_of(workload)
    before = {(d["kind"], d["metadata"]["name"]): d for d in chart_input(chart)}
    original = before[(workload["kind"], workload["metadata"]["name"])]
    # The chart's pod is kept: every container, volume and env entry it had, as it had them.
    for c in all_containers(pod_of(original)):
        now = container(pod, c["name"])
        for key in ("image", "command", "args", "ports", "resources", "restartPolicy"):
            assert now.get(key) == c.get(key), (c["name"], key)
        assert env_of(c).items() <= env_of(now).items(), c["name"]
        assert all(m in now.get("volumeMounts", []) for m in c.get("volumeMounts", [])), c["name"]
    assert all(v in pod["volumes"] for v in pod_of(original).get("volumes", []))
    # Other objects of the chart are left alone.
    for d in docs:
        key = (d["kind"], d["metadata"]["name"])
        if key in before and d is not workload:
            assert d == before[key], key
    # kvtier's containers: native sidecars, the keeper first, before the chart's own sidecars too.
    names = [c["name"] for c in pod["initContainers"]]
    assert names[:2] == ["kvtier-keeper", "kvtier"], names
    daemon = container(pod, "kvtier")
    assert daemon.get("restartPolicy") == "Always" and daemon["args"] == ["serve"] and "command" not in daemon
    assert re.fullmatch(r"[^/]+/[^:]+:[^:]+", daemon["image"]), daemon["image"]
    check_hardened(daemon, pod)
    config = daemon_config(docs)
    # The engine reaches the daemon's socket through the same emptyDir, as gid 2000.
    engine = container(pod, engine_name)
    sock_dir = os.path.dirname(config["KVTIER_SOCKET"])
    dm, em = mount_for(daemon, sock_dir), mount_for(engine, sock_dir)
    assert dm and em and dm["name"] == em["name"] and "emptyDir" in {v["name"]: v for v in pod["volumes"]}[dm["name"]]
    assert env_of(engine)["KVTIER_TARGET"]["value"] == "unix://" + config["KVTIER_SOCKET"]
    assert SHARED_GID in pod["securityContext"]["supplementalGroups"]
    transfer = json.loads(next(a for a in engine_command(engine) if "KVTierConnector" in a).split("=", 1)[-1])
    assert transfer["kv_connector"] == "KVTierConnector"
    assert transfer["kv_connector_module_path"] == "kvtier_client.integrations.vllm"
    # Sizes and their partners, the grace period, the probes.
    cache = mount_for(daemon, config["KVTIER_CACHE_DIR"])
    assert cache and cache["mountPath"] == config["KVTIER_CACHE_DIR"]
    cache_vol = {v["name"]: v for v in pod["volumes"]}[cache["name"]]
    assert quantity(cache_vol["emptyDir"]["sizeLimit"]) >= pools_bytes(config, "KVTIER_DISK_SIZE")
    res = daemon["resources"]
    assert quantity(res["limits"]["memory"]) >= pools_bytes(config, "KVTIER_HOST_SIZE") + DAEMON_OVERHEAD
    assert res["requests"]["memory"] == res["limits"]["memory"]
    assert quantity(res["requests"]["ephemeral-storage"]) >= quantity(cache_vol["emptyDir"]["sizeLimit"])
    drain = seconds(config["KVTIER_DRAIN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] >= ENGINE_STOP_S + 2 * drain
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert ports[daemon["readinessProbe"]["httpGet"]["port"]] == int(config["KVTIER_METRICS_PORT"])
    pod_ports = [p["name"] for c in all_containers(pod) for p in c.get("ports", []) if "name" in p]
    assert len(pod_ports) == len(set(pod_ports)), pod_ports
    for path, probe in (("/healthz", "livenessProbe"), ("/readyz", "readinessProbe"), ("/readyz", "startupProbe")):
        assert daemon[probe]["httpGet"]["path"] == path


def test_sidecar_llm_d_events():
    """llm-d's centralized mode: each engine's kvtier connects to the endpoint picker, which
    binds the event port; the daemon listens on no port for it."""
    docs = render("llm-d")
    config = daemon_config(docs)
    host, port = re.fullmatch(r"tcp://([a-z0-9-]+):(\d+)", config["KVTIER_EVENTS"]).groups()
    assert config["KVTIER_EVENTS_CONNECT"] == "true"
    epp = one([d for d in docs if d["metadata"]["name"] == host], "Deployment")
    assert int(port) in {p["containerPort"] for p in container(pod_of(epp), "epp")["ports"]}
    assert "kv-events" not in {p["name"] for p in container(pod_spec(docs), "kvtier")["ports"]}


def test_sidecar_patches_agree():
    """The Deployment patch and the InferenceService patch add the same pod parts."""
    deployment = yaml.safe_load((K8S / "components" / "sidecar" / "deployment.yaml").read_text())
    isvc = yaml.safe_load((K8S / "components" / "sidecar-kserve" / "inferenceservice.yaml").read_text())
    a, b = deployment["spec"]["template"]["spec"], isvc["spec"]["predictor"]
    for key in ("terminationGracePeriodSeconds", "securityContext", "volumes", "initContainers"):
        assert a[key] == b[key], key
    (ea,), (eb,) = a["containers"], b["containers"]
    assert (ea["name"], eb["name"]) == ("vllm", "kserve-container")
    assert {k: v for k, v in ea.items() if k != "name"} == {k: v for k, v in eb.items() if k != "name"}


# -- the node-wide daemon --------------------------------------------------------------------
NODE_SOCKET_DIR, NODE_CACHE_DIR = "/var/run/kvtier", "/var/lib/kvtier"


def test_node_daemonset():
    docs = render("node")
    ds = one(docs, "DaemonSet")
    pod = pod_of(ds)
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0, "never two daemons on one cache dir"
    assert not any(pod.get(k) for k in ("hostIPC", "hostNetwork", "hostPID")), "memfds need no host namespaces"
    daemon = container(pod, "kvtier")
    assert daemon in pod["containers"] and [c["name"] for c in pod["containers"]] == ["kvtier"], "kvtier alone"
    config = daemon_config(docs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    sock = mount_for(daemon, os.path.dirname(config["KVTIER_SOCKET"]))
    assert sock["mountPath"] == "/run/kvtier" and config["KVTIER_SOCKET"] == "/run/kvtier/kvtier.sock"
    assert volumes[sock["name"]]["hostPath"] == {"path": NODE_SOCKET_DIR, "type": "DirectoryOrCreate"}
    cache = mount_for(daemon, config["KVTIER_CACHE_DIR"])
    assert cache["mountPath"] == config["KVTIER_CACHE_DIR"] and "subPathExpr" not in cache
    assert volumes[cache["name"]]["hostPath"] == {"path": NODE_CACHE_DIR, "type": "DirectoryOrCreate"}
    # The hostPath directories are the daemon's: made so by root with CHOWN and FOWNER only, first.
    dirs = pod["initContainers"][0]
    assert dirs["name"] == "kvtier-dirs" and "restartPolicy" not in dirs
    assert dirs["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert dirs["securityContext"]["allowPrivilegeEscalation"] is False
    assert f"chown {NON_ROOT_UID}:{SHARED_GID} /run/kvtier /var/cache/kvtier" in dirs["command"][-1]
    assert {m["name"] for m in dirs["volumeMounts"]} == {sock["name"], cache["name"]}
    check_hardened(daemon, pod)
    # Sizes, grace (no engine in this pod), probes, ports, config.
    res = daemon["resources"]
    assert quantity(res["limits"]["memory"]) >= pools_bytes(config, "KVTIER_HOST_SIZE") + DAEMON_OVERHEAD
    assert res["requests"]["memory"] == res["limits"]["memory"]
    assert pod["terminationGracePeriodSeconds"] >= 2 * seconds(config["KVTIER_DRAIN_TIMEOUT"]) + 15
    ports = {p["name"]: p["containerPort"] for p in daemon["ports"]}
    assert ports == {"metrics": int(config["KVTIER_METRICS_PORT"]), "kv-events": 5557}
    assert config["KVTIER_EVENTS"] == "tcp://*:5557"
    assert daemon["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    check_network_policy(docs, ds["spec"]["template"]["metadata"]["labels"], pod)


def test_node_engine_uses_the_node_daemon():
    daemon_docs, docs = render("node"), render("node-engine")
    node_pod, config = pod_of(one(daemon_docs, "DaemonSet")), daemon_config(daemon_docs)
    deployment = one(docs, "Deployment")
    pod = pod_of(deployment)
    engine = container(pod, "engine")
    assert "kvtier" not in [c["name"] for c in all_containers(pod)], "no daemon of its own"
    sock_dir = os.path.dirname(config["KVTIER_SOCKET"])
    m = mount_for(engine, sock_dir)
    assert m and m["mountPath"] == sock_dir
    assert {v["name"]: v for v in pod["volumes"]}[m["name"]]["hostPath"] == {"path": NODE_SOCKET_DIR, "type": "Directory"}
    target = "unix://" + config["KVTIER_SOCKET"]
    assert env_of(engine)["KVTIER_TARGET"]["value"] == target
    assert kv_transfer_config(engine)["kv_connector_extra_config"]["target"] == target
    assert SHARED_GID in pod["securityContext"]["supplementalGroups"]
    assert pod["nodeSelector"].items() <= node_pod["nodeSelector"].items(), "engines go where the daemon runs"
    assert not any(pod.get(k) for k in ("hostIPC", "hostNetwork", "hostPID"))


@pytest.mark.parametrize("variant", [*CHARTS, "node"])
def test_other_deployments_daemon_accepts_its_config(variant):
    """As test_daemon_accepts_its_config, for the sidecar in other charts and the node daemon."""
    from kvtier.server.config import BY_KEY, load_config

    config = daemon_config(render(variant))
    unknown = [k for k in config if k[len("KVTIER_"):].lower() not in BY_KEY]
    assert not unknown, f"not daemon options: {unknown}"
    assert load_config(None, config, {}).metrics.port == int(config["KVTIER_METRICS_PORT"])


def test_examples_and_components_all_checked():
    """Every example and component directory is rendered by some test here."""
    rendered = {*VARIANTS.values(), *NODE.values(), *(path for path, _, _ in CHARTS.values())}
    for path in (K8S / "examples").iterdir():
        assert path in rendered, f"{path} is not rendered by the tests"
    used = set()
    for path in rendered:
        used |= {(path / c).resolve() for c in yaml.safe_load((path / "kustomization.yaml").read_text()).get("components", [])}
    used |= {(K8S / "components" / "sidecar").resolve()}  # through sidecar-kserve
    for path in (K8S / "components").iterdir():
        assert path.resolve() in used, f"components/{path.name} is in no rendered variant"
