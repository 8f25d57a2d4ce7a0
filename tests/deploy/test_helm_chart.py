"""The Helm charts under deploy/helm, rendered offline through Helm's own Go SDK
(helm-python-sdk, as tests/deploy/test_manifests.py does) and checked for what each value
must render: the scheduling and metadata values, the PodDisruptionBudget, NetworkPolicy,
PrometheusRule and DRA objects, the hardened engine, the keeper, node mode, the values
schema (generated, not stale, refusing unknown keys), and the kvtier-sidecar library (it
renders the very containers the main chart does, and the examples for other charts hold
what it renders).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_manifests import ALL_CHECKS, HELM_CHART, ROOT, container, one

yaml = pytest.importorskip("yaml")
helm = pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's SDK) is not installed")
from helm_python.errors import HelmError

from kvtier.policy import POLICIES
from kvtier.server.config import BY_KEY, OPTIONS

LIBRARY = ROOT / "deploy" / "helm" / "kvtier-sidecar"
EXAMPLES = LIBRARY / "examples"
GEN_SCHEMA = ROOT / "scripts" / "gen_values_schema.py"
EXAMPLE_VALUES = {"cache": {"mode": "emptyDir"}}  # what the examples were rendered with
EXAMPLE_NAMESPACE = "llama-3.1-8b/default"


def render(values: dict | None = None, *, namespace: str = "default") -> tuple[dict, ...]:
    """The main chart's manifests for `values` (release "llm"); NOTES.txt is not one."""
    out = helm.Chart.load(str(HELM_CHART)).render(values or {}, name="llm", namespace=namespace, is_install=True)
    return tuple(doc for path, text in sorted(out.items()) if path.endswith(".yaml")
                 for doc in yaml.safe_load_all(text) if doc is not None)


def notes(values: dict) -> str:
    out = helm.Chart.load(str(HELM_CHART)).render(values, name="llm", namespace="default", is_install=True)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


def kinds(docs) -> list[str]:
    return sorted(d["kind"] for d in docs)


def workload(docs) -> dict:
    (w,) = [d for d in docs if d["kind"] in ("StatefulSet", "DaemonSet")]
    return w


def pod(docs) -> dict:
    return workload(docs)["spec"]["template"]["spec"]


def configmap(docs) -> dict[str, str]:
    return one(docs, "ConfigMap")["data"]


# The library rendered on its own, from a chart of a user's that depends on it.
LIBRARY_TEMPLATE = """\
{{- $ctx := include "kvtier-sidecar.context" (dict "values" .Values.kvtier "name" "engine") | fromYaml -}}
{{- $ctx = mustMerge .Values.ctx $ctx -}}
{{- toJson (dict
  "initContainers" (include "kvtier-sidecar.initContainers" $ctx | fromYamlArray)
  "daemonContainer" (include "kvtier-sidecar.daemonContainer" $ctx | fromYamlArray)
  "volumes" (include "kvtier-sidecar.volumes" $ctx | fromYamlArray)
  "engineEnv" (include "kvtier-sidecar.engineEnv" $ctx | fromYamlArray)
  "engineVolumeMounts" (include "kvtier-sidecar.engineVolumeMounts" $ctx | fromYamlArray)
  "podSecurityContext" (include "kvtier-sidecar.podSecurityContext" $ctx | fromYaml)
  "daemonEnv" (include "kvtier-sidecar.daemonEnv" $ctx | fromYaml)
  "kvTransferConfig" (include "kvtier-sidecar.kvTransferConfig" $ctx)
  "terminationGracePeriodSeconds" (include "kvtier-sidecar.terminationGracePeriodSeconds" $ctx)
) }}
"""


def render_library(values: dict, ctx: dict | None = None) -> dict:
    """What the library's templates render for `values` (a user's kvtier block) and the
    extra context keys `ctx` (namespace, configMapName, role...)."""
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp)
        (chart / "templates").mkdir()
        (chart / "charts").mkdir()
        (chart / "Chart.yaml").write_text(
            "apiVersion: v2\nname: user\nversion: 0.1.0\n"
            "dependencies:\n  - {name: kvtier-sidecar, version: 0.1.0, repository: file://unused}\n")
        (chart / "charts" / "kvtier-sidecar").symlink_to(LIBRARY)
        (chart / "templates" / "parts.yaml").write_text(LIBRARY_TEMPLATE)
        out = helm.Chart.load(str(chart)).render({"kvtier": values, "ctx": ctx or {}}, name="x")
        return json.loads(out["user/templates/parts.yaml"])


# -- scheduling, metadata, hardening ------------------------------------------------------
def test_scheduling_and_metadata_values_render():
    values = {
        "nodeSelector": {"nvidia.com/gpu.product": "H100"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
        "priorityClassName": "llm-serving",
        "podAnnotations": {"example.com/team": "inference"},
        "podLabels": {"team": "inference"},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "DoNotSchedule"}],
    }
    for mode in ("sidecar", "node"):
        docs = render({**values, "mode": mode})
        tmpl = workload(docs)["spec"]["template"]
        spec = tmpl["spec"]
        assert spec["nodeSelector"] == values["nodeSelector"]
        assert spec["tolerations"] == values["tolerations"]
        assert spec["affinity"] == values["affinity"]
        assert spec["priorityClassName"] == "llm-serving"
        assert tmpl["metadata"]["annotations"]["example.com/team"] == "inference"
        assert "checksum/kvtier-config" in tmpl["metadata"]["annotations"]
        assert tmpl["metadata"]["labels"]["team"] == "inference"
        assert workload(docs)["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
    # Spread: sidecar mode only (a DaemonSet is one pod per node); a constraint without a
    # labelSelector gets the release's pods.
    sts = workload(render(values))
    (spread,) = sts["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    assert spread["labelSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    assert "topologySpreadConstraints" not in pod(render({**values, "mode": "node"}))
    # The default spreads over nodes, softly; GPU adds its toleration to the user's.
    (default_spread,) = pod(render())["topologySpreadConstraints"]
    assert default_spread["topologyKey"] == "kubernetes.io/hostname"
    assert default_spread["whenUnsatisfiable"] == "ScheduleAnyway"
    gpu = pod(render({"gpu": {"enabled": True}, "tolerations": values["tolerations"]}))
    assert [t["key"] for t in gpu["tolerations"]] == ["dedicated", "nvidia.com/gpu"]
    for key in ("nodeSelector", "affinity", "priorityClassName", "tolerations"):
        assert key not in pod(render()), f"{key} rendered without being set"


def test_engine_hardened_like_the_daemon():
    spec = pod(render())
    engine, daemon = container(spec, "engine"), container(spec, "kvtier")
    sc = engine["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] not in (0, daemon["securityContext"]["runAsUser"])
    assert sc["runAsGroup"] == 2000, "the engine reaches the 0660 sockets through group 2000"
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"} and sc["readOnlyRootFilesystem"] is True
    # With a read-only root, what vLLM writes (HOME with the HF cache, /tmp, /dev/shm) are volumes.
    env = {e["name"]: e.get("value") for e in engine["env"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
    for path in (env["HOME"], "/tmp", "/dev/shm", env["HF_HOME"].rsplit("/.cache", 1)[0]):
        assert path in mounts and "emptyDir" in volumes[mounts[path]], path
    assert env["USER"], "torch's caches need a user name the uid's missing passwd entry cannot give"


def test_policy_default_is_the_daemons_and_config_passes_through():
    data = configmap(render())
    assert data["KVTIER_POLICY"] == BY_KEY["policy"].default == "frecency"
    data = configmap(render({"config": {"policy": "s3fifo", "write_through": True, "history_size": 1000000,
                                        "disk_admission_threshold": 0.25, "cluster_timeout": "250ms"}}))
    assert data["KVTIER_POLICY"] == "s3fifo" and data["KVTIER_WRITE_THROUGH"] == "true"
    assert data["KVTIER_HISTORY_SIZE"] == "1000000", "whole numbers without an exponent"
    assert (data["KVTIER_DISK_ADMISSION_THRESHOLD"], data["KVTIER_CLUSTER_TIMEOUT"]) == ("0.25", "250ms")
    from kvtier.server.config import load_config

    cfg = load_config(None, {k: v for k, v in data.items() if k[7:].lower() in BY_KEY}, {})
    assert cfg.tiers.write_through is True and cfg.tiers.history_size == 1000000


def test_keeper_runs_beside_the_daemon_in_every_mode():
    for mode in ("sidecar", "node"):
        docs = render({"mode": mode})
        spec = pod(docs)
        inits = [c["name"] for c in spec["initContainers"]]
        keeper = container(spec, "kvtier-keeper")
        daemon = container(spec, "kvtier")
        assert keeper["restartPolicy"] == "Always"
        if mode == "sidecar":
            assert inits.index("kvtier-keeper") < inits.index("kvtier"), "the keeper starts first, stops last"
        else:
            assert "kvtier" not in inits, "node mode: the daemon is the DaemonSet pod's main container"
        assert keeper["image"] == daemon["image"]
        assert keeper["securityContext"] == daemon["securityContext"]
        assert keeper["args"] == ["keeper", "--socket", "/run/kvtier-keeper/keeper.sock", "--window", "5m"]
        assert keeper["resources"]["requests"] == {"cpu": "50m", "memory": "64Mi"}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes["keeper"]
        for c in (keeper, daemon):
            assert {"name": "keeper", "mountPath": "/run/kvtier-keeper"} in c["volumeMounts"]
        assert configmap(docs)["KVTIER_KEEPER_SOCKET"] == "/run/kvtier-keeper/keeper.sock"
        assert "keeper_socket" in BY_KEY, "the daemon takes an external keeper's socket"
    off = render({"warmRestart": {"enabled": False}})
    assert "kvtier-keeper" not in [c["name"] for c in pod(off)["initContainers"]]
    assert "keeper" not in {v["name"] for v in pod(off)["volumes"]}
    data = configmap(off)
    assert "KVTIER_KEEPER_SOCKET" not in data and data["KVTIER_WARM_RESTART_WINDOW"] == "0"


@pytest.mark.parametrize("values", [{"warmRestart": {"enabled": False}}, {"events": {"enabled": True}},
                                    {"cache": {"mode": "emptyDir"}}, {"replicas": 3, "tokens": {"enabled": True}}],
                         ids=["no-keeper", "events", "emptydir-cache", "tokens-3"])
@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda f: f.__name__[6:])
def test_new_value_sets_pass_the_manifest_checks(values, check):
    if check.__name__ == "check_cache_per_pod" and values.get("cache", {}).get("mode") == "emptyDir":
        pytest.skip("an emptyDir is the pod's own: nothing to share")
    check(render(values))


# -- PodDisruptionBudget, NetworkPolicy, PrometheusRule, DRA ------------------------------
def test_pod_disruption_budget():
    assert "PodDisruptionBudget" not in kinds(render()), "one replica: a budget would block drains"
    docs = render({"replicas": 3})
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1" and pdb["metadata"]["name"]
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["selector"]["matchLabels"] == workload(docs)["spec"]["selector"]["matchLabels"]
    assert "PodDisruptionBudget" not in kinds(render({"replicas": 3, "podDisruptionBudget": {"enabled": False}}))
    assert "PodDisruptionBudget" not in kinds(render({"replicas": 3, "mode": "node"}))


def test_network_policy():
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    subscribers = [{"podSelector": {"matchLabels": {"app": "epp"}}}]
    for mode in ("sidecar", "node"):
        docs = render({"mode": mode, "events": {"enabled": True},
                       "networkPolicy": {"metricsFrom": peers, "eventsFrom": subscribers}})
        np = one(docs, "NetworkPolicy")
        assert np["apiVersion"] == "networking.k8s.io/v1" and np["metadata"]["name"]
        assert np["spec"]["policyTypes"] == ["Ingress"]
        assert np["spec"]["podSelector"]["matchLabels"] == workload(docs)["spec"]["selector"]["matchLabels"]
        rules = {r["ports"][0]["port"]: r for r in np["spec"]["ingress"]}
        ports = {p["name"] for c in pod(docs)["containers"] + pod(docs).get("initContainers", [])
                 for p in c.get("ports", [])}
        assert set(rules) <= ports, "every rule names a port a container has"
        assert rules["metrics"]["from"] == peers and rules["kv-events"]["from"] == subscribers
        assert ("http" in rules) == (mode == "sidecar") and "from" not in rules.get("http", {})
        assert container(pod(docs), "kvtier")["ports"][1] == {"name": "kv-events", "containerPort": 5557}
        assert configmap(docs)["KVTIER_EVENTS"] == "tcp://*:5557"
    default = one(render(), "NetworkPolicy")
    assert {r["ports"][0]["port"] for r in default["spec"]["ingress"]} == {"http", "metrics"}, "no events port when off"
    assert "NetworkPolicy" not in kinds(render({"networkPolicy": {"enabled": False}}))


def _metric_names() -> set[str]:
    """The series docs/metrics.md documents, counters with their _total."""
    table = (ROOT / "docs" / "metrics.md").read_text()
    names = set()
    for row in re.findall(r"^\| (`kvtier_[^|]+)\|", table, re.MULTILINE):
        names.update(re.findall(r"`(kvtier_[a-z_]+)", row))
    return names


def test_prometheus_rule():
    assert "PrometheusRule" not in kinds(render())
    docs = render({"metrics": {"prometheusRule": {"enabled": True}}}, namespace="serving")
    rule = one(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["name"]
    assert rule["metadata"]["labels"] == {"release": "kube-prometheus-stack"}
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert {"KvtierDown", "KvtierNotReady", "KvtierCorruptPages", "KvtierEventsDropped", "KvtierDiskErrors",
            "KvtierDiskBacklog", "KvtierHostTierThrashing", "KvtierLeasesHeld"} <= set(alerts)
    documented = _metric_names()
    for name, r in alerts.items():
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)
        assert r["expr"].strip() and r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert r["expr"].count("(") == r["expr"].count(")") and r["expr"].count("{") == r["expr"].count("}")
        for metric in re.findall(r"\b(kvtier_[a-z_]+)\{", r["expr"]):
            assert metric in documented, f"{name} uses {metric}, which docs/metrics.md does not list"
        if "kvtier_" in r["expr"] or name == "KvtierDown":
            # Only this release's daemons: the PodMonitor's job, in the release's namespace.
            assert 'job="serving/llm-kvtier"' in r["expr"], name
        assert "by (namespace" not in r["expr"] or "kvtier_namespace" not in r["expr"]
    # The PodMonitor the selector matches is the chart's.
    pm = one(render({"metrics": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    assert pm["metadata"]["name"] == "llm-kvtier"
    custom = one(render({"metrics": {"prometheusRule": {"enabled": True, "selector": 'cluster="a"'}}}),
                 "PrometheusRule")
    assert 'up{cluster="a"}' in custom["spec"]["groups"][0]["rules"][0]["expr"]


def test_dra_v1_by_default_and_v1beta1_selectable():
    template = one(render({"gpu": {"enabled": True}}), "ResourceClaimTemplate")
    assert template["apiVersion"] == "resource.k8s.io/v1"
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request == {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
    beta = one(render({"gpu": {"enabled": True, "draApiVersion": "resource.k8s.io/v1beta1"}}), "ResourceClaimTemplate")
    assert beta["apiVersion"] == "resource.k8s.io/v1beta1"
    assert beta["spec"]["spec"]["devices"]["requests"] == [{"name": "gpu", "deviceClassName": "gpu.nvidia.com"}]


# -- node mode ----------------------------------------------------------------------------
def test_node_mode_is_a_daemonset_of_kvtier_alone():
    docs = render({"mode": "node"})
    assert "StatefulSet" not in kinds(docs) and "ResourceClaimTemplate" not in kinds(docs)
    ds = one(docs, "DaemonSet")
    spec = pod(docs)
    names = [c["name"] for c in spec.get("initContainers", []) + spec["containers"]]
    assert "engine" not in names and [c["name"] for c in spec["containers"]] == ["kvtier"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    volumes = {v["name"]: v for v in spec["volumes"]}
    daemon = container(spec, "kvtier")
    mounts = {m["mountPath"]: m for m in daemon["volumeMounts"]}
    run = volumes[mounts["/run/kvtier"]["name"]]
    assert run["hostPath"] == {"path": "/var/run/kvtier", "type": "DirectoryOrCreate"}
    cache = volumes[mounts["/var/cache/kvtier"]["name"]]
    assert cache["hostPath"] == {"path": "/var/lib/kvtier", "type": "DirectoryOrCreate"}
    assert "subPathExpr" not in mounts["/var/cache/kvtier"], "one daemon per node: the node's directory"
    assert "restartPolicy" not in daemon, "a main container"
    assert not spec.get("hostIPC") and not spec.get("hostNetwork"), "host pages go over the socket as memfds"
    assert spec["securityContext"]["supplementalGroups"] == [2000]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in daemon["env"] if "valueFrom" in e}
    assert env == {"KVTIER_POD_IP": "status.podIP", "KVTIER_NODE_NAME": "spec.nodeName",
                   "KVTIER_POD_NAME": "metadata.name"}
    # The host directories are the daemon's uid and group before it starts.
    dirs = container(spec, "kvtier-dirs")
    assert spec["initContainers"][0] is dirs or spec["initContainers"][0]["name"] == "kvtier-dirs"
    assert dirs["command"][:7] == ["install", "-d", "-o", "10001", "-g", "2000", "-m"]
    assert set(dirs["securityContext"]["capabilities"]["add"]) == {"CHOWN", "FOWNER"}
    assert "kvtier-dirs" not in [c["name"] for c in pod(render({"mode": "node", "node": {"prepareDirs": False}}))
                                 ["initContainers"]]
    # Engines are not the DaemonSet's to stop: its grace period is the drain's alone.
    assert spec["terminationGracePeriodSeconds"] == 2 * 30 + 15
    service = one(docs, "Service")
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]
    text = notes({"mode": "node"})
    assert "/var/run/kvtier" in text and "KVTIER_TARGET" in text and "supplementalGroups: [2000]" in text
    with pytest.raises(HelmError, match="gpu.enabled needs mode sidecar"):
        render({"mode": "node", "gpu": {"enabled": True}})


def test_engine_side_of_node_mode_from_the_library():
    parts = render_library({"mode": "node"}, {"namespace": "ns", "role": "engine"})
    assert parts["volumes"] == [{"name": "kvtier-run",
                                 "hostPath": {"path": "/var/run/kvtier", "type": "DirectoryOrCreate"}}]
    assert parts["engineVolumeMounts"] == [{"name": "kvtier-run", "mountPath": "/run/kvtier"}]
    assert parts["engineEnv"] == [{"name": "KVTIER_TARGET", "value": "unix:///run/kvtier/kvtier.sock"}]
    assert 2000 in parts["podSecurityContext"]["supplementalGroups"]


# -- the schema ---------------------------------------------------------------------------
def test_schema_is_not_stale():
    out = subprocess.run([sys.executable, str(GEN_SCHEMA), "--check"], check=False, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("values, where", [
    ({"nodeSelectr": {"a": "b"}}, "nodeSelectr"),
    ({"kvtier": {"hostSize": 8}}, "hostSize"),
    ({"config": {"polcy": "lru"}}, "polcy"),
    ({"config": {"host_size": "8GiB"}}, "host_size"),  # the chart's: kvtier.hostSizeGiB
    ({"config": {"policy": "mru"}}, "policy"),
    ({"config": {"io_depth": "deep"}}, "io_depth"),
    ({"mode": "cluster"}, "mode"),
    ({"warmRestart": {"enable": False}}, "enable"),
    ({"gpu": {"draApiVersion": "resource.k8s.io/v1alpha3"}}, "draApiVersion"),
])
def test_unknown_or_mistyped_values_fail(values, where):
    with pytest.raises(HelmError, match=re.escape(where)):
        render(values)
    report = helm.lint(str(HELM_CHART), values=values)
    assert any(where in e for e in report["errors"]), report


def test_schema_takes_every_daemon_option_but_the_charts():
    schema = json.loads((HELM_CHART / "values.schema.json").read_text())
    config = schema["properties"]["config"]
    assert config["additionalProperties"] is False and schema["additionalProperties"] is False
    owned = {"socket", "cache_dir", "host_size", "disk_size", "max_pools", "drain_timeout", "metrics_port",
             "keeper_socket", "events", "tokens_file", "auth"}
    assert not owned & set(config["properties"])
    for option in OPTIONS:
        if option.key in config["properties"]:
            entry = config["properties"][option.key]
            assert entry["default"] == option.default and entry["description"].startswith(option.help)
    assert set(config["properties"]) | owned >= {o.key for o in OPTIONS} - {"metrics_host", "warm_restart_window", "events_connect",
                                                                        "device_size", "gpu", "pod_ip", "node_name"}
    assert config["properties"]["policy"]["enum"] == list(POLICIES.builtin)  # the stock image holds no plugin
    # Every policy name is listed where users read the values.
    values_text = (HELM_CHART / "values.yaml").read_text()
    assert all(p in values_text for p in POLICIES.builtin)


def test_charts_lint():
    for chart in (HELM_CHART, LIBRARY):
        report = helm.lint(str(chart))
        assert not report["errors"], report
        assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


# -- the library --------------------------------------------------------------------------
@pytest.mark.parametrize("values", [{}, {"mode": "node"}, {"cache": {"mode": "hostPath"}, "tokens": {"enabled": True}},
                                    {"gpu": {"enabled": True}, "warmRestart": {"enabled": False}}],
                         ids=["sidecar", "node", "hostpath-tokens", "gpu-no-keeper"])
def test_library_renders_the_main_charts_containers(values):
    docs = render(values)
    spec = pod(docs)
    mode = values.get("mode", "sidecar")
    ctx = {"namespace": "llama-3.1-8b/default", "configMapName": "llm-kvtier"}
    if mode == "sidecar":
        ctx["extraVolumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    else:
        ctx["role"] = "daemon"
    parts = render_library(values, ctx)
    if mode == "sidecar":
        assert spec["initContainers"] == parts["initContainers"]
        engine = container(spec, "engine")
        assert engine["env"][:len(parts["engineEnv"])] == parts["engineEnv"]
        assert engine["volumeMounts"][:len(parts["engineVolumeMounts"])] == parts["engineVolumeMounts"]
        assert f"--kv-transfer-config={parts['kvTransferConfig']}" in engine["args"]
    else:
        assert spec["initContainers"] + spec["containers"] == parts["initContainers"] + parts["daemonContainer"]
    assert spec["volumes"][:len(parts["volumes"])] == parts["volumes"]
    assert spec["securityContext"] == parts["podSecurityContext"]
    assert configmap(docs) == {k: str(v) for k, v in parts["daemonEnv"].items()}


def test_library_defaults_are_the_charts_values():
    chart = yaml.safe_load((HELM_CHART / "values.yaml").read_text())
    parts = render_library({}, {"namespace": "n"})
    library = render_library(chart, {"namespace": "n"})
    assert parts == library, "the library's defaults and deploy/helm/kvtier/values.yaml differ"


def test_library_inline_env_is_the_configmap():
    parts = render_library({"config": {"policy": "lru"}}, {"namespace": "n"})
    (daemon,) = parts["daemonContainer"]
    env = {e["name"]: e["value"] for e in daemon["env"] if "value" in e}
    assert env == {k: str(v) for k, v in parts["daemonEnv"].items()} and env["KVTIER_POLICY"] == "lru"
    assert "envFrom" not in daemon


def _containers(objs, name: str) -> list[dict]:
    return [c for c in objs if c.get("name") == name]


def test_examples_hold_what_the_library_renders():
    parts = render_library(EXAMPLE_VALUES, {"namespace": EXAMPLE_NAMESPACE})
    inits, volumes = parts["initContainers"], parts["volumes"]
    assert [c["name"] for c in inits] == ["kvtier-keeper", "kvtier"]
    grace = int(parts["terminationGracePeriodSeconds"])
    kv_config = parts["kvTransferConfig"]

    llmd = yaml.safe_load((EXAMPLES / "llm-d-modelservice" / "values.yaml").read_text())["decode"]
    assert llmd["initContainers"] == inits and llmd["volumes"] == volumes
    assert llmd["extraConfig"]["securityContext"] == parts["podSecurityContext"]
    assert llmd["terminationGracePeriodSeconds"] == grace
    (vllm,) = llmd["containers"]
    assert vllm["env"] == parts["engineEnv"] and vllm["volumeMounts"] == parts["engineVolumeMounts"]
    assert vllm["args"] == ["--kv-transfer-config", kv_config]

    runtime, isvc = yaml.safe_load_all((EXAMPLES / "kserve" / "inferenceservice.yaml").read_text())
    assert (runtime["kind"], isvc["kind"]) == ("ServingRuntime", "InferenceService")
    predictor = isvc["spec"]["predictor"]
    assert predictor["initContainers"] == inits and predictor["volumes"] == volumes
    assert predictor["securityContext"] == parts["podSecurityContext"]
    assert predictor["model"]["runtime"] == runtime["metadata"]["name"]
    (engine,) = runtime["spec"]["containers"]
    assert engine["env"] == parts["engineEnv"] and engine["volumeMounts"] == parts["engineVolumeMounts"]
    assert f"--kv-transfer-config={kv_config}" in engine["args"]

    stack = EXAMPLES / "production-stack"
    values = yaml.safe_load((stack / "values.yaml").read_text())["servingEngineSpec"]
    (model,) = values["modelSpec"]
    assert values["securityContext"] == parts["podSecurityContext"]
    assert model["extraVolumes"] == volumes and model["extraVolumeMounts"] == parts["engineVolumeMounts"]
    assert model["env"] == parts["engineEnv"] and model["vllmConfig"]["extraArgs"] == ["--kv-transfer-config", kv_config]
    patch = yaml.safe_load((stack / "patch.yaml").read_text())["spec"]["template"]["spec"]
    assert patch["initContainers"] == inits and patch["terminationGracePeriodSeconds"] == grace
    kustomization = yaml.safe_load((stack / "kustomization.yaml").read_text())
    assert [p["path"] for p in kustomization["patches"]] == ["patch.yaml"]
    # Every volume a kvtier container mounts is in the example's volumes.
    names = {v["name"] for v in volumes}
    for c in inits:
        assert {m["name"] for m in c["volumeMounts"]} <= names, c["name"]


def test_readme_lists_every_value():
    """deploy/helm/kvtier/README.md's table names every value of values.yaml (a block of
    Kubernetes fields or of the daemon's options by its own name)."""
    readme = (HELM_CHART / "README.md").read_text()
    schema = json.loads((HELM_CHART / "values.schema.json").read_text())

    def paths(node: dict, prefix: str = ""):
        for key, sub in node.get("properties", {}).items():
            path = f"{prefix}{key}"
            if path in ("global", "kvtier-sidecar"):
                continue
            if "properties" in sub and path != "config" and not path.startswith("image."):
                yield from paths(sub, path + ".")
            else:
                yield path

    documented = set(re.findall(r"`([A-Za-z][A-Za-z0-9.]*)`", readme))
    for path in paths(schema):
        parent, _, leaf = path.rpartition(".")
        assert path in documented or f"{parent}.{leaf}" in readme or f"`.{leaf}`" in readme, \
            f"{path} is not in deploy/helm/kvtier/README.md"


def test_packaged_chart_carries_the_library(tmp_path):
    """`helm package` follows charts/kvtier-sidecar (a link to the library): the archive renders."""
    archive = helm.package(str(HELM_CHART), destination=str(tmp_path))
    out = helm.Chart.load(archive).render({"mode": "node"}, name="llm")
    assert "kvtier/templates/daemonset.yaml" in out and "kind: DaemonSet" in out["kvtier/templates/daemonset.yaml"]


def test_library_readme_snippet_renders(tmp_path):
    """The library README's "From your own chart" snippet, as a user's chart, renders a pod
    with the keeper, the daemon and the engine wired to them."""
    blocks = re.findall(r"```yaml\n(.*?)```", (LIBRARY / "README.md").read_text(), re.DOTALL)
    chart_yaml = next(b for b in blocks if b.startswith("# Chart.yaml"))
    fragment = next(b for b in blocks if b.startswith("# templates/deployment.yaml"))
    (tmp_path / "templates").mkdir()
    (tmp_path / "charts").mkdir()
    (tmp_path / "charts" / "kvtier-sidecar").symlink_to(LIBRARY)
    (tmp_path / "Chart.yaml").write_text("apiVersion: v2\nname: user\nversion: 0.1.0\n" + chart_yaml)
    (tmp_path / "templates" / "deployment.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: engine}\nspec:\n  template:\n" + fragment)
    out = helm.Chart.load(str(tmp_path)).render({"kvtier": {"cache": {"mode": "emptyDir"}}}, name="r")
    spec = yaml.safe_load(out["user/templates/deployment.yaml"])["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["kvtier-keeper", "kvtier"]
    assert {v["name"] for v in spec["volumes"]} >= {"kvtier-run", "keeper", "kvtier-cache"}
    (vllm,) = spec["containers"]
    assert vllm["env"] == [{"name": "KVTIER_TARGET", "value": "unix:///run/kvtier/kvtier.sock"}]
    assert json.loads(vllm["args"][0].split("=", 1)[1])["kv_connector"] == "KVTierConnector"


@pytest.mark.parametrize("endpoint, events, connect", [
    ("", "tcp://*:5557", None),
    ("tcp://epp.llm-d.svc:5557", "tcp://epp.llm-d.svc:5557", "true"),  # llm-d's centralized mode
    ("watch", "watch", None),
])
def test_events_bind_dial_or_watch(endpoint, events, connect):
    docs = render({"events": {"enabled": True, "endpoint": endpoint}})
    data = configmap(docs)
    assert data["KVTIER_EVENTS"] == events and data.get("KVTIER_EVENTS_CONNECT") == connect
    bound = endpoint == ""
    ports = {p["name"] for p in container(pod(docs), "kvtier")["ports"]}
    assert ("kv-events" in ports) == bound
    assert ("kv-events" in {p["name"] for p in one(docs, "Service")["spec"]["ports"]}) == bound
    assert ("kv-events" in {r["ports"][0]["port"] for r in one(docs, "NetworkPolicy")["spec"]["ingress"]}) == bound
    from kvtier.server.config import load_config

    cfg = load_config(None, {k: v for k, v in data.items() if k[7:].lower() in BY_KEY}, {})
    assert cfg.events.endpoint == events and cfg.events.connect == (connect == "true")
