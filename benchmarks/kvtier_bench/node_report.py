"""`kvtier bench node`'s result as people read it: a table (terminal or Markdown), the notes
that say what was measured, and a plot of hit rate against capacity per setup."""
from __future__ import annotations

import json
from pathlib import Path

from kvtier_bench.harness import describe_machine, format_size
from kvtier_bench.internals import TRACE_BLOCK_TOKENS
from kvtier_bench.node import ENGINES, NodeResult
from kvtier_bench.node_engine import LAYOUT

COLUMNS = ("capacity", "setup", "daemons x pages", "hit rate", "x private", "ceiling", "prefill tokens saved",
           "lost", "requests/engine", "seconds")


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def rows(result: NodeResult) -> list[list[str]]:
    """One row per capacity and setup, cells as COLUMNS."""
    out = []
    for p in result.points:
        for r in p.runs:
            ratio = p.ratio(r.setup)
            pages = f"{r.daemons} x {r.host_pages:,}" + (f" + {r.disk_pages:,} disk" if r.disk_pages else "")
            out.append([f"{p.fraction:.0%} ({p.shared_host_pages:,} pages)", r.setup, pages, f"{r.hit_rate:.4f}",
                        "-" if ratio is None else f"{ratio:.2f}", f"{r.ceiling:.4f}", _tokens(r.tokens_saved),
                        f"{r.lost:,}", "/".join(str(e.requests) for e in r.engines), f"{r.seconds:.1f}"])
    return out


def notes(result: NodeResult) -> list[str]:
    policy = result.policy or "the daemon's default"
    disk = (f", and a disk tier of {result.disk_factor} x its host pages" if result.disk_factor else ", no disk tier")
    return [
        (f"{result.requests:,} requests of {result.trace} in time order, {result.blocks:,} blocks of "
         f"{TRACE_BLOCK_TOKENS} tokens looked up, {result.distinct_blocks:,} distinct; one cache that never evicts: "
         f"{result.infinite:.4f}."),
        (f"{ENGINES} engine processes, one request in flight each; capacity = the shared daemon's host pages as a "
         f"share of the distinct blocks, each private daemon a quarter of them{disk}; pages of "
         f"{format_size(LAYOUT.page_bytes)}; policy: {policy}."),
        ("hit rate = blocks hit / blocks looked up (per request, the leading blocks the daemon's lookup found and its "
         "acquire then got); x private = over the private daemons' with round-robin at the same capacity; "
         "ceiling = the same routing with caches that never evict; prefill tokens saved = blocks hit x "
         f"{TRACE_BLOCK_TOKENS}; lost = blocks a lookup found that were evicted before their acquire; seconds = "
         "first request sent to last answer in."),
        *(["blocks hit in host / disk: " + "; ".join(
            f"{p.fraction:.0%} {r.setup} {r.hits_by_tier.get('host', 0):,} / {r.hits_by_tier.get('disk', 0):,}"
            for p in result.points for r in p.runs)] if result.disk_factor else []),
    ]


def _table(cells: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in cells]


def format_table(result: NodeResult) -> str:
    lines = [f"kvtier bench node, {result.date}", describe_machine(result.machine), ""]
    return "\n".join(lines + _table([list(COLUMNS), *rows(result)]) + [""] + notes(result))


def format_markdown(result: NodeResult) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---|---|---|" + "---:|" * (len(COLUMNS) - 3)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(result)]
    return "\n".join(lines + [""] + notes(result))


def plot(result: NodeResult, path: str | Path) -> None:
    """Hit rate against capacity, one line per setup, with its ceiling dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    xs = [p.fraction * 100 for p in result.points]
    for k, setup in enumerate(dict.fromkeys(r.setup for p in result.points for r in p.runs)):
        runs = [p.run(setup) for p in result.points]
        color = f"C{k}"
        ax.plot(xs, [r.hit_rate if r else None for r in runs], marker="o", color=color, label=setup)
        ax.axhline(runs[0].ceiling, color=color, linestyle=":", linewidth=1, label=f"{setup}, never evicting")
    ax.set_xlabel("host pages of all daemons, % of the trace's distinct blocks")
    ax.set_ylabel("block hit rate")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{ENGINES} engines on one node: one shared daemon vs one per engine (Mooncake trace)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(result: NodeResult, stem: str | Path) -> list[Path]:
    """STEM.json (every figure), STEM.md (the table and notes) and STEM.png; returns the paths."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md"), stem.with_suffix(".png")]
    paths[0].write_text(json.dumps(result.as_dict(), indent=1) + "\n")
    paths[1].write_text(f"# `kvtier bench node`, {result.date}\n\nMachine: {describe_machine(result.machine)}.\n\n"
                        + format_markdown(result) + f"\n\n![node]({paths[2].name})\n")
    plot(result, paths[2])
    return paths
