"""A hypothesis state machine over a real Pool (host memory files + LMDB disk tier).

Random sequences of borrow / commit / lookup / acquire / prefetch / release / end_session /
write-back steps, with caller mistakes (too many pages, wrong session, released leases,
uncached keys, duplicate keys, quotas that cannot be kept) and injected failures (a rotten
byte in a disk page on disk, a disk whose writes fail), over three namespaces with random
quotas. Evictions of dirty pages and write-through commits go through the out-of-lock
write path (write out, then run the request again / file the copies); a `write_back` rule
cleans with a random reserve. After each step the test waits until no disk write or index
deletion is in flight, so the state between steps is settled. After every step: the store's
invariants hold, the disk index agrees, every page a read lease holds and every cached host
and disk page holds the bytes committed under its key, a borrowed page never carries
another namespace's bytes, no namespace is above its maximum, and a request of one
namespace took no other below its guarantee. A lookup counts each miss under the reason
`explain` gives. A refused request must leave the whole state (snapshot) unchanged; only a
checksum failure may change it (it drops pages).
"""
from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import tempfile
import uuid
from collections import Counter
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvtier_client.errors import CapacityError, FailedPrecondition, InvalidArgument, NotFound
from kvtier_client.layout import PageLayout
from kvtier_client.tiers import Tier

from kvtier.codecs import CodecChoice
from kvtier.core import BlockState, MissReason, Quota
from kvtier.core.chunks import chunks_in
from kvtier.core.invariants import check_guarantees_kept, check_quotas_kept
from kvtier.policy.classes import Rank
from kvtier_client.steering import PinMode, Priority
from kvtier.mechanism.directio import aligned_buffer
from kvtier.server.config import default_tiers
from kvtier.server.pools import Pool

from store_helpers import check, read_page, snapshot, write_page

LAYOUT = PageLayout(layers=4, kv_heads=1, head_dim=64, block_tokens=16)  # 16 KiB pages: 4 disk chunks each
HOST_PAGES, DISK_PAGES = 3, 5
NAMESPACES = ("A", "B", "C")
SESSIONS = ("s1", "s2")
KEYS = [bytes([i]) * 8 for i in range(1, 7)]  # a small universe, so keys collide often
FP = 64  # bytes of a page that identify what was written there; corruption happens after them
SHM_DIR = "/dev/shm"  # host memory must never show up here

keys_st = st.lists(st.sampled_from(KEYS), min_size=0, max_size=5)
#: Guarantees of at most one page each always fit (3 namespaces, 3 host pages).
quota_st = st.builds(
    lambda max_host, max_disk, g_host, g_disk: Quota(
        max_host, max_disk, min(g_host, max_host) if max_host else g_host, min(g_disk, max_disk) if max_disk else g_disk
    ),
    st.integers(0, HOST_PAGES), st.integers(0, DISK_PAGES), st.integers(0, 1), st.integers(0, 1),
)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: Pool | None = None
        self.prefix = f"kvtier-test-{uuid.uuid4().hex[:12]}"
        self.dir = tempfile.mkdtemp(prefix="kvtier-stateful-")
        self.content: dict[tuple[str, bytes], bytes] = {}  # ref -> bytes committed under it
        self.owner_of_fp: dict[bytes, str] = {}  # first FP bytes of everything written -> namespace
        self.leases: dict[int, tuple[str, str, str, tuple[int, ...], tuple]] = {}  # id -> session, ns, kind, slots, refs
        self.ended: list[tuple[int, str]] = []  # (lease id, its session) no longer live
        self.corrupt: set[tuple[str, bytes, int]] = set()  # (ns, key, seq) of rotten disk pages
        self.version = itertools.count()
        self.disk_failing = False
        self.pinned_host: set[tuple[str, bytes]] = set()  # hard-pinned refs with a host copy, at the last step

    # -- set-up and teardown --------------------------------------------------
    @initialize(policy=st.sampled_from(["lru", "prefix", "frecency"]), write_through=st.booleans(),
                quotas=st.dictionaries(st.sampled_from(NAMESPACES), quota_st, max_size=len(NAMESPACES)),
                admission=st.sampled_from(["all", "reuse"]), codec=st.sampled_from(["identity", "zstd"]))
    def start(self, policy, write_through, quotas, admission, codec):
        self.config = default_tiers(
            host_size=HOST_PAGES * LAYOUT.slot_bytes,
            disk_size=DISK_PAGES * LAYOUT.slot_bytes,
            cache_dir=self.dir,
            policy=policy,
            # reuse at threshold 1: a kind of page is refused once any of its pages stays away
            disk_admission=admission,
            disk_admission_threshold=1.0,
            write_through=write_through,
            fsync="never",
            arena_prefix=self.prefix,
        )
        self.codecs = CodecChoice(codec)  # zstd: pages of 1 to 4 chunks, mixed on one disk
        self.pool = Pool(LAYOUT, self.config, codecs=self.codecs)
        self.quotas = quotas
        self.store.set_quotas(quotas)

    def teardown(self) -> None:
        try:
            if self.pool is not None:
                self.pool.close()
                assert not [n for n in os.listdir(SHM_DIR) if self.prefix in n]
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def store(self):
        return self.pool.store

    # -- helpers --------------------------------------------------------------
    def fresh_bytes(self, namespace: str, key: bytes) -> bytes:
        seed = hashlib.sha256(b"%s|%s|%d" % (namespace.encode(), key, next(self.version))).digest()
        rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
        # Random bytes after the first FP, or a page that compresses to a fraction of its size.
        values = int(rng.choice([256, 16, 2]))
        data = (rng.integers(0, 256, FP, dtype=np.uint8).tobytes()
                + rng.integers(0, values, LAYOUT.page_bytes - FP, dtype=np.uint8).tobytes())
        self.owner_of_fp[data[:FP]] = namespace
        return data

    def refused(self, call, *errors):
        """Run a call expected to be refused: it raises one of `errors` and changes nothing."""
        before = snapshot(self.pool)
        try:
            result = call()
        except errors:
            assert snapshot(self.pool) == before
            return None
        raise AssertionError(f"expected one of {errors}, got {result!r}")

    @contextmanager
    def request_of(self, namespace: str):
        """The steps inside are one namespace's request: no other may lose pages below its
        guarantee."""
        before = self.store.stats()
        yield
        if not self.disk_failing:  # disk pages evicted for a write that then failed are gone
            check_guarantees_kept(before, self.store.stats(), namespace)

    def settle(self) -> None:
        """Wait for the disk writes commits queued (write-through) and for the index
        deletions a load's I/O thread makes after waking its request (a rotten page): what
        the next step draws from must not depend on how fast those threads ran."""
        assert self.store.wait_saved(10), "disk writes or index deletions did not finish"

    def live(self, kind: str | None = None) -> list[int]:
        return sorted(i for i, lease in self.leases.items() if kind is None or lease[2] == kind)

    # -- rules ----------------------------------------------------------------
    @rule(session=st.sampled_from(SESSIONS), namespace=st.sampled_from(NAMESPACES), n=st.integers(-1, HOST_PAGES + 1))
    def borrow(self, session, namespace, n):
        if not 0 < n <= HOST_PAGES:
            self.refused(lambda: self.store.borrow(session, namespace, n), InvalidArgument)
            return
        if n == HOST_PAGES and any(lease[3] for lease in self.leases.values()):  # an empty read lease holds nothing
            # The whole tier, while some page is leased: refused, nothing changed.
            self.refused(lambda: self.store.borrow(session, namespace, n), CapacityError)
            return
        before = snapshot(self.pool)
        try:
            with self.request_of(namespace):
                lease = self.store.borrow(session, namespace, n)
        except CapacityError as exc:
            event("borrow: quota" if "quota" in str(exc) else "borrow: capacity error")
            assert snapshot(self.pool) == before
            return
        for slot in lease.slots:
            head = read_page(self.pool, slot)[:FP]
            if head != bytes(FP):
                assert self.owner_of_fp.get(head) == namespace, f"borrowed slot {slot} carries another namespace's bytes"
        self.leases[lease.lease_id] = (session, namespace, "write", lease.slots, ())

    @rule(
        session=st.sampled_from(SESSIONS),
        namespace=st.sampled_from(NAMESPACES),
        start=st.integers(0, len(KEYS) - 1),
        n=st.integers(1, 3),
    )
    def put(self, session, namespace, start, n):
        """The common path in one step: borrow n pages, fill them, commit a chain of keys."""
        keys = KEYS[start : start + n]
        parent = KEYS[start - 1] if start else None
        try:
            with self.request_of(namespace):
                lease = self.store.borrow(session, namespace, len(keys))
        except CapacityError:
            return
        self.leases[lease.lease_id] = (session, namespace, "write", lease.slots, ())
        cached_before = set(self.store.blocks)
        for slot, key in zip(lease.slots, keys):
            data = self.fresh_bytes(namespace, key)
            write_page(self.pool, slot, data)
            if (namespace, key) not in cached_before:
                self.content[(namespace, key)] = data
        with self.request_of(namespace):
            result = self.store.commit(session, lease.lease_id, keys, parent)
            self.settle()
        assert result.duplicates == tuple(i for i, k in enumerate(keys) if (namespace, k) in cached_before)
        if result.duplicates:
            event("commit: duplicates")
        self.end(lease.lease_id)

    @precondition(lambda self: self.live("write"))
    @rule(data=st.data(), keys=keys_st, use_parent=st.booleans(), mistake=st.sampled_from(["none"] * 6 + ["session", "too many"]))
    def commit(self, data, keys, use_parent, mistake):
        lease_id = data.draw(st.sampled_from(self.live("write")))
        session, namespace, _, slots, _ = self.leases[lease_id]
        parent = data.draw(st.sampled_from([k for k in KEYS if k not in keys])) if use_parent else None
        if mistake == "session":
            other = next(s for s in SESSIONS if s != session)
            self.refused(lambda: self.store.commit(other, lease_id, keys[: len(slots)], parent), FailedPrecondition)
            return
        if mistake == "too many" or len(keys) > len(slots):
            keys = (keys + KEYS)[: len(slots) + 1]
            self.refused(lambda: self.store.commit(session, lease_id, keys, parent), InvalidArgument)
            return
        written = []
        for slot, key in zip(slots, keys):
            written.append(self.fresh_bytes(namespace, key))
            write_page(self.pool, slot, written[-1])
        cached_before = set(self.store.blocks)
        with self.request_of(namespace):
            result = self.store.commit(session, lease_id, keys, parent)
            self.settle()
        for i, key in enumerate(keys):
            ref = (namespace, key)
            seen = ref in cached_before or key in keys[:i]
            assert (i in result.duplicates) == seen, f"key {i} duplicate={i in result.duplicates}, cached before={seen}"
            if not seen:
                self.content[ref] = written[i]
        assert result.committed == len(keys) - len(result.duplicates)
        if result.duplicates:
            event("commit: duplicates")
        self.end(lease_id)

    @rule(namespace=st.sampled_from(NAMESPACES), keys=keys_st)
    def lookup(self, namespace, keys):
        explained = self.store.explain(namespace, keys)
        counted = self.misses(namespace)
        result = self.store.lookup(namespace, keys)
        for i, key in enumerate(keys[: result.hit_blocks]):
            assert result.tiers[i] == min(self.store.blocks[(namespace, key)].copies)
        if result.hit_blocks < len(keys):
            assert (namespace, keys[result.hit_blocks]) not in self.store.blocks
        # Each miss is counted under the reason explain gives, and explain agrees with the index.
        assert explained.hit_blocks == result.hit_blocks
        reasons = Counter(b.state.value for b in explained.blocks[result.hit_blocks :])
        assert Counter(self.misses(namespace)) - Counter(counted) == reasons
        corrupted = {(ns, key) for ns, key, _ in self.corrupt}
        for status, key in zip(explained.blocks, keys):
            ref = (namespace, key)
            block = self.store.blocks.get(ref)
            assert (block is not None) == (status.state in (BlockState.CACHED, BlockState.BEYOND_PREFIX))
            if block is not None:
                assert status.tier == min(block.copies)
            elif status.state is not BlockState.NEVER_STORED:
                assert ref in self.content and status.seconds_ago >= 0
                assert status.state in (BlockState.EVICTED, BlockState.DROPPED) or ref in corrupted
                event(f"lookup: {status.state.value}")

    def misses(self, namespace: str) -> dict[str, int]:
        usage = self.store.stats().namespace(namespace)
        return dict(usage.misses) if usage else {r.value: 0 for r in MissReason}

    @rule(
        session=st.sampled_from(SESSIONS),
        namespace=st.sampled_from(NAMESPACES),
        data=st.data(),
        extra=st.sampled_from([None, None, None, "uncached", "twice"]),
    )
    def acquire(self, session, namespace, data, extra, keys=None):
        if keys is None:
            cached_keys = sorted(k for ns, k in self.store.blocks if ns == namespace)
            keys = data.draw(st.lists(st.sampled_from(cached_keys), unique=True, max_size=HOST_PAGES) if cached_keys else st.just([]))
        if extra == "uncached":
            keys.append(data.draw(st.sampled_from(KEYS)))
        elif extra == "twice" and keys:
            keys.append(keys[0])
        before = snapshot(self.pool)
        cached = all((namespace, k) in self.store.blocks for k in keys)
        try:
            with self.request_of(namespace):
                lease = self.store.acquire(session, namespace, keys)
        except NotFound as exc:
            if "checksum" in str(exc):
                event("acquire: checksum failure")
                # Rotten pages that had to be loaded were dropped from disk; no lease was
                # opened and no pin taken by the call survives.
                assert cached
                dropped = [k for k in keys if set(before["blocks"][(namespace, k)][1]) == {Tier.DISK}
                           and (namespace, k, before["blocks"][(namespace, k)][1][Tier.DISK][2].seq) in self.corrupt]
                assert dropped
                for k in dropped:
                    assert (namespace, k) not in self.store.blocks
                assert self.store.leases.keys() == before["leases"].keys()
                for ref, block in self.store.blocks.items():
                    for tier, copy in block.copies.items():
                        was = before["blocks"].get(ref, (None, {}))[1].get(tier)
                        assert copy.pins == (was[1] if was else 0)
            else:
                assert not cached
                assert snapshot(self.pool) == before
            return
        except (InvalidArgument, CapacityError) as exc:
            event(f"acquire: {type(exc).__name__}")
            assert snapshot(self.pool) == before
            return
        if lease.promoted:
            event("acquire: promoted from disk")
        assert cached and len(set(keys)) == len(keys) <= HOST_PAGES
        refs = tuple((namespace, k) for k in keys)
        self.leases[lease.lease_id] = (session, namespace, "read", lease.slots, refs)

    @rule(session=st.sampled_from(SESSIONS), data=st.data())
    def acquire_from_disk(self, session, data):
        """Acquire pages that are on disk only, so they must be promoted (or found rotten)."""
        disk_only = sorted(ref for ref, b in self.store.blocks.items() if set(b.copies) == {Tier.DISK})
        if not disk_only:
            return
        namespace = data.draw(st.sampled_from(sorted({ns for ns, _ in disk_only})))
        keys = data.draw(st.lists(st.sampled_from([k for ns, k in disk_only if ns == namespace]), unique=True, min_size=1, max_size=2))
        self.acquire(session, namespace, data, None, keys)

    @rule(namespace=st.sampled_from(NAMESPACES), keys=keys_st)
    def prefetch(self, namespace, keys):
        with self.request_of(namespace):
            loaded = self.store.prefetch(SESSIONS[0], namespace, keys)
            assert 0 <= loaded <= len(keys)
            assert self.store.wait_loaded(10), "prefetch loads did not finish"
        if loaded:
            event("prefetch: loaded")

    @rule(reserve=st.integers(0, HOST_PAGES))
    def write_back(self, reserve):
        """A write-back step with a clean reserve (the pool's own is 0 for so small a host):
        dirty pages at the eviction end get a disk copy and stay in host."""
        dirty = {ref for ref, b in self.store.blocks.items() if Tier.HOST in b.copies and Tier.DISK not in b.copies}
        wrote = self.store.write_back(reserve)
        self.settle()
        now_clean = {ref for ref in dirty if ref in self.store.blocks and Tier.DISK in self.store.blocks[ref].copies}
        assert len(now_clean) >= wrote
        assert all(Tier.HOST in self.store.blocks[ref].copies for ref in now_clean)
        if wrote:
            event("write-back: cleaned")

    @rule(session=st.sampled_from(SESSIONS), namespace=st.sampled_from(NAMESPACES),
          start=st.integers(0, len(KEYS) - 1), n=st.integers(1, 3))
    def put_on_failing_disk(self, session, namespace, start, n):
        """A put while every disk write fails (the slab is open read-only): evicted dirty
        pages are dropped, nothing is filed on disk, the failures are counted. (Disk pages
        evicted to make room for a write that then failed are lost, guarantees or not.)"""
        disk = self.pool.disk
        errors = self.store.stats().tier(Tier.DISK).counters.io_errors
        records = set(disk.records())
        saved_fd = os.dup(disk._fd)
        read_only = os.open(disk.slab_path, os.O_RDONLY)
        os.dup2(read_only, disk._fd)
        self.disk_failing = True
        try:
            self.put(session, namespace, start, n)
        finally:
            self.disk_failing = False
            os.dup2(saved_fd, disk._fd)
            os.close(saved_fd)
            os.close(read_only)
        assert set(disk.records()) <= records  # only deletions
        if self.store.stats().tier(Tier.DISK).counters.io_errors > errors:
            event("put: disk writes failed")

    @rule(data=st.data(), mistake=st.sampled_from(["none", "none", "none", "session", "ended", "unknown"]))
    def release(self, data, mistake):
        if mistake == "unknown":
            unknown = data.draw(st.sampled_from([0, -3, 10**6]))
            self.refused(lambda: self.store.release(SESSIONS[0], unknown), NotFound)
            return
        if mistake == "ended":
            if self.ended:
                lease_id, session = data.draw(st.sampled_from(self.ended))
                self.refused(lambda: self.store.release(session, lease_id), FailedPrecondition)
                self.refused(lambda: self.store.commit(session, lease_id, [KEYS[0]]), FailedPrecondition)
            return
        if not self.leases:
            return
        lease_id = data.draw(st.sampled_from(self.live()))
        session = self.leases[lease_id][0]
        if mistake == "session":
            other = next(s for s in SESSIONS if s != session)
            self.refused(lambda: self.store.release(other, lease_id), FailedPrecondition)
            return
        self.store.release(session, lease_id)
        self.end(lease_id)

    @rule(session=st.sampled_from(SESSIONS))
    def end_session(self, session):
        mine = [i for i, lease in self.leases.items() if lease[0] == session]
        assert self.store.end_session(session) == len(mine)
        for lease_id in mine:
            self.end(lease_id)

    @precondition(lambda self: self.pool is not None and any(True for _ in self.pool.disk.records()))
    @rule(data=st.data(), offset=st.integers(0, LAYOUT.page_bytes - 1))
    def rot_disk_page(self, data, offset):
        record = data.draw(st.sampled_from(sorted(self.pool.disk.records(), key=lambda r: r.seq)))
        if (record.namespace, record.key, record.seq) in self.corrupt:
            return  # already rotten: flipping the same byte again could heal it
        # A byte of what is stored; of a page stored as it is, after the FP bytes that name its writer
        # (a rotten page is read into its host slot before it fails; an encoded one never reaches it).
        at = offset % record.stored if record.codec else FP + offset % (record.stored - FP)
        chunk = self.pool.disk.chunk_bytes
        with open(self.pool.disk.slab_path, "r+b") as f:
            f.seek(chunks_in(record.extent)[at // chunk] * chunk + at % chunk)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x55]))
        self.corrupt.add((record.namespace, record.key, record.seq))

    @rule()
    def restart(self):
        """A clean stop and a new pool on the same disk directory: what the disk holds (host-only
        pages saved at close, as many as fit) comes back with its bytes; leases do not."""
        before = set(self.store.blocks)
        self.pool.close()
        assert not [n for n in os.listdir(SHM_DIR) if self.prefix in n]
        self.pool = Pool(LAYOUT, self.config, codecs=self.codecs)
        self.store.set_quotas(self.quotas)
        self.pool.hints.restore()  # hints with a TTL come back on the blocks that did
        self.pinned_host.clear()  # a restart brings pages back on disk only
        after = set(self.store.blocks)
        assert after <= before
        # DISK_PAGES pages stored as they are fill the disk; encoded ones may leave room for more.
        least, most = min(DISK_PAGES, len(before)), min(self.pool.disk.pages, len(before))
        if any(q.max_disk_pages or q.guaranteed_disk_pages for q in self.quotas.values()):
            assert len(after) <= most  # a quota may leave disk room unused
        else:
            assert least <= len(after) <= most
        # On disk only, but for restored hard pins, which load into host (kvtier.core.pin_loads).
        hints = self.store.control.hints
        for ref, block in self.store.blocks.items():
            pinned = hints.rank(ref) is Rank.HARD_PIN
            assert Tier.DISK in block.copies and set(block.copies) <= ({Tier.DISK, Tier.HOST} if pinned else {Tier.DISK})
        self.leases.clear()
        self.ended.clear()  # lease ids start again at 1 in the new store

    @rule(session=st.sampled_from(SESSIONS), namespace=st.sampled_from(NAMESPACES), keys=keys_st,
          how=st.sampled_from([PinMode.HARD, PinMode.SOFT, Priority.HIGH, Priority.COLD, "unpin"]),
          ttl=st.sampled_from([0, 600]))
    def hint(self, session, namespace, keys, how, ttl):
        """Pins and retains: a hard pin past the namespace's guarantee is refused, changing nothing."""
        control = self.store.control
        if not keys:
            return
        if how == "unpin":
            control.unpin(namespace, keys)
        elif isinstance(how, Priority):
            control.retain(session, namespace, keys, how, ttl)
        elif how is PinMode.SOFT:
            control.pin(session, namespace, keys, how, ttl)
        else:
            refs = {(namespace, k) for k in keys if (namespace, k) in self.store.blocks}
            new = sum(1 for r in refs if control.hints.rank(r) is not Rank.HARD_PIN)
            quota = self.quotas.get(namespace)
            if control.hints.hard_pins(namespace) + new > (quota.guaranteed_host_pages if quota else 0):
                self.refused(lambda: control.pin(session, namespace, keys, how, ttl), CapacityError, FailedPrecondition)
            else:
                with self.request_of(namespace):
                    control.pin(session, namespace, keys, how, ttl)
                    # A hard pin prefetches disk-only blocks into host: let those loads land.
                    assert self.store.wait_loaded(10), "a hard pin's loads did not finish"

    @rule(namespace=st.sampled_from(NAMESPACES), keys=keys_st, drop=st.booleans())
    def demote_or_drop(self, namespace, keys, drop):
        """Demote to disk (host pages written first) or drop: blocks in use are skipped."""
        if not keys:
            return
        with self.request_of(namespace):
            result = (self.store.control.drop if drop else self.store.control.demote)(namespace, keys)
        assert result.applied + result.skipped + result.missing == len(set(keys))

    @rule(namespace=st.sampled_from(NAMESPACES), over=st.sampled_from(["guarantee above max", "guarantees above capacity"]))
    def set_bad_quotas(self, namespace, over):
        """Quotas the store cannot keep are refused; the old ones stay."""
        bad = (
            {namespace: Quota(max_host_pages=1, guaranteed_host_pages=2)} if over == "guarantee above max"
            else {ns: Quota(guaranteed_disk_pages=DISK_PAGES) for ns in NAMESPACES}
        )
        self.refused(lambda: self.store.set_quotas(bad), ValueError)

    def end(self, lease_id: int) -> None:
        session = self.leases.pop(lease_id)[0]
        self.ended.append((lease_id, session))

    # -- after every step -----------------------------------------------------
    @invariant()
    def invariants_hold(self):
        if self.pool is None:
            return
        self.settle()
        check(self.pool)
        check_quotas_kept(self.store)
        assert set(self.store.leases) == set(self.leases)

    @invariant()
    def hard_pinned_host_copies_stay(self):
        """No pressure evicts a hard-pinned host copy: one that was in host at the last step
        and is still hard-pinned is still there."""
        if self.pool is None:
            return
        blocks, hints = self.store.blocks, self.store.control.hints
        for ref in self.pinned_host:
            if hints.rank(ref) is Rank.HARD_PIN:
                assert Tier.HOST in blocks[ref].copies, f"hard-pinned {ref} left host"
        self.pinned_host = {ref for ref, h in hints.hints.items() if h.rank is Rank.HARD_PIN and Tier.HOST in blocks[ref].copies}

    @invariant()
    def read_leases_see_committed_bytes(self):
        if self.pool is None:
            return
        self.settle()
        for lease_id, (_, _, kind, slots, refs) in self.leases.items():
            for slot, ref in zip(slots, refs):
                assert self.store.blocks[ref].copies[Tier.HOST].slot == slot
                assert read_page(self.pool, slot) == self.content[ref], f"lease {lease_id} reads wrong bytes for {ref}"

    @invariant()
    def cached_pages_hold_committed_bytes(self):
        if self.pool is None:
            return
        self.settle()
        buf = aligned_buffer(LAYOUT.slot_bytes)
        try:
            for ref, block in self.store.blocks.items():
                host = block.copies.get(Tier.HOST)
                if host is not None:
                    assert read_page(self.pool, host.slot) == self.content[ref], f"host copy of {ref} changed"
                disk = block.copies.get(Tier.DISK)
                if disk is not None and (ref[0], ref[1], disk.record.seq) not in self.corrupt:
                    view = memoryview(buf)
                    assert self.pool.disk.read_page(disk.record, view), f"disk copy of {ref} fails its checks"
                    assert view[: LAYOUT.page_bytes] == self.content[ref], f"disk copy of {ref} changed"
                    view.release()
        finally:
            buf.close()


StoreMachine.TestCase.settings = settings(
    max_examples=200,  # with 16 KiB pages (zstd's chunk counts vary) about 18 s on 2 quiet cores
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# A loaded machine can take several times that: the suite's 300 s per test would cut it short.
TestStoreMachine = pytest.mark.timeout(900)(StoreMachine.TestCase)
