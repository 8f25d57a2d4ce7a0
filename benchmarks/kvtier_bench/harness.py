"""What every benchmark shares: page sizes and layouts, rates and medians, the machine a
result was measured on, progress lines and where result files go.

Nothing here measures; the benchmark modules do, each next to its baseline in the same run.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
from kvtier_client.layout import PageLayout

KiB = 1024
MiB = 1024 * KiB

#: Pages per borrow / acquire / call: a 256-token request with 16-token blocks.
BATCH = 16
#: Engine-side buffers are a ring of at most this many bytes (at least one page).
ENGINE_RING_BYTES = 256 * MiB

#: Realistic layouts for the default sizes; page_bytes is exactly the key.
NAMED_LAYOUTS: dict[int, tuple[str, PageLayout]] = {
    64 * KiB: (
        "one layer of a Llama-3-8B 16-token block (a vLLM per-layer block), fp16",
        PageLayout(layers=1, kv_heads=8, head_dim=128, block_tokens=16, dtype="float16"),
    ),
    256 * KiB: (
        "Llama-3.2-1B shape, 8-token blocks, fp16",
        PageLayout(layers=16, kv_heads=8, head_dim=64, block_tokens=8, dtype="float16"),
    ),
    2 * MiB: (
        "Llama-3-8B shape, 16-token blocks, fp16",
        PageLayout(layers=32, kv_heads=8, head_dim=128, block_tokens=16, dtype="float16"),
    ),
}


def format_size(nbytes: int) -> str:
    for unit, size in (("GiB", 1024 * MiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def layout_for(page_bytes: int) -> tuple[str, PageLayout]:
    """A layout whose page_bytes is exactly `page_bytes`: a real model's shape where we know
    one, else a one-layer uint8 layout (K and V of one token, head_dim = page_bytes / 2)."""
    if page_bytes in NAMED_LAYOUTS:
        return NAMED_LAYOUTS[page_bytes]
    if page_bytes < 2 or page_bytes % 2:
        raise ValueError(f"page size must be an even number of bytes (K and V halves), got {page_bytes}")
    return "generic uint8 layout", PageLayout(layers=1, kv_heads=1, head_dim=page_bytes // 2, block_tokens=1, dtype="uint8")


def batches(pages: int, batch: int = BATCH) -> list[tuple[int, int]]:
    """(first page, pages) of each call that moves `pages` pages `batch` at a time."""
    return [(start, min(batch, pages - start)) for start in range(0, pages, batch)]


# -- rates and medians ----------------------------------------------------------------
@dataclass(frozen=True)
class Rate:
    """`pages` pages of `page_bytes` each moved in `seconds`."""

    pages: int
    page_bytes: int
    seconds: float

    @property
    def pages_per_s(self) -> float:
        return self.pages / max(self.seconds, 1e-9)

    @property
    def gb_per_s(self) -> float:
        return self.pages * self.page_bytes / max(self.seconds, 1e-9) / 1e9

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "pages_per_s": self.pages_per_s, "gb_per_s": self.gb_per_s}


@dataclass(frozen=True)
class OpResult:
    """One row of a bench: `tier` and `baseline` moved the same pages; medians over repetitions."""

    page_bytes: int
    op: str
    tier: Rate
    baseline: Rate

    @property
    def ratio(self) -> float:
        """Tier throughput over baseline throughput (equally: baseline time over tier time)."""
        return self.tier.pages_per_s / self.baseline.pages_per_s


def median_rate(pages: int, page_bytes: int, samples: Sequence[float]) -> Rate:
    """The median of `samples` (seconds to move `pages` pages) as a Rate."""
    return Rate(pages, page_bytes, statistics.median(samples))


def median_pair(pages: int, page_bytes: int, op: str, pairs: Sequence[tuple[float, float]]) -> OpResult:
    """One row from (tier seconds, baseline seconds) pairs, the median of each side."""
    return OpResult(page_bytes, op, median_rate(pages, page_bytes, [t for t, _ in pairs]),
                    median_rate(pages, page_bytes, [b for _, b in pairs]))


def timed(fn: Callable[[], float | None]) -> float:
    """Seconds `fn` took; a function that times itself (the LMCache driver) returns its own figure."""
    start = time.perf_counter()
    own = fn()
    elapsed = time.perf_counter() - start
    return own if isinstance(own, float) else elapsed


def verify(engine: np.ndarray, sink: np.ndarray, pages: int, what: str) -> None:
    """Outside the timings: the pages that landed last in each sink slot are the engine's."""
    ring = len(engine)
    for i in range(max(0, pages - ring), pages):
        if not np.array_equal(sink[i % ring], engine[i % ring]):
            raise RuntimeError(f"{what}: page {i} came back with other bytes")


def drop_cache(path: str) -> None:
    """Drop a file's clean pages from the page cache (buffered fallback only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_dir(directory: str | None) -> str:
    """Where disk benchmarks put their files: `directory`, else /var/tmp (a real disk, not tmpfs)."""
    return directory or ("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir())


# -- the machine ------------------------------------------------------------------------
def filesystem_of(path: str) -> str:
    """'<type> on <device>' of the mount holding `path` (longest mount point prefix)."""
    path = os.path.realpath(path)
    best = ("", "unknown", "unknown")
    with open("/proc/mounts") as f:
        for line in f:
            device, mount, fstype = line.split()[:3]
            mount = mount.replace("\\040", " ")
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[0]):
                best = (mount, fstype, device)
    return f"{best[1]} on {best[2]}"


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "ram_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine_description(directory: str | None = None) -> dict:
    """What the results were measured on: CPU, cores, RAM, kernel, the bench directory's
    filesystem and /dev/shm's, Python and library versions, the load when measured."""
    info = machine_info()
    directory = directory or ("/var/tmp" if os.path.isdir("/var/tmp") else "/tmp")
    info.update({
        "machine": platform.machine(),
        "os": platform.platform(terse=True),
        "bench_dir": directory,
        "bench_dir_filesystem": filesystem_of(directory),
        "bench_dir_free_bytes": shutil.disk_usage(directory).free,
        "shm_filesystem": filesystem_of("/dev/shm") if os.path.isdir("/dev/shm") else None,
        "loadavg": list(os.getloadavg()),
        "versions": {
            "python": platform.python_version(),
            "kvtier": package_version("kvtier"),
            "numpy": package_version("numpy"),
            "torch": package_version("torch"),
            "grpcio": package_version("grpcio"),
            "matplotlib": package_version("matplotlib"),
        },
    })
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor") as f:
            info["cpu_governor"] = f.read().strip()
    except OSError:
        pass
    if os.path.exists("/sys/hypervisor/type") or _cpu_flag("hypervisor"):
        info["virtualised"] = True
    return info


def _cpu_flag(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return flag in line.split()
    except OSError:
        pass
    return False


def describe_machine(m: dict) -> str:
    """One line for a table header."""
    parts = [f"{m['nproc']} CPUs ({m['cpu']})", f"{m['ram_bytes'] / 2**30:.1f} GiB RAM", f"Linux {m['kernel']}"]
    if m.get("virtualised"):
        parts.append("virtualised")
    if "bench_dir" in m:
        parts.append(f"disk {m['bench_dir']} on {m['bench_dir_filesystem']}")
    versions = m.get("versions", {})
    parts.append(f"Python {versions.get('python', m.get('python'))}")
    if versions.get("torch"):
        parts.append(f"torch {versions['torch']}")
    if "loadavg" in m:
        parts.append("load " + " ".join(f"{x:.1f}" for x in m["loadavg"]))
    return ", ".join(parts)


def utc_now() -> str:
    """A result's date."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# -- progress and result files ------------------------------------------------------------
class ProgressLines:
    """What a benchmark says while it runs, on stderr: one line per message ("... message"),
    and, for a loop over repetitions, replays or requests, a rich progress bar with the time
    left (`bar`) when stderr is a terminal. Into a pipe or a file there are only the plain
    lines: no bar, no control codes. Silent when `quiet` (JSON output)."""

    def __init__(self, quiet: bool = False, line: Callable[[str], str] = lambda message: f"... {message}") -> None:
        self.quiet = quiet
        self._line = line
        self._bars = None  # the rich Progress while a bar is shown
        self._console = None

    def __call__(self, message: str) -> None:
        if self.quiet:
            return
        if self._bars is not None:  # above the bar, which stays at the bottom
            self._bars.console.print(self._line(message), markup=False, highlight=False, soft_wrap=True)
        else:
            print(self._line(message), file=sys.stderr, flush=True)

    def terminal(self) -> bool:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=True)
        return not self.quiet and self._console.is_terminal

    @contextlib.contextmanager
    def bar(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """A bar of `total` steps while inside; yields `advance(steps=1)`. A bar opened inside
        another one is shown under it and removed when done."""
        if not self.terminal() or total <= 0:
            yield lambda steps=1: None
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        outer = self._bars is None
        if outer:
            self._bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                  console=self._console, transient=True)
            self._bars.start()
        bars = self._bars
        task = bars.add_task(description, total=total)
        try:
            yield lambda steps=1: bars.advance(task, steps)
        finally:
            bars.remove_task(task)
            if outer:
                bars.stop()
                self._bars = None


@contextlib.contextmanager
def progress_bar(progress: Callable[[str], None], description: str, total: int) -> Iterator[Callable[[int], None]]:
    """`progress.bar(description, total)` when `progress` has bars (ProgressLines on a
    terminal), else an `advance` that does nothing: the loop's own progress lines remain."""
    bar = getattr(progress, "bar", None)
    if bar is None:
        yield lambda steps=1: None
        return
    with bar(description, total) as advance:
        yield advance


def progress_lines(quiet: bool) -> ProgressLines:
    """One benchmark's progress on stderr ("... message" lines, bars on a terminal), silent
    when `quiet` (JSON output)."""
    return ProgressLines(quiet)


def stderr_progress(t0: float | None = None) -> ProgressLines:
    """Progress of a long run on stderr: lines with the seconds since `t0` (default: now), and
    bars on a terminal."""
    start = time.perf_counter() if t0 is None else t0
    return ProgressLines(line=lambda message: f"[{time.perf_counter() - start:6.1f}s] {message}")


def default_out(now: datetime.datetime | None = None) -> Path:
    """Where a run's result files go by default: benchmarks/results/<YYYY-MM-DD> under the
    current directory (the repository's benchmarks/results/ when run from its root)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return Path("benchmarks") / "results" / now.strftime("%Y-%m-%d")
