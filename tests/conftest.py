"""Fixtures shared by the core, mechanism and replay tests: real shared memory, real disk.

Every test that creates a host arena takes `shm_prefix`, so parallel runs never share an
arena name and a test that leaves one behind fails at teardown.
"""
from __future__ import annotations

import os
import uuid

import pytest
from kvtier_client.layout import PageLayout
from kvtier_client.shm import SHM_DIR

from kvtier.server.pools import Pool, PoolConfig

#: A small layout whose page (3072 bytes) is not a whole slot (4096), so padding is exercised.
SMALL_LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16")


def shm_leftovers(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


@pytest.fixture
def shm_prefix() -> str:
    """A unique arena prefix; teardown fails (after cleaning up) if an arena was left behind."""
    prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    left = shm_leftovers(prefix)
    tables = shm_leftovers("." + prefix)  # the arenas' slot tables (warm restart)
    for name in left + tables:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not left, f"test left shared-memory arenas behind: {left}"
    assert not tables, f"test left slot tables behind: {tables}"


class PoolFactory:
    """Builds real Pools (shm arena + LMDB disk tier) and closes whatever is still open."""

    def __init__(self, prefix: str, disk_dir: str) -> None:
        self.prefix = prefix
        self.disk_dir = disk_dir
        self.open: list[Pool] = []

    def __call__(
        self,
        host_pages: int,
        disk_pages: int = 0,
        *,
        layout: PageLayout = SMALL_LAYOUT,
        disk_dir: str | None = None,
        **config,
    ) -> Pool:
        config.setdefault("fsync", "never")
        pool = Pool(
            layout,
            PoolConfig(
                host_bytes=host_pages * layout.slot_bytes,
                disk_bytes=disk_pages * layout.slot_bytes,
                disk_dir=disk_dir or self.disk_dir,
                arena_prefix=self.prefix,
                **config,
            ),
        )
        self.open.append(pool)
        return pool

    def close(self, pool: Pool, deadline: float | None = None) -> None:
        self.open.remove(pool)
        pool.close(deadline)

    def close_all(self) -> None:
        while self.open:
            self.close(self.open[-1])


@pytest.fixture
def make_pool(shm_prefix: str, tmp_path) -> PoolFactory:
    """`make_pool(host_pages, disk_pages, policy=..., write_through=...)`; closed at teardown."""
    factory = PoolFactory(shm_prefix, str(tmp_path / "disk"))
    yield factory
    factory.close_all()
