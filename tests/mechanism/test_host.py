"""HostArena: one real memfd per namespace over shared slots, mapped by a second real process
through the descriptor (as the handoff socket hands it over)."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from kvtier_client.layout import PageLayout
from kvtier_client.shm import map_fd

from kvtier.mechanism.host import HostArena

LAYOUT = PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16)  # 3072-byte pages in 4096-byte slots

# A client process given one namespace's descriptor: prints slot 2's page as hex, writes
# 0x5A over slot 1's page.
CLIENT = textwrap.dedent(
    """
    import sys
    from kvtier_client.shm import map_fd
    fd, size, slot_bytes, page_bytes = map(int, sys.argv[1:])
    mm = map_fd(fd, size)
    print(mm[2 * slot_bytes : 2 * slot_bytes + page_bytes].hex())
    mm[slot_bytes : slot_bytes + page_bytes] = b"\\x5a" * page_bytes
    mm.close()
    """
)


@pytest.fixture
def arena(shm_prefix):
    a = HostArena(f"{shm_prefix}-host", LAYOUT, 4)
    yield a
    a.close()


def _allocated(arena: HostArena, namespace: str) -> int:
    """Bytes of memory behind a namespace's file (tmpfs allocates on first touch)."""
    return os.fstat(arena.file_for(namespace)).st_blocks * 512


def test_geometry_views_and_one_file_per_namespace(arena):
    for slot in range(4):
        arena.give(slot, "a" if slot < 2 else "b")
    assert len(arena.view(3)) == LAYOUT.slot_bytes
    assert arena.page(3).shape == (LAYOUT.page_bytes,) and arena.page(3).dtype == np.uint8
    arena.page(1)[:] = 9
    view = arena.view(1)
    assert bytes(view[: LAYOUT.page_bytes]) == b"\x09" * LAYOUT.page_bytes  # page() and view() alias
    assert bytes(view[LAYOUT.page_bytes :]) == bytes(LAYOUT.slot_bytes - LAYOUT.page_bytes)  # padding untouched
    assert not arena.page(0).any() and not arena.page(2).any()  # neighbours untouched
    assert arena.file_for("a") != arena.file_for("b")
    assert os.fstat(arena.file_for("a")).st_size == os.fstat(arena.file_for("b")).st_size == arena.size
    del view


def test_a_slot_given_to_another_namespace_is_cut_out_of_the_old_one(arena):
    arena.give(1, "a")
    arena.page(1)[:] = 0xAA
    a = map_fd(arena.file_for("a"), arena.size)  # tenant a's own mapping, as a client holds it
    try:
        assert a[LAYOUT.slot_bytes] == 0xAA
        held = _allocated(arena, "a")
        arena.give(1, "b")
        assert _allocated(arena, "a") <= held - LAYOUT.slot_bytes  # its memory freed (before anyone reads there)
        assert not arena.page(1).any()  # b's file is a hole there: zeros
        assert a[LAYOUT.slot_bytes : LAYOUT.slot_bytes + LAYOUT.page_bytes] == bytes(LAYOUT.page_bytes)  # gone from a's too
        arena.page(1)[:] = 0xBB
        assert a[LAYOUT.slot_bytes] == 0  # b's bytes never show through a's file
    finally:
        a.close()


def test_another_process_maps_its_namespace_by_descriptor(arena):
    for slot in range(3):
        arena.give(slot, "a")
    arena.give(3, "b")
    secret = np.random.default_rng(1).integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8)
    arena.page(2)[:] = secret
    arena.page(3)[:] = 0x77  # b's page: a's process must not see it
    fd = arena.file_for("a")
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, str(fd), str(arena.size), str(LAYOUT.slot_bytes), str(LAYOUT.page_bytes)],
        capture_output=True, text=True, timeout=30, pass_fds=(fd,),
    )
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout.strip()) == secret.tobytes()  # the client read what we wrote
    assert (arena.page(1) == 0x5A).all()  # and we see what the client wrote
    assert (arena.page(3) == 0x77).all()


def test_files_are_sealed_against_resizing(arena):
    """A client holding the descriptor cannot shrink the file under the daemon (SIGBUS)."""
    fd = arena.file_for("a")
    for size in (0, arena.size + 4096):
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size)
    assert fcntl.fcntl(fd, 1034) & 0x7 == 0x7  # F_GET_SEALS: seal, shrink, grow


def test_map_fd_refuses_a_short_file(arena):
    with pytest.raises(ValueError, match="daemon and client disagree"):
        map_fd(arena.file_for("a"), arena.size + 4096)


def test_a_slot_must_be_given_before_use(arena):
    with pytest.raises(RuntimeError, match="never given"):
        arena.page(0)


def test_close_is_idempotent_and_keeps_exported_views_valid(shm_prefix):
    arena = HostArena(f"{shm_prefix}-closing", LAYOUT, 2)
    arena.give(0, "a")
    held = arena.page(0)  # an exported view must not stop the arena from closing
    arena.close()
    arena.close()
    del held


def test_pages_must_be_positive(shm_prefix):
    with pytest.raises(ValueError, match="at least one page"):
        HostArena(f"{shm_prefix}-empty", LAYOUT, 0)
