"""HostArena: a real POSIX shared-memory arena, mapped by a second real process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from kvtier_client.layout import PageLayout
from kvtier_client.shm import SHM_DIR, map_arena, shm_path

from kvtier.mechanism.host import ArenaInUse, HostArena

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16)  # 3072-byte pages in 4096-byte slots


def shm_leftovers(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))

# A client process: maps the arena by name, prints slot 2's page as hex, writes 0x5A over
# slot 1's page.
CLIENT = textwrap.dedent(
    """
    import sys
    from kvtier_client.shm import map_arena
    name, size, slot_bytes, page_bytes = sys.argv[1], *map(int, sys.argv[2:])
    mm = map_arena(name, size)
    print(mm[2 * slot_bytes : 2 * slot_bytes + page_bytes].hex())
    mm[slot_bytes : slot_bytes + page_bytes] = b"\\x5a" * page_bytes
    mm.flush()
    mm.close()
    """
)

# A daemon that owns an arena and never lets go (until it is killed).
HOLDER = textwrap.dedent(
    """
    import sys, time
    from kvtier_client.layout import PageLayout
    from kvtier.mechanism.host import HostArena
    arena = HostArena(sys.argv[1], PageLayout(1, 1, 48, 16), 3)
    arena.page(0)[:] = 7
    print("ready", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def arena(shm_prefix):
    a = HostArena(f"{shm_prefix}-host", LAYOUT, 4)
    yield a
    a.close()


def test_arena_geometry_and_views(arena):
    path = shm_path(arena.name)
    assert os.path.exists(path)
    assert os.path.getsize(path) == 4 * LAYOUT.slot_bytes == arena.size
    assert len(arena.view(3)) == LAYOUT.slot_bytes
    assert arena.page(3).shape == (LAYOUT.page_bytes,) and arena.page(3).dtype == np.uint8
    arena.page(1)[:] = 9
    view = arena.view(1)
    assert bytes(view[: LAYOUT.page_bytes]) == b"\x09" * LAYOUT.page_bytes  # page() and view() alias
    assert bytes(view[LAYOUT.page_bytes :]) == bytes(LAYOUT.slot_bytes - LAYOUT.page_bytes)  # padding untouched
    assert not arena.page(0).any() and not arena.page(2).any()  # neighbours untouched
    arena.clear(1)
    assert not arena.page(1).any()
    del view


def test_another_process_maps_reads_and_writes(arena):
    rng = np.random.default_rng(1)
    secret = rng.integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8)
    arena.page(2)[:] = secret
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, arena.name, str(arena.size), str(LAYOUT.slot_bytes), str(LAYOUT.page_bytes)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout.strip()) == secret.tobytes()  # the client read what we wrote
    assert (arena.page(1) == 0x5A).all()  # and we see what the client wrote
    assert not arena.page(0).any() and not arena.page(3).any()


def test_map_arena_refuses_missing_or_short_arenas(arena, shm_prefix):
    with pytest.raises(FileNotFoundError):
        map_arena(f"{shm_prefix}-nobody", 4096)
    with pytest.raises(ValueError, match="daemon and client disagree"):
        map_arena(arena.name, arena.size + 4096)
    for bad in ("", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="invalid shared-memory name"):
            shm_path(bad)


def test_close_removes_the_arena_and_is_idempotent(shm_prefix):
    arena = HostArena(f"{shm_prefix}-closing", LAYOUT, 2)
    held = arena.page(0)  # an exported view must not stop the arena from being removed
    assert shm_leftovers(shm_prefix) == [arena.name]
    arena.close()
    arena.close()
    assert shm_leftovers(shm_prefix) == []
    del held


def test_pages_must_be_positive(shm_prefix):
    with pytest.raises(ValueError, match="at least one page"):
        HostArena(f"{shm_prefix}-empty", LAYOUT, 0)
    assert shm_leftovers(shm_prefix) == []


def test_a_live_arena_is_refused_in_process(arena):
    with pytest.raises(ArenaInUse, match="owned by a running daemon"):
        HostArena(arena.name, LAYOUT, 4)
    assert os.path.exists(shm_path(arena.name))  # the refusal did not remove the live arena


def test_live_arena_of_another_process_is_refused_and_stale_one_replaced(shm_prefix):
    name = f"{shm_prefix}-crashy"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline()
        assert line.strip() == "ready", holder.stderr.read()
        # While the holder lives, its arena is refused and left alone.
        with pytest.raises(ArenaInUse):
            HostArena(name, LAYOUT, 3)
        assert (np.frombuffer(open(os.path.join(SHM_DIR, name), "rb").read(LAYOUT.page_bytes), np.uint8) == 7).all()
        # It dies holding the arena: the file stays, nobody holds its lock.
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert holder.returncode == -signal.SIGKILL
        assert os.path.exists(os.path.join(SHM_DIR, name))
        arena = HostArena(name, LAYOUT, 2)
        try:
            assert arena.stale_removed
            assert os.path.getsize(shm_path(name)) == 2 * LAYOUT.slot_bytes
            assert not arena.page(0).any()  # none of the dead daemon's bytes survive
        finally:
            arena.close()
        assert not os.path.exists(shm_path(name))
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        holder.stdout.close()
        holder.stderr.close()


def test_fresh_arena_is_not_marked_stale(arena):
    assert arena.stale_removed is False
