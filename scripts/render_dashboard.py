#!/usr/bin/env python3
"""Render deploy/grafana/kvtier-dashboard.json's panels from a live daemon's metrics, with
matplotlib, into a PNG (docs/img/dashboard.png). Grafana cannot run here: this is a stand-in
that evaluates each panel's PromQL itself, over scrapes of /metrics taken every --interval
seconds, so the picture shows what the panels would show, not what Grafana draws.

    .venv/bin/python scripts/render_dashboard.py                      # start a daemon, drive traffic
    .venv/bin/python scripts/render_dashboard.py --url http://127.0.0.1:9188/metrics --duration 120

Only the PromQL the dashboard uses is understood: selectors with =, !=, =~ matchers, rate()
and increase() over a range (the range is capped at --window: a short run has little history),
sum/max/min/avg with `by`, histogram_quantile, and + - * / between vectors (a side without
labels applies to every series of the other; `ignoring`/`group_left` are read and skipped).
Template variables ($pool, $job) match everything; $__rate_interval is --window.
matplotlib comes with the benchmarks' dependencies (benchmarks/pyproject.toml).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtier-dashboard.json"

# -- scrapes ---------------------------------------------------------------------------
Labels = frozenset  # of (name, value)
Scrape = dict  # sample name -> {Labels: value}


def scrape(url: str) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


# -- a small PromQL evaluator ------------------------------------------------------------
TOKEN = re.compile(r"""\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<name>[A-Za-z_:$][A-Za-z0-9_:$]*)|(?P<str>"(?:[^"\\]|\\.)*")
                       |(?P<op>=~|!=|[-+*/(){}\[\],=]))""", re.X)
AGGREGATIONS = {"sum": sum, "max": max, "min": min, "avg": lambda v: sum(v) / len(v)}
DURATION = re.compile(r"(\d+)([smhd])")


def tokenize(expr: str) -> list[str]:
    tokens, pos = [], 0
    expr = expr.strip()
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot parse {expr[pos:]!r}")
        tokens.append(m.group(m.lastgroup))
        pos = m.end()
    return tokens


class Query:
    """Evaluates one expression at a time `at` over a history of (time, scrape)."""

    def __init__(self, expr: str, history: list[tuple[float, Scrape]], window: float) -> None:
        self.tokens = tokenize(expr.replace("$__rate_interval", f"{int(window)}s"))
        self.history = history
        self.window = window

    def at(self, index: int) -> dict:
        self.i, self.index = 0, index
        result = self.expr()
        if self.i != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self.i]!r}")
        return result if isinstance(result, dict) else {frozenset(): result}

    # grammar: expr := term (op term)*; precedence: * / over + -
    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.tokens[self.i]
        if expected is not None and token != expected:
            raise ValueError(f"expected {expected!r}, got {token!r}")
        self.i += 1
        return token

    def expr(self):
        left = self.product()
        while self.peek() in ("+", "-"):
            op = self.take()
            left = binary(op, left, self.product_after_modifiers())
        return left

    def product(self):
        left = self.unary()
        while self.peek() in ("*", "/"):
            op = self.take()
            left = binary(op, left, self.unary_after_modifiers())
        return left

    def skip_modifiers(self) -> None:
        while self.peek() in ("ignoring", "on", "group_left", "group_right"):
            self.take()
            if self.peek() == "(":
                self.labels()

    def product_after_modifiers(self):
        self.skip_modifiers()
        return self.product()

    def unary_after_modifiers(self):
        self.skip_modifiers()
        return self.unary()

    def labels(self) -> list[str]:
        self.take("(")
        names = []
        while self.peek() != ")":
            names.append(self.take())
            if self.peek() == ",":
                self.take()
        self.take(")")
        return names

    def unary(self):
        token = self.peek()
        if re.fullmatch(r"\d+(\.\d+)?", token):
            return float(self.take())
        if token == "(":
            self.take()
            value = self.expr()
            self.take(")")
            return value
        self.take()
        if token in AGGREGATIONS:
            by = self.labels() if self.peek() == "by" and self.take() else None
            self.take("(")
            inner = self.expr()
            self.take(")")
            if by is None and self.peek() == "by":
                self.take()
                by = self.labels()
            return aggregate(AGGREGATIONS[token], vector(inner), by or [])
        if token in ("rate", "increase"):
            self.take("(")
            name, matchers = self.selector_rest(self.take())
            self.take("[")
            span = self.duration()
            self.take("]")
            self.take(")")
            return self.range_function(token, name, matchers, span)
        if token == "histogram_quantile":
            self.take("(")
            q = float(self.take())
            self.take(",")
            inner = vector(self.expr())
            self.take(")")
            return quantile(q, inner)
        name, matchers = self.selector_rest(token)
        return select(self.history[self.index][1], name, matchers)

    def duration(self) -> float:
        text = ""
        while self.peek() != "]":
            text += self.take()
        return sum(int(n) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[u] for n, u in DURATION.findall(text))

    def selector_rest(self, name: str) -> tuple[str, list[tuple[str, str, str]]]:
        matchers = []
        if self.peek() == "{":
            self.take()
            while self.peek() != "}":
                label, op, value = self.take(), self.take(), json.loads(self.take())
                matchers.append((label, op, value))
                if self.peek() == ",":
                    self.take()
            self.take("}")
        return name, matchers

    def range_function(self, fn: str, name: str, matchers, span: float) -> dict:
        now = self.history[self.index][0]
        start = now - min(span, self.window)
        points = [(t, select(s, name, matchers)) for t, s in self.history[: self.index + 1] if t >= start]
        if len(points) < 2:
            return {}
        (t0, first), (t1, last) = points[0], points[-1]
        out = {}
        for labels, value in last.items():
            delta = max(value - first.get(labels, 0.0), 0.0)
            out[labels - {("__name__", name)}] = delta / (t1 - t0) if fn == "rate" else delta
        return out


def select(sample: Scrape, name: str, matchers) -> dict:
    out = {}
    for labels, value in sample.get(name, {}).items():
        d = dict(labels)
        ok = True
        for label, op, want in matchers:
            have = d.get(label, "")
            want = re.sub(r"\$\w+", ".*", want)  # template variables: All
            if want.startswith("${") or (op == "=" and "$" in want):
                continue
            if op == "=" and have != want or op == "!=" and have == want or op == "=~" and not re.fullmatch(want, have):
                ok = False
        if ok:
            out[labels] = value
    return out


def vector(value) -> dict:
    return value if isinstance(value, dict) else {frozenset(): value}


def aggregate(fn, v: dict, by: list[str]) -> dict:
    groups: dict[Labels, list[float]] = {}
    for labels, value in v.items():
        key = frozenset((k, x) for k, x in labels if k in by)
        groups.setdefault(key, []).append(value)
    return {k: fn(vs) for k, vs in groups.items() if vs}


def binary(op: str, left, right):
    def apply(a: float, b: float) -> float:
        if op == "/":
            return a / b if b else math.nan
        return {"+": a + b, "-": a - b, "*": a * b}[op]

    if not isinstance(left, dict) and not isinstance(right, dict):
        return apply(left, right)
    lv, rv = vector(left), vector(right)
    if set(rv) == {frozenset()}:
        return {k: apply(a, rv[frozenset()]) for k, a in lv.items()}
    if set(lv) == {frozenset()}:
        return {k: apply(lv[frozenset()], b) for k, b in rv.items()}
    return {k: apply(a, rv[k]) for k, a in lv.items() if k in rv}


def quantile(q: float, buckets: dict) -> dict:
    """histogram_quantile: linear interpolation within the bucket holding the q-th observation."""
    series: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in buckets.items():
        d = dict(labels)
        le = float(d.pop("le"))
        series.setdefault(frozenset(d.items()), []).append((le, count))
    out = {}
    for labels, points in series.items():
        points.sort()
        total = points[-1][1]
        if total <= 0:
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for le, count in points:
            if count >= rank:
                if math.isinf(le):
                    out[labels] = lower
                else:
                    out[labels] = lower + (le - lower) * (rank - below) / max(count - below, 1e-12)
                break
            lower, below = le, count
    return out


def legend(template: str, labels: Labels) -> str:
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), template) or "value"


# -- a daemon with traffic ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(workdir: Path, port: int) -> subprocess.Popen:
    tokens = workdir / "tokens.toml"
    tokens.write_text('[tokens]\n"render-token-0123456789abcdef" = ["chat", "rag"]\n')
    cmd = [sys.executable, "-m", "kvtier", "serve", "--socket", str(workdir / "kvtier.sock"),
           "--cache-dir", str(workdir / "cache"), "--host-size", "256KiB", "--disk-size", "4MiB",
           "--metrics-port", str(port), "--tokens-file", str(tokens), "--session-timeout", "2s",
           "--arena-prefix", f"kvtier-render-{os.getpid()}", "--warm-restart-window", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.Popen(cmd, stdout=open(workdir / "daemon.log", "wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"daemon did not become ready:\n{(workdir / 'daemon.log').read_text()}")


def traffic(target: str, stop: threading.Event) -> None:
    """Two tenants: write prefixes, look them (and some unknown ones) up, acquire some; a few
    sessions are closed, some left to time out, some Registers refused."""
    import hashlib
    import random

    import grpc
    from kvtier_client.handoff import attach
    from kvtier_client.keys import hash_fingerprint
    from kvtier_client.proto.v1 import kvtier_pb2 as pb
    from kvtier_client.proto.v1 import kvtier_pb2_grpc

    token = "render-token-0123456789abcdef"
    layout = pb.PageLayout(layers=1, kv_heads=1, head_dim=48, block_tokens=16, dtype="float16", order="page_first")
    channel = grpc.insecure_channel(target)
    stub = kvtier_pb2_grpc.KVTierStub(channel)
    auth = (("authorization", f"Bearer {token}"),)
    rng = random.Random(7)

    def register(namespace: str, good: bool = True):
        request = pb.RegisterRequest(namespace=namespace, layout=layout, hash_algorithm="xxh3-128",
                                     hash_fingerprint=hash_fingerprint("xxh3-128"), client_name="render")
        reply = stub.Register(request, metadata=auth if good else None, timeout=10)
        attachment = attach(reply.handoff_socket, reply.session_id, token)
        os.close(attachment.arena_fd)
        return reply.session_id, (*auth, ("kvtier-session-key", attachment.session_key))

    def key(ns: str, doc: int, i: int) -> bytes:
        return hashlib.sha256(f"{ns}:{doc}:{i}".encode()).digest()[:16]

    sessions = {ns: register(ns) for ns in ("chat", "rag")}
    docs = {"chat": 0, "rag": 0}
    step = 0
    while not stop.is_set():
        step += 1
        for ns, (sid, md) in list(sessions.items()):
            try:
                stub.Heartbeat(pb.HeartbeatRequest(session_id=sid), metadata=md, timeout=10)
                if rng.random() < 0.5 or docs[ns] == 0:  # a new document: write its blocks
                    n = rng.randint(2, 6)
                    lease = stub.Borrow(pb.BorrowRequest(session_id=sid, count=n), metadata=md, timeout=10)
                    stub.Commit(pb.CommitRequest(session_id=sid, lease_id=lease.lease_id,
                                                 keys=[key(ns, docs[ns], i) for i in range(n)]), metadata=md, timeout=10)
                    docs[ns] += 1
                doc = rng.randint(max(0, docs[ns] - 30), docs[ns])  # recent documents come back
                wanted = [key(ns, doc, i) for i in range(6)]
                hit = stub.Lookup(pb.LookupRequest(session_id=sid, keys=wanted), metadata=md, timeout=10).hit_blocks
                if hit:
                    lease = stub.Acquire(pb.AcquireRequest(session_id=sid, keys=wanted[:hit], tier=pb.TIER_HOST),
                                         metadata=md, timeout=10)
                    stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=lease.lease_id), metadata=md, timeout=10)
            except grpc.RpcError:
                pass  # RESOURCE_EXHAUSTED and the like: counted by the daemon, which is the point
        if step % 15 == 0:  # a client restarts: closes its session, registers again
            ns = rng.choice(list(sessions))
            sid, md = sessions[ns]
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=md, timeout=10)
            sessions[ns] = register(ns)
        if step % 25 == 0:
            register("chat")  # an engine that dies after registering: times out
            try:
                register("chat", good=False)
            except grpc.RpcError:
                pass  # UNAUTHENTICATED
        stop.wait(0.05)
    for sid, md in sessions.values():
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=md, timeout=10)
    channel.close()


# -- drawing -----------------------------------------------------------------------------
def render(dashboard: dict, history: list[tuple[float, Scrape]], window: float, out: Path, source: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.1 * rows), squeeze=False)
    t0 = history[0][0]
    for ax, panel in zip(axes.flat, panels):
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        drawn = 0
        for target in panel["targets"]:
            query = Query(target["expr"], history, window)
            series: dict[Labels, list[tuple[float, float]]] = {}
            for i, (t, _) in enumerate(history):
                for labels, v in query.at(i).items():
                    if not math.isnan(v):
                        series.setdefault(labels, []).append((t - t0, v))
            for labels, points in sorted(series.items(), key=lambda kv: sorted(kv[0])):
                xs, ys = zip(*points)
                if unit == "percentunit":
                    ys = [y * 100 for y in ys]
                ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), labels), linewidth=1.3)
                drawn += 1
        ax.set_title(panel["title"], fontsize=10)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("seconds", fontsize=7)
        ax.set_ylabel({"percentunit": "%", "Bps": "bytes/s", "s": "seconds", "bytes": "bytes", "ops": "per second"}
                      .get(unit, ""), fontsize=7)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=6, loc="upper left", ncol=2 if drawn > 4 else 1)
        else:
            ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"kvtier dashboard (deploy/grafana/kvtier-dashboard.json) rendered with matplotlib from {source}, "
                 f"{len(history)} scrapes over {history[-1][0] - t0:.0f} s, rate window {window:.0f} s; "
                 "not a Grafana screenshot (Grafana cannot run here)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="scrape this /metrics URL instead of starting a daemon")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of scraping")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    parser.add_argument("--window", type=float, default=10.0, help="rate()/increase() range cap, seconds")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    args = parser.parse_args()
    dashboard = json.loads(args.dashboard.read_text())

    proc = workdir = None
    stop = threading.Event()
    driver = None
    if args.url:
        url, source = args.url, args.url
    else:
        workdir = Path(tempfile.mkdtemp(prefix="kvtier-render-"))
        port = free_port()
        proc = start_daemon(workdir, port)
        url, source = f"http://127.0.0.1:{port}/metrics", "a live daemon with synthetic traffic"
        driver = threading.Thread(target=traffic, args=(f"unix://{workdir / 'kvtier.sock'}", stop), daemon=True)
        driver.start()
    history: list[tuple[float, Scrape]] = []
    try:
        end = time.monotonic() + args.duration
        while time.monotonic() < end:
            history.append((time.monotonic(), scrape(url)))
            time.sleep(args.interval)
    finally:
        stop.set()
        if driver is not None:
            driver.join(timeout=30)
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            shutil.rmtree(workdir, ignore_errors=True)
    render(dashboard, history, args.window, args.out, source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
