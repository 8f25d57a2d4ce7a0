"""The Kubernetes manifests under deploy/k8s, rendered and checked offline.

Each variant (the CPU default base and the overlays) is rendered with `kubectl kustomize`
(kustomize built into kubectl; no cluster needed) and its objects are checked for what the
deployment must get right: the daemon is a native sidecar, its cache directory is its own
per pod, memory and /dev/shm cover every pool, probes hit /healthz and /readyz on the
metrics port, the grace period covers drain and persist, the security context is tight, and
the GPU, tokens and monitoring parts are wired together. `kubectl create --dry-run=client`
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
    out = subprocess.run([KUBECTL, "kustomize", str(VARIANTS[variant])], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {VARIANTS[variant]} failed:\n{out.stderr}"
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


def pod_spec(docs) -> dict:
    return one(docs, "StatefulSet")["spec"]["template"]["spec"]


def container(spec: dict, name: str) -> dict:
    for c in spec.get("initContainers", []) + spec.get("containers", []):
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
    for t in one(docs, "StatefulSet")["spec"].get("volumeClaimTemplates", []):
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
    assert kinds.count("ConfigMap") == 1
    assert "Pod" not in kinds and "Deployment" not in kinds


def check_native_sidecar(docs) -> None:
    spec = pod_spec(docs)
    inits = {c["name"]: c for c in spec.get("initContainers", [])}
    mains = {c["name"]: c for c in spec.get("containers", [])}
    assert "kvtier" in inits and "kvtier" not in mains, "kvtier must be an init container"
    assert inits["kvtier"].get("restartPolicy") == "Always", "a native sidecar has restartPolicy Always"
    assert "engine" in mains
    names = list(inits) + list(mains)
    assert len(names) == len(set(names)), "container names must be unique in a pod"


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
    sts = one(docs, "StatefulSet")
    spec = sts["spec"]
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
    assert (prod["KVTIER_HOST_SIZE"], prod["KVTIER_MAX_POOLS"], prod["KVTIER_POLICY"]) == ("48GiB", "2", "lru")
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
