"""deploy/grafana/kvtier-dashboard.json against a real daemon: every metric name any panel's
PromQL uses is exposed by a daemon's /metrics after some traffic (a renamed metric breaks
the dashboard silently otherwise). Families a daemon declares without series (the cluster
tier's, with no cluster configured) count: their `# TYPE` line is in the scrape. Every label a
panel groups by or names in its legend is one the daemon's series carry, or one any
Prometheus adds (`instance`, `job`): a label Kubernetes' service discovery adds
(`namespace`, `pod`) would group by the wrong thing where kvtier has a label of that meaning
(its tenant label is `kvtier_namespace`, not `namespace`)."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from rpc import free_port, keys

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvtier-dashboard.json"
METRIC_NAME = re.compile(r"(?<![A-Za-z0-9_:$\"])((?:kvtier|process|python)_[A-Za-z0-9_]+)")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # label values: no metric names in there
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")  # no metric names
LEGEND_LABEL = re.compile(r"{{\s*([A-Za-z_][A-Za-z0-9_]*)\s*}}")
SCRAPE_LABELS = {"instance", "job"}  # what every Prometheus adds to every series


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, rows' nested panels included."""
    return [(title, target["expr"]) for title, target in targets(dashboard)]


def targets(dashboard: dict) -> list[tuple[str, dict]]:
    """(panel title, target) of every target of every panel, rows' nested panels included."""
    found = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                found.append((inner["title"], target))
    return found


def labels_used(target: dict) -> set[str]:
    """The labels a target groups by and names in its legend."""
    used = {label.strip() for group in GROUPING.findall(target["expr"]) for label in group.split(",") if label.strip()}
    return used | set(LEGEND_LABEL.findall(target.get("legendFormat", "")))


def series_labels(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names its series carry in an exposition."""
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:{(.*)})?", line)
            found.setdefault(m.group(1), set()).update(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(2) or ""))
    return found


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(LABEL_LISTS.sub("", STRING.sub('""', expr))))


def exposed(text: str) -> set[str]:
    """Every name a query can use: each family's series names (a histogram's _bucket, _count,
    _sum; a counter's _total) whether or not it has series now, and every sample's name."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "histogram":
                names.update(f"{name}{suffix}" for suffix in ("_bucket", "_count", "_sum"))
            elif kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
        elif line and not line.startswith("#"):
            names.add(re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0))
    return names


def test_labels_used():
    target = {"expr": 'sum by (kvtier_namespace) (rate(x[5m])) / ignoring (tier) sum without (le, pool) (y)',
              "legendFormat": "{{kvtier_namespace}} {{ instance }}"}
    assert labels_used(target) == {"kvtier_namespace", "le", "pool", "instance"}
    assert series_labels('a_total{pool="p",kvtier_namespace="n"} 1\nb 2\n') == {"a_total": {"pool", "kvtier_namespace"},
                                                                                 "b": set()}


def test_metric_name_regex():
    expr = ('histogram_quantile(0.99, sum by (le, kvtier_namespace) (rate(kvtier_disk_load_duration_seconds_bucket{'
            'result="ok", x="kvtier_not_a_metric"}[$__rate_interval]))) / ignoring (tier) group_left () process_open_fds')
    assert metric_names(expr) == {"kvtier_disk_load_duration_seconds_bucket", "process_open_fds"}


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert metric_names(target["expr"]), f"{panel['title']}: no metric in {target['expr']}"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    # What the dashboard promises to show.
    used = set().union(*(metric_names(e) for _, e in expressions(dashboard)))
    for name in ("kvtier_hits_total", "kvtier_misses_total", "kvtier_moved_bytes_total",
                 "kvtier_disk_load_duration_seconds_bucket", "kvtier_tier_pages", "kvtier_sessions",
                 "kvtier_sessions_ended_total", "kvtier_register_rejected_total", "kvtier_corrupt_pages_total",
                 "kvtier_cluster_faults_total", "process_resident_memory_bytes"):
        assert name in used, name


def test_every_panel_metric_is_exposed(daemons, connect):
    port = free_port()
    d = daemons.start("--metrics-port", str(port), host_size="64KiB", disk_size="1MiB")  # 16 host pages
    s = connect(d.target).session("dash")
    stored = keys("dash", 24)  # more than the host tier holds: demotions to disk
    for i in range(0, len(stored), 4):
        s.put(stored[i:i + 4])
    s.lookup([*stored, *keys("dash-miss", 2)])
    lease = s.acquire(stored[:4])  # from disk: loads
    s.release(lease.lease_id)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    names = exposed(text)
    missing = {(title, name) for title, expr in expressions(json.loads(DASHBOARD.read_text()))
               for name in metric_names(expr) if name not in names}
    assert not missing, f"panels use metrics the daemon does not expose: {sorted(missing)}"
    # Every label a panel groups by or shows is on its metrics' series (where they have any).
    carried = series_labels(text)
    wrong = set()
    for title, target in targets(json.loads(DASHBOARD.read_text())):
        metrics = [name for name in metric_names(target["expr"]) if name in carried]
        if metrics:
            have = set().union(*(carried[name] for name in metrics)) | SCRAPE_LABELS
            wrong |= {(title, label) for label in labels_used(target) - have}
    assert not wrong, f"panels group by or show labels their series do not carry: {sorted(wrong)}"
    # and the traffic made the headline series real, not only declared
    for name in ("kvtier_hits_total", "kvtier_moved_bytes_total", "kvtier_disk_load_duration_seconds_bucket"):
        assert re.search(rf"^{name}{{", text, re.M), name
