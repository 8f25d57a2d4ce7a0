"""Compressed lower tiers end to end (kvtier.codecs, docs/tiers.md "Codecs"): a real daemon
writes each namespace's disk pages with its codec, in fewer chunks, and reads them back
decoded; pages of another codec written before a change still read; an encoded page that
fails its checksum, or names a codec this kvtier does not know, is a miss, never served."""
from __future__ import annotations

import signal

import grpc
import lmdb
import numpy as np
from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import Conn, expect_code, run_kvtier, tier_stats, wait_for
from test_async_loads import Store, disk_offset

from kvtier.mechanism.disk_index import encode_key

#: 16 layers x 2 heads x 64 dim x 16 tokens, float16: 128 KiB pages, 32 chunks of 4 KiB.
LAYOUT = pb.PageLayout(layers=16, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16", order="page_first")
PAGE = 16 * 2 * 16 * 2 * 64 * 2
TIERS = {"host_size": f"{8 * PAGE}", "disk_size": f"{16 * PAGE}"}


class KVStore(Store):
    """Pages of KV-like float16 values (what lossy codecs are for), with outlier key channels."""

    def content(self, key: bytes) -> bytes:
        rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
        kv = rng.standard_normal((16, 2, 16, 2, 64)).astype(np.float32)
        kv[:, 0, :, :, :3] *= 20
        return kv.astype(np.float16).tobytes()


def keys(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i:04d}".encode().ljust(16, b"-") for i in range(n)]


def values(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.float16).astype(np.float32)


def round_trip(st: KVStore, ks: list[bytes]) -> list[bytes]:
    st.put(ks)
    base = st.push_to_disk()
    lease = st.acquire(ks)
    assert lease.ready == len(ks)
    got = [st.arena.read(slot) for slot in lease.slots]
    st.s.release(lease.lease_id)
    st.settle(base)
    return got


def test_fp8_pages_take_about_half_the_disk_and_come_back_within_fp8_precision(daemons):
    d = daemons.start("--codec", "fp8", **TIERS)
    st = KVStore(Conn(d.target), "fp8", LAYOUT)
    disk = st.disk()
    raw_pages = 16
    assert disk.capacity_pages >= 1.8 * raw_pages  # the codec's room, in pages
    ks = keys("a", 6)
    for key, data in zip(ks, round_trip(st, ks)):
        want, got = values(st.content(key)), values(data)
        assert data != st.content(key)  # lossy: not the bytes written...
        assert np.all(np.abs(got - want) <= np.abs(want) / 16 + 2.0 ** -9)  # ...within FP8 e4m3's precision
    disk = st.disk()
    assert disk.cached_pages == 6 and disk.capacity_bytes == 16 * PAGE
    assert 1.8 <= 6 * PAGE / disk.stored_bytes <= 2.0
    assert disk.free_bytes == disk.capacity_bytes - 6 * 17 * 4096  # 16 chunks of values, one of scales
    out = run_kvtier("stats", "--socket", str(d.socket), env={"TTY_COMPATIBLE": "0", "COLUMNS": ""})
    row = next(line.split() for line in out.stdout.splitlines() if line.split()[:1] == ["disk"])
    assert row[-1] == f"{6 * PAGE / disk.stored_bytes:.2f}x" and "of" in row  # raw, stored of room, ratio


def test_namespaces_keep_their_own_codecs_and_a_change_leaves_older_pages_readable(daemons, tmp_path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[namespaces.lossless]\ncodec = "zstd"\n[namespaces.raw]\ncodec = "identity"\n')
    d = daemons.start("--codec", "int4", "--auth", "none", "--tokens-file", str(tokens), **TIERS)
    conn = Conn(d.target)
    exact, raw, small = KVStore(conn, "lossless", LAYOUT), KVStore(conn, "raw", LAYOUT), KVStore(conn, "small", LAYOUT)
    for st, name in ((exact, "z"), (raw, "r")):
        ks = keys(name, 2)
        assert round_trip(st, ks) == [st.content(k) for k in ks], name  # lossless and identity: every byte
    ks = keys("s", 2)
    for key, data in zip(ks, round_trip(small, ks)):
        assert np.abs(values(data) - values(small.content(key))).max() < 10  # int4: the default, lossy
    first = tier_stats(conn.state(), exact.pool, pb.TIER_DISK)
    assert first.stored_bytes < 6 * PAGE  # zstd and int4 pages took less than their raw size
    conn.close()
    d.stop()
    d2 = daemons.start("--codec", "identity", name="d", **TIERS)  # the same cache directory, codec changed
    conn = Conn(d2.target)
    again = KVStore(conn, "lossless", LAYOUT)
    lease = again.acquire(keys("z", 2))
    assert lease.ready == 2 and [again.arena.read(s) for s in lease.slots] == [again.content(k) for k in keys("z", 2)]
    again.s.release(lease.lease_id)


def test_a_flipped_encoded_byte_is_dropped_and_an_unknown_codec_is_a_miss(daemons):
    d = daemons.start("--codec", "fp8", **TIERS)
    conn = Conn(d.target)
    st = KVStore(conn, "bad", LAYOUT)
    ks = keys("b", 3)
    st.put(ks)
    st.push_to_disk()
    pool, cache = st.pool, d.cache_dir
    at = disk_offset(cache, pool, "bad", ks[1], PAGE)
    conn.close()
    d.stop()  # the index is read at start: tamper with it while no daemon holds it
    with open(cache / pool / "slab.bin", "r+b") as slab:
        slab.seek(at + 100)
        byte = slab.read(1)
        slab.seek(at + 100)
        slab.write(bytes([byte[0] ^ 0x10]))
    env = lmdb.open(str(cache / pool / "index.lmdb"), max_dbs=2)
    try:
        with env.begin(write=True, db=env.open_db(b"pages")) as txn:
            raw = bytearray(txn.get(encode_key("bad", ks[2])))
            raw[12] = 99  # the codec field (kvtier.mechanism.disk_index): a newer kvtier's codec
            txn.put(encode_key("bad", ks[2]), bytes(raw))
    finally:
        env.close()
    d = daemons.start("--codec", "fp8", name="d", **TIERS)
    st = KVStore(Conn(d.target), "bad", LAYOUT)
    base = st.host()
    for key in ks[1:]:  # k1 fails its checksum, k2's codec is unknown: neither is served
        expect_code(grpc.StatusCode.NOT_FOUND, st.acquire, [key])
    st.settle(base)
    lease = st.acquire(ks[:1])
    want = values(st.content(ks[0]))
    assert lease.ready == 1 and np.all(np.abs(values(st.arena.read(lease.slots[0])) - want) <= np.abs(want) / 16 + 2.0 ** -9)
    disk = st.disk()
    assert disk.corrupt_pages == 2 and disk.cached_pages == 1
    assert "codec id 99, which this kvtier does not know" in d.log()


def test_a_reload_that_changes_a_namespaces_codec_takes_effect_for_new_pages(daemons, tmp_path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text("[namespaces.t]\n")
    d = daemons.start("--codec", "int4", "--auth", "none", "--tokens-file", str(tokens), **TIERS)
    st = KVStore(Conn(d.target), "t", LAYOUT)
    before = keys("x", 2)
    st.put(before)
    st.push_to_disk()  # written as int4: a quarter of the chunks
    tokens.write_text('[namespaces.t]\ncodec = "identity"\n')
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reloaded the tokens file" in d.log(), 10, "the reload")
    after = keys("y", 2)
    got = round_trip(st, after)  # as they are now: a raw page's chunks each, never too few
    assert got == [st.content(k) for k in after]
    lease = st.acquire(before)  # the int4 pages still decode
    assert lease.ready == 2
    st.s.release(lease.lease_id)
    assert st.disk().io_errors == 0
