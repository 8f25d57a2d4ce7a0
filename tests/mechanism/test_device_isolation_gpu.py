"""Device memory per namespace on a GPU: tenant B's process cannot read tenant A's device
pages, through any handle it is given or can ask for, and a slot that passes from A to B
reads zeros or B's own bytes, never A's; A keeps only its own old bytes; and the copy
engine is as fast over per-namespace memory as over one allocation.

Tenant A is this test process; tenant B is another process (tokens on, one namespace
each). A's pages are a random secret repeated; every byte B can reach is searched for it.

Run on a GPU machine with ``pytest -m gpu`` (scripts/gpu_check.sh); skipped elsewhere.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest
from kvtier_client import kernels
from kvtier_client.layout import PageLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not kernels.is_available(), reason="needs CuPy and a CUDA device"),
]

LAYOUT = PageLayout(layers=8, kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")  # 512 KiB pages
TOKEN_A = "token-a-3f0c9e8d7b6a5f4e3d2c1b0a9f8e7d6c"
TOKEN_B = "token-b-7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b"


def _read(ptr: int, nbytes: int) -> bytes:
    """`nbytes` of device memory at `ptr` (mapped in this process), copied to the host."""
    import cupy

    memory = cupy.cuda.UnownedMemory(ptr, nbytes, None)
    return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0)).get().tobytes()


def _vmm_supported() -> bool:
    from kvtier_client.cuda_vmm import Driver

    driver = Driver(0)
    try:
        return driver.supports_fd_sharing()
    finally:
        driver.close()


# -- the arena on its own --------------------------------------------------------------
def test_a_slot_passing_to_another_namespace_is_zeroed_and_exported_memory_replaced():
    """Unexported memory is kept and zeroed; exported memory is replaced, and the process
    that imported it keeps the old holder's bytes only: the new holder's never reach it."""
    import cupy

    from kvtier.mechanism.device import DeviceArena
    from kvtier_client.cuda_vmm import Driver

    if not _vmm_supported():
        pytest.skip("this GPU cannot export memory as file descriptors (the shared fallback is used)")
    arena = DeviceArena(LAYOUT, 2)
    importer = Driver(0)
    other = None
    try:
        stride = arena.stride
        assert stride % arena.granularity == 0 and stride >= LAYOUT.slot_bytes
        arena.give([0, 1], "a")
        pages = arena.pages_array()
        pages[0, :] = 0xAA
        pages[1, :] = 0xAC
        cupy.cuda.Device().synchronize()
        # Slot 1 never left the daemon: it passes to b with the same allocation, zeroed.
        generation = arena.book.allocation[1].generation
        arena.give([1], "b")
        assert arena.book.allocation[1].generation == generation
        assert _read(arena.slot_ptr(1), stride) == bytes(stride)
        # Slot 0's descriptor goes to a's process (a duplicate, as SCM_RIGHTS makes one).
        [(slot, generation, fd)] = arena.export("a", [0, 1])
        assert slot == 0
        fd = os.dup(fd)
        with importer.current():
            handle = importer.import_fd(fd)
            os.close(fd)
            other = importer.reserve(stride, arena.granularity)
            importer.map(other, stride, handle)
            importer.release(handle)
        assert _read(other, 16) == b"\xaa" * 16
        arena.give([0], "b")
        assert arena.book.allocation[0].generation != generation  # new memory behind the slot
        assert _read(arena.slot_ptr(0), stride) == bytes(stride)
        pages[0, :] = 0xBB
        cupy.cuda.Device().synchronize()
        kept = _read(other, stride)
        assert kept[: LAYOUT.slot_bytes] == b"\xaa" * LAYOUT.slot_bytes, "a's process must keep its own old bytes"
        assert b"\xbb" not in kept, "the new holder's bytes reached the old holder's mapping"
        assert arena.export("a", [0, 1]) == []  # a holds nothing now
    finally:
        if other is not None:
            with importer.current():
                importer.unmap(other, arena.stride)
                importer.free_range(other, arena.stride)
        importer.close()
        arena.close()


# -- two tenants' processes against a real daemon ---------------------------------------
TENANT_B = textwrap.dedent(
    """
    import json, os, sys
    import cupy, numpy as np, torch
    from kvtier_client import KVTierClient, PageLayout, Tier
    from kvtier_client.cuda_vmm import Driver
    from kvtier_client.handoff import fetch_device_slots
    target, token, secret = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
    layout = PageLayout(layers=8, kv_heads=8, head_dim=128, block_tokens=16, dtype="bfloat16")

    def read(ptr, n):
        memory = cupy.cuda.UnownedMemory(ptr, n, None)
        return cupy.ndarray((n,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0)).get().tobytes()

    def refused(open_handle):
        try:
            open_handle()
        except Exception as exc:
            return type(exc).__name__
        return None

    out = {}
    with KVTierClient(target, token=token, name="tenant-b") as kv:
        kv.register("tenant-b", layout)
        info = kv.pool
        keys = kv.block_keys(list(range(16 * 2)), salt=b"tenant-b")
        with kv.borrow(2) as lease:
            for page in lease.pages:
                page.reshape(-1).view(np.uint8)[:] = 0xBB
            lease.commit(keys)
        with kv.acquire(keys, tier=Tier.DEVICE) as lease:
            got = [t.contiguous().view(torch.uint8).reshape(-1).cpu().numpy() for t in lease.tensors()]
            out["own_bytes"] = all(bool((g == 0xBB).all()) for g in got)
            view = lease.session.device_arena()
            out["view"] = type(view).__name__
            out["leased"] = sorted(lease.slots)
            # The whole of each leased slot: its page, then zeros (nothing of A's in the padding).
            whole = [read(view.ptr + s * view.stride, view.stride) for s in lease.slots]
            out["slot_bytes_ok"] = all(w[: layout.page_bytes] == b"\\xbb" * layout.page_bytes
                                       and w[layout.page_bytes:] == bytes(len(w) - layout.page_bytes) for w in whole)
            out["secret_in_slots"] = any(secret[:16] in w for w in whole)
            # Every handle B was given, tried as a way into device memory.
            out["register_handle"] = len(info.device_ipc_handle)
            out["register_handle_refused"] = refused(lambda: cupy.cuda.runtime.ipcOpenMemHandle(info.device_ipc_handle))
            out["event_handle_refused"] = refused(lambda: cupy.cuda.runtime.ipcOpenMemHandle(lease._ready_event))
            # Ask the daemon for every slot of the arena: only B's come back; map and read each.
            granted = fetch_device_slots(info.handoff_socket, info.session_id, token, list(range(view.pages)))
            out["granted"] = sorted(s for s, _, _ in granted)
            driver, found = Driver(view.device_id), False
            with driver.current():
                for slot, generation, fd in granted:
                    handle = driver.import_fd(fd)
                    os.close(fd)
                    ptr = driver.reserve(view.stride, view.stride)
                    driver.map(ptr, view.stride, handle)
                    driver.release(handle)
                    found = found or secret[:16] in read(ptr, view.stride)
                    driver.unmap(ptr, view.stride)
                    driver.free_range(ptr, view.stride)
            out["secret_in_granted"] = found
            # The table B maps: only B's slots are named (and B cannot write it).
            out["table_slots"] = sorted(int(s) for s in np.flatnonzero(view._table[1:]))
    print(json.dumps(out), flush=True)
    """
)


def test_tenant_b_cannot_read_tenant_a_device_pages(tmp_path):
    import cupy
    import torch
    from daemon import start_daemon
    from kvtier_client import KVTierClient, Tier
    from kvtier_client.device import NamespaceDeviceView

    if not _vmm_supported():
        pytest.skip("this GPU cannot export memory as file descriptors (the shared fallback is used)")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens]\n"{TOKEN_A}" = ["tenant-a"]\n"{TOKEN_B}" = ["tenant-b"]\n')
    # Two device pages (512 KiB slots, 2 MiB strides): B's two pages take both of A's slots.
    daemon = start_daemon(tmp_path, "--device-size", "4MiB", "--tokens-file", str(tokens), host_size="32MiB",
                          disk_size="0")
    secret = os.urandom(16)
    pattern = np.frombuffer(secret * (LAYOUT.page_bytes // 16), np.uint8)
    try:
        with KVTierClient(daemon.target, token=TOKEN_A, name="tenant-a") as kv:
            kv.register("tenant-a", LAYOUT)
            assert kv.pool.device_ipc_handle == b"", "memory per namespace: no handle opens the whole arena"
            keys = kv.block_keys(list(range(16 * 2)), salt=b"tenant-a")
            with kv.borrow(2) as lease:
                for page in lease.pages:
                    page.reshape(-1).view(np.uint8)[:] = pattern
                lease.commit(keys)
            with kv.acquire(keys, tier=Tier.DEVICE) as lease:
                got = [t.contiguous().view(torch.uint8).reshape(-1).cpu().numpy() for t in lease.tensors()]
                assert all((g == pattern).all() for g in got)
                view = lease.session.device_arena()
                assert isinstance(view, NamespaceDeviceView)
                a_slots = sorted(lease.slots)
                cupy.cuda.Device(view.device_id).synchronize()
            # B's process, while A still maps its two (now released) slots.
            run = subprocess.run([sys.executable, "-c", TENANT_B, daemon.target, TOKEN_B, secret.hex()],
                                 capture_output=True, text=True, timeout=180)
            assert run.returncode == 0, run.stderr[-4000:]
            b = json.loads(run.stdout.splitlines()[-1])
            assert b["view"] == "NamespaceDeviceView"
            assert b["own_bytes"] and b["slot_bytes_ok"], "B must read its own bytes, and zeros past them"
            assert b["leased"] == a_slots, "the test needs A's slots to pass to B"
            assert b["granted"] == b["leased"] == b["table_slots"], "B must be handed its own slots only"
            assert not b["secret_in_slots"] and not b["secret_in_granted"], "B reached A's bytes"
            assert b["register_handle"] == 0 and b["register_handle_refused"] and b["event_handle_refused"]
            # A's process still maps the memory it had: its own bytes, never B's.
            assert view.mapped_slots() == a_slots
            for slot in a_slots:
                kept = _read(view.ptr + slot * view.stride, LAYOUT.page_bytes)
                assert kept == pattern.tobytes(), "A's old mapping must keep A's bytes"
            view.sync()  # the table says A lost them: dropped
            assert view.mapped_slots() == []
            # And back to A: new memory again, A's bytes promoted into it.
            with kv.acquire(keys, tier=Tier.DEVICE) as lease:
                got = [t.contiguous().view(torch.uint8).reshape(-1).cpu().numpy() for t in lease.tensors()]
                assert all((g == pattern).all() for g in got)
    finally:
        assert daemon.stop() == 0, daemon.log()


# -- the copy figures ----------------------------------------------------------------------
@pytest.mark.parametrize("page_bytes", [64 << 10, 2 << 20], ids=["64KiB", "2MiB"])
def test_promotion_over_per_namespace_memory_is_as_fast_as_over_one_allocation(page_bytes):
    """The copy engine's promotion bandwidth (random page order, one submission) over the
    per-namespace arena against the shared cudaMalloc arena, same pages, same run."""
    from kvtier.mechanism.device import CopyEngine, DeviceArena, SharedDeviceArena, pin_host
    from kvtier.mechanism.host import HostArena

    if not _vmm_supported():
        pytest.skip("this GPU cannot export memory as file descriptors (the shared fallback is used)")
    layout = PageLayout(layers=1, kv_heads=1, head_dim=page_bytes // 32, block_tokens=16, dtype="uint8")
    pages = max(16, (128 << 20) // page_bytes)
    host = HostArena(f"kvtier-gpu-test-{uuid.uuid4().hex[:8]}", layout, pages)
    for slot in range(pages):
        host.give(slot, "bench")
    unpin = pin_host(host)
    order = np.random.default_rng(0).permutation(pages)
    pairs = [(int(h), int(d)) for h, d in zip(order, np.roll(order, 1))]
    figures = {}
    try:
        for kind in (SharedDeviceArena, DeviceArena):
            device = kind(layout, pages)
            engine = CopyEngine(host, device)
            try:
                engine.promote(pairs, None).wait(60)  # warm-up
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    assert engine.promote(pairs, None).wait(60)
                    times.append(time.perf_counter() - start)
                figures[kind.__name__] = pages * layout.slot_bytes / statistics.median(times) / 1e9
            finally:
                engine.close()
                device.close()
    finally:
        unpin()
        host.close()
    print(f"promotion {page_bytes >> 10} KiB pages: per namespace {figures['DeviceArena']:.1f} GB/s, "
          f"one allocation {figures['SharedDeviceArena']:.1f} GB/s")
    assert figures["DeviceArena"] >= 0.85 * figures["SharedDeviceArena"], figures
