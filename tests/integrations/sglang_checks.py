"""SGLang's HiCache storage interface against a real daemon, run with .venv-sglang's python
by tests/integrations/test_sglang_backend.py: `write` stores pages, `read` (a fresh process,
so a fresh backend and session) reads them back. Each prints one JSON line of what happened.

The backend is built as SGLang builds it: a real `HiCacheStorageConfig`, SGLang's
`StorageBackendFactory.create_backend("dynamic", ...)`, then `register_mem_pool_host`; keys
are SGLang's own page hashes (`get_hash_str`), and the calls are those SGLang's cache
controller makes, with page-aligned host indices. SGLang's host pool classes need a CUDA
torchvision to import, so the pool is a stand-in holding a buffer of exactly the shape
SGLang 0.5.23's `init_kv_buffer` allocates for each layout.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass

import torch
from kvtier_client import KVTierClient
from kvtier_client.tiers import Tier
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

LAYERS, HEADS, HEAD_DIM, LATENT_DIM, PAGE = 3, 2, 8, 16, 4
POOL_PAGES = 12
STORED, ASKED = 6, 8  # pages stored of the keys a reader asks for


@dataclass
class StandInPool:
    """What the backend reads of a host pool: `layout`, `page_size`, `kv_buffer`."""

    layout: str
    page_size: int
    kv_buffer: torch.Tensor


def pool(layout: str, *, mla: bool, heads: int = HEADS, seed: int | None = None) -> StandInPool:
    """A pool of POOL_PAGES pages, its buffer shaped as SGLang allocates it; random bf16 KV
    from `seed`, else zeros."""
    slots = POOL_PAGES * PAGE
    if mla:
        dims = {"layer_first": (LAYERS, slots, 1, LATENT_DIM), "page_first": (slots, LAYERS, 1, LATENT_DIM),
                "page_first_direct": (POOL_PAGES, LAYERS, PAGE, 1, LATENT_DIM)}[layout]
    else:
        dims = {"layer_first": (2, LAYERS, slots, heads, HEAD_DIM), "page_first": (2, slots, LAYERS, heads, HEAD_DIM),
                "page_first_direct": (2, POOL_PAGES, LAYERS, PAGE, heads, HEAD_DIM),
                "page_head": (2, POOL_PAGES, heads, PAGE, LAYERS, HEAD_DIM)}.get(layout, (2, slots, LAYERS, heads, HEAD_DIM))
    if seed is None:
        return StandInPool(layout, PAGE, torch.zeros(dims, dtype=torch.bfloat16))
    generator = torch.Generator().manual_seed(seed)
    return StandInPool(layout, PAGE, torch.randn(dims, generator=generator).to(torch.bfloat16))


def kvtier_order(p: StandInPool, index: int, *, mla: bool) -> torch.Tensor:
    """The page at token slot `index`, element by element in kvtier's order ([layers, K/V,
    tokens, heads, dim]; MLA [layers, tokens, 1, dim]), indexed as SGLang's layouts place it."""
    b, page = p.kv_buffer, index // PAGE
    if mla:
        at = {"layer_first": lambda l, t: b[l, index + t], "page_first": lambda l, t: b[index + t, l],
              "page_first_direct": lambda l, t: b[page, l, t]}[p.layout]
        return torch.stack([torch.stack([at(l, t) for t in range(PAGE)]) for l in range(LAYERS)])
    at = {"layer_first": lambda kv, l, t: b[kv, l, index + t], "page_first": lambda kv, l, t: b[kv, index + t, l],
          "page_first_direct": lambda kv, l, t: b[kv, page, l, t], "page_head": lambda kv, l, t: b[kv, page, :, t, l]}
    return torch.stack([torch.stack([torch.stack([at[p.layout](kv, l, t) for t in range(PAGE)]) for kv in (0, 1)])
                        for l in range(LAYERS)])


def backend(target: str, model: str, *, mla: bool = False, tp: tuple[int, int] = (0, 1), **extra):
    config = HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=model,
        extra_config={"backend_name": "kvtier", "module_path": "kvtier_client.integrations.sglang",
                      "class_name": "KVTierStorage", "interface_v1": 1, "target": target, **extra})
    return StorageBackendFactory.create_backend("dynamic", config, None)


def hashes(model: str, count: int = ASKED) -> list[str]:
    tokens = [int.from_bytes(hashlib.sha256(f"{model}/{i}".encode()).digest()[:4], "little") % 50_000
              for i in range(count * PAGE)]
    return get_hash_str(tokens, None, page_size=PAGE)


def indices(slots: list[int]) -> torch.Tensor:
    """Host indices of whole pages, as SGLang's controller passes them (token slots)."""
    return torch.cat([torch.arange(s * PAGE, (s + 1) * PAGE) for s in slots])


#: (name, mla, writer's layout, reader's layout): every supported layout, crossed.
CASES = [
    ("mha-pf-lf", False, "page_first", "layer_first"), ("mha-lf-pfd", False, "layer_first", "page_first_direct"),
    ("mha-pfd-ph", False, "page_first_direct", "page_head"), ("mha-ph-pf", False, "page_head", "page_first"),
    ("mla-pf-pfd", True, "page_first", "page_first_direct"), ("mla-pfd-lf", True, "page_first_direct", "layer_first"),
    ("mla-lf-pf", True, "layer_first", "page_first"),
]
WRITE_SLOTS = [3, 0, 7, 1, 10, 5]  # where the writer's pages sit in its pool
READ_SLOTS = [2, 9, 4, 11, 0, 6, 8, 1]  # where the reader puts them


def seed(name: str, rank: int = 0) -> int:
    return sum(map(ord, name)) * 10 + rank


def write(target: str, full_target: str, full_pid: int | None) -> dict:
    out: dict = {"cases": {}}
    for name, mla, layout, _ in CASES:
        b = backend(target, name, mla=mla)
        p = pool(layout, mla=mla, seed=seed(name))
        b.register_mem_pool_host(p)
        keys = hashes(name)
        before = b.batch_exists(keys)
        done = b.batch_set_v1(keys[:STORED], indices(WRITE_SLOTS))
        again = b.batch_set_v1(keys[:STORED], indices(WRITE_SLOTS))  # cached: not copied again, still True
        out["cases"][name] = {"before": before, "set": done, "again": again, "after": b.batch_exists(keys)}
        b.close()
    # Two TP ranks of one model store the same keys, each its own heads; MLA ranks share.
    for rank in (0, 1):
        b = backend(target, "tp", tp=(rank, 2))
        b.register_mem_pool_host(pool("page_first", mla=False, heads=1, seed=seed("tp", rank)))
        out[f"tp{rank}_set"] = b.batch_set_v1(hashes("tp")[:STORED], indices(WRITE_SLOTS))
        b.close()
    b = backend(target, "mla-tp", mla=True, tp=(0, 2))
    b.register_mem_pool_host(pool("page_first", mla=True, seed=seed("mla-tp")))
    out["mla_tp0_set"] = b.batch_set_v1(hashes("mla-tp")[:STORED], indices(WRITE_SLOTS))
    b.close()
    # A gap: pages 0, 1 and 3 stored; SGLang asks how many of the keys exist in order.
    b = backend(target, "gap")
    b.register_mem_pool_host(pool("page_first", mla=False, seed=1))
    keys = hashes("gap", 5)
    b.batch_set_v1(keys[:2], indices([0, 1]))
    b.batch_set_v1(keys[3:4], indices([3]))
    out["gap_exists"] = b.batch_exists(keys)
    out["bad_indices"] = b.batch_set_v1(keys[4:5], indices([4])[:2])  # half a page: refused, not raised
    out["bad_hash"] = b.batch_exists(["not-a-hash"])
    # SGLang's generic interface: flat data pages (get_data_page(flat=True) of page_first).
    p = pool("page_first", mla=False, seed=seed("generic"))
    b = backend(target, "generic")
    b.register_mem_pool_host(p)
    flat = [p.kv_buffer[:, s * PAGE:(s + 1) * PAGE].flatten() for s in (2, 5)]
    out["generic_set"] = b.batch_set(hashes("generic", 2), flat)
    b.close()
    # A layout SGLang has but kvtier cannot page is refused when the pool is registered.
    try:
        backend(target, "unified").register_mem_pool_host(pool("page_unified", mla=False))
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    # No daemon at the target: SGLang's start fails, saying where it looked.
    try:
        backend("unix:///nonexistent/kvtier.sock", "nowhere", connect_timeout=1).register_mem_pool_host(
            pool("page_first", mla=False))
        out["unreachable"] = None
    except RuntimeError as exc:
        out["unreachable"] = str(exc)
    # A hybrid model's side pools go through SGLang's v2 calls: refused at attach.
    b = backend(target, "hybrid")
    b.register_mem_host_pool_v2(pool("page_first", mla=False), "kv")
    try:
        b.register_mem_host_pool_v2(pool("page_first", mla=False), "mamba")
        out["hybrid_refused"] = None
    except ValueError as exc:
        out["hybrid_refused"] = str(exc)
    out["full"] = write_full(full_target)
    if full_pid:
        out["gone"] = daemon_gone(full_target, full_pid)
    out["speed"] = speed(target)
    return out


def speed(target: str, pages: int = 32, rounds: int = 5) -> dict:
    """Seconds to store and to load `pages` pages of 256 KiB from a page_first pool, against
    the copy alone (the same views copied into a plain tensor): best of `rounds`, this run."""
    layers, heads, dim, tokens = 8, 4, 64, 32
    buffer = torch.randn((2, pages * tokens, layers, heads, dim)).to(torch.bfloat16)
    p = StandInPool("page_first", tokens, buffer)
    b = backend(target, "speed")
    b.register_mem_pool_host(p)
    slots = torch.arange(pages * tokens)
    views = [b.pages.page(i * tokens) for i in range(pages)]
    scratch = torch.empty((pages, *views[0].shape), dtype=torch.bfloat16)
    copy_s, set_s, get_s = [], [], []
    for r in range(rounds):
        keys = get_hash_str(list(range(r * 1000, r * 1000 + pages * tokens)), None, page_size=tokens)
        start = time.perf_counter()
        for i, view in enumerate(views):
            scratch[i].copy_(view)
        copy_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        stored = b.batch_set_v1(keys, slots)
        set_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        loaded = b.batch_get_v1(keys, slots)
        get_s.append(time.perf_counter() - start)
        assert all(stored) and all(loaded), (stored, loaded)
    b.close()
    best = {"copy_s": min(copy_s), "set_s": min(set_s), "get_s": min(get_s)}
    return {"pages": pages, "page_bytes": b.pages.layout.page_bytes, **best,
            "set_vs_copy": best["set_s"] / best["copy_s"], "get_vs_copy": best["get_s"] / best["copy_s"]}


def write_full(target: str) -> dict:
    """The daemon's host pages all lent to another writer: storing fails cleanly (False, no
    exception, nothing left borrowed), and works again once they are free."""
    p = pool("page_first", mla=False, seed=seed("full"))
    b = backend(target, "full")
    b.register_mem_pool_host(p)
    holder = KVTierClient(target)
    holder.register(b.config.namespace, b.pages.layout)
    capacity = holder.pool.capacity(Tier.HOST)
    lease = holder.borrow(capacity)
    keys = hashes("full", 2)
    refused = b.batch_set_v1(keys, indices([0, 1]))
    exists_while_full = b.batch_exists(keys)
    host = holder.stats().pool(holder.pool.pool_id).tier(Tier.HOST)
    writing_while_full = host.writing_pages  # the holder's lease alone: the refused store kept none
    lease.release()
    holder.lookup([b.scope.key(k) for k in keys])  # answered after the release is applied (the lane sends a release without waiting)
    stored = b.batch_set_v1(keys, indices([0, 1]))
    after = b.batch_exists(keys)
    holder.close()
    b.close()
    return {"capacity": capacity, "refused": refused, "exists_while_full": exists_while_full,
            "writing_while_full": writing_while_full, "stored": stored, "after": after}


def daemon_gone(target: str, pid: int) -> dict:
    """The daemon stops under a registered backend: every call answers "nothing" (0, False)
    without raising, and once one found it unavailable the next ones skip it at once."""
    p = pool("page_first", mla=False, seed=seed("gone"))
    b = backend(target, "gone", connect_timeout=1)
    b.register_mem_pool_host(p)
    keys = hashes("gone", 2)
    os.kill(pid, signal.SIGTERM)
    socket = target.removeprefix("unix://")
    deadline = time.monotonic() + 20
    while os.path.exists(socket) and time.monotonic() < deadline:
        time.sleep(0.05)
    calls = {}
    for name, call in (("exists", lambda: b.batch_exists(keys)), ("set", lambda: b.batch_set_v1(keys, indices([0, 1]))),
                       ("get", lambda: b.batch_get_v1(keys, indices([2, 3])))):
        start = time.perf_counter()
        calls[name] = {"answer": call(), "seconds": time.perf_counter() - start}
    b.close()
    return calls


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))  # bitwise, bf16 as its bits


def read(target: str) -> dict:
    out: dict = {"cases": {}}
    for name, mla, w_layout, r_layout in CASES:
        b = backend(target, name, mla=mla)
        src, dst = pool(w_layout, mla=mla, seed=seed(name)), pool(r_layout, mla=mla)
        b.register_mem_pool_host(dst)
        keys = hashes(name)
        unknown = hashes(name + "-unknown", 2)
        got = b.batch_get_v1(keys, indices(READ_SLOTS))
        pages_equal = [equal(kvtier_order(dst, r * PAGE, mla=mla), kvtier_order(src, w * PAGE, mla=mla))
                       for w, r in zip(WRITE_SLOTS, READ_SLOTS)]
        untouched = [bool((kvtier_order(dst, r * PAGE, mla=mla) == 0).all()) for r in READ_SLOTS[STORED:]]
        # The daemon's page is in kvtier's order, whatever layout wrote it.
        with b.kv.acquire([b.scope.key(keys[0])]) as lease:
            stored_order = equal(lease.tensors()[0], kvtier_order(src, WRITE_SLOTS[0] * PAGE, mla=mla))
        out["cases"][name] = {
            "exists": b.batch_exists(keys), "got": got, "pages_equal": pages_equal, "untouched": untouched,
            "stored_order": stored_order, "unknown_exists": b.batch_exists(unknown),
            "unknown_get": b.batch_get_v1(unknown, indices([0, 1])), "layout": str(b.pages.layout)}
        b.close()
    keys = hashes("tp")[:STORED]
    sources = [pool("page_first", mla=False, heads=1, seed=seed("tp", rank)) for rank in (0, 1)]
    for rank in (0, 1):
        b = backend(target, "tp", tp=(rank, 2))
        dst = pool("page_first", mla=False, heads=1)
        b.register_mem_pool_host(dst)
        got = b.batch_get_v1(keys, indices(READ_SLOTS[:STORED]))
        mine = [equal(dst.kv_buffer[:, r * PAGE:(r + 1) * PAGE], sources[rank].kv_buffer[:, w * PAGE:(w + 1) * PAGE])
                for w, r in zip(WRITE_SLOTS, READ_SLOTS)]
        out[f"tp{rank}"] = {"got": got, "own_pages": mine}
        b.close()
    b = backend(target, "mla-tp", mla=True, tp=(1, 2))  # rank 1 never wrote: it reads rank 0's copy
    dst = pool("page_first", mla=True)
    b.register_mem_pool_host(dst)
    src = pool("page_first", mla=True, seed=seed("mla-tp"))
    got = b.batch_get_v1(hashes("mla-tp")[:STORED], indices(READ_SLOTS[:STORED]))
    out["mla_tp1"] = {"got": got, "equal": all(equal(kvtier_order(dst, r * PAGE, mla=True),
                                                     kvtier_order(src, w * PAGE, mla=True))
                                               for w, r in zip(WRITE_SLOTS, READ_SLOTS))}
    b.close()
    src = pool("page_first", mla=False, seed=seed("generic"))
    b = backend(target, "generic")
    b.register_mem_pool_host(pool("page_first", mla=False))
    targets = [torch.zeros(src.kv_buffer[:, :PAGE].numel(), dtype=torch.bfloat16) for _ in range(3)]
    got = b.batch_get(hashes("generic", 3), targets)
    out["generic"] = {"got": [t is not None for t in got],
                      "equal": [equal(targets[i], src.kv_buffer[:, s * PAGE:(s + 1) * PAGE].flatten())
                                for i, s in enumerate((2, 5))]}
    b.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("step", choices=("write", "read"))
    parser.add_argument("--target", required=True)
    parser.add_argument("--full-target")
    parser.add_argument("--full-pid", type=int, help="stop this daemon (the --full-target one) at the end")
    args = parser.parse_args()
    result = write(args.target, args.full_target, args.full_pid) if args.step == "write" else read(args.target)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
