"""The slow path: page bytes over gRPC, for a client on another host.

A same-host client reads and writes pages in place through the mapped host arena
(lease.pages); a client that cannot map it (KVTierClient(..., map_arena=False)) copies
them through the daemon instead:

    remote = RemotePages(client)
    with client.borrow(n) as lease:
        remote.write_pages(lease, arrays)     # WritePages: a client stream, one page a message
        lease.commit(keys)
    with client.acquire(keys) as lease:
        arrays = remote.read_pages(lease)     # ReadPages: a server stream of the ready pages

Every page costs a copy and a trip through the socket, so this is for remote clients only.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from kvtier_client.client import KVTierClient
from kvtier_client.errors import KVTierError
from kvtier_client.leases import ReadLease, WriteLease
from kvtier_client.views import page_array


class RemotePages:
    """Reads and writes lease pages over gRPC for `client` (KVTierClient.read_page_bytes and
    write_page_bytes: its session and retries), checked and shaped like the layout."""

    def __init__(self, client: KVTierClient) -> None:
        self.client = client

    def read_pages(self, lease: ReadLease) -> list[np.ndarray]:
        """Copies of the lease's first `ready` pages, shaped and typed like lease.pages would be."""
        layout = self.client.layout
        page_bytes = lease.session.page_bytes
        received: dict[int, bytes] = {}
        for index, data in self.client.read_page_bytes(lease):
            if index >= lease.count or index in received:
                raise KVTierError(
                    f"ReadPages for lease {lease.lease_id} sent page {index} "
                    f"(lease holds {lease.count}; already got {sorted(received)}): a daemon bug"
                )
            if len(data) != page_bytes:
                raise KVTierError(f"ReadPages sent {len(data)} bytes for page {index}, expected {page_bytes}")
            received[index] = data
        missing = [i for i in range(lease.ready) if i not in received]
        if missing:
            raise KVTierError(f"ReadPages for lease {lease.lease_id} did not send ready page(s) {missing}: a daemon bug")
        return [page_array(np.frombuffer(bytearray(received[i]), dtype=np.uint8), layout) for i in range(lease.ready)]

    def write_pages(self, lease: WriteLease, pages: Sequence[object]) -> int:
        """Fill the first len(pages) pages of a write lease, then commit the lease yourself.

        A page is a numpy array, a torch tensor or any bytes-like object of exactly
        page_bytes bytes. Returns how many pages the daemon stored.
        """
        page_bytes = lease.session.page_bytes
        if not 0 < len(pages) <= lease.count:
            raise ValueError(f"write_pages needs 1 to {lease.count} pages for lease {lease.lease_id}, got {len(pages)}")
        payloads = [_page_bytes(page, page_bytes, i) for i, page in enumerate(pages)]
        return self.client.write_page_bytes(lease, payloads)


def _page_bytes(page: object, page_bytes: int, index: int) -> bytes:
    torch = sys.modules.get("torch")  # a tensor implies torch is loaded; never import it here
    if torch is not None and isinstance(page, torch.Tensor):
        page = page.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    if isinstance(page, np.ndarray):
        data = np.ascontiguousarray(page).tobytes()
    else:
        data = bytes(memoryview(page).cast("B"))
    if len(data) != page_bytes:
        raise ValueError(f"page {index} has {len(data)} bytes, expected page_bytes={page_bytes}")
    return data
