"""Operator commands that talk to a running daemon: `kvtier stats` (and `kvtier stats why`) and `kvtier health-check`."""
from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import click
import grpc
from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvtier_client.connection import Connection, TLSConfig
from kvtier_client.errors import KVTierError, Unavailable
from kvtier_client.integrations.daemon_settings import default_socket
from kvtier_client.keys import ALGORITHMS, DEFAULT_ALGORITHM, block_keys
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from kvtier_client.results import BlockExplanation, BlockReason, Explanation, MissReason, hashing
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from kvtier.units import parse_duration, parse_size


def _target(socket: str | None, target: str | None) -> str:
    if target:
        return target
    return "unix://" + os.path.abspath(socket or os.environ.get("KVTIER_SOCKET") or default_socket())


def _read_pem(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise click.ClickException(f"cannot read {flag} {path} ({exc.strerror})") from None


def tls_config(tls_ca: str | None, tls_cert: str | None, tls_key: str | None) -> TLSConfig | None:
    """--tls-ca, --tls-cert and --tls-key as the client's TLSConfig; None without them."""
    if bool(tls_cert) != bool(tls_key):
        raise click.ClickException("--tls-cert and --tls-key go together (a client certificate for mutual TLS)")
    if not (tls_ca or tls_cert):
        return None
    return TLSConfig(
        root_certificates=_read_pem(tls_ca, "--tls-ca") if tls_ca else None,
        certificate_chain=_read_pem(tls_cert, "--tls-cert") if tls_cert else None,
        private_key=_read_pem(tls_key, "--tls-key") if tls_key else None,
    )


def connect(socket: str | None, target: str | None, tls_ca: str | None, tls_cert: str | None, tls_key: str | None,
            token: str | None = None) -> Connection:
    """The client's Connection to the daemon at --socket or --target, every call carrying
    --token: plaintext to a Unix socket, or to a TCP daemon without TLS options; TLS (mutual
    with --tls-cert/--tls-key) with them. Calls through `_ask` are tried once, for 5 s."""
    tls = tls_config(tls_ca, tls_cert, tls_key)
    try:
        return Connection(_target(socket, target), token=token, tls=tls, insecure=tls is None, timeout=5.0)
    except ValueError as exc:  # TLS options with a Unix socket
        raise click.ClickException(f"{exc}: leave out --tls-ca/--tls-cert, or pass --target HOST:PORT") from None


def _connection_options(f):
    f = click.option("--tls-key", metavar="PATH", help="PEM key of --tls-cert.")(f)
    f = click.option("--tls-cert", metavar="PATH", help="PEM client certificate, for a daemon that requires mutual TLS.")(f)
    f = click.option("--tls-ca", metavar="PATH", help="PEM CA to verify a TCP daemon's certificate.")(f)
    f = click.option("--target", metavar="URL",
                     help="gRPC target instead of the socket: HOST:PORT, dns:///HOST:PORT or unix:///PATH.")(f)
    f = click.option("--socket", metavar="PATH", envvar="KVTIER_SOCKET",
                     help="Daemon socket.  [env var: KVTIER_SOCKET; default: $XDG_RUNTIME_DIR/kvtier/kvtier.sock]")(f)
    return f


# -- values: sizes and durations as the daemon's configuration reads them (kvtier.units) --
class Duration(click.ParamType):
    """Seconds, written as kvtier.units.parse_duration reads them: 2s, 500ms, 1m30s, or a
    number of seconds; at least `minimum` (more than it, with `open_min`)."""

    name = "duration"

    def __init__(self, minimum: float = 0.0, open_min: bool = False) -> None:
        self.minimum, self.open_min = minimum, open_min

    def convert(self, value, param, ctx) -> float:
        if isinstance(value, float):
            return value
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if seconds < self.minimum or (self.open_min and seconds == self.minimum):
            self.fail(f"{value!r} is too short: {'more than' if self.open_min else 'at least'} {self.minimum:g}s",
                      param, ctx)
        return seconds


class Size(click.ParamType):
    """A size as kvtier.units.parse_size reads it (8GiB, 8Gi, 512MiB, 1.5GB, bytes), checked
    here and passed on as written."""

    name = "size"

    def convert(self, value, param, ctx) -> str:
        try:
            parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return str(value)


# -- output: rich on a terminal, plain aligned text in a pipe ----------------------------
#: Width of plain output: wide enough that no table wraps (lines carry no padding to it).
_PLAIN_WIDTH = 100_000


def console(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr). rich decides whether it is a terminal (also
    forced with FORCE_COLOR or TTY_COMPATIBLE=1, refused with TTY_COMPATIBLE=0)."""
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def plain_text(renderable: RenderableType, width: int = _PLAIN_WIDTH) -> str:
    """`renderable` as text without control codes or trailing blanks, never wrapped (or, given
    a `width`, as wide as that at most: for renderables that fit it, SplitTable): what a
    pipe, a file or a test reads."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, force_terminal=False, highlight=False,
            soft_wrap=False, emoji=False, markup=False).print(renderable)
    return "\n".join(line.rstrip() for line in out.getvalue().rstrip("\n").splitlines())


def pipe_width() -> int:
    """The width of plain output: COLUMNS where it is set (as `watch` and some shells do),
    else unlimited (one table row per line, however long)."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        return _PLAIN_WIDTH
    return columns if columns > 0 else _PLAIN_WIDTH


def emit(renderable: RenderableType, fit: bool = False) -> None:
    """Print `renderable`: with rich's colours and boxes on a terminal, as `plain_text` otherwise
    (with `fit`, no wider than `pipe_width`: only for renderables made to fit, SplitTable)."""
    out = console()
    if out.is_terminal:
        out.print(renderable)
    else:
        click.echo(plain_text(renderable, pipe_width() if fit else _PLAIN_WIDTH))


def _table(columns: list[str], rows: list[tuple[str, ...]], *, left: int, text_last: bool, header: bool, plain: bool,
           title: str | None) -> Table:
    last = len(columns) - 1
    t = Table(show_header=header, title=None if plain else title, title_justify="left", expand=False,
              box=None if plain else box.SIMPLE_HEAD, pad_edge=True, padding=(0, 1), collapse_padding=not plain,
              header_style="" if plain else "bold cyan")
    for i, name in enumerate(columns):
        # On a narrow terminal a header wraps between its words ("hit" over "rate"); cells stay whole.
        widest = max([len(row[i]) for row in rows] + [len(word) for word in name.split()], default=0)
        t.add_column(name, justify="left" if i < left or (text_last and i == last) else "right", no_wrap=plain,
                     min_width=None if plain else widest, style="bold" if i == 0 and not plain else "")
    for row in rows:
        t.add_row(*(Text(cell) for cell in row))  # as written: a namespace's "[...]" is no markup
    return t


def table(columns: list[str], rows: list[tuple[str, ...]], *, left: int = 1, text_last: bool = False,
          header: bool = True, plain: bool = True, title: str | None = None) -> RenderableType:
    """Rows under `columns`: figures right-aligned, the first `left` columns (and the last,
    with `text_last`) left-aligned. `plain`: no box, two spaces between columns, indented
    two spaces (one table row per line, split() gives the cells); else a box for a terminal."""
    t = _table(columns, rows, left=left, text_last=text_last, header=header, plain=plain, title=title)
    if plain:
        return Padding(t, (0, 0, 0, 1), expand=False)
    return _Fit(t, table(columns, rows, left=left, text_last=text_last, header=header, plain=True))


def _width_needed(console: Console, options, renderable: RenderableType) -> int:
    """Columns a `table` needs to show every cell and header on one line (a boxed table given
    less wraps headers and cells, or cuts the widest column short: rich shrinks it first)."""
    unbounded = options.update(max_width=_PLAIN_WIDTH)
    return Measurement.get(console, unbounded, renderable.boxed if isinstance(renderable, _Fit) else renderable).maximum


class _Fit:
    """A boxed table where the console is wide enough for it, else its plain lines (which the
    terminal wraps): a cell or a column is never cut off."""

    def __init__(self, boxed: Table, plain: RenderableType) -> None:
        self.boxed, self.plain = boxed, plain

    def __rich_console__(self, console: Console, options):
        unbounded = options.update(max_width=_PLAIN_WIDTH)
        if Measurement.get(console, unbounded, self.boxed).minimum <= options.max_width:
            yield self.boxed
        else:
            yield Text(plain_text(self.plain), no_wrap=False)


class SplitTable:
    """A `table` that fits the width it is drawn in (the terminal's, or COLUMNS): whole where it
    fits, else as narrower tables one under the other, each starting with the `keys` first
    columns (the row's name) and then a run of the others, in order. `sections` (counts of
    the columns after the keys) are the preferred splits, e.g. state | movement; a section
    still too wide is split into as few runs as fit, of about equal length. A run that fits
    nowhere (the keys alone are about as wide as the terminal) is drawn as its plain lines,
    which wrap: nothing is cut off."""

    def __init__(self, columns: list[str], rows: list[tuple[str, ...]], *, keys: int = 1, sections: tuple[int, ...] = (),
                 left: int = 1, text_last: bool = False, plain: bool = True) -> None:
        self.columns, self.rows, self.keys, self.plain = columns, rows, keys, plain
        self.left, self.text_last = left, text_last
        rest = list(range(keys, len(columns)))
        self.sections = [rest[sum(sections[:i]):sum(sections[:i + 1])] for i in range(len(sections))]
        done = sum(sections)
        if done < len(rest):
            self.sections.append(rest[done:])

    def part(self, picked: list[int]) -> RenderableType:
        """The table of the key columns and the columns `picked`."""
        indices = list(range(self.keys)) + picked
        return table([self.columns[i] for i in indices], [tuple(row[i] for i in indices) for row in self.rows],
                     left=self.left, text_last=self.text_last and indices[-1] == len(self.columns) - 1, plain=self.plain)

    def runs(self, fits) -> list[list[int]]:
        """Column runs (after the keys) of the tables to draw; `fits(run)` says whether one fits."""
        whole = [i for section in self.sections for i in section]
        if fits(whole) or not any(fits([i]) for i in whole):
            return [whole]  # whole where it fits; also where the keys leave room for no column (wrapped, then)
        runs: list[list[int]] = []
        for section in self.sections:
            greedy: list[list[int]] = [[]]
            for i in section:
                if greedy[-1] and not fits(greedy[-1] + [i]):
                    greedy.append([])
                greedy[-1].append(i)
            n, k = len(section), len(greedy)
            even = [section[j * n // k:(j + 1) * n // k] for j in range(k)]  # as many runs, of about equal length
            runs.extend(even if k > 1 and all(fits(run) for run in even) else greedy)
        return runs

    def __rich_console__(self, console: Console, options):
        def fits(run: list[int]) -> bool:
            return _width_needed(console, options, self.part(run)) <= options.max_width

        for run in self.runs(fits):
            part = self.part(run)
            if fits(run):
                yield part
            else:  # too wide for any table: its plain lines, wrapped where they must, never cut
                yield Text(plain_text(part if self.plain else part.plain), no_wrap=False)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


_TIER_NAMES = {pb.TIER_DEVICE: "device", pb.TIER_HOST: "host", pb.TIER_DISK: "disk", pb.TIER_CLUSTER: "cluster"}


#: (key of NamespaceStats.misses, its label): "never_stored" reads "never stored".
_MISS_REASONS = tuple((r.value, r.value.replace("_", " ")) for r in MissReason)


def _misses(ns: pb.NamespaceStats) -> str:
    """Missed blocks by reason, largest first: "3 never stored, 1 evicted"."""
    counts = sorted(((ns.misses.get(key, 0), label) for key, label in _MISS_REASONS), key=lambda c: -c[0])
    return ", ".join(f"{n} {label}" for n, label in counts if n) or "-"


_NAMESPACE_COLUMNS = ["namespace", "tier", "pages", "max", "guaranteed", "hits", "evicted", "looked up",
                      "missed by reason"]


def _namespace_rows(pool: pb.PoolStats) -> list[tuple[str, ...]]:
    """One row per namespace and tier; the namespace's lookups and misses on its first row."""
    rows: list[tuple[str, ...]] = []
    for ns in pool.namespaces:
        for i, t in enumerate(ns.tiers):
            tail = (str(ns.lookup_blocks), _misses(ns)) if i == 0 else ("", "")
            rows.append((
                ns.namespace, _TIER_NAMES.get(t.tier, str(t.tier)), str(t.pages), str(t.max_pages or "-"),
                str(t.guaranteed_pages or "-"), str(t.hits), str(t.evictions), *tail,
            ))
    return rows


_HINT_COLUMNS = ["namespace", "hard pinned", "soft pinned", "retained high", "retained cold", "hard-pin limit",
                 "next TTL end", "hard in host", "hard loading/waiting"]


def _hint_rows(pool: pb.PoolStats) -> list[tuple[str, ...]]:
    """One row per namespace that has clients' hints in the pool (`kvtier cache`)."""
    rows = []
    for ns in pool.namespaces:
        h = ns.hints
        if h.hard_pinned or h.soft_pinned or h.high or h.cold:
            rows.append((ns.namespace, str(h.hard_pinned), str(h.soft_pinned), str(h.high), str(h.cold),
                         str(h.hard_pin_limit or "-"),
                         f"in {h.next_expiry_seconds:.0f} s" if h.next_expiry_seconds else "no TTL",
                         str(h.hard_in_host), f"{h.hard_loading}/{h.hard_waiting}"))
    return rows


_TIER_COLUMNS = ["tier", "capacity", "used", "leased", "cached", "loading", "held", "hit rate", "evicted", "promoted",
                 "demoted", "refused", "moved in", "corrupt", "io errors", "read/s", "raw", "stored", "ratio"]
#: Where a narrow terminal splits the tier table first: what the tier holds | what moved | its bytes.
_TIER_SECTIONS = (7, 8)


def _stored_columns(t: pb.TierStats, page_bytes: int) -> tuple[str, str, str]:
    """Raw bytes (as engines wrote them), stored bytes (the encoded bytes the tier's codecs
    keep, not the chunk-rounded room they take) of the tier's capacity, and their ratio: what
    the codecs buy. Dashes where a tier does not count bytes."""
    if not t.capacity_bytes:
        return "-", "-", "-"
    raw = t.cached_pages * page_bytes
    ratio = f"{raw / t.stored_bytes:.2f}x" if t.stored_bytes else "-"
    return _human_bytes(raw), f"{_human_bytes(t.stored_bytes)} of {_human_bytes(t.capacity_bytes)}", ratio


def _tier_rows(pool: pb.PoolStats) -> list[tuple[str, ...]]:
    rows = []
    for t in pool.tiers:
        used = t.capacity_pages - t.free_pages
        hit_rate = t.hits / pool.lookup_blocks if pool.lookup_blocks else 0.0
        rows.append((
            _TIER_NAMES.get(t.tier, str(t.tier)), str(t.capacity_pages), str(used), str(t.writing_pages + t.pinned_pages),
            str(t.cached_pages), str(t.loading_pages), str(t.held_pages), f"{hit_rate:.3f}", str(t.evictions),
            str(t.promotions), str(t.demotions), str(t.refused_pages), _human_bytes(t.bytes_in), str(t.corrupt_pages), str(t.io_errors),
            _human_bytes(int(t.read_bytes_per_second)), *_stored_columns(t, pool.page_bytes),
        ))
    return rows


def served_line(pool: pb.PoolStats) -> str:
    """The hit rate to read (docs/metrics.md, "Found and served"): blocks kvtier served
    (lent to acquires) over the blocks looked up beyond those the engines held themselves."""
    served = {t.tier: t.served_blocks for t in pool.tiers if t.served_blocks}
    total = sum(served.values())
    rate = total / pool.lookup_blocks if pool.lookup_blocks else 0.0
    tiers = ", ".join(f"{_TIER_NAMES.get(tier, str(tier))} {n}" for tier, n in sorted(served.items()))
    return (f"served rate {rate:.3f}: kvtier served {total} blocks{f' ({tiers})' if tiers else ''} of the "
            f"{pool.lookup_blocks} looked up beyond the {pool.engine_blocks} the engines held themselves")


def stats_view(reply: pb.StatsResponse, plain: bool = True) -> RenderableType:
    """The stats as one renderable: a headline, then per pool a line about its layout, its
    tiers' table and its namespaces' table."""
    strong = "" if plain else "bold"
    parts: list[RenderableType] = [Text(
        f"kvtier {reply.version} · up {reply.uptime_seconds:.0f}s · {reply.sessions} sessions · {reply.leases} leases · "
        f"{reply.namespaces} namespaces (max_namespaces {reply.max_namespaces})", style=strong)]
    if not reply.pools:
        parts.append(Text("no pools yet: a pool is created when the first client registers a layout"))
    for pool in reply.pools:
        lay = pool.layout
        parts.append(Text(
            f"pool {pool.pool_id}: {lay.layers} layers x {lay.kv_heads} kv heads x {lay.head_dim} dim, "
            f"{lay.block_tokens} tokens/page, {lay.dtype}, page {_human_bytes(pool.page_bytes)}; "
            f"{pool.lookup_blocks} blocks looked up, {pool.miss_blocks} missed; miss history {pool.history_entries} of "
            f"{pool.history_limit} blocks ({_human_bytes(pool.history_bytes)})", style="" if plain else "green"))
        parts.append(SplitTable(_TIER_COLUMNS, _tier_rows(pool), sections=_TIER_SECTIONS, plain=plain))
        parts.append(Text(served_line(pool), style=strong))
        if pool.namespaces:
            parts.append(SplitTable(_NAMESPACE_COLUMNS, _namespace_rows(pool), keys=2, left=2, text_last=True, plain=plain))
        if hints := _hint_rows(pool):
            parts.append(SplitTable(_HINT_COLUMNS, hints, plain=plain))
    return Group(*parts)


def render_stats(reply: pb.StatsResponse, width: int = _PLAIN_WIDTH) -> str:
    """The stats as plain text (what `kvtier stats` prints into a pipe), at most `width` wide."""
    return plain_text(stats_view(reply, plain=True), width)


def _token_option(f):
    return click.option("--token", envvar="KVTIER_TOKEN", show_envvar=True, metavar="TOKEN",
                        help="Bearer token, when the daemon requires one.")(f)


def _ask(conn: Connection, method: str, request):
    """One RPC, not retried; a failure becomes the one-line error the command prints."""
    try:
        return conn.unary(method, request, retry=False)
    except Unavailable:
        raise click.ClickException(f"no kvtier daemon answers at {conn.target}; start one with `kvtier serve` or pass "
                                   "--socket/--target") from None
    except KVTierError as exc:
        raise click.ClickException(f"{exc.code}: {exc}") from None


#: Options of `kvtier stats` that, given before `why`, are its defaults.
_SHARED = ("socket", "target", "tls_ca", "tls_cert", "tls_key", "token", "as_json")


_INTEGERS = frozenset({FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
                       FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
                       FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED32,
                       FieldDescriptor.TYPE_SFIXED64})


def enum_json(enum: EnumDescriptor, number: int) -> str | None:
    """An enum value as the CLI writes it everywhere: its name without the prefix all the
    enum's names share, in lower case (TIER_HOST -> "host", BLOCK_NEVER_STORED ->
    "never_stored", KV_EVENT_STORED -> "stored"); None for 0 (UNSPECIFIED)."""
    if number == 0:
        return None
    names = [v.name for v in enum.values]
    prefix = os.path.commonprefix(names)
    prefix = prefix[:prefix.rfind("_") + 1]  # whole words only
    value = enum.values_by_number.get(number)
    return value.name[len(prefix):].lower() if value is not None else str(number)


def _field_json(field: FieldDescriptor, value):
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_json(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return enum_json(field.enum_type, value)
    if field.type in _INTEGERS:
        return int(value)
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return float(value) if math.isfinite(value) else None
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.hex()
    return value


def message_json(message) -> dict:
    """A protobuf message as plain JSON values, every field present (under its proto name):
    integers as numbers (64-bit ones too, which protobuf's own JSON writes as strings), enums
    as `enum_json` names, bytes in hex, maps as objects, unset messages as null."""
    out: dict = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            of = field.message_type.fields_by_name["value"]
            out[field.name] = {str(k): _field_json(of, v) for k, v in sorted(value.items())}
        elif field.is_repeated:
            out[field.name] = [_field_json(field, v) for v in value]
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not message.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _field_json(field, value)
    return out


def _json(reply: pb.StatsResponse) -> str:
    return json.dumps(message_json(reply))


def _watch_footer(every: float, shown: int, count: int | None) -> Text:
    left = f" ({count - shown} more)" if count else ""
    return Text(f"{time.strftime('%H:%M:%S')} · every {every:g}s{left} · Ctrl-C stops", style="dim")


#: `kvtier stats --watch` with no interval.
WATCH_EVERY = "2s"


@click.group("stats", invoke_without_command=True, short_help="Tiers, hit rates, sessions and namespaces of a daemon.",
             epilog="""\b
Examples:
  kvtier stats --socket /tmp/kvtier/kvtier.sock
  kvtier stats --watch                    # a live view, every 2s; plain snapshots into a pipe
  kvtier stats --watch 500ms --count 20   # 20 snapshots, 0.5s apart
  kvtier stats --json | jq '.pools[].tiers[] | {tier, cached_pages}'
  kvtier stats why --namespace my-model/tenant-a 64cfe407263f52ded92a449797f627db""")
@_connection_options
@_token_option
@click.option("--json", "as_json", is_flag=True,
              help="Print the stats as JSON, numbers as numbers and tiers as host, disk, ... (one object per line "
                   "with --watch; docs/cli.md).")
@click.option("--watch", type=Duration(minimum=0.05), is_flag=False, flag_value=WATCH_EVERY, default=None,
              metavar="[DURATION]",
              help=f"Refresh until interrupted, every DURATION (2s, 500ms, 1m; a bare number is seconds), every "
                   f"{WATCH_EVERY} when given alone (--watch, --watch --count 5): a live view on a terminal, one "
                   "plain snapshot after another (blank line between) in a pipe.")
@click.option("--count", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --watch: stop after N snapshots.  [default: until interrupted]")
@click.pass_context
def stats(ctx: click.Context, socket: str | None, target: str | None, tls_ca: str | None, tls_cert: str | None,
          tls_key: str | None, token: str | None, as_json: bool, watch: float | None, count: int | None) -> None:
    """Show per-tier capacity, use, hit rates and movement, plus sessions and leases, and each
    namespace's share (only the namespaces your token grants). `kvtier stats why` explains misses.

    Used = capacity - free; leased = borrowed (writing) + pinned by read leases; of the cached
    pages, loading ones are on their way in and held ones were loaded ahead of use."""
    if ctx.invoked_subcommand is not None:
        if watch or count:
            raise click.UsageError(f"--watch refreshes the stats table; it does not apply to `{ctx.invoked_subcommand}`")
        given = {name: value for name, value in ctx.params.items() if name in _SHARED and value}
        ctx.default_map = {ctx.invoked_subcommand: given}
        return
    if count and not watch:
        raise click.UsageError("--count goes with --watch")
    conn = connect(socket, target, tls_ca, tls_cert, tls_key, token)

    def fetch() -> pb.StatsResponse:
        return _ask(conn, "Stats", pb.StatsRequest())

    try:
        if not watch:
            reply = fetch()
            if as_json:
                click.echo(_json(reply))
            else:
                emit(stats_view(reply, plain=not console().is_terminal), fit=True)
            return
        out = console()
        if out.is_terminal and not as_json:
            with Live(console=out, auto_refresh=False, transient=False) as live:
                shown = 0
                while True:
                    shown += 1
                    live.update(Group(stats_view(fetch(), plain=False), _watch_footer(watch, shown, count)),
                                refresh=True)
                    if count and shown >= count:
                        return
                    time.sleep(watch)
        shown = 0
        while True:
            reply = fetch()
            if as_json:
                click.echo(_json(reply))
            else:
                click.echo(("\n" if shown else "") + render_stats(reply, pipe_width()))
            shown += 1
            if count and shown >= count:
                return
            time.sleep(watch)
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()


# -- kvtier stats why ----------------------------------------------------------------
@dataclass(frozen=True)
class Why:
    """An explanation with what the command knows besides it: the keys asked about, how they
    were hashed (None for keys given in hex), and blocks found under another algorithm."""

    namespace: str
    keys: list[bytes]
    explanation: Explanation
    asked: str | None  # "<algorithm> <block_tokens> tokens/block", as Explain's hashings
    other_algorithm: dict[int, str]  # block index -> the algorithm it was committed under instead


def _hex_keys(texts: tuple[str, ...]) -> list[bytes]:
    try:
        return [bytes.fromhex(t) for t in texts]
    except ValueError:
        raise click.BadParameter("keys are hex strings, e.g. 64cfe407263f52ded92a449797f627db", param_hint="KEY") from None


def _token_ids(token_list: str | None, tokens_file: str | None) -> list[int] | None:
    """The prompt's token ids from --tokens or --tokens-file; None when neither is given."""
    if token_list is not None and tokens_file is not None:
        raise click.UsageError("give --tokens or --tokens-file, not both")
    if tokens_file is not None:
        with open(tokens_file) as f:
            words, where = f.read().split(), f"--tokens-file {tokens_file}"
    elif token_list is not None:
        words, where = token_list.replace(",", " ").split(), "--tokens"
    else:
        return None
    try:
        return [int(w) for w in words]
    except ValueError:
        raise click.UsageError(f"{where}: token ids are integers (separated by commas or whitespace)") from None


def _pool_block_tokens(stats: pb.StatsResponse, pool_id: str) -> int:
    """--block-tokens left out: the block size of --pool, or of the daemon's only pool."""
    pools = [p for p in stats.pools if p.pool_id == pool_id] if pool_id else list(stats.pools)
    if len(pools) != 1:
        known = ", ".join(f"{p.pool_id} ({p.layout.block_tokens})" for p in stats.pools) or "none yet"
        raise click.UsageError(f"--tokens needs --block-tokens, or a --pool to take it from (pools: {known})")
    return pools[0].layout.block_tokens


def _keys_of(token_ids: list[int], block_tokens: int, salt: str, algorithm: str) -> list[bytes]:
    try:
        return list(block_keys(token_ids, block_tokens, salt=salt.encode(), algorithm=algorithm))
    except ValueError as exc:
        raise click.UsageError(f"cannot compute block keys: {exc}") from None


def _describe(block: BlockExplanation, other_algorithm: str | None) -> str:
    """One block's state in words."""
    where = block.tier.label if block.tier is not None else "?"
    reason = block.reason
    hint = f"; {block.hint}" if block.hint else ""
    if reason is BlockReason.CACHED:
        return f"cached in {where}{hint}"
    if reason is BlockReason.DROPPED:
        return f"dropped from {where} {block.seconds_ago:.0f} s ago by a client's drop (kvtier cache drop, KVTierClient.drop)"
    if reason is BlockReason.EVICTED:
        whose = "own pressure" if block.own_pressure else "another namespace's pressure"
        return f"evicted from {where} {block.seconds_ago:.0f} s ago by {block.policy or '?'} ({whose})"
    if reason is BlockReason.CORRUPT:
        return f"dropped as corrupt from {where} {block.seconds_ago:.0f} s ago"
    if reason is BlockReason.OTHER_LAYOUT:
        return f"cached in another layout {block.pool_id} ({where})"
    if reason is BlockReason.BEYOND_PREFIX:
        return f"cached in {where}, but beyond the longest cached prefix{hint}"
    if other_algorithm is not None:
        return f"committed under another hash fingerprint ({other_algorithm})"
    return "never stored"


#: How the summary line names each kind of block, in its order.
_KINDS = {BlockReason.CACHED: "cached", BlockReason.EVICTED: "evicted", BlockReason.DROPPED: "dropped by a client",
          BlockReason.CORRUPT: "dropped as corrupt", BlockReason.NEVER_STORED: "never stored",
          BlockReason.OTHER_LAYOUT: "in another layout", BlockReason.BEYOND_PREFIX: "beyond the prefix"}
_OTHER_FINGERPRINT = "under another hash fingerprint"


def _summary(why: Why) -> str:
    """"8 blocks: 3 cached, 2 evicted, ..." in a fixed order."""
    kinds = [_OTHER_FINGERPRINT if b.index in why.other_algorithm else _KINDS[b.reason] for b in why.explanation.blocks]
    counts = [f"{kinds.count(kind)} {kind}" for kind in (*_KINDS.values(), _OTHER_FINGERPRINT) if kind in kinds]
    return f"{len(kinds)} blocks: " + (", ".join(counts) or "none asked")


def why_view(why: Why, plain: bool = True) -> RenderableType:
    """The explanation: a headline, one row per block (index, key, state), a summary line
    and, when they matter, the hashings the namespace's clients registered with."""
    ex = why.explanation
    pool = next((b.pool_id for b in ex.blocks if b.reason is not BlockReason.OTHER_LAYOUT and b.pool_id), None)
    parts: list[RenderableType] = [Text(
        f"namespace {why.namespace}" + (f", pool {pool}" if pool else "")
        + f": {ex.hit_blocks} of {len(why.keys)} blocks served (the longest cached prefix)", style="" if plain else "bold")]
    rows = [(str(b.index), why.keys[b.index].hex()[:12], _describe(b, why.other_algorithm.get(b.index)))
            for b in ex.blocks]
    if rows:
        parts.append(table(["block", "key", "state"], rows, left=0, text_last=True, header=not plain, plain=plain))
    parts.append(Text(_summary(why)))
    if ex.hashings and (why.asked is None or list(ex.hashings) != [why.asked]):
        asked = f"; you asked for {why.asked}" if why.asked else ""
        parts.append(Text(f"clients of {why.namespace} registered with: {', '.join(ex.hashings)}{asked}",
                          style="" if plain else "yellow"))
    return Group(*parts)


def render_why(why: Why) -> str:
    """The explanation as plain text (what `kvtier stats why` prints into a pipe)."""
    return plain_text(why_view(why, plain=True))


def why_json(why: Why) -> dict:
    ex = why.explanation
    blocks = [
        {"index": b.index, "key": why.keys[b.index].hex(), "state": b.reason.value,
         "tier": b.tier.label if b.tier is not None else None, "pool_id": b.pool_id, "seconds_ago": b.seconds_ago,
         "policy": b.policy, "own_pressure": b.own_pressure, "hint": b.hint,
         "other_algorithm": why.other_algorithm.get(b.index)}
        for b in ex.blocks
    ]
    return {"namespace": why.namespace, "hit_blocks": ex.hit_blocks, "blocks": blocks,
            "hashings": list(ex.hashings), "asked": why.asked}


def _under_other_algorithms(explain, ex: Explanation, token_ids: list[int], block_tokens: int, salt: str,
                            algorithm: str) -> dict[int, str]:
    """Blocks never stored under `algorithm` that the daemon knows under another one."""
    unexplained = {b.index for b in ex.blocks if b.reason is BlockReason.NEVER_STORED}
    found: dict[int, str] = {}
    for other in (a for a in ALGORITHMS if a != algorithm):
        if not unexplained:
            break
        for b in explain(_keys_of(token_ids, block_tokens, salt, other)).blocks:
            if b.index in unexplained and b.reason is not BlockReason.NEVER_STORED:
                found[b.index] = other
                unexplained.discard(b.index)
    return found


@stats.command("why", short_help="Why a prompt's blocks are (not) cached, block by block.",
               epilog="""\b
Examples:
  kvtier stats why --namespace my-model/tenant-a 64cfe407263f52ded92a449797f627db
  kvtier stats why --namespace my-model/tenant-a --tokens 1,2,3,4 --block-tokens 16
  kvtier stats why --namespace my-model/tenant-a --tokens-file prompt.txt --json""")
@click.argument("keys", nargs=-1, metavar="[KEY]...")
@_connection_options
@_token_option
@click.option("--namespace", required=True, metavar="NAME", help="The namespace the prompt was cached in (the token must grant it).")
@click.option("--pool", "pool_id", default="", metavar="ID",
              help="Pool (layout) id, as `kvtier stats` lists them. Default: the pool serving the longest prefix.")
@click.option("--tokens", "token_list", metavar="ID,ID,...", help="The prompt's token ids, instead of KEYs.")
@click.option("--tokens-file", type=click.Path(exists=True, dir_okay=False), metavar="PATH",
              help="A file of the prompt's token ids separated by whitespace, instead of KEYs.")
@click.option("--salt", default="", metavar="SALT", help="With --tokens: the client's cache salt, as text.  [default: none]")
@click.option("--block-tokens", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --tokens: tokens per block. Default: the block size of --pool, or of the only pool.")
@click.option("--algorithm", type=click.Choice(ALGORITHMS), default=DEFAULT_ALGORITHM, show_default=True,
              help="With --tokens: the block-key hash the client uses.")
@click.option("--json", "as_json", is_flag=True, help="Print the explanation as JSON.")
def why(keys: tuple[str, ...], socket: str | None, target: str | None, tls_ca: str | None, tls_cert: str | None,
        tls_key: str | None, token: str | None, namespace: str, pool_id: str, token_list: str | None,
        tokens_file: str | None, salt: str, block_tokens: int | None, algorithm: str, as_json: bool) -> None:
    """Why is a prompt's KV (not) cached? One line per block: cached (and where), evicted
    (when, by which policy, under whose pressure), dropped as corrupt, never stored, cached in
    another layout, or beyond the longest cached prefix.

    Give the block KEYs in hex, or the prompt's token ids (--tokens, --tokens-file) with the
    client's --salt, --block-tokens and --algorithm: blocks never stored are then also looked
    for under the other hash algorithm."""
    token_ids = _token_ids(token_list, tokens_file)
    if (token_ids is None) == (not keys):
        raise click.UsageError("give the block KEYs in hex, or the prompt's --tokens / --tokens-file (one of them)")
    conn = connect(socket, target, tls_ca, tls_cert, tls_key, token)

    def explain(ks: list[bytes]) -> Explanation:
        request = pb.ExplainRequest(namespace=namespace, keys=ks, pool_id=pool_id, reads_dropped=True)
        return Explanation.from_proto(_ask(conn, "Explain", request))

    try:
        if token_ids is None:
            block_list = _hex_keys(keys)
            result = Why(namespace, block_list, explain(block_list), None, {})
        else:
            if block_tokens is None:
                block_tokens = _pool_block_tokens(_ask(conn, "Stats", pb.StatsRequest()), pool_id)
            block_list = _keys_of(token_ids, block_tokens, salt, algorithm)
            ex = explain(block_list)
            others = _under_other_algorithms(explain, ex, token_ids, block_tokens, salt, algorithm)
            result = Why(namespace, block_list, ex, hashing(algorithm, block_tokens), others)
    finally:
        conn.close()
    if as_json:
        click.echo(json.dumps(why_json(result)))
    else:
        emit(why_view(result, plain=not console().is_terminal))


@click.command("health-check", short_help="Exit 0 only if the daemon reports SERVING.",
               epilog="""\b
Examples:
  kvtier health-check --socket /tmp/kvtier/kvtier.sock && echo up
  kvtier health-check --target kvtier.internal:7070 --tls-ca ca.pem --timeout 1s""")
@_connection_options
@click.option("--timeout", type=Duration(minimum=0, open_min=True), default="3s", show_default=True, metavar="DURATION",
              help="How long to wait for an answer (1s, 500ms; a bare number is seconds).")
def health_check(socket: str | None, target: str | None, tls_ca: str | None, tls_cert: str | None, tls_key: str | None,
                 timeout: float) -> None:
    """Exit 0 only if the daemon reports SERVING (for probes and scripts)."""
    conn = connect(socket, target, tls_ca, tls_cert, tls_key)
    try:
        reply = health_pb2_grpc.HealthStub(conn.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        click.echo(f"NOT SERVING: no answer from {conn.target} ({exc.code().name})", err=True)
        sys.exit(1)
    finally:
        conn.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    click.echo(status)
    sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1)
