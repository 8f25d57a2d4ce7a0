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
from collections.abc import Iterator, Sequence

import numpy as np

from kvtier_client.client import KVTierClient
from kvtier_client.errors import KVTierError
from kvtier_client.leases import ReadLease, WriteLease
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.views import page_array

class RemotePages:
    """Reads and writes lease pages over gRPC for `client` (uses its session and retries)."""

    def __init__(self, client: KVTierClient) -> None:
        self.client = client

    def read_pages(self, lease: ReadLease) -> list[np.ndarray]:
        """Copies of the lease's first `ready` pages, shaped and typed like lease.pages would be."""
        layout = self.client.layout
        page_bytes = lease.session.info.page_bytes

        def call(session) -> list[np.ndarray]:
            request = pb.ReadPagesRequest(session_id=session.session_id, lease_id=lease.lease_id)
            received: dict[int, bytes] = {}
            for message in self.client._conn.server_stream("ReadPages", request):
                if message.index >= lease.count or message.index in received:
                    raise KVTierError(
                        f"ReadPages for lease {lease.lease_id} sent page {message.index} "
                        f"(lease holds {lease.count}; already got {sorted(received)}): a daemon bug"
                    )
                if len(message.data) != page_bytes:
                    raise KVTierError(
                        f"ReadPages sent {len(message.data)} bytes for page {message.index}, expected {page_bytes}"
                    )
                received[message.index] = message.data
            missing = [i for i in range(lease.ready) if i not in received]
            if missing:
                raise KVTierError(
                    f"ReadPages for lease {lease.lease_id} did not send ready page(s) {missing}: a daemon bug"
                )
            return [page_array(np.frombuffer(bytearray(received[i]), dtype=np.uint8), layout) for i in range(lease.ready)]

        return self.client._for_lease(lease, call)

    def write_pages(self, lease: WriteLease, pages: Sequence[object]) -> int:
        """Fill the first len(pages) pages of a write lease, then commit the lease yourself.

        A page is a numpy array, a torch tensor or any bytes-like object of exactly
        page_bytes bytes. Returns how many pages the daemon stored.
        """
        page_bytes = lease.session.info.page_bytes
        if not 0 < len(pages) <= lease.count:
            raise ValueError(f"write_pages needs 1 to {lease.count} pages for lease {lease.lease_id}, got {len(pages)}")
        payloads = [_page_bytes(page, page_bytes, i) for i, page in enumerate(pages)]

        def call(session) -> int:
            def messages() -> Iterator[pb.PageData]:
                for i, data in enumerate(payloads):
                    if i == 0:
                        yield pb.PageData(session_id=session.session_id, lease_id=lease.lease_id, index=0, data=data)
                    else:
                        yield pb.PageData(index=i, data=data)

            return self.client._conn.client_stream("WritePages", messages).pages

        return self.client._for_lease(lease, call)


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
