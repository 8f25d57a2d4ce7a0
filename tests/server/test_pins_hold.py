"""Hard pins hold what they pin, before and after any restart (kvtier.core.pin_loads): real
daemons, a real tokens file giving the pinning namespace its guaranteed host pages, real
disk tiers and hints files, warm restarts through the real arena keeper. No client reads
a pinned block after a restart: whatever brings it into host is the daemon's own doing.

Each test floods host from the pinning namespace itself (whose own requests may evict any
of its pages but a hard-pinned one) and from another tenant, then checks where the pinned
blocks are. Why these cannot be flaky: every wait has a deadline (the sweep runs once a
second; the waits allow ten), and every check is exact.
"""
from __future__ import annotations

import json
import signal
import textwrap
import uuid

from kvtier_client.proto.v1 import kvtier_pb2 as pb
from rpc import free_port, keys, pool_stats, scrape, tier_stats, value, wait_for

from kvtier.admin import render_stats

PINS = "token-pins-6c1e9a7b3d5f2a48"
FLOOD = "token-flood-0d8b6f4a2c9e7b15"
ADMIN = "token-admin-4e2a8c6b0d9f1a37"
HOST_SIZE, DISK_SIZE = "256KiB", "2MiB"  # 64 host pages, 512 disk pages
PINNED = 8


def start(daemons, tmp_path, guarantee: int, *args: str):
    """A daemon (the same socket and cache directory every time) where namespace "pins" has
    `guarantee` guaranteed host pages."""
    tokens = tmp_path / f"tokens-{guarantee}.toml"
    tokens.write_text(textwrap.dedent(f"""
        [tokens]
        "{PINS}" = ["pins"]
        "{FLOOD}" = ["flood"]
        "{ADMIN}" = ["*"]

        [namespaces.pins]
        guaranteed_host_pages = {guarantee}
    """))
    return daemons.start("--tokens-file", str(tokens), *args, name="d", host_size=HOST_SIZE, disk_size=DISK_SIZE)


def steer(session, ks: list[bytes], action: int, **fields) -> pb.SteerResponse:
    return session.call("Steer", pb.SteerRequest(session_id=session.id, keys=ks, action=action, **fields))


def pin_hard(session, ks: list[bytes]) -> pb.SteerResponse:
    return steer(session, ks, pb.STEER_ACTION_PIN, pin_mode=pb.PIN_MODE_HARD, ttl_seconds=600)


def pins_stats(admin, pool: str) -> pb.NamespaceStats:
    return next(ns for ns in pool_stats(admin.state(), pool).namespaces if ns.namespace == "pins")


def pinned_in_host(admin, pool: str, n: int) -> pb.HintStats:
    """Wait until n of the namespace's hard-pinned blocks are in host; their stats."""
    def settled():
        hints = pins_stats(admin, pool).hints
        return hints if hints.hard_in_host == n and not hints.hard_loading else None
    return wait_for(settled, 10, f"{n} hard-pinned blocks in host")


def flood(pins, other, admin, pool: str) -> None:
    """Commit twice the host's pages of fresh blocks, half from the pinning namespace itself;
    check the flood really evicted."""
    host = tier_stats(admin.state(), pool).capacity_pages
    tag = uuid.uuid4().hex[:6]
    for i in range(host // 8):
        pins.put(keys(f"own-{tag}-{i}", 8))
        other.put(keys(f"flood-{tag}-{i}", 8))
    assert tier_stats(admin.state(), pool).evictions >= host


def tiers(session, ks: list[bytes]) -> list[int]:
    reply = session.lookup(ks)
    assert reply.hit_blocks == len(ks)
    return list(reply.tiers)


def test_a_cold_restart_loads_the_hard_pinned_blocks_into_host_and_a_flood_keeps_them(daemons, connect, tmp_path):
    first = start(daemons, tmp_path, PINNED)
    pinned = keys("cold", PINNED)
    pins = connect(first.target, token=PINS).session("pins")
    pins.put(pinned)
    assert pin_hard(pins, pinned).applied == PINNED
    assert first.stop(signal.SIGTERM) == 0  # a clean stop: pages to disk, the hints file written

    port = free_port()
    again = start(daemons, tmp_path, PINNED, "--metrics-port", str(port))
    admin = connect(again.target, token=ADMIN)
    pins = connect(again.target, token=PINS).session("pins")  # opens the layout's pool; reads nothing
    pool = pins.reply.pool_id
    hints = pinned_in_host(admin, pool, PINNED)
    assert (hints.hard_pinned, hints.hard_pin_limit, hints.hard_waiting) == (PINNED, PINNED, 0)
    _, families = scrape(port)
    labels = {"pool": pool, "kvtier_namespace": "pins"}
    assert [value(families, "kvtier_hard_pinned_pages", **labels, state=s) for s in ("in_host", "loading", "waiting")] \
        == [PINNED, 0, 0]

    flood(pins, connect(again.target, token=FLOOD).session("flood"), admin, pool)
    assert tiers(pins, pinned) == [pb.TIER_HOST] * PINNED
    assert pins_stats(admin, pool).hints.hard_in_host == PINNED


def test_a_warm_restart_keeps_the_pinned_host_pages_and_loads_the_pins_that_had_no_room(daemons, connect, tmp_path):
    prefix = f"kvtier-test-pins-{uuid.uuid4().hex[:6]}"
    first = start(daemons, tmp_path, PINNED, "--arena-prefix", prefix)
    first.arena_prefix = prefix  # so that teardown removes what the kill leaves
    pinned = keys("warm", PINNED)
    pins = connect(first.target, token=PINS).session("pins")
    pool = pins.reply.pool_id
    admin = connect(first.target, token=ADMIN)
    pins.put(pinned)
    assert steer(pins, pinned[-2:], pb.STEER_ACTION_DEMOTE, tier=pb.TIER_DISK).applied == 2
    other = connect(first.target, token=FLOOD).session("flood")
    other.borrow(tier_stats(admin.state(), pool).free_pages)  # every free host page, written to, never committed
    assert pin_hard(pins, pinned).applied == PINNED
    hints = pins_stats(admin, pool).hints
    assert (hints.hard_in_host, hints.hard_loading, hints.hard_waiting) == (PINNED - 2, 0, 2)  # no room for 2

    hints_file = first.cache_dir / pool / "hints.json"
    wait_for(lambda: hints_file.exists() and len(json.loads(hints_file.read_text())["hints"]) == PINNED, 10,
             "the pins in the hints file")
    first.stop(signal.SIGKILL)

    again = start(daemons, tmp_path, PINNED, "--arena-prefix", prefix)
    again.arena_prefix = prefix
    admin = connect(again.target, token=ADMIN)
    hints = pinned_in_host(admin, pool, PINNED)  # the adopted 6, and the 2 loaded now that there is room
    assert (hints.hard_pinned, hints.hard_waiting) == (PINNED, 0)
    pins = connect(again.target, token=PINS).session("pins")
    flood(pins, connect(again.target, token=FLOOD).session("flood"), admin, pool)
    assert tiers(pins, pinned) == [pb.TIER_HOST] * PINNED


def test_a_restart_with_a_lower_guarantee_loads_and_holds_only_what_it_allows(daemons, connect, tmp_path):
    first = start(daemons, tmp_path, PINNED)
    pinned = keys("lowered", PINNED)
    pins = connect(first.target, token=PINS).session("pins")
    pins.put(pinned)
    assert pin_hard(pins, pinned).applied == PINNED
    assert first.stop(signal.SIGTERM) == 0

    again = start(daemons, tmp_path, PINNED // 2)  # the operator lowered the guarantee meanwhile
    admin = connect(again.target, token=ADMIN)
    pins = connect(again.target, token=PINS).session("pins")
    pool = pins.reply.pool_id
    hints = pinned_in_host(admin, pool, PINNED // 2)
    assert (hints.hard_pinned, hints.soft_pinned, hints.hard_pin_limit, hints.hard_waiting) == (4, 4, 4, 0)
    flood(pins, connect(again.target, token=FLOOD).session("flood"), admin, pool)
    # The 4 still hard-pinned are in host; the 4 turned soft were never loaded.
    assert sorted(tiers(pins, pinned)) == [pb.TIER_HOST] * 4 + [pb.TIER_DISK] * 4
    assert pins_stats(admin, pool).hints.hard_in_host == 4


def test_a_pin_on_disk_only_blocks_while_host_is_full_loads_them_once_room_appears(daemons, connect, tmp_path):
    port = free_port()
    d = start(daemons, tmp_path, PINNED, "--metrics-port", str(port))
    admin = connect(d.target, token=ADMIN)
    pins = connect(d.target, token=PINS).session("pins")
    pool = pins.reply.pool_id
    pinned = keys("full", 4)
    pins.put(pinned)
    assert steer(pins, pinned, pb.STEER_ACTION_DEMOTE, tier=pb.TIER_DISK).applied == 4
    other = connect(d.target, token=FLOOD).session("flood")
    lease = other.borrow(tier_stats(admin.state(), pool).free_pages)  # host full of a write lease
    assert pin_hard(pins, pinned).applied == 4
    hints = pins_stats(admin, pool).hints
    assert (hints.hard_pinned, hints.hard_in_host, hints.hard_loading, hints.hard_waiting) == (4, 0, 0, 4)
    _, families = scrape(port)
    assert value(families, "kvtier_hard_pinned_pages", pool=pool, kvtier_namespace="pins", state="waiting") == 4
    row = next(line.split() for line in render_stats(admin.state()).splitlines() if line.split()[:2] == ["pins", "4"])
    assert row[-2:] == ["0", "0/4"], row  # `kvtier stats`: hard in host, hard loading/waiting

    other.release(lease.lease_id)  # room: the next sweep loads them, with no client asking
    hints = pinned_in_host(admin, pool, 4)
    assert hints.hard_waiting == 0
    flood(pins, other, admin, pool)
    assert tiers(pins, pinned) == [pb.TIER_HOST] * 4
