"""How kvtier's tiers are named in KV events (vLLM's `medium` field), one table for the
daemon's publisher and the vLLM connector's relay (docs/events.md, "Media").

Routers weight media by name. llm-d lower-cases the medium and looks it up in its
`kvCacheBackendConfigs`; since llm-d-router PR #2809 (merged 2026-09-11) a medium it has no
weight for scores 0, and its defaults weigh `gpu` 1.0, `cpu` 0.8, `shared_storage` 0.4 and
`object_store` 0.2. So the cluster tier is `SHARED_STORAGE`, the name llm-d's own
shared-storage publisher (llmd_fs_backend) uses, which llm-d weighs without configuration.
Dynamo maps CPU to HostPinned, DISK to Disk and a name it does not know (HBM) to Device,
and drops the cluster tier's events (locality REMOTE). Each tier gets a name of its own, so
a router can weigh a page on this node's NVMe apart from one in the shared cluster tier,
and kvtier's device tier is not "GPU": routers keep one entry per endpoint and medium, and
the engine's own KV cache publishes GPU under the same endpoint, so a removal of kvtier's
copy would take the engine's credit with it.
"""
from __future__ import annotations

from kvtier_client.tiers import Tier

#: The default medium of each tier; the daemon's `events_media` option overrides them.
DEFAULT_MEDIA: dict[Tier, str] = {
    Tier.DEVICE: "HBM", Tier.HOST: "CPU", Tier.DISK: "DISK", Tier.CLUSTER: "SHARED_STORAGE",
}
#: vLLM's `ownership` of events kvtier makes: "secondary offloading tier identifier".
OWNERSHIP = "kvtier"


def parse_media(text: str) -> dict[Tier, str]:
    """`host=CPU,disk=NVME`: the default media with these tiers renamed. Raises ValueError
    naming the bad entry."""
    media = dict(DEFAULT_MEDIA)
    for entry in filter(None, (e.strip() for e in text.split(","))):
        tier, sep, name = entry.partition("=")
        if not sep or not name.strip() or not name.strip().isprintable() or "@" in name:
            raise ValueError(f"cannot read {entry!r} as TIER=MEDIUM; write e.g. disk=DISK,cluster=SHARED_STORAGE")
        media[Tier.parse(tier.strip())] = name.strip()
    return media
