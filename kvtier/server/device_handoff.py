"""The device tier's part of the handoff socket (kvtier.server.handoff): what an attaching
process of a namespace gets of per-namespace device memory, and the descriptors of its
namespace's device slots when it asks for them. Protocol: kvtier_client.handoff.

    attach       + {"device": {"pages", "stride", "pci_bus_id"}} and the namespace's slot
                   table as one more descriptor (after the host arena's)
    device map   {"session_id", "token", "device_slots": [slot, ...]} (at most
                 MAX_SLOTS_PER_REQUEST) -> {"ok": true, "device_slots": [[slot, generation], ...]}
                 and one descriptor per listed slot, in order; only slots the session's
                 namespace holds are listed, whatever was asked
"""
from __future__ import annotations

from kvtier_client.device_plan import MAX_SLOTS_PER_REQUEST
from kvtier_client.errors import FailedPrecondition, InvalidArgument

from kvtier.server.pools import Pool


def attach_device(pool: Pool, namespace: str) -> tuple[dict, list[int]]:
    """The device fields of an attach reply and their descriptors (none without a device
    tier of memory per namespace: then Register's IPC handle, if any, is the device tier)."""
    device = pool.device
    if device is None or not device.per_namespace:
        return {}, []
    info = {"pages": device.pages, "stride": device.stride, "pci_bus_id": device.pci_bus_id}
    return {"device": info}, [device.table_fd(namespace)]


def map_device(pool: Pool, namespace: str, slots: object) -> tuple[dict, list[int]]:
    """The reply to a device map request: the namespace's slots among `slots`."""
    device = pool.device
    if device is None or not device.per_namespace:
        raise FailedPrecondition("this daemon lends no device memory per namespace (no device tier, or a GPU that "
                                 "shares one allocation): open the device arena from Register's IPC handle")
    if (not isinstance(slots, list) or len(slots) > MAX_SLOTS_PER_REQUEST
            or not all(type(s) is int and 0 <= s < device.pages for s in slots)):
        raise InvalidArgument(f'"device_slots" is a list of at most {MAX_SLOTS_PER_REQUEST} slot numbers '
                              f"in 0..{device.pages - 1}")
    granted = device.export(namespace, slots)
    return ({"ok": True, "device_slots": [[slot, generation] for slot, generation, _ in granted]},
            [fd for _, _, fd in granted])
