"""The option table (kvtier.server.config.OPTIONS) is the one description of the daemon's
configuration: the typed tree, `kvtier serve --help` and docs/configuration.md must all agree
with it. In-process and quick: nothing here starts a daemon."""
from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.mechanism.disk import FsyncPolicy
from kvtier.server.cli import serve
from kvtier.server.config import OPTIONS, AuthMode, ConfigError, DaemonConfig, LogFormat, docs_rows, load_config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_field_of_the_tree_has_one_option():
    sections = typing.get_type_hints(DaemonConfig)
    fields = {(name, f.name) for name, section in sections.items() for f in dataclasses.fields(section)}
    options = [(o.section, o.attr) for o in OPTIONS]
    assert len(options) == len(set(options))
    assert set(options) == fields


def test_docs_table_matches_the_options():
    rows = [line for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    expected = docs_rows()
    assert len(rows) == len(expected), "docs/configuration.md lists other keys than kvtier.server.config.OPTIONS"
    for row, start in zip(rows, expected):
        assert row.startswith(start), f"docs/configuration.md: {row[:60]!r} should start {start!r}"


def test_help_shows_each_flag_with_its_variable_and_default():
    text = CliRunner().invoke(serve, ["--help"], terminal_width=400).output
    # One entry per option, whatever the wrapping: each starts on a line of its own.
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=--)", text)]
    for o in OPTIONS:
        entry = next((e for e in entries if e.startswith(o.flag + " ")), "")
        assert o.env in entry and f"default: {o.default_text}]" in entry, f"{o.flag}: {entry!r}"
    assert "--host-size SIZE" in text and "--session-timeout DURATION" in text and "--policy [lru|prefix|frecency|arc|s3fifo|tinylfu|MODULE:NAME]" in text


def test_defaults_and_precedence_build_a_typed_tree(tmp_path):
    config_file = tmp_path / "kvtier.toml"
    config_file.write_text('host_size = "2MiB"\npolicy = "prefix"\nfsync = "never"\nsession_timeout = "1s"\n')
    env = {"KVTIER_HOST_SIZE": "3MiB", "KVTIER_LOG_FORMAT": "text", "KVTIER_SOCKET": str(tmp_path / "s.sock")}
    cfg = load_config(str(config_file), env, {"host_size": "4MiB", "metrics_port": None})
    assert cfg.tiers.host_size == 4 << 20  # the flag beats the environment and the file
    assert (cfg.tiers.policy, cfg.tiers.fsync, cfg.log.format) == ("prefix", FsyncPolicy.NEVER, LogFormat.TEXT)
    assert cfg.sessions.session_timeout == 1.0 and cfg.sessions.drain_timeout == 10.0
    assert cfg.auth.mode is AuthMode.NONE and cfg.listen.socket == str(tmp_path / "s.sock")
    assert cfg.tiers.arena_prefix.startswith("kvtier-") and cfg.tiers.disk_size == 8 << 30


@pytest.mark.parametrize("env, message", [
    ({"KVTIER_POLICY": "mru"}, "policy: unknown eviction policy 'mru'; known: lru, prefix, frecency, arc, s3fifo, tinylfu"),
    ({"KVTIER_FSYNC": "True"}, "fsync: unknown 'True'; use batch, interval or never"),
    ({"KVTIER_AUTH": "ldap"}, "auth: unknown 'ldap'; use tokens or none"),
    ({"KVTIER_AUTH": "tokens"}, "auth = tokens needs tokens_file"),
    ({"KVTIER_IO_DEPTH": "0"}, "io_depth must be between 1 and 256"),
    ({"KVTIER_PREFETCH_HOLD": "soon"}, "prefetch_hold: cannot read 'soon' as a duration"),
    ({"KVTIER_DISK_ADMISSION": "lfu"}, "disk_admission: unknown 'lfu'; use all or reuse"),
    ({"KVTIER_DISK_ADMISSION_THRESHOLD": "2"}, "disk_admission_threshold: '2' is not between 0 and 1"),
    ({"KVTIER_DISK_ADMISSION_THRESHOLD": "often"}, "disk_admission_threshold: 'often' is not a number"),
])
def test_refusals_name_the_key(env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, env, {})
