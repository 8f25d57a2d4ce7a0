"""LMCache's client side for `kvtier bench peers`, run by the Python of the LMCache venv.

LMCache pins numpy<=2.2.6 and protobuf<7, so it cannot share kvtier's venv; the peers
benchmark runs this file with `.venv-lmcache/bin/python` (scripts/setup_bench_peers.sh makes
it). It imports nothing from kvtier.

It drives a running `lmcache_server HOST PORT cpu` through LMCache's own storage API, the
path LMCache's remote backend takes with an `lm://` URL: a `LocalCPUBackend` (host memory
allocator, no CUDA) hands out memory objects and `LMCServerConnector` moves them.

    put (per page)  allocate a memory object, copy the engine's page into it (what LMCache's
                    GPU connector does from the KV cache), connector.put (16 queued at a
                    time on the connector's event loop), free the object; after the last page
                    one EXIST round trip on the same ordered socket, so that the server holds
                    every page when the timing stops
    get (per page)  connector.get (recv_into a fresh memory object), copy it into the
                    engine's buffer, free the object

Protocol, one line each way:

    python lmcache_driver.py '{"host": "127.0.0.1", "port": 65432, "page_bytes": 262144,
                               "pages": 64, "batch": 16}'
    -> {"ready": true, "lmcache": "0.5.6"}
    <- put            -> {"seconds": 0.123}      every put writes the same N keys (the server
    <- get            -> {"seconds": 0.098}      overwrites), so its memory stays N pages
    <- quit

Any failure: {"error": "..."} on stdout and exit status 1.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time


def main(argv: list[str]) -> int:
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    args = json.loads(argv[1])
    import lmcache
    import numpy as np
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    page_bytes, pages, batch = args["page_bytes"], args["pages"], args["batch"]
    if page_bytes % 4:
        raise ValueError(f"page_bytes must be a multiple of 4, got {page_bytes}")
    # A KV_2LTD object of exactly page_bytes: [K/V, layers, tokens, hidden] float16.
    shape = torch.Size([2, 1, 1, page_bytes // 4])
    dtype = torch.float16

    ring = max(1, min(pages, (256 << 20) // page_bytes))
    rng = np.random.default_rng(1)
    engine = torch.from_numpy(rng.integers(0, 256, size=(ring, page_bytes), dtype=np.uint8))
    sink = torch.ones((ring, page_bytes), dtype=torch.uint8)

    config = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=False, max_local_cpu_size=1)
    # What a serving engine's adapter would fill in; one 1-token chunk is one page here.
    metadata = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=dtype, kv_shape=(1, 2, 1, 1, page_bytes // 4), chunk_size=1)
    allocator = HostMemoryAllocator(max(64 << 20, 4 * batch * page_bytes))
    backend = LocalCPUBackend(config, metadata=metadata, memory_allocator=allocator)

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    connector = LMCServerConnector(args["host"], args["port"], loop, backend)
    keys = [CacheEngineKey("bench", 1, 0, i, dtype) for i in range(pages)]

    def put() -> None:
        for first in range(0, pages, batch):
            objs, futures = [], []
            for i in range(first, min(pages, first + batch)):
                obj = backend.allocate(shape, dtype, MemoryFormat.KV_2LTD)
                if obj is None:
                    raise RuntimeError("LMCache's host allocator is full")
                obj.tensor.view(torch.uint8).view(-1).copy_(engine[i % ring])
                objs.append(obj)
                futures.append(asyncio.run_coroutine_threadsafe(connector.put(keys[i], obj), loop))
            for future in futures:
                future.result()
            for obj in objs:
                obj.ref_count_down()
        if not run(connector.exists(keys[-1])):
            raise RuntimeError("the LMCache server does not hold the last page put")

    def get() -> None:
        for i in range(pages):
            obj = run(connector.get(keys[i]))
            if obj is None:
                raise RuntimeError(f"the LMCache server lost page {i}")
            sink[i % ring].copy_(obj.tensor.view(torch.uint8).view(-1))
            obj.ref_count_down()

    def verify() -> None:  # outside the timing: the last ring's worth of pages, byte for byte
        for i in range(max(0, pages - ring), pages):
            if not torch.equal(sink[i % ring], engine[i % ring]):
                raise RuntimeError(f"page {i} came back from the LMCache server with other bytes")

    print(json.dumps({"ready": True, "lmcache": getattr(lmcache, "__version__", "unknown")}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        start = time.perf_counter()
        if command == "put":
            put()
        elif command == "get":
            get()
        else:
            raise ValueError(f"unknown command {command!r}")
        seconds = time.perf_counter() - start
        if command == "get":
            verify()
        print(json.dumps({"seconds": seconds}), flush=True)
    run(connector.close())
    loop.call_soon_threadsafe(loop.stop)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except Exception as exc:  # noqa: BLE001 - the parent reads the reason from stdout
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        sys.exit(1)
