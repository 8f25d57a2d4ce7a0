"""The device tier on a GPU: the copy engine's promote/demote integrity over both arenas
(memory per namespace, with slots padded to the allocation granularity, and the shared
fallback), and the round trip between a real daemon process and this client process (the
namespace's device slots mapped from descriptors, torch tensors through DLPack, the
interprocess copy-done event waited on by a stream and by the host). Every destination is
poisoned first; every page is random and checked by checksum. Isolation between
namespaces: tests/mechanism/test_device_isolation_gpu.py.

Run on a GPU machine with ``pytest -m gpu`` (scripts/gpu_check.sh); skipped elsewhere.
"""
from __future__ import annotations

import hashlib
import os
import uuid

import numpy as np
import pytest
from kvtier_client.layout import PageLayout

from kvtier_client import kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not kernels.is_available(), reason="needs CuPy and a CUDA device"),
]

LAYOUTS = [
    PageLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16"),  # 8 KiB pages
    PageLayout(layers=8, kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16"),  # 512 KiB pages
]
POISON = 0xA5


def digest(data) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


@pytest.mark.parametrize("arena", ["DeviceArena", "SharedDeviceArena"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.page_bytes // 1024}KiB")
def test_promote_and_demote_keep_every_byte(layout, arena):
    import cupy

    from kvtier.mechanism import device as device_module
    from kvtier.mechanism.device import CopyEngine, pin_host
    from kvtier.mechanism.host import HostArena

    host = HostArena(f"kvtier-gpu-test-{uuid.uuid4().hex[:8]}", layout, 32)
    for slot in range(32):
        host.give(slot, "tenant-a")
    device = getattr(device_module, arena)(layout, 16)
    device.give(range(16), "tenant-a")
    unpin = pin_host(host)
    engine = CopyEngine(host, device)
    try:
        rng = np.random.default_rng(5)
        for slot in range(16):
            host.page(slot)[:] = rng.integers(0, 256, layout.page_bytes, dtype=np.uint8)
        device.pages_array()[...] = POISON
        cupy.cuda.Device().synchronize()  # the fill runs on the default stream, the copies on another
        # Runs of adjacent slots (coalesced into one copy) and scattered ones, in one submission.
        pairs = [(0, 3), (1, 4), (2, 5), (9, 0), (15, 10), (7, 11), (8, 12)]
        landed = []
        transfer = engine.promote(pairs, lambda t, ok: landed.append(ok))
        assert transfer.wait(30)
        assert landed == [True]
        on_device = device.pages_array().get()
        for src, dst in pairs:
            assert digest(on_device[dst, : layout.page_bytes]) == digest(host.page(src)), (src, dst)
        assert (on_device[1, : layout.page_bytes] == POISON).all()  # untouched slots stay poisoned
        # Back down into fresh host slots.
        for slot in range(16, 32):
            host.page(slot)[:] = POISON
        engine.demote([(dst, 16 + i) for i, (_, dst) in enumerate(pairs)])
        for i, (src, _) in enumerate(pairs):
            assert digest(host.page(16 + i)) == digest(host.page(src))
        assert engine.throughput.bytes_per_second > 0
        cupy.cuda.Device().synchronize()
    finally:
        engine.close()
        unpin()
        device.close()
        host.close()


def test_slot_given_to_another_namespace_after_pinning_promotes_the_new_bytes():
    """A slot cut out of one namespace's (pinned) file and given to another: the copy engine
    must read what the new holder wrote, not the pages the old holder's file had."""
    import cupy

    from kvtier.mechanism.device import CopyEngine, DeviceArena, pin_host
    from kvtier.mechanism.host import HostArena

    layout = LAYOUTS[0]
    host = HostArena(f"kvtier-gpu-test-{uuid.uuid4().hex[:8]}", layout, 4)
    for slot in range(4):
        host.give(slot, "tenant-a")
    device = DeviceArena(layout, 4)
    unpin = pin_host(host)
    engine = CopyEngine(host, device)
    try:
        host.page(0)[:] = 0x11
        host.give(0, "tenant-b")  # maps and pins tenant-b's file, cuts the slot out of tenant-a's
        host.page(0)[:] = 0x22
        assert engine.promote([(0, 1)], None).wait(30)
        assert (device.pages_array().get()[1, : layout.page_bytes] == 0x22).all()
        host.give(0, "tenant-a")  # back to a pinned file that was cut there once
        assert (host.page(0) == 0).all(), "a slot given back must not show the namespace's old bytes"
        host.page(0)[:] = 0x44
        assert engine.promote([(0, 2)], None).wait(30)
        assert (device.pages_array().get()[2, : layout.page_bytes] == 0x44).all()
        device.pages_array()[0, :] = 0x33
        cupy.cuda.Device().synchronize()
        engine.demote([(0, 0)])
        assert (host.page(0) == 0x33).all()
    finally:
        engine.close()
        unpin()
        device.close()
        host.close()


def test_ipc_round_trip_between_daemon_and_client(tmp_path):
    """A real daemon lends device pages to this process: the bytes committed through host
    pages come back as CUDA tensors over the daemon's HBM, after the copy-done event."""
    import torch
    from daemon import start_daemon
    from kvtier_client import KVTierClient, Tier

    layout = LAYOUTS[1]
    disk = "64MiB" if _has_lmdb() else "0"
    daemon = start_daemon(tmp_path, "--device-size", "64MiB", host_size="32MiB", disk_size=disk)
    try:
        with KVTierClient(daemon.target) as kv:
            kv.register("gpu/ipc", layout)
            keys = kv.block_keys(list(range(16 * 24)))
            rng = np.random.default_rng(11)
            expected = [rng.integers(0, 256, layout.page_bytes, dtype=np.uint8) for _ in keys]
            with kv.borrow(len(keys)) as lease:
                for page, data in zip(lease.pages, expected):
                    page.reshape(-1).view(np.uint8)[:] = data
                lease.commit(keys)
            # Stream-ordered: the current stream waits on the event, the checksum runs after it.
            with kv.acquire(keys, tier=Tier.DEVICE) as lease:
                assert lease.tier is Tier.DEVICE and lease.ready == len(keys)
                tensors = lease.tensors()
                assert all(t.is_cuda for t in tensors)
                per_namespace = type(lease.session.device_arena()).__name__ == "NamespaceDeviceView"
                assert per_namespace != bool(kv.pool.device_ipc_handle), "an IPC handle only for the shared fallback"
                got = [t.contiguous().view(torch.uint8).reshape(-1).cpu().numpy() for t in tensors]
            for i, (g, e) in enumerate(zip(got, expected)):
                assert digest(g) == digest(e), f"page {i} differs after the device round trip"
            # Host-side wait, and pages already on the device (no copy this time).
            with kv.acquire(keys[:4], tier=Tier.DEVICE) as lease:
                lease.wait()
                assert lease.promoted == 0
                again = [t.view(torch.uint8).reshape(-1).cpu().numpy() for t in lease.tensors()]
            assert [digest(g) for g in again] == [digest(e) for e in expected[:4]]
            stats = kv.stats().pool(kv.pool.pool_id)
            assert stats.tier(Tier.DEVICE).promotions == len(keys)
            assert stats.tier(Tier.DEVICE).read_bytes_per_second > 0
    finally:
        assert daemon.stop() == 0, daemon.log()


def _has_lmdb() -> bool:
    try:
        import lmdb  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("KVTIER_GPU_CHECK_NO_DISK") != "1"
