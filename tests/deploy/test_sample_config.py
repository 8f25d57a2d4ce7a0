"""deploy/kvtier.toml, the sample configuration: the daemon reads it, it sets the eviction
policy the daemon defaults to, and its comment names every policy there is."""
from __future__ import annotations

import re
from pathlib import Path

from kvtier.policy import POLICIES
from kvtier.server.config import OPTIONS, load_config

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "deploy" / "kvtier.toml"


def test_the_sample_reads_and_uses_the_default_policy(tmp_path):
    cfg = load_config(str(SAMPLE), {"KVTIER_SOCKET": str(tmp_path / "s.sock")}, {})
    default = next(o for o in OPTIONS if o.key == "policy").default
    assert cfg.tiers.policy == default == "frecency"


def test_the_sample_lists_every_policy():
    (line,) = [line for line in SAMPLE.read_text().splitlines() if line.startswith("policy")]
    listed = re.findall(r"[a-z0-9]+", line.split("#", 1)[1])
    assert set(POLICIES.builtin) <= set(listed), line


def test_no_sample_outside_helm_and_k8s_sets_another_policy():
    """The systemd unit and examples/ (deploy/helm and deploy/k8s are checked with the manifests)."""
    wrong = []
    for path in [ROOT / "deploy" / "kvtier.service", *sorted((ROOT / "examples").rglob("*"))]:
        if path.is_file():
            for match in re.finditer(r"(?:--policy[ =]|KVTIER_POLICY=|\bpolicy\s*=\s*)[\"']?([a-z0-9]+)", path.read_text()):
                if match.group(1) != "frecency":
                    wrong.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not wrong, wrong
