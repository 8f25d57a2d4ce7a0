"""What the `kvtier` commands print: rich tables and a live view on a terminal, plain text
with no control codes into a pipe, `--help` with metavars, defaults, variables and examples,
and `--version`. Against a real daemon (tests/daemon.py) where a command needs one."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner
from rpc import Conn, keys, run_kvtier

from kvtier.cli import BENCH_INSTALL, main
from kvtier.server.config import OPTIONS, PATH, SIZE

ESC = "\x1b"
#: A pipe, whatever the environment the tests run in (rich honours FORCE_COLOR, TTY_COMPATIBLE;
#: `kvtier stats` fits a COLUMNS that is set), so with no width: one table row per line.
PIPE = {"TTY_COMPATIBLE": "0", "COLUMNS": ""}
#: What a terminal looks like to rich: forced, 160 columns.
TERMINAL = {"TTY_COMPATIBLE": "1", "COLUMNS": "160", "NO_COLOR": ""}
TIER_HEADER = ["tier", "capacity", "used", "leased", "cached", "loading", "held", "hit", "rate", "evicted", "promoted",
               "demoted", "refused", "moved", "in", "corrupt", "io", "errors", "read/s", "raw", "stored", "ratio"]


@pytest.fixture(scope="module")
def daemon(module_daemons):
    d = module_daemons.start(host_size="1MiB", disk_size="4MiB")
    conn = Conn(d.target)
    s = conn.session("cli-out")
    s.put(keys("cli-out", 3))
    s.lookup(keys("cli-out", 3))
    yield d
    conn.close()


def rows_of(text: str) -> dict[str, list[str]]:
    """Table rows (indented two spaces) by their first cell."""
    return {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  ")}


# -- kvtier stats ---------------------------------------------------------------------
def test_stats_into_a_pipe_is_plain_table_text(daemon):
    out = run_kvtier("stats", "--socket", str(daemon.socket), env=PIPE)
    assert out.returncode == 0, out.stderr
    assert ESC not in out.stdout and "\r" not in out.stdout
    lines = out.stdout.splitlines()
    assert lines[0].startswith("kvtier 0.1.0 · up ") and "1 sessions" in lines[0]
    assert lines[1].startswith("pool ") and "3 blocks looked up, 0 missed" in lines[1]
    assert "1 namespaces (max_namespaces 64)" in lines[0] and "miss history 0 of 65536 blocks (0 B)" in lines[1]
    assert lines[2].split() == TIER_HEADER
    rows = rows_of(out.stdout)
    assert rows["host"][1:6] == ["256", "3", "0", "3", "0"] and rows["host"][7] == "1.000"
    assert rows["disk"][1] == "1024"
    assert rows["namespace"][:3] == ["namespace", "tier", "pages"]
    host_share, disk_share = (line.split() for line in lines if line.startswith("  cli-out "))
    assert host_share[:8] == ["cli-out", "host", "3", "-", "-", "3", "0", "3"]
    assert disk_share == ["cli-out", "disk", "0", "-", "-", "0", "0"]
    # Columns line up: every cell of the tier table ends where its header does (figures right-aligned).
    header, host = lines[2], next(line for line in lines if line.startswith("  host"))
    assert header.index("capacity") + len("capacity") == host.index("256") + 3
    assert all(line == line.rstrip() for line in lines)  # no padding to a terminal's width


def test_stats_on_a_terminal_is_a_rich_table(daemon):
    out = run_kvtier("stats", "--socket", str(daemon.socket), env=TERMINAL)
    assert out.returncode == 0, out.stderr
    assert ESC + "[" in out.stdout  # colours and bold
    assert "─" in out.stdout  # the table's rule under its header
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.stdout)
    host = next(line.split() for line in plain.splitlines() if line.split()[:1] == ["host"])
    assert host[1:6] == ["256", "3", "0", "3", "0"]
    assert max(len(line) for line in plain.splitlines()) <= 160


def test_stats_watch_into_a_pipe_prints_plain_snapshots(daemon):
    out = run_kvtier("stats", "--socket", str(daemon.socket), "--watch", "0.2", "--count", "3", env=PIPE, timeout=30)
    assert out.returncode == 0, out.stderr
    assert ESC not in out.stdout  # no clear-screen codes, no cursor movement
    snapshots = out.stdout.split("\n\n")
    assert len(snapshots) == 3
    for snapshot in snapshots:
        assert snapshot.startswith("kvtier 0.1.0 · up ")
        assert rows_of(snapshot)["host"][1] == "256"


def test_stats_watch_json_is_one_object_per_line(daemon):
    out = run_kvtier("stats", "--socket", str(daemon.socket), "--watch", "0.1", "--count", "2", "--json", env=PIPE)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2 and all(line.startswith("{") for line in out.stdout.splitlines())


def test_stats_watch_on_a_terminal_is_a_live_view(daemon):
    out = run_kvtier("stats", "--socket", str(daemon.socket), "--watch", "0.1", "--count", "2", env=TERMINAL)
    assert out.returncode == 0, out.stderr
    assert "\x1b[2J" not in out.stdout  # redrawn in place by rich's Live, not by clearing the screen
    assert "every 0.1s" in out.stdout and "Ctrl-C stops" in out.stdout
    assert out.stdout.count("kvtier 0.1.0") >= 2


def test_stats_watch_alone_refreshes_every_2s(daemon):
    out = run_kvtier("stats", "--socket", str(daemon.socket), "--watch", "--count", "2", env=PIPE, timeout=30)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split("\n\n")) == 2
    live = run_kvtier("stats", "--socket", str(daemon.socket), "--count", "1", "--watch", env=TERMINAL)
    assert live.returncode == 0, live.stderr
    assert "every 2s" in live.stdout


@pytest.mark.parametrize("interval", ["100ms", "0.1", "0.1s"])
def test_stats_watch_takes_a_duration(daemon, interval):
    out = run_kvtier("stats", "--socket", str(daemon.socket), "--watch", interval, "--count", "2", "--json", env=PIPE)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2


@pytest.mark.parametrize("interval, message", [("soon", "cannot read 'soon' as a duration"),
                                               ("10ms", "'10ms' is too short: at least 0.05s")])
def test_stats_watch_refuses_what_is_no_interval(daemon, interval, message):
    out = run_kvtier("stats", "--socket", str(daemon.socket), "--watch", interval, env=PIPE)
    assert out.returncode == 2 and message in out.stderr


def plain_lines(text: str) -> list[str]:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).splitlines()


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize("mode", ["terminal", "pipe"])
def test_stats_fits_the_terminal_width(daemon, columns, mode):
    """The 16-column tier table (about 140 characters) is split into narrower tables, each
    starting with the tier: no line longer than the terminal, no column or cell cut off."""
    env = {**(TERMINAL if mode == "terminal" else PIPE), "COLUMNS": str(columns)}
    out = run_kvtier("stats", "--socket", str(daemon.socket), env=env)
    assert out.returncode == 0, out.stderr
    lines = plain_lines(out.stdout)
    assert max(len(line) for line in lines) <= columns, "\n".join(line for line in lines if len(line) > columns)
    assert "…" not in out.stdout  # nothing cut short
    headers = [line.split() for line in lines if line.split()[:1] == ["tier"]]
    assert len(headers) >= 2  # split, since the whole table needs about 140 columns
    words = [word for header in headers for word in header[1:]]
    assert words == [w for w in TIER_HEADER[1:]]  # every column once, in order, after the tier column
    hosts = [line.split() for line in lines if line.split()[:1] == ["host"]]
    assert len(hosts) == len(headers) and hosts[0][1:6] == ["256", "3", "0", "3", "0"]
    assert any(line.split()[:2] == ["cli-out", "host"] for line in lines)


def test_stats_into_a_pipe_without_columns_keeps_one_row_per_line(daemon):
    out = run_kvtier("stats", "--socket", str(daemon.socket), env={**PIPE, "COLUMNS": ""})
    assert [line.split() for line in out.stdout.splitlines() if line.startswith("  tier")] == [TIER_HEADER]


def test_count_needs_watch(daemon):
    out = run_kvtier("stats", "--socket", str(daemon.socket), "--count", "2", env=PIPE)
    assert out.returncode == 2 and "--count goes with --watch" in out.stderr


def test_stats_why_in_both_modes(daemon):
    key = keys("cli-out", 3)[0].hex()
    plain = run_kvtier("stats", "why", "--socket", str(daemon.socket), "--namespace", "cli-out", key, env=PIPE)
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.splitlines()
    assert ESC not in plain.stdout
    assert lines[0] == "namespace cli-out, pool " + lines[0].split("pool ")[1]
    assert lines[1].split() == ["0", key[:12], "cached", "in", "host"]
    assert lines[2] == "1 blocks: 1 cached"
    rich = run_kvtier("stats", "why", "--socket", str(daemon.socket), "--namespace", "cli-out", key, env=TERMINAL)
    assert rich.returncode == 0 and ESC in rich.stdout and "state" in rich.stdout and "cached in host" in rich.stdout


def test_replay_in_both_modes(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n' * 2)
    plain = run_kvtier("replay", str(trace), "--host-pages", "4", env=PIPE)
    assert plain.returncode == 0, plain.stderr
    assert ESC not in plain.stdout and "block hit rate 0.5000" in plain.stdout
    rich = run_kvtier("replay", str(trace), "--host-pages", "4", env=TERMINAL)
    assert rich.returncode == 0 and ESC in rich.stdout and "0.5000" in rich.stdout


# -- --help ---------------------------------------------------------------------------
def help_of(*args: str) -> str:
    result = CliRunner().invoke(main, [*args, "--help"], terminal_width=400)
    assert result.exit_code == 0, result.output
    return result.output


def test_serve_help_shows_metavars_variables_defaults_and_an_example():
    text = help_of("serve")
    assert ESC not in text
    for metavar in ("--host-size SIZE", "--session-timeout DURATION", "--cache-dir PATH", "--config PATH",
                    "--tokens-file PATH", "--cluster URL", "--tcp HOST:PORT"):
        assert metavar in text, metavar
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=--)", text)]
    for o in OPTIONS:
        entry = next(e for e in entries if e.startswith(o.flag + " "))
        assert o.env in entry and f"default: {o.default_text}]" in entry, entry
        if o.kind in (PATH, SIZE):
            assert entry.startswith(f"{o.flag} {o.kind.metavar} "), entry
        assert not entry.startswith(f"{o.flag} TEXT"), entry  # every option says what kind of value it takes
    assert "Examples:" in text and "kvtier serve --host-size 8GiB" in text


@pytest.mark.parametrize("command", [("serve",), ("stats",), ("stats", "why"), ("health-check",), ("events",),
                                     ("replay",), ("demo",)])
def test_every_command_has_an_example_and_typed_options(command):
    text = help_of(*command)
    assert "Example" in text and f"kvtier {' '.join(command)}" in text.split("Example", 1)[1]
    assert not re.search(r"^  --\S+ TEXT ", text, re.M) or command == ("demo",)  # demo's --prompt is text
    for flag, metavar in (("--socket", "PATH"), ("--target", "URL"), ("--tls-ca", "PATH"), ("--token", "TOKEN")):
        if f"  {flag} " in text:
            assert f"  {flag} {metavar}" in text, (command, flag)


def test_stats_help_shows_the_variables():
    text = help_of("stats")
    assert "KVTIER_SOCKET" in text and "KVTIER_TOKEN" in text
    assert "--watch [DURATION]" in text and "--count N" in text
    assert "every 2s when given alone" in " ".join(text.split())


def test_command_summaries_are_whole_sentences():
    text = help_of()
    listing = text.split("Commands:", 1)[1].split("Examples:", 1)[0]
    summaries = [line.strip() for line in listing.splitlines() if line.strip()]
    assert {s.split()[0] for s in summaries} >= {"serve", "stats", "health-check", "events", "replay", "demo", "bench"}
    assert not any(s.endswith("...") for s in summaries), summaries
    assert "_KVTIER_COMPLETE=bash_source kvtier" in text
    group = main.get_command(click.Context(main), "stats")
    assert not group.get_command(click.Context(group), "why").get_short_help_str().endswith("...")


# -- --version ------------------------------------------------------------------------
def test_version_lists_the_components():
    out = run_kvtier("--version", env=PIPE)
    assert out.returncode == 0, out.stderr
    assert ESC not in out.stdout
    names = [line.split()[0] for line in out.stdout.splitlines()]
    assert names == ["kvtier", "kvtier-client", "grpcio", "protobuf", "Python", "CuPy", "CUDA"]
    lines = dict(line.split(None, 1) for line in out.stdout.splitlines())
    assert lines["kvtier"] == "0.1.0" and re.fullmatch(r"\d+\.\d+.*", lines["grpcio"])
    assert lines["CuPy"]  # a version, or "not installed": never an error without a GPU


def test_version_with_cupy_absent(monkeypatch):
    import builtins

    from kvtier import cli

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy":
            raise ModuleNotFoundError("No module named 'cupy'", name="cupy")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    rows = dict(cli.version_rows())
    assert rows["CuPy"] == "not installed" and rows["CUDA"] == "not available"


# -- the benchmarks' progress ---------------------------------------------------------
def test_bench_progress_plain_in_a_pipe_and_a_bar_on_a_terminal(monkeypatch, capsys):
    harness = pytest.importorskip("kvtier_bench.harness")
    monkeypatch.setenv("TTY_COMPATIBLE", "0")
    progress = harness.progress_lines(False)
    with harness.progress_bar(progress, "reps", 3) as advance:
        for i in range(3):
            progress(f"repetition {i + 1} of 3")
            advance()
    err = capsys.readouterr().err
    assert err.splitlines() == ["... repetition 1 of 3", "... repetition 2 of 3", "... repetition 3 of 3"]

    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    progress = harness.progress_lines(False)
    with harness.progress_bar(progress, "reps", 2) as advance:
        progress("repetition 1 of 2")
        advance()
        advance()
    err = capsys.readouterr().err
    assert ESC in err and "reps" in err and "eta" in err and "... repetition 1 of 2" in err

    quiet = harness.progress_lines(True)  # --json: nothing at all
    with harness.progress_bar(quiet, "reps", 2) as advance:
        quiet("hidden")
        advance()
    assert capsys.readouterr().err == ""


def test_bench_summaries_are_whole_sentences():
    pytest.importorskip("kvtier_bench.cli")
    listing = help_of("bench").split("Commands:", 1)[1].split("Examples:", 1)[0]
    summaries = [line.strip() for line in listing.splitlines() if line.strip()]
    assert {s.split()[0] for s in summaries} >= {"all", "tiers", "rpc", "disk", "trace", "cluster", "e2e"}
    assert not any(s.endswith("...") for s in summaries), summaries


# -- kvtier bench without the benchmarks ----------------------------------------------------
@pytest.mark.parametrize("args", [("bench", "--help"), ("bench",), ("bench", "tiers", "-h")])
def test_bench_help_without_the_benchmarks_says_how_to_install_them(monkeypatch, args):
    for name in ("kvtier_bench", "kvtier_bench.cli"):  # as if kvtier-bench were not installed
        monkeypatch.setitem(sys.modules, name, None)
    result = CliRunner().invoke(main, list(args), terminal_width=400)
    assert result.exit_code == 0, result.output
    assert "not installed here: pip install -e ./benchmarks" in result.output and "Usage:" in result.output


_WITHOUT_BENCH = """
import sys
sys.modules["kvtier_bench"] = None  # as if kvtier-bench were not installed
from kvtier.cli import main
main(sys.argv[1:], prog_name="kvtier")
"""


def test_a_bench_without_the_benchmarks_exits_2_with_one_line():
    out = subprocess.run([sys.executable, "-c", _WITHOUT_BENCH, "bench", "tiers", "--quick"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [f"kvtier bench: the benchmarks are not installed; {BENCH_INSTALL}"]
    assert "pip install -e ./benchmarks" in BENCH_INSTALL


#: What `kvtier stats` may load of kvtier: the CLI, the admin commands and their units.
STATS_LOADS = {"kvtier", "kvtier.cli", "kvtier.admin", "kvtier.units"}
#: Libraries only the daemon needs (the cluster tier, events, the disk's index, tensors).
DAEMON_ONLY = ("redis", "zmq", "lmdb", "torch", "cupy")


def test_kvtier_stats_loads_the_client_side_only(daemon):
    """`kvtier stats` against a daemon imports no module of the daemon's core, policies,
    mechanism or server, nor what only they need: an admin command is light, and a rule it
    reads (a miss reason, a tier) comes from the client package both sides share."""
    probe = ("import sys\nfrom kvtier.cli import main\n"
             f"main(['stats', '--target', {daemon.target!r}], standalone_mode=False)\n"
             "print('MODULES', ' '.join(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **PIPE})
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.rsplit("MODULES ", 1)[1].split()
    assert {m for m in loaded if m == "kvtier" or m.startswith("kvtier.")} == STATS_LOADS
    assert [m for m in loaded if m.split(".")[0] in DAEMON_ONLY] == []
