"""Peers benchmark: kvtier next to the stores engines use for KV pages today, on loopback.

Every system moves the same pages (same sizes, same number, same engine-owned numpy
buffers, PEERS_BATCH = 64 pages per call or round trip unless --batch says otherwise) in the
same run, and each figure is also given as kvtier / peer:

    system            put (engine page -> store)                 get (store -> engine buffer)
    kvtier            borrow a batch, np.copyto into the mapped       acquire a batch, np.copyto the mapped
                      arena pages, commit (daemon subprocess,    pages into the engine buffer,
                      client over its Unix socket)               release
    Redis             SET per page, 16 per pipeline round trip   GET per page, 16 per pipeline,
                      (LMCache's remote backend does one SET     np.copyto the reply into the
                      per page), TCP 127.0.0.1                   engine buffer
    Mooncake Store    mooncake_master + mooncake_client (its     same, batch_get_into the engine
      zero-copy       real client daemon), the Python dummy      buffer; the engine's buffers are
                      client over shared memory: batch_put_from  allocated from the dummy client's
                      of 16 pages from the engine's buffer       registered pool (its zero-copy path)
    Mooncake Store    same servers, put_batch of 16 numpy        get_batch of 16, np.copyto the
      bytes           pages (Mooncake copies them)               returned bytes into the engine buffer
    LMCache server    `lmcache_server 127.0.0.1 PORT cpu` driven through LMCache's storage API
                      (LocalCPUBackend + LMCServerConnector, the lm:// remote backend), in its
                      own venv: see kvtier_bench/lmcache_driver.py
    gRPC              a bare gRPC page store (kvtier_bench/peers/grpc.py): one unary call per
                      page, 16 in flight, TCP 127.0.0.1
    kvtier over gRPC  kvtier again with KVTierClient(lane=False): the fast lane's gain, a reference row
    kvtier RemotePages kvtier's own slow path for a client on another host (WritePages /
                      ReadPages streams through the daemon), a reference row

Before the timed repetitions every system does one untimed round (faults in its memory);
repetitions then rotate the order of the systems. kvtier gets a fresh daemon whose host
tier holds exactly the pages moved for every repetition, so it never evicts (the peers have
room too: Redis and the gRPC store are flushed, Mooncake's objects removed, LMCache's
server overwrites the same keys). Every get is checked byte for byte outside the timing.
kvtier's rows also time np.copyto of the same bytes into and out of the same arena slots
(kvtier / np.copyto). A system that cannot run (not installed, does not start, needs CUDA) keeps its row with
the reason instead of numbers. Peers are not kvtier dependencies:
scripts/setup_bench_peers.sh installs them.

Each system is a PageStore (kvtier_bench.peers.base), one adapter module each in this
package; this module only runs them and reports.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from kvtier_bench.harness import (
    BATCH,
    ENGINE_RING_BYTES,
    KiB,
    MiB,
    Rate,
    describe_machine,
    format_size,
    layout_for,
    machine_description,
    median_rate,
    timed,
    utc_now,
    verify,
)
from kvtier_bench.peers import grpc, kvtier, lmcache, mooncake, redis
from kvtier_bench.peers.base import Context, PageStore, Servers, Unavailable, log
from kvtier_bench.services import ServiceError

PAGE_SIZES = (64 * KiB, 256 * KiB, 2 * MiB)
#: Bytes per page size and measurement (the same for every system) ...
DEFAULT_BYTES = 256 * MiB
QUICK_BYTES = 64 * MiB
#: ... but never fewer pages than this, so that a large page's measurement is not a handful of calls.
MIN_PAGES = 256
QUICK_MIN_PAGES = 128
DEFAULT_REPS = 5
QUICK_REPS = 3
REPO = Path(__file__).resolve().parents[3]
LMCACHE_VENV = Path(os.environ.get("KVTIER_BENCH_LMCACHE_VENV", REPO / ".venv-lmcache"))


@dataclass(frozen=True)
class System:
    """One row of the table: how to open the system's PageStore for a page size."""

    name: str
    label: str
    path: str  # how put and get move the bytes, one line
    open: Callable[[Context], PageStore]
    reference: bool = False  # kvtier's own rows
    version: Callable[[], str | None] = lambda: None  # the system's version, for its row


# -- the systems, in table order ------------------------------------------------
SYSTEMS: tuple[System, ...] = (
    System("kvtier", "kvtier (daemon + shared-memory client)",
           "borrow/commit, acquire/release of a batch over the fast lane; np.copyto into / out of the mapped arena",
           lambda c: kvtier.KvtierStore(c, False), reference=True, version=kvtier.version),
    System("kvtier-grpc", "kvtier, calls over gRPC (lane=False)",
           "the same as kvtier with every call over gRPC instead of the fast lane",
           lambda c: kvtier.KvtierStore(c, False, lane=False), reference=True, version=kvtier.version),
    System("redis", "Redis as LMCache's remote store",
           "SET / GET per page, a batch per pipeline, TCP loopback; reply copied into the engine buffer", redis.RedisStore,
           version=redis.version),
    System("mooncake", "Mooncake Store, zero-copy",
           "dummy client + mooncake_client: batch_put_from / batch_get_into of a batch, engine buffers in its shared pool",
           lambda c: mooncake.MooncakeStore(c, True), version=mooncake.version),
    System("mooncake-bytes", "Mooncake Store, bytes",
           "dummy client + mooncake_client: put_batch / get_batch of a batch, reply copied into the engine buffer",
           lambda c: mooncake.MooncakeStore(c, False), version=mooncake.version),
    System("lmcache", "LMCache server (cpu)",
           "LocalCPUBackend + LMCServerConnector (lm://), TCP loopback, one page per message",
           lambda c: lmcache.LMCacheStore(c, LMCACHE_VENV), version=lambda: lmcache.version(LMCACHE_VENV)),
    System("grpc", "plain gRPC page store",
           "one unary call per page, a batch in flight, TCP loopback; reply copied into the engine buffer", grpc.GrpcStore,
           version=grpc.version),
    System("kvtier-remote", "kvtier RemotePages (gRPC slow path)",
           "borrow/commit, acquire/release of a batch with WritePages / ReadPages streams through the daemon",
           lambda c: kvtier.KvtierStore(c, True), reference=True, version=kvtier.version),
)
SYSTEM_NAMES = tuple(s.name for s in SYSTEMS)
#: Pages per call or round trip: a 1,024-token request in 16-token blocks.
PEERS_BATCH = 64
#: kvtier put and get / np.copyto of the same bytes into and out of the same arena slots.
COPYTO_TARGETS = {64 * KiB: 0.6, 2 * MiB: 0.9}


# -- results --------------------------------------------------------------------
@dataclass(frozen=True)
class PeerRow:
    system: str
    label: str
    path: str
    reference: bool
    version: str | None
    page_bytes: int
    pages: int
    put: Rate | None = None
    get: Rate | None = None
    reason: str | None = None  # why there are no numbers
    copyto_put: Rate | None = None  # np.copyto of the same bytes into the same arena slots (kvtier rows)
    copyto_get: Rate | None = None

    @property
    def ran(self) -> bool:
        return self.put is not None and self.get is not None


@dataclass(frozen=True)
class PeersResult:
    date: str
    machine: dict
    reps: int
    batch: int
    rows: tuple[PeerRow, ...]

    def kvtier(self, page_bytes: int) -> PeerRow | None:
        return next((r for r in self.rows if r.system == "kvtier" and r.page_bytes == page_bytes and r.ran), None)

    def ratio(self, row: PeerRow, op: str) -> float | None:
        """kvtier throughput / this row's, for `op` in ("put", "get")."""
        ref = self.kvtier(row.page_bytes)
        if ref is None or not row.ran:
            return None
        return getattr(ref, op).pages_per_s / getattr(row, op).pages_per_s

    def over_copyto(self, row: PeerRow, op: str) -> float | None:
        """This row's throughput / np.copyto of the same bytes (kvtier rows that map the arena)."""
        base = getattr(row, f"copyto_{op}")
        if base is None or not row.ran:
            return None
        return getattr(row, op).pages_per_s / base.pages_per_s

    def lane_over_grpc(self, page_bytes: int, op: str) -> float | None:
        """kvtier's throughput over the fast lane / with every call over gRPC."""
        grpc_row = next((r for r in self.rows if r.system == "kvtier-grpc" and r.page_bytes == page_bytes and r.ran),
                        None)
        ref = self.kvtier(page_bytes)
        if ref is None or grpc_row is None:
            return None
        return getattr(ref, op).pages_per_s / getattr(grpc_row, op).pages_per_s

    def best_peer(self, page_bytes: int, op: str) -> PeerRow | None:
        """The fastest system that is not kvtier's own, for one page size and op."""
        peers = [r for r in self.rows if r.page_bytes == page_bytes and r.ran and not r.reference]
        return max(peers, key=lambda r: getattr(r, op).pages_per_s, default=None)

    def as_dict(self) -> dict:
        rows = []
        for r in self.rows:
            row = {"system": r.system, "label": r.label, "path": r.path, "reference": r.reference,
                   "version": r.version, "page_bytes": r.page_bytes, "page_size": format_size(r.page_bytes),
                   "pages": r.pages, "ran": r.ran, "reason": r.reason}
            for op in ("put", "get"):
                rate = getattr(r, op)
                row[op] = rate.as_dict() if rate else None
                row[f"kvtier_over_{op}"] = self.ratio(r, op)
                base = getattr(r, f"copyto_{op}")
                row[f"copyto_{op}"] = base.as_dict() if base else None
                row[f"over_copyto_{op}"] = self.over_copyto(r, op)
            rows.append(row)
        sizes = sorted({r.page_bytes for r in self.rows})
        best = {}
        for size in sizes:
            for op in ("put", "get"):
                peer = self.best_peer(size, op)
                best[f"{format_size(size)} {op}"] = (
                    {"system": peer.system, "kvtier_over_peer": self.ratio(peer, op)} if peer else None)
        lane = {f"{format_size(size)} {op}": self.lane_over_grpc(size, op) for size in sizes for op in ("put", "get")}
        return {"date": self.date, "machine": self.machine, "reps": self.reps, "batch": self.batch, "rows": rows,
                "best_peer": best, "lane_over_grpc": lane,
                "copyto_targets": {format_size(k): v for k, v in COPYTO_TARGETS.items()}}


def default_pages(page_bytes: int, quick: bool) -> int:
    if quick:
        return max(QUICK_MIN_PAGES, QUICK_BYTES // page_bytes)
    return max(MIN_PAGES, DEFAULT_BYTES // page_bytes)


@contextlib.contextmanager
def native_logs_to(path: Path):
    """Send what native libraries write to file descriptor 2 (Mooncake's client logs every
    call from C++ threads) to `path`, while Python's sys.stderr (progress lines) keeps
    writing to the real stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    previous = sys.stderr
    try:
        os.dup2(log, 2)
        sys.stderr = io.TextIOWrapper(io.FileIO(saved, "w", closefd=False), write_through=True)
        yield
    finally:
        sys.stderr.flush()
        sys.stderr = previous
        os.dup2(saved, 2)
        os.close(saved)
        os.close(log)


def _unavailable_reason(exc: BaseException) -> str:
    """One line: a row's reason sits in a table cell."""
    text = str(exc) if isinstance(exc, (Unavailable, ServiceError)) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def run_peers(
    page_sizes: Sequence[int] = PAGE_SIZES,
    *,
    pages: int | None = None,
    quick: bool = False,
    reps: int | None = None,
    systems: Sequence[str] = SYSTEM_NAMES,
    directory: str | None = None,
    batch: int = PEERS_BATCH,
    progress: Callable[[str], None] = lambda message: None,
) -> PeersResult:
    """Measure every system in `systems` on every page size; `pages` per size defaults to
    DEFAULT_BYTES (QUICK_BYTES with `quick`) worth, `reps` to DEFAULT_REPS (QUICK_REPS)."""
    reps = reps if reps is not None else (QUICK_REPS if quick else DEFAULT_REPS)
    unknown = [s for s in systems if s not in SYSTEM_NAMES]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEM_NAMES)}")
    if reps <= 0 or (pages is not None and pages <= 0) or batch <= 0:
        raise ValueError("pages, reps and batch must be positive")
    chosen = [s for s in SYSTEMS if s.name in systems]
    parent = directory or tempfile.gettempdir()
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-peers-", dir=parent))
    rows: list[PeerRow] = []
    rng = np.random.default_rng(0)
    sizes = list(dict.fromkeys(page_sizes))
    servers = Servers(root, max((pages or default_pages(size, quick)) * size for size in sizes))
    quiet = native_logs_to(root / "native.log") if any(s.name.startswith("mooncake") for s in chosen) \
        else contextlib.nullcontext()
    try:
        with quiet:
            for size in sizes:
                n_pages = pages or default_pages(size, quick)
                _, layout = layout_for(size)
                ring = max(1, min(n_pages, ENGINE_RING_BYTES // size))
                engine = rng.integers(0, 256, size=(ring, size), dtype=np.uint8)
                sink = np.ones_like(engine)
                ctx = Context(size, layout, n_pages, engine, sink, root / str(size), servers, batch=batch)
                ctx.workdir.mkdir()
                stores: dict[str, PageStore] = {}
                reasons: dict[str, str] = {}
                samples: dict[str, tuple[list[float], list[float]]] = {}
                copyto: dict[str, tuple[list[float], list[float]]] = {}
                try:
                    for system in chosen:
                        progress(f"{format_size(size)}: starting {system.label}")
                        try:
                            stores[system.name] = system.open(ctx)
                            samples[system.name] = ([], [])
                        except Exception as exc:  # noqa: BLE001 - the row says why
                            reasons[system.name] = _unavailable_reason(exc)
                            progress(f"{format_size(size)}: {system.label} does not run: {reasons[system.name]}")
                    for rep in range(reps + 1):  # round 0 warms every system up, untimed
                        names = list(stores)
                        shift = rep % len(names) if names else 0
                        names = names[shift:] + names[:shift]
                        what = "warm-up" if rep == 0 else f"repetition {rep} of {reps}"
                        progress(f"{format_size(size)} x {n_pages} pages: {what} ({', '.join(names)})")
                        for name in names:
                            store = stores[name]
                            try:
                                store.prepare(rep)
                                t_put = timed(partial(store.put, rep))
                                landing = getattr(store, "landing", sink)  # where gets land, if here
                                if landing is not None:
                                    landing.fill(0)
                                t_get = timed(partial(store.get, rep))
                                if landing is not None:
                                    verify(engine, landing, n_pages, name)
                                base = store.baseline(rep) if hasattr(store, "baseline") else None
                            except Exception as exc:  # noqa: BLE001 - the row says why
                                reasons[name] = f"failed during {what}: {_unavailable_reason(exc)}"
                                progress(f"{format_size(size)}: {name} {reasons[name]}")
                                stores.pop(name).close()
                                continue
                            if rep > 0:
                                samples[name][0].append(t_put)
                                samples[name][1].append(t_get)
                                if base is not None:
                                    copyto.setdefault(name, ([], []))
                                    copyto[name][0].append(base[0])
                                    copyto[name][1].append(base[1])
                finally:
                    for name, store in stores.items():
                        try:
                            store.close()
                        except Exception as exc:  # noqa: BLE001 - the figures are taken; say so and go on
                            log.warning("could not close %s cleanly: %s", name, exc)
                for system in chosen:
                    puts, gets = samples.get(system.name, ([], []))
                    if system.name in reasons or not puts:
                        rows.append(PeerRow(system.name, system.label, system.path, system.reference, system.version(),
                                            size, n_pages, reason=reasons.get(system.name, "no repetition finished")))
                    else:
                        base_puts, base_gets = copyto.get(system.name, ([], []))
                        rows.append(PeerRow(system.name, system.label, system.path, system.reference, system.version(),
                                            size, n_pages, median_rate(n_pages, size, puts), median_rate(n_pages, size, gets),
                                            copyto_put=median_rate(n_pages, size, base_puts) if base_puts else None,
                                            copyto_get=median_rate(n_pages, size, base_gets) if base_gets else None))
                del engine, sink
    finally:
        servers.close()
        shutil.rmtree(root, ignore_errors=True)
    return PeersResult(
        date=utc_now(),
        machine=machine_description(),
        reps=reps,
        batch=batch,
        rows=tuple(rows),
    )


# -- output --------------------------------------------------------------------------
COLUMNS = ("page", "system", "put GB/s", "get GB/s", "kvtier/peer put", "kvtier/peer get")


def table_rows(result: PeersResult) -> list[tuple[str, ...]]:
    out = []
    for r in result.rows:
        name = r.label + (f" [{r.version}]" if r.version else "")
        if not r.ran:
            out.append((format_size(r.page_bytes), name, "-", "-", "-", "-", f"not run: {r.reason}"))
            continue
        ratios = [result.ratio(r, op) for op in ("put", "get")]
        out.append((format_size(r.page_bytes), name, f"{r.put.gb_per_s:.2f}", f"{r.get.gb_per_s:.2f}",
                    *(f"{x:.2f}" if x is not None else "-" for x in ratios), ""))
    return out


def format_table(result: PeersResult) -> str:
    lines = [
        f"kvtier bench peers, {result.date}: {result.batch} pages per call or round trip, median of {result.reps}",
        f"machine  {describe_machine(result.machine)}",
        "",
    ]
    rows = [(*COLUMNS, "")] + table_rows(result)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for row in rows:
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append(("  ".join(cells) + ("  " + row[-1] if row[-1] else "")).rstrip())
    lines += ["", "GB/s = 10^9 bytes of KV per second; kvtier/peer = kvtier's throughput / the peer's (same pages, same run)"]
    for size in sorted({r.page_bytes for r in result.rows}):
        for op in ("put", "get"):
            peer = result.best_peer(size, op)
            if peer is not None and result.ratio(peer, op) is not None:
                lines.append(f"best peer {format_size(size)} {op}: {peer.label}, kvtier/peer {result.ratio(peer, op):.2f}")
    lines += copyto_lines(result)
    return "\n".join(lines)


def copyto_lines(result: PeersResult) -> list[str]:
    """kvtier's put and get against np.copyto of the same bytes, and the lane against gRPC."""
    out = []
    for size in sorted({r.page_bytes for r in result.rows}):
        row = result.kvtier(size)
        if row is None or row.copyto_put is None:
            continue
        target = COPYTO_TARGETS.get(size)
        cells = []
        for op in ("put", "get"):
            ratio = result.over_copyto(row, op)
            mark = "" if target is None else (" ok" if ratio >= target else " MISS")
            cells.append(f"{op} {ratio:.2f}{mark} ({getattr(row, 'copyto_' + op).gb_per_s:.2f} GB/s copyto)")
        lane = [result.lane_over_grpc(size, op) for op in ("put", "get")]
        lane_text = "" if None in lane else f"; lane/gRPC put {lane[0]:.2f} get {lane[1]:.2f}"
        out.append(f"kvtier / np.copyto {format_size(size)}: {', '.join(cells)}"
                   f"{'' if target is None else f' (target >= {target:g})'}{lane_text}")
    if out:
        out.insert(0, f"kvtier / np.copyto of the same bytes into and out of the same arena slots, "
                      f"{result.batch} pages per request:")
    return out


def format_markdown(result: PeersResult) -> str:
    lines = ["| page | system | put GB/s | get GB/s | kvtier/peer put | kvtier/peer get |", "|---|---|---:|---:|---:|---:|"]
    for row in table_rows(result):
        page, name, put, get, rput, rget, note = row
        if note:
            lines.append(f"| {page} | {name} | {note.replace('|', '/')} | | | |")
        else:
            lines.append(f"| {page} | {name} | {put} | {get} | {rput} | {rget} |")
    extra = copyto_lines(result)
    if extra:
        lines += [""] + [f"- {line}" if i else line for i, line in enumerate(extra)]
    return "\n".join(lines)
