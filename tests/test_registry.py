"""Codecs, eviction policies and cluster backends are registered by name in one place each
(kvtier.registry), and come in from outside kvtier by module path or entry point: here a
plugin package written into tmp_path and put on sys.path (tests/plugin_package.py), used
in this process. tests/client/test_plugins.py runs it in real daemons."""
from __future__ import annotations

import re

import numpy as np
import pytest
from click.testing import CliRunner
from kvtier_client.layout import PageLayout
from plugin_package import write_plugin

from kvtier.codecs import CODECS, OUT_OF_TREE_IDS, codec_named, decoder
from kvtier.mechanism.cluster import BACKENDS, check_url, open_backend
from kvtier.policy import POLICIES, make_policy
from kvtier.registry import Registry, RegistryError
from kvtier.server.cli import serve
from kvtier.server.config import ConfigError, load_config

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=32, block_tokens=16, dtype="float16")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))  # entry points are read from sys.path as it is
    return write_plugin(tmp_path / "plugins", codec_id=OUT_OF_TREE_IDS.start + 77)


def test_a_policy_by_module_path_and_by_entry_point(plugin):
    for name in (plugin.policy, plugin.policy_entry):
        assert name not in POLICIES.builtin
        policy = make_policy(name, 4)
        for i in range(3):
            policy.add(("ns", bytes([i])), None)
        assert policy.name == "mru" and policy.victims(1, lambda ref: False) == [("ns", b"\x02")]
    assert POLICIES[plugin.policy] is POLICIES[plugin.policy_entry]  # one class, two spellings
    assert plugin.policy_entry in list(POLICIES) and plugin.policy not in list(POLICIES)  # a path is no name


def test_a_codec_from_outside_encodes_and_its_pages_read_by_id(plugin):
    page = np.zeros(LAYOUT.page_bytes, np.uint8)
    page[::7] = 3
    codec = codec_named(plugin.codec, LAYOUT)
    encoded = codec.encode(memoryview(page))
    assert encoded.codec == plugin.codec_id and len(encoded.data) < LAYOUT.page_bytes // 4
    out = bytearray(LAYOUT.page_bytes)
    assert decoder(plugin.codec_id, LAYOUT).decode_into(encoded.data, memoryview(out)) and bytes(out) == page.tobytes()
    assert CODECS[plugin.codec_entry] is CODECS[plugin.codec]


def test_a_page_of_a_plugin_codec_no_option_names_is_read_through_its_entry_point(tmp_path, monkeypatch):
    plugin = write_plugin(tmp_path / "plugins", codec_id=OUT_OF_TREE_IDS.start + 78)
    assert decoder(plugin.codec_id, LAYOUT) is None  # not installed yet: a miss, as any unknown codec
    other = write_plugin(tmp_path / "other", codec_id=OUT_OF_TREE_IDS.start + 79)
    monkeypatch.syspath_prepend(str(other.path))
    found = decoder(other.codec_id, LAYOUT)  # never named: found among the entry points
    assert found is not None and type(found).__module__ == other.module


@pytest.mark.parametrize("codec_id", [0, 3, 127, 256])
def test_a_codec_id_outside_the_range_for_plugins_is_refused(tmp_path, monkeypatch, codec_id):
    plugin = write_plugin(tmp_path / "plugins", codec_id=codec_id, entry_points=False)
    monkeypatch.syspath_prepend(str(plugin.path))
    with pytest.raises(RegistryError, match=f"has id {codec_id}: a codec from outside kvtier takes an id from 128 to 255"):
        CODECS[plugin.codec]
    assert plugin.codec not in list(CODECS)


def test_two_codecs_with_one_id_are_refused(tmp_path, monkeypatch):
    first = write_plugin(tmp_path / "a", codec_id=OUT_OF_TREE_IDS.start + 80, entry_points=False)
    second = write_plugin(tmp_path / "b", codec_id=OUT_OF_TREE_IDS.start + 80, entry_points=False)
    monkeypatch.syspath_prepend(str(first.path))
    monkeypatch.syspath_prepend(str(second.path))
    CODECS[first.codec]
    with pytest.raises(RegistryError, match=rf"has id 208, which {first.module}.ZlibCodec already has"):
        CODECS[second.codec]
    assert type(decoder(208, LAYOUT)).__module__ == first.module  # the pages of the first stay its own


def test_a_cluster_backend_by_entry_point_opens_its_store(plugin, tmp_path):
    url = f"{plugin.scheme}://{tmp_path / 'store'}"
    check_url(url)
    with pytest.raises(ValueError, match="absolute directory"):
        check_url(f"{plugin.scheme}://relative")
    store = open_backend(url, timeout=0.5)
    assert store.put([(b"k", (b"head", b"body"))]) == [True]
    assert store.get([b"k", b"absent"]) == [(b"head", b"body"), None]
    assert plugin.scheme in BACKENDS.names()
    load_config(None, {}, {"cluster": url, "socket": str(tmp_path / "s.sock")})


def test_unknown_names_fail_listing_the_known_ones_and_how_to_add_one(tmp_path):
    socket = ("--socket", str(tmp_path / "s.sock"))
    for flags, wanted in (
        (("--policy", "mru"), "policy: unknown eviction policy 'mru'; known: lru, prefix, frecency, arc, s3fifo, "
                              'tinylfu. To add one, give its module path (mypkg.module:Name) or register it under the '
                              'entry point group "kvtier.policies" (docs/policies.md, "Adding a policy")'),
        (("--codec", "zfp"), "codec: unknown codec 'zfp'; known: identity, zstd, k16v8, fp8, int4, int8. To add one, "
                             'give its module path (mypkg.module:Name) or register it under the entry point group '
                             '"kvtier.codecs" (docs/tiers.md, "Adding a codec")'),
        (("--codec", "no_such_package.codecs:Zfp"), "codec: codec 'no_such_package.codecs:Zfp' does not load: "
                                                    "ModuleNotFoundError: No module named 'no_such_package'"),
        (("--cluster", "mooncake://user:secret@10.0.0.5:50051"),
         "cluster: cluster address must start with one of redis://, rediss://, valkey://, valkeys:// (got mooncake://). "
         'To add one, register it under the entry point group "kvtier.cluster_backends" (docs/tiers.md, '
         '"Adding a cluster backend")'),
    ):
        result = CliRunner().invoke(serve, [*socket, *flags])
        assert result.exit_code == 2, result.output
        # (names a plugin of another test registered in this process may follow the built-in ones)
        said = re.sub(r"(tinylfu|int8|valkeys://)(, \w+(://)?)*", r"\1", " ".join(result.output.split()))
        assert f"kvtier serve: {wanted}" in said, result.output
        assert "secret" not in result.output


def test_a_policy_that_is_not_one_fails_when_named(tmp_path, monkeypatch):
    (tmp_path / "half_policy.py").write_text("class Half:\n    name = 'half'\n    def __init__(self, capacity): pass\n"
                                             "    def add(self, ref, parent): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="policy: eviction policy 'half_policy:Half' makes a Half without touch, "
                                          "remove, victims, __len__"):
        load_config(None, {}, {"policy": "half_policy:Half", "socket": str(tmp_path / "s.sock")})


def test_a_registry_refuses_a_taken_name_and_an_entry_point_never_shadows_a_builtin(tmp_path, monkeypatch, caplog):
    info = tmp_path / "shadow-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shadow\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvtier.test_registry]\nbuilt = os:getcwd\nextra = os:getpid\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry("test part", "kvtier.test_registry", "nowhere", {"built": len})
    assert registry["built"] is len and registry["extra"].__name__ == "getpid"
    assert "ignored" in caplog.text  # the entry point named like the built-in
    registry.register("mine", abs)
    registry.register("mine", abs)  # the same entry again: nothing to refuse
    with pytest.raises(RegistryError, match="test part name 'mine' is taken"):
        registry.register("mine", round)
    assert list(registry) == ["built", "extra", "mine"]
