#!/usr/bin/env python3
"""Generate deploy/helm/kvtier/values.schema.json from the chart's values.yaml and the
daemon's options table (kvtier/server/config.py OPTIONS), so that Helm refuses a value the
chart would silently ignore.

    scripts/gen_values_schema.py          regenerate
    scripts/gen_values_schema.py --check  fail if the committed schema is stale (CI)

Every mapping in values.yaml becomes an object that takes only its own keys
(`additionalProperties: false`), typed from its default and described by its comment. The
`config:` block is the daemon's options, each with its type, default and help, except those
the chart sets itself (CHART_OWNED). Values that hold Kubernetes objects (resources,
affinity, tolerations...) are free-form; a few strings take fixed choices (ENUMS).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtier.server import config as daemon_config

CHART = ROOT / "deploy" / "helm" / "kvtier"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
LIBRARY = "kvtier-sidecar"  # the library dependency: Helm gives it a values key of its own

#: Daemon options the chart derives from its own values: not accepted under `config`.
CHART_OWNED = {
    "socket": "the socket directory is /run/kvtier",
    "cache_dir": "the cache volume is /var/cache/kvtier (cache.*, node.cacheDir)",
    "host_size": "kvtier.hostSizeGiB",
    "disk_size": "kvtier.diskSizeGiB",
    "max_pools": "kvtier.maxPools",
    "drain_timeout": "kvtier.drainTimeoutSeconds",
    "metrics_port": "metrics.port",
    "metrics_host": "0.0.0.0, for the kubelet's probes",
    "keeper_socket": "warmRestart.enabled",
    "warm_restart_window": "warmRestart.window",
    "events": "events.enabled, events.port, events.endpoint",
    "events_connect": "events.endpoint",
    "auth": "tokens.enabled",
    "tokens_file": "tokens.enabled, tokens.secretName",
    "device_size": "gpu.deviceSizeGiB",
    "gpu": "gpu.enabled",
    "pod_ip": "fieldRef status.podIP (KVTIER_POD_IP)",
    "node_name": "fieldRef spec.nodeName (KVTIER_NODE_NAME)",
}

_OBJECT = {"type": "object"}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_OBJECTS = {"type": "array", "items": {"type": "object"}}
#: Values that are Kubernetes objects (or maps of labels): their shape is the API's.
FREE_FORM: dict[str, dict[str, Any]] = {
    "nodeSelector": _STRINGS, "podAnnotations": _STRINGS, "podLabels": _STRINGS,
    "metrics.podMonitor.labels": _STRINGS, "metrics.prometheusRule.labels": _STRINGS,
    "affinity": _OBJECT, "engine.resources": _OBJECT, "engine.securityContext": _OBJECT,
    "warmRestart.resources": _OBJECT, "cache.emptyDir": _OBJECT,
    "tolerations": _OBJECTS, "topologySpreadConstraints": _OBJECTS,
    "networkPolicy.metricsFrom": _OBJECTS, "networkPolicy.eventsFrom": _OBJECTS,
    "engine.extraArgs": {"type": "array", "items": {"type": "string"}},
}
_PULL = ["Always", "IfNotPresent", "Never"]
ENUMS: dict[str, list[str]] = {
    "mode": ["sidecar", "node"],
    "cache.mode": ["volumeClaimTemplate", "hostPath", "emptyDir"],
    "gpu.draApiVersion": ["resource.k8s.io/v1", "resource.k8s.io/v1beta1"],
    "image.kvtier.pullPolicy": _PULL, "image.engine.pullPolicy": _PULL,
}
#: Whole numbers in values.yaml that may also be fractions.
NUMBERS = {"gpu.totalGiB"}
MINIMUM = {"replicas": 0, "kvtier.maxPools": 1, "kvtier.hostSizeGiB": 1, "kvtier.diskSizeGiB": 0,
           "metrics.port": 1, "events.port": 1, "podDisruptionBudget.maxUnavailable": 1}


def value_comments(text: str) -> dict[str, str]:
    """Each key's comment in values.yaml: the one on its line, else the block just above it."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    above: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        m = re.match(r"^(\s*)([A-Za-z0-9_.-]+):(.*)$", line)
        if not m:
            above = []
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [key])
        stack.append((indent, key))
        trailing = rest.split(" # ", 1)[1].strip() if " # " in rest else ""
        text_for_key = trailing or " ".join(above)
        if text_for_key:
            comments[path] = text_for_key
        above = []
    return comments


def option_schema(option: daemon_config.Option) -> dict[str, Any]:
    """One daemon option as a JSON schema: its kind's type, its default and its help."""
    kind = option.kind
    c = daemon_config
    if kind.read_last and kind.choices:  # an enum kind: the daemon refuses anything else
        schema: dict[str, Any] = {"type": "string", "enum": list(kind.choices)}
    elif kind is c.BOOL:
        schema = {"type": "boolean"}
    elif kind is c.INT:
        schema = {"type": "integer"}
    elif kind is c.FRACTION:
        schema = {"type": "number", "minimum": 0, "maximum": 1}
    elif kind is c.SIZE:
        schema = {"type": ["string", "integer"]}
    elif kind in (c.DURATION, c.DURATION_OR_ZERO):
        schema = {"type": ["string", "number"]}
    else:
        schema = {"type": "string"}
    schema["default"] = option.default
    schema["description"] = option.help + (f" Default: {option.shown}." if option.shown else "")
    return schema


def config_schema() -> dict[str, Any]:
    props = {o.key: option_schema(o) for o in daemon_config.OPTIONS if o.key not in CHART_OWNED}
    return {"type": "object", "additionalProperties": False, "properties": props,
            "description": "Options of the daemon (docs/configuration.md), passed as KVTIER_<KEY>. Set by the "
                           "chart instead: " + "; ".join(f"{k} ({v})" for k, v in CHART_OWNED.items()) + "."}


def infer(value: Any, path: str, comments: dict[str, str]) -> dict[str, Any]:
    """The schema of one value of values.yaml, from its default."""
    if path == "config":
        schema = config_schema()
    elif path in FREE_FORM:
        schema = dict(FREE_FORM[path])
    elif path in ENUMS:
        schema = {"type": "string", "enum": ENUMS[path]}
    elif isinstance(value, dict):
        schema = {"type": "object", "additionalProperties": False,
                  "properties": {k: infer(v, f"{path}.{k}" if path else k, comments) for k, v in value.items()}}
    elif isinstance(value, bool):
        schema = {"type": "boolean"}
    elif isinstance(value, int):
        schema = {"type": "number" if path in NUMBERS else "integer"}
    elif isinstance(value, float):
        schema = {"type": "number"}
    elif isinstance(value, str):
        schema = {"type": "string"}
    elif isinstance(value, list):
        schema = {"type": "array"}
    else:
        raise SystemExit(f"values.yaml: {path} has no default to type it by; give it one or add it to FREE_FORM")
    if path in MINIMUM:
        schema["minimum"] = MINIMUM[path]
    if path in comments and path != "config":
        schema["description"] = comments[path]
    return schema


def build() -> str:
    text = VALUES.read_text()
    schema = infer(yaml.safe_load(text), "", value_comments(text))
    schema["properties"]["global"] = {"type": "object"}
    schema["properties"][LIBRARY] = {"type": "object", "additionalProperties": False,
                                     "properties": {"global": {"type": "object"}},
                                     "description": "The library dependency's own key (Helm adds it); takes nothing."}
    schema = {"$schema": "https://json-schema.org/draft-07/schema#",
              "title": "kvtier chart values (generated by scripts/gen_values_schema.py; do not edit)", **schema}
    return json.dumps(schema, indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed schema is stale")
    args = parser.parse_args()
    schema = build()
    if args.check:
        if not SCHEMA.exists() or SCHEMA.read_text() != schema:
            print(f"stale values schema: {SCHEMA.relative_to(ROOT)} differs from values.yaml and the daemon's "
                  "options; run scripts/gen_values_schema.py and commit", file=sys.stderr)
            return 1
        print("values schema is up to date")
        return 0
    SCHEMA.write_text(schema)
    print(f"wrote {SCHEMA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
