"""End-to-end benchmark: time to first token with and without kvtier, on CPU.

A randomly initialised Llama (default: hidden 512, 8 layers, 8 attention heads, 4 KV heads,
float32; no download) answers the same prompt three ways, for each prompt length:

    path            what is timed (TTFT: from having the prompt to the first token's logits)
    full prefill    forward over the whole prompt into an empty DynamicCache
    host restore    lookup + plan + acquire (pages already in the host tier) + copy into a
                    DynamicCache + forward over the suffix (the tokens after the last cached
                    block, at least the last prompt token)
    disk restore    the same, after every cached page was pushed out of the host tier, so the
                    acquire promotes each page from the disk tier first

The prompt's KV is stored once after the full prefill (not timed), and restored once untimed
(the process's first forward over a long cache pays for growing its heap, which a serving
engine paid long before; a first full prefill shows no such cost). Restores go through a real
`kvtier serve` subprocess and the real client (`kvtier_client.integrations.hf.HFPrefixCache`
with its load planner, which has seen the measured full prefill). Before each disk restore a
borrow of the whole host tier demotes every cached page (write-back) and the slab files'
page cache is dropped, so the pages come from the disk. Every restored run's next-token
logits are compared with the full prefill's (max abs difference). The speed-up is full
prefill TTFT / restore TTFT; figures are medians over repetitions. Nothing here asserts a speed.

The heap: by default glibc is asked (mallopt) to serve allocations up to 32 MiB from its heap
and to keep freed memory, as a long-running engine's process effectively does. Otherwise
every forward maps fresh memory for DynamicCache's concatenations and faults it in page by
page, which on a busy VM makes a 1-token forward over a 4,096-token cache vary from 30 ms
to 600 ms. It applies to every path alike; `keep_heap=False` (--glibc-heap) measures with
glibc's defaults.
"""
from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import click

from kvtier_bench.harness import (
    bench_dir,
    filesystem_of,
    format_size,
    machine_info,
    progress_bar,
    progress_lines,
    utc_now,
)
from kvtier_bench.internals import ChildDaemon, open_direct

DEFAULT_LENGTHS = (2048, 4096, 8192)
QUICK_LENGTHS = (2048, 4096)
DEFAULT_REPS = 3
#: The prompt length the targets are stated at, and the targets (speed-ups over full prefill).
TARGET_TOKENS = 4096
TARGETS = {"host": 10.0, "disk": 5.0}
#: Pause between demoting the pages and reading them back from disk.
DISK_SETTLE_S = 1.0
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
NAMESPACE = "bench/e2e"
#: The daemon's host arenas are /dev/shm/<ARENA_PREFIX><our pid>-<random>.
ARENA_PREFIX = "kvtier-bench-e2e-"


@dataclass(frozen=True)
class ModelSpec:
    """The random-init Llama the benchmark runs (its shape decides the page size)."""

    hidden_size: int = 512
    layers: int = 8
    attention_heads: int = 8
    kv_heads: int = 4
    intermediate_size: int = 1408
    vocab_size: int = 32000
    block_tokens: int = 16
    dtype: str = "float32"

    def describe(self) -> str:
        return (f"random-init Llama, hidden {self.hidden_size}, {self.layers} layers, {self.attention_heads} heads, "
                f"{self.kv_heads} KV heads, MLP {self.intermediate_size}, vocab {self.vocab_size:,}, {self.dtype}")

    def build(self, max_positions: int, seed: int = 0):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.layers, num_attention_heads=self.attention_heads,
            num_key_value_heads=self.kv_heads, max_position_embeddings=max(max_positions, 2048),
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).to(getattr(torch, self.dtype)).eval()


@dataclass(frozen=True)
class PathResult:
    """One way to the first token at one prompt length; times are medians over repetitions."""

    ttft_seconds: float
    load_seconds: float  # restore: lookup + plan + acquire + copy into the cache (0 for full prefill)
    prefill_seconds: float  # forward over the tokens not restored
    restored_tokens: int
    cached_blocks: int
    host_blocks: int  # restored blocks the lookup found in host
    disk_blocks: int  # restored blocks the lookup found only on disk
    promoted: int  # pages the acquire loaded from disk
    max_abs_diff: float  # next-token logits vs the full prefill's (0 for full prefill itself)
    plan: str  # the planner's reason
    samples: tuple[float, ...] = field(default=())  # every repetition's TTFT

    def as_dict(self) -> dict:
        d = asdict(self)
        d["samples"] = list(self.samples)
        return d


@dataclass(frozen=True)
class LengthResult:
    tokens: int
    full: PathResult
    host: PathResult
    disk: PathResult
    stored_blocks: int
    store_seconds: float

    def speedup(self, path: str) -> float:
        """Full prefill TTFT / the path's TTFT."""
        return self.full.ttft_seconds / max(getattr(self, path).ttft_seconds, 1e-12)

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "full": self.full.as_dict(),
            "host": self.host.as_dict(),
            "disk": self.disk.as_dict(),
            "speedup_host": self.speedup("host"),
            "speedup_disk": self.speedup("disk"),
            "stored_blocks": self.stored_blocks,
            "store_seconds": self.store_seconds,
        }


@dataclass(frozen=True)
class E2EResult:
    date: str
    machine: dict
    model: ModelSpec
    page_bytes: int
    reps: int
    planner: str
    keep_heap: bool  # glibc asked to keep freed memory (see the module docstring)
    directory: str
    filesystem: str
    direct_io: bool
    host_bytes: int
    disk_bytes: int
    rows: tuple[LengthResult, ...]

    def targets(self) -> list[dict]:
        """The stated targets, at TARGET_TOKENS, where that length was measured."""
        out = []
        for row in self.rows:
            if row.tokens == TARGET_TOKENS:
                for path, want in TARGETS.items():
                    got = row.speedup(path)
                    out.append({"tokens": row.tokens, "path": path, "target": want, "speedup": got, "met": got >= want})
        return out

    @property
    def notes(self) -> list[str]:
        notes = []
        fstype = self.filesystem.split()[0]
        if fstype in ("tmpfs", "ramfs"):
            notes.append(f"{self.directory} is on {fstype}: the disk restores read memory, not a disk")
        elif not self.direct_io:
            notes.append(f"{self.directory} ({self.filesystem}) refuses O_DIRECT: the disk tier reads through the page "
                         "cache (dropped with fadvise before each disk restore)")
        if self.machine.get("load_average", [0.0])[0] > 0.5 * self.machine.get("nproc", 1):
            notes.append("other processes were using the CPUs before the run (load average): the suffix forward, "
                         "many small multi-threaded torch ops, suffers most from that, so speed-ups read low")
        if self.machine.get("cuda"):
            notes.append("the model ran on CPU even though CUDA is present")
        return notes

    def as_dict(self) -> dict:
        return {
            "date": self.date,
            "machine": self.machine,
            "model": asdict(self.model),
            "model_description": self.model.describe(),
            "page_bytes": self.page_bytes,
            "reps": self.reps,
            "planner": self.planner,
            "keep_heap": self.keep_heap,
            "dir": self.directory,
            "filesystem": self.filesystem,
            "direct_io": self.direct_io,
            "host_bytes": self.host_bytes,
            "disk_bytes": self.disk_bytes,
            "rows": [r.as_dict() for r in self.rows],
            "targets": self.targets(),
            "notes": self.notes,
        }


# -- the daemon -------------------------------------------------------------------
def _drop_page_cache(cache_dir: str) -> None:
    """Drop the disk tier's clean pages from the page cache (a no-op where it uses O_DIRECT)."""
    for path in glob.glob(os.path.join(cache_dir, "**", "slab.bin"), recursive=True):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _direct_io_works(directory: str) -> bool:
    path = os.path.join(directory, f".direct-probe-{uuid.uuid4().hex[:8]}")
    try:
        fd, direct = open_direct(path, os.O_RDWR | os.O_CREAT)
        os.close(fd)
        return bool(direct)
    except OSError:
        return False
    finally:
        if os.path.exists(path):
            os.unlink(path)


# -- measurement ------------------------------------------------------------------
def _path_result(runs: list[dict]) -> PathResult:
    """Median over repetitions; the counts come from the median run (they are equal anyway)."""
    ordered = sorted(runs, key=lambda r: r["ttft"])
    mid = ordered[(len(ordered) - 1) // 2]
    return PathResult(
        ttft_seconds=statistics.median(r["ttft"] for r in runs),
        load_seconds=statistics.median(r["load"] for r in runs),
        prefill_seconds=statistics.median(r["prefill"] for r in runs),
        restored_tokens=mid["tokens"], cached_blocks=mid["cached"], host_blocks=mid["host"], disk_blocks=mid["disk"],
        promoted=mid["promoted"], max_abs_diff=max(r["diff"] for r in runs), plan=mid["plan"],
        samples=tuple(r["ttft"] for r in runs),
    )


def run_e2e(
    *,
    lengths: Sequence[int] | None = None,
    quick: bool = False,
    progress: Callable[[str], None] = lambda message: None,
    model: ModelSpec | None = None,
    reps: int | None = None,
    directory: str | None = None,
    load_all: bool = False,
    threads: int | None = None,
    keep_heap: bool = True,
    seed: int = 0,
) -> E2EResult:
    """Run the benchmark. `lengths` default to 2048, 4096, 8192 tokens (2048 and 4096 with
    `quick`); `reps` to 3 (1 with `quick`); `model` to the default ModelSpec; `directory`
    holds the daemon's disk tier (a temporary subdirectory, removed afterwards; default
    /var/tmp, a real disk). `load_all` restores every cached block instead of asking the
    load planner (which, fed the measured prefill, declines blocks slower to load than to
    recompute: on a tiny model that can be all of them). `threads` sets torch's intra-op
    threads for the run (default: torch's own choice), for every path alike. `keep_heap`:
    see the module docstring."""
    import torch

    spec = model or ModelSpec()
    lengths = tuple(dict.fromkeys(lengths or (QUICK_LENGTHS if quick else DEFAULT_LENGTHS)))
    reps = reps if reps is not None else (1 if quick else DEFAULT_REPS)
    if reps <= 0:
        raise ValueError("reps must be positive")
    B = spec.block_tokens
    for n in lengths:
        if n <= B:
            raise ValueError(f"prompt length {n} must exceed one block ({B} tokens): only full blocks are cached")
    if threads is not None and threads <= 0:
        raise ValueError("threads must be positive")
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    kept = _keep_heap(True) if keep_heap else False
    try:
        return _run(spec, lengths, reps, directory, load_all, seed, kept, progress)
    finally:
        torch.set_num_threads(saved_threads)
        if kept:
            _keep_heap(False)


#: mallopt parameters (glibc malloc.h) and glibc's defaults for them.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_DEFAULT_TRIM, _DEFAULT_MMAP = 128 * 1024, 128 * 1024


def _keep_heap(keep: bool) -> bool:
    """Ask glibc to serve allocations up to 32 MiB from the heap and keep up to 1 GiB freed
    (or, with keep=False, back to its default figures). False where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mmap_at, trim_at = (32 << 20, 1 << 30) if keep else (_DEFAULT_MMAP, _DEFAULT_TRIM)
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_at) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_at) == 1)


def _run(spec: ModelSpec, lengths: tuple[int, ...], reps: int, directory: str | None, load_all: bool, seed: int,
         keep_heap: bool, progress: Callable[[str], None]) -> E2EResult:
    import torch
    import transformers
    from kvtier_client import KVTierClient
    from kvtier_client.integrations.hf import HFPrefixCache, LoadEverything, page_layout
    from kvtier_client.integrations.planner import Planner

    B = spec.block_tokens
    load_before = os.getloadavg()[0]
    progress(f"building {spec.describe()}")
    net = spec.build(max(lengths), seed)
    layout = page_layout(net, block_tokens=B)
    # The host tier holds the longest prefix twice over (the helper acquires in batches of at
    # most half the host tier, so it is one acquire); the disk tier every length's prefix twice.
    max_blocks = max(lengths) // B
    host_bytes = (2 * max_blocks + 8) * layout.slot_bytes
    disk_bytes = (2 * sum(n // B for n in lengths) + 16) * layout.slot_bytes
    parent = bench_dir(directory)
    root = tempfile.mkdtemp(prefix="kvtier-bench-e2e-", dir=parent)
    rows: list[LengthResult] = []
    planner_name = "LoadEverything" if load_all else "Planner (measured prefill rate and tier bandwidths)"
    try:
        direct = _direct_io_works(root)
        daemon = ChildDaemon(
            root, host_size=host_bytes, disk_size=disk_bytes, arena_prefix=f"{ARENA_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}",
            extra=("--write-back", "--session-timeout", "30s"),
        )
        try:
            daemon.wait_serving(START_TIMEOUT)
            progress(f"daemon serving at {daemon.socket}: host tier {format_size(host_bytes)}, "
                     f"disk tier {format_size(disk_bytes)} under {parent}")
            with KVTierClient(daemon.target) as kv, torch.no_grad():
                planner = LoadEverything() if load_all else Planner(kv)
                cache = HFPrefixCache(kv, net, namespace=NAMESPACE, planner=planner)
                # Warm-up, as in an engine that has served before: the model (a prefill, a forward
                # on top of a cache) and every call of the restore path on both sides (store,
                # lookup, the planner's first Stats, acquire), on a prompt of its own.
                # (A helper of its own, so the planner's prefill rate is fed by the real prompts only.)
                warm = HFPrefixCache(kv, net, namespace=NAMESPACE, planner=LoadEverything())
                warm_ids = (torch.arange(3 * B + 1).unsqueeze(0) * 7919) % spec.vocab_size
                warm.prefill(warm_ids[:, : 2 * B + 1])
                warm.prefill(warm_ids)
                if isinstance(planner, Planner):
                    planner.bandwidth()
                generator = torch.Generator().manual_seed(seed)
                # Per length: `reps` full prefills, one warm-up restore, `reps` from host and from disk.
                with progress_bar(progress, "e2e prefills and restores", len(lengths) * (3 * reps + 1)) as advance:
                    for n in lengths:
                        ids = torch.randint(0, spec.vocab_size, (1, n), generator=generator)
                        rows.append(_one_length(n, ids, net, cache, kv, daemon, reps, progress, advance))
        finally:
            daemon.stop(STOP_TIMEOUT)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    machine = machine_info()
    machine.update(
        torch=torch.__version__, transformers=transformers.__version__, torch_threads=torch.get_num_threads(),
        cuda=bool(torch.cuda.is_available()), load_average=[load_before, os.getloadavg()[0]],
    )
    return E2EResult(
        date=utc_now(),
        machine=machine, model=spec, page_bytes=layout.page_bytes, reps=reps, planner=planner_name, keep_heap=keep_heap,
        directory=parent, filesystem=filesystem_of(parent), direct_io=direct,
        host_bytes=host_bytes, disk_bytes=disk_bytes, rows=tuple(rows),
    )


def _one_length(
    n: int, ids, net, cache, kv, daemon: ChildDaemon, reps: int, progress: Callable[[str], None],
    advance: Callable[[], None] = lambda: None,
) -> LengthResult:
    """Full prefill, store, then host and disk restores of one prompt (`cache`: the HFPrefixCache)."""
    from kvtier_client import Tier
    from transformers import DynamicCache

    kwargs = cache.cache_kwargs

    full_runs, reference, last_cache = [], None, None
    for rep in range(reps):
        progress(f"{n:,} tokens: full prefill {rep + 1}/{reps}")
        dc = DynamicCache()
        t0 = time.perf_counter()
        logits = net(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs(dc)).logits[:, -1]
        logits.argmax(-1)
        ttft = time.perf_counter() - t0
        reference = logits if reference is None else reference
        last_cache = dc
        full_runs.append(dict(ttft=ttft, load=0.0, prefill=ttft, tokens=0, cached=0, host=0, disk=0, promoted=0,
                              diff=(logits - reference).abs().max().item(), plan="-"))
        advance()
    full = _path_result(full_runs)
    cache.planner.observe_prefill(n, full.ttft_seconds)  # what an engine reports after its prefills
    stored = cache.store(ids, last_cache)
    del last_cache
    keys = kv.block_keys(ids[0].tolist())

    def restored_run(expect: Tier) -> dict:
        tiers = kv.lookup(keys).tiers
        if any(t != expect for t in tiers):
            raise RuntimeError(f"{n} tokens: expected every cached page in {expect.label} before the restore, "
                               f"found {sorted({t.label for t in tiers})}")
        t0 = time.perf_counter()
        r = cache.restore(ids)
        t1 = time.perf_counter()
        logits = net(input_ids=ids[:, r.tokens:], use_cache=True, logits_to_keep=1, **kwargs(r.cache)).logits[:, -1]
        logits.argmax(-1)
        t2 = time.perf_counter()
        return dict(ttft=t2 - t0, load=t1 - t0, prefill=t2 - t1, tokens=r.tokens, cached=r.cached_blocks,
                    host=r.blocks_from(Tier.HOST), disk=r.blocks_from(Tier.DISK), promoted=r.promoted,
                    diff=(logits - reference).abs().max().item(), plan=r.plan.reason)

    # One untimed restore first (see the module docstring).
    progress(f"{n:,} tokens: warm-up restore")
    restored_run(Tier.HOST)
    advance()
    host_runs = []
    for rep in range(reps):
        progress(f"{n:,} tokens: restore from host {rep + 1}/{reps}")
        host_runs.append(restored_run(Tier.HOST))
        advance()
    disk_runs = []
    for rep in range(reps):
        progress(f"{n:,} tokens: restore from disk {rep + 1}/{reps}")
        with kv.borrow(kv.pool.capacity(Tier.HOST)):  # evicts (demotes) every cached page
            pass
        time.sleep(DISK_SETTLE_S)  # pages demoted a while ago, not a read racing their writes
        _drop_page_cache(daemon.cache_dir)
        disk_runs.append(restored_run(Tier.DISK))
        advance()
    return LengthResult(n, full, _path_result(host_runs), _path_result(disk_runs), stored.stored_blocks, stored.seconds)


# -- output -----------------------------------------------------------------------
COLUMNS = ("prompt tokens", "full prefill ms", "host TTFT ms", "host load + suffix ms", "host speed-up",
           "disk TTFT ms", "disk load + suffix ms", "disk speed-up", "restored tokens", "max abs diff host / disk")


def format_table(result: E2EResult) -> str:
    m = result.machine
    threads = m.get("torch_threads")
    lines = [
        f"kvtier bench e2e, {result.date}: time to first token on CPU, median of {result.reps}",
        f"machine  {m['nproc']} CPUs ({m['cpu']}), {m['ram_bytes'] / 2**30:.1f} GiB RAM, Linux {m['kernel']}, "
        f"torch {m.get('torch')} ({threads} thread{'' if threads == 1 else 's'}), "
        f"transformers {m.get('transformers')}, "
        f"load average {m['load_average'][0]:.1f} before / {m['load_average'][1]:.1f} after",
        f"model    {result.model.describe()}; "
        f"{result.model.block_tokens}-token pages of {format_size(result.page_bytes)}",
        f"daemon   host tier {format_size(result.host_bytes)}, disk tier {format_size(result.disk_bytes)} in "
        f"{result.directory} ({result.filesystem}, O_DIRECT {'yes' if result.direct_io else 'NO'}); "
        f"planner: {result.planner}",
        "heap     " + ("glibc keeps freed memory (mmap threshold 32 MiB, trim 1 GiB)" if result.keep_heap
                           else "glibc defaults (every forward faults in fresh memory)"),
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---:" for _ in COLUMNS) + "|",
    ]
    for r in result.rows:
        cells = (
            f"{r.tokens:,}",
            f"{r.full.ttft_seconds * 1e3:,.1f}",
            f"{r.host.ttft_seconds * 1e3:,.1f}",
            f"{r.host.load_seconds * 1e3:,.1f} + {r.host.prefill_seconds * 1e3:,.1f}",
            f"{r.speedup('host'):,.1f}x",
            f"{r.disk.ttft_seconds * 1e3:,.1f}",
            f"{r.disk.load_seconds * 1e3:,.1f} + {r.disk.prefill_seconds * 1e3:,.1f}",
            f"{r.speedup('disk'):,.1f}x",
            f"{r.host.restored_tokens:,} / {r.disk.restored_tokens:,}",
            f"{r.host.max_abs_diff:.1e} / {r.disk.max_abs_diff:.1e}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("TTFT = prompt in hand -> first token's logits. load = lookup + plan + acquire + copy into a "
                 "DynamicCache; suffix = forward over the tokens not restored. speed-up = full prefill / TTFT.")
    for t in result.targets():
        lines.append(f"target at {t['tokens']:,} tokens from {t['path']}: >= {t['target']:g}x, measured "
                     f"{t['speedup']:,.1f}x: {'met' if t['met'] else 'NOT MET'}")
    for r in result.rows:
        for path in ("host", "disk"):
            p = getattr(r, path)
            if p.restored_tokens < min(r.tokens // result.model.block_tokens * result.model.block_tokens, r.tokens - 1):
                lines.append(f"note: {r.tokens:,} tokens from {path}: restored {p.restored_tokens:,} tokens "
                             f"({p.plan})")
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


# -- command ------------------------------------------------------------------------
@click.option("--quick", is_flag=True,
              help=f"Lengths {', '.join(map(str, QUICK_LENGTHS))} and one repetition instead of {DEFAULT_REPS}.")
@click.option("--length", "lengths", type=click.IntRange(min=17), multiple=True,
              help=f"Prompt length in tokens; repeatable  [default: {', '.join(map(str, DEFAULT_LENGTHS))}]")
@click.option("--dir", "directory", type=click.Path(exists=True, file_okay=False, writable=True),
              help="Where the daemon's disk tier goes (a temporary subdirectory, removed afterwards)  "
                   "[default: /var/tmp, a real disk, not tmpfs]")
@click.option("--reps", type=click.IntRange(min=1), default=None,
              help=f"Repetitions of every measurement (the median is reported)  "
                   f"[default: {DEFAULT_REPS}, 1 with --quick]")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch intra-op threads for every path (on a shared machine 1 is steadier)  "
                   "[default: torch's choice]")
@click.option("--glibc-heap", is_flag=True,
              help="Leave glibc's malloc at its defaults (every forward then faults in fresh memory) instead of "
                   "keeping freed memory as a long-running engine does.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def _e2e(quick: bool, lengths: tuple[int, ...], directory: str | None, reps: int | None, threads: int | None,
         glibc_heap: bool, as_json: bool) -> None:
    """Time to first token of a random-init Llama on CPU (hidden 512, 8 layers, 4 KV heads,
    float32): full prefill vs the prompt's KV restored through a real daemon from the host
    tier and from the disk tier, with the logits of each restore checked against the full
    prefill. Prints TTFT per path and the speed-up full / restored."""
    progress = progress_lines(as_json)
    try:
        result = run_e2e(lengths=lengths or None, quick=quick, progress=progress, reps=reps, threads=threads,
                         keep_heap=not glibc_heap,
                         directory=os.path.abspath(directory) if directory else None)
    except (ValueError, OSError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(result.as_dict()) if as_json else format_table(result))


command = click.command("e2e", short_help="Time to first token: full prefill vs KV restored from host, disk.")(_e2e)
