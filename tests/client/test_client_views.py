"""Page views over a real memory file (a memfd, as the daemon hands over), without a daemon:
shapes, dtypes, zero copy."""
from __future__ import annotations

import gc
import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvtier_client.layout import DTYPE_BYTES, PageLayout
from kvtier_client.views import NUMPY_DTYPES, HostArenaView, numpy_dtype

SLOTS = 3


@pytest.fixture
def shm_file():
    """A real memfd standing in for a daemon's arena; closed afterwards."""
    created = []

    def make(size: int) -> int:
        fd = os.memfd_create("kvtier-views-test", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        created.append(fd)
        return fd

    yield make
    for fd in created:
        os.close(fd)


def _arena(shm_file, layout: PageLayout) -> HostArenaView:
    size = SLOTS * layout.slot_bytes
    return HostArenaView.from_fd(shm_file(size), size, layout, layout.page_bytes, layout.slot_bytes)


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_numpy_view_has_layout_shape_and_dtype_width(shm_file, dtype):
    layout = PageLayout(layers=3, kv_heads=2, head_dim=8, block_tokens=4, dtype=dtype)
    arena = _arena(shm_file, layout)
    page = arena.numpy(1, writable=True)
    assert page.shape == (3, 2, 4, 2, 8)
    assert page.dtype == NUMPY_DTYPES[dtype]
    assert page.dtype.itemsize == layout.itemsize
    assert page.nbytes == layout.page_bytes
    assert page.flags.c_contiguous


def test_numpy_dtypes_are_real_where_numpy_has_them():
    assert numpy_dtype("float16") == np.float16
    assert numpy_dtype("float32") == np.float32
    assert numpy_dtype("int8") == np.int8
    # No numpy type: the raw bits in an unsigned integer of the same width.
    assert numpy_dtype("bfloat16") == np.uint16
    assert numpy_dtype("float8_e4m3fn") == np.uint8
    with pytest.raises(ValueError, match="no numpy view"):
        numpy_dtype("float64")


def test_views_address_slot_stride_and_share_memory(shm_file):
    # page_bytes = 2*2*4*2*3*2 = 384, slot_bytes = 4096: pages are not back to back.
    layout = PageLayout(layers=2, kv_heads=2, head_dim=3, block_tokens=4, dtype="float16")
    fd = shm_file(SLOTS * layout.slot_bytes)
    arena = HostArenaView.from_fd(fd, SLOTS * layout.slot_bytes, layout, layout.page_bytes, layout.slot_bytes)
    arena.numpy(2, writable=True)[...] = 1.5
    # A second, independent mapping of the same file sees the write at slot 2's offset.
    other = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    raw = np.frombuffer(other, dtype=np.uint8)
    start = 2 * layout.slot_bytes
    assert np.all(raw[start : start + layout.page_bytes].view(np.float16) == 1.5)
    assert not raw[: start].any() and not raw[start + layout.page_bytes :].any()
    del raw
    other.close()


def test_read_views_are_read_only(shm_file):
    layout = PageLayout(layers=1, kv_heads=1, head_dim=4, block_tokens=2)
    arena = _arena(shm_file, layout)
    page = arena.numpy(0, writable=False)
    with pytest.raises(ValueError):
        page[...] = 1


def test_slot_outside_arena_is_refused(shm_file):
    layout = PageLayout(layers=1, kv_heads=1, head_dim=4, block_tokens=2)
    arena = _arena(shm_file, layout)
    with pytest.raises(ValueError, match="outside"):
        arena.numpy(SLOTS, writable=True)


def test_disagreeing_page_size_is_refused(shm_file):
    layout = PageLayout(layers=1, kv_heads=1, head_dim=4, block_tokens=2)
    size = SLOTS * layout.slot_bytes
    with pytest.raises(ValueError, match="disagree"):
        HostArenaView.from_fd(shm_file(size), size, layout, layout.page_bytes * 2, layout.slot_bytes)


def test_close_keeps_pages_in_use_alive(shm_file):
    layout = PageLayout(layers=1, kv_heads=1, head_dim=4, block_tokens=2, dtype="float32")
    arena = _arena(shm_file, layout)
    page = arena.numpy(0, writable=True)
    arena.close()
    page[...] = 7.0  # still mapped: the view holds the mapping
    assert page.sum() == 7.0 * page.size
    with pytest.raises(ValueError, match="closed"):
        arena.numpy(0, writable=True)


def test_close_keeps_tensors_in_use_alive(shm_file):
    pytest.importorskip("torch")
    layout = PageLayout(layers=1, kv_heads=1, head_dim=4, block_tokens=2, dtype="bfloat16")
    arena = _arena(shm_file, layout)
    tensor = arena.torch(2)
    arena.close()
    del arena
    gc.collect()
    tensor.fill_(2.0)  # would fault if closing had unmapped the arena under the tensor
    assert float(tensor.float().sum()) == 2.0 * tensor.numel()


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_torch_view_has_real_dtype_and_shares_numpy_bytes(shm_file, dtype):
    torch = pytest.importorskip("torch")
    layout = PageLayout(layers=2, kv_heads=2, head_dim=4, block_tokens=2, dtype=dtype)
    arena = _arena(shm_file, layout)
    tensor = arena.torch(1)
    assert tensor.dtype == getattr(torch, dtype)
    assert tuple(tensor.shape) == layout.shape
    assert tensor.is_contiguous()
    tensor.view(torch.uint8).fill_(0x3C)  # write through torch ...
    assert np.all(arena.raw(1, writable=False) == 0x3C)  # ... read the same bytes through numpy
    assert not arena.raw(0, writable=False).any() and not arena.raw(2, writable=False).any()


def test_bfloat16_numpy_bits_match_torch_values(shm_file):
    torch = pytest.importorskip("torch")
    layout = PageLayout(layers=1, kv_heads=1, head_dim=8, block_tokens=2, dtype="bfloat16")
    arena = _arena(shm_file, layout)
    values = torch.linspace(-3, 3, 32, dtype=torch.bfloat16).view(layout.shape)
    arena.torch(0).copy_(values)
    bits = arena.numpy(0, writable=False)  # uint16 raw bits
    as_float = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(as_float, values.float().numpy())


def test_sdk_works_without_torch(tmp_path):
    """With torch unimportable, the package imports, numpy views work and torch views
    explain how to install it."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # makes `import torch` raise ImportError
        import mmap
        import kvtier_client
        from kvtier_client.layout import PageLayout
        from kvtier_client.views import HostArenaView
        layout = PageLayout(layers=1, kv_heads=1, head_dim=4, block_tokens=2, dtype="bfloat16")
        arena = HostArenaView(mmap.mmap(-1, layout.slot_bytes), layout, layout.page_bytes, layout.slot_bytes)
        assert arena.numpy(0, writable=True).shape == layout.shape
        try:
            arena.torch(0)
        except ImportError as exc:
            assert "kvtier-client[torch]" in str(exc), exc
        else:
            raise AssertionError("torch view without torch did not raise")
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
