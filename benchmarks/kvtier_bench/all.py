"""`kvtier bench all`: every benchmark in one run, written to one directory.

    section  what                                                       baseline (same run)
    tiers    host put/get and disk write/read through a Pool, and host  np.copyto; raw O_DIRECT
             put/get through a daemon subprocess and the client mapping pwrite/pread
    rpc      hot-call latency over the fast lane and gRPC (Lookup,      gRPC; a raw SEQPACKET echo
             Acquire+Release, acquire_prefix, Commit+Borrow); pages/s   of the same frame sizes; a
             with 1-8 client processes; host-hit latency while another  bare gRPC echo; the engine
             process loads from disk                                    alone
    peers    put/get of pages: kvtier next to Redis, Mooncake Store,    kvtier / peer
             LMCache's server and plain gRPC on loopback
    trace    block hit rate vs capacity on the Mooncake trace, lru and  infinite cache, offline
             prefix, one tier and host+disk                             Belady (one tier)
    cluster  put/get of pages through the cluster tier on a loopback    redis-py's pipelined
             Redis Cluster; the trace round-robin over two daemons,     SET/GET; the same daemons
             hit rate with --cluster                                    without --cluster
    node     hit rate of 4 engine processes on one node-wide daemon vs  4 private daemons
             4 private daemons with the same memory (Mooncake trace)    with round-robin
    e2e      time to first token on CPU: full prefill vs restored       full prefill
             from host and from disk (kvtier_bench.e2e)

Output, in `--out` (default benchmarks/results/<YYYY-MM-DD>/ under the current directory):
results.json (every figure, the machine, each section's time or error), results.md (the
tables and whether each target is met) and PNG plots (tiers.png, peers.png, trace.png,
e2e.png). A section that fails records its error and the others still run.
"""
from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier_bench.harness import KiB, MiB, default_out, describe_machine, format_size, machine_description

SECTIONS = ("tiers", "rpc", "peers", "trace", "cluster", "node", "e2e")
#: Page sizes of the tiers and peers sections: a per-layer vLLM block of Llama-3-8B
#: (16 tokens x 8 KV heads x 128 x K/V x fp16), a Llama-3.2-1B page and a Llama-3-8B page.
PAGE_SIZES = (64 * KiB, 256 * KiB, 2 * MiB)
TARGETS = {
    "host": 0.9,  # tiers: host put/get >= 0.9 x np.copyto
    "disk": 0.8,  # tiers: disk write/read >= 0.8 x raw O_DIRECT
    "rpc": 1.3,  # rpc: gRPC stubs median latency <= 1.3 x a gRPC echo
    "lane_over_grpc": 0.1,  # rpc: lane p50 <= 0.1 x the same call over gRPC
    "lane_over_echo": 15.0,  # rpc: lane p50 <= 15 x a raw SEQPACKET echo of the same frame sizes
    "page_ops": 500_000,  # rpc: page operations/s with 4 client processes over the lane
    "peers": 3.0,  # peers: kvtier >= 3 x the best peer, put and get of 2 MiB pages
    "cluster": 0.8,  # cluster: the cluster tier's put/get >= 0.8 x redis-py's SET/GET on the same cluster
}


@dataclass(frozen=True)
class Settings:
    """How big each section runs; `for_mode` gives the full and --quick settings, tests shrink them."""

    page_sizes: tuple[int, ...] = PAGE_SIZES
    tiers_pages: int | None = None  # None: the tiers default (1 GiB, 64 MiB quick) worth per size
    tiers_reps: int = 5
    rpc_iterations: int = 1000
    rpc_keys: int = 64
    rpc_processes: tuple[int, ...] = (1, 2, 4, 8)  # () leaves the throughput table out
    rpc_seconds: float = 2.0
    rpc_interference: bool = True
    peers_pages: int | None = None  # None: the peers default (1 GiB, 256 MiB quick) worth per size
    peers_reps: int | None = None
    peers_systems: tuple[str, ...] | None = None  # None: every system
    trace_path: str | None = None
    trace_capacities: tuple[int, ...] | None = None  # None: the trace default for the mode
    trace_limit: int | None = None
    cluster_page_sizes: tuple[int, ...] = (256 * KiB, 2 * MiB)
    cluster_pages: int | None = None  # None: the cluster default (256 MiB, 64 MiB quick) worth per size
    cluster_reps: int | None = None
    cluster_requests: int | None = 1000  # of the trace (trace_path), round-robin over two daemons; None: all
    node_requests: int | None = None  # of the trace (trace_path) over 4 engines; None: all
    node_fractions: tuple[float, ...] = (0.25,)  # one capacity here; `kvtier bench node` sweeps three
    e2e_kwargs: dict = field(default_factory=dict)
    directory: str | None = None  # disk benchmarks' directory (default /var/tmp)

    @classmethod
    def for_mode(cls, quick: bool) -> Settings:
        if quick:
            return cls(tiers_reps=5, rpc_iterations=300, rpc_seconds=1.0, node_requests=3000)
        return cls()


def _section_tiers(s: Settings, quick: bool, progress) -> tuple[dict, str, object]:
    from kvtier_bench.procs import render_procs, run_procs
    from kvtier_bench.tiers import format_table, run_tiers

    result = run_tiers(s.page_sizes, pages=s.tiers_pages, quick=quick, reps=s.tiers_reps, directory=s.directory,
                       through_daemon=True, progress=progress)
    # Put and get by 1, 2 and 4 client processes against a cold copy (what `tiers --daemon` adds).
    processes = run_procs(pages=s.tiers_pages, quick=quick, directory=s.directory, progress=progress)
    data = {**result.as_dict(), "processes": processes}
    return data, "```\n" + format_table(result) + "\n\n" + render_procs(processes) + "\n```", result


def _section_rpc(s: Settings, quick: bool, progress) -> tuple[dict, str, object]:
    from kvtier_bench.rpc import render_all, run_rpc

    progress(f"rpc: {s.rpc_iterations} calls per measurement, {s.rpc_keys} keys per call")
    result = run_rpc(s.rpc_iterations, s.rpc_keys, processes=s.rpc_processes, seconds=s.rpc_seconds,
                     interference=s.rpc_interference, directory=s.directory, progress=progress)
    return result, "```\n" + render_all(result) + "\n```", result


def _section_peers(s: Settings, quick: bool, progress) -> tuple[dict, str, object]:
    from kvtier_bench.peers.bench import SYSTEM_NAMES, format_markdown, run_peers

    result = run_peers(s.page_sizes, pages=s.peers_pages, quick=quick, reps=s.peers_reps,
                       systems=s.peers_systems or SYSTEM_NAMES, progress=progress)
    note = (f"{result.batch} pages per call or round trip; median of {result.reps} repetitions after one untimed "
            "round; kvtier/peer = kvtier's throughput / the peer's, same pages, same run. Peers and how each "
            "moves the bytes: docs/benchmarks.md.")
    lines = [format_markdown(result), "", note]
    return result.as_dict(), "\n".join(lines), result


def _section_trace(s: Settings, quick: bool, progress) -> tuple[dict, str, object]:
    from kvtier_bench.trace import DEFAULT_TRACE, format_markdown, run_trace

    result = run_trace(s.trace_path or DEFAULT_TRACE, capacities=s.trace_capacities, quick=quick,
                       limit=s.trace_limit, progress=progress)
    return result.as_dict(), format_markdown(result), result


def _section_cluster(s: Settings, quick: bool, progress) -> tuple[dict, str, object]:
    from kvtier_bench import cluster

    missing = cluster.server_missing()
    if missing:  # like a peer that is not installed: the reason instead of figures
        progress(f"cluster: does not run: {missing}")
        return {"ran": False, "reason": missing}, f"Did not run: {missing}.", None
    result = cluster.run_cluster(s.cluster_page_sizes, pages=s.cluster_pages, reps=s.cluster_reps, quick=quick,
                                 trace=s.trace_path or cluster.DEFAULT_TRACE, requests=s.cluster_requests,
                                 directory=s.directory, progress=progress)
    return {"ran": True, **result.as_dict()}, cluster.format_markdown(result), result


def _section_node(s: Settings, quick: bool, progress) -> tuple[dict, str, object]:
    from kvtier_bench.node import DEFAULT_TRACE, run_node
    from kvtier_bench.node_report import format_markdown

    result = run_node(s.trace_path or DEFAULT_TRACE, requests=s.node_requests, fractions=s.node_fractions,
                      directory=s.directory, progress=progress)
    return result.as_dict(), format_markdown(result), result


def _section_e2e(s: Settings, quick: bool, progress) -> tuple[dict, str, object]:
    from kvtier_bench import e2e  # torch and transformers: imported only when this section runs

    result = e2e.run_e2e(quick=quick, progress=progress, **s.e2e_kwargs)
    return result.as_dict(), e2e.format_table(result), result


RUNNERS: dict[str, Callable[[Settings, bool, Callable[[str], None]], tuple[dict, str, object]]] = {
    "tiers": _section_tiers,
    "rpc": _section_rpc,
    "peers": _section_peers,
    "trace": _section_trace,
    "cluster": _section_cluster,
    "node": _section_node,
    "e2e": _section_e2e,
}


# -- targets ----------------------------------------------------------------------
def targets(sections: dict[str, dict]) -> list[dict]:
    """Every stated target, measured or not: {"section", "what", "target", "measured", "met"}."""
    out: list[dict] = []

    def add(section: str, what: str, target: str, measured: float | None, met: bool | None, note: str = "") -> None:
        out.append({"section": section, "what": what, "target": target, "measured": measured, "met": met,
                    **({"note": note} if note else {})})

    tiers = sections.get("tiers", {}).get("result")
    if tiers:
        for r in tiers["results"]:
            kind = "host" if r["op"].startswith("host") else "disk"
            want = TARGETS[kind]
            add("tiers", f"{r['page_size']} {r['op']}", f">= {want} x {r['baseline']['name']}", r["ratio"],
                r["ratio"] >= want)
    for t in (tiers or {}).get("processes", {}).get("targets", []):
        add("tiers", f"{t['page_bytes'] // 1024} KiB {t['op']}, {t['processes']} client processes",
            f">= {t['target']} x a cold copy", t["measured"], t["met"])
    rpc = sections.get("rpc", {}).get("result")
    if rpc:
        for call in rpc["latency"]["calls"]:
            if call["name"] not in ("lookup", "acquire_release"):
                continue
            for key, what in (("lane_over_grpc", "gRPC"), ("lane_over_echo", "raw echo")):
                if call.get(key) is not None:
                    add("rpc", f"{call['label']} lane p50", f"<= {TARGETS[key]:g} x {what}", call[key],
                        call[key] <= TARGETS[key])
            if call.get("stubs_over_grpc_echo") is not None:
                add("rpc", f"{call['label']} gRPC stubs p50", f"<= {TARGETS['rpc']} x gRPC echo",
                    call["stubs_over_grpc_echo"], call["stubs_over_grpc_echo"] <= TARGETS["rpc"])
        lane4 = next((r for r in rpc.get("clients", {}).get("rounds", [])
                      if r["transport"] == "lane" and r["processes"] == 4), None)
        if lane4 is not None:
            add("rpc", "page ops/s, 4 processes, lane", f">= {TARGETS['page_ops']:,}", lane4["page_ops_per_s"],
                lane4["page_ops_per_s"] >= TARGETS["page_ops"])
    peers = sections.get("peers", {}).get("result")
    if peers:
        for op in ("put", "get"):
            best = peers["best_peer"].get(f"{format_size(2 * MiB)} {op}")
            if best is None or best.get("kvtier_over_peer") is None:
                add("peers", f"2 MiB {op}", f">= {TARGETS['peers']} x best peer", None, None, "no peer ran")
            else:
                ratio = best["kvtier_over_peer"]
                add("peers", f"2 MiB {op} vs {best['system']}", f">= {TARGETS['peers']} x best peer", ratio,
                    ratio >= TARGETS["peers"])
    if peers:
        for row in peers["rows"]:
            want = peers.get("copyto_targets", {}).get(row["page_size"])
            if row["system"] != "kvtier" or want is None:
                continue
            for op in ("put", "get"):
                ratio = row.get(f"over_copyto_{op}")
                add("peers", f"{row['page_size']} kvtier {op}, {peers['batch']} pages/request", f">= {want} x np.copyto",
                    ratio, None if ratio is None else ratio >= want)
    cluster = sections.get("cluster", {}).get("result")
    if cluster and cluster.get("ran"):
        for row in cluster["pages"]:
            for op in ("put", "get"):
                ratio = row[f"ratio_{op}"]
                add("cluster", f"{row['page_size']} tier {op}", f">= {TARGETS['cluster']} x redis-py", ratio,
                    ratio >= TARGETS["cluster"])
    e2e = sections.get("e2e", {}).get("result")
    if e2e:
        for t in e2e.get("targets", []):
            add("e2e", f"{t['tokens']:,} tokens from {t['path']}", f">= {t['target']:g}x speed-up", t["speedup"],
                t["met"])
    return out


# -- plots --------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tiers(result: dict, path: Path) -> None:
    """Ratio tier / baseline per op, grouped by page size, with the targets as lines."""
    plt = _pyplot()
    rows = result["results"]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    sizes = list(dict.fromkeys(r["page_size"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(sizes))
    for k, size in enumerate(sizes):
        ys = [next((r["ratio"] for r in rows if r["op"] == op and r["page_size"] == size), 0) for op in ops]
        xs = [i + (k - (len(sizes) - 1) / 2) * width for i in range(len(ops))]
        bars = ax.bar(xs, ys, width, label=size)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(TARGETS["host"], color="tab:green", linestyle="--", linewidth=1, label=f"host target {TARGETS['host']}")
    ax.axhline(TARGETS["disk"], color="tab:red", linestyle=":", linewidth=1, label=f"disk target {TARGETS['disk']}")
    ax.set_xticks(range(len(ops)), [op.replace(" (client)", "\n(daemon+client)") for op in ops], fontsize=8)
    ax.set_ylabel("throughput / baseline (same run)")
    ax.set_title("kvtier tiers vs the raw operation under them")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_peers(result: dict, path: Path) -> None:
    """GB/s of put and get per system, grouped by page size (systems that did not run are absent)."""
    plt = _pyplot()
    rows = [r for r in result["rows"] if r["ran"]]
    systems = list(dict.fromkeys(r["label"] for r in rows))
    sizes = list(dict.fromkeys(r["page_size"] for r in result["rows"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    width = 0.8 / max(1, len(systems))
    for ax, op in zip(axes, ("put", "get")):
        for k, system in enumerate(systems):
            ys = [next((r[op]["gb_per_s"] for r in rows if r["label"] == system and r["page_size"] == size), 0)
                  for size in sizes]
            xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(sizes))]
            ax.bar(xs, ys, width, label=system)
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_title(f"{op}: engine buffer {'->' if op == 'put' else '<-'} store")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s (10^9 bytes of KV per second)")
    missing = sorted({r["label"] for r in result["rows"] if not r["ran"]})
    title = "kvtier and its peers on loopback, same pages, same run"
    if missing:
        title += f" (did not run: {', '.join(missing)})"
    fig.suptitle(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_e2e(result: dict, path: Path) -> None:
    """TTFT per prompt length: full prefill, restored from host, restored from disk."""
    plt = _pyplot()
    rows = result["rows"]
    paths = (("full", "full prefill"), ("host", "restored from host"), ("disk", "restored from disk"))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    width = 0.8 / len(paths)
    for k, (key, label) in enumerate(paths):
        ys = [r[key]["ttft_seconds"] * 1e3 for r in rows]
        xs = [i + (k - 1) * width for i in range(len(rows))]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(rows)), [f"{r['tokens']:,} tokens" for r in rows])
    ax.set_ylabel("time to first token, ms")
    ax.set_title(f"TTFT on CPU, {result.get('model_description', 'e2e model')}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot(name: str, data: dict, obj: object, out: Path) -> str | None:
    file = out / f"{name}.png"
    if name == "tiers":
        plot_tiers(data, file)
    elif name == "peers":
        plot_peers(data, file)
    elif name == "trace":
        from kvtier_bench.trace import plot

        plot(obj, file)
    elif name == "e2e":
        plot_e2e(data, file)
    else:
        return None
    return file.name


# -- the run -------------------------------------------------------------------------
def run_all(
    out: str | os.PathLike | None = None,
    *,
    quick: bool = False,
    sections: Sequence[str] = SECTIONS,
    settings: Settings | None = None,
    command: str | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    """Run `sections` in order, write results.json, results.md and the plots into `out`, and
    return what results.json holds."""
    unknown = [s for s in sections if s not in RUNNERS]
    if unknown:
        raise ValueError(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    settings = settings or Settings.for_mode(quick)
    started = datetime.datetime.now(datetime.timezone.utc)
    out_dir = Path(out) if out is not None else default_out(started)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    machine = machine_description(settings.directory)
    progress(f"machine: {describe_machine(machine)}")
    results: dict[str, dict] = {}
    objects: dict[str, object] = {}
    for name in sections:
        progress(f"section {name}: starting ({time.perf_counter() - t0:.0f} s since start)")
        start = time.perf_counter()

        def section_progress(message: str, _name: str = name) -> None:
            progress(f"{_name}: {message}" if not message.startswith(f"{_name}:") else message)

        if hasattr(progress, "bar"):  # the sections' bars (progress_bar) on the run's terminal
            section_progress.bar = progress.bar  # type: ignore[attr-defined]

        try:
            data, markdown, obj = RUNNERS[name](settings, quick, section_progress)
        except Exception as exc:  # noqa: BLE001 - a failing section is recorded and the rest still runs
            results[name] = {"ok": False, "seconds": time.perf_counter() - start,
                             "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            progress(f"section {name}: FAILED after {time.perf_counter() - start:.0f} s: {type(exc).__name__}: {exc}")
            continue
        entry = {"ok": True, "seconds": time.perf_counter() - start, "result": data, "markdown": markdown}
        try:
            entry["plot"] = _plot(name, data, obj, out_dir)
        except Exception as exc:  # noqa: BLE001 - the figures still count without their picture
            entry["plot_error"] = f"{type(exc).__name__}: {exc}"
        results[name] = entry
        objects[name] = obj
        progress(f"section {name}: done in {entry['seconds']:.0f} s")
    document = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "command": command or "kvtier bench all" + (" --quick" if quick else ""),
        "quick": quick,
        "seconds": time.perf_counter() - t0,
        "machine": machine,
        "sections": {name: {k: v for k, v in entry.items() if k != "markdown"} for name, entry in results.items()},
        "targets": targets(results),
    }
    (out_dir / "results.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    (out_dir / "results.md").write_text(render_markdown(document, results))
    progress(f"wrote {out_dir}/results.json, results.md and the plots in {document['seconds']:.0f} s")
    return document


SECTION_TITLES = {
    "tiers": "Tiers: kvtier vs the raw operation under it",
    "rpc": "RPC: hot calls over the fast lane and gRPC, vs raw echoes; many clients; interference",
    "peers": "Peers: kvtier vs Redis, Mooncake Store, LMCache and plain gRPC",
    "trace": "Trace: block hit rate vs capacity (Mooncake conversation trace)",
    "cluster": "Cluster: the cluster tier vs redis-py; two nodes' hit rate with and without it",
    "node": "Node: one node-wide daemon vs one daemon per engine, same memory (Mooncake trace)",
    "e2e": "End to end: time to first token on CPU",
}


def render_markdown(document: dict, results: dict[str, dict]) -> str:
    m = document["machine"]
    lines = [
        f"# `{document['command']}`, {document['date']}",
        "",
        (f"Machine: {describe_machine(m)}. /dev/shm: {m.get('shm_filesystem')}. Every figure is a ratio against "
         "a baseline measured in the same run; absolute rates depend on the machine."),
        f"Total time: {document['seconds']:.0f} s.",
        "",
        "## Targets",
        "",
        "| section | what | target | measured | met |",
        "|---|---|---|---:|---|",
    ]
    for t in document["targets"]:
        measured = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        lines.append(f"| {t['section']} | {t['what']} | {t['target']} | {measured} | {met} |")
    for name, entry in results.items():
        lines += ["", f"## {SECTION_TITLES.get(name, name)}", ""]
        if not entry["ok"]:
            lines.append(f"Did not run: `{entry['error']}`")
            continue
        lines.append(entry["markdown"])
        if entry.get("plot"):
            lines += ["", f"![{name}]({entry['plot']})"]
        elif entry.get("plot_error"):
            lines += ["", f"(no plot: {entry['plot_error']})"]
        lines.append(f"\n_{entry['seconds']:.0f} s_")
    return "\n".join(lines) + "\n"
