"""How kvtier's tiers are named in KV events (vLLM's `medium` field), one table for the
daemon's publisher and the vLLM connector's relay (docs/events.md, "Media").

Routers weight media by name: llm-d lower-cases the medium and looks it up in its
`kvCacheBackendConfigs`, Dynamo maps CPU to HostPinned, DISK to Disk, SHARED to External and
a name it does not know (HBM) to Device. Each tier gets a name of its own, so a router can
weigh a page on this node's NVMe apart from one in the shared cluster tier, and kvtier's
device tier is not "GPU": routers keep one entry per endpoint and medium, and the engine's
own KV cache publishes GPU under the same endpoint, so a removal of kvtier's copy would take
the engine's credit with it.
"""
from __future__ import annotations

from kvtier_client.tiers import Tier

#: The default medium of each tier; the daemon's `events_media` option overrides them.
DEFAULT_MEDIA: dict[Tier, str] = {Tier.DEVICE: "HBM", Tier.HOST: "CPU", Tier.DISK: "DISK", Tier.CLUSTER: "SHARED"}
#: vLLM's `ownership` of events kvtier makes: "secondary offloading tier identifier".
OWNERSHIP = "kvtier"


def parse_media(text: str) -> dict[Tier, str]:
    """`host=CPU,disk=NVME`: the default media with these tiers renamed. Raises ValueError
    naming the bad entry."""
    media = dict(DEFAULT_MEDIA)
    for entry in filter(None, (e.strip() for e in text.split(","))):
        tier, sep, name = entry.partition("=")
        if not sep or not name.strip() or not name.strip().isprintable() or "@" in name:
            raise ValueError(f"cannot read {entry!r} as TIER=MEDIUM; write e.g. disk=DISK,cluster=SHARED")
        media[Tier.parse(tier.strip())] = name.strip()
    return media
