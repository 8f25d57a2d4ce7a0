"""`kvtier demo`: start a throwaway daemon and walk one prompt through the cache.

It shows the whole protocol from an engine's side with nothing to configure: a daemon on
a temporary socket and cache directory (host and disk tiers, no GPU), one client doing
register -> block keys -> lookup (miss) -> borrow, write KV, commit -> lookup (hit) ->
acquire and compare bytes -> release -> stats, and a clean SIGTERM shutdown that must
exit 0. Any step that does not behave makes the command fail.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import click
import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvtier_client import Backoff, KVTierClient, PageLayout, Stats

DEMO_LAYOUT = PageLayout(layers=4, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
DEMO_PROMPT = "You are a helpful assistant. Summarise the following document in three short sentences, please."
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


class DemoDaemon:
    """A `kvtier serve` child process on a private socket, cache dir and arena prefix."""

    def __init__(self, workdir: Path, host_size: str, disk_size: str) -> None:
        self.socket = workdir / "kvtier.sock"
        self.log_path = workdir / "daemon.log"
        args = [
            sys.executable, "-m", "kvtier", "serve",
            "--socket", str(self.socket),
            "--cache-dir", str(workdir / "cache"),
            "--host-size", host_size,
            "--disk-size", disk_size,
            "--arena-prefix", f"kvtier-demo-{uuid.uuid4().hex[:8]}",
            "--log-format", "text",
        ]
        # The demo's defaults are embedded: a KVTIER_* variable of the caller's (a tokens
        # file, another socket) must not leak into the throwaway daemon.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_serving(self, timeout: float = START_TIMEOUT) -> None:
        """Block until gRPC health says SERVING; fail at once if the process exits."""
        deadline = time.monotonic() + timeout
        channel = grpc.insecure_channel(self.target)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise click.ClickException(
                        f"daemon exited with code {self.proc.returncode} before serving:\n{self.log_tail()}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise click.ClickException(f"daemon not serving after {timeout:g}s:\n{self.log_tail()}")
                try:
                    # wait_for_ready: block on the connection instead of spinning on refusals.
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=min(0.5, remaining), wait_for_ready=True)
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                        raise
                    continue
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                try:
                    self.proc.wait(0.1)  # up but not yet serving; doubles as the exit check
                except subprocess.TimeoutExpired:
                    pass
        finally:
            channel.close()

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM and wait; SIGKILL if it does not stop in time. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise click.ClickException(f"daemon ignored SIGTERM for {timeout:g}s and was killed:\n{self.log_tail()}")
        return self.proc.returncode


def _short(key: bytes) -> str:
    return key.hex()[:12]


def round_trip(client: KVTierClient, prompt: str, echo=click.echo) -> None:
    """The engine's side of one cache miss and one cache hit, narrated step by step."""
    step = iter(range(1, 100))

    def say(name: str, text: str) -> None:
        echo(f"{next(step):>2}. {name:<11} {text}")

    layout = DEMO_LAYOUT
    pool = client.register("demo/tiny-model", layout)
    say("register", f"namespace demo/tiny-model, session {pool.session_id[:8]}, pool {pool.pool_id}")
    echo(
        f"{'':15}layout {layout.layers} layers x {layout.kv_heads} kv heads x {layout.head_dim} dim, "
        f"{layout.block_tokens} tokens/page, {layout.dtype}: {pool.page_bytes} bytes/page"
    )
    echo(f"{'':15}host arena /dev/shm/{pool.host_arena} mapped ({pool.host_arena_bytes // pool.slot_bytes} slots)")

    token_ids = list(prompt.encode())  # a byte-level "tokenizer": one token per UTF-8 byte
    keys = client.block_keys(token_ids)
    if not keys:
        raise click.ClickException(f"the prompt needs at least {layout.block_tokens} tokens (bytes) for one block")
    say("block keys", f"{len(token_ids)} tokens -> {len(keys)} full blocks ({pool.algorithm}): "
        + ", ".join(_short(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else ""))

    first = client.lookup(keys)
    say("lookup", f"{first.hit_blocks} of {len(keys)} blocks cached: {'hit' if first.hit_blocks else 'miss'}")
    if first.hit_blocks:
        raise click.ClickException("a fresh daemon reported cached blocks: expected a miss")

    kv = np.random.default_rng(0).standard_normal((len(keys), *layout.shape)).astype(np.float16)
    with client.borrow(len(keys)) as lease:
        for page, values in zip(lease.pages, kv):
            page[...] = values  # the "engine" writes its KV straight into the shared pages
        say("borrow", f"lease {lease.lease_id}: {lease.count} host pages (slots {list(lease.slots)}); wrote KV in place")
        result = lease.commit(keys)
    say("commit", f"{result.committed} pages published under their block keys, {len(result.duplicates)} duplicates")

    second = client.lookup(keys)
    tiers = ", ".join(t.label for t in second.tiers)
    outcome = "hit" if second.hit_blocks == len(keys) else "MISS"
    say("lookup", f"{second.hit_blocks} of {len(keys)} blocks cached ({tiers}): {outcome}")
    if second.hit_blocks != len(keys):
        raise click.ClickException("committed blocks were not found by lookup")

    with client.acquire(second.hit_keys(keys)) as read:
        equal = read.ready == len(keys) and all(
            np.array_equal(page.view(np.uint8), values.view(np.uint8)) for page, values in zip(read.pages, kv)
        )
        say("acquire", f"lease {read.lease_id}: {read.ready} pages ready, {read.promoted} promoted; "
            f"bytes equal to what was written: {'yes' if equal else 'NO'}")
        if not equal:
            raise click.ClickException("pages read back differ from the pages written")
        lease_id = read.lease_id
    say("release", f"lease {lease_id} released")

    say("stats", "")
    echo(render_stats(client.stats()))


def render_stats(stats: Stats) -> str:
    """A short per-tier table of the daemon's pools."""
    lines = [f"{'':4}daemon {stats.version}: {stats.sessions} sessions, {stats.leases} leases"]
    header = ("tier", "capacity", "free", "cached", "pinned", "hits", "promoted", "demoted")
    for pool in stats.pools:
        rows = [header] + [
            (t.tier.label, t.capacity_pages, t.free_pages, t.cached_pages, t.pinned_pages, t.hits, t.promotions, t.demotions)
            for t in pool.tiers
        ]
        cells = [[str(c) for c in row] for row in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        lines.append(f"{'':4}pool {pool.pool_id}: {pool.lookup_blocks} blocks looked up, {pool.miss_blocks} missed")
        for r in cells:
            lines.append(f"{'':4}" + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


@click.command("demo")
@click.option("--prompt", default=DEMO_PROMPT, show_default=False, help="Text whose UTF-8 bytes serve as token ids.")
@click.option("--host-size", default="16MiB", show_default=True, help="Host tier of the demo daemon.")
@click.option("--disk-size", default="64MiB", show_default=True, help="Disk tier of the demo daemon.")
def demo(prompt: str, host_size: str, disk_size: str) -> None:
    """Start a temporary daemon, run one client round trip through it step by step, stop it."""
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as workdir:
        daemon = DemoDaemon(Path(workdir), host_size, disk_size)
        click.echo(f"kvtier demo: daemon pid {daemon.proc.pid} on {daemon.target} (host {host_size}, disk {disk_size})")
        try:
            daemon.wait_serving()
            with KVTierClient(daemon.target, name="kvtier demo", backoff=Backoff(total=10.0)) as client:
                round_trip(client, prompt)
        except BaseException:
            daemon.stop()
            click.echo(f"daemon log (last lines):\n{daemon.log_tail()}", err=True)
            raise
        code = daemon.stop()
        if code != 0:
            raise click.ClickException(f"daemon exited with code {code} after SIGTERM:\n{daemon.log_tail()}")
        click.echo(f"daemon stopped by SIGTERM, exit code {code}")
