"""Fixtures shared by the core, mechanism and replay tests: real memory files, real disk.

Every test that creates a host arena takes `shm_prefix`, a unique name prefix; teardown
fails if anything of that name appeared in /dev/shm (host memory must have no path).
"""
from __future__ import annotations

import os
import uuid

import pytest
from kvtier_client.layout import PageLayout

from kvtier.mechanism.keeper import KeeperClient, KeptFile
from kvtier.server.config import default_tiers
from kvtier.server.pools import Pool

pytest_plugins = [
    "redis_cluster_plugin",  # redis_cluster, redis_cluster_replicas: a real Redis Cluster on loopback
    "shared_data_plugin",  # mooncake_trace: the shared trace, or a skip that says where it was looked for
]

# pytest-xdist's workers start with COLUMNS=80, which `kvtier stats` (and rich) would fit its
# tables to: the tests read plain output one table row per line, as a serial run gives them.
# A test that wants a width passes COLUMNS itself (tests/server/test_cli_output.py).
os.environ.pop("COLUMNS", None)

#: A small layout whose page (3072 bytes) is not a whole slot (4096), so padding is exercised.
SMALL_LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16")
SHM_DIR = "/dev/shm"


def shm_leftovers(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if prefix in name)


@pytest.fixture
def shm_prefix() -> str:
    """A unique arena prefix; teardown fails if a file of that name shows in /dev/shm."""
    prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    left = shm_leftovers(prefix)
    for name in left:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not left, f"host memory showed up as files in {SHM_DIR}: {left}"


class Keeper:
    """A real arena keeper process for one test, and the daemon's side of it: `crash()`
    hangs up as a dying daemon does and connects again as its successor."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.client = KeeperClient.connect_or_start(path, linger=60)

    def crash(self) -> list[KeptFile]:
        """What a successor gets back: every file the keeper held."""
        self.client.close(keep=True)
        self.client = KeeperClient.connect(self.path)
        assert self.client is not None, "the keeper did not outlive its daemon"
        return self.client.take_all()

    def kept(self, layout: PageLayout) -> list[KeptFile]:
        """After `crash`: the files kept for `layout`."""
        return [f for f in self.crash() if f.name.startswith(layout.layout_id + "/")]

    def close(self) -> None:
        self.client.close(keep=False)


@pytest.fixture
def keeper(tmp_path) -> Keeper:
    held = Keeper(str(tmp_path / "keeper.sock"))
    yield held
    held.close()


class PoolFactory:
    """Builds real Pools (memfd host arenas + LMDB disk tier) and closes whatever is still open."""

    def __init__(self, prefix: str, disk_dir: str, keeper: Keeper | None = None) -> None:
        self.prefix = prefix
        self.disk_dir = disk_dir
        self.keeper = keeper
        self.open: list[Pool] = []

    def __call__(
        self,
        host_pages: int,
        disk_pages: int = 0,
        *,
        layout: PageLayout = SMALL_LAYOUT,
        disk_dir: str | None = None,
        kept: list[KeptFile] = (),
        **config,
    ) -> Pool:
        """`kept`: files a crashed predecessor left with the keeper (from `keeper.kept`);
        `config`: other tiers options (kvtier.server.config.TiersConfig), by default lru,
        every page admitted to disk and no fsync."""
        config = {"policy": "lru", "disk_admission": "all", "fsync": "never", **config}
        pool = Pool(
            layout,
            default_tiers(
                host_size=host_pages * layout.slot_bytes,
                disk_size=disk_pages * layout.slot_bytes,
                cache_dir=disk_dir or self.disk_dir,
                arena_prefix=self.prefix,
                **config,
            ),
            keeper=self.keeper.client if self.keeper is not None else None,
            kept=kept,
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


@pytest.fixture
def make_kept_pool(shm_prefix: str, tmp_path, keeper: Keeper) -> PoolFactory:
    """`make_pool` whose pools give their host memory to a real keeper (`make_kept_pool.keeper`)."""
    factory = PoolFactory(shm_prefix, str(tmp_path / "disk"), keeper)
    yield factory
    factory.close_all()
